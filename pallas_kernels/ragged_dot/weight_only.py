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
"""Pallas Mosaic GPU weight-only grouped GEMM for Hopper (W8A16 mixture-of-experts layers).

``y[r] = (x[r] @ w[g]) * scales[g]`` for each row ``r`` of group ``g`` (rows
grouped contiguously, ``lax.ragged_dot`` semantics): ``x [M, K]`` bfloat16 or
float16, the expert weights ``w [G, K, N]`` int8 or float8_e4m3fn (the layout
of ``lax.ragged_dot``'s right operand), ``scales [G, N]`` float32, one per
expert and output channel. A channel's scale is common to its whole column,
so it leaves the dot product: the kernel multiplies the 8-bit values (exact in
bfloat16 and float16) and scales the fp32 tile in the epilogue. A decode step
reads every expert's weight for a few rows each: half the bytes of bfloat16
weights is what it saves.

It is the grouped GEMM of :mod:`pallas_kernels.ragged_dot.mosaic` (the
run-time work list of 8-row-aligned row tasks, one persistent CTA per SM, the
row-exact ladder of TMA stores) with the weight-only GEMM's core
(:mod:`pallas_kernels.matmul.weight_only`): each consumer warpgroup converts
its columns of the 8-bit block in registers into a 16-bit buffer of its own,
which wgmma reads. The scales of a work item's expert and columns come with
TMA while its K loop runs. With ``split_k > 1`` each split writes its scaled
fp32 partial (the scales are linear in the partial sums) and one XLA
reduction sums them.

Rows past ``sum(group_sizes)`` come out as zeros: their tasks' K loads lie
past K (TMA fills zeros), even where ``x`` holds NaN there.

Requirements (:func:`check_shapes`): compute capability 9.0; the tiles
:data:`TILES`; ``N`` a multiple of 128, ``K`` of 64 with at least two K steps
of 64 per split; ``num_stages >= 3``. ``M`` above 8 and not a multiple of 8
pads ``x`` with zero rows (the output is stored row by row in place).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._launch import match_varying, out_struct, require_compute_capability
from pallas_kernels.matmul import weight_only as dense
from pallas_kernels.matmul.mosaic import (BLOCK_K, M_MULTIPLE, empty_split, k_steps,
                                          persistent_kernel, wg_tile)
from pallas_kernels.ragged_dot import worklist
from pallas_kernels.ragged_dot.mosaic import (BAND_BYTES, MosaicRaggedDotConfig, consumer_part,
                                              decode_item, item_windows, store_rows)

__all__ = ["ITEM_STEPS", "SPLIT_GAIN", "SPLIT_MIN_WAVES", "SPLIT_PAST_WAVE_GPUS", "TILES",
           "WEIGHT_DTYPES", "busy_share", "check_shapes", "decode_config", "prefill_config",
           "smem_bytes", "weight_only_ragged_dot"]

WEIGHT_DTYPES = dense.WEIGHT_DTYPES
#: CTA tiles the kernel runs: 64 x 256 (the consumers split the columns, each
#: a 128-byte row of the 8-bit block) and 128 x 128 (they split the rows and
#: each converts the whole block); 128 x 256 leaves no room for a ring.
TILES = ((64, 256), (128, 128))
_BARRIER_BYTES = 1024
NO_INTERPRET = ("the Mosaic GPU weight-only grouped GEMM has no CPU interpret mode; its "
                "correctness is checked on a Hopper GPU (benchmarks/weight_only.py "
                "--grouped compares every config with the float32 product of the "
                "dequantized weights)")


def smem_bytes(*, block_m: int, block_n: int, num_stages: int, itemsize: int,
               out_itemsize: int) -> int:
  """The operand ring (16-bit x blocks, 8-bit w blocks), two dequantized
  blocks per consumer, each consumer's staged output tile and its scales."""
  wm, wn = wg_tile(block_m, block_n)
  ring = num_stages * (block_m * BLOCK_K * itemsize + BLOCK_K * block_n)
  deq = 2 * 2 * BLOCK_K * (block_n if block_m >= 128 else wn) * itemsize
  return ring + deq + 2 * wm * wn * out_itemsize + 2 * wn * 4 + _BARRIER_BYTES


