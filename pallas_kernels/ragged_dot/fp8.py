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
"""Pallas Mosaic GPU FP8 grouped GEMM for Hopper (W8A8 mixture-of-experts layers).

``y[r] = (x[r] @ w[g].T) * x_scales[r] * w_scales[g]`` for each row ``r`` of
group ``g`` (rows grouped contiguously, ``lax.ragged_dot`` semantics): ``x [M,
K]`` and the expert weights ``w [G, N, K]`` are float8_e4m3fn with K
contiguous (FP8 ``wgmma`` reads 8-bit operands K-major), ``x_scales [M]`` the
per-token scales and ``w_scales [G, N]`` each expert's per-output-channel
scales, float32.

It is the grouped GEMM of :mod:`pallas_kernels.ragged_dot.mosaic` (the
run-time work list of 8-row-aligned row tasks, one persistent CTA per SM, the
row-exact ladder of TMA stores) with the FP8 GEMM's core
(:mod:`pallas_kernels.matmul.fp8`): ``[block_m, 128]`` x ``[block_n, 128]``
K-major blocks, the next wgmma issued before the last is waited for, and the
scales fetched with TMA per work item and applied to the fp32 tile in the
epilogue. With ``split_k > 1`` each split writes its scaled fp32 partial
(the scales are linear in the partial sums) and one XLA reduction sums them.

Where a split has few K steps (at most :data:`RING_MAX_STEPS`), the K
blocks stream through the bf16 kernel's own ring, not Pallas's pipeline:
one TMA ring through all of a CTA's work items, its slots counted across
them, so the producer loads the next item's first K blocks while the
consumers scale and store the last one (Pallas's pipeline drains the ring
between items). ``ring`` chooses either.

Rows past ``sum(group_sizes)`` come out as zeros: their K loads lie past K
(TMA fills zeros) and their row scales are set to 0 before the kernel, so a
NaN there stays out.

Accuracy as the FP8 GEMM's: 2e-2 relative to the output's largest value
against the float32 product of the dequantized operands.

Requirements (:func:`check_shapes`): compute capability 9.0; ``K`` a multiple
of 128 with at least two K steps of 128 per split; ``N`` a multiple of 64;
``num_stages >= 3``. ``M`` above 8 and not a multiple of 8 pads ``x`` and
``x_scales`` with zero rows (the output is stored row by row in place).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._launch import match_varying, out_struct, require_compute_capability
from pallas_kernels.matmul import fp8 as dense
from pallas_kernels.matmul.mosaic import M_MULTIPLE, persistent_kernel, wg_tile, wgmma_wait_delayed
from pallas_kernels.ragged_dot import worklist
from pallas_kernels.ragged_dot.mosaic import (BAND_BYTES, PRODUCER_REGISTERS,
                                              MosaicRaggedDotConfig, consumer_part,
                                              consumer_registers, cta_items, decode_item,
                                              item_windows, ring_produce, store_rows)

__all__ = ["BLOCK_K", "K_MULTIPLE", "RING_MAX_STEPS", "TILES", "check_shapes", "fp8_ragged_dot",
           "smem_bytes"]

BLOCK_K = dense.BLOCK_K
#: K must be a multiple of this (TMA tiles global memory like shared memory).
K_MULTIPLE = BLOCK_K
#: CTA tiles the kernel runs.
TILES = ((64, 128), (64, 256), (128, 128), (128, 256), (256, 128))
_BARRIER_BYTES = 1024
#: ``ring=None`` runs the kernel's own ring where a split has at most this
#: many K steps of 128, else Pallas's pipeline. On an H200
#: (``benchmarks/fp8_ragged_dot.py --ring``): at 6-16 steps and 1,024-4,096
#: tokens the ring ran 1.007-1.191x the pipeline on all 40 config pairs; at
#: 32 and 112 steps (Mixtral-8x7B's experts) at 4,096 tokens down to 0.906x.
RING_MAX_STEPS = 16
NO_INTERPRET = ("the Mosaic GPU FP8 grouped GEMM has no CPU interpret mode; its correctness "
                "is checked on a Hopper GPU (benchmarks/fp8_ragged_dot.py compares every "
                "config with the float32 product of the dequantized operands)")


def smem_bytes(*, block_m: int, block_n: int, num_stages: int, out_itemsize: int) -> int:
  """The operand ring, each consumer's two output slots and its scales."""
  wm, wn = wg_tile(block_m, block_n)
  ring = num_stages * (block_m + block_n) * BLOCK_K
  return ring + 2 * wm * wn * out_itemsize + 2 * (wm + wn) * 4 + _BARRIER_BYTES


