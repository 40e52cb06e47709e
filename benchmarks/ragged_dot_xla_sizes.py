"""What the op's handling of the group sizes costs in front of XLA's ragged dot.

``wt.ragged_dot`` clips each group size to ``[0, M]`` before any backend
runs; in front of XLA's dense ragged dot (a GPU with a cuDNN older than
9.22) that elementwise clip is all (it once also saturated the running sum
at ``M``, a few small XLA ops). Where the selector keeps XLA's ragged dot
(few experts at decode sizes) it runs on every call. Per problem, on one
GPU (CUPTI, L2 flushed, each output checked against the float32 reference
on a balanced router's sizes):

* ``lax``: ``lax.ragged_dot`` on the sizes as given (what a user writes);
* ``op``: ``wt.ragged_dot`` with XLA's config pinned (the op as it runs);
* ``clip``: ``lax.ragged_dot`` on ``jnp.clip(sizes, 0, M)`` alone.

Then, per problem, the op on sizes a router never gives (negative ones,
sums past ``M``, one group of all the rows and more), each backend pinned
(XLA's ragged dot and the Mosaic kernel's rule), against the reference on
the clipped sizes: the op's semantics hold on the GPU with nothing in front
of XLA's dense ragged dot.

    python3 benchmarks/ragged_dot_xla_sizes.py [--problems G,M,K,N ...] [--json out.json]
"""

from __future__ import annotations

import argparse
import json

import jax
import jax.numpy as jnp

import wavetune_jax as wt
from wavetune_jax import RAGGED_DOT, RaggedDotProblem
from wavetune_jax.cli.common import positive_ints
from wavetune_jax.tuning import profiler

# (experts, rows, K, N): decode steps of 8- and 16-expert models, where the
# tables keep XLA's ragged dot (JetMoE-8B at 12 tokens, Mixtral-8x7B and
# Phi-3.5-MoE at 16).
PROBLEMS = [(8, 24, 5632, 2048), (8, 24, 2048, 11264), (8, 32, 14336, 4096),
            (16, 32, 4096, 12800)]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--problems", nargs="+", type=positive_ints("G,M,K,N"), metavar="G,M,K,N",
                  default=None, help="experts, rows, K, N (default: four decode steps)")
  ap.add_argument("--iterations", type=int, default=20)
  ap.add_argument("--json", default=None)
  a = ap.parse_args(argv)
  if a.iterations < 1:
    ap.error("--iterations must be >= 1")
  print(jax.devices()[0].device_kind, jax.__version__)
  prof = profiler.Profiler(iterations=a.iterations)
  xla = wt.XlaRaggedDotConfig()
  rows = []
  print(f"{'G x M, K, N':<26}{'lax us':>9}{'op us':>9}{'clip us':>9}{'lax/op':>8}{'lax/clip':>9}")
  for g, m, k, n in a.problems or PROBLEMS:
    p = RaggedDotProblem(m=m, g=g, k=k, n=n)
    args = RAGGED_DOT.inputs(p, jax.random.PRNGKey(0))
    ref = RAGGED_DOT.reference(p, *args)
    fns = [lambda x, w, s: jax.lax.ragged_dot(x, w, s),
           lambda x, w, s: wt.ragged_dot(x, w, s, config=xla),
           lambda x, w, s, m=m: jax.lax.ragged_dot(x, w, jnp.clip(s, 0, m))]
    res = prof.measure_many(fns, args, reference=ref, tolerance=RAGGED_DOT.tolerance(p),
                            out_bytes=ref.size * 4)
    us = [r.median_us if r.status == "ok" else float("nan") for r in res]
    bad = " ".join(f"{i}:{r.status}" for i, r in enumerate(res) if r.status != "ok")
    print(f"{f'{g} x {m}, {k}, {n}':<26}{us[0]:9.1f}{us[1]:9.1f}{us[2]:9.1f}"
          f"{us[0] / us[1]:8.3f}{us[0] / us[2]:9.3f}  {bad}", flush=True)
    rows.append({"problem": [g, m, k, n], "us": dict(zip(("lax", "op", "clip"), us))})
  checks = check_sizes(a.problems or PROBLEMS)
  if a.json:
    from wavetune_jax.core import versions
    from wavetune_jax.families.ragged_dot import xla as xla_backend
    with open(a.json, "w") as f:
      json.dump({"device_kind": jax.devices()[0].device_kind, "versions": versions.current(),
                 # True: the op put no running sum in front of XLA's ragged dot
                 "elementwise_clip_only": xla_backend.cudnn_below(
                     xla_backend.CUDNN_GROUPED_GEMM) is True,
                 "rows": rows, "checks": checks}, f, indent=1)
  return 0 if all(c["ok"] for c in checks) else 1


def odd_sizes(g: int, m: int) -> dict:
  """Sizes a router never gives, by name (int32 ``[g]``)."""
  ramp = [(-1) ** i * (m // 2 + i) for i in range(g)]
  return {"negative and past M": ramp,
          "each M": [m] * g,
          "past M in the middle": [m // 3] * (g // 2) + [m] + [1] * (g - g // 2 - 1),
          "one short, then past": [m - 1, -m] + [m] * (g - 2)}


def check_sizes(problems, backends=None) -> list[dict]:
  """The op (XLA's config and the Mosaic rule's, pinned; on a GPU those it
  has) on :func:`odd_sizes` against the float32 reference on the clipped
  sizes."""
  if backends is None:
    has = {b.name for b in RAGGED_DOT.available(wt.detect())}
    backends = [b for b in ("xla", "mosaic") if b in has]
  out = []
  print(f"\n{'G x M, K, N':<26}{'sizes':<24}{'backend':<9}{'rel err':>10}{'tol':>9}")
  for g, m, k, n in problems:
    p = RaggedDotProblem(m=m, g=g, k=k, n=n)
    x, w, _ = RAGGED_DOT.inputs(p, jax.random.PRNGKey(1))
    tol = RAGGED_DOT.tolerance(p)
    for name, sizes in odd_sizes(g, m).items():
      sizes = jnp.asarray(sizes, jnp.int32)
      ref = RAGGED_DOT.reference(p, x, w, sizes)
      for backend in backends:
        try:
          y = jax.jit(lambda x, w, s, b=backend: wt.ragged_dot(x, w, s, config={"backend": b}))(
              x, w, sizes)
          err = profiler.rel_error(y, ref)
        except Exception as e:  # noqa: BLE001 - reported, the run goes on
          print(f"{f'{g} x {m}, {k}, {n}':<26}{name:<24}{backend:<9} failed: {e}"[:200])
          out.append({"problem": [g, m, k, n], "sizes": name, "backend": backend, "ok": False,
                      "error": str(e)[:500]})
          continue
        ok = err <= tol
        print(f"{f'{g} x {m}, {k}, {n}':<26}{name:<24}{backend:<9}{err:10.2e}{tol:9.1e}"
              f"{'' if ok else '  WRONG'}", flush=True)
        out.append({"problem": [g, m, k, n], "sizes": name, "backend": backend, "ok": ok,
                    "rel_err": err})
  return out


if __name__ == "__main__":
  raise SystemExit(main())
