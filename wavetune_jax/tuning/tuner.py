"""Sparse structural profiling: anchors -> wave models -> a table.

The tuner never sweeps. Given a *pool* of problems (the shape suite on a GPU;
the training problems of a recorded sweep in replay mode) and a *budget* of
measurements, it:

1. **Structural anchors.** For every variant (a config minus the fields the
   (G, L) mapping absorbs, e.g. a GEMM tile with its warps and stages, all its
   split-K values together) it places ``k`` anchors on the wave structure:
   first the point nearest one full wave (``G = C`` at the analytic occupancy)
   at a middle ``L``, then each next point as far as possible from those
   chosen, in ``(log2 G, log2 L, split-K used)``; so the anchors reach the
   most waves, the extreme ``L`` values and split-K. ``k`` takes half the
   budget (at least 2 per variant).
2. **Fit.** Per variant: occupancy from the data within the analytic bound,
   non-negative relative least squares of the wave model (``wave_model``).
3. **Targeted anchors.** The rest of the budget is spent in rounds: for every
   pool problem, the config the current models rank first and has not been
   measured is measured (where the best so far is measured, the next one
   predicted to beat it). A variant whose model is too optimistic gets
   measured exactly where that would mislead the selector, and is corrected.
   Rounds stop when the budget is spent or no pool problem has a candidate.

The result is a :class:`tables.Table`: the model entries, the exact table (a
pool problem's best measured config, kept only where the model predicts no
unmeasured config beats it) and every anchor measured.

Measuring goes through a measurer: :class:`ReplayMeasurer` reads a recorded
sweep (CPU tests, ``wavetune eval``); :class:`GpuMeasurer` times on the GPU
with the one measuring pipeline (``tuning.measure``) and logs every anchor to
a resumable sweep-format file.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import math
import random
from typing import Callable, Sequence

import jax
import numpy as np

from wavetune_jax.core.family import Family
from wavetune_jax.core.hardware import Hardware
from wavetune_jax.runtime import tables, wave_model

__all__ = ["ReplayMeasurer", "GpuMeasurer", "tune", "fit_entries", "build_table", "TuneResult",
           "DEFAULT_BUDGET_FRACTION"]

#: Default budget: this fraction of the exhaustive sweep of the pool.
DEFAULT_BUDGET_FRACTION = 0.03
_MIN_POINTS = 2


class ReplayMeasurer:
  """Measurements from a recorded sweep, restricted to ``problems``."""

  mode = "replay"

  def __init__(self, ds, problems: Sequence):
    self.ds = ds
    self.allowed = set(problems)
    self.seconds = 0.0

  def measure(self, points: Sequence[tuple]) -> list[float | None]:
    out = []
    for p, c in points:
      if p not in self.allowed:
        raise ValueError(f"replay: {self.ds.family.problem_key(p)} is not in the pool")
      self.seconds += self.ds.seconds_per_point.get(p, 0.0)
      out.append(self.ds.times[p].get(c))  # None: failed or not in the sweep
    return out

  def evidence(self) -> tuple[list, dict]:
    """The evidence points: every config of every pool problem of the sweep
    (the guard's rows and the ranking's winners come from them); and the
    versions the sweep was measured with."""
    pts = [(p, c, us) for p in self.allowed if p in self.ds.times
           for c, us in self.ds.times[p].items()]
    return pts, sweep_versions(self.ds.header)


def sweep_versions(header: dict) -> dict:
  """The versions a sweep file's header records (old files: JAX's alone)."""
  out = dict(header.get("versions") or {})
  if header.get("jax_version"):
    out.setdefault("jax", str(header["jax_version"]))
  return {k: str(v) for k, v in out.items()}


class GpuMeasurer:
  """Times anchors on the GPU; every measurement is appended to ``log`` (a
  :class:`sweep.SweepFile`), and anchors already in it are read, not re-timed.
  Problems are compiled and timed ``chunk`` at a time, each chunk logged when
  it is done: a stopped run loses at most the chunk it was on."""

  mode = "gpu"

  def __init__(self, spec: Family, profiler, log=None, progress=None, chunk: int = 16):
    if chunk < 1:
      raise ValueError(f"chunk={chunk} must be >= 1")
    self.spec = spec
    self.chunk = chunk
    self.prof = profiler
    self.log = log
    self.progress = progress
    self.seconds = 0.0
    # Wall seconds per phase: parallel compiles (candidates and problem kits),
    # inputs + reference on the device, checks and timing.
    self.phase_seconds = collections.Counter()
    self._known: dict = {}
    if log is not None:
      from wavetune_jax.tuning import sweep
      _, rows = sweep.read_sweep(log.path, check=True)
      for r in rows:
        if r["impl"] == "pallas":
          key = (spec.problem_from_dict(r["problem"]), spec.config_from_dict(r["config"]))
          self._known[key] = r["median_us"] if r["status"] == "ok" else None

  def evidence(self) -> tuple[list, dict]:
    """No points beyond the anchors (``tune`` adds those); measured here, now."""
    from wavetune_jax.core import versions
    return [], versions.current()

  def measure(self, points: Sequence[tuple]) -> list[float | None]:
    import time

    from wavetune_jax.tuning import measure, sweep
    spec = self.spec
    todo = [pc for pc in dict.fromkeys(points) if pc not in self._known]
    by_problem = collections.defaultdict(list)
    for p, c in todo:
      by_problem[p].append(c)
    t0 = time.perf_counter()
    work = list(by_problem.items())
    # A chunk of problems compiles in parallel, then is timed and logged, so
    # a run that is stopped keeps every chunk it finished (a rerun reads them).
    for i in range(0, len(work), self.chunk):
      rows, current = [], None
      for p, impl, c, m in measure.measure_points(spec, self.prof, work[i:i + self.chunk],
                                                  phase_seconds=self.phase_seconds):
        if p is not current and rows:
          self._flush(rows)
          rows = []
        current = p
        self._known[(p, c)] = m.median_us if m.status == "ok" else None
        rows.append(sweep.make_row(spec, p, impl, c, m))
        if self.progress is not None:
          self.progress.advance(m.status)
      self._flush(rows)
    self.seconds += time.perf_counter() - t0
    return [self._known[pc] for pc in points]

  def _flush(self, rows):
    if self.log is not None and rows:
      self.log.append(rows)


@dataclasses.dataclass
class _Cand:
  problem: object
  config: object
  g: int
  l: int
  aux: tuple


def _candidates(spec: Family, hw: Hardware, pool: Sequence) -> dict:
  """variant -> every (problem, config) point of the pool's spaces."""
  out = collections.defaultdict(list)
  for p in pool:
    for c in spec.space(p, hw):
      g, l = spec.coords(p, c)
      out[spec.variant(c)].append(_Cand(p, c, g, l, spec.aux(p, c)))
  return out


