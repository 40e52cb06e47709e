# Copyright 2024 The JAX Authors.
# Copyright 2026 The wavetune-jax Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     https://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Pallas Mosaic GPU flash attention, forward (Hopper, warp-specialized).

The forward kernel of JAX's ``jax.experimental.pallas.ops.gpu.attention_mgpu``
(FlashAttention-3 style: TMA loads into a ring of ``num_stages`` shared-memory
K/V buffers, wgmma, one producer warpgroup and two consumer warpgroups of
``block_q / 2`` query rows each), changed here in seven ways:

* the shared-memory buffers take the input dtype (upstream hard-codes
  float16, so bfloat16 inputs fail to compile in JAX 0.11.2);
* the softmax scale is applied in the kernel, folded into the ``log2(e)``
  factor of the exponent (upstream applies none; scaling ``q`` outside adds an
  elementwise pass over ``q``);
* under a causal mask, programs run from the last query block (the most KV
  blocks) to the first, so the longest programs start in the first wave;
* any lengths, not multiples of the blocks: TMA zero-fills the rows of a
  load past the end of an array and drops the rows of a store past it, and the
  last KV block's scores past ``kv_len`` are masked (upstream needs both
  lengths multiples of the blocks). Mosaic's TMA tiles the sequence dimension
  of global memory by 8 rows, so a length that is not a multiple of 8 is
  padded to one on the device first (``jnp.pad``: one copy of that operand;
  the padded keys are masked, the padded query rows dropped);
* any ``head_dim`` from 64 to 256 that is a multiple of 16 (upstream: 64 or
  128): the shared-memory tiles take the widest swizzle that divides a row
  (128 bytes for multiples of 64 in 16-bit types, 64 bytes for multiples of
  32 such as 96, else 32 bytes), so wgmma and TMA run on the rows as they are,
  with no padding of ``head_dim``;
* logit soft-capping (``tanh`` of the fp32 scores), attention sinks (each
  row's running max starts at its head's sink logit and its sum at 1);
* sliding windows (a left side, a right side or both, with or without the
  causal mask), per-sequence KV lengths and the bottom-right causal
  alignment: each consumer warpgroup reads the KV blocks its rows' keys
  span (:func:`kv_block_plan`), and masks only the blocks at the edges of
  that band (the window's sides, the diagonal, a sequence's last key);
  the interior blocks run unmasked;
* the checks raise ``ValueError`` with what to change.

Layout ``[batch, seq, heads, head_dim]``, grouped-query attention read in place,
causal masking aligned top-left as in ``jax.nn.dot_product_attention``, or
bottom-right.

Requirements (checked by :func:`check_shapes`): an NVIDIA GPU of compute
capability 9.0; bfloat16 or float16; ``head_dim`` a multiple of 16 in
[64, 256]; a top-left causal mask only with ``q_len <= kv_len``.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._launch import (SMEM_LIMIT, check_ints, item_grid, local_items,
                                     match_varying, out_struct, persistent_ctas,
                                     require_compute_capability)
from pallas_kernels.attention.common import check_align, check_call, check_lengths

__all__ = ["BLOCK_K", "BLOCK_Q", "COMPUTE_CAPABILITY", "HEAD_DIM_MAX", "HEAD_DIM_MIN",
           "HEAD_DIM_MULTIPLE", "NO_INTERPRET", "NUM_WARPS", "SEQ_MULTIPLE",
           "MosaicAttentionConfig", "attention", "band_mask", "check_device", "check_shapes",
           "key_bounds", "kv_block_plan", "smem_bytes", "swizzle_bytes", "tile_kv_blocks"]

