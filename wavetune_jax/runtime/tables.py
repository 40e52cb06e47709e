"""Dual tables on disk: exact (problem -> config) and model (wave models).

``tables/<device_key>/<family>.json``, plain JSON::

  {"format": "wavetune-table", "schema": 2, "family": "matmul",
   "revisions": {"triton": 1}, "device_kind": "NVIDIA H200",
   "device_key": "nvidia_h200", "num_sms": 132,
   "provenance": {"command", "date", "jax_version", "mode": "gpu" | "replay",
                  "source", "budget", "anchors", "gpu_seconds", "pool_problems"},
   "model": {"form": "bilinear", "aux_names": [...], "trust": 1.5,
             "distance_penalty": 0.3,
             "entries": [{"variant": {"backend": name, ...}, "occupancy", "coef": [...], "points",
                          "min_g", "max_g", "min_l", "max_l", "aux_seen": [...],
                          "fit_med_err"}]},
   "exact": [{"problem": {...}, "config": {"backend": name, ...}, "us"}],
   "anchors": [{"problem": {...}, "config": {"backend": name, ...}, "us"}]}

Model variants and configs name their backend (schema 2; schema 1 files,
written when a family had one config class, are rebuilt by the replay command
in their provenance). ``revisions`` holds the kernel revision of each backend
the table was tuned for; a table tuned for another revision is not used.

Written atomically (temp file + rename). :func:`load` validates the file and
every entry (an exact config invalid for its problem, a negative or
non-finite coefficient, time or trust bound, a non-positive SM count or
occupancy) and raises :class:`TableError` naming the entry; the selector turns
that into one warning and the heuristic.

A model entry answers only inside its *trust region*: ``min_g / trust <= G <= trust * max_g``,
``min_l / trust <= L <= trust * max_l``, and an auxiliary column may be
non-zero only if one of its anchors had it non-zero (a tile never anchored with
split-K does not know what the reduction costs). ``trust`` null in the file
means no box (the models answer everywhere). Without that, the argmin over
~140 configs finds the one whose extrapolation is most optimistic: on the H200
sweep, held-out selection picked a 32x256 tile at M = 512 whose model, fitted
on small M only, predicted 135 us for a 411 us kernel.

Inside the trust region a prediction is still scaled by ``1 + distance_penalty
* d``, ``d`` the L1 distance in ``(log G, log L)`` from the query to the nearest
anchor of the entry's variant: the further a prediction extrapolates, the less it
is believed, so the argmin prefers configs measured near the query. A table
without the field (written before it existed) uses 0. Held-out numbers for the
values tried are in docs/design.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import json
import math
import os
import tempfile
import threading
from typing import Sequence

import numpy as np

from wavetune_jax.core.family import Family
from wavetune_jax.core.hardware import Hardware
from wavetune_jax.runtime import table_cache, wave_model

__all__ = ["FORMAT", "SCHEMA", "TableError", "ModelEntry", "Table", "load", "save",
           "default_path", "shipped_dir", "user_dir", "user_path"]

FORMAT = "wavetune-table"
SCHEMA = 2
DEFAULT_TRUST = 1.5
DEFAULT_DISTANCE_PENALTY = 0.3



#: Anchor slots searched for most variants (see ``Table._distance``).
_FEW_ANCHORS = 8
#: The largest coefficient (the models are evaluated in float32).
_F32_MAX = float(np.finfo(np.float32).max)
#: The most SMs a table's GPU may have.
_MAX_SMS = 2**16
#: The largest size of a table's problems (the kernels' 32-bit offsets; the
#: selector's arrays of sizes and coordinates).
_MAX_SIZE = 2**31 - 1

class TableError(ValueError):
  """A table file that cannot be used (missing, corrupt, foreign, stale)."""


@dataclasses.dataclass(frozen=True)
class ModelEntry:
  """The fitted wave model of one variant (config minus folded fields)."""

  variant: tuple            # (("backend", name), (field, value), ...)
  occupancy: int
  coef: tuple[float, ...]
  points: int
  min_g: int
  max_g: int
  min_l: float
  max_l: float
  aux_seen: tuple[bool, ...]
  fit_med_err: float

  def to_json(self) -> dict:
    d = dataclasses.asdict(self)
    d["variant"] = dict(self.variant)
    return d

  @classmethod
  def from_json(cls, d: dict, family: Family) -> "ModelEntry":
    """Parses and checks one entry; raises ``TableError`` naming it."""
    if not isinstance(d, dict):
      raise TableError(f"model entry {_short(d)} is not an object")
    where = f"model entry {_short(d.get('variant'))}"
    try:
      variant = family.variant_from_dict(d["variant"])
      e = cls(variant=variant, occupancy=_int(d["occupancy"]),
              coef=tuple(_num(x) for x in d["coef"]), points=_int(d["points"]),
              min_g=_int(d["min_g"]), max_g=_int(d["max_g"]), min_l=_num(d["min_l"]),
              max_l=_num(d["max_l"]), aux_seen=tuple(bool(x) for x in d["aux_seen"]),
              fit_med_err=_num(d["fit_med_err"]))
    except (KeyError, TypeError, ValueError) as err:
      raise TableError(f"{where}: {type(err).__name__}: {err}") from None
    bad = [name for name, v in (("occupancy", e.occupancy), ("min_g", e.min_g),
                                ("max_g", e.max_g), ("min_l", e.min_l), ("max_l", e.max_l))
           if not (math.isfinite(v) and v > 0)]
    if not all(0 <= c <= _F32_MAX for c in e.coef):  # (NaN fails too)
      bad.append("coef")
    if not (math.isfinite(e.fit_med_err) and e.fit_med_err >= 0):
      bad.append("fit_med_err")
    if e.min_g > e.max_g or e.min_l > e.max_l:
      bad.append("min > max")
    if bad:
      raise TableError(f"{where}: invalid {', '.join(bad)} (coefficients, bounds and "
                       f"occupancy must be finite and positive; coefficients float32)")
    return e


@dataclasses.dataclass
class Table:
  """One family's tables for one GPU model."""

  family: Family
  device_kind: str
  device_key: str
  num_sms: int
  form: str
  entries: dict             # variant -> ModelEntry
  exact: dict               # problem -> (config, us)
  anchors: list             # [(problem, config, us)]
  provenance: dict
  trust: float = DEFAULT_TRUST
  distance_penalty: float = DEFAULT_DISTANCE_PENALTY
  #: The guard's evidence: ``[(problem, {backend: best us})]`` (empty: the
  #: anchors are), and the versions it was measured with.
  evidence: list = dataclasses.field(default_factory=list)
  evidence_versions: dict = dataclasses.field(default_factory=dict)
  #: The fastest measured config at each evidence problem (the ranking's
  #: neighbours: first-use refinement measures what won next door).
  winners: dict = dataclasses.field(default_factory=dict)

  # --- the guard ---------------------------------------------------------------------
  def guard(self, hw: Hardware):
    """The :class:`~wavetune_jax.runtime.guard.Evidence` of this table on
    ``hw`` (built once per hardware)."""
    from wavetune_jax.runtime import guard
    memo = self.__dict__.setdefault("_guards", {})
    ev = memo.get(hw)
    if ev is None:
      rows = self.evidence or guard.evidence_rows(self.family, self.anchors)
      ev = memo[hw] = guard.Evidence(self.family, hw, rows,
                                     measured_with=self.evidence_versions)
    return ev

  # --- the model -------------------------------------------------------------------
  def predict_arrays(self, configs: Sequence, g: np.ndarray, l: np.ndarray,
                     aux: np.ndarray, *, trusted: bool = True) -> np.ndarray:
    """Predicted us ``[S, n]`` of ``configs`` at coordinates ``[S, n]``.

    Configs without a model, or (``trusted=True``) outside their trust region,
    get ``inf``.
    """
    idx = self._config_idx(configs)
    # Only the configs whose variant has a model are evaluated (a new
    # weight's candidates are mostly without one): the rest are inf.
    cols = np.flatnonzero(idx)
    out = np.full(np.broadcast_shapes(np.shape(g), np.shape(l)), np.inf)
    if cols.size == 0:
      return out
    full = cols.size == len(idx)
    pick = (lambda x: x) if full else (lambda x: x[..., cols])  # noqa: E731
    g, l = pick(np.broadcast_to(g, out.shape)), pick(np.broadcast_to(l, out.shape))
    aux = aux if full else aux[..., cols, :]
    coef, cap, lim, near, n_near = self._arrays_at(idx[cols])
    with np.errstate(invalid="ignore", divide="ignore"):
      t = wave_model.predict_np(coef, g, l, cap, self.form, aux).astype(np.float64)
      if trusted and self.distance_penalty:
        d = self._distance(g, l, near, n_near)
        t = t * (1.0 + self.distance_penalty * np.where(np.isfinite(d), d, 0.0))
    min_g, max_g, min_l, max_l, aux_ok = lim
    bad = ~np.isfinite(cap)
    if trusted:
      bad = bad | (g > self.trust * max_g) | (l > self.trust * max_l)
      bad = bad | (g * self.trust < min_g)
      bad = bad | (l * self.trust < min_l)
      if aux.shape[-1]:
        bad = bad | np.any((aux != 0) & ~aux_ok, axis=-1)
    t = np.where(bad, np.inf, t)
    if full:
      return t
    out[..., cols] = t
    return out

  def anchor_distance(self, configs: Sequence, g: np.ndarray, l: np.ndarray, *,
                      near: np.ndarray | None = None) -> np.ndarray:
    """L1 distance in ``(log G, log L)`` from each point ``[S, n]`` to the
    nearest anchor of its config's variant (``inf``: the variant has none)."""
    if near is None:
      near = self._entry_arrays(tuple(configs))[3]
    return self._distance(g, l, near)

  @classmethod
  def _distance(cls, g: np.ndarray, l: np.ndarray, near: np.ndarray,
                n_near: np.ndarray | None = None) -> np.ndarray:
    # A few variants (XLA's op, measured at every anchored problem) have many
    # anchors; the rest a handful: pad each group to its own width.
    few = _FEW_ANCHORS
    if n_near is not None and near.shape[1] > few and np.any(n_near <= few):
      small = n_near <= few
      d = np.empty(np.broadcast_shapes(np.shape(g), np.shape(l)), np.float32)
      g, l = np.broadcast_to(g, d.shape), np.broadcast_to(l, d.shape)
      d[..., small] = cls._distance(g[..., small], l[..., small], near[small, :few])
      if not small.all():
        big = ~small
        d[..., big] = cls._distance(g[..., big], l[..., big], near[big])
      return d
    lg = np.log(np.maximum(g, 1.0)).astype(np.float32)
    ll = np.log(np.maximum(l, 1e-3)).astype(np.float32)
    if lg.size * near.shape[1] <= 1 << 16:  # small (one size): all anchors at once
      return np.min(np.abs(lg[..., None] - near[:, :, 0]) + np.abs(ll[..., None] - near[:, :, 1]),
                    axis=-1)
    d = np.full(lg.shape, np.inf, np.float32)
    step = np.empty_like(d)
    for j in range(near.shape[1]):  # nearest anchor, one anchor slot at a time
      np.subtract(lg, near[:, j, 0], out=step)
      np.abs(step, out=step)
      d2 = np.abs(ll - near[:, j, 1])
      np.add(step, d2, out=step)
      np.minimum(d, step, out=d)
    return d

  def _entry_arrays(self, configs: tuple):
    return self._arrays_at(self._config_idx(configs))[:4]

  def _arrays_at(self, idx: np.ndarray):
    a = self._config_rows()["arrays"]
    return (a["coef"][idx], a["cap"][idx],
            (a["min_g"][idx], a["max_g"][idx], a["min_l"][idx], a["max_l"][idx],
             a["aux_ok"][idx]), a["near"][idx], a["n_near"][idx])

  def _config_idx(self, configs) -> np.ndarray:
    """Each config's row of the per-variant arrays (0: no model)."""
    rows = self._config_rows()
    # Each config's row of the per-variant arrays (row 0: no model), through
    # a memo keyed by the config object's id (it holds the config, so the id
    # stays its own): configs are interned by the backends, so a new weight
    # brings configs seen before, found without hashing their fields.
    memo = rows["memo"]
    idx = np.empty(len(configs), np.int64)
    for i, c in enumerate(configs):
      hit = memo.get(id(c))
      if hit is None or hit[0] is not c:
        hit = memo[id(c)] = (c, rows["row"].get(self.family.variant(c), 0))
      idx[i] = hit[1]
    return idx

  def _config_rows(self) -> dict:
    """Per-variant model arrays, row 0 for configs without a model."""
    hit = self.__dict__.get("_rows")
    if hit is not None:
      return hit
    variants = list(self.entries)
    n = len(variants) + 1
    n_coef = wave_model.n_coef(self.form, len(self.family.aux_names))
    pts = self._anchor_coords()
    k = max((len(v) for v in pts.values()), default=1)
    a = {"coef": np.zeros((n, n_coef), np.float32), "cap": np.full(n, np.inf, np.float32),
         "min_g": np.zeros(n), "max_g": np.zeros(n), "min_l": np.zeros(n),
         "max_l": np.zeros(n), "aux_ok": np.zeros((n, len(self.family.aux_names)), bool),
         "near": np.full((n, k, 2), np.inf, np.float32),  # (log G, log L) of anchors
         "n_near": np.zeros(n, np.int64)}
    for i, v in enumerate(variants, start=1):
      e = self.entries[v]
      if v in pts:
        a["near"][i, :len(pts[v])] = pts[v]
        a["n_near"][i] = len(pts[v])
      a["coef"][i] = e.coef
      a["cap"][i] = e.occupancy * self.num_sms
      a["min_g"][i], a["max_g"][i], a["min_l"][i], a["max_l"][i] = (
          e.min_g, e.max_g, e.min_l, e.max_l)
      a["aux_ok"][i] = e.aux_seen
    hit = self.__dict__["_rows"] = {"arrays": a, "memo": {},
                                    "row": {v: i for i, v in enumerate(variants, start=1)}}
    return hit

  def peak_rates(self) -> tuple[float, float] | None:
    """The fastest FLOP/us and byte/us any anchor reached, or None (a family
    without :meth:`Family.work`, or no anchors): the selector's measured
    floor. Computed once per anchor list (tables are not edited in place
    after loading)."""
    memo = self.__dict__.get("_peak_rates")
    if memo is None or memo[0] is not self.anchors:
      flops_rate = bytes_rate = 0.0
      for p, _, us in self.anchors:
        w = self.family.work(p) if us and us > 0 else None
        if w is not None:
          flops_rate = max(flops_rate, w[0] / us)
          bytes_rate = max(bytes_rate, w[1] / us)
      rates = (flops_rate, bytes_rate) if flops_rate > 0 and bytes_rate > 0 else None
      memo = self.__dict__["_peak_rates"] = (self.anchors, rates)
    return memo[1]

  def _anchor_coords(self) -> dict:
    """variant -> ``[n, 2]`` (log G, log L) of its measured anchors."""
    hit = self.__dict__.get("_anchor_xy")
    if hit is None:
      spec = self.family
      pts: dict = {}
      for p, c, us in self.anchors:
        if us is not None:
          g, l = spec.coords(p, c)
          pts.setdefault(spec.variant(c), []).append((np.log(max(g, 1.0)),
                                                      np.log(max(l, 1e-3))))
      hit = self.__dict__["_anchor_xy"] = {v: np.asarray(x) for v, x in pts.items()}
    return hit

  def predict(self, problem, configs: Sequence, *, trusted: bool = True) -> np.ndarray:
    """Predicted us of each config at one problem (``inf``: no answer)."""
    spec = self.family
    g = np.empty(len(configs), np.int64)
    l = np.empty(len(configs), np.float64)
    aux = np.zeros((len(configs), len(spec.aux_names)), np.float32)
    for i, c in enumerate(configs):
      g[i], l[i] = spec.coords(problem, c)
      aux[i] = spec.aux(problem, c)
    return self.predict_arrays(configs, g, l, aux, trusted=trusted)

  # --- (de)serialisation ---------------------------------------------------------------
  def to_json(self) -> dict:
    spec = self.family
    used = sorted({dict(v)["backend"] for v in self.entries}
                  | {spec.backend_of(c).name for c, _ in self.exact.values()}
                  | {b for _, us in self.evidence for b in us})
    out = {
        "format": FORMAT, "schema": SCHEMA, "family": spec.name,
        "revisions": {b: spec.backend(b).revision for b in used},
        "device_kind": self.device_kind,
        "device_key": self.device_key, "num_sms": self.num_sms,
        "provenance": self.provenance,
        "model": {"form": self.form, "aux_names": list(spec.aux_names), "trust": None if math.isinf(self.trust) else self.trust,
                  "distance_penalty": self.distance_penalty,
                  "entries": [e.to_json() for e in
                              sorted(self.entries.values(), key=lambda e: e.variant)]},
        "exact": [{"problem": spec.problem_to_dict(p), "config": spec.config_to_dict(c),
                   "us": us} for p, (c, us) in
                  sorted(self.exact.items(), key=lambda kv: spec.problem_key(kv[0]))],
        "anchors": [{"problem": spec.problem_to_dict(p), "config": spec.config_to_dict(c),
                     "us": us} for p, c, us in self.anchors],
    }
    if self.evidence:
      out["evidence"] = {
          "versions": dict(self.evidence_versions),
          "rows": [{"problem": spec.problem_to_dict(p), "us": dict(sorted(us.items())),
                    **({"best": spec.config_to_dict(self.winners[p])}
                       if p in self.winners else {})}
                   for p, us in sorted(self.evidence,
                                       key=lambda r: spec.problem_key(r[0]))]}
    return out


