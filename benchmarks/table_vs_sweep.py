"""How good are a table's choices on the problems of an exhaustive sweep? (CPU)

For every problem of the sweep: the config the selector picks with the table
(exact -> model -> heuristic), its measured time, the oracle's, XLA's.
Prints geomean and minimum efficiency (t_oracle / t_chosen), the share within
5%, where the answers came from, and the speed vs XLA and vs the fixed default.
Unlike ``wavetune eval`` this is not held out: the table's anchors may come
from these very problems (the shipped table is tuned on the whole suite).

  python3 benchmarks/table_vs_sweep.py data/sweeps/nvidia_h200/matmul_bfloat16.jsonl.gz \
      tables/nvidia_h200/matmul.json
"""

from __future__ import annotations

import argparse
import collections
import math

import numpy as np

from wavetune_jax.cli import eval as eval_cli
from wavetune_jax.runtime import selector, tables
from wavetune_jax.tuning import evaluate, sweep


def _geo(xs):
  return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("sweep")
  ap.add_argument("table", nargs="?", help="a table file (not with --heuristic)")
  ap.add_argument("--heuristic", action="store_true",
                  help="score the family's heuristic (no table) instead")
  ap.add_argument("--min-size", type=int, default=None,
                  help="also print the speed over problems of at least this size")
  ap.add_argument("--min-tokens", type=int, default=None,
                  help="grouped GEMM: also print the speed over problems of at least this "
                       "many tokens (rows / top_k of the suite's weight), overall and per model")
  ap.add_argument("--below", type=float, default=None, metavar="X",
                  help="also list each problem where the chosen config runs below X times "
                       "the baseline (e.g. 1.0), with the oracle's speed and the config")
  ap.add_argument("--vs-batched", action="store_true",
                  help="grouped GEMM: speed against the sweep's batched-GEMM bound (and the "
                       "faster of it and lax.ragged_dot, what a well-built grouped GEMM "
                       "gets) by rows per expert, and each problem of >= 128 rows per "
                       "expert below 0.95x the batched GEMM")
  ap.add_argument("--per-problem", action="store_true",
                  help="with --vs-batched, every problem: the batched GEMM, lax.ragged_dot, "
                       "the faster of the two (what a well-built grouped GEMM gets) and the "
                       "table's choice over it")
  ap.add_argument("--trusted", action="store_true",
                  help="grouped GEMM: the Mosaic configs of the sweep where the guard trusts "
                       "the kernel without evidence, and the slowest against XLA, per region")
  ap.add_argument("--per-backend", action="store_true",
                  help="each backend's best config and its own rule on the problems without "
                       "options: share of the oracle, and where it is the oracle")
  ap.add_argument("--guarded", action="store_true",
                  help="apply the guard to each answer, as the ops do (default: the "
                       "table's or the heuristic's answer itself)")
  ap.add_argument("--without", metavar="BACKEND",
                  help="as on a JAX where this backend cannot run (e.g. triton: a JAX "
                       "without the Pallas Triton lowering); the table's configs of it are "
                       "passed over")
  eval_cli.add_margin_arg(ap)
  a = ap.parse_args(argv)
  if a.heuristic == (a.table is not None):
    ap.error("give a table, or --heuristic")
  ds = evaluate.load_dataset(a.sweep)
  if not a.without:
    return _report(a, ds)
  gone = type(ds.family.backend(a.without))  # (an unknown name is a clear error)
  runs_on = gone.runs_on
  gone.runs_on = lambda self, hw: False
  try:
    return _report(a, ds)
  finally:
    gone.runs_on = runs_on