#: The GPUs the kernel runs on (wgmma and TMA: Hopper).
COMPUTE_CAPABILITY = "9.0"
#: Two consumer warpgroups and one producer warpgroup.
NUM_WARPS = 12
#: Query rows per program (two warpgroups of ``block_q / 2`` rows).
BLOCK_Q = (128, 256)
#: KV rows per pipeline step.
BLOCK_K = (64, 128, 256)
#: The TMA copies tile the sequence dimension of global memory by 8 rows (the
#: shared-memory tiling): other lengths are padded to a multiple of this.
SEQ_MULTIPLE = 8
#: head_dim: a multiple of this (the narrowest swizzle, 32 bytes of a 16-bit
#: type), in [HEAD_DIM_MIN, HEAD_DIM_MAX].
HEAD_DIM_MULTIPLE = 16
HEAD_DIM_MIN, HEAD_DIM_MAX = 64, 256
_LOG2E = math.log2(math.e)
_BARRIER_BYTES = 1024  # barriers and alignment slack
# JAX 0.10's Mosaic GPU interpreter has no rules for this kernel's
# run_state accumulator, register layouts or transposed wgmma operands.
NO_INTERPRET = ("the Mosaic GPU attention kernel has no CPU interpret mode; its "
                 "correctness is checked on a Hopper GPU (the sweep and "
                 "benchmarks/attention_mosaic.py compare it with the float32 reference)")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MosaicAttentionConfig:
  """Launch parameters of the Mosaic GPU attention kernel (12 warps: two
  consumer warpgroups and one producer warpgroup).

  Attributes:
    block_q: query rows per program, 128 or 256 (two consumer warpgroups of
      ``block_q / 2`` rows).
    block_k: KV rows per pipeline step: 64, 128 or 256.
    num_stages: K/V buffers in flight (TMA ring), in [2, 8].
  """

  block_q: int = 128
  block_k: int = 128
  num_stages: int = 2

  def __post_init__(self):
    check_ints(self)
    if self.block_q not in BLOCK_Q:
      raise ValueError(f"MosaicAttentionConfig.block_q={self.block_q} must be one of {BLOCK_Q}")
    if self.block_k not in BLOCK_K:
      raise ValueError(f"MosaicAttentionConfig.block_k={self.block_k} must be one of {BLOCK_K}")
    if not 2 <= self.num_stages <= 8:
      raise ValueError(f"MosaicAttentionConfig.num_stages={self.num_stages} must be in [2, 8]")


def smem_bytes(*, block_q: int, block_k: int, num_stages: int, head_dim: int,
               itemsize: int, persistent: bool = False) -> int:
  """Shared memory of one program: the Q/O tile of both consumer warpgroups
  (two with ``persistent``) and ``num_stages`` K and V buffers."""
  q_tiles = 2 if persistent else 1
  return (q_tiles * block_q + 2 * num_stages * block_k) * head_dim * itemsize + _BARRIER_BYTES


def swizzle_bytes(head_dim: int, itemsize: int) -> int:
  """The shared-memory swizzle of the Q/K/V/O tiles: the widest of 128, 64
  and 32 bytes that divides a row of ``head_dim`` elements."""
  row = head_dim * itemsize
  return next(s for s in (128, 64, 32) if row % s == 0)


def check_shapes(q_shape, kv_shape, dtype, *, causal: bool) -> None:
  """Raises ``ValueError`` unless the Mosaic kernel runs a call of these shapes."""
  _, q_len, _, head_dim = q_shape
  kv_len = kv_shape[1]
  if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
    raise ValueError(f"the Mosaic GPU attention kernel takes bfloat16 or float16; "
                     f"got {jnp.dtype(dtype).name}")
  if head_dim % HEAD_DIM_MULTIPLE or not HEAD_DIM_MIN <= head_dim <= HEAD_DIM_MAX:
    raise ValueError(f"the Mosaic GPU attention kernel needs head_dim a multiple of "
                     f"{HEAD_DIM_MULTIPLE} in [{HEAD_DIM_MIN}, {HEAD_DIM_MAX}]; got {head_dim} "
                     f"(use a Triton config)")
  if causal and q_len > kv_len:
    raise ValueError(f"the Mosaic GPU attention kernel needs q_len <= kv_len under a "
                     f"causal mask; got q_len={q_len}, kv_len={kv_len}")