def check_shapes(m: int, n: int, k: int, config: MosaicRaggedDotConfig) -> None:
  """Raises ``ValueError`` unless the kernel runs ``[m, k] x [G, n, k]`` with ``config``."""
  if k % K_MULTIPLE or n % dense.N_MULTIPLE:
    raise ValueError(f"the Mosaic GPU FP8 grouped GEMM needs K a multiple of {K_MULTIPLE} and "
                     f"N of {dense.N_MULTIPLE}; got N={n}, K={k} (use the XLA config)")
  if (config.block_m, config.block_n) not in TILES:
    raise ValueError(f"the Mosaic GPU FP8 grouped GEMM runs the tiles {TILES}; got "
                     f"{config.block_m}x{config.block_n}")
  if config.num_stages < 3:
    raise ValueError(f"config {config}: the FP8 grouped GEMM needs num_stages >= 3 (a ring "
                     f"slot is released one step late)")
  if dense.k_steps(k, config.split_k) < 2:
    raise ValueError(f"config {config}: the FP8 grouped GEMM needs at least 2 K steps of "
                     f"{BLOCK_K} per split; K={k} gives {dense.k_steps(k, config.split_k)}")
  del m  # any row count (padded to a multiple of 8 for the loads)


def fp8_ragged_dot(x: jax.Array, w: jax.Array, x_scales: jax.Array, w_scales: jax.Array,
                   group_sizes: jax.Array, *, config: MosaicRaggedDotConfig,
                   out_dtype=jnp.bfloat16, num_sms: int | None = None,
                   ring: bool | None = None) -> jax.Array:
  """The W8A8-FP8 grouped GEMM (Hopper only; module doc).

  Args:
    x: ``[M, K]`` float8_e4m3fn, rows grouped by expert.
    w: ``[G, N, K]`` float8_e4m3fn expert weights (K contiguous).
    x_scales: ``[M]`` float32, one per row.
    w_scales: ``[G, N]`` float32, one per expert and output channel.
    group_sizes: ``[G]`` integers (clipped as
      :func:`~pallas_kernels.ragged_dot.worklist.clip_sizes` clips them).
    config: launch parameters (:class:`MosaicRaggedDotConfig`), used as given.
    out_dtype: bfloat16, float16 or float32.
    num_sms: CTAs of the persistent grid (default: the default device's SMs).
    ring: True runs the kernel's own TMA ring through all of a CTA's work
      items (module doc), False Pallas's pipeline, which drains between
      items; None (default): the ring where a split has at most
      :data:`RING_MAX_STEPS` K steps.

  Raises:
    ValueError: bad shapes or dtypes, shapes the kernel does not run, or no
      Hopper GPU.
  """
  if not isinstance(config, MosaicRaggedDotConfig):
    raise ValueError(f"config must be a MosaicRaggedDotConfig; got {type(config).__name__}")
  if x.ndim != 2 or w.ndim != 3 or x.shape[1] != w.shape[2]:
    raise ValueError(f"need x [M, K] and w [G, N, K]; got {x.shape}, {w.shape}")
  for name, a in (("x", x), ("w", w)):
    if a.dtype != jnp.float8_e4m3fn:
      raise ValueError(f"the Mosaic GPU FP8 grouped GEMM takes float8_e4m3fn operands; got "
                       f"{name} {a.dtype}")
  (m, k), (g, n, _) = x.shape, w.shape
  if x_scales.shape != (m,) or w_scales.shape != (g, n) or group_sizes.shape != (g,):
    raise ValueError(f"need x_scales [M], w_scales [G, N] and group_sizes [G]; got "
                     f"{x_scales.shape}, {w_scales.shape}, {group_sizes.shape}")
  out_dtype = jnp.dtype(out_dtype)
  if out_dtype.name not in ("bfloat16", "float16", "float32"):
    raise ValueError(f"the Mosaic GPU FP8 grouped GEMM writes bfloat16, float16 or float32; "
                     f"got {out_dtype.name}")
  check_shapes(m, n, k, config)
  if ring is None:
    ring = dense.k_steps(k, config.split_k) <= RING_MAX_STEPS
  if num_sms is None:
    num_sms = int(require_compute_capability("9.0", "Mosaic GPU FP8 grouped GEMM",
                                             "use the XLA config").core_count)
  return _ragged_dot(x, w, x_scales.astype(jnp.float32), w_scales.astype(jnp.float32),
                     group_sizes.astype(jnp.int32), config=config, out_dtype=out_dtype,
                     num_sms=int(num_sms), ring=bool(ring))


