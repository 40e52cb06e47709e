"""Every grouped-GEMM backend against the float32 reference at model sizes.

Per (weight, tokens): top-k routing of random logits, then ``lax.ragged_dot``,
``wt.ragged_dot`` (tables / heuristic policy), the fixed default config and
each Triton config of ``--triton``; prints the relative RMS and max errors
against ``lax.ragged_dot`` on float32 inputs. A GPU check of what the CPU
tests run in interpret mode at small sizes.

    python3 benchmarks/ragged_dot_accuracy.py [--weights mixtral_8x7b.w13 ...]
        [--tokens 1000 2048 4096]
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np

import wavetune_jax as wt
from wavetune_jax import RAGGED_DOT, RaggedDotProblem
from wavetune_jax.families.ragged_dot import routing
from wavetune_jax.shapes import load_suite


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--weights", nargs="+", default=["mixtral_8x7b.w13", "mixtral_8x7b.w2"])
  ap.add_argument("--tokens", type=int, nargs="+", default=[1000, 2048, 4096])
  a = ap.parse_args(argv)
  from wavetune_jax.families.ragged_dot.triton import TritonRaggedDotConfig
  weights = load_suite("train")["grouped_gemm"]["weights"]
  print(f"{jax.devices()[0].device_kind}")
  print(f"{'weight':<20} {'tokens':>6} {'op':<34} {'rel RMS':>9} {'rel max':>9}")
  for name in a.weights:
    w = weights[name]
    for t in a.tokens:
      p = RaggedDotProblem(m=t * w["top_k"], g=w["E"], k=w["K"], n=w["N"])
      k0, k1, k2 = jax.random.split(jax.random.PRNGKey(t), 3)
      sizes = routing.group_sizes(k0, p.m, p.g)
      lhs = jax.random.normal(k1, (p.m, p.k), jnp.bfloat16)
      rhs = (jax.random.normal(k2, (p.g, p.k, p.n), jnp.float32) / p.k ** 0.5).astype(jnp.bfloat16)
      ref = np.asarray(jax.jit(lambda x, y, s: jax.lax.ragged_dot(
          x.astype(jnp.float32), y.astype(jnp.float32), s))(lhs, rhs, sizes))
      ops = {"lax.ragged_dot": jax.jit(jax.lax.ragged_dot)}
      for pol in ("tables", "heuristic"):
        def f(x, y, s, pol=pol):
          with wt.policy(pol):
            return wt.ragged_dot(x, y, s)
        ops[f"wt.ragged_dot ({pol})"] = jax.jit(f)
      for c in (RAGGED_DOT.default(p), TritonRaggedDotConfig(block_m=16),
                TritonRaggedDotConfig(block_m=128, num_warps=8)):
        ops[f"triton {c.block_m}x{c.block_n}x{c.block_k}"] = jax.jit(
            lambda x, y, s, c=c: wt.ragged_dot(x, y, s, config=c))
      for label, fn in ops.items():
        out = np.asarray(fn(lhs, rhs, sizes), np.float32)
        err = out - ref
        rms = float(np.sqrt(np.mean(err ** 2) / np.mean(ref ** 2)))
        mx = float(np.max(np.abs(err)) / np.max(np.abs(ref)))
        print(f"{name:<20} {t:>6} {label:<34} {rms:9.2e} {mx:9.2e}", flush=True)


if __name__ == "__main__":
  main()