def check_shapes(m: int, n: int, k: int, dtype, w_dtype, config: MosaicRaggedDotConfig) -> None:
  """Raises ``ValueError`` unless the kernel runs ``[m, k] x [G, k, n]`` with ``config``."""
  dense.check_dtypes(dtype, w_dtype, "weight-only grouped GEMM")
  if (config.block_m, config.block_n) not in TILES:
    raise ValueError(f"the Mosaic GPU weight-only grouped GEMM runs the tiles {TILES}; got "
                     f"{config.block_m}x{config.block_n}")
  if n % dense.N_MULTIPLE or k % BLOCK_K:
    raise ValueError(f"the Mosaic GPU weight-only grouped GEMM needs N a multiple of "
                     f"{dense.N_MULTIPLE} and K of {BLOCK_K}; got N={n}, K={k} (use the XLA "
                     f"config)")
  if config.num_stages < 3:
    raise ValueError(f"config {config}: the weight-only grouped GEMM needs num_stages >= 3 "
                     f"(a ring slot is released one step late)")
  if k_steps(k, config.split_k) < 2:
    raise ValueError(f"config {config}: the weight-only grouped GEMM needs at least 2 K "
                     f"steps of {BLOCK_K} per split; K={k} gives "
                     f"{k_steps(k, config.split_k)}")
  del m  # any row count (padded to a multiple of 8 for the loads)


