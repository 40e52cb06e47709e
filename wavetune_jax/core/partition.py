"""Sharded ``jax.jit``: every op partitions like its XLA counterpart.

Under ``jax.jit`` with sharded inputs (and more than one device) an op is a
``custom_partitioning`` call with the family's :class:`PartitionRule`, a
Shardy sharding rule in einsum notation: each factor sharded in the inputs
stays sharded, the kernel runs on the per-shard shapes (and its config is
selected for them), and factors contracted away (GEMM's K) are summed across
their mesh axes after the kernel, in the output's dtype as XLA's partitioned
dot sums them (a rule's ``partial_kwargs`` can ask for float32 partials,
at twice the bytes of the sum). Factors a kernel cannot split
(the rows of a grouped GEMM, attention's sequence) are marked for
replication: Shardy gathers them, the documented fallback.

Not wrapped: a single device, and calls inside ``jax.shard_map`` (already
per-shard: the kernels declare how their outputs vary) or under a mesh with
explicit axes (sharding in types), where the op takes its inputs as they come
(and runs XLA's op: ``core.op._under_explicit_mesh``).
"""

from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

import jax
import jax.numpy as jnp

__all__ = ["PartitionRule", "wants_partitioning", "partitioned"]


@dataclasses.dataclass(frozen=True)
class PartitionRule:
  """How a family's op partitions (see module doc).

  Attributes:
    rule: Shardy rule over the op's array arguments, e.g. ``"m k, k n -> m n"``.
    factor_sizes: sizes of factors that only appear inside compound
      dimensions, e.g. ``{"r": 4}`` for ``"(g r)"``.
    reduction: factors summed over by the op (partial results are added).
    replicated: factors the kernel cannot split (gathered if sharded).
    partial_kwargs: op keyword arguments for the per-shard call when a
      reduction factor is sharded (``{"out_dtype": "float32"}``: partial
      sums in float32, cast after the sum).
  """

  rule: str
  factor_sizes: dict = dataclasses.field(default_factory=dict)
  reduction: tuple = ()
  replicated: tuple = ()
  partial_kwargs: dict = dataclasses.field(default_factory=dict)

  def operand_factors(self) -> list[list[str]]:
    """Per operand, then the result, per dimension: the factor whose
    sharding the dimension carries (of a compound dimension ``(g r)``, its
    major factor ``g``: a block split of the dimension is a split of ``g``)."""
    lhs, rhs = self.rule.split("->")
    out = []
    for operand in lhs.split(",") + [rhs]:
      dims = re.findall(r"\([^)]*\)|\S+", operand.strip())
      out.append([d.strip("()").split()[0] for d in dims])
    return out

  def minor_sizes(self) -> dict[str, int]:
    """For the major factor of each compound dimension, the product of the
    sizes of the factors after it (``(g r)``: ``{"g": r}``)."""
    out = {}
    for d in re.findall(r"\([^)]*\)", self.rule):
      names = d.strip("()").split()
      out[names[0]] = math.prod(self.factor_sizes[n] for n in names[1:])
    return out


def explicit_mesh(arrays=()) -> bool:
  """Whether the op is traced under a mesh with explicit axes (sharding in
  types), outside ``shard_map``, or any of ``arrays`` is sharded over
  explicit axes in its type (an array placed with a ``NamedSharding`` of
  such a mesh, used without the mesh set)."""
  mesh = jax.sharding.get_abstract_mesh()
  if getattr(mesh, "manual_axes", ()):
    return False
  explicit = getattr(jax.sharding.AxisType, "Explicit", None)
  if explicit is None:
    return False
  return (any(t == explicit for t in getattr(mesh, "axis_types", ()) or ())
          or any(_explicitly_sharded(a, explicit) for a in arrays))


def _explicit_mesh_of(arrays):
  """The mesh set, or else the mesh the arrays are placed on."""
  mesh = jax.sharding.get_abstract_mesh()
  if getattr(mesh, "axis_names", ()):
    return mesh
  found = next((m for m in (getattr(getattr(jax.typeof(a), "sharding", None), "mesh", None)
                            for a in arrays if a is not None)
                if getattr(m, "axis_names", ())), None)
  if found is None:
    raise ValueError("an operand is sharded over explicit axes, but neither the mesh set "
                     "(jax.set_mesh) nor the operands name it")
  return found


def replicated(a):
  """``a`` on every device where it is sharded over explicit axes (group
  sizes before a running sum, which JAX refuses on a sharded array there);
  ``a`` itself elsewhere."""
  if not isinstance(a, jax.Array) or not explicit_mesh((a,)):
    return a   # (NumPy and lists: clipped by the caller before JAX narrows them)
  from jax.sharding import NamedSharding, PartitionSpec as P
  return jax.sharding.reshard(a, NamedSharding(_explicit_mesh_of((a,)), P()))


