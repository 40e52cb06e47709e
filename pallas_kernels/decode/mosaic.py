"""Pallas Mosaic GPU flash-decoding for Hopper, on a contiguous or a paged KV cache.

Attention of a few new queries per sequence (decode, speculative
verification, chunked prefill: 1 to 64) against a long KV cache. Layout as
:mod:`pallas_kernels.decode.triton`: ``q [batch, q_len, q_heads, head_dim]``;
the cache either contiguous, ``k, v [batch, kv_len, kv_heads, head_dim]``, or
paged, ``k, v [num_pages, page_size, kv_heads, head_dim]`` with
``block_tables [batch, max_pages]`` (the page ids of each sequence in order,
the layout of vLLM and JAX's paged attention; ``kv_len = max_pages *
page_size``). Queries are the last ``q_len`` positions of each sequence,
bottom-right causal: query ``t`` sees keys ``j <= t + L - q_len``.

One CTA takes one KV head of one sequence, 64 query rows of it (the group's
query heads at every new position, so a GQA group shares every K/V load and
one wgmma tile; more rows take more CTAs) and one of ``num_splits`` chunks
of the sequence's valid keys (flash-decoding). Two warpgroups:

* a producer streams ``block_k``-key blocks of K and V with TMA into a ring
  of ``num_stages`` shared-memory buffers. On a paged cache it reads the
  page id of each block from the block table (clipped into the pool); a
  block spans ``block_k / page_size`` pages where pages are smaller, one TMA
  copy per page;
* a consumer runs ``S = Q K^T`` and ``O += P V`` on wgmma with the online
  softmax of FlashAttention-2 in registers.

Lengths are read at run time: a chunk is cut from the sequence's valid
length, so a short sequence's work is still spread over all its splits,
nothing at or past a length is loaded beyond the last block, and a split with
no keys runs no loop step. Scores past the length (and, under a causal
mask, past each row's diagonal) are masked in the last blocks, and the V rows
of the block past the length are zeroed in shared memory before ``P V``, so
NaN or Inf there never reaches the output. A row that sees no key gives 0.

With one split the CTA normalizes and writes the output. With several it
writes float32 partial outputs (normalized) and their log-sum-exp, and one
small XLA reduction combines them (:func:`combine`).

Requirements (:func:`check_shapes`): compute capability 9.0; bfloat16 or
float16; ``head_dim`` a multiple of 16 in [64, 256]; the cache's sequence
dimension (``kv_len``, or ``page_size``) a multiple of 8 (TMA tiles it by 8
rows); on a paged cache, ``page_size`` and ``block_k`` dividing one another.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._launch import check_ints, match_varying, out_struct, \
    require_compute_capability
from pallas_kernels.attention.common import check_call, check_lengths
from pallas_kernels.attention.mosaic import swizzle_bytes
from pallas_kernels.decode import chunk_len, paging, splits_of

__all__ = ["BLOCK_H", "BLOCK_K", "COMPUTE_CAPABILITY", "MAX_SPLITS", "MosaicDecodeConfig",
           "NO_INTERPRET", "check_shapes", "combine", "decode_attention", "smem_bytes"]

COMPUTE_CAPABILITY = "9.0"
#: Query rows per CTA: one wgmma tile of the consumer warpgroup.
BLOCK_H = 64
#: Keys per pipeline step.
BLOCK_K = (64, 128, 256)
#: Most chunks per sequence.
MAX_SPLITS = 256
#: head_dim: a multiple of 16 in [64, 256] (the attention kernel's rule).
HEAD_DIM_MULTIPLE, HEAD_DIM_MIN, HEAD_DIM_MAX = 16, 64, 256
#: TMA tiles the sequence dimension of the cache by 8 rows.
SEQ_MULTIPLE = 8
_LOG2E = math.log2(math.e)
_BARRIER_BYTES = 2560  # barriers and alignment (Mosaic counted up to 2,152 over the buffers)
NO_INTERPRET = ("the Mosaic GPU decode kernel has no CPU interpret mode; its correctness "
                "is checked on a Hopper GPU (the sweep and benchmarks/decode_mosaic.py "
                "compare every config with the float32 reference)")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MosaicDecodeConfig:
  """Launch parameters of the Mosaic GPU decode kernel.

  Attributes:
    block_k: keys per pipeline step: 64, 128 or 256.
    num_stages: K/V blocks in flight (TMA ring), in [2, 8].
    num_splits: chunks each sequence's valid keys are split into, each its
      own CTA, in [1, 256] (fewer where the cache has fewer blocks).
  """

  block_k: int = 128
  num_stages: int = 2
  num_splits: int = 1

  def __post_init__(self):
    check_ints(self)
    if self.block_k not in BLOCK_K:
      raise ValueError(f"MosaicDecodeConfig.block_k={self.block_k} must be one of {BLOCK_K}")
    if not 2 <= self.num_stages <= 8:
      raise ValueError(f"MosaicDecodeConfig.num_stages={self.num_stages} must be in [2, 8]")
    if not 1 <= self.num_splits <= MAX_SPLITS:
      raise ValueError(f"MosaicDecodeConfig.num_splits={self.num_splits} must be in "
                       f"[1, {MAX_SPLITS}]")


def padded_rows(rows: int) -> int:
  """Query rows per KV head as the kernel stores them: a multiple of 8 up
  to one 64-row tile, whole tiles above."""
  return -(-rows // 8) * 8 if rows <= BLOCK_H else -(-rows // BLOCK_H) * BLOCK_H


def _out_chunk(head_dim: int, itemsize: int) -> int:
  """Columns per epilogue store: one swizzle width."""
  return swizzle_bytes(head_dim, itemsize) // itemsize


def smem_bytes(*, block_k: int, num_stages: int, head_dim: int, itemsize: int,
               split: bool) -> int:
  """Shared memory of one CTA, as Mosaic counts it (each buffer aligned to
  1 KiB): the K/V ring, the query tile, two epilogue buffers of one swizzle
  width, the log-sum-exp row and the barriers."""
  out_item = 4 if split else itemsize
  kib = lambda n: -(-n // 1024) * 1024  # noqa: E731
  return (2 * kib(num_stages * block_k * head_dim * itemsize)
          + kib(BLOCK_H * head_dim * itemsize)
          + kib(2 * BLOCK_H * _out_chunk(head_dim, out_item) * out_item)
          + kib(BLOCK_H * 4) + _BARRIER_BYTES)


def check_shapes(q_shape, kv_shape, dtype, *, page_size: int | None = None,
                 block_k: int | None = None) -> None:
  """Raises ``ValueError`` unless the kernel runs these shapes (``kv_shape``
  is the cache's, pages included; ``page_size`` None for a contiguous one)."""
  head_dim = q_shape[3]
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f"the Mosaic GPU decode kernel takes bfloat16 or float16; "
                     f"got {jnp.dtype(dtype).name}")
  if head_dim % HEAD_DIM_MULTIPLE or not HEAD_DIM_MIN <= head_dim <= HEAD_DIM_MAX:
    raise ValueError(f"the Mosaic GPU decode kernel needs head_dim a multiple of "
                     f"{HEAD_DIM_MULTIPLE} in [{HEAD_DIM_MIN}, {HEAD_DIM_MAX}]; got {head_dim}")
  seq = kv_shape[1]
  what = "page_size" if page_size is not None else "kv_len"
  if seq % SEQ_MULTIPLE:
    raise ValueError(f"the Mosaic GPU decode kernel needs {what} a multiple of "
                     f"{SEQ_MULTIPLE} (TMA tiles it by 8 rows); got {seq}")
  if page_size is not None and block_k is not None and (
      page_size % block_k and block_k % page_size):
    raise ValueError(f"on a paged cache block_k={block_k} and page_size={page_size} must "
                     f"divide one another")


