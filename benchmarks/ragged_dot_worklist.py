"""What the grouped GEMM's work list costs, built two ways, alone and in
``wt.ragged_dot``.

The work list (:mod:`pallas_kernels.ragged_dot.worklist`) is built from the
group sizes on the device by small XLA ops before each grouped GEMM: the
family's clip of the sizes, then the row tasks. It is built with running
sums as masked reductions and each task's group values as one telescoping
reduction (``masked``, the library's); ``scan`` is the way it was built
before (``cumsum`` and ``searchsorted`` with gathers, kept here to compare).
Per problem, on one GPU, CUPTI, L2 flushed:

* each way alone (the clip and the row tasks of the shipped rule's tile):
  its kernels, their summed time, and a check that both give the same list;
* ``wt.ragged_dot`` (policy ``tables``) with each way: the op's time, the
  main kernel's, and what the rest took.

    python3 benchmarks/ragged_dot_worklist.py [--json out.json]   # GPU
    python3 benchmarks/ragged_dot_worklist.py --summarize out.json  # CPU
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
from pallas_kernels._integers import INT32_MAX, clipped_int32
from pallas_kernels.ragged_dot import mosaic as kernel
from pallas_kernels.ragged_dot import worklist
from pallas_kernels.ragged_dot.reference import ragged_dot_reference
from wavetune_jax.families.ragged_dot import family as rd_family
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


def _scan_bounds(sizes, m):
  ends = jnp.minimum(jnp.cumsum(sizes, dtype=jnp.int32), m)
  if sizes.shape[0] * m > INT32_MAX:
    ends = jax.lax.associative_scan(lambda a, b: jnp.minimum(a, m - b) + b, sizes)
  return ends


def scan_clip_sizes(group_sizes, m):
  """The clip as built before (a cumsum, then its differences)."""
  sizes = clipped_int32(group_sizes, m, name="group_sizes")
  if sizes.ndim != 1 or sizes.shape[0] < 2:
    return sizes
  return jnp.diff(_scan_bounds(sizes, m), prepend=jnp.zeros((1,), jnp.int32))


def scan_row_tasks(group_sizes, m, block_m, align=worklist.ALIGN, band_cap=0):
  """The row tasks as built before: cumsums, ``searchsorted`` and gathers."""
  g = group_sizes.shape[0]
  t = worklist.max_tasks(m, g, block_m, align)
  ends = _scan_bounds(clipped_int32(group_sizes, m, name="group_sizes"), m)
  zero = jnp.zeros((1,), jnp.int32)
  starts = jnp.concatenate([zero, ends[:-1], ends[-1:]])
  ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
  first = (starts // align) * align
  ntiles = jnp.where(ends > starts, (ends - first + block_m - 1) // block_m, 0)
  cum = jnp.cumsum(ntiles)
  count = cum[-1:]
  tid = jnp.arange(t, dtype=jnp.int32)
  grp = jnp.minimum(jnp.searchsorted(cum, tid, side="right", method="compare_all"),
                    g).astype(jnp.int32)
  row0 = first[grp] + (tid - (cum[grp] - ntiles[grp])) * block_m
  lo = jnp.maximum(starts[grp], row0)
  hi = jnp.minimum(ends[grp], row0 + block_m)
  used = tid < count[0]
  size = jnp.where(used, jnp.maximum(hi - lo, 0), 0)
  start = jnp.where(used, lo - row0, 0)
  row0 = jnp.where(used, row0, 0)
  rows = [grp, row0, start, size]
  if band_cap:
    n_g = ntiles[grp]
    first_task = cum[grp] - n_g
    bands = (n_g + band_cap - 1) // band_cap
    width = (n_g + jnp.maximum(bands, 1) - 1) // jnp.maximum(bands, 1)
    b0 = first_task + ((tid - first_task) // jnp.maximum(width, 1)) * width
    bw = jnp.minimum(width, first_task + n_g - b0)
    rows += [jnp.where(used, b0, tid), jnp.where(used, bw, 1)]
  return jnp.stack(rows).astype(jnp.int32), count.astype(jnp.int32)


@contextlib.contextmanager
def scan_worklist():
  """Runs ``wt.ragged_dot`` with the work list built the way before."""
  saved = (worklist.row_tasks, worklist.clip_sizes, rd_family.clip_sizes)
  worklist.row_tasks, worklist.clip_sizes, rd_family.clip_sizes = (
      scan_row_tasks, scan_clip_sizes, scan_clip_sizes)
  jax.clear_caches()
  try:
    yield
  finally:
    worklist.row_tasks, worklist.clip_sizes, rd_family.clip_sizes = saved
    jax.clear_caches()


def _routing(g, m, seed=0):
  """Sizes from a random top-k-like router: ``m`` rows over ``g`` experts."""
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.multinomial(m, np.ones(g) / g), jnp.int32)


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--iterations", type=int, default=20)
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
  for g, m, k, n, label in PROBLEMS:
    sizes = _routing(g, m)
    with wt.policy("tables"):
      cfg = wt.select("ragged_dot", wt.RaggedDotProblem(m=m, g=g, k=k, n=n), hw).config
    row = {"g": g, "m": m, "k": k, "n": n, "label": label, "config": repr(cfg)}
    bm = getattr(cfg, "block_m", 128)
    cap = kernel.band_cap(bm, k, 2) if getattr(cfg, "grid_minor", 0) == 2 else 0
    lists = {}
    for way, clip, tasks in (("scan", scan_clip_sizes, scan_row_tasks),
                             ("masked", worklist.clip_sizes, worklist.row_tasks)):
      fn = lambda s, clip=clip, tasks=tasks: tasks(clip(s, m), m, bm, band_cap=cap)  # noqa: E731
      lists[way] = jax.tree.map(np.asarray, jax.jit(fn)(sizes))
      bd = prof.kernel_breakdown(fn, (sizes,))
      row[f"list_{way}"] = {"kernels": len(bd), "us": sum(us for _, us in bd), "breakdown": bd}
    row["same_list"] = all(np.array_equal(x, y) for x, y in zip(lists["scan"], lists["masked"]))
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    lhs = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    rhs = (jax.random.normal(kw, (g, k, n), jnp.float32) / math.sqrt(k)).astype(jnp.bfloat16)
    op = lambda x, w, s: wt.ragged_dot(x, w, s, config=cfg)  # noqa: E731
    ref = ragged_dot_reference(lhs, rhs, sizes, jnp.float32)
    for way in ("scan", "masked"):
      with scan_worklist() if way == "scan" else contextlib.nullcontext():
        res = prof.measure_many([op], (lhs, rhs, sizes), reference=ref, tolerance=2e-2)[0]
        bd = prof.kernel_breakdown(op, (lhs, rhs, sizes))
      main_us = max((us for _, us in bd), default=math.nan)
      row[f"op_{way}"] = {"us": res.median_us if res.status == "ok" else math.nan, "status": res.status,
                          "main_us": main_us, "rest_us": sum(us for _, us in bd) - main_us,
                          "kernels": len(bd)}
    out["rows"].append(row)
    _print_row(row)
    if a.json:
      with open(a.json, "w") as f:
        json.dump(out, f, indent=1)


def _print_row(r):
  s, w = r["list_scan"], r["list_masked"]
  os_, ow = r["op_scan"], r["op_masked"]
  print(f"{r['label']:32s} G={r['g']:3d} M={r['m']:6d} K={r['k']:5d} N={r['n']:5d} | list "
        f"scan {s['kernels']} kernels {s['us']:5.1f} us, masked {w['kernels']} kernels "
        f"{w['us']:5.1f} us, same={r['same_list']} | op scan {os_['us']:8.1f} us, masked "
        f"{ow['us']:8.1f} us ({os_['us'] / ow['us']:.3f}x); main kernel {ow['main_us']:.1f}",
        flush=True)


def summarize(out):
  print(out["device_kind"], out["jax"])
  for r in out["rows"]:
    _print_row(r)
  ratios = [r["op_scan"]["us"] / r["op_masked"]["us"] for r in out["rows"]
            if r["op_masked"]["us"] == r["op_masked"]["us"]]
  if ratios:
    print(f"op with the masked work list over the scan one: geomean "
          f"{math.exp(np.mean(np.log(ratios))):.3f}x ({min(ratios):.3f}-{max(ratios):.3f}x) "
          f"over {len(ratios)}")


if __name__ == "__main__":
  main()
