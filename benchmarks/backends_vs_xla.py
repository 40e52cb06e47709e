"""Best config of each GEMM backend vs XLA, per M bucket, from sweep files (CPU).

For every problem of a sweep file that has rows of the ``xla`` backend: the
best Mosaic config against that ``xla`` row (same run), the best Triton
config against the file's baseline row (the run that measured Triton), and
the better of the two ("best Pallas"). Prints the geomeans per M bucket and
the problems where best Pallas is below 0.95x XLA.

    python3 benchmarks/backends_vs_xla.py data/sweeps/nvidia_h100_80gb_hbm3/matmul_bfloat16.jsonl.gz \
        data/sweeps/nvidia_h200/matmul_bfloat16.jsonl.gz
"""

from __future__ import annotations

import argparse
import collections

from wavetune_jax import MATMUL
from wavetune_jax.tuning import evaluate, sweep

BUCKETS = ((1, 16), (17, 128), (129, 512), (513, 2048), (2049, 1 << 40))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("sweeps", nargs="+", help="GEMM sweep files with xla rows")
  a = ap.parse_args(argv)
  for path in a.sweeps:
    header, rows = sweep.read_sweep(path, strict=True)
    best: dict = collections.defaultdict(dict)
    base = {}
    for r in rows:
      if r.get("status") != "ok":
        continue
      p = MATMUL.problem_from_dict(r["problem"])
      if r["impl"] == "baseline":
        base[p] = r["median_us"]
      elif r["impl"] == "pallas":
        b = MATMUL.backend_of(MATMUL.config_from_dict(r["config"])).name
        best[p][b] = min(best[p].get(b, float("inf")), r["median_us"])
    ratio = {"mosaic": [], "triton": [], "pallas": [], "of the three (XLA included)": []}
    by_bucket = collections.defaultdict(list)
    low = []
    for p in sorted(best, key=lambda p: (p.n, p.k, p.m)):
      t = best[p]
      if "xla" not in t:
        continue
      rm = t["xla"] / t["mosaic"] if "mosaic" in t else 0.0
      rt = base[p] / t["triton"] if "triton" in t and p in base else 0.0
      pallas = max(rm, rt)
      for k, v in (("mosaic", rm), ("triton", rt), ("pallas", pallas),
                   ("of the three (XLA included)", max(1.0, pallas))):
        if v:
          ratio[k].append(v)
      by_bucket[next(b for b in BUCKETS if b[0] <= p.m <= b[1])].append(pallas)
      if pallas < 0.95:
        low.append(f"{MATMUL.problem_key(p)} {pallas:.3f}x")
    print(f"{header['device_kind']}: {len(ratio['pallas'])} problems with xla rows ({path})")
    for k, v in ratio.items():
      print(f"  best {k} vs XLA: {evaluate._geomean(v):.3f}x (min {min(v):.3f}) over {len(v)}")
    for b in BUCKETS:
      if by_bucket[b]:
        print(f"  M {b[0]}-{min(b[1], 10**6)}: best Pallas {evaluate._geomean(by_bucket[b]):.3f}x "
              f"over {len(by_bucket[b])}")
    print(f"  below 0.95x: {len(low)}: " + ", ".join(low))


if __name__ == "__main__":
  main()