def check_device() -> None:
  require_compute_capability(COMPUTE_CAPABILITY, "Mosaic GPU decode kernel",
                             "use a Triton or XLA config")


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, config: MosaicDecodeConfig,
                     causal: bool = True, scale: float | None = None, kv_lengths=None,
                     block_tables=None) -> jax.Array:
  """Flash-decoding with the Mosaic GPU kernel (Hopper only).

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``, bfloat16 or float16.
    k, v: the cache, same dtype: ``[batch, kv_len, kv_heads, head_dim]``, or
      pages ``[num_pages, page_size, kv_heads, head_dim]`` with
      ``block_tables``.
    config: launch parameters; used as given.
    causal: query ``t`` sees keys ``j <= t + L - q_len``; False: every
      valid key.
    scale: softmax scale (default ``1 / sqrt(head_dim)``).
    kv_lengths: ``[batch]`` int valid length per sequence (clipped to
      ``[0, kv_len]``), or None (all ``kv_len``).
    block_tables: ``[batch, max_pages]`` int32 page ids (clipped to the
      pool), or None for a contiguous cache.

  Raises:
    ValueError: bad arguments, shapes the kernel does not run
      (:func:`check_shapes`), or no Hopper GPU.
  """
  if not isinstance(config, MosaicDecodeConfig):
    raise ValueError(f"config must be a MosaicDecodeConfig; got {type(config).__name__}")
  paged = block_tables is not None
  if paged:
    scale, kv_len, _, page_size, block_tables = paging.check_paged_call(
        q, k, v, block_tables, kv_lengths, scale)
  else:
    scale, kv_len = check_call(q, k, v, scale), k.shape[1]
  if q.shape[0] == 0 or q.shape[1] == 0 or q.shape[2] == 0:
    return jnp.zeros(q.shape, q.dtype)
  check_shapes(q.shape, k.shape, q.dtype, page_size=page_size if paged else None,
               block_k=config.block_k)
  kv_lengths = check_lengths(kv_lengths, q.shape[0], kv_len)
  if not isinstance(q, jax.core.Tracer):
    # A call on concrete arrays runs now: say so here if no Hopper GPU can
    # (traced calls are checked where they compile; the tests lower them).
    check_device()
  return _decode(q, k, v, kv_lengths, block_tables, config=config, causal=bool(causal),
                 scale=scale)


