"""The guard: no config over the platform op without evidence that it wins.

A table's answer (exact entry, wave model or heuristic) of a backend other
than the family's platform config (:meth:`Family.platform_config`: what
``jnp.dot``, cuDNN attention or ``lax.ragged_dot`` runs) is kept only when
the table holds measurements *near* the problem showing that backend faster
than the platform op there. Otherwise the platform config runs (source
``"guard"``), unless a measurement on this GPU (first-use refinement) says
otherwise.

Evidence is a table's ``evidence`` rows: per measured problem, the best time
of each backend it measured, the platform's among them (a replayed table
carries every problem of the sweep it was tuned from; a GPU-tuned one, its
anchors, with the platform config measured at each problem visited). A
table without the section uses its anchors.

Near (:class:`Rule`): the same shape class (every problem field that is not
an int, the family's ``evidence_categorical`` fields such as head_dim, the
GQA ratio), every other log2 weight field within ``weight_radius``, and the
size (tokens, cache length) within ``size_radius`` in log2. The backend is
allowed when at least one near row measured it and the platform op, and at
every such row it ran at least ``win`` times the platform op's speed; a row
of this very problem, where there is one, decides alone. Each
family sets its rule (``Family.guard_rule``) from held-out replays of the
recorded sweeps (``benchmarks/guard_radius.py``; docs/design.md, "The
guard").

Evidence measured with other JAX, jaxlib, CUDA or cuDNN versions than the
running ones is *stale*: the platform op may have changed under it (from
cuDNN 9.22 XLA lowers ``lax.ragged_dot`` to a cuDNN grouped GEMM). A stale
row counts only where the backend won by ``stale_win``. Versions are
compared where the ops run on a GPU (on a CPU, choosing for a named GPU, the
target's versions are not known).
"""

from __future__ import annotations

import collections
import dataclasses
import inspect
import math
from typing import Sequence

import numpy as np

from wavetune_jax.core import versions
from wavetune_jax.core.family import Family
from wavetune_jax.core.hardware import Hardware

__all__ = ["Rule", "DEFAULT_RULE", "rule_of", "Evidence", "evidence_rows", "winners",
           "trusted"]


@dataclasses.dataclass(frozen=True)
class Rule:
  """What counts as evidence (see module doc)."""

  weight_radius: float = 1.0
  size_radius: float = 1.0
  win: float = 1.0
  stale_win: float = 1.10


def trusted(spec: Family, problem, config, platform, hw: Hardware,
            versions: dict | None = None) -> bool:
  """``spec.trusted_without_evidence(problem, config, platform, hw=hw)``:
  whether the family's measured rule lets ``config`` replace ``platform``
  without evidence. False where the override raises (it must not fail the
  user's call); an override written before the hardware argument takes
  three. ``versions``: the platform's (a replay's recorded ones), passed to
  a rule that takes them; default this process's."""
  rule = spec.trusted_without_evidence
  try:
    params = inspect.signature(rule).parameters
    kw = {"hw": hw} if "hw" in params else {}
    if versions is not None and "versions" in params:
      kw["versions"] = versions
    return bool(rule(problem, config, platform, **kw))
  except Exception:  # noqa: BLE001 - a family's rule never fails the user's call
    return False


#: The rule of a family that sets no ``Family.guard_rule``.
DEFAULT_RULE = Rule()


def rule_of(spec: Family) -> Rule:
  """The family's rule: :data:`DEFAULT_RULE` with its ``guard_rule`` fields."""
  return dataclasses.replace(DEFAULT_RULE, **dict(getattr(spec, "guard_rule", {}) or {}))


def evidence_rows(spec: Family, points: Sequence[tuple]) -> list[tuple]:
  """``[(problem, {backend: best us})]`` from measured ``(problem, config,
  us | None)`` points (failed points are left out)."""
  best: dict = collections.defaultdict(dict)
  for p, c, us in points:
    if us is None or not math.isfinite(us) or us <= 0:
      continue
    b = spec.backend_of(c).name
    if us < best[p].get(b, math.inf):
      best[p][b] = us
  return [(p, d) for p, d in best.items() if d]


def winners(points: Sequence[tuple]) -> dict:
  """``{problem: the fastest config}`` of measured ``(problem, config, us |
  None)`` points."""
  best: dict = {}
  for p, c, us in points:
    if us is not None and math.isfinite(us) and us > 0 and us < best.get(p, (None, math.inf))[1]:
      best[p] = (c, us)
  return {p: c for p, (c, _) in best.items()}


class Evidence:
  """A table's evidence rows, indexed by shape class, and the guard's test."""

  def __init__(self, spec: Family, hw: Hardware, rows: Sequence[tuple], *,
               measured_with: dict | None = None, rule: Rule | None = None):
    self.spec, self.hw = spec, hw
    self.rule = rule_of(spec) if rule is None else rule
    # (Versions are compared where the ops run on a GPU: choosing for a GPU
    # named on a CPU, the target's versions are not known.)
    now = versions.current()
    self.stale = "cuda" in now and versions.differ(measured_with or {}, now)
    self._by_class: dict = collections.defaultdict(list)
    for p, us in rows:
      plat = spec.platform_config(p, hw)
      if plat is None:
        continue
      t_plat = us.get(spec.backend_of(plat).name)
      if t_plat is None:
        continue
      cls, num, size = spec.evidence_features(p)
      self._by_class[cls].append((np.asarray(num, np.float64), size, us, t_plat))
    self._memo: dict = {}

  def allows(self, problem, config) -> tuple[bool, str]:
    """``(allowed, why)``: whether ``config`` may run ``problem`` instead of
    the platform config."""
    spec = self.spec
    plat = spec.platform_config(problem, self.hw)
    if plat is None or config == plat:
      return True, ""
    b = spec.backend_of(config).name
    cls, num, size = spec.evidence_features(problem)
    key = (cls, num, size, b)
    hit = self._memo.get(key)
    if hit is not None:
      return hit
    r = self.rule
    win = max(r.win, r.stale_win) if self.stale else r.win
    num = np.asarray(num, np.float64)
    ratios, here = [], None
    for n, s, us, t_plat in self._by_class.get(cls, ()):
      t = us.get(b)
      if t is None or abs(s - size) > r.size_radius:
        continue
      if n.shape != num.shape or (n.size and np.max(np.abs(n - num)) > r.weight_radius):
        continue
      ratios.append(t_plat / t)
      if s == size and np.array_equal(n, num):
        here = t_plat / t
    if here is not None:   # measured at this very problem: that row decides
      ratios = [here]
    stale = " (stale: measured with other versions)" if self.stale else ""
    if not ratios:
      out = (False, f"no {b} measurement near this shape{stale}")
    elif min(ratios) < win:
      out = (False, f"{b} ran at {min(ratios):.2f}x the platform op on a near shape "
                    f"(needs {win:.2f}x){stale}")
    else:
      out = (True, "")
    self._memo[key] = out
    return out
