"""How well one GPU's best configs serve another GPU (CPU, recorded sweeps).

On the problems both sweeps hold: how often the two oracles agree, the
efficiency on GPU B of GPU A's oracle config, and each oracle's geomean speed
against its own platform baseline.

  python3 benchmarks/cross_gpu.py data/sweeps/nvidia_h100_80gb_hbm3/matmul_bfloat16.jsonl.gz \\
      data/sweeps/nvidia_h200/matmul_bfloat16.jsonl.gz
"""

from __future__ import annotations

import argparse
import math

from wavetune_jax.tuning import evaluate


def _geo(xs):
  return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("sweep_a")
  ap.add_argument("sweep_b")
  a = ap.parse_args(argv)
  da, db = evaluate.load_dataset(a.sweep_a), evaluate.load_dataset(a.sweep_b)
  if da.family.name != db.family.name:
    raise SystemExit(f"{a.sweep_a} is {da.family.name}, {a.sweep_b} is {db.family.name}")
  common = [p for p in da.problems if p in db.times]
  if not common:
    raise SystemExit("the two sweeps share no problem")
  same, eff_ab, eff_ba = 0, [], []
  for p in common:
    ta, tb = da.times[p], db.times[p]
    oa, ob = min(ta, key=ta.get), min(tb, key=tb.get)
    same += oa == ob
    if oa in tb:
      eff_ab.append(tb[ob] / tb[oa])
    if ob in ta:
      eff_ba.append(ta[oa] / ta[ob])
  name = da.family.baseline_name
  print(f"{len(common)} {da.family.name} problems in both: A = {da.hw.name}, B = {db.hw.name}")
  print(f"same oracle config: {same} of {len(common)}")
  print(f"A's oracle config on B: efficiency {_geo(eff_ab):.3f} geomean, {min(eff_ab):.3f} min "
        f"({len(eff_ab)} problems where B measured it)")
  print(f"B's oracle config on A: efficiency {_geo(eff_ba):.3f} geomean, {min(eff_ba):.3f} min "
        f"({len(eff_ba)} problems where A measured it)")
  for d in (da, db):
    r = [d.baseline[p] / min(d.times[p].values()) for p in common if p in d.baseline]
    print(f"{d.hw.name}: oracle vs {name} {_geo(r):.3f}x ({len(r)} problems)")


if __name__ == "__main__":
  main()
