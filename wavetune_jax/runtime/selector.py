"""Trace-time config selection.

Selection order (the one place it is written): an explicit config (argument,
or pinned with :func:`use_config`) -> the policy. Policy ``"tables"``: exact
table -> model table -> heuristic, then the guard
(:mod:`wavetune_jax.runtime.guard`: a config other than the platform op's
only where the table's evidence shows its backend winning near the
problem). ``"refine"``: the same answer, then at the first use of a problem
a measurement on this GPU of the platform config, that answer and the wave
model's top-k (:mod:`wavetune_jax.runtime.refine`), kept on disk.
``"auto"`` (the default): ``"refine"`` where the ops run on a GPU and the
table-cache folder is set, else ``"tables"``. ``"heuristic"``: the
family's rule of thumb (its backends' in order of preference). ``"fixed"``: the
family's fixed default. ``"exhaustive"``: time the whole space on the GPU now,
like an autotuner, and cache the answer.

Only backends that run where the ops run are chosen (``Hardware.interpret``:
with no GPU, those with a Pallas interpret mode; ``Backend.runs_on``: a
Pallas Triton backend only where this JAX has the Triton lowering); an exact
table entry, a decision kept with a cached table, or a fixed default of
another backend is passed over, the models (or the heuristic) answer and the
selection's note says why. A config pinned explicitly is never replaced: the
op raises ``ValueError`` with the reason.

Decisions are memoized per (family, problem, hardware, state). The state (policy,
tables, pinned configs) is part of JAX's jit cache key through
``jax.make_user_context``, so a jitted function traced under one policy or
table is traced again under another instead of reusing a stale config.

The model table answers from a per-weight *decision vector*: the first time a
weight (every problem field but the size) is seen, the model is evaluated for
a block of size buckets at once in NumPy (``family.size_quantum``: sizes in one
bucket share space and coordinates); later sizes in that block are one
array lookup.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import itertools
import os
import threading
import time
import warnings
from typing import Any, Iterator

import jax
import numpy as np

from wavetune_jax.core.family import Family
from wavetune_jax.core.hardware import Hardware, get_hardware
from wavetune_jax.core.registry import get_family, registered
from wavetune_jax.core import hardware as hardware_lib
from wavetune_jax.runtime import guard as guard_lib
from wavetune_jax.runtime import refine as refine_lib
from wavetune_jax.runtime import table_cache
from wavetune_jax.runtime import tables as tables_lib

__all__ = ["POLICIES", "Selection", "select", "set_policy", "get_policy", "policy", "use_config",
           "load_tables", "use_tables", "active_table", "clear", "Decider",
           "decision_stats", "refinement_stats"]

POLICIES = ("auto", "refine", "tables", "heuristic", "fixed", "exhaustive")
_BLOCK = 64  # size buckets evaluated together for a new weight


@dataclasses.dataclass(frozen=True)
class Selection:
  """A decision: the config and where it came from."""

  config: Any
  # explicit | exact | model | heuristic | guard | measured | fixed | exhaustive
  source: str
  predicted_us: float | None = None
  waves: int | None = None
  note: str = ""


class Decider:
  """Exact -> model decisions of one table (no heuristic, no memo per problem).

  ``heuristic_margin``: ``"spec"`` (the default) uses
  ``Family.heuristic_margin``; a number or None (the model's argmin
  stands) overrides it, for comparisons.
  """

  def __init__(self, table: tables_lib.Table, hw: Hardware, *,
               heuristic_margin: float | None | str = "spec"):
    self.table = table
    self.hw = hw
    self.spec = table.family
    self.margin = (table.family.heuristic_margin if heuristic_margin == "spec"
                   else heuristic_margin)
    self._weights: dict = {}
    self._seen: set = set()
    self.rates = table.peak_rates()

  def decide(self, problem) -> Selection | None:
    """The table's answer for ``problem`` (None: outside the model's trust
    region), checked against the problem itself (:meth:`_runnable`)."""
    hit = self.table.exact.get(problem)
    if hit is None:
      sel = self._model(problem)
    elif self.spec.supports(hit[0], self.hw):
      sel = Selection(hit[0], "exact", hit[1])
    else:
      sel = self._model(problem)
      if sel is not None:
        sel = dataclasses.replace(sel, note=_passed_over("the exact entry", self.spec,
                                                         hit[0], self.hw, sel.note))
    return None if sel is None else self._runnable(problem, sel)

  def _runnable(self, problem, sel: Selection) -> Selection:
    """``sel``, or the family's rule at ``problem`` where ``sel``'s config
    cannot run it: a model's answer is shared by the sizes of a bucket, and a
    table's exact entry may come from other code."""
    spec, hw = self.spec, self.hw
    try:
      spec.validate(problem, sel.config, hw)
      return sel
    except ValueError as e:
      rule = spec.heuristic(problem, hw)
      return Selection(rule, "heuristic", note=_cannot_run(
          spec, f"the table's {sel.source} answer", sel.config, e,
          "the family's rule at this size", rule))

  def ranked(self, problem, k: int) -> list:
    """The ``k`` configs first-use refinement measures besides the platform
    config and the table's answer: the wave model's fastest predictions
    (trusted first, then its extrapolations) interleaved with the configs
    that won at the table's nearest evidence problems of the same shape
    class (its exact answers where it has no winners; held-out recall in
    docs/design.md)."""
    spec = self.spec
    size = np.array([spec.size_of(problem)])
    configs, valid, g, l, aux = spec.decision_arrays(problem, size, self.hw)
    model = []
    for trusted in (True, False):
      if not configs:
        break
      pred = np.where(valid, self.table.predict_arrays(configs, g, l, aux, trusted=trusted),
                      np.inf)[0]
      for i in np.argsort(pred, kind="stable"):
        if len(model) == k or not np.isfinite(pred[i]):
          break
        if configs[i] not in model:
          model.append(configs[i])
    near = self._neighbours(problem, k)
    out = []
    for pair in itertools.zip_longest(model, near):
      for c in pair:
        if c is not None and c not in out and len(out) < k:
          out.append(c)
    return out

  def _neighbours(self, problem, k: int) -> list:
    """Winners (else exact answers) of the table's problems in ``problem``'s
    shape class, nearest first (Chebyshev distance in log2 fields and size), that are
    valid for ``problem``."""
    spec = self.spec
    index = self.__dict__.get("_exact_index")
    if index is None:
      index = {}
      won = self.table.winners or {p: c for p, (c, _) in self.table.exact.items()}
      for p, c in won.items():
        cls, num, size = spec.evidence_features(p)
        index.setdefault(cls, []).append((np.asarray(num + (size,)), c))
      self._exact_index = index
    cls, num, size = spec.evidence_features(problem)
    x = np.asarray(num + (size,))
    rows = sorted(((float(np.max(np.abs(v - x))) if v.shape == x.shape else np.inf, i)
                   for i, (v, _) in enumerate(index.get(cls, ()))))
    out = []
    for _, i in rows:
      c = index[cls][i][1]
      if c in out or not spec.supports(c, self.hw):
        continue
      try:
        spec.validate(problem, c, self.hw)
      except ValueError:
        continue
      out.append(c)
      if len(out) == k:
        break
    return out

  def _model(self, problem) -> Selection | None:
    spec = self.spec
    if not spec.modelled(problem):
      return None  # the heuristic answers (no evidence of such problems)
    q = spec.size_quantum(problem)
    bucket = -(-spec.size_of(problem) // q)  # 1-based
    block = (bucket - 1) // _BLOCK
    # The quantum is in the key: it names the sizes of the block, and it
    # changes with the backends that run the problem (GEMM: M % 8 for Mosaic).
    key = (spec.weight_of(problem), q, block)
    vec = self._weights.get(key)
    r = (bucket - 1) % _BLOCK
    if vec is None:
      if key not in self._seen:
        # The first size of a block is decided alone (a new weight costs one
        # size's evaluation at trace time); the second builds the block that
        # answers every later size in microseconds. Rows are independent:
        # the answers are the same either way.
        self._seen.add(key)
        vec = self._block(problem, np.array([bucket * q]))
        r = 0
      else:
        sizes = (np.arange(block * _BLOCK, (block + 1) * _BLOCK) + 1) * q
        vec = self._weights[key] = self._block(problem, sizes)
    configs, idx, pred, kept, passed = vec
    i = idx[r]
    if i < 0:
      return None
    t = float(pred[r])
    if kept[r]:
      if np.isfinite(t):
        return Selection(configs[i], "heuristic", t,
                         note="the family's rule: the table's model predicts no config "
                              "faster by more than the family's heuristic_margin")
      return Selection(configs[i], "heuristic", None,
                       note="the family's rule: the table's model has no trusted "
                            "prediction for it, so no config is weighed against it")
    return Selection(configs[i], "model", t, note=self._passed_rule(problem, passed[r],
                                                                    configs[i]))

  def _passed_rule(self, problem, rule, config) -> str:
    """The note of a model answer given where the family's rule (read at the
    bucket's top size) cannot run ``problem``; "" where there was none."""
    if rule is None:
      return ""
    spec = self.spec
    try:
      spec.validate(problem, rule, self.hw)
      return ""
    except ValueError as e:
      return _cannot_run(spec, "the family's rule", rule, e,
                         "the table's model among the backends that run it", config)

  def _block(self, problem, sizes: np.ndarray):
    spec = self.spec
    configs, valid, g, l, aux = spec.decision_arrays(problem, sizes, self.hw)
    pred = self.table.predict_arrays(configs, g, l, aux)
    pred = np.where(valid, pred, np.inf)
    idx = np.argmin(pred, axis=1)
    best = pred[np.arange(len(sizes)), idx]
    idx = np.where(np.isfinite(best), idx, -1)
    margin = self.margin
    kept = [False] * len(sizes)
    passed = [None] * len(sizes)   # a rule of a backend that cannot run these sizes
    if margin is None:
      return configs, idx.tolist(), best, kept, passed
    configs = list(configs)
    heuristics = spec.heuristics(problem, sizes, self.hw)
    # Each distinct heuristic config is looked up once (a size-free
    # heuristic: once per block).
    index: dict = {}
    for h in dict.fromkeys(heuristics):
      index[h] = next((j for j, c in enumerate(configs) if c == h), None)
    # The heuristic's config stays unless the model predicts a gain over it
    # larger than the spec's margin, with a trusted prediction for both: a
    # sparse model is most wrong where it is most optimistic. Nor is a claim
    # believed below the floor of the fastest FLOP and byte rates any anchor
    # of the table reached (a measured roofline).
    floor = self._floor(problem, sizes)
    # The rule is read at each bucket's top size, where a backend that cannot
    # run this problem's sizes may run (the Mosaic decode kernel tiles a cache
    # of a multiple of 8 keys): such a rule is not a candidate here.
    runs = spec.decision_backends(problem, self.hw)
    for r, s in enumerate(sizes):
      if idx[r] < 0:
        continue
      h = heuristics[r]
      if spec.backend_of(h) not in runs:
        passed[r] = h
        continue
      j = index.get(h)
      # (A heuristic config outside the candidates has no column: it is
      # predicted on its own, at each size.)
      t_h = (pred[r, j] if j is not None and j < pred.shape[1]
             else self.table.predict(spec.with_size(problem, int(s)), [h])[0])
      model_wins = np.isfinite(t_h) and max(best[r], floor[r]) * (1.0 + margin) < t_h
      if not model_wins:
        if j is None:
          j = index[h] = len(configs)
          configs.append(h)
        idx[r], best[r], kept[r] = j, t_h, True
    return tuple(configs), idx.tolist(), best, kept, passed

  def _floor(self, problem, sizes) -> np.ndarray:
    """Per size, the least time the table's measured rates allow (0: unknown)."""
    if self.rates is None:
      return np.zeros(len(sizes))
    flops_rate, bytes_rate = self.rates
    out = np.zeros(len(sizes))
    for r, s in enumerate(sizes):
      w = self.spec.work(self.spec.with_size(problem, int(s)))
      if w is not None:
        out[r] = max(w[0] / flops_rate, w[1] / bytes_rate)
    return out


# --- state -------------------------------------------------------------------------------


class _State(threading.local):
  def __init__(self):
    self.policy: str | None = None    # context override
    self.pinned: dict = {}            # family -> config (context)
    self.tables: dict = {}            # family -> Table | None (context)


_global = {"policy": "auto", "pinned": {}, "tables": {}, "generation": 0}
_local = _State()
_lock = threading.Lock()
_memo: dict = {}   # state token -> {(problem, family, hardware): Selection}
_shipped: dict = {}   # (family, hardware) -> Decider | None
_warned: set = set()

# JAX's jit cache keys on both: the global generation (set globally, so a
# global change retraces inside a scoped block too, and in other threads),
# and this thread's scoped state (a ``with`` block's policy, pins, tables).
_gctx = jax.make_user_context(default_value=0) if hasattr(jax, "make_user_context") else None
_ctx = jax.make_user_context(default_value=()) if _gctx is not None else None


def _token():
  """Hashable description of the state that decisions depend on (cached per
  thread until the global generation or this thread's context changes)."""
  gen = _global["generation"]
  cached = _local.__dict__.get("token")
  if cached is not None and cached[0] == gen:
    return cached
  tok = (gen, _local.policy,
         tuple(sorted((k, repr(v)) for k, v in _local.pinned.items())),
         tuple(sorted((k, _serial(v)) for k, v in _local.tables.items())))
  _local.token = tok
  return tok


_serials = itertools.count(1)


def _serial(table) -> int:
  """A table's number for the jit cache key, never reused (an ``id`` is,
  once the table is freed: a later table there would hit a stale trace)."""
  if table is None:
    return 0
  return table.__dict__.setdefault("_wt_serial", next(_serials))


def _context_changed():
  _local.token = None
  _local.memo = None


def _state_memo() -> dict:
  """The memo of decisions under the current state (this thread's view)."""
  tok = _token()
  memo = _memo.get(tok)
  if memo is None:
    memo = _memo[tok] = {}
  _local.memo = (tok[0], memo)
  return memo


def _changed():
  """Global state changed: new generation, and jit caches keyed on it."""
  _global["generation"] += 1
  _memo.clear()
  if _gctx is not None:
    _gctx.set_global(_global["generation"])
  else:  # pragma: no cover - JAX without user contexts
    jax.clear_caches()


@contextlib.contextmanager
def _scoped() -> Iterator[None]:
  if _ctx is None:  # pragma: no cover
    jax.clear_caches()
    yield
    jax.clear_caches()
    return
  with _ctx(_token()[1:]):
    yield


def _check_policy(name: str) -> str:
  if name not in POLICIES:
    raise ValueError(f"unknown policy {name!r}; policies are {POLICIES}")
  return name


def set_policy(name: str) -> None:
  """Sets the global selection policy (``POLICIES``)."""
  _global["policy"] = _check_policy(name)
  _changed()


def get_policy() -> str:
  """The selection policy in force in this thread (``POLICIES``): the
  innermost :func:`policy` block's, else :func:`set_policy`'s (``"auto"``
  unless set)."""
  return _local.policy or _global["policy"]


@contextlib.contextmanager
def policy(name: str) -> Iterator[None]:
  """Selection policy inside a ``with`` block (this thread)."""
  old = _local.policy
  _local.policy = _check_policy(name)
  _context_changed()
  try:
    with _scoped():
      yield
  finally:
    _local.policy = old
    _context_changed()


@contextlib.contextmanager
def _override(field: str, family: str, value) -> Iterator[None]:
  """Sets ``_local.<field>[family]`` inside the block (this thread)."""
  old = dict(getattr(_local, field))
  getattr(_local, field)[family] = value
  _context_changed()
  try:
    with _scoped():
      yield
  finally:
    setattr(_local, field, old)
    _context_changed()


@contextlib.contextmanager
def use_config(family: str | Family, config) -> Iterator[None]:
  """Pins ``config`` (a config or a dict with its ``backend``) for every call
  of ``family`` inside the block. A dict naming only its ``"backend"`` pins
  that backend's rule for each call's problem, as ``config=`` does."""
  fam = get_family(family)
  coerced = fam.coerce_config(config)  # a wrong backend or field: a clear error here
  config = dict(config) if isinstance(config, dict) and set(config) == {"backend"} else coerced
  with _override("pinned", fam.name, config):
    yield


def load_tables(path: str, family: str | Family, *, hw: Hardware | str | None = None):
  """Loads a table file and makes it the active table of ``family`` (globally).

  Raises:
    TypeError: ``path`` is not a str or an ``os.PathLike``.
    tables.TableError: the file is missing, corrupt, or for another GPU or family.
  """
  fam = get_family(family)
  table = tables_lib.load(path, fam, get_hardware(hw))
  _global["tables"][fam.name] = table
  _changed()
  return table


@contextlib.contextmanager
def use_tables(table: tables_lib.Table | None, family: str | Family) -> Iterator[None]:
  """Uses ``table`` (None: no table, i.e. the heuristic) for ``family``
  inside the block.

  Raises:
    TypeError: ``table`` is not a table (read a file with :func:`load_tables`).
    ValueError: the table is another family's.
  """
  fam = get_family(family)
  if table is not None and not isinstance(table, tables_lib.Table):
    raise TypeError(f"table={table!r} must be a table as wt.load_tables(path, family) "
                    f"returns it, or None")
  if table is not None and table.family.name != fam.name:
    raise ValueError(f"the table is for family {table.family.name!r}, not {fam.name!r}")
  with _override("tables", fam.name, table):
    yield


def clear() -> None:
  """Forgets memoized decisions, loaded tables and settings (tests, reloads)."""
  _global.update(policy="auto", pinned={}, tables={})
  _shipped.clear()
  _warned.clear()
  refine_lib.clear()
  _changed()


def _warn_once(key, msg: str) -> None:
  if key not in _warned:
    _warned.add(key)
    warnings.warn(msg, stacklevel=4)


def _decider(spec: Family, hw: Hardware) -> Decider | None:
  if spec.name in _local.tables:
    t = _local.tables[spec.name]
    return None if t is None else _cached_decider(t, hw)
  if spec.name in _global["tables"]:
    return _cached_decider(_global["tables"][spec.name], hw)
  key = (spec.name, hw)
  if key not in _shipped:
    path = tables_lib.default_path(spec.name, hw.device_key)
    shipped = os.path.join(tables_lib.shipped_dir(), hw.device_key, f"{spec.name}.json")
    try:
      _shipped[key] = Decider(tables_lib.load(path, spec, hw), hw)
    except tables_lib.TableError as e:
      _shipped[key] = None
      fallback = "the heuristic config"
      # A stale or broken table of the user's folder: the shipped one instead
      # (a table of $WAVETUNE_TABLES is what the user asked for).
      if (not os.environ.get("WAVETUNE_TABLES") and os.path.realpath(path)
          != os.path.realpath(shipped) and os.path.isfile(shipped)):
        try:
          _shipped[key] = Decider(tables_lib.load(shipped, spec, hw), hw)
          fallback = f"the shipped table {shipped}"
        except tables_lib.TableError:
          pass
      if spec.tables_shipped or os.path.exists(path):  # (none expected: no warning)
        _warn_once(key[:1] + (hw.device_key,),
                   f"wavetune_jax: no usable {spec.name} table for {hw.device_key} "
                   f"({e}); using {fallback}")
  return _shipped[key]


_deciders: dict = {}


def _cached_decider(table, hw) -> Decider:
  d = _deciders.get((id(table), hw))
  if d is None or d.table is not table:
    d = _deciders[(id(table), hw)] = Decider(table, hw)
  return d


def active_table(family: str | Family, hw: Hardware | str | None = None):
  """The table the ``tables`` policy would use now (None: none usable)."""
  d = _decider(get_family(family), get_hardware(hw))
  return None if d is None else d.table


def select(family: str | Family, problem, hw: Hardware | str | None = None) -> Selection:
  """The config for ``problem`` of ``family`` on ``hw`` (default: where the
  ops run) under the current state (memoized).

  Args:
    family: a family's name (``"matmul"``) or a :class:`Family`.
    problem: a problem of that family (``family.problem_cls``, as
      :class:`~wavetune_jax.MatmulProblem` for ``"matmul"``).
    hw: a hardware preset's name, a :class:`Hardware`, or None.

  Raises:
    ValueError: an unknown family or hardware name.
    TypeError: ``family`` not a name or a Family, or ``problem`` not a
      problem of the family.
  """
  spec = get_family(family) if isinstance(family, str) else family
  if hw.__class__ is not Hardware:
    hw = get_hardware(hw)
  cached = _local.__dict__.get("memo")
  memo = cached[1] if cached is not None and cached[0] == _global["generation"] else _state_memo()
  try:
    key = (problem, spec.name, hw.device_key, hw.interpret)
    hit = memo.get(key)
  except (AttributeError, TypeError):  # not a Family, or an unhashable problem
    _check_select(spec, family, problem)
    raise
  if hit is not None:
    return hit
  # The arguments' kinds are checked on a miss only: a problem of another
  # family is never memoized, so a hit is of the right kind.
  _check_select(spec, family, problem)
  with _lock:
    hit = memo.get(key)  # another thread may have decided it meanwhile
    if hit is not None:
      return hit
    t0 = time.perf_counter()
    sel = memo[key] = _select(spec, problem, hw)
    _decided[0] += 1
    _decided[1] += time.perf_counter() - t0
  return sel


def _check_select(spec, family, problem) -> None:
  if not isinstance(spec, Family):
    raise TypeError(f"family={family!r} must be a family name (one of "
                    f"{list(registered())}) or a Family")
  cls = getattr(spec, "problem_cls", None)
  if cls is not None and not isinstance(problem, cls):
    raise TypeError(f"problem={problem!r} must be an instance of {cls.__name__} (the "
                    f"problems of family {spec.name!r}); got {type(problem).__name__}")


_decided = [0, 0.0]  # decisions made (memo misses), seconds spent making them


def decision_stats() -> tuple[int, float]:
  """``(decisions, seconds)``: the selections this process has made that
  were not memoized, and the wall time they took (table loads included;
  under the ``exhaustive`` policy, its measurements). The memoized path is
  not counted."""
  return _decided[0], _decided[1]


def pinned(spec: Family):
  """The config ``wt.use_config`` pins for ``spec`` here (this thread's
  block, else the global pin), or None."""
  return _local.pinned.get(spec.name, _global["pinned"].get(spec.name))


def _select(spec: Family, problem, hw: Hardware) -> Selection:
  pinned = _local.pinned.get(spec.name, _global["pinned"].get(spec.name))
  if isinstance(pinned, dict):  # a backend only: its rule for this problem
    try:
      rule = spec.backend(pinned["backend"]).heuristic(problem, hw)
    except ValueError:
      rule = None
    return Selection(spec.coerce_config(pinned) if rule is None else rule, "explicit")
  if pinned is not None:
    return Selection(pinned, "explicit")
  return _with_unrunnable(spec, problem, hw, _by_policy(spec, problem, hw))


def _by_policy(spec: Family, problem, hw: Hardware) -> Selection:
  pol = get_policy()
  if pol == "fixed":
    config = spec.default(problem)
    if not spec.supports(config, hw):
      return Selection(spec.heuristic(problem, hw), "heuristic",
                       note=_passed_over("the fixed default", spec, config, hw))
    try:
      spec.validate(problem, config, hw)
    except ValueError as e:  # (shared memory, 32-bit offsets, ...)
      rule = spec.heuristic(problem, hw)
      return Selection(rule, "heuristic", note=_cannot_run(
          spec, "the fixed default", config, e, "the family's rule", rule))
    return Selection(config, "fixed")
  if pol == "heuristic":
    return Selection(spec.heuristic(problem, hw), "heuristic")
  if pol == "exhaustive":
    return _exhaustive(spec, problem, hw)
  sel, d = _from_tables(spec, problem, hw)
  if pol == "refine" or (pol == "auto" and _can_measure(hw)):
    sel = _refined(spec, problem, hw, d, sel)
  return sel


def _with_unrunnable(spec: Family, problem, hw: Hardware, sel: Selection) -> Selection:
  """``sel`` with, where it runs a platform op, why a backend of this GPU
  that can say so (its ``why_not``) does not run ``problem`` (the Mosaic
  quantized kernels' layouts and multiples, say): otherwise the note
  explains only the candidates there were."""
  try:
    chosen = spec.backend_of(sel.config)
  except Exception:  # noqa: BLE001 - an explanation never fails the user's call
    return sel
  if not chosen.platform:
    return sel
  why = []
  for b in spec.available(hw):
    check = getattr(b, "why_not", None)
    if check is None or b is chosen:
      continue
    try:
      reason = check(problem)
    except Exception:  # noqa: BLE001 - an explanation never fails the user's call
      continue
    if reason and reason not in sel.note:
      why.append(f"{b.name} does not run it: {reason}")
  if not why:
    return sel
  return dataclasses.replace(sel, note="; ".join([n for n in (sel.note, *why) if n]))


def _can_measure(hw: Hardware) -> bool:
  """``auto`` refines where the ops run on a GPU (not a preset named on
  another machine) and the table-cache folder is set."""
  return table_cache.cache_dir() is not None and _on_this_gpu(hw)


def _on_this_gpu(hw: Hardware) -> bool:
  """Whether ``hw`` is the GPU the ops run on (measuring is possible)."""
  if hw.interpret:
    return False
  try:
    return hardware_lib.current() == hw
  except Exception:  # noqa: BLE001 - no GPU: nothing to measure on
    return False


@contextlib.contextmanager
def measuring_off() -> Iterator[None]:
  """No first-use measurement inside the block (this thread): the ops called
  from XLA's partitioner, inside its compile, use the tables' answer."""
  old = _local.__dict__.get("no_measure", False)
  _local.no_measure = True
  try:
    yield
  finally:
    _local.no_measure = old


def _refined(spec: Family, problem, hw: Hardware, d, sel: Selection) -> Selection:
  if _local.__dict__.get("no_measure") or not _on_this_gpu(hw):
    return sel
  got = refine_lib.refine(spec, problem, hw, d, sel.config, table_cache.cache_dir())
  if got is None:
    return sel
  config, us, note = got
  return Selection(config, "measured", us, note=note)


def refinement_stats() -> dict:
  """What first-use refinement did in this process
  (:func:`wavetune_jax.runtime.refine.stats`)."""
  return refine_lib.stats()


def _from_tables(spec: Family, problem, hw: Hardware):
  """``(selection, decider)``: the table's answer (exact -> model ->
  heuristic) after the guard; decider None without a table."""
  # A first decision (a table's load, a new weight's block) allocates many
  # objects it keeps; the collector, paused meanwhile, would walk all of
  # JAX's objects each time (tables_lib.gc_paused).
  with tables_lib.gc_paused():
    d = _decider(spec, hw)
    if d is None:
      return _guarded(spec, problem, hw, None, Selection(
          spec.heuristic(problem, hw), "heuristic", note="no table")), None
    # A table read through the parsed-table cache keeps a record of its
    # decisions, stored with it at exit, so a later process answers these
    # problems without building candidates (a decision is a function of the
    # table's bytes, the hardware and the code, which the cache's key holds).
    # The record is keyed by the problem's fields (the cache stores them,
    # not problems), so a kept config is checked against the problem here.
    kept = d.table.__dict__.get("_cache_key") is not None
    decided = d.table.__dict__.setdefault("_decided", {}) if kept else {}
    at = (problem._key, hw) if kept else None
    hit = decided.get(at)
    # (A kept decision of a backend that no longer runs here, say after an
    # upgrade to a JAX without Triton, is decided again.)
    if hit is not None and spec.supports(hit.config, hw):
      try:
        spec.validate(problem, hit.config, hw)
        _say_instead(spec, problem, hit)
        return hit, d
      except ValueError as e:  # an entry edited or written by other code
        table_cache.bad_decision(problem, hit, e)
        decided.pop(at, None)
    sel = d.decide(problem)
  if sel is None:
    sel = Selection(spec.heuristic(problem, hw), "heuristic",
                    note="outside the model's trust region")
  else:
    g, _ = spec.coords(problem, sel.config)
    e = d.table.entries.get(spec.variant(sel.config))
    waves = -(-g // (e.occupancy * hw.num_sms)) if e is not None else None
    sel = dataclasses.replace(sel, waves=waves)
  _say_instead(spec, problem, sel)
  sel = _guarded(spec, problem, hw, d, sel)
  if kept and len(decided) < _MAX_KEPT_DECISIONS:
    decided[at] = sel
    if not _dirty:
      atexit.register(_persist_decisions)
    _dirty[id(d.table)] = d.table
  return sel, d


_CANNOT_RUN = "cannot run this problem"
_INSTEAD = "runs it instead"


def _cannot_run(spec: Family, what: str, config, error, answer: str, chosen) -> str:
  """A selection's note: ``what`` (``config``) cannot run the problem, why,
  and what answered (``chosen``), saying where that is another backend."""
  b, c = spec.backend_of(config).name, spec.backend_of(chosen).name
  instead = f"; the {c} backend {_INSTEAD}" if c != b else ""
  return f"{what}, a {b} config, {_CANNOT_RUN} ({error}); {answer}{instead}"


def _say_instead(spec: Family, problem, sel: Selection) -> None:
  """One warning per process and family where a table's answer could not
  run a problem and another backend runs it (maybe slower), as decided now
  or read back with a cached table."""
  if _CANNOT_RUN in sel.note and _INSTEAD in sel.note:
    _warn_once(("instead", spec.name),
               f"wavetune_jax.{spec.name} {spec.problem_key(problem)}: {sel.note} "
               f"(maybe slower; warned once per process)")


_NO_EVIDENCE: dict = {}


def _guarded(spec: Family, problem, hw: Hardware, d, sel: Selection) -> Selection:
  """``sel``, or the platform config where the guard finds no evidence for
  it (on a GPU; in interpret mode speed is not the question)."""
  if hw.interpret:
    return sel
  if d is not None:
    ev = d.table.guard(hw)
  else:
    ev = _NO_EVIDENCE.get((spec.name, hw))
    if ev is None:
      ev = _NO_EVIDENCE[(spec.name, hw)] = guard_lib.Evidence(spec, hw, [])
  ok, why = ev.allows(problem, sel.config)
  if ok:
    return sel
  plat = spec.platform_config(problem, hw)
  if guard_lib.trusted(spec, problem, sel.config, plat, hw):
    return sel
  return Selection(plat, "guard", note=f"kept the platform op: {why} (the {sel.source} "
                                        f"answer was a {spec.backend_of(sel.config).name} "
                                        f"config)")


def _passed_over(what: str, spec: Family, config, hw: Hardware, note: str = "") -> str:
  """A selection's note: ``what`` (a config of a backend that cannot run on
  ``hw``) was passed over, and why."""
  b = spec.backend_of(config)
  why = b.unavailable_reason(hw) or "it cannot run here"
  return f"{what} is a {b.name} config, passed over: {why}" + (f"; {note}" if note else "")


#: Decisions kept with a table for later processes, at most: each adds to
#: reading the entry back (a server that sees every M would otherwise make
#: the read slower than deciding).
_MAX_KEPT_DECISIONS = 1024
_dirty: dict = {}   # id -> table with decisions not yet in the parsed-table cache


def _persist_decisions() -> None:
  """At exit: rewrites the cache entry of each table that decided something
  new, its decisions included (one file write per table)."""
  for table in list(_dirty.values()):
    tables_lib.store_in_cache(table, merge=True, limit=_MAX_KEPT_DECISIONS)
  _dirty.clear()


def _exhaustive(spec: Family, problem, hw: Hardware) -> Selection:
  """Times the whole space now (GPU only) and keeps the fastest."""
  if hw.interpret:
    _warn_once(("exhaustive", spec.name), "wavetune_jax: policy 'exhaustive' needs a GPU; "
                                          "using the heuristic config")
    return Selection(spec.heuristic(problem, hw), "heuristic", note="no GPU to time on")
  from wavetune_jax.tuning import measure, profiler
  configs = spec.space(problem, hw)
  # Trace time may be inside a jit: measure on concrete arrays outside it.
  with jax.ensure_compile_time_eval():
    rows = measure.measure_points(spec, profiler.Profiler(iterations=10),
                                  [(problem, configs)])
    ok = [(m.median_us, configs.index(c)) for _, _, c, m in rows if m.status == "ok"]
  if not ok:
    return Selection(spec.heuristic(problem, hw), "heuristic", note="every config failed")
  us, i = min(ok)
  return Selection(configs[i], "exhaustive", us)
