"""The float32 grouped-GEMM reference every backend is checked against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels.ragged_dot.worklist import clip_sizes

__all__ = ["ragged_dot_reference", "ragged_dot_reference_by_expert"]

#: Above this many bytes of ``M x G x K`` float32, the reference loops over
#: row blocks: XLA's ragged dot materialises an ``[M, G, K]`` operand (Arctic's
#: 128 experts at 32,768 rows: 60 GB in bfloat16, more than an H100 has).
LOOP_ABOVE_BYTES = 1 << 32


def ragged_dot_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                         out_dtype=None, *, block_rows: int | None = None) -> jax.Array:
  """``lax.ragged_dot`` in float32 at highest precision (the test reference).

  Where that would materialise more than :data:`LOOP_ABOVE_BYTES` (or when
  ``block_rows`` is given), the same product is computed one expert and one
  block of ``block_rows`` rows at a time, in memory proportional to one
  expert's weight; rows past ``sum(group_sizes)`` are zeros either way.
  Negative sizes count as 0 and sizes summing past ``M`` are clipped at
  ``M`` (:func:`~pallas_kernels.ragged_dot.worklist.clip_sizes`).
  """
  out_dtype = lhs.dtype if out_dtype is None else out_dtype
  (m, k), g = lhs.shape, rhs.shape[0]
  group_sizes = clip_sizes(group_sizes, m)
  if block_rows is None and m * g * k * 4 <= LOOP_ABOVE_BYTES:
    y = jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32),
                           group_sizes,
                           precision=jax.lax.Precision.HIGHEST)
    return y.astype(out_dtype)
  return _blocked(lhs, lambda e: jax.lax.dynamic_index_in_dim(rhs, e, 0, keepdims=False),
                  g, rhs.shape[2], group_sizes, min(block_rows or 512, m)).astype(out_dtype)


def ragged_dot_reference_by_expert(lhs: jax.Array, expert_weight, g: int, n: int,
                                   group_sizes: jax.Array, out_dtype=None, *,
                                   block_rows: int = 512) -> jax.Array:
  """:func:`ragged_dot_reference` with expert ``e``'s ``[K, N]`` weight given
  by ``expert_weight(e)`` (``e`` traced), built one expert at a time: for
  weights whose whole float32 form would not fit in memory (a quantized
  weight dequantized expert by expert)."""
  out_dtype = lhs.dtype if out_dtype is None else out_dtype
  m = lhs.shape[0]
  group_sizes = clip_sizes(group_sizes, m)
  return _blocked(lhs, expert_weight, g, n, group_sizes, min(block_rows, m)).astype(out_dtype)


def _blocked(lhs, expert_weight, g: int, n: int, group_sizes, b: int) -> jax.Array:
  """Expert by expert, its rows ``b`` at a time: a window of ``b`` rows that
  ends inside the array, masked to the expert's rows."""
  m = lhs.shape[0]
  # Clipped sizes (ragged_dot_reference): the running sum stays <= M.
  ends = jnp.cumsum(group_sizes, dtype=jnp.int32)
  starts = ends - group_sizes
  rows = jnp.arange(b)

  def expert(e, out):
    w = expert_weight(e).astype(jnp.float32)

    def block(j, out):
      r0 = starts[e] + j * b
      s = jnp.minimum(r0, m - b)
      x = jax.lax.dynamic_slice_in_dim(lhs, s, b, 0).astype(jnp.float32)
      y = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)
      keep = ((s + rows >= r0) & (s + rows < ends[e]))[:, None]
      cur = jax.lax.dynamic_slice_in_dim(out, s, b, 0)
      return jax.lax.dynamic_update_slice_in_dim(out, jnp.where(keep, y, cur), s, 0)

    return jax.lax.fori_loop(0, (ends[e] - starts[e] + b - 1) // b, block, out)

  return jax.lax.fori_loop(0, g, expert, jnp.zeros((m, n), jnp.float32))