def gathered_for_ragged_dot(gathered, rhs, *, n_dim: int, others=()):
  """Under a mesh with explicit axes, the operands JAX's ragged dot runs on,
  and its output's sharding: ``lax.ragged_dot`` has no sharding rule there
  (it asks for ``out_sharding``, and given one it still refuses the rows or
  K sharded), so the arrays of ``gathered`` (the rows, the group sizes, row
  scales) are gathered on every device, the weights ``rhs [G, ., .]`` keep
  their expert axis and N's (dimension ``n_dim``) and lose K's, and the
  output ``[M, N]`` keeps N's. ``others``: more operands that may name the
  mesh (placed on it, the mesh not set)."""
  from jax.sharding import NamedSharding, PartitionSpec as P
  mesh = _explicit_mesh_of((*gathered, rhs, *others))
  spec = tuple(getattr(jax.typeof(rhs).sharding, "spec", None) or ()) + (None,) * 3
  keep = [spec[0], None, None]
  keep[n_dim] = spec[n_dim]
  put = lambda a, *axes: jax.sharding.reshard(a, NamedSharding(mesh, P(*axes)))  # noqa: E731
  return (tuple(None if a is None else put(a) for a in gathered), put(rhs, *keep),
          NamedSharding(mesh, P(None, spec[n_dim])))


def _explicitly_sharded(a, explicit) -> bool:
  try:
    sharding = jax.typeof(a).sharding
  except (AttributeError, TypeError):
    return False
  types = getattr(getattr(sharding, "mesh", None), "axis_types", ()) or ()
  spec = getattr(sharding, "spec", None) or ()
  return any(t == explicit for t in types) and any(p is not None for p in spec)


def _manual_or_explicit(arrays) -> bool:
  """Inside ``shard_map``, or :func:`explicit_mesh`."""
  return bool(getattr(jax.sharding.get_abstract_mesh(), "manual_axes", ())) \
      or explicit_mesh(arrays)


def _batched(arrays) -> bool:
  # custom_partitioning has no batching rule: under jax.vmap the op is
  # taken as it comes.
  return any(type(a).__name__ == "BatchTracer" for a in arrays)


def wants_partitioning(arrays) -> bool:
  """Whether a call on ``arrays`` goes through ``custom_partitioning``:
  several devices, Shardy (JAX's default partitioner), not inside
  ``shard_map``, ``vmap`` or an explicit-axes mesh (or arrays sharded over
  explicit axes in their types: the ops take them as they come)."""
  if jax.device_count() < 2 or _manual_or_explicit(arrays) or _batched(arrays):
    return False
  if not jax.config.jax_use_shardy_partitioner:
    return False
  from pallas_kernels._launch import match_varying
  return not match_varying(*arrays)[1]


def partitioned(rule: PartitionRule, local_call: Callable, arrays, kwargs: dict):
  """``local_call(*arrays, **kwargs)`` as a ``custom_partitioning`` op."""
  from jax.experimental.custom_partitioning import custom_partitioning

  @custom_partitioning
  def op(*xs):
    return local_call(*xs, **kwargs)

  factors = rule.operand_factors()

  def partition(mesh, arg_shapes, result_shape):
    # One assignment of mesh axes to factors for every operand and the
    # result, taken from the operands' shardings in order (then the
    # result's): a factor keeps the first split that is valid (its size
    # divisible, its axes not used by another factor); replicated factors
    # are never split. Operands whose shardings disagree are resharded to
    # it by the partitioner, so a kernel only ever sees consistent shards.
    minor = rule.minor_sizes()
    size: dict = {}
    for a, dims in zip(arg_shapes, factors):
      for d, n in zip(dims, a.shape):
        size.setdefault(d, n // minor.get(d, 1))
    assign: dict = {}
    used: set = set()
    for s, dims in [(a.sharding, dims) for a, dims in zip(arg_shapes, factors)] + [
        (result_shape.sharding, factors[-1])]:
      spec = tuple(s.spec) + (None,) * (len(dims) - len(s.spec))
      for d, axes in zip(dims, spec):
        if not axes or d in assign or d in rule.replicated:
          continue
        axes = (axes,) if isinstance(axes, str) else tuple(axes)
        n = math.prod(mesh.shape[x] for x in axes)
        if used & set(axes) or size.get(d, 0) % n:
          continue
        assign[d] = axes
        used |= set(axes)

    def sharding(dims):
      spec = [assign.get(d) for d in dims]
      spec = [a[0] if a is not None and len(a) == 1 else a for a in spec]
      return jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec))

    arg_shardings = tuple(sharding(dims) for dims in factors[:-1])
    reduce_axes = tuple(x for f in rule.reduction for x in assign.get(f, ()))
    out_dtype = result_shape.dtype

    def lower(*xs):
      if not reduce_axes:
        return local_call(*xs, **kwargs)
      y = local_call(*xs, **{**kwargs, **rule.partial_kwargs})
      return jax.lax.psum(y, reduce_axes).astype(out_dtype)

    return mesh, lower, sharding(factors[-1]), arg_shardings

  # Shardy numbers factors in order of appearance and wants them sorted.
  order = {f: i for i, f in enumerate(dict.fromkeys(re.findall(r"\w+", rule.rule)))}
  ordered = lambda fs: tuple(sorted(fs, key=order.__getitem__))  # noqa: E731
  op.def_partition(partition, sharding_rule=rule.rule,
                   reduction_factors=ordered(rule.reduction),
                   need_replication_factors=ordered(rule.replicated), **rule.factor_sizes)
  return op(*arrays)


