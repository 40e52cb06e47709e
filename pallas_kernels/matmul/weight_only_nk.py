"""Pallas Mosaic GPU weight-only GEMM for a few rows with the weight as
``[N, K]``: ``y = (x @ w.T) * scales``.

``x [M, K]`` bfloat16 or float16 with ``M <= 64`` (a decode step), ``w [N,
K]`` int8 or float8_e4m3fn with K contiguous (what
``quantize_weight(..., layout="nk")`` gives, and the layout of most
checkpoints), ``scales [N]`` float32, one per output channel (it leaves the
dot product: the kernel computes on the 8-bit values, exact in 16 bits, and
the scales multiply the fp32 result once). W4A16: ``w [N, K]`` int4 with
``scales [K // group, N]``, a scale per 64 or 128 values of K of each
channel; each group's block is converted and scaled in registers before its
wgmma (the scales vary along K, so they cannot wait for the result).

The operands are swapped: each consumer warpgroup computes a tile of
``(x @ w.T).T = w @ x.T``, ``[64 or 128 channels, M]``. wgmma's left
operand can live in registers, so a consumer loads its rows of the 8-bit
``w`` block from shared memory into registers, converts them there and hands
them to wgmma directly (int8 under float16 ``x`` two values at a time:
:func:`~pallas_kernels.matmul.weight_only.int8_to_f16`): the dequantized weight never goes back through
shared memory, which is what bounds the ``[K, N]`` kernel
(:mod:`pallas_kernels.matmul.weight_only`: each 8-bit block is written to
shared memory again in 16 bits and read by wgmma). ``x``'s block is wgmma's
right operand, read transposed from shared memory, with the rows (tokens) as
wgmma's N: 8, 16, 32 or 64 of them, the rows past M zeros.

The rest is the project's Mosaic GEMM: a persistent grid, one producer
warpgroup streaming ``[block_n, 128]`` 8-bit blocks of ``w`` and ``[rows,
128]`` blocks of ``x`` (128-byte swizzle) with TMA into a ring (a K step of
128: on an H100 it ran 1.11-1.17x faster than steps of 64 on Llama-3-8B's
weights, the per-step wait for the wgmma coming half as often),
two consumer warpgroups (each half of the block's channels), split-K with
fp32 partials. On an int4 weight a step is :data:`INT4_STEP_K` = 256 (a
128-byte row of 4-bit values), loaded as one ``[block_n, group]`` sub-block
per scale group plus the step's ``[256 // group, block_n]`` scales, and
each sub-block goes to its own wgmma. The kernel writes the fp32 ``[split, N, rows]`` tile of the
transposed product; one XLA fusion sums the splits, transposes, applies the
scales and casts (``M x N`` values, against ``N x K`` weight bytes).

Requirements (:func:`check_shapes`): compute capability 9.0; ``M <= 64``, a
multiple of 8 or below it; ``N`` a multiple of ``block_n`` (128 or 256) and
``K`` of 128 (TMA tiles the 8-bit weight by 128-byte rows; int4: of 256,
groups of 64 or 128), no split of K empty.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.matmul.mosaic import (BLOCK_K, M_MULTIPLE, MosaicMatmulConfig, empty_split,
                                          launch, store_tile)
from pallas_kernels._launch import SMEM_LIMIT, require_compute_capability
from pallas_kernels.matmul import weight_only as _dense
from pallas_kernels.matmul.weight_only import check_dtypes, int8_to_f16

__all__ = ["ANY_SPLIT_GPUS", "MAX_M", "BLOCK_N", "INT4_GROUPS", "WIDE_STEP", "check_shapes", "decode_config", "row_tile",
           "smem_bytes", "step_k", "weight_only_matmul_nk"]

#: Rows (tokens) the kernel runs: wgmma's N, rounded up to a power of two.
MAX_M = 64
#: CTA tiles of channels (rows of ``w``): two consumers of 64 or 128.
BLOCK_N = (128, 256)
_BARRIER_BYTES = 1024
_MEMORY_REGISTERS = 40
#: K of one pipeline step (a 128-byte row of the 8-bit block).
STEP_K = 128
#: The ring's fill at each work item, in pipeline steps (:func:`decode_config`).
ITEM_OVERHEAD_STEPS = 2
#: The cost of one pipeline step of a 256-channel tile, in steps of a
#: 128-channel tile, by device key, for 8-bit weights at up to 16 rows
#: (:func:`decode_config`; GPUs not listed, more rows and int4 weights count
#: 2). A consumer's step is one dependent chain (load the 8-bit block,
#: convert it, the wgmmas, wait), and issuing the conversion is its largest
#: part (on an H200, Llama-3-8B's w1 at 16 rows: LOP3, PRMT and HADD2 are
#: 162 of a step's 272 SASS instructions with 46% of its warp samples,
#: ``benchmarks/kernel_case.py --sass-summary``); a consumer of a
#: 256-channel tile runs two independent 64-channel halves of it, so where
#: the consumers, not HBM, bound the kernel a step of twice the bytes takes
#: less than twice the time. On an H200 (4.8 TB/s) at 1 and 16 rows, 256
#: channels with twice the K split (the same CTAs) ran 1.04-1.15x faster than
#: 128 channels on Llama-3-8B's w1, w2 and wqkv, equal on wo; the pairs the
#: rule chooses between fit 1.62-1.88, and any count up to 1.75 picks the
#: fastest of every tile and split on all 12 problems at 1 and 16 rows
#: (``benchmarks/weight_only.py --layout nk --grid``,
#: ``data/probes/weight_only_nk_grid_h200.json``). At 64 rows (the MMA four
#: times as wide) 256 channels were within 2% or slower. The H100's run
#: timed 256 channels faster at the same CTAs on 14 of 16 pairs at up to 16
#: rows, but not the configs a smaller count would pick there; it keeps 2.
WIDE_STEP = {"nvidia_h200": 1.75}
#: GPUs (device keys) where :func:`decode_config` weighs any K split count,
#: not only powers of two (measured there; with any count the rule also
#: moves between channel tiles, 128 x 2 -> 256 x 5 on Llama-3-8B's wqkv,
#: which the H100 never timed): other GPUs keep powers of two until measured.
ANY_SPLIT_GPUS = ("nvidia_h200",)
#: Group sizes along K of an int4 weight's scales (one scale per ``group``
#: values of a channel).
INT4_GROUPS = (64, 128)
#: K of one pipeline step on an int4 weight: a 128-byte row of 4-bit values,
#: so a step moves as many weight bytes as an 8-bit step of 128.
INT4_STEP_K = 256


def step_k(w_dtype) -> int:
  """K of one pipeline step: :data:`STEP_K`, or :data:`INT4_STEP_K` for int4."""
  return INT4_STEP_K if jnp.dtype(w_dtype) == jnp.int4 else STEP_K


def check_int4(k: int, group: int) -> None:
  """Raises ``ValueError`` unless int4 ``[N, K]`` weights with scales per
  ``group`` values of K run: ``group`` in :data:`INT4_GROUPS`, K a multiple
  of :data:`INT4_STEP_K`."""
  if group not in INT4_GROUPS:
    raise ValueError(f"the Mosaic GPU int4 GEMM takes scales per group of {INT4_GROUPS} "
                     f"values along K; got group={group}")
  if k % INT4_STEP_K:
    raise ValueError(f"the Mosaic GPU int4 GEMM needs K a multiple of {INT4_STEP_K}; got "
                     f"K={k} (use the XLA config)")


def row_tile(m: int) -> int:
  """wgmma's N for ``m`` rows: 8, 16, 32 or 64."""
  for t in (8, 16, 32, 64):
    if m <= t:
      return t
  raise ValueError(f"the swapped weight-only GEMM runs up to {MAX_M} rows; got M={m}")