def _expected_work(m: int, g: int, n: int) -> int:
  """64 x 256 work items of ``m`` rows over ``g`` experts under balanced
  routing (an expert's rows start at a multiple of 8 rows: up to 7 more a
  task)."""
  experts = min(g, m)
  return experts * -(-(-(-m // experts) + worklist.ALIGN - 1) // 64) * -(-n // 256)


#: Past one wave, a K split is taken only where the model below predicts
#: under this share of no split's time ...
SPLIT_GAIN = 0.9
#: ... and where the expected busy items pass the SMs by this much: just past
#: one wave, how many experts a batch routes to decides between one wave and
#: two.
SPLIT_MIN_WAVES = 1.1
#: A work item's fixed cost (its pipeline's fill, its epilogue) in K steps of
#: its loop, fitted on an H200 (docstring of :func:`decode_config`).
ITEM_STEPS = 4
#: GPUs whose rule takes a K split past one wave (measured on an H200 only;
#: the family passes ``past_one_wave`` from this).
SPLIT_PAST_WAVE_GPUS = ("nvidia_h200",)


def busy_share(m: int, g: int) -> float:
  """The expected share of ``g`` experts that get rows when ``m`` rows are
  routed at random: ``1 - (1 - 1/g)^m`` (``g`` times it is at most ``min(g,
  m)``: two rows may pick one expert). A top-k router sends a token's k
  rows to k distinct experts, a few more busy than this counts; the
  benchmarks' router picks each row's expert at random."""
  return 1.0 - (1.0 - 1.0 / g) ** m


def _busy_work(m: int, g: int, n: int) -> float:
  """Expected 64 x 256 work items of ``m`` rows routed at random over ``g``
  experts: the busy experts (:func:`busy_share`), each its rows' tasks."""
  busy = g * busy_share(m, g)
  return busy * math.ceil((m / busy + worklist.ALIGN / 2) / 64) * -(-n // 256)


def decode_config(m: int, g: int, n: int, k: int, num_sms: int,
                  past_one_wave: bool = True) -> MosaicRaggedDotConfig | None:
  """The config for a few rows per expert (at most 64 under balanced
  routing): 64 x 256 tiles, 4 stages, column tiles first; None above 64
  rows per expert (as the dense weight-only GEMM, whose conversion costs
  more than the halved bytes save once the GEMM is compute-bound).

  The K split: where the expected work items (row tasks x column tiles)
  fit one wave, the largest power of two, at most 8, whose CTAs still fit
  it, with at least four K steps a split. Past one wave (``past_one_wave``;
  the rule before took no split there), where the expected busy items
  (:func:`_busy_work`) pass the SMs by :data:`SPLIT_MIN_WAVES`, the split
  of 2, 4 or 8 (none empty, at least four K steps each) with the least
  waves x (:data:`ITEM_STEPS` + its K steps), if under
  :data:`SPLIT_GAIN` of no split's: 192 items on 132 SMs run two waves,
  the second more than half empty, and two splits run 384 half-length
  items in three. On an H200 (``benchmarks/weight_only_ragged_dot.py
  --compare-rules``, int8 (one e4m3), 23 problems of 13 expert weights at
  1-64 tokens; docs/results.md) it splits 14: 1.07-1.30x no split on the 12
  timed at its split; on the other two it takes 2 where 4 were timed
  (1.02-1.05x); it keeps the other 9 whole, where the splits timed ran
  0.83-0.96x. The model was revised once the second half was timed (it had
  counted ``min(g, m)`` busy experts and any split count), so those 23 are
  not held out. Not measured on an H100: the family takes it on the GPUs
  of :data:`SPLIT_PAST_WAVE_GPUS` only.
  """
  if m > 64 * min(g, m):
    return None
  work = _expected_work(m, g, n)
  sk = 1
  if work > num_sms:
    busy = _busy_work(m, g, n)
    if past_one_wave and busy > SPLIT_MIN_WAVES * num_sms:
      steps = k_steps(k, 1)
      cost = lambda s: math.ceil(busy * s / num_sms) * (ITEM_STEPS + k_steps(k, s))  # noqa: E731
      best = SPLIT_GAIN * cost(1)
      for s in (2, 4, 8):
        if k_steps(k, s) >= 4 and not empty_split(steps, s) and cost(s) < best:
          best, sk = cost(s), s
    return MosaicRaggedDotConfig(block_m=64, block_n=256, num_stages=4, split_k=sk)
  while work * sk * 2 <= num_sms and k_steps(k, sk * 2) >= 4 and sk < 8:
    sk *= 2
  return MosaicRaggedDotConfig(block_m=64, block_n=256, num_stages=4, split_k=sk)


def prefill_config(m: int, g: int, n: int, k: int, num_sms: int) -> MosaicRaggedDotConfig:
  """The config above 64 rows per expert: 64 x 256 tiles, 4 stages, walked
  expert by expert (order 2: an expert's tasks read each weight tile
  together) where the expected work passes a wave, column tiles first
  otherwise. On an H100 (Mixtral-8x7B's w13 in int8 at 512 and 2,048
  tokens) it was the fastest of 64 x 256 and 128 x 128 in both orders,
  3.9x XLA's ragged dot on the converted weights, and 0.84x / 0.51x the
  bfloat16 grouped GEMM: once the GEMM is compute-bound the conversion
  costs more than the halved bytes save."""
  work = _expected_work(m, g, n)
  return MosaicRaggedDotConfig(block_m=64, block_n=256, num_stages=4,
                               grid_minor=2 if work > num_sms else 1)


def weight_only_ragged_dot(x: jax.Array, w: jax.Array, scales: jax.Array,
                           group_sizes: jax.Array, *, config: MosaicRaggedDotConfig,
                           out_dtype=None, num_sms: int | None = None) -> jax.Array:
  """The W8A16 grouped GEMM (Hopper only; module doc).

  Args:
    x: ``[M, K]`` bfloat16 or float16, rows grouped by expert.
    w: ``[G, K, N]`` int8 or float8_e4m3fn expert weights.
    scales: ``[G, N]`` float32, one per expert and output channel.
    group_sizes: ``[G]`` integers (clipped as
      :func:`~pallas_kernels.ragged_dot.worklist.clip_sizes` clips them).
    config: launch parameters (:class:`MosaicRaggedDotConfig`), used as given.
    out_dtype: bfloat16, float16 or float32 (default ``x.dtype``).
    num_sms: CTAs of the persistent grid (default: the default device's SMs).

  Raises:
    ValueError: bad shapes or dtypes, shapes the kernel does not run, or no
      Hopper GPU.
  """
  if not isinstance(config, MosaicRaggedDotConfig):
    raise ValueError(f"config must be a MosaicRaggedDotConfig; got {type(config).__name__}")
  if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[1]:
    raise ValueError(f"need x [M, K] and w [G, K, N]; got {x.shape}, {w.shape}")
  (m, k), (g, _, n) = x.shape, w.shape
  if scales.shape != (g, n) or group_sizes.shape != (g,):
    raise ValueError(f"need scales [G, N] and group_sizes [G]; got {scales.shape}, "
                     f"{group_sizes.shape}")
  out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
  if out_dtype.name not in ("bfloat16", "float16", "float32"):
    raise ValueError(f"the Mosaic GPU weight-only grouped GEMM writes bfloat16, float16 or "
                     f"float32; got {out_dtype.name}")
  check_shapes(m, n, k, x.dtype, w.dtype, config)
  if num_sms is None:
    num_sms = int(require_compute_capability("9.0", "Mosaic GPU weight-only grouped GEMM",
                                             "use the XLA config").core_count)
  return _ragged_dot(x, w, scales.astype(jnp.float32), group_sizes.astype(jnp.int32),
                     config=config, out_dtype=out_dtype, num_sms=int(num_sms))


@functools.partial(jax.jit, static_argnames=("config", "out_dtype", "num_sms"))
def _ragged_dot(x, w, ws, group_sizes, *, config, out_dtype, num_sms):
  m, k = x.shape
  group_sizes = worklist.clip_sizes(group_sizes, m)
  tasks, count = worklist.row_tasks(
      group_sizes, m, config.block_m,
      band_cap=max(1, BAND_BYTES // (config.block_m * k * x.dtype.itemsize))
      if config.grid_minor == 2 else 0)
  pad = -m % M_MULTIPLE if m > M_MULTIPLE else 0
  if pad:  # TMA loads rows in tiles of 8; the output keeps its M rows
    x = jnp.pad(x, ((0, pad), (0, 0)))
  if config.split_k == 1:
    return _kernel_call(tasks, count, x, w, ws, m=m, config=config, out_dtype=out_dtype,
                        num_sms=num_sms)
  partials = _kernel_call(tasks, count, x, w, ws, m=m, config=config,
                          out_dtype=jnp.dtype(jnp.float32), num_sms=num_sms)
  return partials.sum(axis=0).astype(out_dtype)


def _kernel_call(tasks, count, x, w, ws, *, m, config, out_dtype, num_sms):
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  k, (groups, _, n) = x.shape[1], w.shape
  dtype = x.dtype
  sk = config.split_k
  bm, bn = config.block_m, config.block_n
  wm, wn = wg_tile(bm, bn)
  deq_n = bn if bm >= 128 else wn  # the w columns one consumer converts
  tiles_n = pl.cdiv(n, bn)
  steps = k_steps(k, sk)
  split_len = steps * BLOCK_K
  past_k = sk * split_len  # K offset of the tail tasks: every load is past K
  n_tasks = tasks.shape[1]

  out_swizzle = 128
  out_elems = out_swizzle // out_dtype.itemsize
  # One row per tile: a store may start at any row of the tile.
  out_transforms = (plgpu.TilingTransform((1, out_elems)), plgpu.SwizzleTransform(out_swizzle))

  def get_pipeline(body, compute_context):
    return dense.operand_pipeline(body, compute_context, block_m=bm, block_n=bn, steps=steps,
                                  num_stages=config.num_stages, dtype=dtype)

  def kernel(tasks_gmem, count_gmem, x_gmem, w_gmem, ws_gmem, out_gmem):
    ignore = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem.at[0]),
        out_smem=plgpu.SMEM((2, wn // out_elems, wm, out_elems), out_dtype,
                            transforms=out_transforms),
        deq_smem=plgpu.SMEM((2, 2, BLOCK_K, deq_n), dtype,
                            transforms=dense.x_block_transforms(dtype)),
        col_smem=plgpu.SMEM((2, wn), jnp.float32),
        scale_bars=plgpu.Barrier(num_barriers=2),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, out_smem, deq_smem, col_smem, scale_bars):
      wg = lax.axis_index("wg")
      count = count_gmem[0]
      per_split = count * tiles_n

      @plgpu.nd_loop((per_split * sk,), collective_axes="sm")
      def _work_loop(info: plgpu.NDLoopInfo):
        (lin,) = info.index
        split, ni, row0, start, size, expert, k0 = decode_item(
            lin, per_split, count, tasks_gmem, tiles_n=tiles_n, grid_minor=config.grid_minor,
            groups=groups, past_k=past_k, split_len=split_len)
        m_slice, n_slice, k_slice, out_ref = item_windows(
            row0, ni, k0, split, out_gmem, block_m=bm, block_n=bn, split_len=split_len,
            split_k=sk)
        wg_m, wg_n, base, lo, rows, col0 = consumer_part(wg, ni, start, size, block_n=bn,
                                                         wg_tile=(wm, wn))

        def compute_context(eval_pipeline):
          # Fetch this consumer's column scales while its K loop runs.
          plgpu.copy_gmem_to_smem(ws_gmem.at[expert, pl.ds(col0, wn)], col_smem.at[wg],
                                  scale_bars.at[wg])

          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wm, wn), jnp.float32))
          def _acc_scope(acc_ref):
            eval_pipeline(acc_ref)
            plgpu.wgmma_wait(0)
            plgpu.barrier_wait(scale_bars.at[wg])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            # Column slices one swizzle wide (64 bf16, 32 fp32), one row per
            # tile: a store may start at any row.
            for j in range(wn // out_elems):
              cols = pl.ds(j * out_elems, out_elems)
              col_s = plgpu.load(col_smem.at[wg, cols], (),
                                 layout=plgpu.Layout.WGMMA.reduce(0))
              acc = acc_ref[:, j * out_elems:(j + 1) * out_elems]
              acc = acc * lax.broadcast_in_dim(col_s, (wm, out_elems), [1])
              out_smem[wg, j] = acc.astype(out_dtype)
            plgpu.commit_smem()
            store_rows(out_smem, wg, out_ref, row0, base, lo, rows, col0)

        def mma_body(idx, x_smem, w_smem, acc_ref):
          dense.dequantized_mma(idx[0], steps, acc_ref, x_smem.at[wg_m], w_smem.at[:, wg_n],
                                deq_smem.at[wg])
          return acc_ref

        get_pipeline(mma_body, compute_context)(
            x_gmem.at[m_slice, k_slice],
            w_gmem.at[expert, k_slice, n_slice],
            allocations=pipeline_allocs,
        )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  out_shape = (sk, m, n) if sk > 1 else (m, n)
  arrays, axes = match_varying(tasks, count, x, w, ws)
  return persistent_kernel(kernel, out_struct(out_shape, out_dtype, axes),
                           min(num_sms, n_tasks * tiles_n * sk))(*arrays)