def _report(a, ds):
  spec, hw = ds.family, ds.hw
  d = None if a.heuristic else selector.Decider(tables.load(a.table, spec, hw), hw,
                                                heuristic_margin=a.heuristic_margin)
  eff, xla, dflt, src, missing = [], [], [], collections.Counter(), 0
  chosen_us, chosen_cfg = [], []
  for p in ds.problems:
    ts = ds.times[p]
    sel = None if d is None else d.decide(p)
    if sel is not None and not spec.supports(sel.config, hw):
      sel = None  # (--without: a config of the backend that cannot run)
    if a.guarded:
      sel = selector._guarded(spec, p, hw, d, sel or selector.Selection(
          spec.heuristic(p, hw), "heuristic"))
    c = spec.heuristic(p, hw) if sel is None else sel.config
    src["heuristic" if sel is None else sel.source] += 1
    t = ts.get(c)
    if t is None:
      missing += 1
      t = max(ts.values())
    eff.append(min(ts.values()) / t)
    chosen_us.append(t)
    chosen_cfg.append(c)
    if p in ds.baseline:
      xla.append(ds.baseline[p] / t)
    if spec.default(p) in ts:
      dflt.append(ts[spec.default(p)] / t)
  n = len(eff)
  print(f"{ds.header['device_kind']}: {n} problems, "
        f"{'the heuristic' if d is None else 'table ' + a.table}")
  print(f"efficiency vs oracle: geomean {_geo(eff):.3f}, min {min(eff):.3f}, "
        f"within 5% {sum(e >= 1 / 1.05 for e in eff) / n:.2f}; not measured: {missing}")
  if a.without:
    here = [min(v for c, v in ds.times[p].items() if spec.supports(c, hw)) / t
            for p, t in zip(ds.problems, chosen_us)]
    plain = [e for p, e in zip(ds.problems, here) if getattr(p, "plain", True)]
    print(f"efficiency vs the oracle of the configs that run without {a.without}: geomean "
          f"{_geo(here):.3f}, min {min(here):.3f}; problems without options (no window, "
          f"soft cap or sinks): {_geo(plain):.3f}, min {min(plain):.3f}, {len(plain)} problems")
  g = _geo(dflt)  # (a family with no default config: no such speed)
  print(f"speed vs {spec.baseline_name} {_geo(xla):.3f}x (min {min(xla, default=math.nan):.3f}x), "
        f"vs fixed default {'-' if math.isnan(g) else f'{g:.3f}x'}")
  print(f"answered by: {dict(src)}")
  if a.per_backend:
    _per_backend(ds)
  _by_window(ds, eff, chosen_us)
  if a.min_size is not None:
    big = [ds.baseline[p] / t for p, t in zip(ds.problems, chosen_us)
           if p in ds.baseline and spec.size_of(p) >= a.min_size]
    print(f"speed vs {spec.baseline_name} at {spec.size_field} >= {a.min_size}: "
          f"{_geo(big):.3f}x over {len(big)} problems (min {min(big, default=math.nan):.3f}x)")
  if a.min_tokens is not None:
    _per_model(ds, chosen_us, a.min_tokens)
  if a.below is not None:
    low = [(ds.baseline[p] / t, p, c) for p, t, c in zip(ds.problems, chosen_us, chosen_cfg)
           if p in ds.baseline and ds.baseline[p] / t < a.below]
    print(f"problems below {a.below}x {spec.baseline_name} ({len(low)}): chosen / oracle "
          f"speed, the chosen config")
    for speed, p, c in sorted(low, key=lambda x: x[0]):
      best = ds.baseline[p] / min(ds.times[p].values())
      print(f"  {spec.problem_key(p)}  {speed:.3f}x / {best:.3f}x  {c}")
  by_size = collections.defaultdict(list)
  for p, t in zip(ds.problems, chosen_us):
    if p in ds.baseline:
      by_size[spec.size_of(p)].append((ds.baseline[p] / t,
                                       ds.baseline[p] / min(ds.times[p].values())))
  print(f"speed vs {spec.baseline_name} per {spec.size_field} (table / oracle): " + ", ".join(
      f"{s}: {_geo([a for a, _ in v]):.2f}/{_geo([b for _, b in v]):.2f}"
      for s, v in sorted(by_size.items())))
  # Extra baselines of the sweep (e.g. XLA next to cuDNN), where they ran.
  chosen = dict(zip(ds.problems, chosen_us))
  extra = collections.defaultdict(list)
  for r in sweep.read_sweep(a.sweep)[1]:
    if r["impl"].startswith("baseline_") and r["status"] == "ok":
      p = spec.problem_from_dict(r["problem"])
      if p in chosen:
        extra[r["impl"][len("baseline_"):]].append((r["median_us"] / chosen[p],
                                                    r["median_us"] / min(ds.times[p].values())))
  for name, v in sorted(extra.items()):
    print(f"speed vs {name} ({len(v)} problems where it ran): table {_geo([a for a, _ in v]):.2f}x, "
          f"oracle {_geo([b for _, b in v]):.2f}x")
  if a.per_problem and not a.vs_batched:
    raise SystemExit("table_vs_sweep.py: --per-problem goes with --vs-batched")
  if a.vs_batched:
    _vs_batched(ds, chosen, chosen_cfg, a.sweep, per_problem=a.per_problem)
  if a.trusted:
    if spec.name != "ragged_dot":
      raise SystemExit("table_vs_sweep.py: --trusted is for the ragged_dot family")
    _trusted_regions(ds)


