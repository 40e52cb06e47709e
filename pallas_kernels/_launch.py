"""Checks shared by the kernels' launch-config dataclasses."""

from __future__ import annotations

import dataclasses
import functools
import operator

import jax
import numpy as np

#: tl.dot needs every block dimension >= 16.
MIN_BLOCK = 16
#: Triton's largest tensor has 2**20 elements (``TRITON_MAX_TENSOR_NUMEL``).
MAX_BLOCK = 2**20
#: Config fields are int32 in the kernels (grid sizes, offsets, loop bounds).
INT32_MIN, INT32_MAX = -2**31, 2**31 - 1
#: Shared memory of one CTA on Hopper (227 KiB, Mosaic GPU's limit on an
#: H100 or H200): the bound of the Mosaic kernels' shared-memory rules.
SMEM_LIMIT = 232448


def is_pow2(v: int) -> bool:
  return v >= 1 and (v & (v - 1)) == 0


@functools.lru_cache(maxsize=None)
def field_names(cls, init_only: bool = False) -> tuple[str, ...]:
  """A dataclass's field names, optionally only those ``__init__`` takes
  (``dataclasses.fields`` builds its tuple anew on every call; configs are
  validated by the thousand at a table's first decision, and every op call
  builds a problem)."""
  return tuple(f.name for f in dataclasses.fields(cls) if f.init or not init_only)


def check_ints(config) -> None:
  """Raises ``ValueError`` unless every field of the dataclass is an int
  that fits int32 (a larger one would fail deep in the trace, or wrap); a
  NumPy integer field becomes a Python int."""
  for name in field_names(type(config)):
    v = getattr(config, name)
    if isinstance(v, np.integer) and not isinstance(v, np.bool_):
      v = int(v)  # a NumPy integer (from an array, a table) is stored as an int
      object.__setattr__(config, name, v)
    if isinstance(v, bool) or not isinstance(v, int):
      raise ValueError(f"{type(config).__name__}.{name}={v!r} must be an int")
    if not INT32_MIN <= v <= INT32_MAX:
      # (An int of thousands of digits cannot be printed: name its size.)
      shown = v if v.bit_length() <= 128 else f"<an int of {v.bit_length()} bits>"
      raise ValueError(f"{type(config).__name__}.{name}={shown} must fit int32 "
                       f"([{INT32_MIN}, {INT32_MAX}])")


def check_launch(config, block_fields: tuple[str, ...]) -> None:
  """Raises ``ValueError`` unless every field is an int of int32, the blocks
  are powers of two in [``MIN_BLOCK``, ``MAX_BLOCK``], ``num_warps`` a power
  of two <= 16 and ``num_stages`` in [1, 8]."""
  name = type(config).__name__
  check_ints(config)
  for b in block_fields:
    v = getattr(config, b)
    if not is_pow2(v) or v < MIN_BLOCK:
      raise ValueError(f"{name}.{b}={v} must be a power of two >= {MIN_BLOCK}")
    if v > MAX_BLOCK:
      raise ValueError(f"{name}.{b}={v} must be at most {MAX_BLOCK} (Triton's largest "
                       f"tensor)")
  if not is_pow2(config.num_warps) or config.num_warps > 16:
    raise ValueError(f"{name}.num_warps={config.num_warps} must be a power of two <= 16")
  if not 1 <= config.num_stages <= 8:
    raise ValueError(f"{name}.num_stages={config.num_stages} must be in [1, 8]")


def require_compute_capability(cc: str, kernel: str, instead: str):
  """The default device; raises ``ValueError`` unless it is a GPU of compute
  capability ``cc`` (``kernel`` and ``instead`` name the kernel and what to
  use otherwise, for the message)."""
  dev = jax.devices()[0]
  got = getattr(dev, "compute_capability", None)
  if dev.platform != "gpu" or got != cc:
    raise ValueError(f"the {kernel} needs a GPU of compute capability {cc} (Hopper); the "
                     f"default device is {dev.device_kind} (compute capability {got}); "
                     f"{instead}")
  return dev


def persistent_ctas(persistent: bool, num_sms, cc: str, kernel: str, instead: str) -> int:
  """The CTAs of a persistent grid: ``num_sms`` (checked: a positive int),
  else the default device's SM count (which must be a GPU of compute
  capability ``cc``); 0 without ``persistent`` (one CTA per work item)."""
  if not persistent:
    return 0
  if num_sms is None:
    return require_compute_capability(cc, kernel, instead).core_count
  try:
    ctas = operator.index(num_sms)
  except TypeError:
    ctas = 0
  if isinstance(num_sms, bool) or ctas < 1:
    raise ValueError(f"num_sms must be a positive int; got {num_sms!r}")
  return ctas


def item_grid(items: int, ctas: int) -> int:
  """CTAs of a grid over ``items`` work items: one per item, or at most
  ``ctas`` (a persistent grid, CTA ``c`` taking items c, c + C, ...)."""
  return min(items, ctas) if ctas else items


def local_items(cta, items, grid_ctas: int):
  """How many of the ``items`` (an int or a traced int32) CTA ``cta``
  (traced) of ``grid_ctas`` takes (items cta, cta + grid_ctas, ... below
  ``items``; none where ``items <= cta``)."""
  import jax.numpy as jnp
  from jax import lax
  return lax.div(jnp.maximum(jnp.int32(items) - cta, 0) + (grid_ctas - 1),
                 jnp.int32(grid_ctas))


# --- inside jax.shard_map ---------------------------------------------------------
# With check_vma (shard_map's default) every array carries the mesh axes it
# varies over, and a kernel's output types must say theirs. A kernel's output
# varies over every axis any of its inputs varies over.


def _varying(a) -> frozenset:
  t = jax.typeof(a)
  mat = getattr(t, "manual_axis_type", None)
  if mat is not None:
    return frozenset(mat.varying)
  return frozenset(getattr(t, "vma", None) or ())


def match_varying(*arrays) -> tuple[tuple, frozenset]:
  """``(arrays, axes)``: the mesh axes any of ``arrays`` varies over (empty
  outside ``shard_map``), and the arrays cast to vary over all of them (a
  kernel takes operands of one type)."""
  axes = frozenset().union(*(_varying(a) for a in arrays))
  if not axes:
    return arrays, axes
  pvary = getattr(jax.lax, "pvary", None)
  out = []
  for a in arrays:
    missing = tuple(sorted(axes - _varying(a)))
    if missing:
      a = pvary(a, missing) if pvary is not None else jax.lax.pcast(a, missing, to="varying")
    out.append(a)
  return tuple(out), axes


def out_struct(shape, dtype, axes: frozenset) -> jax.ShapeDtypeStruct:
  """A kernel output's type, varying over the mesh axes ``axes``."""
  if not axes:
    return jax.ShapeDtypeStruct(shape, dtype)
  mat_cls = getattr(jax.sharding, "ManualAxisType", None)
  if mat_cls is not None:
    return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=mat_cls(varying=axes))
  return jax.ShapeDtypeStruct(shape, dtype, vma=axes)
