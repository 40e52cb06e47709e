"""What the grouped GEMM's work list costs, built each way, alone and in the op.

The op is ``wt.ragged_dot``.

The work list (:mod:`pallas_kernels.ragged_dot.worklist`) is built from the
group sizes on the device by small XLA ops before each grouped GEMM: the
row tasks, which saturate the sizes' running sum themselves (the op clips
each size in front of them, an elementwise op; this script still times
``clip_sizes`` in front, as the op ran when these lists were measured). Its running sums are masked
reductions or ``cumsum``s, and each task reads its group's values by one
telescoping reduction or by ``searchsorted`` and gathers (the module's
``MASKED_SUMS_FROM`` and ``TELESCOPED_FROM`` pick by the number of groups):
``scan`` is cumsums and searches (how it was built first), ``masked`` both
reductions, ``masked sums`` and ``telescoped`` one of each. Per problem, on
one GPU, CUPTI, L2 flushed:

* each way alone (the clip and the row tasks of the shipped rule's tile):
  its kernels, their summed time, and a check that every way gives the same
  list;
* ``wt.ragged_dot`` (policy ``tables``) built ``scan`` and ``masked``: the
  op's time (checked against the float32 reference), the main kernel's,
  and what the rest took. ``--lists-only``: the lists alone, every way, on
  4 to 256 experts.

    python3 benchmarks/ragged_dot_worklist.py [--lists-only] [--json out.json]   # GPU
    python3 benchmarks/ragged_dot_worklist.py --summarize out.json               # CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math

import jax
import jax.numpy as jnp
import numpy as np

import wavetune_jax as wt
from pallas_kernels.ragged_dot import mosaic as kernel
from pallas_kernels.ragged_dot import worklist
from pallas_kernels.ragged_dot.reference import ragged_dot_reference
from wavetune_jax.tuning import profiler

# (experts, total rows, K, N, label): decode steps (16 or 64 tokens x top-k
# over the experts) and prefill, OLMoE-, Qwen3-30B-A3B-, Mixtral- and
# DeepSeek-shaped.
PROBLEMS = [
    (64, 128, 2048, 2048, "OLMoE w13, 16 tokens"),
    (64, 128, 1024, 2048, "OLMoE w2, 16 tokens"),
    (128, 128, 2048, 1536, "Qwen3-30B-A3B w13, 16 tokens"),
    (128, 512, 768, 2048, "Qwen3-30B-A3B w2, 64 tokens"),
    (8, 32, 4096, 28672, "Mixtral w13, 16 tokens"),
    (256, 512, 2048, 1024, "256 experts, 64 tokens"),
    (64, 8192, 1024, 2048, "OLMoE w2, 1,024 tokens"),
    (128, 24576, 2048, 1536, "128 x 192 rows"),
    (64, 24000, 3584, 5120, "64 x 375 rows"),
]


#: Ways of building the list: (MASKED_SUMS_FROM, TELESCOPED_FROM) of
#: :mod:`pallas_kernels.ragged_dot.worklist` (0: always; NEVER: never).
NEVER = 10**9
WAYS = {"scan": (NEVER, NEVER), "masked": (0, 0), "masked sums": (0, NEVER),
        "telescoped": (NEVER, 0)}


@contextlib.contextmanager
def way(name: str):
  """Builds the work list one way (module thresholds, caches cleared)."""
  saved = (worklist.MASKED_SUMS_FROM, worklist.TELESCOPED_FROM)
  worklist.MASKED_SUMS_FROM, worklist.TELESCOPED_FROM = WAYS[name]
  jax.clear_caches()
  try:
    yield
  finally:
    worklist.MASKED_SUMS_FROM, worklist.TELESCOPED_FROM = saved
    jax.clear_caches()


def _routing(g, m, seed=0):
  """Sizes from a random top-k-like router: ``m`` rows over ``g`` experts."""
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.multinomial(m, np.ones(g) / g), jnp.int32)


#: (experts, total rows, K) of the list-only problems: 4 to 256 experts.
LIST_ONLY = [(4, 32, 4096), (8, 32, 4096), (8, 4096, 4096), (16, 64, 2048), (16, 4096, 6144),
             (32, 128, 2880), (64, 128, 2048), (128, 512, 768), (256, 512, 2048)]


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--iterations", type=int, default=20)
  ap.add_argument("--lists-only", action="store_true",
                  help="time the lists alone, every way, on 4 to 256 experts")
  ap.add_argument("--json", default=None)
  ap.add_argument("--summarize", metavar="JSON", help="print a run's table (CPU)")
  a = ap.parse_args()
  if a.summarize:
    with open(a.summarize) as f:
      summarize(json.load(f))
    return
  dev = jax.devices()[0]
  hw = wt.detect()
  prof = profiler.Profiler(iterations=a.iterations)
  out = {"device_kind": dev.device_kind, "jax": jax.__version__, "rows": []}
  print(dev.device_kind, jax.__version__, flush=True)
  problems = ([(g, m, k, 4096, f"{g} experts, {m} rows") for g, m, k in LIST_ONLY]
              if a.lists_only else PROBLEMS)
  ways = tuple(WAYS) if a.lists_only else ("scan", "masked")
  for g, m, k, n, label in problems:
    sizes = _routing(g, m)
    with wt.policy("tables"):
      cfg = wt.select("ragged_dot", wt.RaggedDotProblem(m=m, g=g, k=k, n=n), hw).config
    row = {"g": g, "m": m, "k": k, "n": n, "label": label, "config": repr(cfg)}
    bm = getattr(cfg, "block_m", 128)
    cap = kernel.band_cap(bm, k, 2) if getattr(cfg, "grid_minor", 0) == 2 else 0
    lists = []
    for name in ways:
      with way(name):
        fn = lambda s: worklist.row_tasks(worklist.clip_sizes(s, m), m, bm,  # noqa: E731
                                          band_cap=cap)
        lists.append(jax.tree.map(np.asarray, jax.jit(fn)(sizes)))
        bd = prof.kernel_breakdown(fn, (sizes,))
      row[f"list_{name}"] = {"kernels": len(bd), "us": sum(us for _, us in bd),
                             "breakdown": bd}
    row["same_list"] = all(np.array_equal(x, y) for other in lists[1:]
                           for x, y in zip(lists[0], other))
    if not a.lists_only:
      kx, kw = jax.random.split(jax.random.PRNGKey(0))
      lhs = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
      rhs = (jax.random.normal(kw, (g, k, n), jnp.float32) / math.sqrt(k)).astype(jnp.bfloat16)
      op = lambda x, w, s: wt.ragged_dot(x, w, s, config=cfg)  # noqa: E731
      ref = ragged_dot_reference(lhs, rhs, sizes, jnp.float32)
      for name in ways:
        with way(name):
          res = prof.measure_many([op], (lhs, rhs, sizes), reference=ref, tolerance=2e-2)[0]
          bd = prof.kernel_breakdown(op, (lhs, rhs, sizes))
        main_us = max((us for _, us in bd), default=math.nan)
        row[f"op_{name}"] = {"us": res.median_us if res.status == "ok" else math.nan,
                             "status": res.status, "main_us": main_us,
                             "rest_us": sum(us for _, us in bd) - main_us, "kernels": len(bd)}
    out["rows"].append(row)
    _print_row(row)
    if a.json:
      with open(a.json, "w") as f:
        json.dump(out, f, indent=1)


def _print_row(r):
  lists = ", ".join(f"{name} {r[f'list_{name}']['kernels']} kernels "
                    f"{r[f'list_{name}']['us']:5.1f} us" for name in WAYS if f"list_{name}" in r)
  line = (f"{r['label']:32s} G={r['g']:3d} M={r['m']:6d} K={r['k']:5d} | {lists}, "
          f"same={r['same_list']}")
  if "op_masked" in r:
    os_, ow = r["op_scan"], r["op_masked"]
    line += (f" | op scan {os_['us']:8.1f} us, masked {ow['us']:8.1f} us "
             f"({os_['us'] / ow['us']:.3f}x); main kernel {ow['main_us']:.1f}")
  print(line, flush=True)


def summarize(out):
  print(out["device_kind"], out["jax"])
  for r in out["rows"]:
    _print_row(r)
  ratios = [r["op_scan"]["us"] / r["op_masked"]["us"] for r in out["rows"]
            if "op_masked" in r and r["op_masked"]["us"] == r["op_masked"]["us"]]
  if ratios:
    print(f"op with the masked work list over the scan one: geomean "
          f"{math.exp(np.mean(np.log(ratios))):.3f}x ({min(ratios):.3f}-{max(ratios):.3f}x) "
          f"over {len(ratios)}")


if __name__ == "__main__":
  main()
