"""Pallas (Triton backend) flash-decoding: attention of a few new queries per
sequence against a long KV cache, the KV sequence split across programs.

Layout as the attention kernels: ``q [batch, q_len, q_heads, head_dim]``,
``k, v [batch, kv_len, kv_heads, head_dim]`` (the cache), optional
``kv_lengths [batch]`` (the valid length of each sequence). The queries are
the last ``q_len`` positions of each sequence: under a causal mask query
``t`` sees keys ``j <= t + L - q_len`` (``L`` its valid length), the
bottom-right alignment of FlashAttention 2.1+. ``q_len = 1`` sees the whole
valid cache.

One program takes one KV head of one sequence, all the query rows that share
it (``q_len * q_heads / kv_heads`` rows: the group's heads at every new
position, so a shared KV head is read once per group, not once per query
head; ``block_h`` rows at a time) and one of ``num_splits`` contiguous
chunks of the sequence's valid keys (whole blocks, cut from the valid length
at run time, so a short sequence's work is still spread over all its
programs). It runs the online softmax of FlashAttention-2
over its chunk in ``block_k``-key blocks and writes the unnormalized output
with its row max and denominator; one small XLA reduction combines the
chunks (FlashDecoding). With ``num_splits = 1`` the program normalizes and
writes the output itself.

Blocks at or past a sequence's valid length are never loaded; in the last
block the keys past it are loaded as zeros (NaN or Inf in the cache there
never reaches the output). A query that sees no key gives zeros; NaN in a
query or in a key it sees makes its output NaN, as in the float32
reference (a NaN score makes the row's denominator NaN; the output and the
chunks' combination test whether a row sees a key, never ``l > 0``).

Grid: ``(row_blocks, num_splits, batch * kv_heads)``, axis 0 fastest: the
programs of one KV chunk's row blocks run side by side and share it in L2.

A paged cache (``block_tables``, :mod:`pallas_kernels.decode.paging`): each
``block_k`` block of keys lies in one page (``block_k`` divides
``page_size``), so a block's page id is one load from the block table
(clipped to the pool) and the block is ``pages[page, off:off + block_k]``.
Only the entries of blocks below a sequence's length are read.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._launch import MIN_BLOCK, check_launch, match_varying, out_struct
from pallas_kernels._triton_lowering import compiler_params, plgpu
from pallas_kernels.attention.common import check_call, check_lengths
from pallas_kernels.decode import chunk_len
from pallas_kernels.decode import paging

__all__ = ["TritonDecodeConfig", "decode_attention", "chunk_len", "MAX_SPLITS", "MAX_ELEMENTS"]

#: Most elements of one cache array: the kernel's 32-bit offsets reach
#: ``size - 1`` (the sweeps' caches of exactly 2**31 elements pass the check).
MAX_ELEMENTS = 2**31

#: Most KV chunks per sequence.
MAX_SPLITS = 256

# A finite "minus infinity" (see pallas_kernels.attention.triton).
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TritonDecodeConfig:
  """Launch parameters of the Triton flash-decoding kernel.

  Attributes:
    block_h: query rows (heads x new positions of one KV head) per program;
      a power of two >= 16.
    block_k: keys per loop step; a power of two >= 16.
    num_splits: chunks each sequence's valid keys are split into, each its
      own program; in [1, 256] (fewer where the cache has fewer blocks).
    num_warps: warps per program; a power of two in [1, 16].
    num_stages: software-pipelining depth of the key loop, in [1, 8].
  """

  block_h: int = 16
  block_k: int = 128
  num_splits: int = 1
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    check_launch(self, ("block_h", "block_k"))
    if not 1 <= self.num_splits <= MAX_SPLITS:
      raise ValueError(f"TritonDecodeConfig.num_splits={self.num_splits} must be in "
                       f"[1, {MAX_SPLITS}]")


def _decode_kernel(*refs, q_len, kv_len, rows, group, head_dim, dp, bh, bk, chunk, splits,
                   causal, scale, has_lengths, split, page_size, num_pages):
  q_ref, k_ref, v_ref, *refs = refs
  len_ref = refs.pop(0) if has_lengths else None
  bt_ref = refs.pop(0) if page_size else None
  out_refs = refs
  kv_heads = q_ref.shape[1]
  rb, s, bhh = pl.program_id(0), pl.program_id(1), pl.program_id(2)
  b = bhh // kv_heads
  kvh = bhh % kv_heads

  row_ids = rb * bh + jnp.arange(bh, dtype=jnp.int32)
  mask_r = (row_ids < rows) if rows % bh else None
  mask_d = (jnp.arange(dp, dtype=jnp.int32) < head_dim) if dp != head_dim else None
  q_mask = _outer_and(mask_r, mask_d)
  r_sl, cols = pl.ds(rb * bh, bh), pl.ds(jnp.int32(0), dp)  # int32 indices (jax_enable_x64)
  q = plgpu.load(q_ref.at[b, kvh, r_sl, cols], mask=q_mask,
                 other=None if q_mask is None else 0.0)
  qk_scale = scale * _LOG2E  # exp(x) = exp2(x * log2(e))
  if has_lengths:
    valid = jnp.clip(len_ref[b], 0, kv_len).astype(jnp.int32)
  else:
    valid = jnp.int32(kv_len)
  # Row r is query position t = r // group; it sees keys c <= t + shift.
  t = row_ids // group
  shift = valid - q_len
  if has_lengths:
    # Chunks of this sequence's valid keys: every split gets an even share
    # of the work however short the sequence is.
    per = (valid + splits - 1) // splits
    chunk = (per + bk - 1) // bk * bk
  lo = s * chunk
  hi = jnp.minimum(lo + chunk, valid)
  total = jnp.maximum((hi - lo + bk - 1) // bk, 0)
  # Keys every row sees: below the valid length and, under a causal mask,
  # at or before the first row's diagonal.
  seen_by_all = jnp.minimum(hi, shift + 1) if causal else hi
  full = jnp.clip((seen_by_all - lo) // bk, 0, total)
  kv_mask = None if mask_d is None else mask_d[None, :]

  def kv_block(ref, start):
    # The block's keys: rows [start, start + bk) of the sequence.
    if not page_size:
      return ref.at[b, pl.ds(start, bk), kvh, cols]
    page = jnp.clip(bt_ref[b, start // page_size], 0, num_pages - 1).astype(jnp.int32)
    return ref.at[page, pl.ds(start % page_size, bk), kvh, cols]

  def step(j, carry, *, edge: bool):
    acc, m_i, l_i = carry
    start = lo + j * bk
    col_ids = start + jnp.arange(bk, dtype=jnp.int32)
    if edge:
      col_ok = col_ids < valid
      ld_mask = _outer_and(col_ok, mask_d)
    else:
      ld_mask = kv_mask
    other = None if ld_mask is None else 0.0
    k = plgpu.load(kv_block(k_ref, start), mask=ld_mask, other=other)
    sc = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                             preferred_element_type=jnp.float32) * qk_scale
    if edge:
      mask = col_ok[None, :]
      if causal:
        mask = mask & (col_ids[None, :] <= (t + shift)[:, None])
      sc = jnp.where(mask, sc, _MASK_VALUE)
    m_next = jnp.maximum(m_i, jnp.max(sc, axis=1))
    alpha = jnp.exp2(m_i - m_next)
    p = jnp.exp2(sc - m_next[:, None])
    l_next = l_i * alpha + jnp.sum(p, axis=1)
    v = plgpu.load(kv_block(v_ref, start), mask=ld_mask, other=other)
    acc = acc * alpha[:, None] + jax.lax.dot(p.astype(v.dtype), v,
                                             preferred_element_type=jnp.float32)
    return acc, m_next, l_next

  carry = (jnp.zeros((bh, dp), jnp.float32),
           jnp.full((bh,), -jnp.inf, jnp.float32),
           jnp.zeros((bh,), jnp.float32))
  carry = jax.lax.fori_loop(jnp.int32(0), full, functools.partial(step, edge=False), carry)
  acc, m_i, l_i = jax.lax.fori_loop(full, total, functools.partial(step, edge=True), carry)

  out_mask = _outer_and(mask_r, mask_d)
  if not split:
    (o_ref,) = out_refs
    sees = (valid > 0) & (t + shift >= 0) if causal else jnp.full((bh,), valid > 0)
    # A row that sees a key has l_i >= 1, or NaN (NaN in its query or its
    # keys), which reaches the output as in the float32 reference.
    out = jnp.where(sees[:, None], acc / l_i[:, None], 0.0)
    plgpu.store(o_ref.at[b, kvh, r_sl, cols], out.astype(o_ref.dtype), mask=out_mask)
  else:
    o_ref, m_ref, l_ref = out_refs
    plgpu.store(o_ref.at[s, b, kvh, r_sl, cols], acc, mask=out_mask)
    plgpu.store(m_ref.at[s, b, kvh, r_sl], m_i, mask=mask_r)
    plgpu.store(l_ref.at[s, b, kvh, r_sl], l_i, mask=mask_r)


def _outer_and(a, b):
  if a is None and b is None:
    return None
  if a is None:
    return b[None, :]
  if b is None:
    return a[:, None]
  return a[:, None] & b[None, :]


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, config: TritonDecodeConfig,
                     causal: bool = True, scale: float | None = None, kv_lengths=None,
                     block_tables=None, interpret: bool = False) -> jax.Array:
  """Flash-decoding with the Pallas Triton kernel.

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``, bfloat16 or float16: the newest
      ``q_len`` positions of each sequence.
    k, v: ``[batch, kv_len, kv_heads, head_dim]``, the KV cache (same dtype;
      ``kv_heads`` divides ``q_heads``).
    config: launch parameters; used as given.
    causal: query ``t`` sees keys ``j <= t + L - q_len`` (bottom-right);
      False: every valid key.
    scale: softmax scale (default ``1 / sqrt(head_dim)``).
    kv_lengths: ``[batch]`` int valid length per sequence (clipped to
      ``[0, kv_len]``), or None (all ``kv_len``).
    block_tables: ``[batch, max_pages]`` int page ids, or None. Given, ``k``
      and ``v`` are pages ``[num_pages, page_size, kv_heads, head_dim]``
      (:mod:`pallas_kernels.decode.paging`), ``kv_len = max_pages *
      page_size``, and ``config.block_k`` must divide ``page_size``. Concrete
      tables and lengths are checked; traced page ids are clipped to
      ``[0, num_pages - 1]``.
    interpret: Pallas interpret mode (CPU; for tests).

  Returns:
    ``[batch, q_len, q_heads, head_dim]`` of ``q.dtype``.

  Raises:
    ValueError: as :func:`pallas_kernels.attention.triton.attention`, a
      cache (or pool of pages) of more than ``2**31`` elements per array, and
      for pages: the checks of :func:`pallas_kernels.decode.paging.check_pages`
      and :func:`~pallas_kernels.decode.paging.check_block_tables`, or a
      ``block_k`` that does not divide ``page_size``.
  """
  if not isinstance(config, TritonDecodeConfig):
    raise ValueError(f"config must be a TritonDecodeConfig; got {type(config).__name__}")
  if block_tables is None:
    scale = check_call(q, k, v, scale)
    kv_len = k.shape[1]
  else:
    scale, kv_len, num_pages, page_size, block_tables = paging.check_paged_call(
        q, k, v, block_tables, kv_lengths, scale)
    if config.block_k > page_size or page_size % config.block_k:
      raise ValueError(f"config {config}: block_k={config.block_k} must divide "
                       f"page_size={page_size} (a block of keys lies in one page)")
  if q.shape[0] == 0 or q.shape[1] == 0 or q.shape[2] == 0:
    return jnp.zeros(q.shape, q.dtype)
  if k.size > MAX_ELEMENTS:
    raise ValueError(f"the KV cache holds {k.size} elements per array, more than the "
                     f"kernel's 32-bit offsets allow ({MAX_ELEMENTS}); use the xla backend")
  kv_lengths = check_lengths(kv_lengths, q.shape[0], kv_len)
  return _decode(q, k, v, kv_lengths, block_tables, config=config, causal=bool(causal),
                 scale=scale, interpret=interpret)


def group_rows(q: jax.Array, kv_heads: int) -> jax.Array:
  """``[batch, q_len, q_heads, d]`` -> ``[batch, kv_heads, q_len * group, d]``:
  the rows of one KV head together, row ``t * group + g`` (free for one query)."""
  batch, q_len, q_heads, d = q.shape
  group = q_heads // kv_heads
  if q_len == 1:
    return q.reshape(batch, kv_heads, group, d)
  q = q.reshape(batch, q_len, kv_heads, group, d).transpose(0, 2, 1, 3, 4)
  return q.reshape(batch, kv_heads, q_len * group, d)


def ungroup_rows(o: jax.Array, q_len: int) -> jax.Array:
  """The inverse of :func:`group_rows`."""
  batch, kv_heads, rows, d = o.shape
  group = rows // q_len
  if q_len == 1:
    return o.reshape(batch, 1, kv_heads * group, d)
  o = o.reshape(batch, kv_heads, q_len, group, d).transpose(0, 2, 1, 3, 4)
  return o.reshape(batch, q_len, kv_heads * group, d)


@functools.partial(jax.jit, static_argnames=("config", "causal", "scale", "interpret"))
def _decode(q, k, v, kv_lengths, block_tables, *, config: TritonDecodeConfig, causal: bool,
            scale: float, interpret: bool):
  batch, q_len, q_heads, head_dim = q.shape
  kv_heads = k.shape[2]
  if block_tables is None:
    kv_len, page_size, num_pages = k.shape[1], 0, 0
  else:
    page_size, num_pages = k.shape[1], k.shape[0]
    kv_len = block_tables.shape[1] * page_size
  c = config
  group = q_heads // kv_heads
  rows = q_len * group
  dp = max(MIN_BLOCK, pl.next_power_of_2(head_dim))
  chunk = chunk_len(kv_len, c.num_splits, c.block_k)
  splits = -(-kv_len // chunk)  # chunks that hold keys
  split = splits > 1
  if split and splits * batch * q_heads * q_len * head_dim > MAX_ELEMENTS:
    raise ValueError(f"{splits} splits: the float32 partials pass the kernel's 32-bit "
                     f"offsets ({MAX_ELEMENTS} elements); use fewer splits")
  qg = group_rows(q, kv_heads)
  kernel = functools.partial(
      _decode_kernel, q_len=q_len, kv_len=kv_len, rows=rows, group=group,
      head_dim=head_dim, dp=dp, bh=c.block_h, bk=c.block_k, chunk=chunk, splits=splits,
      causal=causal,
      scale=scale, has_lengths=kv_lengths is not None, split=split, page_size=page_size,
      num_pages=num_pages)
  grid = (pl.cdiv(rows, c.block_h), splits, batch * kv_heads)
  args = tuple(a for a in (qg, k, v, kv_lengths, block_tables) if a is not None)
  args, axes = match_varying(*args)
  if split:
    out_shape = (out_struct((splits, batch, kv_heads, rows, head_dim), jnp.float32, axes),
                 out_struct((splits, batch, kv_heads, rows), jnp.float32, axes),
                 out_struct((splits, batch, kv_heads, rows), jnp.float32, axes))
  else:
    out_shape = out_struct((batch, kv_heads, rows, head_dim), q.dtype, axes)
  with warnings.catch_warnings():
    # JAX 0.11 deprecates the Triton backend of Pallas; it still works.
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        compiler_params=compiler_params(num_warps=c.num_warps,
                                        num_stages=c.num_stages),
        interpret=interpret,
        name=f"wavetune_decode_{c.block_h}x{c.block_k}s{splits}"
             + (f"p{page_size}" if page_size else ""),
    )(*args)
  if split:
    out = _combine(*out, kv_lengths, q_len=q_len, kv_len=kv_len, group=group, causal=causal,
                   dtype=q.dtype)
  return ungroup_rows(out, q_len)


def _combine(o, m, l, kv_lengths, *, q_len, kv_len, group, causal, dtype):
  """Merges the chunks' partial softmax results (max in log2 units): one
  fused XLA reduction over the split axis.

  A chunk with no keys (``l = 0``, ``m = -inf``) weighs 0; a chunk whose
  ``l`` is NaN (NaN in the query or in a key it sees) makes the row NaN, as
  in the float32 reference (a test ``l > 0`` would drop it).
  """
  m_all = jnp.max(m, axis=0)
  w = jnp.where(l == 0, 0.0, jnp.exp2(m - m_all[None]))
  den = jnp.sum(w * l, axis=0)
  num = jnp.sum(w[..., None] * o, axis=0)
  batch, _, rows = den.shape[0], den.shape[1], den.shape[2]
  valid = (jnp.full((batch,), kv_len, jnp.int32) if kv_lengths is None
           else jnp.clip(kv_lengths, 0, kv_len))
  # A row that sees a key has den >= 1 (its top chunk weighs 1), or NaN.
  sees = jnp.broadcast_to((valid > 0)[:, None, None], den.shape)
  if causal:
    t = jnp.arange(rows, dtype=jnp.int32) // group
    sees = sees & ((t[None, :] + (valid - q_len)[:, None]) >= 0)[:, None, :]
  out = jnp.where(sees[..., None], num / jnp.where(sees, den, 1.0)[..., None], 0.0)
  return out.astype(dtype)