def group_rows(q: jax.Array, kv_heads: int, rows_p: int) -> jax.Array:
  """``[batch, q_len, q_heads, d]`` -> ``[batch * kv_heads, rows_p, d]``:
  the rows of one KV head together (row ``t * group + g``), zero-padded to
  ``rows_p`` rows and at least one 64-row tile."""
  batch, q_len, q_heads, d = q.shape
  group = q_heads // kv_heads
  q = q.reshape(batch, q_len, kv_heads, group, d).transpose(0, 2, 1, 3, 4)
  q = q.reshape(batch * kv_heads, q_len * group, d)
  pad = max(rows_p, BLOCK_H) - q_len * group
  return jnp.pad(q, ((0, 0), (0, pad), (0, 0))) if pad else q


def ungroup_rows(o: jax.Array, batch: int, q_len: int, q_heads: int) -> jax.Array:
  """``[batch * kv_heads, rows_p, d]`` -> ``[batch, q_len, q_heads, d]``."""
  bh, _, d = o.shape
  kv_heads = bh // batch
  group = q_heads // kv_heads
  o = o[:, :q_len * group].reshape(batch, kv_heads, q_len, group, d)
  return o.transpose(0, 2, 1, 3, 4).reshape(batch, q_len, q_heads, d)


def combine(o: jax.Array, lse: jax.Array, dtype) -> jax.Array:
  """Merges ``num_splits`` normalized partial outputs ``o [S, ..., d]`` by
  their log2-sum-exp ``lse [S, ...]`` (``-inf``: the split saw no key; NaN
  propagates). Rows that saw no key anywhere give 0."""
  mx = jnp.max(lse, axis=0)
  w = jnp.where(lse == -jnp.inf, 0.0, jnp.exp2(lse - jnp.where(mx == -jnp.inf, 0.0, mx)))
  den = jnp.sum(w, axis=0)
  num = jnp.sum(w[..., None] * o, axis=0)
  return (num / jnp.where(den == 0, 1.0, den)[..., None]).astype(dtype)