def shipped_dir() -> str:
  """Where shipped tables live: the installed copy (the data package
  ``wavetune_jax.shipped_tables`` that a wheel carries), else the
  repository's ``tables/`` in a source checkout (next to ``setup.py``; a
  ``tables`` folder of another package in site-packages is not ours)."""
  package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  installed = os.path.join(package, "shipped_tables")
  if os.path.isdir(installed):
    return installed
  root = os.path.dirname(package)
  repo = os.path.join(root, "tables")
  if os.path.isdir(repo) and os.path.isfile(os.path.join(root, "setup.py")):
    return repo
  return installed


def user_dir() -> str:
  """The user's tables, where ``wavetune tune`` writes by default:
  ``$XDG_DATA_HOME/wavetune/tables``, default ``~/.local/share/wavetune/tables``."""
  data = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local",
                                                         "share")
  return os.path.join(data, "wavetune", "tables")


def user_path(family: str, device_key: str) -> str:
  """Where ``wavetune tune`` writes a table by default: in ``$WAVETUNE_TABLES``
  when it is set, else in :func:`user_dir`."""
  folder = os.path.expanduser(os.environ.get("WAVETUNE_TABLES") or user_dir())
  return os.path.join(folder, device_key, f"{family}.json")


def default_path(family: str, device_key: str) -> str:
  """The table the selector reads for ``family`` on ``device_key``: in
  ``$WAVETUNE_TABLES`` when it is set (missing there: no table), else the
  user's (:func:`user_dir`) when it has the file, else the shipped one."""
  name = os.path.join(device_key, f"{family}.json")
  env = os.environ.get("WAVETUNE_TABLES")
  if env:
    return os.path.join(os.path.expanduser(env), name)
  user = os.path.join(user_dir(), name)
  return user if os.path.isfile(user) else os.path.join(shipped_dir(), name)


