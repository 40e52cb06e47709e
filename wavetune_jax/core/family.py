"""Families and backends: the only places that know an operation or a kernel.

A :class:`Family` is one operation with one semantics (GEMM, attention): its
problem type, how call arguments become a problem, the shape suite, random
inputs, the reference and the platform baseline. A :class:`Backend` is one way
to run it: its frozen config class, where it runs, its config space and
pruning rules, validation, heuristic, occupancy bound, ``(G, L)`` mapping and
the call into its kernel.

Everything above (selector, tables, tuner, sweeps, evaluation, CLI) sees a
family through the generic methods of :class:`Family`, which dispatch to the
backend a config belongs to (by its class). Nothing outside ``families/`` and
``pallas_kernels/`` branches on a family's or a backend's name.
"""

from __future__ import annotations

import abc
import dataclasses
import functools
import math
from typing import Any, Callable, ClassVar, NamedTuple, Sequence

import jax
import numpy as np

from pallas_kernels._launch import field_names
from wavetune_jax.core.hardware import Hardware

__all__ = ["Problem", "Backend", "OneConfigBackend", "Family", "Call", "config_from_fields",
           "interned"]

_INT64 = 2**63


class Problem:
  """Base of problem dataclasses: equality and hash from the init fields as
  one tuple, built once (problems key the selector's memo, so a lookup hashes
  and compares in C).

  Subclasses are ``dataclass(frozen=True, eq=False)``, declare ``_key: tuple``
  and ``_hash: int`` as ``field(init=False, repr=False, compare=False)``, and
  call :meth:`_freeze` at the end of ``__post_init__``. They pickle as a
  constructor call (:meth:`__reduce__`).
  """

  __slots__ = ()

  def _freeze(self) -> None:
    names = field_names(type(self), True)
    key = tuple(getattr(self, f) for f in names)
    for f, v in zip(names, key):
      # (Array shapes are 64-bit: a size past that is no array's, and
      # overflows the float and int64 arithmetic of the selector.)
      if v.__class__ is int and not -_INT64 <= v < _INT64:
        raise ValueError(f"{type(self).__name__}.{f}={v} does not fit 64 bits")
    object.__setattr__(self, "_key", key)
    object.__setattr__(self, "_hash", hash(key))

  def __hash__(self) -> int:
    return self._hash

  def __reduce__(self):
    # Pickled as a constructor call: the hash is recomputed, not restored (a
    # str's hash differs between processes, so a stored one would miss every
    # dict lookup), and the fields are checked again.
    return _rebuild_problem, (self.__class__, self._key)

  def __eq__(self, other) -> bool:
    if other.__class__ is not self.__class__:
      return NotImplemented
    return self._key == other._key


class Call(NamedTuple):
  """A bound op call: the problem, the arrays the kernel takes and the
  options (static, not part of the problem) its ``run`` takes.
  ``kw_arrays`` names the keyword arguments of the op whose arrays end
  ``arrays`` (attention's ``kv_lengths``), in that order."""

  problem: Any
  arrays: tuple
  options: dict
  kw_arrays: tuple = ()


_INTERNED: dict = {}


def interned(cls, **fields):
  """``cls(**fields)``, one object per distinct config: candidate lists of
  different weights share their configs, so trace-time lookups keyed by a
  config find it by identity (no field-by-field comparison)."""
  key = (cls, tuple(fields.items()))
  c = _INTERNED.get(key)
  if c is None:
    c = _INTERNED[key] = cls(**fields)
  return c


def config_from_fields(cls, d: dict):
  """``cls(**d)``; unknown keys raise ``ValueError`` naming the valid fields."""
  names = set(field_names(cls))
  unknown = sorted(set(d) - names)
  if unknown:
    raise ValueError(f"unknown {cls.__name__} field(s) {unknown}; "
                     f"valid fields are {sorted(names)}")
  return cls(**d)


def _rebuild_problem(cls, key: tuple):
  return cls(**dict(zip(field_names(cls, True), key)))


