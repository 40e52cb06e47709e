"""The kernel-spec abstraction: the one place that knows a kernel family.

The tuner (profiler, model, tables, selector, evaluation) sees kernels only
through a :class:`KernelSpec`. Adding a kernel family means one kernel file in
``pallas_kernels`` and one spec registered here; nothing else branches on the
kernel's name.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, ClassVar, Sequence

import jax

from wavetune_jax.hardware import Hardware

__all__ = ["KernelSpec", "KeyedProblem", "register", "get_spec", "registered"]


class KeyedProblem:
  """Equality and hash of a problem dataclass from its init fields as one
  tuple, built once: problems key the selector's memo, and a lookup then
  hashes and compares in C.

  Subclasses are ``dataclass(frozen=True, eq=False)``, declare ``_key: tuple``
  and ``_hash: int`` as ``field(init=False, repr=False, compare=False)`` (fields,
  so that pickling keeps them), and call :meth:`_freeze` at the end of
  ``__post_init__``.
  """

  __slots__ = ()

  def _freeze(self) -> None:
    key = tuple(getattr(self, f.name) for f in dataclasses.fields(self) if f.init)
    object.__setattr__(self, "_key", key)
    object.__setattr__(self, "_hash", hash(key))

  def __hash__(self) -> int:
    return self._hash

  def __eq__(self, other) -> bool:
    if other.__class__ is not self.__class__:
      return NotImplemented
    return self._key == other._key


class KernelSpec(abc.ABC):
  """Everything the tuner knows about one kernel family.

  Subclasses set the class attributes and implement the methods. Problems and
  configs are frozen (hashable) dataclasses.
  """

  #: Name used on the command line and in table file names.
  name: ClassVar[str]
  #: Frozen dataclass of the static facts of one call.
  problem_cls: ClassVar[type]
  #: Frozen dataclass of launch parameters.
  config_cls: ClassVar[type]
  #: Config fields that change the grid or the inner-loop length.
  macro_fields: ClassVar[tuple[str, ...]]
  #: Config fields that change per-tile efficiency only.
  micro_fields: ClassVar[tuple[str, ...]]
  #: The problem field that grows with the tokens of a call (GEMM: ``m``).
  #: Evaluation holds out its values; plots put it on the x axis.
  size_field: ClassVar[str]
  #: Config fields that the (G, L) mapping absorbs completely (GEMM:
  #: ``split_k``): configs that differ only in them share one wave model.
  folded_fields: ClassVar[tuple[str, ...]] = ()
  #: Config fields that ``config_to_dict`` leaves out at their default value
  #: (fields added after data was recorded: files stay valid). A variant may
  #: lack them.
  default_fields: ClassVar[tuple[str, ...]] = ()
  #: Names of the auxiliary model columns returned by :meth:`aux`.
  aux_names: ClassVar[tuple[str, ...]] = ()
  #: ``None``: the model's argmin stands. A fraction: the model replaces the
  #: heuristic's config only when it predicts a gain larger than this, with a
  #: trusted prediction for the heuristic's config too (for kernels whose
  #: heuristic is strong next to a sparse model).
  heuristic_margin: ClassVar[float | None] = None
  #: What :meth:`baseline` runs, for tables and reports.
  baseline_name: ClassVar[str] = "XLA"
  #: Bumped whenever the kernel's code changes its performance: tables tuned
  #: for another revision are not used.
  revision: ClassVar[int] = 1

  # --- the space -------------------------------------------------------------
  @abc.abstractmethod
  def space(self, problem, hw: Hardware) -> tuple:
    """Every config worth measuring for ``problem`` on ``hw`` (pruned)."""

  @abc.abstractmethod
  def validate(self, problem, config, hw: Hardware | None = None) -> None:
    """Raises ``ValueError`` if ``config`` cannot run ``problem``."""

  @abc.abstractmethod
  def heuristic(self, problem, hw: Hardware):
    """A sensible config from a rule of thumb (no measurements)."""

  @abc.abstractmethod
  def default(self, problem) -> Any:
    """The one fixed config that an untuned library would use."""

  # --- the WaveTune mapping --------------------------------------------------
  @abc.abstractmethod
  def coords(self, problem, macro: dict) -> tuple[int, int]:
    """``(G, L)``: CTAs launched and inner-loop trips of one CTA."""

  @abc.abstractmethod
  def occupancy_bound(self, problem, config, hw: Hardware) -> int:
    """Analytic upper bound on CTAs resident per SM (prior of the wave model)."""

  def aux(self, problem, config) -> tuple[float, ...]:
    """Costs outside the wave structure, one value per ``aux_names``."""
    return ()

  def variant(self, config) -> tuple:
    """The wave model a config belongs to: its fields minus ``folded_fields``."""
    d = self.config_to_dict(config)
    return tuple((k, v) for k, v in d.items() if k not in self.folded_fields)

  # --- vectorised view for the selector -----------------------------------------
  def size_quantum(self, problem) -> int:
    """Sizes in ``(q*(j-1), q*j]`` get the same decision (same space, G, L).

    The selector decides once per bucket. 1 (the default) is always safe.
    """
    return 1

  def with_size(self, problem, size: int):
    return dataclasses.replace(problem, **{self.size_field: int(size)})

  def decision_arrays(self, problem, sizes, hw: Hardware):
    """Everything the selector needs to score configs at many sizes at once.

    Args:
      problem: any problem of the weight (its size is ignored).
      sizes: ``[S]`` values of ``size_field``.

    Returns:
      ``(configs, valid [S, n], G [S, n], L [S, n], aux [S, n, n_aux])``:
      the candidate configs and, per size, which are in the space and their
      coordinates. This generic version calls the scalar methods; specs
      override it with array code.
    """
    import numpy as np
    probs = [self.with_size(problem, s) for s in sizes]
    spaces = [self.space(p, hw) for p in probs]
    configs = tuple(dict.fromkeys(c for sp in spaces for c in sp))
    idx = {c: i for i, c in enumerate(configs)}
    shape = (len(probs), len(configs))
    valid = np.zeros(shape, bool)
    g = np.ones(shape, np.int64)
    l = np.ones(shape, np.int64)
    aux = np.zeros(shape + (len(self.aux_names),), np.float32)
    for i, (p, sp) in enumerate(zip(probs, spaces)):
      for c in sp:
        j = idx[c]
        valid[i, j] = True
        g[i, j], l[i, j] = self.coords(p, self.macro(c))
        aux[i, j] = self.aux(p, c)
    return configs, valid, g, l, aux

  # --- running ---------------------------------------------------------------
  @abc.abstractmethod
  def build(self, problem, config, *, interpret: bool = False) -> Callable:
    """A jittable callable ``f(*inputs)`` running the kernel with ``config``."""

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
    """Other platform implementations to time in sweeps, by name (e.g. XLA's
    unfused attention next to cuDNN's)."""
    return {}

  @abc.abstractmethod
  def tolerance(self, problem) -> float:
    """Largest acceptable ``|out - ref| / |ref|``."""

  @abc.abstractmethod
  def problems_from_suite(self, suite: dict, *, weights: Sequence[str] | None = None,
                          sizes: Sequence[int] | None = None, dtype: str) -> list:
    """The problems of a shape suite (``shapes/train.json`` format)."""

  def weight_of(self, problem) -> tuple:
    """Every problem field except ``size_field``: what stays fixed per weight."""
    d = self.problem_to_dict(problem)
    return tuple(sorted((k, v) for k, v in d.items() if k != self.size_field))

  def size_of(self, problem) -> int:
    return getattr(problem, self.size_field)

  # --- keys and (de)serialisation ---------------------------------------------
  @abc.abstractmethod
  def problem_key(self, problem) -> str:
    """A stable string naming ``problem`` in tables and sweep files."""

  def problem_to_dict(self, problem) -> dict:
    return {f.name: getattr(problem, f.name) for f in dataclasses.fields(problem) if f.init}

  def problem_from_dict(self, d: dict):
    return self.problem_cls(**d)

  def config_to_dict(self, config) -> dict:
    return dataclasses.asdict(config)

  def config_from_dict(self, d: dict):
    from pallas_kernels._launch import config_from_dict
    return config_from_dict(self.config_cls, d)

  def macro(self, config) -> dict:
    return {f: getattr(config, f) for f in self.macro_fields}

  def micro(self, config) -> dict:
    return {f: getattr(config, f) for f in self.micro_fields}


_REGISTRY: dict[str, KernelSpec] = {}


def register(spec: KernelSpec) -> KernelSpec:
  """Registers a spec instance under ``spec.name``."""
  if spec.name in _REGISTRY and type(_REGISTRY[spec.name]) is not type(spec):
    raise ValueError(f"a different spec is already registered as {spec.name!r}")
  _REGISTRY[spec.name] = spec
  return spec


def get_spec(name: str) -> KernelSpec:
  """The registered spec called ``name``."""
  try:
    return _REGISTRY[name]
  except KeyError:
    raise ValueError(
        f"unknown kernel {name!r}; registered kernels: {registered()}"
    ) from None


def registered() -> Sequence[str]:
  return sorted(_REGISTRY)