def check_device() -> None:
  """Raises ``ValueError`` unless the default device is a Hopper GPU (the
  kernel uses wgmma and TMA, compute capability 9.0 only)."""
  require_compute_capability(COMPUTE_CAPABILITY, "Mosaic GPU attention kernel",
                             "use a Triton config")


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, config: MosaicAttentionConfig,
              causal: bool = True, scale: float | None = None, soft_cap: float = 0.0,
              window_left: int = -1, window_right: int = -1, sinks: jax.Array | None = None,
              kv_lengths: jax.Array | None = None, causal_align: str = "top_left",
              persistent: bool = False, num_sms: int | None = None) -> jax.Array:
  """Flash attention forward with the Mosaic GPU kernel (Hopper only).

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``, bfloat16 or float16.
    k, v: ``[batch, kv_len, kv_heads, head_dim]``, same dtype; ``kv_heads``
      divides ``q_heads``.
    config: launch parameters; used as given, never changed.
    causal: mask keys after the query (top-left aligned).
    scale: softmax scale (default ``1 / sqrt(head_dim)``).
    soft_cap: above 0, the scaled scores ``s`` become ``cap * tanh(s / cap)``.
    window_left, window_right: query position ``i`` sees keys ``i -
      window_left <= j <= i + window_right`` only (-1: that side unbounded;
      under ``causal`` the right side is the diagonal). A program reads the
      KV blocks of its rows' windows only.
    sinks: ``[q_heads]`` float32 logits added to each softmax's denominator.
    kv_lengths: ``[batch]`` int32, each sequence's valid keys (clipped to
      ``[0, kv_len]``); a program reads no KV block past its sequence's
      length. A query row that sees no key gives zeros.
    causal_align: ``"top_left"`` (query ``i`` at key position ``i``) or
      ``"bottom_right"`` (at ``i + L - q_len``, ``L`` the sequence's valid
      keys: new queries at the end of a cache); it places the causal
      diagonal and the window.
    persistent: at most one CTA per SM, each walking its share of the
      programs (a query head's ``block_q`` rows of one sequence) in launch
      order: the producer streams the next program's K/V blocks into the
      ring while the consumers finish this one, and the next program's
      queries load into a second Q/O tile during this one. A static share,
      so it pays where programs are of equal length (under a window, not
      under a plain causal mask). False: one CTA per program.
    num_sms: the persistent grid's CTAs at most (default: the default
      device's SMs).

  Raises:
    ValueError: invalid arguments (as the Triton kernel), shapes this kernel
      does not run (:func:`check_shapes`), or no Hopper GPU.
  """
  if not isinstance(config, MosaicAttentionConfig):
    raise ValueError(f"config must be a MosaicAttentionConfig; got {type(config).__name__}")
  scale = check_call(q, k, v, scale)
  if q.shape[1] == 0 or q.shape[0] == 0 or q.shape[2] == 0:
    return jnp.zeros(q.shape, q.dtype)
  kv_lengths = check_lengths(kv_lengths, q.shape[0], k.shape[1])
  # The alignment matters only where the queries do not start at key 0.
  bottom_right = (check_align(causal_align) == "bottom_right"
                  and (kv_lengths is not None or q.shape[1] != k.shape[1]))
  check_shapes(q.shape, k.shape, q.dtype, causal=bool(causal) and not bottom_right)
  for name, w in (("window_left", window_left), ("window_right", window_right)):
    if isinstance(w, bool) or not isinstance(w, int) or w < -1:
      raise ValueError(f"{name}={w!r} must be a Python int >= -1 (-1: unbounded)")
  # A side at least as long as every key position reaches is unbounded (and
  # the kernel's int32 positions stay in range).
  reach = q.shape[1] + k.shape[1] + SEQ_MULTIPLE
  window_left, window_right = (-1 if w >= reach else w for w in (window_left, window_right))
  if soft_cap and scale <= 0:
    raise ValueError(f"the Mosaic GPU attention kernel soft-caps only with scale > 0; "
                     f"got scale={scale}")
  ctas = persistent_ctas(persistent, num_sms, COMPUTE_CAPABILITY,
                         "Mosaic GPU attention kernel", "use a Triton config")
  check_device()
  has_sinks = sinks is not None
  sinks = (jnp.zeros((q.shape[2],), jnp.float32) if sinks is None
           else jnp.asarray(sinks, jnp.float32))
  return _attention(q, k, v, sinks, kv_lengths, block_q=config.block_q,
                    block_k=config.block_k, num_stages=config.num_stages, causal=bool(causal),
                    scale=scale, soft_cap=float(soft_cap), window_left=int(window_left),
                    window_right=-1 if causal else int(window_right),
                    bottom_right=bottom_right, has_sinks=has_sinks, ctas=ctas)


def key_bounds(pos, seq_len, *, causal: bool, left: int, right: int):
  """``(lo, hi)``: the keys ``lo <= j <= hi`` query position ``pos`` sees
  (``hi < lo``: none) among a sequence's ``seq_len`` valid keys, under the
  causal mask and a ``(left, right)`` window (-1: a side unbounded). Traced
  or Python integers."""
  lo = jnp.maximum(pos - left, 0) if left >= 0 else jnp.int32(0)
  hi = jnp.asarray(seq_len, jnp.int32) - 1
  if causal:
    hi = jnp.minimum(hi, pos)
  if right >= 0:
    hi = jnp.minimum(hi, pos + right)
  return lo, hi


def band_mask(pos, j, seq_len, *, causal: bool, left: int, right: int):
  """Whether key ``j`` is seen at query position ``pos`` (arrays of one
  shape): ``j < seq_len`` and, as they apply, ``j <= pos``, ``pos - left <=
  j``, ``j <= pos + right`` (the mask of
  :func:`pallas_kernels.attention.common.valid_keys`). ``seq_len`` None:
  the caller knows ``j < seq_len`` holds wherever the rest does."""
  mask = None if seq_len is None else j < seq_len
  if causal:
    mask = j <= pos if mask is None else mask & (j <= pos)
  if left >= 0:
    mask = mask & (j >= pos - left)
  if right >= 0:
    mask = mask & (j <= pos + right)
  return mask


