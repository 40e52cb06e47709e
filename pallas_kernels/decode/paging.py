"""A paged KV cache: checks of the pages and block tables, and the gather that
makes a contiguous cache of them.

Layout as serving stacks keep it (vLLM, JAX's paged attention):
``k_pages, v_pages [num_pages, page_size, kv_heads, head_dim]`` (a pool of
pages shared by every sequence), ``block_tables [batch, max_pages]`` (the
page ids of each sequence's cache, in order) and ``kv_lengths [batch]``.
Position ``j`` of sequence ``b`` lies at
``pages[block_tables[b, j // page_size], j % page_size]``; the logical cache
length is ``max_pages * page_size``.

Only the entries that hold a sequence's keys are read (entry ``j`` below
``ceil(length / page_size)``); the others may hold anything (``-1``
padding). Where the table and the lengths are concrete (not traced),
:func:`check_block_tables` checks those entries; traced ones are clipped to
``[0, num_pages - 1]`` where they are read (:func:`clip_pages`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._integers import clipped_int32, shape_and_dtype
from pallas_kernels.attention.common import check_call, check_lengths

__all__ = ["check_pages", "check_block_tables", "table_int32", "clip_pages", "gather_pages",
           "is_concrete", "logical_cache", "shuffled_tables", "to_pages", "check_paged_call"]


def is_concrete(x) -> bool:
  """Whether ``x`` holds values now (not a tracer under ``jax.jit``)."""
  return not isinstance(x, jax.core.Tracer)


def check_pages(q, k_pages, v_pages, block_tables) -> tuple[int, int, int]:
  """Checks the shapes of a paged call; ``(num_pages, page_size, max_pages)``.

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``.
    k_pages, v_pages: ``[num_pages, page_size, kv_heads, head_dim]``.
    block_tables: ``[batch, max_pages]`` integers.

  Raises:
    ValueError: wrong ranks, ``k``/``v`` pages of different shapes, an empty
      pool or pages of no rows, or a table that is not ``[batch, max_pages]``
      integers.
  """
  for name, a in (("k", k_pages), ("v", v_pages)):
    if a.ndim != 4:
      raise ValueError(f"with block_tables, {name} must have rank 4 ([num_pages, page_size, "
                       f"kv_heads, head_dim]); got {name}.shape={a.shape}")
  if k_pages.shape != v_pages.shape:
    raise ValueError(f"k and v pages must have the same shape; got k.shape={k_pages.shape}, "
                     f"v.shape={v_pages.shape}")
  num_pages, page_size = k_pages.shape[0], k_pages.shape[1]
  if num_pages < 1 or page_size < 1:
    raise ValueError(f"the pages must hold at least one page of at least one row; got "
                     f"k.shape={k_pages.shape}")
  shape, dtype = shape_and_dtype(block_tables, name="block_tables")
  batch = q.shape[0] if q.ndim >= 1 else None
  if len(shape) != 2 or shape[0] != batch:
    raise ValueError(f"block_tables must have shape [batch, max_pages] with batch={batch}; "
                     f"got block_tables.shape={shape}")
  if dtype == np.bool_ or not jnp.issubdtype(dtype, jnp.integer):
    raise ValueError(f"block_tables must be integers; got block_tables.dtype={dtype}")
  return num_pages, page_size, shape[1]


def check_block_tables(block_tables, kv_lengths, *, num_pages: int, page_size: int,
                       q_len: int = 1, window_left: int = -1) -> None:
  """Where the table and the lengths are concrete (``kv_lengths`` None: every
  sequence full), checks that every entry holding keys of its sequence is a
  page of the pool and that no length passes the table's ``max_pages *
  page_size``; traced ones are left to :func:`clip_pages` and the kernels'
  clip of the lengths. Negative lengths count as 0, as everywhere. Under a
  left window bound ``window_left`` the pages wholly left of a sequence's
  window (keys below ``length - q_len - window_left``) hold none of its
  keys: their entries may hold anything, as a serving stack frees them.

  Raises:
    ValueError: a length above ``max_pages * page_size``, or a page id
      outside ``[0, num_pages)`` among the entries a sequence's keys use
      (the first such sequence and entry are named).
  """
  if not is_concrete(block_tables) or (kv_lengths is not None
                                       and not is_concrete(kv_lengths)):
    return
  table = np.asarray(block_tables)
  batch, max_pages = table.shape
  kv_len = max_pages * page_size
  if kv_lengths is None:
    lens = np.full((batch,), kv_len, np.int64)
  else:
    raw = np.asarray(kv_lengths)
    over = np.nonzero(raw > kv_len)[0]
    if over.size:
      b = int(over[0])
      raise ValueError(f"kv_lengths[{b}]={int(raw[b])} passes the block table's "
                       f"max_pages * page_size = {max_pages} * {page_size} = {kv_len}")
    lens = np.clip(raw, 0, kv_len).astype(np.int64)
  used = -(-lens // page_size)                                     # [batch]
  in_use = np.arange(max_pages)[None, :] < used[:, None]           # [batch, max_pages]
  if window_left >= 0:
    window_left = min(window_left, kv_len + q_len)  # (the same pages; no int64 overflow)
    gone = np.maximum(lens - q_len - window_left, 0) // page_size  # pages left of the window
    in_use &= np.arange(max_pages)[None, :] >= gone[:, None]
  bad = in_use & ((table < 0) | (table >= num_pages))
  if bad.any():
    b, j = (int(i) for i in np.argwhere(bad)[0])
    raise ValueError(f"block_tables[{b}, {j}]={int(table[b, j])} is not a page of the pool "
                     f"[0, {num_pages}) (sequence {b} of length {int(lens[b])} uses its "
                     f"first {int(used[b])} entries)")


def table_int32(block_tables, num_pages: int) -> jax.Array:
  """The table as int32: ids wider than int32 are clipped to
  ``[0, num_pages - 1]`` in their own dtype first (an int64 ``2**32`` is
  the last page, not the 0 it would wrap to); narrower ones are only cast
  (every reader clips them, :func:`clip_pages`)."""
  return clipped_int32(block_tables, num_pages - 1, name="block_tables", clip_narrow=False)


def clip_pages(block_tables: jax.Array, num_pages: int) -> jax.Array:
  """Page ids clipped to ``[0, num_pages - 1]`` (entries past a sequence's
  length, and traced tables the checks could not see)."""
  return jnp.clip(block_tables, 0, num_pages - 1)


def gather_pages(pages: jax.Array, block_tables: jax.Array) -> jax.Array:
  """``[batch, max_pages * page_size, kv_heads, head_dim]``: each sequence's
  pages in order (ids clipped to the pool), a contiguous cache."""
  batch, max_pages = block_tables.shape
  _, page_size, heads, d = pages.shape
  out = pages[clip_pages(block_tables, pages.shape[0])]   # [batch, max_pages, page, h, d]
  return out.reshape(batch, max_pages * page_size, heads, d)


def logical_cache(pages, batch: int, max_pages: int) -> jax.ShapeDtypeStruct:
  """The shape and dtype of the contiguous cache the pages stand for,
  ``[batch, max_pages * page_size, kv_heads, head_dim]`` (for the checks
  that contiguous calls share)."""
  _, page_size, heads, d = pages.shape
  return jax.ShapeDtypeStruct((batch, max_pages * page_size, heads, d), pages.dtype)


def shuffled_tables(key: jax.Array, batch: int, max_pages: int,
                    num_pages: int | None = None) -> jax.Array:
  """``[batch, max_pages]`` int32 block tables whose pages are drawn from a
  random permutation of a pool of ``num_pages`` (default ``batch *
  max_pages``): a sequence's pages neither in order nor adjacent, as a
  serving allocator leaves them after a while."""
  n = batch * max_pages if num_pages is None else num_pages
  if batch < 1 or max_pages < 1 or n < batch * max_pages:
    raise ValueError(f"a pool of {n} pages cannot hold batch={batch} x max_pages="
                     f"{max_pages} distinct pages")
  perm = jax.random.permutation(key, n)[:batch * max_pages]
  return perm.reshape(batch, max_pages).astype(jnp.int32)


def to_pages(cache: jax.Array, block_tables, num_pages: int, fill=0) -> jax.Array:
  """A contiguous cache ``[batch, max_pages * page_size, kv_heads, head_dim]``
  written into a pool of ``num_pages`` pages at the ids of ``block_tables``
  (distinct, in range); the pages no entry names hold ``fill``. The inverse
  of :func:`gather_pages`."""
  batch, max_pages = np.shape(block_tables)
  page = cache.shape[1] // max_pages
  pool = jnp.full((num_pages, page) + cache.shape[2:], fill, cache.dtype)
  rows = cache.reshape((batch * max_pages, page) + cache.shape[2:])
  return pool.at[jnp.asarray(block_tables).reshape(-1)].set(rows)


def check_paged_call(q, k_pages, v_pages, block_tables, kv_lengths, scale, *,
                     window_left: int = -1):
  """The checks of a decode call on a paged cache, in the order a user meets
  them (ranks, pages, the attention call on the logical cache, the lengths,
  then the table's entries): ``(scale, kv_len, num_pages, page_size, table)``
  with the table as int32 (ids clipped where traced)."""
  if np.ndim(q) != 4:
    check_call(q, k_pages, v_pages, scale)  # q's rank error
  num_pages, page_size, max_pages = check_pages(q, k_pages, v_pages, block_tables)
  cache = logical_cache(k_pages, q.shape[0], max_pages)
  try:
    scale = check_call(q, cache, cache, scale)
  except ValueError as e:  # name the pages the caller passed, not the logical cache
    raise ValueError(str(e).replace(f"k.shape={cache.shape}", f"k_pages.shape="
                                    f"{tuple(k_pages.shape)}")) from None
  kv_len = cache.shape[1]
  if kv_lengths is not None:
    check_lengths(kv_lengths, q.shape[0], kv_len)  # shape and dtype errors first
  check_block_tables(block_tables, kv_lengths, num_pages=num_pages, page_size=page_size,
                     q_len=q.shape[1], window_left=window_left)
  return scale, kv_len, num_pages, page_size, table_int32(block_tables, num_pages)