def _per_backend(ds) -> None:
  """On the problems without options (attention and decode: no window, soft
  cap or sinks), each backend's best config and its own rule's config
  (``Backend.heuristic``, where it answers and was measured): share of the
  oracle, geomean (min), and the problems where the backend is the oracle."""
  spec, hw = ds.family, ds.hw
  best, rule, oracle = (collections.defaultdict(list) for _ in range(3))
  for p in ds.problems:
    if not getattr(p, "plain", True):
      continue
    ts = ds.times[p]
    top = min(ts.values())
    oracle[spec.backend_of(min(ts, key=ts.get)).name].append(p)
    for b in {spec.backend_of(c) for c in ts}:
      best[b.name].append(top / min(v for c, v in ts.items() if spec.backend_of(c) is b))
      r = b.heuristic(p, hw)
      if r in ts:
        rule[b.name].append(top / ts[r])
  n = sum(len(v) for v in oracle.values())
  print(f"each backend over {n} problems without options: best config / own rule, share of "
        f"the oracle geomean (min), oracle of: " + "; ".join(
            f"{k} {_geo(v):.3f} ({min(v):.3f}) / "
            + (f"{_geo(rule[k]):.3f} ({min(rule[k]):.3f})" if rule[k] else "-")
            + f", {len(oracle[k])}" for k, v in sorted(best.items())))


def _by_window(ds, eff, chosen_us) -> None:
  """Attention and decode sweeps with windows (``wavetune sweep --windows``):
  the efficiency and the speed against the baseline per window size."""
  groups = collections.defaultdict(list)
  for p, e, t in zip(ds.problems, eff, chosen_us):
    if getattr(p, "windowed", False):
      key = f"window {p.window_left + 1}" if p.window_right in (-1, 0) else str(p.window)
      groups[key].append((e, ds.baseline.get(p, math.nan) / t))
      groups["every window"].append(groups[key][-1])
    elif hasattr(p, "windowed"):
      groups["no window"].append((e, ds.baseline.get(p, math.nan) / t))
  if len(groups) < 2:
    return
  spec = ds.family
  best = collections.defaultdict(list)  # (window, backend) -> baseline / best time
  for p in ds.problems:
    if getattr(p, "windowed", False) and p in ds.baseline:
      for name in {spec.backend_of(c).name for c in ds.times[p]}:
        t = min(v for c, v in ds.times[p].items() if spec.backend_of(c).name == name)
        best[(p.window_left + 1, name)].append(ds.baseline[p] / t)
  print("by window, each backend's best config: speed vs the baseline min-max (wins): " +
        "; ".join(f"window {w} {name}: {min(v):.2f}-{max(v):.2f}x ({sum(x > 1 for x in v)} "
                  f"of {len(v)})" for (w, name), v in sorted(best.items())))
  if spec.name == "decode":
    _window_bandwidth(ds, chosen_us)
  print("by window: efficiency geomean (min); speed vs the baseline geomean (min): " + "; ".join(
      f"{k}: {_geo([e for e, _ in v]):.3f} ({min(e for e, _ in v):.3f}); "
      f"{_geo([x for _, x in v]):.2f}x ({min(x for _, x in v):.2f}x), {len(v)} problems"
      for k, v in sorted(groups.items(), key=lambda kv: (kv[0] != "no window",
                                                         len(kv[0]), kv[0]))))