def _cdiv_nonneg(x, d: int):
  """``ceil(max(x, 0) / d)`` of an int32."""
  return lax.div(jnp.maximum(x, 0) + (d - 1), jnp.int32(d))


def tile_kv_blocks(q0, q1, seq_len, *, block_kv: int, causal: bool, left: int, right: int):
  """``(start, end)``: the KV blocks a program of query positions ``q0..q1``
  reads (every key of any of its rows lies in them; ``end == start``: none).
  Key bounds grow with the position, so the first row bounds the start and
  the last row the end."""
  lo, _ = key_bounds(q0, seq_len, causal=causal, left=left, right=right)
  _, hi = key_bounds(q1, seq_len, causal=causal, left=left, right=right)
  start = lax.div(lo, jnp.int32(block_kv))
  return start, jnp.maximum(_cdiv_nonneg(hi + 1, block_kv), start)


def kv_block_plan(r0, r1, start, seq_len, *, block_kv: int, causal: bool, left: int,
                  right: int):
  """``(e1, e2, end)`` for a consumer warpgroup of query positions
  ``r0..r1`` in a program whose KV blocks start at ``start``: blocks
  ``[start, e1)`` are masked (the window's left edge; rows whose keys start
  later see none of them), ``[e1, e2)`` hold keys every row sees (no mask),
  ``[e2, end)`` are masked (the diagonal, the right side, the sequence's
  last key); from ``end`` to the program's end this warpgroup's rows see
  no key."""
  lo_last, _ = key_bounds(r1, seq_len, causal=causal, left=left, right=right)
  _, hi_first = key_bounds(r0, seq_len, causal=causal, left=left, right=right)
  _, hi_last = key_bounds(r1, seq_len, causal=causal, left=left, right=right)
  end = jnp.maximum(_cdiv_nonneg(hi_last + 1, block_kv), start)
  e1 = jnp.clip(_cdiv_nonneg(lo_last, block_kv), start, end)
  e2 = jnp.clip(lax.div(jnp.maximum(hi_first + 1, 0), jnp.int32(block_kv)), e1, end)
  return e1, e2, end


def _pad_seq(x, multiple: int):
  """``x`` with its sequence dimension (1) padded with zeros to ``multiple``."""
  pad = -x.shape[1] % multiple
  return x if not pad else jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))


@functools.partial(jax.jit, static_argnames=("block_q", "block_k", "num_stages", "causal",
                                             "scale", "soft_cap", "window_left", "window_right",
                                             "bottom_right", "has_sinks", "ctas"))
