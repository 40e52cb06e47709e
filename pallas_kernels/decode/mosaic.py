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

Options (static): a sliding window ``(left, right)`` (query position ``i``
sees keys ``i - left <= j <= i + right``, -1 unbounded): the chunks are cut
from the window's keys, so a CTA loads no block left of its sequence's
window, and only the blocks at the window's edges are masked; soft-capping
(``cap * tanh(s / cap)`` of the fp32 scores); per-head sinks (a logit added
to each softmax's denominator): with one split each row's sink is one
more term of its softmax, added after the keys (its logit loaded while Q is
in flight); with several the combine adds the sink once.

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

from pallas_kernels._launch import SMEM_LIMIT, check_ints, item_grid, local_items, \
    match_varying, out_struct, persistent_ctas, require_compute_capability
from pallas_kernels.attention.common import (check_call, check_lengths, check_sinks,
                                             check_soft_cap, check_window, unbound_far_sides)
from pallas_kernels.attention.mosaic import swizzle_bytes
from pallas_kernels.decode import chunk_len, paging, splits_of

__all__ = ["BLOCK_H", "BLOCK_K", "COMPUTE_CAPABILITY", "MAX_SPLITS", "MosaicDecodeConfig",
           "NO_INTERPRET", "SMEM_LIMIT", "check_shapes", "chunk_plan", "combine",
           "decode_attention", "sink_rows", "smem_bytes"]

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
               split: bool, persistent: bool = False) -> int:
  """Shared memory of one CTA, as Mosaic counts it (each buffer aligned to
  1 KiB): the K/V ring, the query tile (two with ``persistent``: the next
  work item's is loaded while this one runs), two epilogue buffers of one
  swizzle width, the log-sum-exp row and the barriers."""
  out_item = 4 if split else itemsize
  kib = lambda n: -(-n // 1024) * 1024  # noqa: E731
  return (2 * kib(num_stages * block_k * head_dim * itemsize)
          + (2 if persistent else 1) * kib(BLOCK_H * head_dim * itemsize)
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
                     block_tables=None, local_window_size=None, logit_soft_cap=None,
                     sinks=None, persistent: bool = False,
                     num_sms: int | None = None) -> jax.Array:
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
    local_window_size: an int ``w`` (``(w, w)``) or ``(left, right)``:
      query position ``i`` sees keys ``i - left <= j <= i + right`` (-1: a
      side unbounded); None: no window. Keys (and pages) more than one
      block left of a sequence's window are never read; values left of the
      window in the block that is read are zeroed, like those past a length.
    logit_soft_cap: above 0, the scaled scores ``s`` become ``cap * tanh(s
      / cap)``.
    sinks: ``[q_heads]`` float32 logits, each added to its head's softmax
      denominator as ``exp(sink)``.
    persistent: one CTA per SM (at most one per work item), each walking
      its share of the work items (a KV head's 64-row tile of one split)
      in turn: the producer streams the next item's blocks while the
      consumer finishes this one, and the next item's queries load during
      this one (a second query tile in shared memory). One CTA per SM
      loses no occupancy: the warpgroups' registers (232 and 40 a thread,
      34,816 of an SM's 65,536) leave room for one CTA either way. False:
      one CTA per work item.
    num_sms: the persistent grid's CTAs at most (default: the default
      device's SMs).

  Raises:
    ValueError: bad arguments, shapes the kernel does not run
      (:func:`check_shapes`), or no Hopper GPU.
  """
  if not isinstance(config, MosaicDecodeConfig):
    raise ValueError(f"config must be a MosaicDecodeConfig; got {type(config).__name__}")
  window = check_window(local_window_size) or (-1, -1)
  paged = block_tables is not None
  if paged:
    scale, kv_len, _, page_size, block_tables = paging.check_paged_call(
        q, k, v, block_tables, kv_lengths, scale, window_left=window[0])
  else:
    scale, kv_len = check_call(q, k, v, scale), k.shape[1]
  window = unbound_far_sides(window, q.shape[1], kv_len) or (-1, -1)
  if q.shape[0] == 0 or q.shape[1] == 0 or q.shape[2] == 0:
    return jnp.zeros(q.shape, q.dtype)
  check_shapes(q.shape, k.shape, q.dtype, page_size=page_size if paged else None,
               block_k=config.block_k)
  kv_lengths = check_lengths(kv_lengths, q.shape[0], kv_len)
  soft_cap = check_soft_cap(logit_soft_cap)
  sinks = check_sinks(sinks, q.shape[2])
  ctas = persistent_ctas(persistent, num_sms, COMPUTE_CAPABILITY, "Mosaic GPU decode kernel",
                         "use a Triton or XLA config")
  if not isinstance(q, jax.core.Tracer):
    # A call on concrete arrays runs now: say so here if no Hopper GPU can
    # (traced calls are checked where they compile; the tests lower them).
    check_device()
  return _decode(q, k, v, kv_lengths, block_tables, sinks, config=config, causal=bool(causal),
                 scale=scale, window=window, soft_cap=soft_cap, ctas=ctas)


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


def combine(o: jax.Array, lse: jax.Array, dtype, sinks=None) -> jax.Array:
  """Merges ``num_splits`` normalized partial outputs ``o [S, ..., d]`` by
  their log2-sum-exp ``lse [S, ...]`` (``-inf``: the split saw no key; NaN
  propagates). Rows that saw no key anywhere give 0. ``sinks [...]``: a
  log2 logit per row, a split of output 0 (the softmax's sink)."""
  mx = jnp.max(lse, axis=0)
  if sinks is not None:
    mx = jnp.maximum(mx, sinks)
  safe = jnp.where(mx == -jnp.inf, 0.0, mx)
  w = jnp.where(lse == -jnp.inf, 0.0, jnp.exp2(lse - safe))
  den = jnp.sum(w, axis=0)
  if sinks is not None:
    den = den + jnp.exp2(sinks - safe)
  num = jnp.sum(w[..., None] * o, axis=0)
  return (num / jnp.where(den == 0, 1.0, den)[..., None]).astype(dtype)


def chunk_plan(valid, split, *, q_len: int, kv_len: int, splits: int, block_k: int,
               window: tuple[int, int], causal: bool, dynamic: bool):
  """The keys one CTA of a sequence of valid length ``valid`` reads, as
  int32 scalars ``(first, lo, n_steps, lead, full)``: its chunk starts at key
  ``lo`` and takes ``n_steps`` blocks of ``block_k``; steps ``[0, lead)`` are
  masked on the left (keys left of some row's window, ``first`` the first
  key of any row's), ``[lead, full)`` are seen whole by every row, ``[full,
  n_steps)`` masked on the right (the length, the diagonal or the window's
  right side). The window's keys ``[first, valid)`` are cut into ``splits``
  chunks from the block that holds ``first``. ``window``: ``(left, right)``,
  -1 unbounded (``right`` is ignored under ``causal``); ``dynamic``: the
  chunks follow ``valid`` (per-sequence lengths or a window), else they are
  the static ones of the whole cache. Pure jnp arithmetic: the kernel runs
  it on its scalars, the tests on every case."""
  left, right = window
  if causal:
    right = -1
  bk = jnp.int32(block_k)
  valid = jnp.asarray(valid, jnp.int32)
  shift = valid - q_len  # row position t sees keys <= t + shift (causal)
  first = jnp.maximum(shift - left, 0) if left >= 0 else jnp.int32(0)
  base = lax.div(first, bk) * bk
  if dynamic:
    per = lax.div(jnp.maximum(valid - base, 0) + (splits - 1), jnp.int32(splits))
    chunk = lax.div(per + (block_k - 1), bk) * bk
  else:
    chunk = jnp.int32(chunk_len(kv_len, splits, block_k))
  lo = base + split * chunk
  hi = jnp.minimum(lo + chunk, valid)
  n_steps = jnp.maximum(lax.div(hi - lo + (block_k - 1), bk), 0)
  seen_by_all = hi  # right of it some row does not see a key
  if causal:
    seen_by_all = jnp.minimum(hi, shift + 1)
  elif right >= 0:
    seen_by_all = jnp.minimum(hi, shift + right + 1)
  full = jnp.clip(lax.div(jnp.maximum(seen_by_all - lo, 0), bk), 0, n_steps)
  lead = jnp.int32(0)
  if left >= 0:
    inside = shift + q_len - 1 - left  # the last row's first key
    lead = jnp.clip(lax.div(jnp.maximum(inside - lo, 0) + (block_k - 1), bk), 0, n_steps)
    full = jnp.maximum(full, lead)
  return first, lo, n_steps, lead, full


def sink_rows(sinks: jax.Array, batch: int, kv_heads: int, rows_p: int) -> jax.Array:
  """``[q_heads]`` sink logits -> ``[batch * kv_heads, rows_p]`` in log2
  units, row ``t * group + g`` of KV head ``h`` holding head ``h * group + g``'s."""
  group = sinks.shape[0] // kv_heads
  rows = sinks.astype(jnp.float32).reshape(kv_heads, group)[:, jnp.arange(rows_p) % group]
  return jnp.tile(rows * _LOG2E, (batch, 1))


@functools.partial(jax.jit, static_argnames=("config", "causal", "scale", "window",
                                             "soft_cap", "ctas"))
def _decode(q, k, v, kv_lengths, block_tables, sinks=None, *, config: MosaicDecodeConfig,
            causal: bool, scale: float, window: tuple[int, int] = (-1, -1),
            soft_cap: float = 0.0, ctas: int = 0):
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
  has_sinks = sinks is not None
  split = splits > 1
  # One split: each row's sink joins its softmax after the last key block.
  # Several: the combine adds the sink once.
  kernel_sinks = has_sinks and not split
  left, right = window
  if causal:
    right = -1  # the diagonal bounds the right side more tightly
  windowed = left >= 0 or right >= 0
  dtype = q.dtype
  stages = config.num_stages
  has_lengths = kv_lengths is not None
  if paged and page_size < bk:
    copies = bk // page_size
  else:
    copies = 1
  qg = group_rows(q, kv_heads, rows_p)
  if soft_cap:  # s = cap * tanh(qk * scale / cap); exp(s) = exp2(s * log2(e))
    c, pre = _LOG2E, None
  else:
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

  bh_count = batch * kv_heads
  items = row_blocks * splits * bh_count
  # One CTA per work item, or (persistent) at most ``ctas``, each taking the
  # items c, c + C, c + 2C, ... in the order the one-per-item grid launches
  # them (rows fastest, then splits, then KV heads).
  grid_ctas = item_grid(items, ctas)
  persistent = grid_ctas < items
  q_bufs = 2 if persistent else 1
  if persistent:
    need = smem_bytes(block_k=bk, num_stages=stages, head_dim=head_dim,
                      itemsize=jnp.dtype(q.dtype).itemsize, split=split, persistent=True)
    if need > SMEM_LIMIT:
      raise ValueError(f"config {config}: the persistent grid's two query tiles need "
                       f"{need} bytes of shared memory, over {SMEM_LIMIT} (use fewer "
                       f"stages or persistent=False)")

  def item_coords(i):
    rb = lax.rem(i, jnp.int32(row_blocks))
    rest = lax.div(i, jnp.int32(row_blocks))
    return rb, lax.rem(rest, jnp.int32(splits)), lax.div(rest, jnp.int32(splits))

  def kernel(*refs):
    q_ref, k_ref, v_ref, *rest = refs
    len_ref = rest.pop(0) if has_lengths else None
    bt_ref = rest.pop(0) if paged else None
    sink_ref = rest.pop(0) if kernel_sinks else None
    if split:
      o_ref, lse_ref, scoped = rest
    else:
      (o_ref, scoped), lse_ref = rest, None
    (q_smem, k_smem, v_smem, o_smem, lse_smem), (k_bar, v_bar, q_bar), consumed = scoped
    k_done, v_done = consumed
    cta = lax.axis_index("cta")
    wg = lax.axis_index("wg")
    # This CTA's items: cta, cta + grid_ctas, ... below items.
    n_local = local_items(cta, items, grid_ctas)

    def plan(n):
      """The ``n``-th item of this CTA: its coordinates and chunk plan."""
      rb, s, bh = item_coords(cta + n * grid_ctas)
      b = lax.div(bh, jnp.int32(kv_heads))
      kvh = lax.rem(bh, jnp.int32(kv_heads))
      valid = jnp.clip(len_ref[b], 0, kv_len) if has_lengths else jnp.int32(kv_len)
      first, lo, n_steps, lead, full = chunk_plan(
          valid, s, q_len=q_len, kv_len=kv_len, splits=splits, block_k=bk,
          window=(left, right), causal=causal, dynamic=has_lengths or windowed)
      return dict(rb=rb, s=s, bh=bh, b=b, kvh=kvh, valid=valid, first=first, lo=lo,
                  n_steps=n_steps, lead=lead, full=full)

    def load_q(n):
      it = plan(n)
      buf = lax.rem(n, jnp.int32(q_bufs))
      plgpu.copy_gmem_to_smem(q_ref.at[it["bh"], pl.ds(it["rb"] * BLOCK_H, BLOCK_H)],
                              q_smem.at[buf], q_bar.at[buf])

    @pl.when(wg == 0)
    def _consumer():
      plgpu.set_max_registers(232, action="increase")
      load_q(jnp.int32(0))

      def run_item(n, g):
        """Item ``n`` of this CTA; ``g``: ring steps taken before it."""
        it = plan(n)
        s, bh, valid, first, lo = it["s"], it["bh"], it["valid"], it["first"], it["lo"]
        row0 = it["rb"] * BLOCK_H
        shift = valid - q_len  # row r (position t = r // group) sees keys <= t + shift
        if kernel_sinks:
          # The group's sink logits, loaded while Q is in flight and used
          # after the keys (their latency hides behind the loop).
          sink_vals = [sink_ref[it["kvh"] * group + g_] for g_ in range(group)]
        qb = lax.rem(n, jnp.int32(q_bufs))
        plgpu.barrier_wait(q_bar.at[qb])
        q_tile = q_smem.at[qb]
        if persistent:
          # The next item's queries load while this one runs (the other
          # buffer's last reader, item n - 1's wgmmas, has completed).
          @pl.when(n + 1 < n_local)
          def _():
            load_q(n + 1)

        def step(j, carry, *, edge: bool, left_edge: bool = False):
          acc, m_i, l_i = carry
          slot = lax.rem(g + j, jnp.int32(stages))
          start = lo + j * bk
          plgpu.barrier_wait(k_bar.at[slot])

          def compute_qk(acc_ref):
            plgpu.wgmma(acc_ref, q_tile, k_smem.at[slot].transpose((1, 0)))
            return acc_ref[...]
          qk = pl.run_scoped(compute_qk, plgpu.ACC((BLOCK_H, bk), jnp.float32))
          plgpu.barrier_arrive(k_done.at[slot])
          if pre is not None:
            qk = qk * pre
          if soft_cap:
            qk = soft_cap * jnp.tanh(qk * (scale / soft_cap))
          if edge:
            col = iota((BLOCK_H, bk), 1) + start
            r = iota((BLOCK_H, bk), 0) + row0
            ok = col < valid
            if causal:
              # r // group >= col - shift  <=>  r >= (col - shift) * group
              ok = ok & (r >= (col - shift) * group)
            elif right >= 0:
              ok = ok & (r >= (col - shift - right) * group)
            if left_edge:
              # r // group <= col - shift + left  <=>  r < (col - shift + left + 1) * group
              ok = ok & (r < (col - shift + left + 1) * group)
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
            keep = rows_k < valid
            if left_edge:  # and left of the window (pages there may be anyone's)
              keep = keep & (rows_k >= first)
            vb[...] = jnp.where(keep, vb[...], jnp.zeros((), dtype))
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
        carry = (acc, m_i, l_i)
        start_full = 0
        if left >= 0:
          carry = lax.fori_loop(0, it["lead"],
                                functools.partial(step, edge=True, left_edge=True), carry)
          start_full = it["lead"]
        carry = lax.fori_loop(start_full, it["full"], functools.partial(step, edge=False),
                              carry)
        acc, m_i, l_i = lax.fori_loop(it["full"], it["n_steps"],
                                      functools.partial(step, edge=True), carry)
        if kernel_sinks:
          # Row r holds head kvh * group + r % group: its sink, as a row
          # maximum of a tile (the layout of m), scaled like m, is one more
          # term of the softmax's sum with no value.
          head = lax.rem(iota((BLOCK_H, bk), 0) + row0, jnp.int32(group))
          sk = jnp.full((BLOCK_H, bk), -jnp.inf, jnp.float32)
          for g_ in range(group):
            sk = jnp.where(head == g_, sink_vals[g_], sk)
          sink_m = sk.max(axis=1) * _LOG2E
          m_new = jnp.maximum(m_i, sink_m)
          m_ref = jnp.where(m_new == -jnp.inf, 0.0, m_new)
          alpha = jnp.exp2(m_i - m_ref)
          l_i = l_i * alpha + jnp.exp2(sink_m - m_ref)
          acc = acc * lax.broadcast_in_dim(alpha, acc.shape, [0])

        # A row that saw no key has acc = 0 (and l = 0, or 1 with a sink): it
        # gives 0.
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
        if persistent:
          # The next item writes these buffers again: their stores must have
          # read them (the stores themselves complete in the background).
          plgpu.wait_smem_to_gmem(0, wait_read_only=True)
        return g + it["n_steps"]

      if persistent:
        lax.fori_loop(0, n_local, run_item, jnp.int32(0))
      else:
        run_item(jnp.int32(0), jnp.int32(0))
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg == 1)
    def _producer():
      plgpu.set_max_registers(40, action="decrease")

      def load(it, step, slot, src_ref, dst, bar):
        b, kvh = it["b"], it["kvh"]
        start = it["lo"] + step * bk
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

      def stream_item(n, g):
        """Streams item ``n``'s K and V blocks into the ring from step ``g``
        on: a slot is refilled once the consumer released it (the first
        ``stages`` steps of the CTA fill an empty ring)."""
        it = plan(n)

        @pl.loop(0, it["n_steps"])
        def _step(i):
          slot = lax.rem(g + i, jnp.int32(stages))
          refill = g + i >= stages

          @pl.when(refill)
          def _():
            plgpu.barrier_wait(k_done.at[slot])
          load(it, i, slot, k_ref, k_smem, k_bar)

          @pl.when(refill)
          def _():
            plgpu.barrier_wait(v_done.at[slot])
          load(it, i, slot, v_ref, v_smem, v_bar)
        return g + it["n_steps"]

      if persistent:
        lax.fori_loop(0, n_local, stream_item, jnp.int32(0))
      else:
        stream_item(jnp.int32(0), jnp.int32(0))

  num_pages = k.shape[0] if paged else 0
  max_pages = block_tables.shape[1] if paged else 0

  def entry(*refs):
    scratch = (
        plgpu.SMEM((q_bufs, BLOCK_H, head_dim), dtype, transforms=tiled),
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
         plgpu.Barrier(num_barriers=q_bufs)),
        (plgpu.Barrier(num_barriers=stages),) * 2,
        collective_axes="wg",
    )

  args = [qg, k, v]
  if has_lengths:
    args.append(kv_lengths.astype(jnp.int32))
  if paged:
    args.append(block_tables.astype(jnp.int32))
  if kernel_sinks:
    args.append(sinks.astype(jnp.float32))
  args, axes = match_varying(*args)
  if split:
    out_type = (out_struct((splits, bh_count, rows_p, head_dim), jnp.float32, axes),
                out_struct((splits, bh_count, rows_p), jnp.float32, axes))
  else:
    out_type = out_struct((bh_count, rows_p, head_dim), dtype, axes)
  out = plgpu.kernel(
      entry,
      out_type=out_type,
      grid=(grid_ctas,),
      grid_names=("cta",),
      num_threads=2,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(*args)
  if split:
    out = combine(out[0], out[1], dtype,
                  sink_rows(sinks, batch, kv_heads, rows_p) if has_sinks else None)
  return ungroup_rows(out, batch, q_len, q_heads)
