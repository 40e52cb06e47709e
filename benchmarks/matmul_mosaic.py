"""The three GEMM backends side by side on one GPU: Mosaic (its space), Triton
(its pruned space, or its heuristic with ``--triton heuristic``) and XLA.

Every config is checked against the float32 reference before it is timed
(CUPTI, L2 flushed, same process). Prints, per problem, the best time of each
backend, its ratio to XLA (x > 1: faster than XLA), the best Mosaic config,
TFLOP/s, and at the end the geomean per M bucket; ``--json`` writes every
measurement.

    python3 benchmarks/matmul_mosaic.py [--set suite|heldout|peak|quick]
        [--full] [--triton space|heuristic|none] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax

from wavetune_jax import MATMUL, MatmulProblem
from wavetune_jax.core import hardware
from wavetune_jax.tuning import evaluate, profiler

# Llama-3-8B, Llama-3-70B (TP8), and the sizes M of the training suite that
# bracket the buckets; "heldout": projections of models outside the suite.
SUITE_W = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1280, 8192),
           (8192, 1024), (7168, 8192), (8192, 3584)]
SUITE_M = [1, 16, 64, 128, 256, 512, 1000, 2048, 4096, 8192]
HELDOUT = [(m, n, k) for n, k in [(5120, 4096), (13824, 5120), (5120, 13824), (2048, 2048)]
           for m in (8, 96, 400, 1536, 3000, 12000)]
PEAK = [(8192, 8192, 8192), (4096, 28672, 4096)]
QUICK = [(128, 6144, 4096), (512, 28672, 4096), (2048, 4096, 14336), (8192, 8192, 8192),
         (64, 4096, 14336), (1000, 7168, 8192), (16, 1280, 8192), (4, 4096, 4096)]
BUCKETS = ((1, 16), (17, 128), (129, 512), (513, 2048), (2049, 1 << 40))
#: Dense bf16 tensor-core peaks (NVIDIA data sheets, SXM).
PEAK_TFLOPS = {"h100": 989.0, "h200": 989.0}


def problems(which: str) -> list[tuple[int, int, int]]:
  if which == "suite":
    return [(m, n, k) for n, k in SUITE_W for m in SUITE_M]
  return {"heldout": HELDOUT, "peak": PEAK, "quick": QUICK}[which]


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--set", choices=("suite", "heldout", "peak", "quick"), default="quick")
  ap.add_argument("--full", action="store_true", help="Mosaic's unpruned space")
  ap.add_argument("--triton", choices=("space", "heuristic", "none"), default="heuristic")
  ap.add_argument("--iterations", type=int, default=20)
  ap.add_argument("--json", default=None)
  a = ap.parse_args()
  dev = jax.devices()[0]
  print(dev.device_kind, jax.__version__, flush=True)
  hw = hardware.detect()
  prof = profiler.Profiler(iterations=a.iterations)
  mosaic, triton, xla = (MATMUL.backend(n) for n in ("mosaic", "triton", "xla"))
  rows, ratios = [], {"mosaic": [], "triton": [], "pallas": []}
  by_bucket: dict = {}
  print(f"{'problem':<22}{'xla us':>9}{'mosaic':>9}{'triton':>9}{'mos/xla':>9}"
        f"{'tri/xla':>9}  best mosaic config (TFLOP/s)  [ok/wrong/failed]", flush=True)
  t_start = time.time()
  for m, n, k in problems(a.set):
    p = MatmulProblem(m=m, n=n, k=k, dtype="bfloat16")
    args = MATMUL.inputs(p, jax.random.PRNGKey(0))
    ref = MATMUL.reference(p, *args)
    cands = list(mosaic.space(p, hw, prune=not a.full))
    if a.triton == "space":
      cands += list(triton.space(p, hw))
    elif a.triton == "heuristic":
      cands.append(triton.heuristic(p, hw))
    cands.append(xla.space(p, hw)[0])
    fns = [MATMUL.build(p, c) for c in cands]
    res = prof.measure_many(fns, args, reference=ref, tolerance=MATMUL.tolerance(p),
                            out_bytes=ref.size * 4)
    best: dict = {}
    counts = {"ok": 0, "wrong": 0, "failed": 0}
    first_err = None
    for c, r in zip(cands, res):
      name = MATMUL.backend_of(c).name
      rows.append({"m": m, "n": n, "k": k, "config": MATMUL.config_to_dict(c),
                   "status": r.status, "us": r.median_us if r.status == "ok" else None,
                   "rel_error": r.rel_error, "error": (r.error or "")[:300]})
      if name == "mosaic":
        key = "ok" if r.status == "ok" else ("wrong" if r.status == "wrong" else "failed")
        counts[key] += 1
        if r.status != "ok" and first_err is None:
          first_err = f"{c}: {r.status} {r.rel_error} {(r.error or '')[:300]}"
      if r.status == "ok" and (name not in best or r.median_us < best[name][0]):
        best[name] = (r.median_us, c)
    x = best.get("xla", (math.nan,))[0]
    tm = best.get("mosaic", (math.nan, None))
    tt = best.get("triton", (math.nan, None))
    fmt = lambda v: f"{v:9.1f}" if v == v else f"{'-':>9}"  # noqa: E731
    rm, rt = x / tm[0], x / tt[0]
    for key, v in (("mosaic", rm), ("triton", rt), ("pallas", max(rm, rt))):
      if v == v:
        ratios[key].append(v)
    if max(rm, rt) == max(rm, rt):
      bucket = next(b for b in BUCKETS if b[0] <= m <= b[1])
      by_bucket.setdefault(bucket, []).append(max(rm, rt))
    tf = 2 * m * n * k / (tm[0] * 1e-6) / 1e12 if tm[0] == tm[0] else math.nan
    cfg = tm[1]
    cs = (f"{cfg.block_m}x{cfg.block_n} s{cfg.num_stages} k{cfg.split_k} "
          f"o{cfg.grid_minor}/{cfg.grid_width}" if cfg is not None else "-")
    print(f"{m:>6}x{n:>6}x{k:>6}  {fmt(x)}{fmt(tm[0])}{fmt(tt[0])}{rm:9.3f}{rt:9.3f}  "
          f"{cs} ({tf:.0f})  [{counts['ok']}/{counts['wrong']}/{counts['failed']}]",
          flush=True)
    if first_err:
      print(f"    first failure: {first_err}", flush=True)
  print(f"elapsed {time.time() - t_start:.0f} s")
  for key, r in ratios.items():
    if r:
      print(f"geomean {key} vs XLA: {evaluate._geomean(r):.3f}x over {len(r)} problems "
            f"(min {min(r):.3f})")
  for b in BUCKETS:
    if b in by_bucket:
      print(f"  M in [{b[0]}, {min(b[1], 99999)}]: best Pallas vs XLA "
            f"{evaluate._geomean(by_bucket[b]):.3f}x over {len(by_bucket[b])}")
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"device_kind": dev.device_kind, "jax": jax.__version__, "rows": rows}, f)


if __name__ == "__main__":
  main()
