"""Why the wavetune policy misses the oracle on held-out shapes (CPU replay).

Runs the tuner as ``wavetune eval`` does (training split, 3% budget) and
prints: anchors per variant model, the share of held-out problems whose
oracle config was outside its model's trust region (the selector could not
consider it), and the worst held-out problems with the chosen config's
predicted and measured time next to the oracle's.

  python3 benchmarks/wavetune_misses.py data/sweeps/nvidia_h200/matmul_bfloat16.jsonl.gz --seed 4
"""

from __future__ import annotations

import argparse
import collections
import math
import random

import numpy as np

from wavetune_jax.tuning import evaluate
from wavetune_jax.tuning import tuner as tuning


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("sweep")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--worst", type=int, default=8)
  a = ap.parse_args(argv)
  ds = evaluate.load_dataset(a.sweep)
  spec = ds.family
  train, test = evaluate.split(ds, seed=a.seed)
  policy = evaluate.make_policy("wavetune")
  budget = max(1, round(tuning.DEFAULT_BUDGET_FRACTION * sum(len(ds.times[p]) for p in train)))
  # The same random stream as ``evaluate.evaluate`` gives the policy.
  policy.fit(ds, train, budget, random.Random(a.seed))
  table = policy.table
  per = collections.Counter(e.points for e in table.entries.values())
  print(f"{ds.header['device_kind']}, seed {a.seed}: {len(train)} training / {len(test)} "
        f"held-out problems; {len(table.anchors)} anchors, {len(table.entries)} variant "
        f"models, {len(table.exact)} exact entries")
  print("anchors per variant model (anchors: models): "
        + ", ".join(f"{k}: {v}" for k, v in sorted(per.items())))
  rows, outside = [], 0
  for p in test:
    ts = ds.times[p]
    best = min(ts, key=ts.get)
    chosen = policy.select(p)
    pred_c, pred_b = table.predict(p, [chosen, best])
    outside += not np.isfinite(pred_b)
    rows.append((ts[best] / ts[chosen], p, pred_c, ts[chosen], pred_b, ts[best]))
  eff = np.array([r[0] for r in rows])
  print(f"held-out efficiency: geomean {math.exp(np.log(eff).mean()):.3f}, min {eff.min():.3f}")
  print(f"held-out problems whose oracle config is outside its model's trust region "
        f"(or has no model): {outside} of {len(test)}")
  print(f"\n{'problem':<34} {'eff':>6} {'chosen pred/meas us':>21} {'oracle pred/meas us':>21}")
  for e, p, pc, tc, pb, tb in sorted(rows, key=lambda r: r[0])[:a.worst]:
    print(f"{spec.problem_key(p):<34} {e:>6.3f} {pc:>10.1f}/{tc:<10.1f} {pb:>10.1f}/{tb:<10.1f}")


if __name__ == "__main__":
  main()