def _window_bandwidth(ds, chosen_us) -> None:
  """Decode with a window: the K and V bytes of each sequence's window (its
  valid keys, at most the window's) over the chosen config's time, against
  the GPU's nominal HBM bandwidth, per window and at least 64 MB."""
  import os
  import sys

  import jax
  sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
  from decode_options import PEAK_BW
  peak = PEAK_BW.get(ds.header["device_kind"])
  if peak is None:
    return
  spec = ds.family
  groups = collections.defaultdict(list)
  for p, t in zip(ds.problems, chosen_us):
    if not p.windowed:
      continue
    lens = (np.asarray(spec.length_values(p, jax.random.PRNGKey(0))) if p.lengths
            else np.full(p.batch, p.kv_len))  # (the sweep's lengths; their order is moot)
    keys = np.minimum(lens, p.span).sum()
    nbytes = 2 * keys * p.kv_heads * p.head_dim * p.itemsize
    share = nbytes / (t * 1e-6) / peak
    groups[f"window {p.window_left + 1}"].append(share)
    if nbytes >= 64e6:
      groups[">= 64 MB"].append(share)
  print(f"HBM share on the window's bytes ({peak / 1e12:.2f} TB/s), median (max): " + "; ".join(
      f"{k}: {np.median(v):.0%} ({max(v):.0%}), {len(v)} problems"
      for k, v in sorted(groups.items(), key=lambda kv: (len(kv[0]), kv[0]))))