def k_steps(k: int, split_k: int, step: int = STEP_K) -> int:
  """Pipeline steps of one K split (the last split may run past K: zeros)."""
  return -(-(-(-k // step)) // split_k)


def smem_bytes(*, m: int, block_n: int, num_stages: int, itemsize: int,
               group: int = 0) -> int:
  """The operand ring (8-bit w blocks and x blocks; for int4 (``group`` > 0)
  4-bit w blocks, x blocks and the steps' fp32 scales) and one fp32 output
  slot of 64 channels per consumer."""
  rows = row_tile(m)
  if group:
    stage = block_n * INT4_STEP_K // 2 + rows * INT4_STEP_K * itemsize + (
        INT4_STEP_K // group * block_n * 4)
  else:
    stage = block_n * STEP_K + rows * STEP_K * itemsize
  return num_stages * stage + 2 * 64 * rows * 4 + _BARRIER_BYTES


def check_shapes(m: int, n: int, k: int, dtype, w_dtype, config: MosaicMatmulConfig,
                 group: int = 0) -> None:
  """Raises ``ValueError`` unless the kernel runs these shapes with ``config``
  (``group``: int4 weights' scale group along K; 0 for 8-bit weights)."""
  int4 = jnp.dtype(w_dtype) == jnp.int4
  check_dtypes(dtype, jnp.int8 if int4 else w_dtype)
  if int4:
    check_int4(k, group)
  elif group:
    raise ValueError(f"scales per group of K are for int4 weights; got w_dtype="
                     f"{jnp.dtype(w_dtype).name} with group={group}")
  step = step_k(w_dtype)
  if not 1 <= m <= MAX_M:
    raise ValueError(f"the Mosaic GPU weight-only GEMM on an [N, K] weight runs 1 to "
                     f"{MAX_M} rows; got M={m} (use the XLA config)")
  if m > M_MULTIPLE and m % M_MULTIPLE:
    raise ValueError(f"the Mosaic GPU weight-only GEMM needs M a multiple of {M_MULTIPLE} "
                     f"or below it; got M={m} (use the XLA config)")
  if config.block_n not in BLOCK_N:
    raise ValueError(f"config {config}: the weight-only GEMM on an [N, K] weight needs "
                     f"block_n in {BLOCK_N}")
  if n % config.block_n or k % step:
    raise ValueError(f"the Mosaic GPU weight-only GEMM on an [N, K] weight needs N a "
                     f"multiple of block_n={config.block_n} and K of {step}; got N={n}, "
                     f"K={k} (use the XLA config)")
  if empty_split(k // step, config.split_k):
    raise ValueError(f"config {config}: K={k} gives {k // step} steps of {step}, too "
                     f"few for {config.split_k} splits (the last would be empty; use fewer "
                     f"splits or the XLA config)")
  if not 2 <= config.num_stages <= 8:
    raise ValueError(f"config {config}: num_stages must be in [2, 8]")


def decode_config(m: int, k: int, n: int, num_sms: int, group: int = 0,
                  smem_limit: int = SMEM_LIMIT,
                  wide_step: float | None = None,
                  any_split: bool = False) -> MosaicMatmulConfig | None:
  """The channel tile (:data:`BLOCK_N`) and split of K (a power of two, or
  any count with ``any_split``: :data:`ANY_SPLIT_GPUS`; at least two
  K steps a split, none empty) of least modelled time, counted in
  pipeline steps of a 128-channel tile: the persistent grid's waves times a
  work item's steps (a 256-channel step counts two, or ``wide_step`` for
  8-bit weights at up to 16 rows: :data:`WIDE_STEP` by GPU) plus
  :data:`ITEM_OVERHEAD_STEPS` (the ring's fill), plus the fp32 partials
  written and summed (as steps of the whole grid's weight bytes); 4 stages,
  or the most under 4 that fit ``smem_limit`` bytes. ``group`` > 0: an int4
  weight with scales per ``group`` values of K (steps of
  :data:`INT4_STEP_K`, each moving as many weight bytes as an 8-bit step).
  None above :data:`MAX_M` rows, where N is not a multiple of 128 or K of
  the step, or where nothing fits.

  Any split lets the grid fill the SMs where powers of two leave a wave
  part empty or spill into a second (20 tiles of 256 channels: 6 splits
  give 120 CTAs of 132, where 8 give 160 and 4 give 80). On an H200 every
  split over powers of two only: 0.986-1.110x on the 8 problems the
  grid of splits 1-10 was read from (the model picked the fastest timed on
  7), 0.975-1.453x, geomean 1.145x, on 44 held-out problems of 16 weights
  where the pick changes (``benchmarks/weight_only.py --layout nk
  --compare-splits``, ``data/probes/weight_only_nk_any_split_h200.json``);
  on int4 weights (groups of 128) 1.126-1.464x on all 16 held-out problems
  timed (``--weights int4 --compare-splits``,
  ``data/probes/weight_only_int4_any_split_h200.json``)."""
  step = INT4_STEP_K if group else STEP_K
  if m > MAX_M or n % 128 or k % step:
    return None
  steps, rows = k // step, row_tile(m)
  wide = wide_step if wide_step is not None and rows <= 16 and not group else 2.0
  best = None
  for bn in BLOCK_N:
    stages = [st for st in (4, 3, 2) if smem_bytes(m=m, block_n=bn, num_stages=st, itemsize=2,
                                                   group=group) <= smem_limit]
    if n % bn or not stages:
      continue
    sk = 1
    while sk == 1 or steps // sk >= 2:
      if empty_split(steps, sk):
        sk = sk + 1 if any_split else sk * 2
        continue
      waves = -(-(n // bn) * sk // num_sms)
      cost = waves * (-(-steps // sk) * (1.0 if bn == 128 else wide) + ITEM_OVERHEAD_STEPS)
      if sk > 1:
        cost += 2 * sk * n * rows * 4 / (num_sms * 128 * 128)
      if best is None or cost < best[0]:
        best = (cost, bn, sk, stages[0])
      sk = sk + 1 if any_split else sk * 2
  if best is None:
    return None
  return MosaicMatmulConfig(block_m=64, block_n=best[1], num_stages=best[3], split_k=best[2])


def weight_only_matmul_nk(x: jax.Array, w: jax.Array, scales: jax.Array, *,
                          config: MosaicMatmulConfig, out_dtype=None,
                          num_sms: int | None = None) -> jax.Array:
  """``(x @ w.T) * scales`` with 8-bit ``w [N, K]``, or the int4 weight's
  group-wise dequantized product (Hopper only).

  Args:
    x: ``[M, K]`` bfloat16 or float16, ``M <= 64``.
    w: ``[N, K]`` int8, float8_e4m3fn or int4.
    scales: for 8-bit ``w``, ``[N]`` float32, the dequantization scale of
      each output channel. For int4 ``w``, ``[K // group, N]`` float32: the
      scale of each ``group`` (64 or 128) consecutive values of a channel,
      ``w[n, k]`` standing for ``w[n, k] * scales[k // group, n]``.
    config: launch parameters (:class:`MosaicMatmulConfig`; ``block_n``,
      ``num_stages`` and ``split_k`` are used), used as given.
    out_dtype: bfloat16, float16 or float32 (default ``x.dtype``).
    num_sms: CTAs of the persistent grid (default: the default device's SMs).

  The result matches the float32 product of ``x`` and the dequantized
  weight to a bfloat16 GEMM's error (relative 1e-2): the 8-bit values are
  exact in 16 bits and products accumulate in fp32. For int4 the group's
  scale is rounded to ``x``'s dtype and so is its product with the value
  before the MMA (two roundings of the dequantized weight; XLA's
  dequantize-then-dot scales in float32 and rounds once).

  Raises:
    ValueError: bad shapes or dtypes, shapes the kernel does not run, or no
      Hopper GPU.
  """
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
    raise ValueError(f"need x [M, K] and w [N, K]; got {x.shape} and {w.shape}")
  (m, k), n = x.shape, w.shape[0]
  group = 0
  if w.dtype == jnp.int4:
    if scales.ndim != 2 or scales.shape[1] != n or not scales.shape[0] or k % scales.shape[0]:
      raise ValueError(f"an int4 w [N, K] = {w.shape} takes scales [K // group, N]; got "
                       f"{scales.shape}")
    group = k // scales.shape[0]
  elif scales.shape != (n,):
    raise ValueError(f"an 8-bit w [N, K] = {w.shape} takes scales [N]; got {scales.shape}")
  out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
  check_shapes(m, n, k, x.dtype, w.dtype, config, group)
  need = smem_bytes(m=m, block_n=config.block_n, num_stages=config.num_stages,
                    itemsize=x.dtype.itemsize, group=group)
  if need > SMEM_LIMIT:
    raise ValueError(f"config {config} needs {need} bytes of shared memory at M={m}, over "
                     f"the {SMEM_LIMIT} a CTA has: use fewer stages")
  if num_sms is None:
    num_sms = int(require_compute_capability("9.0", "Mosaic GPU weight-only GEMM",
                                             "use the XLA config").core_count)
  return _matmul(x, w, scales, config=config, out_dtype=out_dtype, num_sms=int(num_sms))


@functools.partial(jax.jit, static_argnames=("config", "out_dtype", "num_sms"))
def _matmul(x, w, scales, *, config: MosaicMatmulConfig, out_dtype, num_sms: int):
  int4 = w.dtype == jnp.int4
  acc = _kernel_call(x, w, scales.astype(jnp.float32) if int4 else None, config=config,
                     num_sms=num_sms)  # [(split,) N, rows]
  if config.split_k > 1:
    acc = acc.sum(axis=0)
  acc = acc[:, :x.shape[0]].T
  if not int4:
    acc = acc * scales.astype(jnp.float32)[None, :]
  return acc.astype(out_dtype)


def _transforms(row_bytes: int, itemsize: int) -> tuple:
  import jax.experimental.pallas.mosaic_gpu as plgpu
  swizzle = min(128, row_bytes)
  return (plgpu.TilingTransform((8, swizzle // itemsize)), plgpu.SwizzleTransform(swizzle))


def _kernel_call(x, w, group_scales, *, config: MosaicMatmulConfig, num_sms: int):
  """The fp32 ``[(split,) N, rows]`` product. ``group_scales [K // group, N]``
  with an int4 ``w``: a step of :data:`INT4_STEP_K` is ``INT4_STEP_K //
  group`` sub-blocks ``[block_n, group]`` of ``w`` (each its own TMA copy
  and ring buffer, so that a consumer loads each whole), each converted,
  scaled by its row of scales and handed to its own wgmma."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  (m, k), n = x.shape, w.shape[0]
  dtype = x.dtype
  int4 = group_scales is not None
  step = step_k(w.dtype)
  group = k // group_scales.shape[0] if int4 else step
  subs = step // group  # sub-blocks of w (and rows of scales) a step
  sk, bn = config.split_k, config.block_n
  wn = bn // 2  # channels of one consumer
  rows = row_tile(m)
  tiles = n // bn
  steps = k_steps(k, sk, step)
  split_len = steps * step
  itemsize = jnp.dtype(dtype).itemsize
  x_transforms = _transforms(min(128, step * itemsize), itemsize)
  w_bits = 4 if int4 else 8
  w_swizzle = min(128, group * w_bits // 8)
  w_transforms = (plgpu.TilingTransform((8, w_swizzle * 8 // w_bits)),
                  plgpu.SwizzleTransform(w_swizzle))
  out_transforms = _transforms(rows * 4, 4)
  convert_f16 = w.dtype == jnp.float8_e4m3fn and dtype != jnp.float16
  fast_i8 = _dense.FAST_INT8_F16 and w.dtype in (jnp.int8, jnp.int4) and dtype == jnp.float16

  in_specs = [plgpu.BlockSpec((rows, step), lambda kk: (0, kk), transforms=x_transforms,
                              memory_space=plgpu.SMEM)]
  for j in range(subs):
    in_specs.append(plgpu.BlockSpec((bn, group), lambda kk, j=j: (0, kk * subs + j),
                                    transforms=w_transforms, memory_space=plgpu.SMEM))
  if int4:
    in_specs.append(plgpu.BlockSpec((subs, bn), lambda kk: (kk, 0), memory_space=plgpu.SMEM))

  def get_pipeline(body, compute_context):
    return plgpu.emit_pipeline_warp_specialized(
        body,
        grid=(steps,),
        memory_registers=_MEMORY_REGISTERS,
        in_specs=in_specs,
        wg_axis="wg",
        num_compute_wgs=2,
        max_concurrent_steps=min(config.num_stages, steps),
        compute_context=compute_context,
    )

  def kernel(x_gmem, w_gmem, *rest):
    s_gmem, out_gmem = rest if int4 else (None, *rest)
    ignore = lambda *_, **__: None
    operands = (x_gmem,) + (w_gmem,) * subs + ((s_gmem,) if int4 else ())

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(*operands),
        out_smem=plgpu.SMEM((2, 1, 64, rows), jnp.float32, transforms=out_transforms),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, out_smem):
      wg = lax.axis_index("wg")
      wg_n = pl.ds(wg * wn, wn)

      @plgpu.nd_loop((tiles * sk,), collective_axes="sm")
      def _tile_loop(info: plgpu.NDLoopInfo):
        (lin,) = info.index
        # Splits outermost: the CTAs of a wave read neighbouring weight rows.
        split = lax.div(lin, jnp.int32(tiles))
        n_slice = pl.ds(lax.rem(lin, jnp.int32(tiles)) * bn, bn)
        k_slice = pl.ds(split * split_len, split_len)
        out_ref = out_gmem.at[split] if sk > 1 else out_gmem

        def compute_context(eval_pipeline):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wn, rows), jnp.float32))
          def _acc_scope(acc_ref):
            eval_pipeline(acc_ref)
            store_tile(acc_ref[...], out_smem, wg, out_ref.at[n_slice].at[wg_n],
                       epi=(64, rows))

        def mma_body(_, x_smem, *refs):
          *w_smems, acc_ref = refs
          s_smem = w_smems.pop() if int4 else None
          for j, w_smem in enumerate(w_smems):
            # Loaded in wgmma's layout. (Loading 32 bits a thread, then a
            # relayout in registers, ran no faster on an H100.)
            a = w_smem[wg_n]
            if convert_f16:
              a = a.astype(jnp.float16)  # e4m3 -> bfloat16 has no single cvt on sm_90
            if fast_i8:
              a = int8_to_f16(a)
            else:
              a = a.astype(dtype)
            if int4:
              s = plgpu.load(s_smem.at[j, wg_n], (), layout=plgpu.Layout.WGMMA.reduce(1))
              a = a * lax.broadcast_in_dim(s.astype(dtype), a.shape, [0])
            x_part = x_smem.at[:, pl.ds(j * group, group)] if subs > 1 else x_smem
            plgpu.wgmma(acc_ref, a, plgpu.transpose_ref(x_part, (1, 0)))
          # The registers of a stay read until the wgmmas complete.
          plgpu.wgmma_wait(0)
          return acc_ref

        get_pipeline(mma_body, compute_context)(
            x_gmem.at[pl.ds(0, rows), k_slice],
            *(w_gmem.at[n_slice, k_slice],) * subs,
            *((s_gmem.at[pl.ds(split * (split_len // group), split_len // group), n_slice],)
              if int4 else ()),
            allocations=pipeline_allocs,
        )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  arrays = (x, w, group_scales) if int4 else (x, w)
  return launch(kernel, arrays, out_shape=(n, rows), split_k=sk, out_dtype=jnp.float32,
                work_tiles=tiles * sk, num_sms=num_sms)