@functools.partial(jax.jit, static_argnames=("config", "out_dtype", "num_sms", "ring"))
def _ragged_dot(x, w, xs, ws, group_sizes, *, config, out_dtype, num_sms, ring):
  m, k = x.shape
  group_sizes = worklist.clip_sizes(group_sizes, m)
  tasks, count = worklist.row_tasks(
      group_sizes, m, config.block_m,
      band_cap=max(1, BAND_BYTES // (config.block_m * k)) if config.grid_minor == 2 else 0)
  # Rows past the groups: a zero scale (their products are zeros already).
  xs = jnp.where(jnp.arange(m) < jnp.sum(group_sizes), xs, 0.0)
  pad = -m % M_MULTIPLE if m > M_MULTIPLE else 0
  if pad:  # TMA loads rows in tiles of 8; the output keeps its M rows
    x = jnp.pad(x, ((0, pad), (0, 0)))
    xs = jnp.pad(xs, (0, pad))
  if config.split_k == 1:
    return _kernel_call(tasks, count, x, w, xs, ws, m=m, config=config, out_dtype=out_dtype,
                        num_sms=num_sms, ring=ring)
  partials = _kernel_call(tasks, count, x, w, xs, ws, m=m, config=config,
                          out_dtype=jnp.dtype(jnp.float32), num_sms=num_sms, ring=ring)
  return partials.sum(axis=0).astype(out_dtype)


def _kernel_call(tasks, count, x, w, xs, ws, *, m, config, out_dtype, num_sms, ring):
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  k, (groups, n, _) = x.shape[1], w.shape
  sk = config.split_k
  bm, bn = config.block_m, config.block_n
  wm, wn = wg_tile(bm, bn)
  tiles_n = pl.cdiv(n, bn)
  steps = dense.k_steps(k, sk)
  split_len = steps * BLOCK_K
  past_k = sk * split_len  # K offset of the tail tasks: every load is past K
  n_tasks = tasks.shape[1]
  ctas = min(num_sms, n_tasks * tiles_n * sk)

  out_swizzle = 128
  out_elems = out_swizzle // out_dtype.itemsize
  # One row per tile: a store may start at any row of the tile.
  out_transforms = (plgpu.TilingTransform((1, out_elems)), plgpu.SwizzleTransform(out_swizzle))

  def fetch_scales(xs_gmem, ws_gmem, row_smem, col_smem, scale_bars, wg, row, expert, col0):
    """Consumer ``wg``'s row and column scales of a work item, by TMA."""
    plgpu.copy_gmem_to_smem(xs_gmem.at[pl.ds(row, wm)], row_smem.at[wg], scale_bars.at[2 * wg])
    plgpu.copy_gmem_to_smem(ws_gmem.at[expert, pl.ds(col0, wn)], col_smem.at[wg],
                            scale_bars.at[2 * wg + 1])

  def epilogue(acc_ref, wg, out_smem, row_smem, col_smem, scale_bars, out_ref, row0, base, lo,
               rows, col0):
    """Consumer ``wg``'s finished fp32 tile, scaled by its row and column
    scales (:func:`fetch_scales`), stored to its valid rows."""
    plgpu.barrier_wait(scale_bars.at[2 * wg])
    plgpu.barrier_wait(scale_bars.at[2 * wg + 1])
    row_s = plgpu.load(row_smem.at[wg], (), layout=plgpu.Layout.WGMMA.reduce(1))
    row_s = lax.broadcast_in_dim(row_s, (wm, out_elems), [0])
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)
    # Column slices one swizzle wide (64 bf16, 32 fp32), one row per
    # tile: a store may start at any row.
    for j in range(wn // out_elems):
      cols = pl.ds(j * out_elems, out_elems)
      col_s = plgpu.load(col_smem.at[wg, cols], (), layout=plgpu.Layout.WGMMA.reduce(0))
      acc = acc_ref[:, j * out_elems:(j + 1) * out_elems]
      acc = acc * row_s * lax.broadcast_in_dim(col_s, (wm, out_elems), [1])
      out_smem[wg, j] = acc.astype(out_dtype)
    plgpu.commit_smem()
    store_rows(out_smem, wg, out_ref, row0, base, lo, rows, col0)

  def epilogue_scratch():
    """Shared memory of the epilogue: each consumer's output tile (column
    slices one swizzle wide, one row per swizzle tile), scales and their
    barriers."""
    return dict(out_smem=plgpu.SMEM((2, wn // out_elems, wm, out_elems), out_dtype,
                                    transforms=out_transforms),
                row_smem=plgpu.SMEM((2, wm), jnp.float32),
                col_smem=plgpu.SMEM((2, wn), jnp.float32),
                scale_bars=plgpu.Barrier(num_barriers=4))

  def get_pipeline(body, compute_context):
    return dense.operand_pipeline(body, compute_context, block_m=bm, block_n=bn, steps=steps,
                                  num_stages=config.num_stages)

  def kernel(tasks_gmem, count_gmem, x_gmem, w_gmem, xs_gmem, ws_gmem, out_gmem):
    ignore = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem.at[0]),
        **epilogue_scratch(),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, out_smem, row_smem, col_smem, scale_bars):
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
        wg_m, w_rows, base, lo, rows, col0 = consumer_part(wg, ni, start, size, block_n=bn,
                                                           wg_tile=(wm, wn))

        def compute_context(eval_pipeline):
          # Fetch this consumer's scales while its K loop runs.
          fetch_scales(xs_gmem, ws_gmem, row_smem, col_smem, scale_bars, wg, row0 + base,
                       expert, col0)

          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wm, wn), jnp.float32))
          def _acc_scope(acc_ref):
            eval_pipeline(acc_ref)
            plgpu.wgmma_wait(0)
            epilogue(acc_ref, wg, out_smem, row_smem, col_smem, scale_bars, out_ref, row0,
                     base, lo, rows, col0)

        def mma_body(idx, x_smem, w_smem, acc_ref):
          plgpu.wgmma(acc_ref, x_smem.at[wg_m],
                      plgpu.transpose_ref(w_smem.at[w_rows], (1, 0)))
          wgmma_wait_delayed(idx[0], steps, 1)  # the last step's: its slot is released next
          return acc_ref

        get_pipeline(mma_body, compute_context)(
            x_gmem.at[m_slice, k_slice],
            w_gmem.at[expert, n_slice, k_slice],
            allocations=pipeline_allocs,
        )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  def ring_kernel(tasks_gmem, count_gmem, x_gmem, w_gmem, xs_gmem, ws_gmem, out_gmem):
    """``ring``: one TMA ring through all of this CTA's work items (items
    ``cta``, ``cta + ctas``, ...), its slots counted across them
    (:func:`~pallas_kernels.ragged_dot.mosaic.ring_consume` and
    :func:`~pallas_kernels.ragged_dot.mosaic.ring_produce`): the producer
    loads the next item's first blocks while the consumers scale and store
    the last one."""
    stages = config.num_stages

    @functools.partial(pl.run_scoped, **dense.ring_scratch(stages, bm, bn, x_gmem.dtype),
                       **epilogue_scratch(), collective_axes="wg")
    def _scope(x_smem, w_smem, x_ready, w_ready, consumed, out_smem, row_smem, col_smem,
               scale_bars):
      wg = lax.axis_index("wg")
      cta = lax.axis_index("sm")
      bars = dict(x_ready=x_ready, w_ready=w_ready)
      n_local, item = cta_items(cta, ctas, count_gmem[0], tasks_gmem, out_gmem,
                                tiles_n=tiles_n, split_k=sk, grid_minor=config.grid_minor,
                                groups=groups, past_k=past_k, split_len=split_len,
                                block_m=bm, block_n=bn)

      @pl.when(wg < 2)
      def _consumers():
        plgpu.set_max_registers(consumer_registers(2), action="increase")

        def run_item(i, g):
          it, (_, _, _, out_ref) = item(i)
          wg_m, w_rows, base, lo, rows, col0 = consumer_part(wg, it.ni, it.start, it.size,
                                                             block_n=bn, wg_tile=(wm, wn))
          # This consumer's scales arrive while its K loop runs.
          fetch_scales(xs_gmem, ws_gmem, row_smem, col_smem, scale_bars, wg, it.row0 + base,
                       it.expert, col0)

          def tile(acc_ref):
            dense.ring_tile(acc_ref, g, x_smem.at[:, wg_m], w_smem.at[:, w_rows], steps=steps,
                            stages=stages, consumed=consumed, **bars)
            epilogue(acc_ref, wg, out_smem, row_smem, col_smem, scale_bars, out_ref, it.row0,
                     base, lo, rows, col0)

          pl.run_scoped(tile, plgpu.ACC((wm, wn), jnp.float32))
          return g + steps

        lax.fori_loop(0, n_local, run_item, jnp.int32(0))

      @pl.when(wg == 2)
      def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        def item_loads(i):
          it, (m_slice, n_slice, _, _) = item(i)

          def load(kk, slot):
            k_slice = pl.ds(it.k0 + kk * BLOCK_K, BLOCK_K)
            dense.ring_load(x_gmem.at[m_slice, k_slice], w_gmem.at[it.expert, n_slice, k_slice],
                            slot, x_smem=x_smem, w_smem=w_smem, **bars)
          return load

        ring_produce(n_local, steps=steps, stages=stages, consumed=consumed,
                     item_loads=item_loads)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  out_shape = (sk, m, n) if sk > 1 else (m, n)
  arrays, axes = match_varying(tasks, count, x, w, xs, ws)
  return persistent_kernel(ring_kernel if ring else kernel,
                           out_struct(out_shape, out_dtype, axes), ctas)(*arrays)
