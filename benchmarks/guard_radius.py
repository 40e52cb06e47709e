"""How near must evidence be? The guard's rule chosen from held-out replays.

For every recorded sweep (both GPUs, four families) and several held-out
splits (``wavetune eval``'s protocol: whole weights and whole sizes held out),
the wavetune policy is fitted on the training split, and each test problem's
answer is put through the guard under every rule of a grid (weight radius,
size radius, win ratio: ``wavetune_jax.runtime.guard.Rule``). Printed per
rule, over all splits: the problems below 0.97x the platform op, the
geomean over the platform op, and the same without a guard. A rule is safe
when no held-out problem of any family falls below 0.97x; the default is the
safe rule with the highest geomean. Also prints recall@k of the wave model
and the refinement replay with the default rule. CPU only, about a minute.

    python3 benchmarks/guard_radius.py [--seeds 0 1 2 3 4] [--budget-fraction 0.03]
        [--top-k 3] [--drop-stage-variants] [--skip-confident RATIO] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import itertools
import json
import math
import os
import random
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from wavetune_jax.runtime import guard  # noqa: E402
from wavetune_jax.tuning import evaluate  # noqa: E402

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                    "sweeps")
FAMILIES = ("matmul", "attention", "decode", "ragged_dot")
DEVICES = ("nvidia_h100_80gb_hbm3", "nvidia_h200")
GRID = [guard.Rule(weight_radius=w, size_radius=s, win=v, stale_win=v)
        for w, s, v in itertools.product((0.5, 1.0, 2.0, math.inf), (0.5, 1.0, 2.0, math.inf),
                                         (0.97, 1.0, 1.03))]


def _geo(xs):
  return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _without_micro_variants(candidates):
  """``refine.candidates`` less the wave model's and the neighbours' configs
  whose backend and macro fields (tile, split) an earlier candidate has."""
  from wavetune_jax.runtime import refine

  def wrapped(spec, problem, hw, decider, base, *, k=None):
    k = refine.top_k(spec) if k is None else k
    out = candidates(spec, problem, hw, decider, base, k=k)
    fixed = set(candidates(spec, problem, hw, decider, base, k=0))
    keep, seen = [], set()
    for c in out:
      b = spec.backend_of(c)
      macro = (b.name,) + tuple(getattr(c, f, None) for f in b.macro_fields)
      if c in fixed or macro not in seen:
        keep.append(c)
        seen.add(macro)
    return keep
  return wrapped


def _predictions(decider, problem) -> dict:
  """The wave model's predicted us for each config of ``problem``'s space
  (trusted predictions, else its extrapolations; configs it cannot predict
  left out)."""
  import numpy as np
  spec = decider.spec
  size = np.array([spec.size_of(problem)])
  configs, valid, g, l, aux = spec.decision_arrays(problem, size, decider.hw)
  out = {}
  for trusted in (True, False):
    if not configs:
      break
    pred = np.where(valid, decider.table.predict_arrays(configs, g, l, aux, trusted=trusted),
                    np.inf)[0]
    for c, t in zip(configs, pred):
      if np.isfinite(t) and c not in out:
        out[c] = float(t)
  return out


def _skipping_confident(candidates, ratio: float):
  """``refine.candidates`` that measures nothing (the table's answer stands)
  where the wave model predicts the table's answer faster than every other
  candidate by ``ratio`` or more, each of them predicted."""
  def wrapped(spec, problem, hw, decider, base, *, k=None):
    out = candidates(spec, problem, hw, decider, base, k=k)
    if decider is None or base is None or len(out) < 2:
      return out
    pred = _predictions(decider, problem)
    others = [c for c in out if c != base]
    skip = base in pred and all(c in pred and pred[c] >= ratio * pred[base] for c in others)
    SKIPPED[spec.name].append(skip)
    return [base] if skip else out
  return wrapped


SKIPPED = collections.defaultdict(list)   # family -> [skipped?] per replayed first use


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
  ap.add_argument("--families", default=",".join(FAMILIES))
  ap.add_argument("--budget-fraction", type=float, default=evaluate.DEFAULT_BUDGET_FRACTION,
                  help="profiling budget of the tables, a fraction of the training sweep")
  ap.add_argument("--top-k", type=int, default=None,
                  help="the wave model's candidates refinement measures (default: the "
                       "library's)")
  ap.add_argument("--drop-stage-variants", action="store_true",
                  help="replay refinement without the model's candidates that differ from an "
                       "earlier candidate only in micro fields (stages, order): each is one "
                       "more kernel to compile at first use")
  ap.add_argument("--skip-confident", type=float, default=None, metavar="RATIO",
                  help="replay refinement measuring nothing where the wave model predicts "
                       "the table's answer at least RATIO times faster than every other "
                       "candidate (an experiment; not the library's)")
  ap.add_argument("--json", default=None)
  a = ap.parse_args(argv)
  if a.skip_confident is not None and a.skip_confident < 1:
    ap.error("--skip-confident must be >= 1")
  fams = a.families.split(",")
  from wavetune_jax.runtime import refine
  original = refine.candidates
  if a.drop_stage_variants:
    refine.candidates = _without_micro_variants(original)
  if a.skip_confident is not None:
    refine.candidates = _skipping_confident(refine.candidates, a.skip_confident)
  SKIPPED.clear()
  try:
    return _replay(a, fams)
  finally:
    refine.candidates = original


def _replay(a, fams) -> int:
  per_rule = collections.defaultdict(lambda: collections.defaultdict(list))
  none = collections.defaultdict(list)
  recall = collections.defaultdict(list)
  refined = collections.defaultdict(list)
  for dev, fam in itertools.product(DEVICES, fams):
    path = os.path.join(ROOT, dev, f"{fam}_bfloat16.jsonl.gz")
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      ds = evaluate.load_dataset(path)
    for seed in a.seeds:
      train, test = evaluate.split(ds, seed=seed)
      pol = evaluate.WaveTunePolicy(guard=None, top_k=a.top_k)
      budget = max(1, round(a.budget_fraction *
                            sum(len(ds.times[p]) for p in train)))
      pol.fit(ds, train, budget, random.Random(seed))
      raw = {p: pol.unguarded(p) for p in test}
      plat = {p: evaluate.platform_time(ds, p) for p in test}
      test = [p for p in test if plat[p] is not None]
      for p in test:
        t = ds.times[p].get(raw[p], max(ds.times[p].values()))
        none[fam].append(plat[p] / t)
      for rule in GRID:
        ev = guard.Evidence(ds.family, ds.hw, pol.table.evidence, rule=rule)
        for p in test:
          c = raw[p] if ev.allows(p, raw[p])[0] else ds.family.platform_config(p, ds.hw)
          t = ds.times[p].get(c, max(ds.times[p].values()))
          per_rule[rule][fam].append(plat[p] / t)
      pol.guard = "default"
      pol.evidence = guard.Evidence(ds.family, ds.hw, pol.table.evidence)
      r, ref = evaluate._ranking_scores(ds, pol, test)
      recall[(dev, fam)].append(r)
      refined[(dev, fam)].append(ref)
  print(f"{'rule (weight r, size r, win)':<30}" + "".join(f"{f[:9]:>20}" for f in fams)
        + f"{'all <0.97':>11}{'geomean':>9}")
  print(f"{'no guard':<30}" + "".join(
      f"{sum(x < 0.97 for x in none[f]):>5} {_geo(none[f]):6.3f} {min(none[f]):6.3f}"
      for f in fams) + f"{sum(x < 0.97 for f in fams for x in none[f]):>11}"
      f"{_geo([x for f in fams for x in none[f]]):9.3f}")
  rows = []
  for rule in GRID:
    d = per_rule[rule]
    bad = sum(x < 0.97 for f in fams for x in d[f])
    geo = _geo([x for f in fams for x in d[f]])
    rows.append((rule, bad, geo))
    print(f"{rule.weight_radius:>7} {rule.size_radius:>7} {rule.win:>7}      " + "".join(
        f"{sum(x < 0.97 for x in d[f]):>5} {_geo(d[f]):6.3f} {min(d[f]):6.3f}" for f in fams)
        + f"{bad:>11}{geo:9.3f}")
  print("\nper family, the safe rule (no held-out problem below 0.97x) with the highest "
        "geomean, and the family's rule:")
  from wavetune_jax.core.registry import get_family
  for f in fams:
    safe = [(r, _geo(per_rule[r][f]), min(per_rule[r][f])) for r in GRID
            if all(x >= 0.97 for x in per_rule[r][f])]
    best = max(safe, key=lambda t: t[1]) if safe else None
    mine = guard.rule_of(get_family(f))
    mine_t = next(((g, m) for r, g, m in safe if (r.weight_radius, r.size_radius, r.win)
                   == (mine.weight_radius, mine.size_radius, mine.win)), None)
    print(f"  {f:<11} best {best[0] if best else None} geomean "
          f"{best[1] if best else float('nan'):.3f}; family rule "
          f"({mine.weight_radius}, {mine.size_radius}, {mine.win}): "
          + (f"safe, geomean {mine_t[0]:.3f}, min {mine_t[1]:.3f}" if mine_t else
             "NOT safe or not in the grid"))
  k = a.top_k if a.top_k is not None else "each family's (refine.top_k)"
  print("\nrecall@k of the wave model (min over seeds) and refinement replayed (k="
        f"{k}, each family's rule; budget "
        f"{a.budget_fraction:g} of the training sweep):")
  print(f"{'sweep':<36}" + "".join(f"{'r@' + str(k):>7}" for k in evaluate.RECALL_K)
        + f"{'eff':>7}{'vs plat':>8}{'min':>7}{'<0.97':>6}{'cands':>6}")
  for (dev, fam), rs in recall.items():
    ref = refined[(dev, fam)]
    print(f"{dev + ' ' + fam:<36}" + "".join(
        f"{min(r[k] for r in rs):7.2f}" for k in evaluate.RECALL_K)
        + f"{_geo([x['geomean'] for x in ref]):7.3f}"
        f"{_geo([x['vs_platform_geomean'] for x in ref]):8.3f}"
        f"{min(x['vs_platform_min'] for x in ref):7.3f}"
        f"{sum(x['below_097'] for x in ref):6d}{sum(x['candidates'] for x in ref) / len(ref):6.1f}")
  if a.skip_confident is not None:
    print(f"\nfirst uses that measured nothing (--skip-confident {a.skip_confident:g}): " +
          ", ".join(f"{f} {sum(v)} of {len(v)}" for f, v in sorted(SKIPPED.items())))
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"rules": [{"rule": vars(r), "below_097": b, "geomean": g,
                            "per_family": {f: {"below_097": sum(x < 0.97 for x in per_rule[r][f]),
                                               "geomean": _geo(per_rule[r][f]),
                                               "min": min(per_rule[r][f])} for f in fams}}
                           for r, b, g in rows],
                 "recall": {f"{d} {f}": v for (d, f), v in recall.items()},
                 "refined": {f"{d} {f}": v for (d, f), v in refined.items()}}, f, indent=1)
  return 0


if __name__ == "__main__":
  sys.exit(main())
