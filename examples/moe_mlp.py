"""A mixture-of-experts MLP in plain JAX with ``wt.ragged_dot`` or ``lax.ragged_dot``.

router top-k -> sort the (token, expert) pairs by expert -> w13 (fused
gate/up) -> SiLU(gate) * up -> w2 -> unsort -> weighted sum over the k
experts of each token. The two expert GEMMs are the only difference between
the two versions. On a GPU the script times both (CUPTI, whole jitted layer);
with ``--small`` (for a CPU) it runs a tiny layer and checks that the two
agree (without it a CPU runs the full-sized layer, slowly).

    python3 examples/moe_mlp.py [--model mixtral_8x7b] [--tokens 1024 8192]
    python3 examples/moe_mlp.py --small          # CPU: tiny layer, both versions
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

import wavetune_jax as wt
from wavetune_jax.models import moe_mlp  # the MLP itself: router, sort, w13, SwiGLU, w2

# hidden, intermediate, experts, top_k (public configs).
MODELS = {"mixtral_8x7b": (4096, 14336, 8, 2), "olmoe_1b_7b": (2048, 1024, 64, 8),
          "dbrx": (6144, 10752, 16, 4), "snowflake_arctic": (7168, 4864, 128, 2),
          "small": (64, 128, 4, 2)}


def init(key, hidden, inter, experts, dtype=jnp.bfloat16):
  kr, k13, k2 = jax.random.split(key, 3)
  return {
      "router": jax.random.normal(kr, (hidden, experts), jnp.float32) / hidden ** 0.5,
      "w13": (jax.random.normal(k13, (experts, hidden, 2 * inter), jnp.float32)
              / hidden ** 0.5).astype(dtype),
      "w2": (jax.random.normal(k2, (experts, inter, hidden), jnp.float32)
             / inter ** 0.5).astype(dtype),
  }


GEMMS = {"wt": wt.ragged_dot, "xla": jax.lax.ragged_dot}
SMALL_CONFIG = {"backend": "triton", "block_m": 16, "block_n": 64, "block_k": 32,
                "num_warps": 4, "num_stages": 3}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", choices=sorted(MODELS), default="mixtral_8x7b")
  ap.add_argument("--tokens", type=int, nargs="+", default=[1024])
  ap.add_argument("--small", action="store_true", help="a tiny layer (CPU)")
  a = ap.parse_args(argv)
  model = "small" if a.small else a.model
  hidden, inter, experts, top_k = MODELS[model]
  params = init(jax.random.PRNGKey(0), hidden, inter, experts)
  on_gpu = jax.devices()[0].platform == "gpu"
  for tokens in ([16] if a.small else a.tokens):
    x = jax.random.normal(jax.random.PRNGKey(tokens), (tokens, hidden), jnp.bfloat16)
    fns = {name: jax.jit(functools.partial(moe_mlp, top_k=top_k, gemm=g))
           for name, g in GEMMS.items()}
    if a.small:  # the Triton kernel in interpret mode, pinned, against XLA
      with wt.use_config("ragged_dot", SMALL_CONFIG):
        outs = {"wt": fns["wt"](params, x)}
      outs["xla"] = fns["xla"](params, x)
    else:
      outs = {name: f(params, x) for name, f in fns.items()}
    err = float(jnp.max(jnp.abs(outs["wt"].astype(jnp.float32) - outs["xla"].astype(jnp.float32)))
                / (jnp.max(jnp.abs(outs["xla"].astype(jnp.float32))) + 1e-6))
    line = f"{model} tokens={tokens}: max |wt - xla| / max |xla| = {err:.2e}"
    if on_gpu and not a.small:
      from wavetune_jax.tuning.profiler import Profiler
      leaves, tree = jax.tree_util.tree_flatten(params)
      flat = [lambda *a, f=f: f(jax.tree_util.tree_unflatten(tree, a[:-1]), a[-1])
              for f in fns.values()]
      res = Profiler(iterations=10).measure_many(flat, (*leaves, x))
      times = {name: r.median_us for name, r in zip(fns, res)}
      line += (f"; layer: wt {times['wt']:.1f} us, lax.ragged_dot {times['xla']:.1f} us, "
               f"{times['xla'] / times['wt']:.2f}x")
    print(line, flush=True)
    if err > 5e-2:
      raise SystemExit(f"the two versions differ: {err:.3g}")


if __name__ == "__main__":
  main()
