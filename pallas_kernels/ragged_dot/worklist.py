"""The row work list of a grouped GEMM, shared by the kernels.

Rows of ``lhs`` are grouped contiguously: group ``g`` owns rows
``[start_g, start_g + group_sizes[g])``. A kernel walks *row tasks*: a block
of ``block_m`` rows that all belong to one group (the rows of the block
outside the group are loaded and multiplied but never stored). A group's
first task starts at its first row rounded down to ``align`` rows, so a group
of 10 rows costs one task, not two, wherever it starts.

The rows past ``sum(group_sizes)`` form one more group, the *tail*, whose
tasks store zeros (what ``lax.ragged_dot`` returns there). Group sizes past
``M`` in total are clipped at ``M``; negative sizes count as 0
(:func:`clip_sizes`: the work lists saturate the running sum themselves,
whatever sizes they are given).

Everything is computed from ``group_sizes`` at run time by a few small XLA
ops, vectorised (no loop over the groups), into one int32 array
``tasks [4, T]`` (group, first row, first valid row within the block, valid
rows) and the number of tasks in use, ``count [1]``: tasks ``[0, count)``
are the non-empty ones, in group order; ``T`` is a static bound.

From :data:`MASKED_SUMS_FROM` groups the running sums are masked reductions
(``sum_j [j <= i] v[j]`` over a ``[G, G]`` mask) rather than ``cumsum``, and
each task reads its group's values by a telescoping sum over the groups
rather than ``searchsorted`` and gathers: on a GPU a reduction is one kernel
that also takes in the elementwise ops around it, where a ``cumsum`` is a
reduce-window kernel of its own and the search and each gather more kernels
(:data:`MASKED_MAX_GROUPS` bounds the ``[G, G]`` masks; past it the sums are
scans). With few groups XLA fuses the cumsums well, and they stay.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels._integers import INT32_MAX, clipped_int32

__all__ = ["ALIGN", "banded_item", "batch_rows", "check_operands", "clip_sizes", "max_tasks",
           "row_tasks", "GROUP", "ROW0", "START", "SIZE", "BAND0", "BANDW"]

#: Task blocks start at multiples of this many rows.
ALIGN = 8
#: Rows of ``tasks``.
GROUP, ROW0, START, SIZE = 0, 1, 2, 3
#: With ``band_cap``: the first task and the width of the task's band.
BAND0, BANDW = 4, 5


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


def clip_sizes(group_sizes, m: int) -> jax.Array:
  """The group sizes every backend computes with: ``[G]`` int32, each in
  ``[0, m]``, summing to at most ``m``.

  Negative sizes count as 0 and the groups end at row ``m``: each size is
  clipped to ``[0, m]`` (in its own dtype, before the cast to int32, so a
  uint32 ``4294967295`` is ``m``, not -1), then the running sum saturates at
  ``m`` (``min(a, m - b) + b``: no partial sum passes ``m``, so none
  overflows int32 whatever the sizes), and the sizes are its differences.

  Raises:
    ValueError: ``group_sizes`` is not an integer array (booleans are not).
  """
  sizes = clipped_int32(group_sizes, m, name="group_sizes")
  if sizes.ndim != 1 or sizes.shape[0] < 2:
    return sizes
  starts, ends = _bounds(sizes, m)
  return ends - starts


#: Groups up to which running sums are ``[G, G]`` masked reductions (one
#: kernel on a GPU, 4M elements at this bound); past it, scans.
MASKED_MAX_GROUPS = 2048
#: Groups from which the running sums are masked reductions (below, cumsums).
#: On an H100 the masked list took 7.6-13.0 us against 8.2-35.2 for cumsums
#: and searches at 32-256 groups, and 0.8-2.3 us more at 8-16 groups, where
#: XLA fuses the cumsums into 3-6 kernels
#: (``benchmarks/ragged_dot_worklist.py --lists-only``).
MASKED_SUMS_FROM = 32
#: Groups from which each task reads its group's values by one telescoping
#: reduction over the groups (below, ``searchsorted`` and gathers).
TELESCOPED_FROM = 32
#: Tasks x groups up to which the lookup telescopes (its reduction reads
#: five values at each; past it, ``searchsorted`` and gathers).
TELESCOPED_MAX_ELEMENTS = 1 << 22


def _masked(g: int, first: int) -> bool:
  return first <= g <= MASKED_MAX_GROUPS


def _prefix_sums(v: jax.Array, *, inclusive: bool) -> jax.Array:
  """``sum_{j <= i} v[j]`` (or ``j < i``) of int32 ``v [n]`` as one masked
  reduction (no partial sum may overflow int32: callers check)."""
  i = jnp.arange(v.shape[0], dtype=jnp.int32)
  mask = (i[None, :] <= i[:, None]) if inclusive else (i[None, :] < i[:, None])
  return jnp.sum(jnp.where(mask, v[None, :], 0), axis=1, dtype=jnp.int32)


def _bounds(sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
  """Where each group starts and ends: the running sums of ``sizes [G]``
  (int32, each in ``[0, m]``) before and through it, saturated at ``m``."""
  g = sizes.shape[0]
  if not g:
    return sizes, sizes
  if g * m <= INT32_MAX and _masked(g, MASKED_SUMS_FROM):
    # No partial sum of sizes in [0, m] can overflow.
    return (jnp.minimum(_prefix_sums(sizes, inclusive=False), m),
            jnp.minimum(_prefix_sums(sizes, inclusive=True), m))
  if g * m <= INT32_MAX:
    ends = jnp.minimum(jnp.cumsum(sizes, dtype=jnp.int32), m)
  else:
    ends = jax.lax.associative_scan(lambda a, b: jnp.minimum(a, m - b) + b, sizes)
  return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]]), ends


def batch_rows(sizes: jax.Array, m: int, *, shared_groups: bool) -> tuple[jax.Array, jax.Array]:
  """``B`` grouped GEMMs of ``m`` rows as one: where each row goes.

  ``sizes [B, G]`` are clipped sizes (:func:`clip_sizes`, each row summing to
  at most ``m``). With ``shared_groups`` (one ``rhs [G, K, N]`` for every
  batch) the ``B * m`` rows are ordered by group, then batch: group ``g``
  holds the rows of every batch's group ``g``; otherwise (``rhs [B, G, K,
  N]`` flattened to ``[B * G, K, N]``) by batch, then group. The rows past
  each batch's groups come last (the tail: zeros in the product).

  Returns:
    ``(dest [B, m] int32, sizes [G or B * G] int32)``: row ``r`` of batch
    ``b`` is row ``dest[b, r]`` of the one GEMM, whose group sizes are
    ``sizes``. ``dest`` is a permutation of ``range(B * m)``.
  """
  b, g = sizes.shape
  i32 = functools.partial(jnp.cumsum, dtype=jnp.int32)
  ends = i32(sizes, axis=1)  # [B, G], at most m
  if shared_groups:
    flat = jnp.sum(sizes, axis=0, dtype=jnp.int32)  # [G]
    # group g's first row, then the rows of batches before b in group g
    first = (i32(flat) - flat)[None, :] + i32(sizes, axis=0) - sizes
  else:
    flat = sizes.reshape(-1)
    first = (i32(flat) - flat).reshape(b, g)
  tail = m - ends[:, -1]  # [B]
  tail_first = jnp.sum(flat, dtype=jnp.int32) + i32(tail) - tail
  # dest = first row of the row's group + its index within the group
  base = jnp.concatenate([first - (ends - sizes), (tail_first - ends[:, -1])[:, None]], axis=1)
  rows = jnp.arange(m, dtype=jnp.int32)
  grp = jax.vmap(lambda e: jnp.searchsorted(e, rows, side="right", method="compare_all"))(ends)
  dest = jnp.take_along_axis(base, grp.astype(jnp.int32), axis=1) + rows[None, :]
  return dest.astype(jnp.int32), flat


def banded_item(rest, tiles_n: int, tasks):
  """``(task, column tile)`` of work item ``rest`` when each band of tasks
  walks its column tiles, its tasks first within one (the Mosaic kernel's
  order 2). The band of tasks ``[b0, b0 + bw)`` owns the items ``[b0 *
  tiles_n, (b0 + bw) * tiles_n)``, so the task at ``rest // tiles_n`` names
  it. ``tasks`` is the work list with band rows (a kernel's ref or an array)."""
  from jax import lax
  guess = lax.div(rest, jnp.int32(tiles_n))
  b0 = tasks[BAND0, guess]
  bw = tasks[BANDW, guess]
  b_rest = rest - b0 * tiles_n
  return b0 + lax.rem(b_rest, bw), lax.div(b_rest, bw)


def max_tasks(m: int, groups: int, block_m: int, align: int = ALIGN) -> int:
  """A static bound on the row tasks of ``m`` rows in ``groups`` groups (and
  the tail): each of the ``groups + 1`` groups takes at most
  ``(size + align - 1) / block_m + 1`` tasks."""
  return -(-(m + (groups + 1) * (align - 1)) // block_m) + groups + 1


def row_tasks(group_sizes: jax.Array, m: int, block_m: int,
              align: int = ALIGN, band_cap: int = 0) -> tuple[jax.Array, jax.Array]:
  """``(tasks [4, T] int32, count [1] int32)`` for ``m`` rows (module doc).

  The tail group has index ``len(group_sizes)``. With ``band_cap > 0``,
  ``tasks`` has two more rows: each group's ``n`` tasks are split into
  ``ceil(n / band_cap)`` bands of ``ceil(n / bands)`` tasks (the last one
  narrower), and ``tasks[BAND0, t]``,
  ``tasks[BANDW, t]`` are the first task and the width of task ``t``'s band
  (unused tasks: a band of their own, width 1).
  """
  if block_m % align:
    raise ValueError(f"block_m={block_m} must be a multiple of align={align}")
  g = group_sizes.shape[0]
  t = max_tasks(m, g, block_m, align)
  # clip_sizes' bounds, then the tail: rows past the last group.
  starts, ends = _bounds(clipped_int32(group_sizes, m, name="group_sizes"), m)
  last = ends[-1:] if g else jnp.zeros((1,), jnp.int32)
  starts = jnp.concatenate([starts, last])
  ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
  first = (starts // align) * align
  ntiles = jnp.where(ends > starts, (ends - first + block_m - 1) // block_m, 0)
  # Tasks before each group: at most m / align + g + 1 of them, no overflow.
  if _masked(g + 1, MASKED_SUMS_FROM):
    before = _prefix_sums(ntiles, inclusive=False)
  else:
    before = jnp.cumsum(ntiles, dtype=jnp.int32) - ntiles
  count = before[-1:] + ntiles[-1:]
  tid = jnp.arange(t, dtype=jnp.int32)
  # Task i's group is the number of groups ending at or before it (the
  # groups' task ranges are in order), capped at the tail's index g.
  values = jnp.stack([first, before, ntiles, starts, ends])  # [5, g + 1]
  if _masked(g + 1, TELESCOPED_FROM) and t * g <= TELESCOPED_MAX_ELEMENTS:
    # A group's value at it telescopes: v[0] + sum over groups h < g whose
    # tasks end by i of (v[h + 1] - v[h]), one reduction for all the values.
    done = (before[1:] <= tid[:, None]).astype(jnp.int32)  # [T, g]: group h ended by i
    steps = jnp.diff(values, axis=1)  # [5, g]
    grp = jnp.sum(done, axis=1, dtype=jnp.int32)
    at = values[:, :1] + jnp.sum(done[None] * steps[:, None, :], axis=2, dtype=jnp.int32)
  else:
    grp = jnp.minimum(jnp.searchsorted(before + ntiles, tid, side="right",
                                       method="compare_all"), g).astype(jnp.int32)
    at = values[:, grp]
  first_g, before_g, n_g, start_g, end_g = at
  row0 = first_g + (tid - before_g) * block_m
  lo = jnp.maximum(start_g, row0)
  hi = jnp.minimum(end_g, row0 + block_m)
  used = tid < count[0]
  size = jnp.where(used, jnp.maximum(hi - lo, 0), 0)
  start = jnp.where(used, lo - row0, 0)
  row0 = jnp.where(used, row0, 0)
  rows = [grp, row0, start, size]
  if band_cap:
    bands = (n_g + band_cap - 1) // band_cap
    width = (n_g + jnp.maximum(bands, 1) - 1) // jnp.maximum(bands, 1)
    local = tid - before_g
    b0 = before_g + (local // jnp.maximum(width, 1)) * width
    bw = jnp.minimum(width, before_g + n_g - b0)
    rows += [jnp.where(used, b0, tid), jnp.where(used, bw, 1)]
  tasks = jnp.stack(rows).astype(jnp.int32)
  return tasks, count.astype(jnp.int32)
