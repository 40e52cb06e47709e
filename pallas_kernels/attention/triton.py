"""Pallas (Triton backend) flash attention, forward: ``softmax(q k^T * scale) v``.

Layout ``[batch, seq, heads, head_dim]`` for ``q``, ``k`` and ``v``. Grouped-query
attention: ``k`` and ``v`` have ``kv_heads`` heads, a divisor of ``q_heads``; the
program of query head ``h`` reads KV head ``h // (q_heads // kv_heads)`` in place,
so repeated K/V are never materialized.

One program computes ``block_q`` query rows of one (batch, head) with the online
softmax of FlashAttention-2: a loop over KV blocks of ``block_k`` rows keeps the
running row max ``m``, the running denominator ``l`` and the unnormalized output
in fp32, and normalizes once at the end. The loop is split in two parts:

* full blocks, where every (row, column) is visible: no mask at all;
* edge blocks (the causal diagonal, the ragged end of the KV sequence): a mask
  from ``iota`` comparisons.

A causal program stops at its last visible KV block, so fully masked blocks are
never loaded. Lengths need not be multiples of the blocks: the last query
block is shifted back to end at the last row (``q_block_start``; a row mask
only for sequences shorter than one block), columns past ``kv_len`` are
masked in the edge blocks.
``head_dim`` is padded to the next power of two inside the kernel (masked
loads), never in HBM.

Causal masking is aligned top-left, as in ``jax.nn.dot_product_attention``:
query ``i`` sees keys ``j <= i``.

Grid: ``(q_blocks, batch * q_heads)``. Axis 0 varies fastest, so the programs
in flight share one head's K/V in L2. Under a causal mask the query blocks run
from the last (the most KV blocks) to the first: the long programs start in the
first wave and the short ones fill the tail.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl

from pallas_kernels._launch import MIN_BLOCK as _MIN_BLOCK
from pallas_kernels._launch import check_launch, match_varying, out_struct
from pallas_kernels._triton_lowering import compiler_params, plgpu
from pallas_kernels.attention.common import check_align, check_call, check_lengths

__all__ = ["TritonAttentionConfig", "attention", "kv_blocks", "q_block_start",
           "MAX_ELEMENTS"]

#: Triton addresses operands with 32-bit offsets.
MAX_ELEMENTS = 2**31 - 1

# A finite "minus infinity": exp2(mask - m) is exactly 0, and a row never sees
# (-inf) - (-inf).
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)
_LOG2E = math.log2(math.e)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TritonAttentionConfig:
  """Launch parameters of the Triton attention kernel.

  Attributes:
    block_q: query rows per program; a power of two >= 16.
    block_k: KV rows per loop step; a power of two >= 16.
    num_warps: warps per program; a power of two in [1, 16].
    num_stages: software-pipelining depth of the KV loop, in [1, 8].
  """

  block_q: int = 128
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 2

  def __post_init__(self):
    check_launch(self, ("block_q", "block_k"))


def q_block_start(q_block, *, q_len: int, block_q: int):
  """First query row of program ``q_block``.

  When ``q_len`` is not a multiple of ``block_q`` (but at least one block),
  the last block is shifted back to end at ``q_len - 1``: it overlaps the
  block before it instead of reaching past the end, so no program needs a
  row mask. The overlapping rows are computed twice, bit for bit the same,
  and written twice. (Row masks on the Q load and the output store cost
  30-35% of the kernel's speed on an H200.)
  """
  if q_len % block_q == 0 or q_len < block_q:
    return q_block * block_q
  minimum = jnp.minimum if isinstance(q_block, jax.Array) else np.minimum
  return minimum(q_block * block_q, q_len - block_q)


def kv_blocks(q_block, *, q_len: int, kv_len: int, block_q: int, block_k: int,
              causal: bool):
  """``(full, total)`` KV blocks the program of query block ``q_block`` visits.

  Blocks ``[0, full)`` need no mask; ``[full, total)`` are edge blocks. Works on
  ints, NumPy arrays (the tuner) and traced values (the kernel).
  """
  minimum = jnp.minimum if isinstance(q_block, jax.Array) else np.minimum
  n_kv = -(-kv_len // block_k)
  full = kv_len // block_k
  if not causal:
    return full, n_kv
  first_row = q_block_start(q_block, q_len=q_len, block_q=block_q)
  last_row = minimum(first_row + block_q, q_len) - 1
  total = minimum(last_row // block_k + 1, n_kv)
  # Block j is visible to every row of the query block when its last column
  # is <= the block's first row.
  full = minimum((first_row + 1) // block_k, full)
  return full, total


def kv_range(first_row, end_row, *, valid, shift, q_len: int, block_k: int, causal: bool):
  """``(full, total)`` KV blocks of the query rows ``[first_row, end_row)``
  with ``valid`` keys and the diagonal at ``col <= row + shift`` (traced
  values; the general form of :func:`kv_blocks`)."""
  last_row = jnp.minimum(end_row, q_len) - 1
  full = valid // block_k
  total = (valid + block_k - 1) // block_k
  if causal:
    full = jnp.minimum(full, jnp.maximum(first_row + shift + 1, 0) // block_k)
    total = jnp.minimum(total, (jnp.maximum(last_row + shift + 1, 0) + block_k - 1) // block_k)
  total = jnp.maximum(total, 0)
  return jnp.minimum(full, total), total


def _attention_kernel(*refs, q_len, kv_len, q_heads, group, head_dim, dp, bq, bk, causal,
                      scale, has_lengths, bottom_right):
  if has_lengths:
    q_ref, k_ref, v_ref, len_ref, o_ref = refs
  else:
    q_ref, k_ref, v_ref, o_ref = refs
  n_q = pl.cdiv(q_len, bq)
  pid_q = pl.program_id(0)
  q_block = (n_q - 1 - pid_q) if causal else pid_q
  bh = pl.program_id(1)
  b = bh // q_heads
  h = bh % q_heads
  kvh = h // group

  start = q_block_start(q_block, q_len=q_len, block_q=bq)
  rows = pl.ds(start, bq)
  cols = pl.ds(jnp.int32(0), dp)  # int32 like the other indices (jax_enable_x64)
  row_ids = start + jnp.arange(bq, dtype=jnp.int32)
  # Only a sequence shorter than one block needs a row mask.
  mask_q = (row_ids < q_len) if q_len < bq else None
  mask_d = (jnp.arange(dp, dtype=jnp.int32) < head_dim) if dp != head_dim else None
  q_mask = _outer_and(mask_q, mask_d)
  q = plgpu.load(q_ref.at[b, rows, h, cols], mask=q_mask,
                 other=None if q_mask is None else 0.0)
  kv_mask = None if mask_d is None else mask_d[None, :]
  qk_scale = scale * _LOG2E  # exp(x) = exp2(x * log2(e))
  # The valid keys of this sequence, and where the causal diagonal sits:
  # query row r sees keys c <= r + shift.
  if has_lengths:
    valid = jnp.clip(len_ref[b], 0, kv_len).astype(jnp.int32)
  else:
    valid = kv_len
  shift = (valid - q_len) if bottom_right else 0

  def step(j, carry, *, edge: bool):
    acc, m_i, l_i = carry
    ks = pl.ds(j * bk, bk)
    # Keys past the valid length are only read in edge blocks; loaded as
    # zeros there (NaN in a cache past a sequence's length never reaches the
    # output).
    if edge and (has_lengths or kv_len % bk):
      col_ok = (j * bk + jnp.arange(bk, dtype=jnp.int32)) < valid
      ld_mask = _outer_and(col_ok, mask_d)
    else:
      col_ok = None
      ld_mask = kv_mask
    other = None if ld_mask is None else 0.0
    k = plgpu.load(k_ref.at[b, ks, kvh, cols], mask=ld_mask, other=other)
    s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())),
                            preferred_element_type=jnp.float32) * qk_scale
    if edge:
      col_ids = j * bk + jnp.arange(bk, dtype=jnp.int32)
      mask = None
      if causal:
        mask = (row_ids[:, None] + shift) >= col_ids[None, :]
      if col_ok is not None:
        mask = col_ok[None, :] if mask is None else mask & col_ok[None, :]
      if mask is not None:
        s = jnp.where(mask, s, _MASK_VALUE)
    m_next = jnp.maximum(m_i, jnp.max(s, axis=1))
    alpha = jnp.exp2(m_i - m_next)
    p = jnp.exp2(s - m_next[:, None])
    l_next = l_i * alpha + jnp.sum(p, axis=1)
    v = plgpu.load(v_ref.at[b, ks, kvh, cols], mask=ld_mask, other=other)
    acc = acc * alpha[:, None] + jax.lax.dot(p.astype(v.dtype), v,
                                             preferred_element_type=jnp.float32)
    return acc, m_next, l_next

  if has_lengths or bottom_right:
    full, total = kv_range(start, start + bq, valid=valid, shift=shift, q_len=q_len,
                           block_k=bk, causal=causal)
    full, total = full.astype(jnp.int32), total.astype(jnp.int32)
  else:
    full, total = kv_blocks(q_block, q_len=q_len, kv_len=kv_len, block_q=bq,
                            block_k=bk, causal=causal)
  carry = (jnp.zeros((bq, dp), jnp.float32),
           jnp.full((bq,), -jnp.inf, jnp.float32),
           jnp.zeros((bq,), jnp.float32))
  zero = jnp.int32(0) if isinstance(full, jax.Array) else 0
  carry = jax.lax.fori_loop(zero, full, functools.partial(step, edge=False), carry)
  acc, m_i, l_i = jax.lax.fori_loop(full, total, functools.partial(step, edge=True),
                                    carry)
  out = acc / l_i[:, None]
  if has_lengths or bottom_right:
    # A query that sees no key (an empty sequence, or a row before the
    # diagonal's start) gives zeros.
    sees = (row_ids + shift >= 0) & (valid > 0) if causal else jnp.full((bq,), valid > 0)
    out = jnp.where(sees[:, None], out, 0.0)
  plgpu.store(o_ref.at[b, rows, h, cols], out.astype(o_ref.dtype), mask=q_mask)


def _outer_and(a, b):
  if a is None and b is None:
    return None
  if a is None:
    return b[None, :]
  if b is None:
    return a[:, None]
  return a[:, None] & b[None, :]


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, config: TritonAttentionConfig,
              causal: bool = True, scale: float | None = None, kv_lengths=None,
              causal_align: str = "top_left", interpret: bool = False) -> jax.Array:
  """Flash attention forward with the Pallas Triton kernel.

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``, bfloat16 or float16.
    k, v: ``[batch, kv_len, kv_heads, head_dim]``, same dtype; ``kv_heads``
      divides ``q_heads``.
    config: launch parameters; used as given, never changed.
    causal: mask keys after the query, aligned as ``causal_align`` says.
    scale: softmax scale (default ``1 / sqrt(head_dim)``).
    kv_lengths: ``[batch]`` int valid KV length per sequence (keys past it
      are neither seen nor read), or None (all ``kv_len``).
    causal_align: ``"top_left"`` (query ``i`` sees keys ``j <= i``) or
      ``"bottom_right"`` (``j <= i + L - q_len``, L the valid length): see
      ``pallas_kernels.attention.common.ALIGNS``. A query that sees no key
      gives zeros.
    interpret: run in Pallas interpret mode (CPU; for tests).

  Returns:
    ``[batch, q_len, q_heads, head_dim]`` of ``q.dtype``.

  Raises:
    ValueError: wrong ranks, mismatched batch/heads/head_dim/dtypes, an
      unsupported dtype or head_dim, an empty KV sequence, a non-finite scale
      or a config that is not a TritonAttentionConfig.
  """
  if not isinstance(config, TritonAttentionConfig):
    raise ValueError(f"config must be a TritonAttentionConfig; got {type(config).__name__}")
  scale = check_call(q, k, v, scale)
  if q.shape[1] == 0 or q.shape[0] == 0 or q.shape[2] == 0:
    return jnp.zeros(q.shape, q.dtype)
  for name, a in (("q", q), ("k", k)):
    if a.size > MAX_ELEMENTS:
      raise ValueError(f"{name} holds {a.size} elements, more than the kernel's "
                       f"32-bit offsets allow ({MAX_ELEMENTS})")
  kv_lengths = check_lengths(kv_lengths, q.shape[0], k.shape[1])
  return _attention(q, k, v, kv_lengths, config=config, causal=bool(causal), scale=scale,
                    bottom_right=check_align(causal_align) == "bottom_right"
                    and bool(causal), interpret=interpret)


@functools.partial(jax.jit, static_argnames=("config", "causal", "scale", "bottom_right",
                                             "interpret"))
def _attention(q, k, v, kv_lengths, *, config: TritonAttentionConfig, causal: bool,
               scale: float, bottom_right: bool, interpret: bool):
  batch, q_len, q_heads, head_dim = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  c = config
  dp = max(_MIN_BLOCK, pl.next_power_of_2(head_dim))
  kernel = functools.partial(
      _attention_kernel, q_len=q_len, kv_len=kv_len, q_heads=q_heads,
      group=q_heads // kv_heads, head_dim=head_dim, dp=dp, bq=c.block_q,
      bk=c.block_k, causal=causal, scale=scale, has_lengths=kv_lengths is not None,
      bottom_right=bottom_right and q_len != kv_len or bottom_right and kv_lengths is not None)
  grid = (pl.cdiv(q_len, c.block_q), batch * q_heads)
  args = (q, k, v) if kv_lengths is None else (q, k, v, kv_lengths)
  args, axes = match_varying(*args)
  with warnings.catch_warnings():
    # JAX 0.11 deprecates the Triton backend of Pallas; it still works.
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    return pl.pallas_call(
        kernel,
        out_shape=out_struct(q.shape, q.dtype, axes),
        grid=grid,
        compiler_params=compiler_params(
            num_warps=c.num_warps, num_stages=c.num_stages),
        interpret=interpret,
        name=f"wavetune_attention_{c.block_q}x{c.block_k}",
    )(*args)