def save(table: Table, path: str) -> None:
  """Writes ``table`` atomically."""
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), suffix=".tmp")
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(table.to_json(), f, indent=1)
      f.write("\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, path)
  except BaseException:
    if os.path.exists(tmp):
      os.unlink(tmp)
    raise


def _require(d: dict, key: str, kind, where: str):
  if key not in d:
    raise TableError(f"{where}: missing {key!r}")
  v = d[key]
  if not isinstance(v, kind) or isinstance(v, bool) and kind is not bool:
    raise TableError(f"{where}: {key!r} should be {getattr(kind, '__name__', kind)}, "
                     f"got {type(v).__name__}")
  return v


#: Integers of a table fit 64 bits (the selector's arrays hold them).
_INT_LIMIT = 2**63


def _int(v) -> int:
  if isinstance(v, bool) or not isinstance(v, int):
    raise ValueError(f"{_short(v)} is not an integer")
  if not -_INT_LIMIT <= v < _INT_LIMIT:
    raise ValueError(f"{_short(v)} does not fit 64 bits")
  return v


def _num(v) -> float:
  if isinstance(v, bool) or not isinstance(v, (int, float)):
    raise ValueError(f"{_short(v)} is not a number")
  try:
    return float(v)
  except OverflowError:  # an integer literal past float's range
    raise ValueError(f"{_short(v)} is too large for a float") from None


def _short(v, limit: int = 80) -> str:
  """``repr(v)``, cut to ``limit`` characters (a hostile file's values may
  be huge: an int of 400 digits, a list of thousands)."""
  try:
    r = repr(v)
  except ValueError:  # an int past Python's digit limit for str()
    return f"<an int of about {v.bit_length() * 0.30103:.0f} digits>"
  return r if len(r) <= limit else r[:limit - 3] + "..."


def _parsed(memo: dict | None, kind: str, d, parse):
  """``parse(d)``, memoized on the dict's items (records repeat problems and
  configs: a table's anchors visit a few hundred problems)."""
  if memo is None or not isinstance(d, dict):
    return parse(d)
  try:
    key = (kind, tuple(sorted(d.items())))
    hash(key)
  except TypeError:  # unhashable values: parse (and fail) as usual
    return parse(d)
  if key not in memo:
    memo[key] = parse(d)
  return memo[key]


def _record(r, family: Family, hw: Hardware | None, kind: str, memo: dict | None = None):
  """``(problem, config, us)`` of an exact or anchor record, checked."""
  if not isinstance(r, dict):
    raise TableError(f"{kind} entry {_short(r)} is not an object")
  where = f"{kind} entry {_short(r.get('problem'))}"
  try:
    p = _parsed(memo, "problem", r["problem"], family.problem_from_dict)
    if any(v.__class__ is int and v > _MAX_SIZE for v in p._key):
      raise ValueError(f"a problem size is larger than {_MAX_SIZE} (2**31 - 1)")
    c = _parsed(memo, "config", r["config"], family.config_from_dict)
    us = _num(r["us"])
    if memo is None or (p, c, hw) not in memo:
      # An entry of a backend this process cannot run (a Triton config where
      # this JAX has no Triton lowering) is kept: the selector passes it over.
      runs = hw is None or family.backend_of(c).supported_on(hw)
      family.validate(p, c, hw if runs else None)
      if memo is not None:
        memo[(p, c, hw)] = True
  except (KeyError, TypeError, ValueError) as err:
    raise TableError(f"{where}: {type(err).__name__}: {err}") from None
  if not (math.isfinite(us) and us > 0):
    raise TableError(f"{where}: time {us!r} us must be finite and positive")
  return p, c, us


def from_json(d, family: Family, hw: Hardware | None, where: str = "table") -> Table:
  """Validates a parsed table against ``family`` and (if given) ``hw``."""
  spec = family
  if not isinstance(d, dict) or d.get("format") != FORMAT:
    raise TableError(f"{where} is not a wavetune table (format {FORMAT!r} missing)")
  if d.get("schema") != SCHEMA:
    raise TableError(f"{where} has schema {_short(d.get('schema'))}; this version reads {SCHEMA} "
                     f"(rebuild it with the command in its provenance)")
  if d.get("family") != spec.name:
    raise TableError(f"{where} is for family {_short(d.get('family', d.get('kernel')))}, "
                     f"not {spec.name!r}")
  revisions = _require(d, "revisions", dict, where)
  for b, rev in revisions.items():
    try:
      now = spec.backend(b).revision
    except ValueError:
      raise TableError(f"{where} has configs of backend {_short(b)}, which the {spec.name} "
                       f"family does not have") from None
    if rev != now:
      raise TableError(f"{where} was tuned for revision {_short(rev)} of the {spec.name} {b} "
                       f"kernel; this is revision {now}: retune")
  device_key = _require(d, "device_key", str, where)
  if hw is not None and device_key != hw.device_key:
    raise TableError(f"{where} is for {_short(device_key)}, not for {hw.device_key!r} (the "
                     f"GPU it is loaded for)")
  num_sms = _require(d, "num_sms", int, where)
  if not 1 <= num_sms <= _MAX_SMS:
    raise TableError(f"{where}: num_sms={_short(num_sms)} must be in [1, {_MAX_SMS}]")
  if hw is not None and num_sms != hw.num_sms:
    raise TableError(f"{where}: num_sms={num_sms}, but {hw.device_key!r} has {hw.num_sms} "
                     f"SMs (its waves would be counted wrong)")
  model = _require(d, "model", dict, where)
  form = _require(model, "form", str, where + ".model")
  if form not in wave_model.FORMS:
    raise TableError(f"{where}: unknown model form {_short(form)}")
  aux_names = model.get("aux_names", [])
  if not isinstance(aux_names, list) or aux_names != list(spec.aux_names):
    raise TableError(f"{where}: auxiliary columns {_short(aux_names)} != "
                     f"{list(spec.aux_names)}")
  n_coef = wave_model.n_coef(form, len(spec.aux_names))
  entries = {}
  try:
    for e in _require(model, "entries", list, where + ".model"):
      entry = ModelEntry.from_json(e, spec)
      if len(entry.coef) != n_coef or len(entry.aux_seen) != len(spec.aux_names):
        raise TableError(f"model entry {dict(entry.variant)} has {len(entry.coef)} "
                         f"coefficients, the form needs {n_coef}")
      if dict(entry.variant)["backend"] not in revisions:
        raise TableError(f"model entry {dict(entry.variant)}: its backend has no revision "
                         f"in the table")
      entries[entry.variant] = entry
    exact = {}
    memo: dict = {}
    for r in _require(d, "exact", list, where):
      p, c, us = _record(r, spec, hw, "exact", memo)
      if spec.backend_of(c).name not in revisions:
        raise TableError(f"exact entry {r.get('problem')}: its backend has no revision "
                         f"in the table")
      exact[p] = (c, us)
    anchors = d.get("anchors", [])
    if not isinstance(anchors, list):
      raise TableError(f"'anchors' should be list, got {type(anchors).__name__}")
    anchors = [_record(r, spec, None, "anchor", memo) for r in anchors]
    evidence, ev_versions, winners = _evidence(d.get("evidence"), spec, memo)
  except TableError as e:
    raise TableError(f"{where}: {e}") from None
  trust_in = model.get("trust", DEFAULT_TRUST)
  penalty_in = model.get("distance_penalty", 0.0)
  try:
    # null: no trust box, the models answer everywhere
    trust = math.inf if trust_in is None else _num(trust_in)
    penalty = _num(penalty_in)
    ok = trust >= 1 and 0 <= penalty < math.inf
  except ValueError:
    ok = False
  if not ok:
    raise TableError(f"{where}: trust {_short(trust_in)} must be >= 1 and distance_penalty "
                     f"{_short(penalty_in)} a finite number >= 0")
  provenance = d.get("provenance", {})
  if not isinstance(provenance, dict):
    raise TableError(f"{where}: 'provenance' should be dict, got {type(provenance).__name__}")
  device_kind = d.get("device_kind", device_key)
  if not isinstance(device_kind, str):
    raise TableError(f"{where}: 'device_kind' should be str, got {type(device_kind).__name__}")
  return Table(family=spec, device_kind=device_kind, device_key=device_key,
               num_sms=num_sms, form=form, entries=entries, exact=exact, anchors=anchors,
               provenance=dict(provenance), trust=trust, distance_penalty=penalty,
               evidence=evidence, evidence_versions=ev_versions, winners=winners)


def _evidence(d, spec: Family, memo: dict) -> tuple[list, dict, dict]:
  """The ``evidence`` section (absent: none), checked: rows, versions, winners."""
  if d is None:
    return [], {}, {}
  if not isinstance(d, dict) or not isinstance(d.get("rows"), list):
    raise TableError("'evidence' must be an object with a 'rows' list")
  vers = d.get("versions", {})
  if not isinstance(vers, dict) or not all(isinstance(v, str) for v in vers.values()):
    raise TableError(f"evidence versions {_short(vers)} must map names to strings")
  rows, winners = [], {}
  for r in d["rows"]:
    if not isinstance(r, dict) or not isinstance(r.get("us"), dict) or not r["us"]:
      raise TableError(f"evidence row {_short(r)} needs a problem and a non-empty 'us'")
    where = f"evidence row {_short(r.get('problem'))}"
    try:
      p = _parsed(memo, "problem", r["problem"], spec.problem_from_dict)
      us = {}
      for b, t in r["us"].items():
        spec.backend(b)
        us[b] = _num(t)
      if "best" in r:
        c = _parsed(memo, "config", r["best"], spec.config_from_dict)
        spec.validate(p, c, None)
        winners[p] = c
    except (KeyError, TypeError, ValueError) as err:
      raise TableError(f"{where}: {type(err).__name__}: {err}") from None
    if not all(math.isfinite(t) and t > 0 for t in us.values()):
      raise TableError(f"{where}: times must be finite and positive")
    rows.append((p, us))
  return rows, dict(vers), winners


_gc_lock = threading.Lock()
_gc_depth = 0
_gc_was_enabled = True


@contextlib.contextmanager
def gc_paused():
  """Python's cyclic garbage collector off for a burst of allocations.

  Parsing a table allocates tens of thousands of objects that are all kept;
  in a process that has imported JAX each collection this triggers walks
  JAX's own objects too. On a 2-core CPU it took 45 of the 62 ms of loading
  the H100 GEMM table (1,063 records) at the first wavetune call of a
  process; 17 ms with the collector paused. The switch is process-wide:
  nested and concurrent pauses share it (the first turns the collector off,
  the last restores the state the first found).
  """
  global _gc_depth, _gc_was_enabled
  with _gc_lock:
    if _gc_depth == 0:
      _gc_was_enabled = gc.isenabled()
      gc.disable()
    _gc_depth += 1
  try:
    yield
  finally:
    with _gc_lock:
      _gc_depth -= 1
      if _gc_depth == 0 and _gc_was_enabled:
        gc.enable()


def load(path: str, family: Family, hw: Hardware | None = None) -> Table:
  """Reads and validates a table file (through the parsed-table cache,
  :mod:`~wavetune_jax.runtime.table_cache`, when it is on).

  Raises:
    TypeError: ``path`` is not a str or an ``os.PathLike`` (an int would be
      read as an open file descriptor, and closed).
    TableError: missing, unreadable, not JSON, or failing validation.
  """
  if not isinstance(path, (str, os.PathLike)):
    raise TypeError(f"path={_short(path)} must be a str or an os.PathLike naming a table "
                    f"file; got {type(path).__name__}")
  path = os.fsdecode(path)  # (a pathlib.Path names the file in messages as a str does)
  with gc_paused():
    try:
      with open(path, "rb") as f:
        data = f.read()
    except FileNotFoundError:
      raise TableError(f"no table at {path}") from None
    except OSError as e:
      raise TableError(f"{path} is not readable ({type(e).__name__}: {e})") from None
    k = table_cache.key(data, family.name, hw) if table_cache.cache_dir() is not None else None
    table = None if k is None else table_cache.load(k, family, hw)
    if table is not None:
      table._cache_key = k
      return table
    try:
      d = json.loads(data)
    except (ValueError, RecursionError) as e:
      # (ValueError: JSONDecodeError, UnicodeDecodeError, an integer of more
      # digits than Python converts; RecursionError: arrays or objects
      # nested thousands deep.)
      raise TableError(f"{path} is not readable JSON ({type(e).__name__}: "
                       f"{_short(str(e), 200)})") from None
    table = from_json(d, family, hw, where=path)
    if k is not None:
      table._config_rows()  # the per-variant arrays and the rates: stored with the table
      table.peak_rates()
      table._cache_key = k
      store_in_cache(table)
    return table


def store_in_cache(table: Table, *, merge: bool = False, limit: int | None = None) -> None:
  """(Re)writes the parsed-table cache entry of a table read through it,
  with what it holds now. ``merge``: first adds the decisions the entry
  holds now, which other processes may have written since this one read it
  (the selector stores its decisions at exit), up to ``limit`` decisions in
  all (this table's first)."""
  if table.__dict__.get("_cache_key") is None:
    return
  with gc_paused():
    table_cache.store(table, merge=merge, limit=limit)
