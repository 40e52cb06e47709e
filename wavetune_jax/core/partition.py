"""Sharded ``jax.jit``: every op partitions like its XLA counterpart.

Under ``jax.jit`` with sharded inputs (and more than one device) an op is a
``custom_partitioning`` call with the family's :class:`PartitionRule`, a
Shardy sharding rule in einsum notation: each factor sharded in the inputs
stays sharded, the kernel runs on the per-shard shapes (and its config is
selected for them), and factors contracted away (GEMM's K) are summed across
their mesh axes after the kernel, in float32. Factors a kernel cannot split
(the rows of a grouped GEMM, attention's sequence) are marked for
replication: Shardy gathers them, the documented fallback.

Not wrapped: a single device, and calls inside ``jax.shard_map`` (already
per-shard: the kernels declare how their outputs vary) or under a mesh with
explicit axes (sharding in types), where the op takes its inputs as they come.
"""

from __future__ import annotations

import dataclasses
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

  def operand_factors(self) -> list[list[str | None]]:
    """Per operand, then the result, per dimension: its factor name (None
    for a compound one)."""
    lhs, rhs = self.rule.split("->")
    out = []
    for operand in lhs.split(",") + [rhs]:
      dims = re.findall(r"\([^)]*\)|\S+", operand.strip())
      out.append([None if d.startswith("(") else d for d in dims])
    return out


def _manual_or_explicit() -> bool:
  mesh = jax.sharding.get_abstract_mesh()
  if getattr(mesh, "manual_axes", ()):
    return True
  explicit = getattr(jax.sharding.AxisType, "Explicit", None)
  types = getattr(mesh, "axis_types", ()) or ()
  return explicit is not None and any(t == explicit for t in types)


def wants_partitioning(arrays) -> bool:
  """Whether a call on ``arrays`` goes through ``custom_partitioning``."""
  if jax.device_count() < 2 or _manual_or_explicit():
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

  def replicate(sharding, dims):
    """``sharding`` with the dimensions of replicated factors unsharded."""
    spec = tuple(sharding.spec) + (None,) * (len(dims) - len(sharding.spec))
    spec = tuple(None if d in rule.replicated else a for d, a in zip(dims, spec))
    return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))

  def partition(mesh, arg_shapes, result_shape):
    # Shardy is asked to gather the replicated factors; what it hands over
    # is checked here too, so a split of them can never reach a kernel.
    arg_shardings = tuple(replicate(a.sharding, dims)
                          for a, dims in zip(arg_shapes, factors))
    reduce_axes = []
    for f in rule.reduction:
      for dims, s in zip(factors, arg_shardings):
        if f in dims:
          spec = tuple(s.spec) + (None,) * (len(dims) - len(s.spec))
          axes = spec[dims.index(f)]
          if axes:
            reduce_axes += [axes] if isinstance(axes, str) else list(axes)
          break
    out_dtype = result_shape.dtype
    reduce_axes = tuple(dict.fromkeys(reduce_axes))

    def lower(*xs):
      if not reduce_axes:
        return local_call(*xs, **kwargs)
      y = local_call(*xs, **{**kwargs, **rule.partial_kwargs})
      return jax.lax.psum(y, reduce_axes).astype(out_dtype)

    return mesh, lower, replicate(result_shape.sharding, factors[-1]), arg_shardings

  # Shardy numbers factors in order of appearance and wants them sorted.
  order = {f: i for i, f in enumerate(dict.fromkeys(re.findall(r"\w+", rule.rule)))}
  ordered = lambda fs: tuple(sorted(fs, key=order.__getitem__))  # noqa: E731
  op.def_partition(partition, sharding_rule=rule.rule,
                   reduction_factors=ordered(rule.reduction),
                   need_replication_factors=ordered(rule.replicated), **rule.factor_sizes)
  return op(*arrays)