def _structural(spec, hw, cands: list, k: int) -> list:
  """``k`` anchors of one variant spread over the wave structure."""
  c0 = cands[0]
  cap = spec.occupancy_bound(c0.problem, c0.config, hw) * hw.num_sms
  x = np.array([[math.log2(c.g), math.log2(c.l), 2.0 * any(c.aux)] for c in cands])
  span = np.maximum(x.max(axis=0) - x.min(axis=0), 1e-9)
  span[2] = 1.0
  x = x / span
  med_l = np.median(x[:, 1])
  first = int(np.argmin(np.abs(np.log2(np.array([c.g for c in cands]) / cap))
                        + 0.25 * np.abs(x[:, 1] - med_l)))
  chosen = [first]
  dist = np.linalg.norm(x - x[first], axis=1)
  while len(chosen) < min(k, len(cands)):
    nxt = int(np.argmax(dist))
    if dist[nxt] <= 0:
      break
    chosen.append(nxt)
    dist = np.minimum(dist, np.linalg.norm(x - x[nxt], axis=1))
  return [cands[i] for i in chosen]


def _family(spec: Family, variant: tuple) -> tuple:
  """Variants of one family share the backend and macro tile and differ in
  micro fields."""
  micro = spec.backend(dict(variant)["backend"]).micro_fields
  return tuple((k, v) for k, v in variant if k not in micro)