class Backend(abc.ABC):
  """One way to run a family: a kernel and everything the tuner knows of it.

  Subclasses set the class attributes and implement the abstract methods.
  """

  #: Name in tables, sweep files and config dicts (``"triton"``, ``"mosaic"``).
  name: ClassVar[str]
  #: Frozen dataclass of launch parameters (the backend's own).
  config_cls: ClassVar[type]
  #: Config fields that change the grid or the inner-loop length.
  macro_fields: ClassVar[tuple[str, ...]]
  #: Config fields that change per-tile efficiency only.
  micro_fields: ClassVar[tuple[str, ...]]
  #: Config fields the (G, L) mapping absorbs completely (GEMM: ``split_k``):
  #: configs that differ only in them share one wave model.
  folded_fields: ClassVar[tuple[str, ...]] = ()
  #: The kernel runs in Pallas interpret mode on a CPU.
  interpret: ClassVar[bool] = False
  #: ``heuristic`` answers the same for every size of a weight (XLA's op):
  #: the selector then asks once per block of sizes, not once per size.
  heuristic_size_free: ClassVar[bool] = False
  #: It also runs on a CPU inside ``jax.shard_map`` (Pallas interpret mode
  #: does not handle the mesh axes a value varies over; XLA ops do).
  interpret_in_shard_map: ClassVar[bool] = False
  #: A Pallas kernel: the op keeps its lowered form on disk
  #: (:mod:`wavetune_jax.core.kernel_cache`) so later processes skip the
  #: lowering. Library backends (XLA, cuDNN) leave it False.
  kernel_cache: ClassVar[bool] = False
  #: Bumped whenever the kernel's code changes its performance: tables tuned
  #: for another revision are not used.
  revision: ClassVar[int] = 1
  #: The sweep row whose measurement is this backend's one config (a backend
  #: that runs exactly what the family's baseline runs: ``"baseline"`` or
  #: ``"baseline_<name>"``). Sweeps do not time it twice; readers of sweep
  #: files turn those rows into its config rows (``sweep.with_recorded_backends``).
  recorded_as: ClassVar[str | None] = None
  #: Fields that files recorded before the backend had its own config class
  #: hold, with the one value they could have; read and dropped.
  dropped_fields: ClassVar[dict] = {}
  #: A platform op (XLA, cuDNN): what a JAX user gets without this library.
  #: The guard falls back to the family's platform config
  #: (:meth:`Family.platform_config`).
  platform: ClassVar[bool] = False

  def supported_on(self, hw: Hardware) -> bool:
    """Whether the kernel runs on ``hw`` at all (interpret mode aside)."""
    return True

  def unsupported_reason(self, hw: Hardware) -> str | None:
    """Why :meth:`supported_on` is False for ``hw``, in one line (None where
    it is True). Backends whose reason is not the GPU (a lowering this JAX
    lacks) override it."""
    if self.supported_on(hw):
      return None
    return f"compute capability {hw.compute_capability} is not supported"

  def runs_on(self, hw: Hardware) -> bool:
    """:meth:`supported_on`, and an interpret mode where ``hw`` has no GPU."""
    return self.supported_on(hw) and (self.interpret or not hw.interpret)

  def unavailable_reason(self, hw: Hardware) -> str | None:
    """Why :meth:`runs_on` is False for ``hw``, in one line (None where it is
    True)."""
    if not self.supported_on(hw):
      return self.unsupported_reason(hw)
    if hw.interpret and not self.interpret:
      return "no GPU here, and the backend has no interpret mode"
    return None

  @abc.abstractmethod
  def space(self, problem, hw: Hardware, *, prune: bool = True) -> tuple:
    """Every config worth measuring for ``problem`` on ``hw`` (pruned)."""

  @abc.abstractmethod
  def validate(self, problem, config, hw: Hardware | None = None) -> None:
    """Raises ``ValueError`` if ``config`` cannot run ``problem`` (on ``hw``:
    shared memory and block limits)."""

  def heuristic(self, problem, hw: Hardware):
    """A config from a rule of thumb, or None where this backend should not
    be the default choice."""
    return None

  @abc.abstractmethod
  def occupancy_bound(self, problem, config, hw: Hardware) -> int:
    """Analytic upper bound on CTAs resident per SM (prior of the wave model)."""

  @abc.abstractmethod
  def coords(self, problem, macro: dict) -> tuple[int, float]:
    """``(G, L)``: work tiles (CTAs, or tiles of a persistent grid) and
    inner-loop trips of one tile."""

  def aux(self, problem, config) -> tuple[float, ...]:
    """Costs outside the wave structure, one value per ``Family.aux_names``
    (empty: all zero)."""
    return ()

  def size_quantum(self, problem) -> int | None:
    """Sizes in ``(q*(j-1), q*j]`` share this backend's space and (G, L);
    None where the backend never runs the problem's weight. 1 is always safe."""
    return 1

  def decision_arrays(self, problem, sizes, hw: Hardware, n_aux: int, with_size):
    """``(configs, valid [S, n], G [S, n], L [S, n], aux [S, n, n_aux])`` at
    many sizes at once; this generic version calls the scalar methods and
    backends override it with array code."""
    probs = [with_size(problem, s) for s in sizes]
    spaces = [self.space(p, hw) for p in probs]
    configs = tuple(dict.fromkeys(c for sp in spaces for c in sp))
    idx = {c: i for i, c in enumerate(configs)}
    shape = (len(probs), len(configs))
    valid = np.zeros(shape, bool)
    g = np.ones(shape, np.int64)
    l = np.ones(shape, np.float64)
    aux = np.zeros(shape + (n_aux,), np.float32)
    for i, (p, sp) in enumerate(zip(probs, spaces)):
      for c in sp:
        j = idx[c]
        valid[i, j] = True
        g[i, j], l[i, j] = self.coords(p, self.macro(c))
        a = self.aux(p, c)
        if a:
          aux[i, j] = a
    return configs, valid, g, l, aux

  @abc.abstractmethod
  def run(self, problem, config, *arrays, interpret: bool = False, **options) -> jax.Array:
    """Runs the kernel on the call's arrays with ``config`` (jittable)."""

  # --- helpers -------------------------------------------------------------------
  def macro(self, config) -> dict:
    return {f: getattr(config, f) for f in self.macro_fields}

  def micro(self, config) -> dict:
    return {f: getattr(config, f) for f in self.micro_fields}

  def fields(self) -> tuple[str, ...]:
    return field_names(self.config_cls)

  def __repr__(self) -> str:
    return f"<{type(self).__name__} {self.name!r}>"