def _order2_over_before(ds) -> None:
  """Two changes of the Hopper rule's config, above 64 rows per expert, by
  rows per expert: order 2 (by expert) over the orders the rule used before
  (order 0 from 128 rows per expert where the weight has more than 16
  column tiles of 256, else 1), both 128 x 256 with 3 stages; and 4 stages
  (the output staged a slice at a time, RG8) over 3, both order 2."""
  from wavetune_jax import MosaicRaggedDotConfig as C

  def old_order(p, r):
    return C(block_m=128, block_n=256, num_stages=3,
             grid_minor=0 if r >= 128 and -(-p.n // 256) > 16 else 1)

  for label, old, new in (
      ("order 2 over the earlier orders (128 x 256, 3 stages)", old_order,
       lambda p, r: C(block_m=128, block_n=256, num_stages=3, grid_minor=2)),
      ("4 stages over 3 (128 x 256, order 2)",
       lambda p, r: C(block_m=128, block_n=256, num_stages=3, grid_minor=2),
       lambda p, r: C(block_m=128, block_n=256, num_stages=4, grid_minor=2))):
    by = collections.defaultdict(list)
    for p in ds.problems:
      r = p.m / min(p.g, p.m)
      t = ds.times[p]
      if r > 64 and old(p, r) in t and new(p, r) in t:
        by["65-127" if r < 128 else "128-511" if r < 512 else ">= 512"].append(
            t[old(p, r)] / t[new(p, r)])
    every = [x for v in by.values() for x in v]
    if every:
      print(f"{label}, {len(every)} problems: {_geo(every):.3f}x ({min(every):.3f}-"
            f"{max(every):.3f}); by rows per expert "
            + ", ".join(f"{k} {_geo(v):.3f}x over {len(v)}" for k, v in sorted(by.items())))


def _tile_height_by_expert(ds) -> None:
  """The Hopper rule's task height in order 2, by rows per expert: 64 x 256
  (4 stages) against 128 x 256 (the rule's stages on this GPU), each as a
  share of the best Mosaic config of the problem, and how many problems each
  is within 5% of that best."""
  from wavetune_jax import MosaicRaggedDotConfig as C
  from wavetune_jax.families.ragged_dot.mosaic import DEEPER_RING
  tall = C(block_m=128, block_n=256, grid_minor=2,
           num_stages=4 if ds.hw.device_key.startswith(DEEPER_RING) else 3)
  short = C(block_m=64, block_n=256, num_stages=4, grid_minor=2)
  for label, lo, hi in (("65-128", 64, 128), ("129-255", 128, 255)):
    rows = []
    for p in ds.problems:
      r, t = p.m / min(p.g, p.m), ds.times[p]
      if lo < r <= hi and tall in t and short in t:
        best = min(v for c, v in t.items() if isinstance(c, C))
        rows.append((best / t[short], best / t[tall], t[tall] / t[short]))
    if rows:
      s_, t_, ratio = (list(v) for v in zip(*rows))
      print(f"64 x 256 over {tall.block_m} x 256 ({tall.num_stages} stages), order 2, at "
            f"{label} rows per expert, {len(rows)} problems: {_geo(ratio):.3f}x "
            f"({min(ratio):.3f}-{max(ratio):.3f}), 64 x 256 faster on "
            f"{sum(x > 1 for x in ratio)}; share of the best Mosaic config "
            f"{_geo(s_):.3f} (min {min(s_):.3f}) / {_geo(t_):.3f} (min {min(t_):.3f}), "
            f"within 5% on {sum(x >= 0.95 for x in s_)} / {sum(x >= 0.95 for x in t_)}")


def _trusted_regions(ds) -> None:
  """Where the guard trusts a Mosaic config over XLA's dense ragged dot
  without evidence (``RaggedDotFamily.trusted_without_evidence``, the
  sweep's cuDNN): per region, the Mosaic configs of the sweep there and the
  slowest of them against the sweep's XLA row (the regions overlap)."""
  from wavetune_jax.families.ragged_dot.mosaic import MosaicRaggedDotConfig
  from wavetune_jax.families.ragged_dot.xla import XlaRaggedDotConfig
  spec, hw = ds.family, ds.hw
  regions = (("from 64 rows per expert", lambda p: p.m >= 64 * p.g),
             ("with 64 experts or more", lambda p: p.g >= 64),
             ("at most one row for two experts", lambda p: 2 * p.m <= p.g),
             ("one row per expert or fewer, the rule's config", lambda p: p.m <= p.g))
  versions = evaluate.platform_versions(ds.header)
  for label, where in regions:
    speeds, probs = [], 0
    for p in ds.problems:
      if not where(p) or p not in ds.baseline:
        continue
      rule = label.endswith("the rule's config")
      ts = [t for c, t in ds.times[p].items() if isinstance(c, MosaicRaggedDotConfig)
            and (not rule or c == spec.heuristic(p, hw))
            and spec.trusted_without_evidence(p, c, XlaRaggedDotConfig(), hw, versions)]
      probs += bool(ts)
      speeds += [ds.baseline[p] / t for t in ts]
    print(f"trusted {label}: {len(speeds)} Mosaic configs over {probs} problems, the slowest "
          f"{min(speeds, default=math.nan):.2f}x XLA")


#: Rows per expert (balanced routing) of --vs-batched's groups.
BINS = ((0, 16), (16, 128), (128, 512), (512, math.inf))


def _vs_batched(ds, chosen: dict, chosen_cfg, path: str, *, per_problem: bool = False) -> None:
  """Speed of the chosen configs against the sweep's ``baseline_batched``
  rows, by rows per expert (the targets: >= 0.95x from 128 rows per expert,
  >= 1.0x from 512); with ``per_problem``, each problem's line too."""
  spec = ds.family
  if spec.name != "ragged_dot":
    raise SystemExit("table_vs_sweep.py: --vs-batched is for the ragged_dot family")
  batched, padded = {}, {}
  for r in sweep.read_sweep(path)[1]:
    if r["impl"] in ("baseline_batched", "baseline_batched_padded") and r["status"] == "ok":
      (batched if r["impl"] == "baseline_batched" else padded)[
          spec.problem_from_dict(r["problem"])] = r["median_us"]
  cfg = dict(zip(ds.problems, chosen_cfg))
  print("speed vs the batched GEMM on the same rows (uniform routing), vs the faster of it "
        "and lax.ragged_dot, and vs the batched GEMM padded to the largest group of the "
        "sweep's rows, by rows per expert: table geomean (min) / oracle geomean; problems "
        ">= 0.95x and >= 1.0x the batched GEMM")
  low = []
  for lo, hi in BINS:
    ps = [p for p in ds.problems if p in batched and lo <= p.m / min(p.g, p.m) < hi]
    if not ps:
      continue
    vb = [batched[p] / chosen[p] for p in ps]
    vo = [batched[p] / min(ds.times[p].values()) for p in ps]
    vw = [min(batched[p], ds.baseline.get(p, math.inf)) / chosen[p] for p in ps]
    vp = [padded[p] / chosen[p] for p in ps if p in padded]
    print(f"  {lo}-{hi if hi < math.inf else ''} rows: {len(ps)} problems; batched "
          f"{_geo(vb):.3f}x ({min(vb):.3f}x) / {_geo(vo):.3f}x; >= 0.95x "
          f"{sum(v >= 0.95 for v in vb)}, >= 1.0x {sum(v >= 1.0 for v in vb)}; faster of the "
          f"two {_geo(vw):.3f}x ({min(vw):.3f}x); padded {_geo(vp):.3f}x "
          f"({min(vp, default=math.nan):.3f}x) over {len(vp)}")
    low += [(v, p) for v, p in zip(vb, ps) if lo >= 128 and v < 0.95]
  # The third target: >= 650 TFLOP/s wherever the batched GEMM
  # reaches >= 700 (its FLOPs: ceil(m / g) rows for each of the g experts).
  fast = sorted((2 * p.m * p.k * p.n / chosen[p] / 1e6,
                 2 * -(-p.m // p.g) * p.g * p.k * p.n / batched[p] / 1e6, p)
                for p in ds.problems if p in batched)
  fast = [x for x in fast if x[1] >= 700]
  if fast:
    print(f"where the batched GEMM reaches >= 700 TFLOP/s ({len(fast)} problems): the table's "
          f"choice reaches >= 650 on {sum(x[0] >= 650 for x in fast)}; lowest "
          + ", ".join(f"{spec.problem_key(p)} {t:.0f} (batched {b:.0f})" for t, b, p in fast[:3]))
  _order2_over_before(ds)
  _tile_height_by_expert(ds)
  if per_problem:
    print("every problem (us, CUPTI medians of the sweep): rows per expert, the batched GEMM "
          "(uniform routing), lax.ragged_dot, the faster of the two (what a well-built "
          "grouped GEMM gets), the table's choice and its speed over that")
    for p in sorted((p for p in ds.problems if p in batched),
                    key=lambda p: (p.g, p.k, p.n, p.m)):
      lax_us = ds.baseline.get(p, math.inf)
      best = ("batched", batched[p]) if batched[p] <= lax_us else ("lax.ragged_dot", lax_us)
      print(f"  {spec.problem_key(p):<38} {p.m / min(p.g, p.m):7.0f} {batched[p]:10.1f} "
            f"{lax_us:10.1f}  {best[0]:<14} {chosen[p]:10.1f}  {best[1] / chosen[p]:.3f}x")
  if low:
    print(f"problems of >= 128 rows per expert below 0.95x the batched GEMM ({len(low)}): "
          f"table / oracle speed, the chosen config")
    for v, p in sorted(low, key=lambda x: x[0]):
      print(f"  {spec.problem_key(p)} ({p.m / min(p.g, p.m):.0f} rows per expert)  {v:.3f}x / "
            f"{batched[p] / min(ds.times[p].values()):.3f}x  {cfg[p]}")


def _per_model(ds, chosen_us, min_tokens: int) -> None:
  """Speed vs the baseline by model of the suite's grouped-GEMM weights,
  over all problems and over those of at least ``min_tokens`` tokens."""
  from wavetune_jax.families.ragged_dot.family import expert_weights
  from wavetune_jax.shapes import load_suite
  if ds.family.name != "ragged_dot":
    raise SystemExit("table_vs_sweep.py: --min-tokens is for the ragged_dot family")
  weights = {(w["E"], w["K"], w["N"]): (name.split(".")[0], w["top_k"])
             for name, w in expert_weights(load_suite("train")).items()}
  per, big = collections.defaultdict(list), []
  for p, t in zip(ds.problems, chosen_us):
    model, top_k = weights.get((p.g, p.k, p.n), ("other", 1))
    if p in ds.baseline:
      tokens, speed = p.m / top_k, ds.baseline[p] / t
      per[model].append((tokens, speed))
      if tokens >= min_tokens:
        big.append(speed)
  print(f"speed vs {ds.family.baseline_name} at >= {min_tokens} tokens: {_geo(big):.2f}x over "
        f"{len(big)} problems (min {min(big, default=math.nan):.2f}x)")
  for model, v in per.items():
    b = [x for tok, x in v if tok >= min_tokens]
    print(f"  {model}: {_geo([x for _, x in v]):.2f}x over {len(v)}; >= {min_tokens} tokens "
          f"{_geo(b):.2f}x over {len(b)} (min {min(b, default=math.nan):.2f}x)")


if __name__ == "__main__":
  main()