def fit_entries(spec: Family, hw: Hardware, points: Sequence[tuple], *,
                form: str = "bilinear", family_weight: float = 0.0) -> dict:
  """Fits one wave model per variant from measured ``(problem, config, us)``.

  Variants with fewer than 2 points get no entry. With ``family_weight > 0``
  a variant's fit also sees the points of its family (same macro tile, other
  micro fields) at that weight: sparse anchors borrow the family's curve.
  Problems the models do not answer (``Family.modelled``: soft caps and
  sinks, and attention's windows) are left out. Their measurements still
  make exact entries and evidence.
  """
  groups = collections.defaultdict(list)
  for p, c, us in points:
    if us is not None and us > 0 and spec.modelled(p):
      groups[spec.variant(c)].append((p, c, us))
  groups = {v: pts for v, pts in groups.items() if len(pts) >= _MIN_POINTS}
  if not groups:
    return {}
  variants = sorted(groups)
  weights = {v: [1.0] * len(groups[v]) for v in variants}
  if family_weight > 0:
    fam = collections.defaultdict(list)
    for v in variants:
      fam[_family(spec, v)].append(v)
    own = {v: list(groups[v]) for v in variants}
    for v in variants:
      for u in fam[_family(spec, v)]:
        if u != v:
          groups[v] = groups[v] + own[u]
          weights[v] = weights[v] + [family_weight] * len(own[u])
  n = max(len(groups[v]) for v in variants)
  n_aux = len(spec.aux_names)
  b = len(variants)
  g = np.ones((b, n)); l = np.ones((b, n)); t = np.ones((b, n))
  mask = np.zeros((b, n), np.float32)
  aux = np.zeros((b, n, n_aux), np.float32)
  bounds = np.zeros(b, np.int64)
  for i, v in enumerate(variants):
    pts = groups[v]
    bounds[i] = spec.occupancy_bound(pts[0][0], pts[0][1], hw)
    for j, (p, c, us) in enumerate(pts):
      g[i, j], l[i, j] = spec.coords(p, c)
      t[i, j] = us
      aux[i, j] = spec.aux(p, c)
      mask[i, j] = weights[v][j]
  # The fits are thousands of tiny least-squares solves: on the host CPU they
  # take seconds; as GPU SVDs (compiled per shape) they took minutes of a tune.
  with jax.default_device(jax.local_devices(backend="cpu")[0]):
    occ, res = wave_model.fit_occupancy_batch(
        g, l, t, num_sms=hw.num_sms, bounds=bounds, mask=mask,
        aux=aux if n_aux else None, form=form)
    occ, res = np.asarray(occ), jax.tree.map(np.asarray, res)
  out = {}
  for i, v in enumerate(variants):
    m = mask[i] >= 1.0  # the variant's own points
    out[v] = tables.ModelEntry(
        variant=v, occupancy=int(occ[i]), coef=tuple(float(x) for x in res.coef[i]),
        points=int(m.sum()), min_g=int(g[i, m].min()), max_g=int(g[i, m].max()), min_l=float(l[i, m].min()),
        max_l=float(l[i, m].max()),
        aux_seen=tuple(bool(x) for x in np.any(aux[i, m] != 0, axis=0)),
        fit_med_err=float(res.med_err[i]))
  return out


@dataclasses.dataclass
class TuneResult:
  table: tables.Table
  measurements: int
  seconds: float
  rounds: int


