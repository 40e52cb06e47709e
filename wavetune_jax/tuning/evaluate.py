"""How good is a config-selection policy? Replay against an exhaustive sweep.

Protocol (held out by shape, fixed seed):

* The sweep's problems are grouped by *weight* (every problem field except the
  spec's ``size_field``, the token count) and by size. A seeded draw holds out ``test_weights``
  (a fraction) of the weights and ``test_ms`` (a fraction) of the M values.
* Test set = every problem of a held-out weight, plus every problem at a
  held-out M. Training set = the rest (kept weights at kept M values). No policy
  ever sees a measurement of a test problem while it builds itself.
* Learned policies get a profiling budget: a number of measured (problem,
  config) points, drawn from training problems only. By default it is 3% of the
  training split's measurements (the WaveTune budget); ``budget=`` overrides.
* ``efficiency(s) = t_oracle(s) / t_policy(s)`` from the sweep's times. A policy
  that picks a config without a valid time on file (failed or not measured)
  scores that problem's worst measured time and the miss is counted.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import random
import statistics
import time
import warnings
from typing import Callable, Sequence

import numpy as np

from wavetune_jax.core.family import Family
from wavetune_jax.core.hardware import Hardware
from wavetune_jax.core.registry import get_family
from wavetune_jax.runtime import tables
from wavetune_jax.tuning import report, sweep

__all__ = ["Dataset", "load_dataset", "split", "Policy", "POLICIES", "make_policy",
           "evaluate", "PolicyResult", "DEFAULT_BUDGET_FRACTION"]

DEFAULT_BUDGET_FRACTION = 0.03


@dataclasses.dataclass
class Dataset:
  """Times of one sweep: ``times[problem][config] = us`` (ok rows only)."""

  family: Family
  hw: Hardware
  header: dict
  times: dict
  baseline: dict           # problem -> us
  seconds_per_point: dict  # problem -> GPU seconds one measurement cost
  failed: dict             # problem -> set of configs that failed

  @property
  def problems(self) -> list:
    return sorted(self.times, key=self.family.problem_key)

  def oracle(self, problem):
    t = self.times[problem]
    return min(t, key=t.get)


def _values(spec, config) -> set:
  return {(spec.backend_of(config).name, k, repr(v))
          for k, v in spec.config_to_dict(config).items()}


def recorded_values(spec, rows) -> set:
  """``{(backend, field, value)}`` of the config rows of a sweep file."""
  out = set()
  for r in rows:
    if r.get("impl") == "pallas":
      out |= _values(spec, spec.config_from_dict(r["config"]))
  return out


def load_dataset(path: str) -> Dataset:
  """Reads a sweep file.

  Problems without a single ok config are dropped, and so are problems whose
  sweep was cut short (a config of the spec's space has no row): their oracle
  would be the best of a part of the space. One warning names them. A config
  with a field value that no row of its backend in the whole file has (the
  space grew that value after the file was recorded, as the grouped GEMM's
  order 2) does not make a problem partial: the file predates it, as
  :func:`~wavetune_jax.tuning.sweep.recorded_family` says of backends.
  """
  header, rows = sweep.read_sweep(path, strict=True)
  hw = report.hardware_of(header)
  rows = sweep.with_recorded_backends(get_family(header["kernel"]), hw, rows)
  spec = sweep.recorded_family(get_family(header["kernel"]), rows)
  times: dict = collections.defaultdict(dict)
  failed: dict = collections.defaultdict(set)
  baseline, walls, counts = {}, collections.Counter(), collections.Counter()
  for r in rows:
    p = spec.problem_from_dict(r["problem"])
    if r["impl"] == "pallas":
      counts[p] += 1
      c = spec.config_from_dict(r["config"])
      if r["status"] == "ok":
        times[p][c] = r["median_us"]
      else:
        failed[p].add(c)
    elif r["impl"] == "baseline" and r["status"] == "ok":
      baseline[p] = r["median_us"]
    elif r["impl"] == "timing":
      walls[p] += r["wall_s"]
  seen = recorded_values(spec, rows)
  partial = {p: n for p in list(times)
             if (n := sum(c not in times[p] and c not in failed[p]
                          and _values(spec, c) <= seen
                          for c in sweep.swept_space(spec, p, hw)))}
  if partial:
    warnings.warn(
        f"{path}: {len(partial)} problem(s) swept only in part are left out ("
        + ", ".join(f"{spec.problem_key(p)}: {n} configs missing"
                    for p, n in list(partial.items())[:4])
        + (", ..." if len(partial) > 4 else "")
        + "); rerun the sweep command to complete them", stacklevel=2)
    for p in partial:
      del times[p]
  spp = {p: (walls[p] / counts[p] if counts[p] and walls[p] else 0.0) for p in times}
  return Dataset(family=spec, hw=hw, header=header, times=dict(times), baseline=baseline,
                 seconds_per_point=spp, failed=dict(failed))


def split(ds: Dataset, *, seed: int = 0, test_weights: float = 0.34,
          test_ms: float = 0.25) -> tuple[list, list]:
  """``(train, test)`` problems, held out by weight and by M (see module doc)."""
  problems = ds.problems
  weights = sorted({ds.family.weight_of(p) for p in problems})
  ms = sorted({ds.family.size_of(p) for p in problems})
  rng = random.Random(seed)
  n_w = min(len(weights) - 1, max(1, round(test_weights * len(weights))))
  n_m = min(len(ms) - 1, max(1, round(test_ms * len(ms))))
  held_w = set(rng.sample(weights, n_w)) if len(weights) > 1 else set()
  held_m = set(rng.sample(ms, n_m)) if len(ms) > 1 else set()
  test = [p for p in problems if ds.family.weight_of(p) in held_w
          or ds.family.size_of(p) in held_m]
  train = [p for p in problems if p not in set(test)]
  return train, test


# --- policies ------------------------------------------------------------------------


class Policy:
  """A config-selection policy: ``fit`` on training data, then ``select``."""

  name = "policy"

  def fit(self, ds: Dataset, train: Sequence, budget: int, rng: random.Random) -> tuple[int, float]:
    """Builds the policy; returns (measurements used, GPU seconds they cost)."""
    return 0, 0.0

  def select(self, problem):
    raise NotImplementedError


class DefaultPolicy(Policy):
  """One fixed config for every problem (``spec.default``)."""
  name = "default"

  def fit(self, ds, train, budget, rng):
    self.spec = ds.family
    return 0, 0.0

  def select(self, problem):
    return self.spec.default(problem)


class HeuristicPolicy(Policy):
  """The spec's rule of thumb (``spec.heuristic``)."""
  name = "heuristic"

  def fit(self, ds, train, budget, rng):
    self.spec, self.hw = ds.family, ds.hw
    return 0, 0.0

  def select(self, problem):
    return self.spec.heuristic(problem, self.hw)


class OraclePolicy(Policy):
  """Exhaustive search: the best measured config (profiles every test shape)."""
  name = "oracle"

  def fit(self, ds, train, budget, rng):
    self.ds = ds
    return 0, 0.0  # its cost is charged per evaluated problem in evaluate()

  def select(self, problem):
    return self.ds.oracle(problem)


class NearestPolicy(Policy):
  """Exhaustive tuning of as many training shapes as the budget pays for, then
  the config of the nearest tuned shape: the same weight at the nearest M (in
  log space), else the nearest weight (what tuned-JSON lookups do). Where the
  tuned shape's best config is not in the new problem's space, its next best
  one that is."""
  name = "nearest"

  def fit(self, ds, train, budget, rng):
    self.spec, self.hw = ds.family, ds.hw
    order = list(train)
    rng.shuffle(order)
    self.tuned = {}
    used, secs = 0, 0.0
    for p in order:
      n = len(ds.times[p]) + len(ds.failed.get(p, ()))
      if used + n > budget:
        continue
      used += n
      secs += n * ds.seconds_per_point[p]
      self.tuned[p] = sorted(ds.times[p], key=ds.times[p].get)
    if not self.tuned:  # not even one shape fits the budget: tune the smallest
      p = min(train, key=lambda p: len(ds.times[p]))
      used, secs = len(ds.times[p]), len(ds.times[p]) * ds.seconds_per_point[p]
      self.tuned[p] = sorted(ds.times[p], key=ds.times[p].get)
    self._feats = {p: _log_fields(self.spec, p) for p in self.tuned}
    return used, secs

  def select(self, problem):
    f = _log_fields(self.spec, problem)
    size = self.spec.size_field
    best = min(self._feats, key=lambda p: _dist(self._feats[p], f, size))
    ranking = self.tuned[best]
    space = set(self.spec.space(problem, self.hw))
    return next((c for c in ranking if c in space), ranking[0])


def _log_fields(spec, problem) -> dict:
  return {k: math.log2(v) for k, v in spec.problem_to_dict(problem).items()
          if isinstance(v, int) and not isinstance(v, bool) and v > 0}


def _dist(a: dict, b: dict, size_field: str) -> float:
  # Other fields (the weight) dominate: a shape of the same weight always wins.
  return sum((a[k] - b.get(k, 0.0)) ** 2 * (1.0 if k == size_field else 1e3) for k in a)


class _RegressorPolicy(Policy):
  """Learned cost model: random (problem, config) points of the training split,
  features of problem, config and the (G, L) mapping, log latency as target;
  selection is the argmin of the prediction over the space."""

  def _model(self):
    raise NotImplementedError

  def fit(self, ds, train, budget, rng):
    self.spec, self.hw = ds.family, ds.hw
    pool = [(p, c) for p in train for c in ds.times[p]]
    pts = rng.sample(pool, min(budget, len(pool)))
    x = np.array([_features(ds.family, ds.hw, p, c) for p, c in pts])
    y = np.log(np.array([ds.times[p][c] for p, c in pts]))
    self.model = self._model()
    self.model.fit(x, y)
    return len(pts), sum(ds.seconds_per_point[p] for p, _ in pts)

  def select(self, problem):
    space = self.spec.space(problem, self.hw)
    x = np.array([_features(self.spec, self.hw, problem, c) for c in space])
    return space[int(np.argmin(self.model.predict(x)))]


def _features(spec, hw, problem, config) -> list[float]:
  g, l = spec.coords(problem, config)
  waves = g / hw.num_sms
  # Every integer field of the problem (0 as -1 and a negative value, a
  # window's unbounded side, as -2), so all problems of a family have one
  # feature length: windowed and plain attention problems share a sweep.
  # (The dataclass's fields, not problem_to_dict, which leaves out options
  # at their defaults.)
  values = [getattr(problem, f.name) for f in dataclasses.fields(problem)
            if not f.name.startswith("_")]  # (not the memoized key and hash)
  prob = [math.log2(v) if v > 0 else -1.0 if v == 0 else -2.0
          for v in values if isinstance(v, int) and not isinstance(v, bool)]
  # Every field of every backend (-1 where a backend has none) and the
  # backend one-hot, so all configs have one feature length.
  b = spec.backend_of(config)
  names = sorted({f for x in spec.backends for f in x.fields()})
  cfg = [math.log2(v) if (v := getattr(config, f, 0)) > 0 else -1.0 for f in names]
  hot = [float(x is b) for x in spec.backends]
  return prob + cfg + hot + [math.log2(g), math.log2(l), math.ceil(waves),
                             waves / max(1, math.ceil(waves))]


def _sklearn():
  try:
    import sklearn  # noqa: F401
  except ImportError:
    raise RuntimeError("policies 'tree' and 'gbdt' need scikit-learn: "
                       "pip install 'wavetune-jax[eval]'") from None


class TreePolicy(_RegressorPolicy):
  name = "tree"

  def _model(self):
    _sklearn()
    from sklearn.tree import DecisionTreeRegressor
    return DecisionTreeRegressor(random_state=0, min_samples_leaf=2)


class GBDTPolicy(_RegressorPolicy):
  name = "gbdt"

  def _model(self):
    _sklearn()
    from sklearn.ensemble import GradientBoostingRegressor
    return GradientBoostingRegressor(random_state=0, n_estimators=200, max_depth=4)


def platform_versions(header: dict) -> dict:
  """The versions a sweep ran with, for a replay that stands in for that
  platform: the header's, and where it records no cuDNN (sweeps started
  before versions were recorded), the newest cuDNN its resumed or merged
  runs record."""
  from wavetune_jax.tuning.tuner import sweep_versions
  out = sweep_versions(header)
  if "cudnn" not in out:
    runs = list(header.get("merged") or []) + list(header.get("resumed") or [])
    for run in sorted(runs, key=lambda r: str(r.get("date", ""))):
      cudnn = (run.get("versions") or {}).get("cudnn")
      if cudnn:
        out["cudnn"] = str(cudnn)
  return out


class WaveTunePolicy(Policy):
  """The WaveTune tuner in replay mode on the training problems, within the
  budget; selection as the ops' ``"tables"`` policy: exact -> model ->
  heuristic, then the guard (``guard``: a :class:`guard.Rule`, None for
  none) on the table's evidence (the training problems' sweep rows).

  :meth:`refined` replays first-use refinement: the fastest recorded time
  among the configs it would measure (:func:`refine.candidates`);
  :meth:`ranked` is the wave model's top-k (recall@k)."""
  name = "wavetune"

  def __init__(self, form: str = "bilinear",
               distance_penalty: float = tables.DEFAULT_DISTANCE_PENALTY,
               trust: float = tables.DEFAULT_TRUST, family_weight: float = 0.0,
               heuristic_margin: float | None | str = "spec", guard="default",
               top_k: int | None = None):
    from wavetune_jax.runtime import refine
    self.guard = guard  # "default": the family's rule
    self._top_k = top_k   # None: the family's (refine.top_k), known at fit
    self.top_k = refine.TOP_K if top_k is None else top_k
    self.heuristic_margin = heuristic_margin
    self.form = form
    self.distance_penalty = distance_penalty
    self.trust = trust
    self.family_weight = family_weight

  def fit(self, ds, train, budget, rng):
    from wavetune_jax.runtime import selector
    from wavetune_jax.tuning import tuner as tuning
    from wavetune_jax.runtime import refine
    self.spec, self.hw = ds.family, ds.hw
    self.top_k = refine.top_k(ds.family) if self._top_k is None else self._top_k
    res = tuning.tune(ds.family, ds.hw, train, tuning.ReplayMeasurer(ds, train),
                      budget=budget, seed=rng.randrange(1 << 30), form=self.form,
                      distance_penalty=self.distance_penalty, trust=self.trust,
                      family_weight=self.family_weight)
    self.table = res.table
    self.platform_versions = platform_versions(ds.header)
    self.decider = selector.Decider(res.table, ds.hw, heuristic_margin=self.heuristic_margin)
    if self.guard is not None:
      from wavetune_jax.runtime import guard as guard_lib
      self.evidence = guard_lib.Evidence(
          ds.family, ds.hw, res.table.evidence, measured_with=res.table.evidence_versions,
          rule=None if self.guard == "default" else self.guard)
    return res.measurements, res.seconds

  def unguarded(self, problem):
    sel = self.decider.decide(problem)
    return self.spec.heuristic(problem, self.hw) if sel is None else sel.config

  def select(self, problem):
    c = self.unguarded(problem)
    if self.guard is None or self.evidence.allows(problem, c)[0]:
      return c
    plat = self.spec.platform_config(problem, self.hw)
    # As the selector's guard: the family's rule for problems without
    # evidence, with the sweep's versions standing for the platform's.
    from wavetune_jax.runtime import guard as guard_lib
    return c if guard_lib.trusted(self.spec, problem, c, plat, self.hw,
                              versions=self.platform_versions) else plat

  def ranked(self, problem, k: int) -> list:
    return self.decider.ranked(problem, k)

  def refined(self, problem, times: dict):
    """The config first-use refinement keeps (the fastest recorded among its
    candidates), and how many it measures. The replay times the platform
    config always; first use leaves an XLA platform op untimed where a
    candidate is trusted over it (:func:`refine.dominating`), the fastest
    trusted candidate standing in, so there it can keep that candidate where
    the replay keeps one faster than it by less than 3%. A sweep holds one input mix: the
    decode replay does not apply the full-cache check first use makes
    (:meth:`Family.refine_mixes`), so it can keep configs that a GPU would not."""
    from wavetune_jax.runtime import refine
    cands = refine.candidates(self.spec, problem, self.hw, self.decider,
                              self.select(problem), k=self.top_k)
    timed = {c: times[c] for c in cands if c in times}
    if not timed:
      return self.select(problem), len(cands)
    return refine.pick(timed, self.spec.platform_config(problem, self.hw)), len(cands)


POLICIES: dict[str, Callable[[], Policy]] = {
    cls.name: cls for cls in (DefaultPolicy, HeuristicPolicy, NearestPolicy, TreePolicy,
                              GBDTPolicy, WaveTunePolicy, OraclePolicy)}


def make_policy(name: str, wavetune: dict | None = None) -> Policy:
  """A policy by name; ``wavetune`` holds options of the wavetune policy
  (``form``, ``distance_penalty``, ``trust``, ``family_weight``,
  ``heuristic_margin``: ``"spec"`` for the spec's, None for no guard)."""
  try:
    cls = POLICIES[name]
  except KeyError:
    raise ValueError(f"unknown policy {name!r}; known: {sorted(POLICIES)}") from None
  return cls(**(wavetune or {})) if cls is WaveTunePolicy else cls()


# --- evaluation ----------------------------------------------------------------------


@dataclasses.dataclass
class PolicyResult:
  policy: str
  efficiency: dict           # problem key -> t_oracle / t_policy
  geomean: float
  minimum: float
  p10: float
  within_5pct: float
  misses: int
  measurements: int
  gpu_seconds: float
  decision_us_cold: float
  decision_us_memo: float
  vs_xla_geomean: float | None
  #: The slowest chosen config's speed over the baseline (None: no baseline).
  vs_xla_min: float | None = None
  #: Geomean speedup over the fixed default on the test problems where the
  #: default is more than 10% slower than the oracle (None: no such problem).
  vs_default_where_differ: float | None = None
  #: Geomean and slowest speed over the platform op (the fastest of the
  #: family's platform configs and its baseline: decode's faster of cuDNN
  #: and XLA), and the problems below 0.97x of it.
  vs_platform_geomean: float | None = None
  vs_platform_min: float | None = None
  below_097: int = 0
  #: The wavetune policy only: recall@k of the wave model (k -> share of
  #: test problems with a config within 2% of the oracle in its top-k), and
  #: first-use refinement replayed (efficiency geomean, vs the platform op,
  #: candidates measured per problem).
  recall: dict | None = None
  refined: dict | None = None

  def to_json(self) -> dict:
    return dataclasses.asdict(self)


def _geomean(xs) -> float:
  xs = list(xs)
  return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else float("nan")


def _time_decisions(policy: Policy, problems: Sequence) -> tuple[float, float]:
  """Median microseconds of one decision: cold (no memo) and memoized."""
  cold = []
  for p in problems:
    t0 = time.perf_counter_ns()
    policy.select(p)
    cold.append((time.perf_counter_ns() - t0) / 1e3)
  memo = {p: policy.select(p) for p in problems}
  warm = []
  for p in problems:
    t0 = time.perf_counter_ns()
    memo.get(p)
    warm.append((time.perf_counter_ns() - t0) / 1e3)
  return statistics.median(cold), statistics.median(warm)


#: recall@k is reported for these k.
RECALL_K = (1, 2, 3, 4, 6)


def platform_time(ds: Dataset, problem) -> float | None:
  """The platform op's time: the fastest of the family's platform configs
  (decode and attention: the faster of cuDNN and XLA); None if none ran.
  The sweep's own rows of those configs, not its ``baseline`` rows: a GEMM's
  XLA config and ``jnp.dot`` are the same op, yet two compiles of it in one
  sweep differed by up to 1.3x (XLA's autotuner picks per compile), and a
  policy that keeps the platform config must score 1.0 against it."""
  ts = [t for c, t in ds.times[problem].items() if ds.family.backend_of(c).platform]
  return min(ts) if ts else None


def _ranking_scores(ds: Dataset, policy: "WaveTunePolicy", test) -> tuple[dict, dict]:
  """recall@k of the policy's wave model and its refinement replayed."""
  recall = {}
  for k in RECALL_K:
    hits = 0
    for p in test:
      best = ds.times[p][ds.oracle(p)]
      hits += any(ds.times[p].get(c, math.inf) <= 1.02 * best for c in policy.ranked(p, k))
    recall[k] = hits / len(test)
  eff, vs, n = [], [], []
  for p in test:
    c, m = policy.refined(p, ds.times[p])
    t = ds.times[p].get(c, max(ds.times[p].values()))
    eff.append(ds.times[p][ds.oracle(p)] / t)
    n.append(m)
    t_plat = platform_time(ds, p)
    if t_plat is not None:
      vs.append(t_plat / t)
  return recall, {"k": policy.top_k, "geomean": _geomean(eff), "minimum": min(eff),
                  "vs_platform_geomean": _geomean(vs) if vs else None,
                  "vs_platform_min": min(vs) if vs else None,
                  "below_097": sum(x < 0.97 for x in vs),
                  "candidates": statistics.mean(n)}


def evaluate(ds: Dataset, policy_names: Sequence[str], *, seed: int = 0,
             budget: int | None = None, test_weights: float = 0.34,
             test_ms: float = 0.25, wavetune: dict | None = None
             ) -> tuple[list[PolicyResult], dict]:
  """Fits every policy on the training split and scores it on the test split.

  ``wavetune`` passes options to the wavetune policy (:func:`make_policy`).

  Returns:
    (results per policy, facts about the split and the budget).
  """
  train, test = split(ds, seed=seed, test_weights=test_weights, test_ms=test_ms)
  if not train or not test:
    raise ValueError(f"the split left {len(train)} training and {len(test)} test "
                     f"problems; the sweep needs more weights and M values")
  train_points = sum(len(ds.times[p]) for p in train)
  if budget is None:
    budget = max(1, round(DEFAULT_BUDGET_FRACTION * train_points))
  results = []
  for name in policy_names:
    policy = make_policy(name, wavetune)
    used, secs = policy.fit(ds, train, budget, random.Random(seed))
    if name == "oracle":  # exhaustive search profiles every evaluated shape
      used = sum(len(ds.times[p]) + len(ds.failed.get(p, ())) for p in test)
      secs = sum((len(ds.times[p]) + len(ds.failed.get(p, ()))) * ds.seconds_per_point[p]
                 for p in test)
    eff, vs_xla, vs_dflt, vs_plat, misses = {}, [], [], [], 0
    for p in test:
      c = policy.select(p)
      t = ds.times[p].get(c)
      if t is None:
        misses += 1
        t = max(ds.times[p].values())
      eff[ds.family.problem_key(p)] = ds.times[p][ds.oracle(p)] / t
      if p in ds.baseline:
        vs_xla.append(ds.baseline[p] / t)
      t_plat = platform_time(ds, p)
      if t_plat is not None:
        vs_plat.append(t_plat / t)
      t_dflt = ds.times[p].get(ds.family.default(p))
      if t_dflt is not None and t_dflt > 1.1 * ds.times[p][ds.oracle(p)]:
        vs_dflt.append(t_dflt / t)
    cold, memo = _time_decisions(policy, test)
    recall = refined = None
    if isinstance(policy, WaveTunePolicy):
      recall, refined = _ranking_scores(ds, policy, test)
    e = sorted(eff.values())
    results.append(PolicyResult(
        policy=name, efficiency=eff, geomean=_geomean(e), minimum=e[0],
        p10=float(np.percentile(e, 10)), within_5pct=sum(x >= 1 / 1.05 for x in e) / len(e),
        misses=misses, measurements=used, gpu_seconds=secs, decision_us_cold=cold,
        decision_us_memo=memo, vs_xla_geomean=_geomean(vs_xla) if vs_xla else None,
        vs_xla_min=min(vs_xla) if vs_xla else None,
        vs_default_where_differ=_geomean(vs_dflt) if vs_dflt else None,
        vs_platform_geomean=_geomean(vs_plat) if vs_plat else None,
        vs_platform_min=min(vs_plat) if vs_plat else None,
        below_097=sum(x < 0.97 for x in vs_plat), recall=recall, refined=refined))
  facts = {"train_problems": len(train), "test_problems": len(test),
           "train_points": train_points, "budget": budget, "seed": seed,
           "device_kind": ds.header["device_kind"], "baseline_name": ds.family.baseline_name,
           "test": [ds.family.problem_key(p) for p in test]}
  return results, facts