def _attention(q, k, v, sinks=None, kv_lengths=None, *, block_q: int, block_k: int,
               num_stages: int, causal: bool, scale: float, soft_cap: float = 0.0,
               window_left: int = -1, window_right: int = -1, bottom_right: bool = False,
               has_sinks: bool = False, ctas: int = 0):
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  if sinks is None:
    sinks = jnp.zeros((q.shape[2],), jnp.float32)  # read only where has_sinks
  has_lengths = kv_lengths is not None
  if kv_lengths is None:
    kv_lengths = jnp.zeros((q.shape[0],), jnp.int32)  # read only where has_lengths

  check_shapes(q.shape, k.shape, q.dtype, causal=causal and not bottom_right)
  q_len = q.shape[1]
  # Lengths that are not multiples of 8 rows: pad (the keys past kv_seq_len
  # are masked below; the query rows past q_len are sliced off the output).
  kv_seq_len = k.shape[1]
  q, k, v = (_pad_seq(x, SEQ_MULTIPLE) for x in (q, k, v))
  batch_size, q_seq_len, num_q_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  q_heads_per_kv_head = num_q_heads // num_kv_heads
  dtype = q.dtype
  wg_rows = block_q // 2  # rows of one consumer warpgroup
  block_kv = block_k
  # Ragged ends: TMA fills rows past the end of q, k and v with zeros and drops
  # the rows of a store past the end of the output. Scores of keys past kv_len
  # are masked in the last KV step; query rows past q_len are computed on zeros
  # and never stored.
  num_kv_steps = pl.cdiv(kv_seq_len, block_kv)
  kv_ragged = kv_seq_len % block_kv != 0
  max_concurrent_steps = min(num_stages, num_kv_steps)
  num_q_tiles = pl.cdiv(q_seq_len, block_q)
  # exp(s * scale) = exp2(s * c). With c > 0, max(s * c) = max(s) * c, so the
  # scale folds into the FMA of the exponent.
  if soft_cap:  # s = cap * tanh(qk * scale / cap), then exp(s) = exp2(s * log2(e))
    c, pre = _LOG2E, None
  elif scale > 0:
    c, pre = scale * _LOG2E, None
  else:
    c, pre = _LOG2E, scale
  if causal:
    window_right = -1  # the diagonal bounds the right side
  windowed = window_left >= 0 or window_right >= 0
  # The banded kernel: a window, KV lengths or the bottom-right alignment.
  # Each program reads the KV blocks its rows' keys span (tile_kv_blocks)
  # and each warpgroup masks only the edges of its band (kv_block_plan); a
  # row may see no key (its output is then 0). Plain causal and non-causal
  # calls keep the loops below with static bounds.
  banded = windowed or has_lengths or bottom_right
  band = dict(block_kv=block_k, causal=causal, left=window_left, right=window_right)
  causal_mask = causal  # (kv_loop's own `causal` is the plain kernel's diagonal mask)
  # Programs (work items) in launch order: query heads fastest (the heads of
  # a GQA group, which share K/V, run together), then query tiles, then
  # sequences. One CTA per item, or (persistent) at most ``ctas`` CTAs, CTA
  # ``c`` taking items c, c + C, c + 2C, ...
  items = num_q_heads * num_q_tiles * batch_size
  grid_ctas = item_grid(items, ctas)
  persistent = grid_ctas < items
  q_bufs = 2 if persistent else 1
  if persistent:
    need = smem_bytes(block_q=block_q, block_k=block_kv, num_stages=max_concurrent_steps,
                      head_dim=head_dim, itemsize=jnp.dtype(dtype).itemsize, persistent=True)
    if need > SMEM_LIMIT:
      raise ValueError(f"block_q={block_q}, block_k={block_k}, num_stages={num_stages}: the "
                       f"persistent grid's two Q/O tiles need {need} bytes of shared memory, "
                       f"over {SMEM_LIMIT} (use fewer stages or persistent=False)")

  iota = functools.partial(plgpu.broadcasted_iota, jnp.int32, layout=plgpu.Layout.WGMMA)

  def kernel(q_ref, k_ref, v_ref, sinks_ref, lens_ref, out_ref, scoped):
    cta = lax.axis_index("cta")
    smem_buffers, buffer_barriers, consumed_barriers, schedule_barrier = scoped
    wg_idx = lax.axis_index("wg")
    qo_smem2, k_smem, v_smem = smem_buffers
    k_barriers, v_barriers, q_barriers = buffer_barriers
    k_consumed_barriers, v_consumed_barriers = consumed_barriers
    # This CTA's items: cta, cta + grid_ctas, ... below items.
    n_local = local_items(cta, items, grid_ctas)

    def seq_of(batch):
      """A sequence's valid keys and the key position of its query row 0."""
      if has_lengths:
        seq_len = jnp.clip(lens_ref[batch], 0, kv_seq_len)
      else:
        seq_len = jnp.int32(kv_seq_len)
      shift = seq_len - q_len if bottom_right else jnp.int32(0)
      return seq_len, shift

    def plan(n):
      """The ``n``-th item of this CTA: its sequence, query head, query tile,
      first KV step and the step past its last."""
      i = cta + n * grid_ctas
      q_head = lax.rem(i, jnp.int32(num_q_heads))
      rest = lax.div(i, jnp.int32(num_q_heads))
      q_tile = lax.rem(rest, jnp.int32(num_q_tiles))
      batch = lax.div(rest, jnp.int32(num_q_tiles))
      if causal:
        q_tile = num_q_tiles - 1 - q_tile  # the longest programs first
      if banded:
        seq_len, shift = seq_of(batch)
        q0 = q_tile * block_q + shift
        kv_start, block_max_kv_steps = tile_kv_blocks(q0, q0 + block_q - 1, seq_len, **band)
      elif causal:
        kv_start = 0  # (a Python int: the plain kernel's loops are as before)
        block_max_kv_steps = kv_steps_to((q_tile + 1) * block_q)
      else:
        kv_start, block_max_kv_steps = 0, num_kv_steps
      return batch, q_head, q_tile, kv_start, block_max_kv_steps

    def perform_schedule_barrier():
      plgpu.barrier_arrive(schedule_barrier)
      plgpu.barrier_wait(schedule_barrier)

    def kv_steps_to(q_end):
      # KV steps a causal block of queries ending at q_end reads (q_len <= kv_len
      # under a causal mask, so keys past kv_len are only seen by padding rows).
      return jnp.minimum(pl.cdiv(q_end, jnp.array(block_kv, jnp.int32)), num_kv_steps)

    def ring_slot(g, kv_step, kv_start):
      # g: ring steps this CTA took before the item (0 without persistence).
      return lax.rem(g + kv_step - kv_start if (banded or persistent) else kv_step,
                     jnp.array(max_concurrent_steps, jnp.int32))

    @pl.when(wg_idx < 2)
    def _compute_wg():
      plgpu.set_max_registers(232, action="increase")

      def load_q(n):
        batch, q_head, q_tile, _, _ = plan(n)
        buf = lax.rem(n, jnp.int32(q_bufs)) * 2 + wg_idx
        plgpu.copy_gmem_to_smem(
            q_ref.at[batch, pl.ds(q_tile * block_q + wg_idx * wg_rows, wg_rows), q_head],
            qo_smem2.at[buf],
            q_barriers.at[buf],
        )

      load_q(jnp.int32(0))

      def run_item(n, g):
        batch, q_head, q_tile, kv_start, block_max_kv_steps = plan(n)
        slot_of = functools.partial(ring_slot, g, kv_start=kv_start)
        buf = lax.rem(n, jnp.int32(q_bufs)) * 2 + wg_idx
        qo_smem = qo_smem2.at[buf]
        q_seq_base = q_tile * block_q + wg_idx * wg_rows

        if banded:
          seq_len, shift = seq_of(batch)
          row0 = q_seq_base + shift  # this warpgroup's first row's key position
          edge_end, full_kv_steps, kv_steps = kv_block_plan(
              row0, row0 + wg_rows - 1, kv_start, seq_len, **band)
        elif causal:
          kv_steps = kv_steps_to(q_seq_base + wg_rows)
        else:
          kv_steps = block_max_kv_steps

        def load_next_q():
          if persistent:
            # The other tile's last reader was item n - 1's output store,
            # issued a whole item ago.
            @pl.when(n + 1 < n_local)
            def _():
              plgpu.wait_smem_to_gmem(0, wait_read_only=True)
              load_q(n + 1)

        plgpu.barrier_wait(q_barriers.at[buf])

        if has_sinks:
          # The sink's exp(sink - m) starts the denominator (m kept scaled by c;
          # in the banded kernel at least -1e30: a sink of -inf must not give
          # -inf - -inf where a row's first blocks are all masked).
          m0 = sinks_ref[q_head] * _LOG2E
          if banded:
            m0 = jnp.maximum(m0, -1e30)
          m0 = jnp.broadcast_to(m0, (wg_rows,))
          l0 = jnp.full((wg_rows,), 1, dtype=jnp.float32)
        else:
          # Finite in the banded kernel: a row whose first blocks are all out
          # of its band keeps alpha = 1 and p = 0 there (-inf - -inf would be
          # NaN).
          m0 = jnp.full((wg_rows,), -1e30 if banded else -jnp.inf, dtype=jnp.float32)
          l0 = jnp.full((wg_rows,), 0, dtype=jnp.float32)
        m_i = plgpu.layout_cast(m0, plgpu.Layout.WGMMA.reduce(1))
        l_i = plgpu.layout_cast(l0, plgpu.Layout.WGMMA.reduce(1))
        acc = plgpu.layout_cast(jnp.full((wg_rows, head_dim), 0, dtype=jnp.float32),
                                plgpu.Layout.WGMMA)

        @pl.when(kv_steps > kv_start)
        def _():
          plgpu.barrier_wait(k_barriers.at[slot_of(jnp.asarray(kv_start, jnp.int32))])

        pl.when(wg_idx == 1)(perform_schedule_barrier)

        def kv_loop(kv_step, carry, causal: bool = False, kv_tail: bool = False,
                    banded_step: bool = False):
          acc, m_i, l_i = carry
          slot = slot_of(kv_step)

          def compute_qk(acc_ref):
            plgpu.wgmma(acc_ref, qo_smem, k_smem.at[slot].transpose((1, 0)))
            perform_schedule_barrier()
            return acc_ref[...]
          qk = pl.run_scoped(compute_qk, plgpu.ACC((wg_rows, block_kv), jnp.float32))
          plgpu.barrier_arrive(k_consumed_barriers.at[slot])
          if pre is not None:
            qk = qk * pre
          if soft_cap:
            qk = soft_cap * jnp.tanh(qk * (scale / soft_cap))

          if causal:
            q_ids = iota((wg_rows, block_kv), 0)
            kv_ids = iota((wg_rows, block_kv), 1)
            mask = (q_ids + q_seq_base) >= (kv_ids + kv_step * block_kv)
            qk = jnp.where(mask, qk, -jnp.inf)
          if kv_tail:
            kv_ids = iota((wg_rows, block_kv), 1)
            qk = jnp.where(kv_ids + kv_step * block_kv < kv_seq_len, qk, -jnp.inf)
          if banded_step:
            # Key j of row r (key position pos = r + shift) is seen where
            # j < seq_len and, as they apply, j <= pos, pos - left <= j,
            # j <= pos + right.
            pos = iota((wg_rows, block_kv), 0) + row0
            j = iota((wg_rows, block_kv), 1) + kv_step * block_kv
            # (Causal without KV lengths: j <= pos < kv_len for every row of
            # the output, so the length's compare is left out; padded query
            # rows, sliced off, see zero-filled keys.)
            qk = jnp.where(band_mask(pos, j, None if causal_mask and not has_lengths
                                     else seq_len, causal=causal_mask, left=window_left,
                                     right=window_right), qk, -jnp.inf)

          # m is kept scaled by c, so p takes one FMA per score.
          m_ij = jnp.maximum(m_i, qk.max(axis=1) * c)
          alpha = jnp.exp2(m_i - m_ij)
          m_i = m_ij
          p = jnp.exp2(qk * c - lax.broadcast_in_dim(m_ij, qk.shape, [0]))
          acc *= lax.broadcast_in_dim(alpha, acc.shape, [0])
          l_i *= alpha
          p16 = p.astype(dtype)

          def end_softmax_barriers():
            plgpu.barrier_arrive(schedule_barrier)  # done with the softmax
            plgpu.barrier_wait(v_barriers.at[slot])
            plgpu.barrier_wait(schedule_barrier)  # the tensor cores are free
          # Upstream found this order to matter for speed.
          if head_dim <= 128:
            l_i += p.sum(axis=1)
            acc, l_i, m_i, p16 = lax.optimization_barrier((acc, l_i, m_i, p16))
            end_softmax_barriers()
          else:
            end_softmax_barriers()
            l_i += p.sum(axis=1)

          if banded_step and has_lengths:
            # Values at or past the sequence's length may be NaN or Inf (0 *
            # NaN is NaN in P V): zero those rows of the block. Both warpgroups
            # do it before their own P V; they write the same bits (the value
            # read, or zero), so neither undoes the other.
            @pl.when((kv_step + 1) * block_kv > seq_len)
            def _zero_past_length():
              vb = v_smem.at[slot]
              rows_k = iota((block_kv, head_dim), 0) + kv_step * block_kv
              vb[...] = jnp.where(rows_k < seq_len, vb[...], jnp.zeros((), dtype))
              plgpu.commit_smem()

          def compute_pv(acc_ref):
            plgpu.wgmma(acc_ref, p16, v_smem.at[slot])
            wait_step = kv_step + 1
            wait_slot = slot_of(wait_step)

            @pl.when(wait_step < kv_steps)
            def _wait():
              plgpu.barrier_wait(k_barriers.at[wait_slot])
          acc = pl.run_state(compute_pv)(plgpu.ACC.init(acc))
          plgpu.barrier_arrive(v_consumed_barriers.at[slot])
          return acc, m_i, l_i

        def epilogue_kv_loop(kv_step, _):
          # Drains the pipeline when this warpgroup finishes before the other.
          slot = slot_of(kv_step)
          if persistent:
            # Every load's barrier is waited once by each warpgroup, so
            # that their phases stay in step for the next items.
            plgpu.barrier_wait(k_barriers.at[slot])
          plgpu.barrier_arrive(k_consumed_barriers.at[slot])
          if persistent:
            plgpu.barrier_wait(v_barriers.at[slot])
          plgpu.barrier_arrive(v_consumed_barriers.at[slot])
          perform_schedule_barrier()
          perform_schedule_barrier()

        if banded:
          band_loop = functools.partial(kv_loop, banded_step=True)
          acc, m_i, l_i = lax.fori_loop(kv_start, edge_end, band_loop, (acc, m_i, l_i))
          acc, m_i, l_i = lax.fori_loop(edge_end, full_kv_steps, kv_loop, (acc, m_i, l_i))
          load_next_q()
          acc, m_i, l_i = lax.fori_loop(full_kv_steps, kv_steps, band_loop, (acc, m_i, l_i))
          lax.fori_loop(kv_steps, block_max_kv_steps, epilogue_kv_loop, None)
        elif not causal:
          full_steps = num_kv_steps - kv_ragged
          acc, m_i, l_i = lax.fori_loop(0, full_steps, kv_loop, (acc, m_i, l_i))
          load_next_q()
          # The last KV block, masked past kv_len (a loop of one step: its index
          # must be a traced value for the lowering).
          acc, m_i, l_i = lax.fori_loop(full_steps, num_kv_steps,
                                        functools.partial(kv_loop, kv_tail=True),
                                        (acc, m_i, l_i))
        else:
          causal_kv_loop = functools.partial(kv_loop, causal=True)
          full_kv_steps = jnp.minimum(lax.div(q_seq_base, jnp.array(block_kv, jnp.int32)),
                                      kv_steps)
          # Unmasked blocks, then the diagonal blocks.
          acc, m_i, l_i = lax.fori_loop(0, full_kv_steps, kv_loop, (acc, m_i, l_i))
          load_next_q()
          acc, m_i, l_i = lax.fori_loop(full_kv_steps, kv_steps, causal_kv_loop,
                                        (acc, m_i, l_i))
          lax.fori_loop(kv_steps, block_max_kv_steps, epilogue_kv_loop, None)
        pl.when(wg_idx == 0)(perform_schedule_barrier)

        if banded:
          # A row that saw no key has l = 0 (and acc = 0): its output is 0.
          # Any other row's sum is at least 1 (its max's own term).
          l_i = jnp.maximum(l_i, 1.0)
        acc /= lax.broadcast_in_dim(l_i, (wg_rows, head_dim), [0])
        qo_smem[...] = acc.astype(dtype)
        plgpu.commit_smem()
        plgpu.copy_smem_to_gmem(qo_smem,
                                out_ref.at[batch, pl.ds(q_seq_base, wg_rows), q_head])
        return g + block_max_kv_steps - kv_start

      if persistent:
        lax.fori_loop(0, n_local, run_item, jnp.int32(0))
      else:
        run_item(jnp.int32(0), 0)
      plgpu.wait_smem_to_gmem(0)

    @pl.when(wg_idx == 2)
    def _memory_wg():
      plgpu.set_max_registers(40, action="decrease")

      def stream_item(n, g):
        """Streams item ``n``'s K and V blocks into the ring from ring step
        ``g`` on: a slot is refilled once both consumers released it (the
        first ``max_concurrent_steps`` steps of the CTA fill an empty ring)."""
        batch, q_head, _, kv_start, block_max_kv_steps = plan(n)
        kv_head = lax.div(q_head, jnp.array(q_heads_per_kv_head, q_head.dtype))

        # A loop, not a Python for: its starts are traced, so a last block that
        # runs past kv_len is a TMA copy (zero-filled), not a static slice error.
        @pl.loop(kv_start, block_max_kv_steps)
        def _kv_loop(kv_step):
          slot = ring_slot(g, kv_step, kv_start)
          refill = g + kv_step - kv_start >= max_concurrent_steps
          s = (batch, pl.ds(kv_step * block_kv, block_kv), kv_head)

          @pl.when(refill)
          def _():
            plgpu.barrier_wait(k_consumed_barriers.at[slot])
          plgpu.copy_gmem_to_smem(k_ref.at[s], k_smem.at[slot], k_barriers.at[slot])

          @pl.when(refill)
          def _():
            plgpu.barrier_wait(v_consumed_barriers.at[slot])
          plgpu.copy_gmem_to_smem(v_ref.at[s], v_smem.at[slot], v_barriers.at[slot])
        return g + block_max_kv_steps - kv_start

      if persistent:
        lax.fori_loop(0, n_local, stream_item, jnp.int32(0))
      else:
        stream_item(jnp.int32(0), 0)

  def entry(q_ref, k_ref, v_ref, sinks_ref, lens_ref, out_ref):
    compute_wgs = 2
    swizzle_b = swizzle_bytes(head_dim, jnp.dtype(dtype).itemsize)
    tiling = plgpu.TilingTransform((8, swizzle_b // jnp.dtype(dtype).itemsize))
    swizzle = plgpu.SwizzleTransform(swizzle_b)
    qo_scratch = plgpu.SMEM((q_bufs * compute_wgs, wg_rows, head_dim), dtype,
                            transforms=(tiling, swizzle))
    k_scratch = plgpu.SMEM((max_concurrent_steps, block_kv, head_dim), dtype,
                           transforms=(tiling, swizzle))
    v_scratch = plgpu.SMEM((max_concurrent_steps, block_kv, head_dim), dtype,
                           transforms=(tiling, swizzle))
    pl.run_scoped(
        lambda *args: kernel(q_ref, k_ref, v_ref, sinks_ref, lens_ref, out_ref, args),
        (qo_scratch, k_scratch, v_scratch),
        (
            plgpu.Barrier(num_barriers=max_concurrent_steps),
            plgpu.Barrier(num_barriers=max_concurrent_steps),
            plgpu.Barrier(num_barriers=q_bufs * compute_wgs),
        ),
        (plgpu.Barrier(num_arrivals=compute_wgs, num_barriers=max_concurrent_steps),) * 2,
        plgpu.Barrier(num_arrivals=compute_wgs),
        collective_axes="wg",
    )

  (q, k, v, sinks, kv_lengths), axes = match_varying(q, k, v, sinks, kv_lengths)
  out = plgpu.kernel(
      entry,
      out_type=out_struct(q.shape, dtype, axes),
      grid=(grid_ctas,),
      grid_names=("cta",),
      num_threads=3,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(approx_math=True),
  )(q, k, v, sinks, kv_lengths)
  return out if out.shape[1] == q_len else out[:, :q_len]