def tune(spec: Family, hw: Hardware, pool: Sequence, measurer, *, budget: int | None = None,
         seed: int = 0, form: str = "bilinear",
         distance_penalty: float = tables.DEFAULT_DISTANCE_PENALTY,
         trust: float = tables.DEFAULT_TRUST, family_weight: float = 0.0,
         provenance: dict | None = None, per_round: int = 2,
         paired: bool | None = None,
         log: Callable[[str], None] | None = None) -> TuneResult:
  """Builds a table from at most ``budget`` measurements of ``pool`` problems.

  Args:
    spec, hw: kernel and GPU.
    pool: problems the tuner may measure.
    measurer: :class:`ReplayMeasurer` or :class:`GpuMeasurer`.
    budget: measurements allowed (default: 3% of the pool's exhaustive sweep).
    seed: tie-breaking among equally useful targeted anchors.
    form: wave model form.
    distance_penalty: the table's penalty on predictions far from anchors
      (:class:`tables.Table`).
    trust: the table's trust-region factor (:class:`tables.Table`).
    family_weight: weight of a variant's family points in its fit
      (:func:`fit_entries`; 0: each variant alone).
    provenance: extra facts recorded in the table.
    per_round: targeted anchors per pool problem and round (on a GPU every
      problem visited costs inputs and a reference, so a few at once).
    paired: also measure the family's heuristic config at every problem
      visited (one more measurement per problem, within the budget): the
      heuristic's model, which guards every decision, gets a point wherever
      the others do, and a visited problem can get an exact entry. Default:
      where the budget holds at least two measurements per pool problem
      (with fewer, the pairs take the anchors the models need; held-out data
      in docs/design.md).
    log: called with one line per phase (progress output).
  """
  say = log or (lambda s: None)
  rng = random.Random(seed)
  cands = _candidates(spec, hw, pool)
  space_size = sum(len(v) for v in cands.values())
  if budget is None:
    budget = max(1, round(DEFAULT_BUDGET_FRACTION * space_size))
  measured: dict = {}  # (problem, config) -> us | None
  if paired is None:
    paired = budget >= 2 * len(pool)

  heuristic_of: dict = {}
  platform_of: dict = {}
  # On a GPU every problem visited also times the platform config: the
  # guard's evidence is a backend's time against the platform op's at one
  # problem (a replayed sweep has the platform's rows already).
  with_platform = measurer.mode == "gpu"

  def paired_with(points):
    if with_platform:
      out = []
      for p, c in points:
        if p not in platform_of:
          platform_of[p] = spec.platform_config(p, hw)
          if platform_of[p] is not None:
            out.append((p, platform_of[p]))
        out.append((p, c))
      points = out
    if not paired:
      return points
    out = []
    for p, c in points:
      if p not in heuristic_of:
        try:
          heuristic_of[p] = spec.heuristic(p, hw)
        except ValueError:  # no backend has a heuristic config for it
          heuristic_of[p] = None
        if heuristic_of[p] is not None:
          out.append((p, heuristic_of[p]))
      out.append((p, c))
    return out

  def run(points):
    points = [pc for pc in dict.fromkeys(paired_with(points)) if pc not in measured]
    points = points[:budget - len(measured)]
    if points:
      for pc, us in zip(points, measurer.measure(points)):
        measured[pc] = us
    return len(points)

  # 1. Structural anchors.
  k = max(_MIN_POINTS, (budget // 2) // max(1, len(cands)))
  structural = []
  for v in sorted(cands):
    structural += [(c.problem, c.config) for c in _structural(spec, hw, cands[v], k)]
  say(f"{len(cands)} variants, {space_size} points in the pool's space; budget {budget}; "
      f"structural anchors: {min(len(structural), budget)} ({k} per variant)")
  run(structural)

  # 2-3. Fit, then targeted anchors where the models would decide.
  by_problem = collections.defaultdict(list)
  for v, cs in cands.items():
    for c in cs:
      by_problem[c.problem].append(c.config)
  rounds = 0
  while len(measured) < budget:
    entries = fit_entries(spec, hw, [(p, c, us) for (p, c), us in measured.items()],
                          form=form, family_weight=family_weight)
    table = _table(spec, hw, entries, {}, [], form, {})
    wanted = []
    for p, configs in by_problem.items():
      pred = table.predict(p, configs, trusted=False)
      best_meas = min((measured[(p, c)] for c in configs
                       if measured.get((p, c)) is not None), default=math.inf)
      picked = 0
      for i in np.argsort(pred, kind="stable"):
        if not np.isfinite(pred[i]) or pred[i] >= best_meas or picked == per_round:
          break
        if (p, configs[i]) not in measured:
          wanted.append((p, configs[i]))
          picked += 1
    if not wanted:
      break
    # Over budget: keep whole problems (a GPU pays per problem visited).
    order = list(dict.fromkeys(p for p, _ in wanted))
    rng.shuffle(order)
    rank = {p: i for i, p in enumerate(order)}
    wanted.sort(key=lambda pc: rank[pc[0]])
    got = run(wanted)
    rounds += 1
    say(f"round {rounds}: {got} targeted anchors ({len(measured)}/{budget} measured)")
    if got == 0:
      break

  prov = {"mode": measurer.mode, "budget": budget, "paired": paired,
          "gpu_seconds": round(measurer.seconds, 2),
          "rounds": rounds, "seed": seed}
  phases = getattr(measurer, "phase_seconds", None)
  if phases:
    prov["phase_seconds"] = {k: round(v, 1) for k, v in phases.items()}
    say("GPU tune seconds by phase (wall; *_summed: over programs and threads): "
        + ", ".join(f"{k} {v:.0f}" for k, v in phases.items()))
  prov.update(provenance or {})
  points = [(p, c, us) for (p, c), us in measured.items()]
  ev_points, ev_versions = (measurer.evidence() if hasattr(measurer, "evidence")
                            else ([], {}))
  from wavetune_jax.runtime import guard
  ev_points = list(ev_points) + points
  table = build_table(spec, hw, pool, points,
                      form=form, distance_penalty=distance_penalty, trust=trust,
                      family_weight=family_weight, provenance=prov)
  table.evidence = guard.evidence_rows(spec, ev_points)
  table.evidence_versions = ev_versions
  table.winners = guard.winners(ev_points)
  say(f"fitted {len(table.entries)} variant models from {len(measured)} anchors; "
      f"{len(table.exact)} exact entries")
  return TuneResult(table=table, measurements=len(measured), seconds=measurer.seconds,
                    rounds=rounds)


def build_table(spec: Family, hw: Hardware, pool: Sequence, points: Sequence[tuple], *,
                form: str = "bilinear",
                distance_penalty: float = tables.DEFAULT_DISTANCE_PENALTY,
                trust: float = tables.DEFAULT_TRUST, family_weight: float = 0.0,
                provenance: dict | None = None) -> tables.Table:
  """The dual table from measured ``(problem, config, us | None)`` points.

  Model entries per variant; an exact entry for a pool problem where the
  family's heuristic config was measured too (an exact answer is a measured
  win over the default, never a model's guess against it) and the best
  measured config is predicted to beat every unmeasured one.
  """
  entries = fit_entries(spec, hw, points, form=form, family_weight=family_weight)
  table = _table(spec, hw, entries, {}, points, form, {}, distance_penalty, trust)
  measured = collections.defaultdict(dict)
  for p, c, us in points:
    if us is not None:
      measured[p][c] = us
  exact = {}
  for p in pool:
    meas = measured.get(p)
    if not meas:
      continue
    try:
      if spec.heuristic(p, hw) not in meas:
        continue
    except ValueError:  # no backend has a heuristic config for it
      pass
    best = min(meas, key=meas.get)
    rest = [c for c in spec.space(p, hw) if c not in meas]
    if not rest or np.min(table.predict(p, rest)) >= meas[best]:
      exact[p] = (best, meas[best])
  prov = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
          "anchors": len(points), "failed_anchors": sum(us is None for *_, us in points),
          "pool_problems": len(pool),
          "pool_points": sum(len(spec.space(p, hw)) for p in pool)}
  if family_weight:
    prov["family_weight"] = family_weight
  prov.update(provenance or {})
  return _table(spec, hw, entries, exact, points, form, prov, distance_penalty, trust)


def _table(spec, hw, entries, exact, points, form, prov,
           distance_penalty: float = tables.DEFAULT_DISTANCE_PENALTY,
           trust: float = tables.DEFAULT_TRUST) -> tables.Table:
  return tables.Table(family=spec, device_kind=hw.name, device_key=hw.device_key,
                      num_sms=hw.num_sms, form=form, entries=entries, exact=exact,
                      anchors=[(p, c, us) for p, c, us in points if us is not None],
                      provenance=prov, distance_penalty=distance_penalty, trust=trust)
