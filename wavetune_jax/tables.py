"""Dual tables on disk: exact (problem -> config) and model (wave models).

``tables/<device_key>/<kernel>.json``, plain JSON::

  {"format": "wavetune-table", "schema": 1, "kernel": "matmul",
   "kernel_revision": 1, "device_kind": "NVIDIA H200", "device_key": "nvidia_h200",
   "num_sms": 132,
   "provenance": {"command", "date", "jax_version", "mode": "gpu" | "replay",
                  "source", "budget", "anchors", "gpu_seconds", "pool_problems"},
   "model": {"form": "bilinear", "aux_names": [...], "trust": 1.5,
             "distance_penalty": 0.3,
             "entries": [{"variant": {...}, "occupancy", "coef": [...], "points",
                          "min_g", "max_g", "min_l", "max_l", "aux_seen": [...],
                          "fit_med_err"}]},
   "exact": [{"problem": {...}, "config": {...}, "us"}],
   "anchors": [{"problem": {...}, "config": {...}, "us"}]}

Written atomically (temp file + rename). :func:`load` validates everything and
raises :class:`TableError` with the reason; the selector turns that into one
warning and the heuristic.

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

import dataclasses
import json
import math
import os
import tempfile
from typing import Sequence

import numpy as np

from wavetune_jax import wave_model
from wavetune_jax.hardware import Hardware
from wavetune_jax.spec import KernelSpec

__all__ = ["FORMAT", "SCHEMA", "TableError", "ModelEntry", "Table", "load", "save",
           "default_path", "tables_dir"]

FORMAT = "wavetune-table"
SCHEMA = 1
DEFAULT_TRUST = 1.5
DEFAULT_DISTANCE_PENALTY = 0.3


class TableError(ValueError):
  """A table file that cannot be used (missing, corrupt, foreign, stale)."""


@dataclasses.dataclass(frozen=True)
class ModelEntry:
  """The fitted wave model of one variant (config minus folded fields)."""

  variant: tuple            # ((field, value), ...)
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
  def from_json(cls, d: dict, spec: KernelSpec) -> "ModelEntry":
    variant = d["variant"]
    folded = set(spec.folded_fields)
    fields = [f for f in spec.macro_fields + spec.micro_fields if f not in folded]
    missing = set(fields) - set(variant) - set(spec.default_fields)
    if missing or set(variant) - set(fields):
      raise TableError(f"model entry variant {variant} does not have the fields {fields}")
    return cls(variant=tuple((f, int(variant[f])) for f in fields if f in variant),
               occupancy=int(d["occupancy"]), coef=tuple(float(x) for x in d["coef"]),
               points=int(d["points"]), min_g=int(d["min_g"]), max_g=int(d["max_g"]), min_l=float(d["min_l"]),
               max_l=float(d["max_l"]), aux_seen=tuple(bool(x) for x in d["aux_seen"]),
               fit_med_err=float(d["fit_med_err"]))


@dataclasses.dataclass
class Table:
  """One kernel's tables for one GPU model."""

  spec: KernelSpec
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

  # --- the model -------------------------------------------------------------------
  def predict_arrays(self, configs: Sequence, g: np.ndarray, l: np.ndarray,
                     aux: np.ndarray, *, trusted: bool = True) -> np.ndarray:
    """Predicted us ``[S, n]`` of ``configs`` at coordinates ``[S, n]``.

    Configs without a model, or (``trusted=True``) outside their trust region,
    get ``inf``.
    """
    coef, cap, lim, near = self._entry_arrays(tuple(configs))
    with np.errstate(invalid="ignore", divide="ignore"):
      t = wave_model.predict(coef, g, l, cap, self.form, aux, xp=np).astype(np.float64)
      if trusted and self.distance_penalty:
        d = self.anchor_distance(configs, g, l)
        t = t * (1.0 + self.distance_penalty * np.where(np.isfinite(d), d, 0.0))
    min_g, max_g, min_l, max_l, aux_ok = lim
    bad = ~np.isfinite(cap)
    if trusted:
      bad = bad | (g > self.trust * max_g) | (l > self.trust * max_l)
      bad = bad | (g * self.trust < min_g)
      bad = bad | (l * self.trust < min_l)
      if aux.shape[-1]:
        bad = bad | np.any((aux != 0) & ~aux_ok, axis=-1)
    return np.where(bad, np.inf, t)

  def anchor_distance(self, configs: Sequence, g: np.ndarray, l: np.ndarray) -> np.ndarray:
    """L1 distance in ``(log G, log L)`` from each point ``[S, n]`` to the
    nearest anchor of its config's variant (``inf``: the variant has none)."""
    near = self._entry_arrays(tuple(configs))[3]
    lg = np.log(np.maximum(g, 1.0)).astype(np.float32)
    ll = np.log(np.maximum(l, 1e-3)).astype(np.float32)
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
    cache = self.__dict__.setdefault("_arrays", {})
    hit = cache.get(configs)
    if hit is not None:
      return hit
    n_coef = wave_model.n_coef(self.form, len(self.spec.aux_names))
    coef = np.zeros((len(configs), n_coef), np.float32)
    cap = np.full(len(configs), np.inf, np.float32)
    min_g = np.zeros(len(configs)); max_g = np.zeros(len(configs))
    min_l = np.zeros(len(configs))
    max_l = np.zeros(len(configs))
    aux_ok = np.zeros((len(configs), len(self.spec.aux_names)), bool)
    pts = self._anchor_coords()
    k = max((len(v) for v in pts.values()), default=1)
    near = np.full((len(configs), k, 2), np.inf, np.float32)  # (log G, log L) of anchors
    for i, c in enumerate(configs):
      e = self.entries.get(self.spec.variant(c))
      if e is None:
        continue
      a = pts.get(e.variant)
      if a is not None:
        near[i, :len(a)] = a
      coef[i] = e.coef
      cap[i] = e.occupancy * self.num_sms
      min_g[i], max_g[i], min_l[i], max_l[i] = e.min_g, e.max_g, e.min_l, e.max_l
      aux_ok[i] = e.aux_seen
    out = (coef, cap, (min_g, max_g, min_l, max_l, aux_ok), near)
    if len(cache) > 1024:
      cache.clear()
    cache[configs] = out
    return out

  def _anchor_coords(self) -> dict:
    """variant -> ``[n, 2]`` (log G, log L) of its measured anchors."""
    hit = self.__dict__.get("_anchor_xy")
    if hit is None:
      spec = self.spec
      pts: dict = {}
      for p, c, us in self.anchors:
        if us is not None:
          g, l = spec.coords(p, spec.macro(c))
          pts.setdefault(spec.variant(c), []).append((np.log(max(g, 1.0)),
                                                      np.log(max(l, 1e-3))))
      hit = self.__dict__["_anchor_xy"] = {v: np.asarray(x) for v, x in pts.items()}
    return hit

  def predict(self, problem, configs: Sequence, *, trusted: bool = True) -> np.ndarray:
    """Predicted us of each config at one problem (``inf``: no answer)."""
    spec = self.spec
    g = np.empty(len(configs), np.int64)
    l = np.empty(len(configs), np.float64)
    aux = np.zeros((len(configs), len(spec.aux_names)), np.float32)
    for i, c in enumerate(configs):
      g[i], l[i] = spec.coords(problem, spec.macro(c))
      aux[i] = spec.aux(problem, c)
    return self.predict_arrays(configs, g, l, aux, trusted=trusted)

  # --- (de)serialisation ---------------------------------------------------------------
  def to_json(self) -> dict:
    spec = self.spec
    return {
        "format": FORMAT, "schema": SCHEMA, "kernel": spec.name,
        "kernel_revision": spec.revision, "device_kind": self.device_kind,
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


def tables_dir() -> str:
  """Where shipped tables live: ``$WAVETUNE_TABLES``, else the repository's
  ``tables/`` in a source checkout, else the installed copy (the data package
  ``wavetune_jax.shipped_tables`` that a wheel carries)."""
  env = os.environ.get("WAVETUNE_TABLES")
  if env:
    return env
  here = os.path.dirname(os.path.abspath(__file__))
  repo = os.path.join(os.path.dirname(here), "tables")
  if os.path.isdir(repo):
    return repo
  return os.path.join(here, "shipped_tables")


def default_path(kernel: str, device_key: str) -> str:
  return os.path.join(tables_dir(), device_key, f"{kernel}.json")


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


def from_json(d, spec: KernelSpec, hw: Hardware | None, where: str = "table") -> Table:
  """Validates a parsed table against ``spec`` and (if given) ``hw``."""
  if not isinstance(d, dict) or d.get("format") != FORMAT:
    raise TableError(f"{where} is not a wavetune table (format {FORMAT!r} missing)")
  if d.get("schema") != SCHEMA:
    raise TableError(f"{where} has schema {d.get('schema')!r}; this version reads {SCHEMA}")
  if d.get("kernel") != spec.name:
    raise TableError(f"{where} is for kernel {d.get('kernel')!r}, not {spec.name!r}")
  if d.get("kernel_revision") != spec.revision:
    raise TableError(f"{where} was tuned for revision {d.get('kernel_revision')!r} of the "
                     f"{spec.name} kernel; this is revision {spec.revision}: retune")
  device_key = _require(d, "device_key", str, where)
  if hw is not None and device_key != hw.device_key:
    raise TableError(f"{where} is for {device_key!r}, this GPU is {hw.device_key!r}")
  num_sms = _require(d, "num_sms", int, where)
  model = _require(d, "model", dict, where)
  form = _require(model, "form", str, where + ".model")
  if form not in wave_model.FORMS:
    raise TableError(f"{where}: unknown model form {form!r}")
  if list(model.get("aux_names", [])) != list(spec.aux_names):
    raise TableError(f"{where}: auxiliary columns {model.get('aux_names')} != "
                     f"{list(spec.aux_names)}")
  n_coef = wave_model.n_coef(form, len(spec.aux_names))
  entries = {}
  try:
    for e in _require(model, "entries", list, where + ".model"):
      entry = ModelEntry.from_json(e, spec)
      if len(entry.coef) != n_coef or len(entry.aux_seen) != len(spec.aux_names):
        raise TableError(f"{where}: entry {dict(entry.variant)} has {len(entry.coef)} "
                         f"coefficients, the form needs {n_coef}")
      if not np.all(np.isfinite(entry.coef)) or entry.occupancy < 1:
        raise TableError(f"{where}: entry {dict(entry.variant)} has invalid values")
      entries[entry.variant] = entry
    exact = {}
    for r in _require(d, "exact", list, where):
      p = spec.problem_from_dict(r["problem"])
      exact[p] = (spec.config_from_dict(r["config"]), float(r["us"]))
    anchors = [(spec.problem_from_dict(r["problem"]), spec.config_from_dict(r["config"]),
                float(r["us"])) for r in d.get("anchors", [])]
  except TableError:
    raise
  except (KeyError, TypeError, ValueError) as e:
    raise TableError(f"{where}: invalid entry ({type(e).__name__}: {e})") from None
  trust = model.get("trust", DEFAULT_TRUST)
  trust = math.inf if trust is None else trust  # null: the models answer everywhere
  penalty = model.get("distance_penalty", 0.0)
  if (isinstance(trust, bool) or not isinstance(trust, (int, float)) or not trust >= 1
      or isinstance(penalty, bool) or not isinstance(penalty, (int, float))
      or not 0 <= penalty < math.inf):
    raise TableError(f"{where}: trust {trust!r} must be >= 1 and distance_penalty "
                     f"{penalty!r} a finite number >= 0")
  return Table(spec=spec, device_kind=str(d.get("device_kind", device_key)),
               device_key=device_key, num_sms=num_sms, form=form, entries=entries,
               exact=exact, anchors=anchors, provenance=dict(d.get("provenance", {})),
               trust=float(trust), distance_penalty=float(penalty))


def load(path: str, spec: KernelSpec, hw: Hardware | None = None) -> Table:
  """Reads and validates a table file.

  Raises:
    TableError: missing, unreadable, not JSON, or failing validation.
  """
  try:
    with open(path) as f:
      d = json.load(f)
  except FileNotFoundError:
    raise TableError(f"no table at {path}") from None
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise TableError(f"{path} is not readable JSON ({type(e).__name__}: {e})") from None
  return from_json(d, spec, hw, where=path)