class OneConfigBackend(Backend):
  """A platform op as a backend: one config without launch parameters
  (``config_cls()``), XLA's own op; subclasses set ``name``, ``config_cls``
  and implement ``coords`` and ``run``."""

  macro_fields = ()
  micro_fields = ()
  interpret = True
  interpret_in_shard_map = True
  heuristic_size_free = True
  platform = True

  def space(self, problem, hw: Hardware, *, prune: bool = True):
    return (self.config_cls(),)

  def validate(self, problem, config, hw: Hardware | None = None) -> None:
    if not isinstance(config, self.config_cls):
      name = self.config_cls.__name__
      article = "an" if name[0] in "AEIOUX" else "a"
      raise ValueError(f"config must be {article} {name}; got {config!r}")

  def heuristic(self, problem, hw: Hardware):
    return self.config_cls()

  def occupancy_bound(self, problem, config, hw: Hardware) -> int:
    return 1


class Family(abc.ABC):
  """One operation: its problems, arguments, suite, reference and backends.

  Subclasses set the class attributes, implement the abstract methods and
  pass their backends (in order of preference: the first whose heuristic
  answers gives the heuristic config) to ``__init__``.
  """

  #: Name on the command line, in tables and in sweep files.
  name: ClassVar[str]
  #: Frozen dataclass of the static facts of one call.
  problem_cls: ClassVar[type]
  #: The problem field that grows with the tokens of a call (GEMM: ``m``).
  #: Evaluation holds out its values; plots put it on the x axis.
  size_field: ClassVar[str]
  #: Names of the auxiliary model columns backends return from ``aux``.
  aux_names: ClassVar[tuple[str, ...]] = ()
  #: ``None``: the model's argmin stands. A fraction: the model replaces the
  #: heuristic's config only when it predicts a gain larger than this, with a
  #: trusted prediction for the heuristic's config too.
  heuristic_margin: ClassVar[float | None] = None
  #: The wave model's candidates first-use refinement measures at a new
  #: problem (``None``: :data:`wavetune_jax.runtime.refine.TOP_K`); fewer
  #: where each costs a kernel compile that does not overlap the others.
  refine_top_k: ClassVar[int | None] = None
  #: First-use refinement also measures the config of each platform backend
  #: besides :meth:`platform_config`'s (decode: XLA's attention next to
  #: cuDNN's), so what it keeps is as fast as the faster of them.
  refine_all_platforms: ClassVar[bool] = False
  #: What :meth:`baseline` runs, for tables and reports.
  baseline_name: ClassVar[str] = "XLA"
  #: Said after "running XLA's op" in the warning under a mesh with explicit
  #: axes, where that op runs differently there.
  explicit_mesh_note: ClassVar[str] = ""
  #: Files recorded before configs named their backend: a config dict without
  #: ``"backend"`` is this backend's, and an int ``backend`` is looked up here.
  legacy_backends: ClassVar[dict] = {}
  legacy_default_backend: ClassVar[str | None] = None

  def __init__(self, backends: Sequence[Backend]):
    if not backends:
      raise ValueError(f"family {self.name!r} needs at least one backend")
    names = [b.name for b in backends]
    if len(set(names)) != len(names):
      raise ValueError(f"family {self.name!r}: backend names {names} repeat")
    classes = [b.config_cls for b in backends]
    if len(set(classes)) != len(classes):
      raise ValueError(f"family {self.name!r}: two backends share a config class")
    self.backends: tuple[Backend, ...] = tuple(backends)
    self._by_name = {b.name: b for b in backends}
    self._by_cls = {b.config_cls: b for b in backends}

  # --- backends --------------------------------------------------------------------
  def backend(self, name: str) -> Backend:
    """The backend called ``name``."""
    try:
      return self._by_name[name]
    except (KeyError, TypeError):
      raise ValueError(f"family {self.name!r} has no backend {name!r}; its backends are "
                       f"{list(self._by_name)}") from None

  def backend_of(self, config) -> Backend:
    """The backend whose config class ``config`` is."""
    b = self._by_cls.get(type(config))
    if b is None:
      raise ValueError(
          f"{self.name} config must be one of "
          f"{[c.__name__ for c in self._by_cls]} (or a dict with a 'backend' key); "
          f"got {config!r}")
    return b

  def available(self, hw: Hardware) -> tuple[Backend, ...]:
    """The backends that can run where ``hw`` says the ops run."""
    return tuple(b for b in self.backends if b.runs_on(hw))

  def with_backends(self, names: Sequence[str]) -> "Family":
    """A copy of this family with only the backends ``names`` (same order)."""
    keep = [b for b in self.backends if b.name in set(names)]
    unknown = set(names) - {b.name for b in self.backends}
    if unknown:
      raise ValueError(f"family {self.name!r} has no backend(s) {sorted(unknown)}")
    if len(keep) == len(self.backends):
      return self
    new = object.__new__(type(self))
    new.__dict__.update(self.__dict__)
    Family.__init__(new, keep)
    return new

  def revisions(self) -> dict[str, int]:
    return {b.name: b.revision for b in self.backends}

  # --- the call ----------------------------------------------------------------------
  @abc.abstractmethod
  def bind(self, *args, **kwargs) -> Call | jax.Array:
    """Checks call arguments and returns the :class:`Call`, or the result
    itself where there is nothing to compute (empty arrays)."""

  # --- problems ------------------------------------------------------------------------
  @abc.abstractmethod
  def problems_from_suite(self, suite: dict, *, weights: Sequence[str] | None = None,
                          sizes: Sequence[int] | None = None, dtype: str) -> list:
    """The problems of a shape suite (``shapes/train.json`` format)."""

  @abc.abstractmethod
  def problem_key(self, problem) -> str:
    """A stable string naming ``problem`` in tables and sweep files."""

  @abc.abstractmethod
  def inputs(self, problem, key: jax.Array) -> tuple[jax.Array, ...]:
    """Random inputs (never zeros) for ``problem``."""

  @abc.abstractmethod
  def reference(self, problem, *inputs) -> jax.Array:
    """High-precision reference output."""

  @abc.abstractmethod
  def baseline(self, problem) -> Callable:
    """The platform's own implementation (XLA, cuDNN) for comparison."""

  def extra_baselines(self, problem) -> dict[str, Callable]:
    """Other platform implementations to time in sweeps, by name."""
    return {}

  def refine_mixes(self, problem) -> tuple["Family", ...]:
    """Other families whose :meth:`inputs` give ``problem`` another run-time
    mix (decode: every sequence at the full cache next to the spread
    lengths), on which first-use refinement also checks and times its
    candidates: a config replaces the platform config only if it is
    ``refine.MARGIN`` faster on each of them too. Default: none."""
    return ()

  def speed_references(self, problem) -> dict[str, tuple[Callable, tuple]]:
    """Platform ops that bound the problem's speed without computing its op,
    by name: ``{name: (fn, input shapes)}`` (``jax.ShapeDtypeStruct`` values).
    Sweeps time each on random inputs of those shapes, unchecked, next to the
    baselines (rows ``baseline_<name>``), e.g. the grouped GEMM's batched GEMM
    on the same rows per expert."""
    return {}

  @abc.abstractmethod
  def tolerance(self, problem) -> float:
    """Largest acceptable ``|out - ref| / |ref|``."""

  @abc.abstractmethod
  def default(self, problem):
    """The one fixed config an untuned library would use."""

  def partition_rule(self, problem):
    """How the op partitions under sharded ``jax.jit``
    (:class:`wavetune_jax.core.partition.PartitionRule`), or None: inputs
    are then taken as they come (XLA gathers sharded ones)."""
    return None

  #: The op's ``jax.vmap`` rule, or None: the op then batches as its kernels
  #: do (Pallas adds a grid axis). A family whose kernels cannot batch (the
  #: grouped GEMM: ``lax.ragged_dot`` has no rule for batched group sizes)
  #: defines the method ``batched_call(self, axis_size, in_batched, arrays,
  #: op) -> array``: ``arrays`` are the call's arrays with the batch axis first
  #: where ``in_batched`` says, ``op`` runs this family's op on arrays of a
  #: larger problem (the batch folded in, its config chosen for it); it
  #: returns the batched result, batch axis first
  #: (:func:`wavetune_jax.core.op.tuned_call`).
  batched_call: ClassVar[Callable | None] = None

  def problem_to_dict(self, problem) -> dict:
    return {f: getattr(problem, f) for f in field_names(type(problem), True)}

  def problem_from_dict(self, d: dict):
    if not isinstance(d, dict):
      raise ValueError(f"a {self.name} problem must be a mapping; got {d!r}")
    names = set(field_names(self.problem_cls, True))
    unknown = sorted(set(d) - names)
    if unknown:
      raise ValueError(f"unknown {self.problem_cls.__name__} field(s) {unknown}; "
                       f"valid fields are {sorted(names)}")
    return self.problem_cls(**d)

  def size_of(self, problem) -> int:
    return getattr(problem, self.size_field)

  def work(self, problem) -> tuple[float, float] | None:
    """``(flops, bytes)`` every kernel of the problem must at least do and
    move, or None (unknown). The selector divides them by the fastest rates
    any anchor of the table reached: a prediction below that floor is an
    extrapolation, and is not believed against the heuristic."""
    return None

  def with_size(self, problem, size: int):
    return dataclasses.replace(problem, **{self.size_field: int(size)})

  def weight_of(self, problem) -> tuple:
    """Every problem field except ``size_field``: what stays fixed per weight."""
    d = self.problem_to_dict(problem)
    return tuple(sorted((k, v) for k, v in d.items() if k != self.size_field))

  # --- configs -------------------------------------------------------------------------
  def config_to_dict(self, config) -> dict:
    return {"backend": self.backend_of(config).name, **dataclasses.asdict(config)}

  def config_from_dict(self, d: dict, *, legacy: bool = True):
    """A config from ``{"backend": name, **fields}``. Files recorded before
    backends were named (``legacy``, the default, for reading files): no
    ``backend`` key means ``legacy_default_backend``, an int one is looked up
    in ``legacy_backends``. With ``legacy=False`` (a user's config) the key
    is required."""
    if not isinstance(d, dict):
      raise ValueError(f"a {self.name} config must be a mapping; got {d!r}")
    d = dict(d)
    name = d.pop("backend", None)
    if name is None and not legacy:
      raise ValueError(f"config={d!r}: a {self.name} config dict needs a 'backend' key, "
                       f"one of {list(self._by_name)}")
    if name is None:
      name = self.legacy_default_backend
      if name is None:
        raise ValueError(f"a {self.name} config dict needs a 'backend' key (one of "
                         f"{list(self._by_name)}); got {d}")
    elif isinstance(name, int) and not isinstance(name, bool):
      if name not in self.legacy_backends:
        raise ValueError(f"unknown {self.name} backend number {name}")
      name = self.legacy_backends[name]
    b = self.backend(name)
    for f, v in b.dropped_fields.items():
      if f in d:
        if d[f] != v:
          raise ValueError(f"a {b.name} {self.name} config has {f}={v}; got {d[f]!r}")
        del d[f]
    return config_from_fields(b.config_cls, d)

  def coerce_config(self, config):
    """A config object from a config or a dict with its ``"backend"``
    (:meth:`config_from_dict`; the key is required: the legacy form is for
    recorded files only)."""
    if isinstance(config, dict):
      return self.config_from_dict(config, legacy=False)
    self.backend_of(config)
    return config

  def variant(self, config) -> tuple:
    """The wave model a config belongs to: its backend and its fields minus
    the backend's ``folded_fields``."""
    b = self.backend_of(config)
    return (("backend", b.name),) + tuple(
        (f, getattr(config, f)) for f in b.fields() if f not in b.folded_fields)

  def canonical(self, problem):
    """``problem`` as the ops key it (the same problem, where no field
    means what another value does)."""
    return problem

  def variant_from_dict(self, d: dict) -> tuple:
    """A variant from its JSON form; raises ``ValueError`` on wrong fields."""
    d = dict(d)
    b = self.backend(d.pop("backend", None))
    fields = [f for f in b.fields() if f not in b.folded_fields]
    if set(d) != set(fields):
      raise ValueError(f"variant {d} of backend {b.name!r} must have the fields {fields}")
    for f in fields:
      if isinstance(d[f], np.integer) and not isinstance(d[f], np.bool_):
        d[f] = int(d[f])
      if isinstance(d[f], bool) or not isinstance(d[f], int):
        raise ValueError(f"variant field {f}={d[f]!r} must be an int")
    return (("backend", b.name),) + tuple((f, d[f]) for f in fields)

  def macro(self, config) -> dict:
    return self.backend_of(config).macro(config)

  def micro(self, config) -> dict:
    return self.backend_of(config).micro(config)

  # --- generic views over the backends ---------------------------------------------------
  def space(self, problem, hw: Hardware, *, prune: bool = True) -> tuple:
    """Every config of every backend that runs on ``hw``."""
    return tuple(c for b in self.available(hw) for c in b.space(problem, hw, prune=prune))

  def validate(self, problem, config, hw: Hardware | None = None) -> None:
    """Raises ``ValueError`` if ``config`` cannot run ``problem`` (on ``hw``)."""
    b = self.backend_of(config)
    if hw is not None and not b.supported_on(hw):
      where = f"{hw.name} (interpret mode)" if hw.interpret else hw.name
      raise ValueError(f"the {b.name} backend of {self.name} does not run on {where}: "
                       f"{b.unsupported_reason(hw)}")
    b.validate(problem, config, hw)

  def heuristic(self, problem, hw: Hardware):
    """The first answer of the backends' heuristics, in order of preference.

    Where none answers and some backend cannot run on ``hw`` (its rule, such
    as a Pallas Triton kernel's where this JAX has no Triton lowering, would
    have), the first config of the first backend that runs ``problem`` here.

    Raises:
      ValueError: no config at all.
    """
    available = self.available(hw)
    for b in available:
      c = b.heuristic(problem, hw)
      if c is not None:
        return c
    if len(available) < len(self.backends):
      for b in available:
        space = b.space(problem, hw)
        if space:
          return space[0]
    raise ValueError(f"no {self.name} backend has a heuristic config for "
                     f"{self.problem_key(problem)} on {hw.name}")

  def heuristics(self, problem, sizes, hw: Hardware) -> list:
    """:meth:`heuristic` at each of ``sizes`` of ``problem``'s weight (one
    call where the answering backend's heuristic does not depend on size)."""
    first = next(iter(self.available(hw)), None)
    if first is not None and first.heuristic_size_free:
      h = first.heuristic(problem, hw)
      if h is not None:
        return [h] * len(sizes)
    return [self.heuristic(self.with_size(problem, int(s)), hw) for s in sizes]

  def occupancy_bound(self, problem, config, hw: Hardware) -> int:
    return self.backend_of(config).occupancy_bound(problem, config, hw)

  def coords(self, problem, config) -> tuple[int, float]:
    """``(G, L)`` of ``config`` at ``problem``."""
    b = self.backend_of(config)
    return b.coords(problem, b.macro(config))

  def aux(self, problem, config) -> tuple[float, ...]:
    a = self.backend_of(config).aux(problem, config)
    return tuple(a) if a else (0.0,) * len(self.aux_names)

  def window_variants(self, problems: list, suite: dict) -> list:
    """Each of ``problems`` with each of the suite's sliding windows (the
    attention families; ``wavetune sweep --windows``)."""
    raise ValueError(f"the {self.name} family has no sliding windows (--windows: attention "
                     f"and decode)")

  #: The project ships tables of this family for its GPUs (False: none yet,
  #: so a missing table is expected and not warned about).
  tables_shipped: ClassVar[bool] = True

  def trusted_without_evidence(self, problem, config, platform, hw=None) -> bool:
    """Whether the guard lets ``config`` replace ``platform`` on ``problem``
    without table evidence on ``hw`` (a family's measured rule for problems
    no table holds; default: never). An override may also take
    ``versions=`` (``core.versions.current()``'s form: the platform's JAX,
    CUDA and cuDNN), which a replay of a sweep passes as the sweep's."""
    return False

  def modelled(self, problem) -> bool:
    """Whether a table's wave models may answer ``problem`` (False: options
    that no sweep measures, such as soft-capping and sinks, or that the
    family keeps out of its fits, such as attention's windows; the
    heuristic answers)."""
    return True

  def size_quantum(self, problem) -> int:
    """Sizes in ``(q*(j-1), q*j]`` get the same decision: the gcd of the
    quanta of the backends that run ``problem``."""
    qs = [q for b in self.backends if (q := b.size_quantum(problem))]
    return math.gcd(*qs) if qs else 1

  def decision_backends(self, problem, hw: Hardware) -> tuple[Backend, ...]:
    """The backends that run on ``hw`` and run ``problem`` (a size quantum)."""
    return tuple(b for b in self.available(hw) if b.size_quantum(problem) is not None)

  def decision_arrays(self, problem, sizes, hw: Hardware):
    """The candidates of every backend that runs ``problem``, at many sizes,
    side by side (see :meth:`Backend.decision_arrays`)."""
    n_aux = len(self.aux_names)
    parts = [b.decision_arrays(problem, sizes, hw, n_aux, self.with_size)
             for b in self.decision_backends(problem, hw)]
    if not parts:
      s = len(sizes)
      return ((), np.zeros((s, 0), bool), np.ones((s, 0), np.int64),
              np.ones((s, 0)), np.zeros((s, 0, n_aux), np.float32))
    if len(parts) == 1:
      return parts[0]
    s = len(sizes)
    configs = tuple(c for p in parts for c in p[0])
    shapes = lambda p: [(s, len(p[0]))] * 3 + [(s, len(p[0]), n_aux)]  # noqa: E731
    return (configs,) + tuple(
        np.concatenate([np.broadcast_to(p[i], shapes(p)[i - 1]) for p in parts], axis=1)
        for i in range(1, 5))

  def build(self, problem, config, *, interpret: bool = False) -> Callable:
    """A jittable ``f(*inputs)`` running ``config`` on ``problem``'s inputs
    (as :meth:`inputs` makes them; default options)."""
    self.validate(problem, config)
    return functools.partial(self.backend_of(config).run, problem, config,
                             interpret=interpret)

  # --- the guard's view -------------------------------------------------------------------
  def platform_config(self, problem, hw: Hardware):
    """The config that runs what :meth:`baseline` runs (the platform op a
    JAX user writes: ``jnp.dot``, cuDNN attention, ``lax.ragged_dot``):
    the backend recorded as the sweeps' ``"baseline"`` where it runs the
    problem here, else the first platform backend that does; None if none.
    The guard keeps it wherever the evidence does not show another backend
    winning."""
    ok = [b for b in self.available(hw) if b.platform]
    ok.sort(key=lambda b: b.recorded_as != "baseline")
    for b in ok:
      space = b.space(problem, hw)
      if space:
        return space[0]
    return None

  #: The guard's rule (fields of :class:`wavetune_jax.runtime.guard.Rule`:
  #: ``weight_radius``, ``size_radius``, ``win``, ``stale_win``) where the
  #: family's held-out replays chose other values than the default.
  guard_rule: ClassVar[dict] = {}

  #: Problem fields the guard compares by equality (besides every field that
  #: is not an int): a kernel's speed against the platform op does not carry
  #: over between them (attention's head_dim).
  evidence_categorical: ClassVar[tuple[str, ...]] = ()
  #: Values of the dtype fields the guard counts as one class: float16 calls
  #: are judged on bfloat16 measurements (the sweeps are bfloat16; Hopper's
  #: wgmma, cuBLAS and cuDNN run the two 16-bit formats at one rate, and the
  #: kernels move the same bytes: docs/design.md, "The guard").
  evidence_dtype_class: ClassVar[dict] = {"float16": "bfloat16"}

  def evidence_features(self, problem) -> tuple[tuple, tuple[float, ...], float]:
    """``(shape class, log2 weight fields, log2 size)``: the guard calls
    evidence near a problem when the class is equal and every log2 field is
    within its radius. The class is every field that is not an int, the
    fields named in :attr:`evidence_categorical`, and the GQA ratio where
    the problem has ``q_heads`` and ``kv_heads``."""
    d = self.problem_to_dict(problem)
    cat, num = [], []
    for k in sorted(d):
      v = d[k]
      if k == self.size_field:
        continue
      if k in ("dtype", "out_dtype"):
        v = self.evidence_dtype_class.get(v, v)
      if isinstance(v, bool) or not isinstance(v, int) or k in self.evidence_categorical:
        cat.append((k, v))
      else:
        num.append(math.log2(max(1, v)))
    if "q_heads" in d and "kv_heads" in d:
      cat.append(("group", d["q_heads"] // max(1, d["kv_heads"])))
    return tuple(cat), tuple(num), math.log2(max(1, self.size_of(problem)))

  def supports(self, config, hw: Hardware) -> bool:
    """Whether ``config``'s backend runs on ``hw``."""
    b = self._by_cls.get(type(config))
    return b is not None and b.runs_on(hw)
