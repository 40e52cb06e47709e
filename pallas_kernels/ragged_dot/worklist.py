"""The row work list of a grouped GEMM, shared by the kernels.

Rows of ``lhs`` are grouped contiguously: group ``g`` owns rows
``[start_g, start_g + group_sizes[g])``. A kernel walks *row tasks*: a block
of ``block_m`` rows that all belong to one group (the rows of the block
outside the group are loaded and multiplied but never stored). A group's
first task starts at its first row rounded down to ``align`` rows, so a group
of 10 rows costs one task, not two, wherever it starts.

The rows past ``sum(group_sizes)`` form one more group, the *tail*, whose
tasks store zeros (what ``lax.ragged_dot`` returns there). Group sizes past
``M`` in total are clipped at ``M``; negative sizes count as 0.

Everything is computed from ``group_sizes`` at run time by a few small XLA
ops, vectorised (no loop over the groups), into one int32 array
``tasks [4, T]`` (group, first row, first valid row within the block, valid
rows) and the number of tasks in use, ``count [1]``: tasks ``[0, count)``
are the non-empty ones, in group order; ``T`` is a static bound.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["ALIGN", "check_operands", "max_tasks", "row_tasks", "GROUP", "ROW0", "START",
           "SIZE"]

#: Task blocks start at multiples of this many rows.
ALIGN = 8
#: Rows of ``tasks``.
GROUP, ROW0, START, SIZE = 0, 1, 2, 3


def check_operands(lhs, rhs, group_sizes) -> None:
  """Raises ``ValueError`` unless ``lhs [M, K]``, ``rhs [G, K, N]`` and
  ``group_sizes [G]`` form a grouped GEMM of one input dtype (every kernel
  checks this)."""
  if lhs.ndim != 2 or rhs.ndim != 3 or lhs.shape[1] != rhs.shape[1]:
    raise ValueError(f"need lhs [M, K] and rhs [G, K, N]; got lhs.shape={lhs.shape}, "
                     f"rhs.shape={rhs.shape}")
  if group_sizes.shape != (rhs.shape[0],):
    raise ValueError(f"group_sizes must have shape ({rhs.shape[0]},); got {group_sizes.shape}")
  if lhs.dtype != rhs.dtype:
    raise ValueError(f"lhs.dtype={lhs.dtype} and rhs.dtype={rhs.dtype} must be the same")


def max_tasks(m: int, groups: int, block_m: int, align: int = ALIGN) -> int:
  """A static bound on the row tasks of ``m`` rows in ``groups`` groups (and
  the tail): each of the ``groups + 1`` groups takes at most
  ``(size + align - 1) / block_m + 1`` tasks."""
  return -(-(m + (groups + 1) * (align - 1)) // block_m) + groups + 1


def row_tasks(group_sizes: jax.Array, m: int, block_m: int,
              align: int = ALIGN) -> tuple[jax.Array, jax.Array]:
  """``(tasks [4, T] int32, count [1] int32)`` for ``m`` rows (module doc).

  The tail group has index ``len(group_sizes)``.
  """
  if block_m % align:
    raise ValueError(f"block_m={block_m} must be a multiple of align={align}")
  g = group_sizes.shape[0]
  t = max_tasks(m, g, block_m, align)
  # Sizes clipped to [0, m] and a saturating running sum: no int32 overflow
  # whatever the sizes (each partial sum stays <= m).
  sizes = jnp.clip(group_sizes.astype(jnp.int32), 0, m)
  ends = jax.lax.associative_scan(lambda a, b: jnp.minimum(a + b, m), sizes) if g else sizes
  zero = jnp.zeros((1,), jnp.int32)
  starts = jnp.concatenate([zero, ends[:-1]]) if g else zero[:0]
  # The tail: rows past the last group.
  last = ends[-1:] if g else zero
  starts = jnp.concatenate([starts, last])
  ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
  first = (starts // align) * align
  ntiles = jnp.where(ends > starts, (ends - first + block_m - 1) // block_m, 0)
  cum = jnp.cumsum(ntiles)
  count = cum[-1:]
  tid = jnp.arange(t, dtype=jnp.int32)
  grp = jnp.minimum(jnp.searchsorted(cum, tid, side="right", method="compare_all"),
                    g).astype(jnp.int32)
  row0 = first[grp] + (tid - (cum[grp] - ntiles[grp])) * block_m
  lo = jnp.maximum(starts[grp], row0)
  hi = jnp.minimum(ends[grp], row0 + block_m)
  used = tid < count[0]
  size = jnp.where(used, jnp.maximum(hi - lo, 0), 0)
  start = jnp.where(used, lo - row0, 0)
  row0 = jnp.where(used, row0, 0)
  tasks = jnp.stack([grp, row0, start, size]).astype(jnp.int32)
  return tasks, count.astype(jnp.int32)