@functools.partial(jax.jit, static_argnames=("config", "causal", "scale"))
def _decode(q, k, v, kv_lengths, block_tables, *, config: MosaicDecodeConfig, causal: bool,
            scale: float):
  batch, q_len, q_heads, head_dim = q.shape
  kv_heads = k.shape[2]
  paged = block_tables is not None
  page_size = k.shape[1] if paged else 0
  kv_len = block_tables.shape[1] * page_size if paged else k.shape[1]
  group = q_heads // kv_heads
  rows = q_len * group
  rows_p = padded_rows(rows)
  row_blocks = -(-rows // BLOCK_H)
  rows_store = min(rows_p, BLOCK_H)
  bk = config.block_k
  splits = splits_of(kv_len, config.num_splits, bk)
  split = splits > 1
  dtype = q.dtype
  stages = config.num_stages
  has_lengths = kv_lengths is not None
  if paged and page_size < bk:
    copies = bk // page_size
  else:
    copies = 1
  qg = group_rows(q, kv_heads, rows_p)
  c = scale * _LOG2E if scale > 0 else _LOG2E
  pre = None if scale > 0 else scale

  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  iota = functools.partial(plgpu.broadcasted_iota, jnp.int32, layout=plgpu.Layout.WGMMA)
  item = jnp.dtype(dtype).itemsize
  swz = swizzle_bytes(head_dim, item)
  tiled = (plgpu.TilingTransform((8, swz // item)), plgpu.SwizzleTransform(swz))
  out_dtype = jnp.dtype(jnp.float32) if split else jnp.dtype(dtype)
  o_item = out_dtype.itemsize
  o_swz = swizzle_bytes(head_dim, o_item)
  o_cols = o_swz // o_item
  o_tiled = (plgpu.TilingTransform((8, o_cols)), plgpu.SwizzleTransform(o_swz))

  def kernel(*refs):
    q_ref, k_ref, v_ref, *rest = refs
    len_ref = rest.pop(0) if has_lengths else None
    bt_ref = rest.pop(0) if paged else None
    if split:
      o_ref, lse_ref, scoped = rest
    else:
      (o_ref, scoped), lse_ref = rest, None
    (q_smem, k_smem, v_smem, o_smem, lse_smem), (k_bar, v_bar, q_bar), consumed = scoped
    k_done, v_done = consumed
    rb = lax.axis_index("rows")
    s = lax.axis_index("split")
    bh = lax.axis_index("bh")
    b = lax.div(bh, jnp.int32(kv_heads))
    kvh = lax.rem(bh, jnp.int32(kv_heads))
    wg = lax.axis_index("wg")
    if has_lengths:
      valid = jnp.clip(len_ref[b], 0, kv_len)
      per = lax.div(valid + (splits - 1), jnp.int32(splits))
      chunk = lax.div(per + (bk - 1), jnp.int32(bk)) * bk
    else:
      valid = jnp.int32(kv_len)
      chunk = jnp.int32(chunk_len(kv_len, splits, bk))
    lo = s * chunk
    hi = jnp.minimum(lo + chunk, valid)
    n_steps = jnp.maximum(lax.div(hi - lo + (bk - 1), jnp.int32(bk)), 0)
    shift = valid - q_len  # row r (position t = r // group) sees keys <= t + shift
    seen_by_all = jnp.minimum(hi, shift + 1) if causal else hi
    full = jnp.clip(lax.div(jnp.maximum(seen_by_all - lo, 0), jnp.int32(bk)), 0, n_steps)

    @pl.when(wg == 0)
    def _consumer():
      plgpu.set_max_registers(232, action="increase")
      plgpu.copy_gmem_to_smem(q_ref.at[bh, pl.ds(rb * BLOCK_H, BLOCK_H)], q_smem, q_bar)
      plgpu.barrier_wait(q_bar)
      row0 = rb * BLOCK_H

      def step(j, carry, *, edge: bool):
        acc, m_i, l_i = carry
        slot = lax.rem(j, jnp.int32(stages))
        start = lo + j * bk
        plgpu.barrier_wait(k_bar.at[slot])

        def compute_qk(acc_ref):
          plgpu.wgmma(acc_ref, q_smem, k_smem.at[slot].transpose((1, 0)))
          return acc_ref[...]
        qk = pl.run_scoped(compute_qk, plgpu.ACC((BLOCK_H, bk), jnp.float32))
        plgpu.barrier_arrive(k_done.at[slot])
        if pre is not None:
          qk = qk * pre
        if edge:
          col = iota((BLOCK_H, bk), 1) + start
          ok = col < valid
          if causal:
            # r // group >= col - shift  <=>  r >= (col - shift) * group
            ok = ok & (iota((BLOCK_H, bk), 0) + row0 >= (col - shift) * group)
          qk = jnp.where(ok, qk, -jnp.inf)
        m_new = jnp.maximum(m_i, qk.max(axis=1) * c)
        # A row with every score masked so far keeps m = -inf: its p and
        # alpha are taken against 0 (exp2(-inf) = 0), never -inf - -inf.
        m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
        alpha = jnp.exp2(m_i - m_ref)
        p = jnp.exp2(qk * c - lax.broadcast_in_dim(m_ref, qk.shape, [0]))
        l_i = l_i * alpha + p.sum(axis=1)
        acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])
        p16 = p.astype(dtype)
        plgpu.barrier_wait(v_bar.at[slot])
        if edge:
          # Values at or past the length may be NaN or Inf (0 * NaN is NaN
          # in P V): zero those rows of the buffer.
          vb = v_smem.at[slot]
          rows_k = iota((bk, head_dim), 0) + start
          vb[...] = jnp.where(rows_k < valid, vb[...], jnp.zeros((), dtype))
          plgpu.commit_smem()

        def compute_pv(acc_ref):
          plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
        acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
        plgpu.barrier_arrive(v_done.at[slot])
        return acc, m_new, l_i

      acc = plgpu.layout_cast(jnp.full((BLOCK_H, head_dim), 0, jnp.float32),
                              plgpu.Layout.WGMMA)
      m_i = plgpu.layout_cast(jnp.full((BLOCK_H,), -jnp.inf, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
      l_i = plgpu.layout_cast(jnp.full((BLOCK_H,), 0, jnp.float32),
                              plgpu.Layout.WGMMA.reduce(1))
      carry = lax.fori_loop(0, full, functools.partial(step, edge=False), (acc, m_i, l_i))
      acc, m_i, l_i = lax.fori_loop(full, n_steps, functools.partial(step, edge=True), carry)

      # A row that saw no key has l = 0 and acc = 0: it gives 0.
      l_safe = jnp.where(l_i == 0, 1.0, l_i)
      out = acc / lax.broadcast_in_dim(l_safe, acc.shape, [0])
      out = out.astype(out_dtype)
      dst = o_ref.at[s] if split else o_ref
      for j in range(head_dim // o_cols):
        buf = j % 2
        plgpu.wait_smem_to_gmem(1, wait_read_only=True)
        o_smem[buf] = out[:, j * o_cols:(j + 1) * o_cols]
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(
            o_smem.at[buf, pl.ds(0, rows_store)],
            dst.at[bh, pl.ds(row0, rows_store), pl.ds(j * o_cols, o_cols)])
      if split:
        lse_smem[...] = m_i + jnp.log(l_i) * (1 / math.log(2))
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(lse_smem.at[pl.ds(0, rows_store)],
                                lse_ref.at[s, bh, pl.ds(row0, rows_store)])
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")

      def load(step, slot, src_ref, dst, bar):
        start = lo + step * bk
        if not paged:
          plgpu.copy_gmem_to_smem(src_ref.at[b, pl.ds(start, bk), kvh], dst.at[slot],
                                  bar.at[slot])
          return
        if copies == 1:
          page = bt_ref[b, jnp.minimum(lax.div(start, jnp.int32(page_size)),
                                       max_pages - 1)]
          page = jnp.clip(page, 0, num_pages - 1)
          off = lax.rem(start, jnp.int32(page_size))
          plgpu.copy_gmem_to_smem(src_ref.at[page, pl.ds(off, bk), kvh], dst.at[slot],
                                  bar.at[slot])
          return
        first = lax.div(start, jnp.int32(page_size))
        for i in range(copies):
          page = bt_ref[b, jnp.minimum(first + i, max_pages - 1)]
          page = jnp.clip(page, 0, num_pages - 1)
          plgpu.copy_gmem_to_smem(src_ref.at[page, pl.ds(0, page_size), kvh],
                                  dst.at[slot, pl.ds(i * page_size, page_size)],
                                  bar.at[slot])

      @pl.loop(0, jnp.minimum(n_steps, stages))
      def _prologue(i):
        load(i, i, k_ref, k_smem, k_bar)
        load(i, i, v_ref, v_smem, v_bar)

      @pl.loop(0, n_steps - stages)
      def _ring(i):
        step = i + stages
        slot = lax.rem(i, jnp.int32(stages))
        plgpu.barrier_wait(k_done.at[slot])
        load(step, slot, k_ref, k_smem, k_bar)
        plgpu.barrier_wait(v_done.at[slot])
        load(step, slot, v_ref, v_smem, v_bar)

  num_pages = k.shape[0] if paged else 0
  max_pages = block_tables.shape[1] if paged else 0

  def entry(*refs):
    scratch = (
        plgpu.SMEM((BLOCK_H, head_dim), dtype, transforms=tiled),
        plgpu.SMEM((stages, bk, head_dim), dtype, transforms=tiled),
        plgpu.SMEM((stages, bk, head_dim), dtype, transforms=tiled),
        plgpu.SMEM((2, BLOCK_H, o_cols), out_dtype, transforms=o_tiled),
        plgpu.SMEM((BLOCK_H,), jnp.float32),
    )
    pl.run_scoped(
        lambda *args: kernel(*refs, args),
        scratch,
        (plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
         plgpu.Barrier(num_arrivals=copies, num_barriers=stages),
         plgpu.Barrier()),
        (plgpu.Barrier(num_barriers=stages),) * 2,
        collective_axes="wg",
    )

  args = [qg, k, v]
  if has_lengths:
    args.append(kv_lengths.astype(jnp.int32))
  if paged:
    args.append(block_tables.astype(jnp.int32))
  args, axes = match_varying(*args)
  bh_count = batch * kv_heads
  if split:
    out_type = (out_struct((splits, bh_count, rows_p, head_dim), jnp.float32, axes),
                out_struct((splits, bh_count, rows_p), jnp.float32, axes))
  else:
    out_type = out_struct((bh_count, rows_p, head_dim), dtype, axes)
  out = plgpu.kernel(
      entry,
      out_type=out_type,
      grid=(row_blocks, splits, bh_count),
      grid_names=("rows", "split", "bh"),
      num_threads=2,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(*args)
  if split:
    out = combine(out[0], out[1], dtype)
  return ungroup_rows(out, batch, q_len, q_heads)
