"""Fit error of the wave model forms on a recorded exhaustive sweep (CPU).

For every config with enough points in the sweep: the occupancy is chosen from
the data (1 .. the analytic bound), then each model form is fitted
(a) on all the config's points (in-sample) and (b) on the training split of
the held-out protocol of ``wavetune eval``, scored on the held-out problems.
Prints median and p90 |relative error| of predicted vs measured latency.

Then the ceiling of each form as a selector: the table's variant models
(``tuning.fit_entries``, split-K folded in) fitted on every point of the
sweep, the argmin of their predictions taken for every problem (no exact
entries, no distance penalty), scored against the oracle. This is what
WaveTune would reach if every point were an anchor; the gap to the held-out
numbers of ``wavetune eval`` is the price of sparse anchors.

  python3 benchmarks/wave_model_fit.py data/sweeps/nvidia_h200/matmul_bfloat16.jsonl.gz
"""

from __future__ import annotations

import argparse
import collections

import numpy as np

from wavetune_jax.runtime import tables, wave_model
from wavetune_jax.tuning import evaluate
from wavetune_jax.tuning import tuner as tuning


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("sweep")
  ap.add_argument("--min-points", type=int, default=20)
  ap.add_argument("--seed", type=int, default=0)
  a = ap.parse_args(argv)
  ds = evaluate.load_dataset(a.sweep)
  spec, hw = ds.family, ds.hw
  train, test = evaluate.split(ds, seed=a.seed)
  train = set(train)
  pts = collections.defaultdict(list)
  for p, ts in ds.times.items():
    for c, t in ts.items():
      g, l = spec.coords(p, c)
      pts[c].append((p, g, l, t))
  configs = [c for c, v in pts.items() if len(v) >= a.min_points]
  print(f"{ds.header['device_kind']}: {len(configs)} configs with >= {a.min_points} "
        f"points ({sum(len(pts[c]) for c in configs)} points)")
  print(f"{'form':<10} {'in-sample med':>14} {'p90':>7} {'held-out med':>13} {'p90':>7} "
        f"{'occupancy found (count)':>26}")
  for form in wave_model.FORMS:
    ins, outs, occs = [], [], collections.Counter()
    for c in configs:
      p0 = pts[c][0][0]
      bound = spec.occupancy_bound(p0, c, hw)
      _, g, l, t = map(np.array, zip(*pts[c]))
      occ, res = wave_model.fit_occupancy(g, l, t, num_sms=hw.num_sms, bound=bound,
                                          form=form)
      occs[occ] += 1
      ins.extend(wave_model.rel_errors(
          wave_model.predict(res.coef, g, l, occ * hw.num_sms, form), t))
      tr = np.array([q in train for q, *_ in pts[c]])
      n_coef = wave_model.N_COEF[form]
      if tr.sum() >= n_coef + 2 and (~tr).any():
        occ_tr, res_tr = wave_model.fit_occupancy(g[tr], l[tr], t[tr], num_sms=hw.num_sms,
                                                  bound=bound, form=form)
        outs.extend(wave_model.rel_errors(wave_model.predict(
            res_tr.coef, g[~tr], l[~tr], occ_tr * hw.num_sms, form), t[~tr]))
    print(f"{form:<10} {100 * np.median(ins):>13.1f}% {100 * np.percentile(ins, 90):>6.1f}% "
          f"{100 * np.median(outs):>12.1f}% {100 * np.percentile(outs, 90):>6.1f}% "
          f"{str(dict(sorted(occs.items()))):>26}")

  print(f"\nselector ceiling: variant models fitted on all {len(ds.times)} problems' points, "
        "argmin per problem")
  print(f"{'form':<10} {'geomean':>8} {'min':>6} {'p10':>6} {'<=5% miss':>10}")
  points = [(p, c, t) for p, ts in ds.times.items() for c, t in ts.items()]
  for form in wave_model.FORMS:
    table = tables.Table(family=spec, device_kind=hw.name, device_key=hw.device_key,
                         num_sms=hw.num_sms, form=form,
                         entries=tuning.fit_entries(spec, hw, points, form=form), exact={},
                         anchors=[], provenance={}, distance_penalty=0.0)
    eff = []
    for p, ts in ds.times.items():
      configs = list(ts)
      pick = configs[int(np.argmin(table.predict(p, configs, trusted=False)))]
      eff.append(min(ts.values()) / ts[pick])
    eff = np.array(eff)
    print(f"{form:<10} {np.exp(np.mean(np.log(eff))):>8.3f} {eff.min():>6.3f} "
          f"{np.percentile(eff, 10):>6.3f} {100 * np.mean(eff >= 0.95):>9.0f}%")


if __name__ == "__main__":
  main()
