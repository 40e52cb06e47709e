"""Pallas Mosaic GPU FP8 GEMM for Hopper (W8A8): ``y = (x @ w.T) * x_scales[:, None] * w_scales``.

``x [M, K]`` and ``w [N, K]`` are float8_e4m3fn, both with K contiguous: the
layout Hopper's FP8 tensor cores read (``wgmma`` takes 8-bit operands only
K-major, so the weight is ``[N, K]``, as cuBLASLt's and DeepGEMM's FP8 GEMMs
take it). ``x_scales [M]`` are the activations' per-token (row) scales and
``w_scales [N]`` the weight's per-output-channel scales, both float32: the
dequantized operands are ``x * x_scales[:, None]`` and ``w * w_scales[:, None]``,
and both scales leave the dot product, so the kernel multiplies the 8-bit
values on the tensor cores (twice bfloat16's rate) and scales the fp32 tile
once in the epilogue, before the cast.

The structure is the project's Mosaic GEMM (:mod:`pallas_kernels.matmul.mosaic`):
a persistent grid, one producer warpgroup streaming ``[block_m, 128]`` blocks
of ``x`` and ``[block_n, 128]`` blocks of ``w`` (128 one-byte elements: one
128-byte swizzle row) with TMA into a ring of ``num_stages`` buffers, two
consumer warpgroups running wgmma with fp32 accumulators. What differs:

* a consumer issues the next step's wgmma before waiting for the last one
  (a ring slot is released one step late), so the tensor cores never wait
  for the issue of the next block;
* at the start of a work tile each consumer fetches its rows' and columns'
  scales with TMA; the epilogue multiplies the fp32 tile by both and writes
  the output dtype. With ``split_k > 1`` the kernel writes fp32 partials and
  one XLA fusion sums them, scales and casts.

Accuracy: the products of two e4m3 values are exact in fp32; wgmma's fp32
accumulation over K rounds like any fp32 GEMM on Hopper's FP8 path (its
accumulator keeps fewer mantissa bits than IEEE fp32 between K blocks). The
tolerance against the float32 product of the dequantized operands is 2e-2
relative to the output's largest value (every config measured on an H100
since the last-step wait of ``wgmma_wait_delayed`` was within it). That holds
where the products cancel (random signs); where an output sums products of
one sign (``benchmarks/fp8_gemm.py --x-from-w``: x is the weight's first
rows), the error grows with the K of a split: on an H200 0.148, 0.076, 0.040
and 0.016 at 14,336, 7,168, 3,584 and 1,792 K per split, and XLA's FP8 dot
(cuBLASLt) the same 0.153 at 14,336 K and 2,048 rows (0.016-0.018 at 1 and
16 rows). Promoting the accumulator to fp32 every few K blocks, as DeepGEMM
does, is not done.

Where a K split has few steps (at most :data:`RING_MAX_STEPS`), the blocks
stream through one TMA ring across all of a CTA's work tiles (the grouped
GEMM's ring, :func:`~pallas_kernels.ragged_dot.mosaic.ring_produce`), so the
producer loads the next tile's first K blocks while the consumers scale and
store the last one; Pallas's pipeline, used above that, drains between
tiles. ``fp8_matmul(ring=...)`` chooses either.

Requirements (:func:`check_shapes`): compute capability 9.0; ``K`` a multiple
of 128 with at least two K steps of 128 per split; ``N`` a multiple of 64;
``M`` a multiple of 8 or below it; ``num_stages >= 3``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.matmul.mosaic import (EPI_TILE, M_MULTIPLE, MosaicMatmulConfig, empty_split,
                                          launch,
                                          store_tile, wg_tile, wgmma_wait_delayed, work_tile)
from pallas_kernels._launch import SMEM_LIMIT, local_items, require_compute_capability
from pallas_kernels.ragged_dot.mosaic import (PRODUCER_REGISTERS, consumer_registers,
                                              ring_consume, ring_produce)

__all__ = ["BLOCK_K", "DTYPES", "HBM_TBS", "RING_MAX_STEPS", "RULE_TILES", "check_shapes",
           "WIDE_TILES", "WIDE_TILE_GPUS", "estimate_us", "fp8_matmul", "heuristic_config",
           "k_steps", "operand_pipeline", "ring_load", "ring_scratch", "ring_tile",
           "rule_candidates", "rule_tiles", "smem_bytes", "wave_split"]

#: Operand dtypes (both).
DTYPES = ("float8_e4m3fn",)
#: K step of the pipeline: 128 one-byte elements, one 128-byte swizzle row.
BLOCK_K = 128
#: N must be a multiple of this (TMA tiles global memory like shared memory).
N_MULTIPLE = 64
_BARRIER_BYTES = 1024
_MEMORY_REGISTERS = 40
#: ``ring=None`` runs the kernel's own ring where a K split has at most this
#: many steps of 128, else Pallas's pipeline (the FP8 grouped GEMM's limit,
#: :data:`pallas_kernels.ragged_dot.fp8.RING_MAX_STEPS`, which it measured).
RING_MAX_STEPS = 16


def k_steps(k: int, split_k: int) -> int:
  """Pipeline steps of one K split (the last split may run past K: zeros)."""
  return -(-(-(-k // BLOCK_K)) // split_k)


def smem_bytes(*, block_m: int, block_n: int, num_stages: int, out_itemsize: int) -> int:
  """The operand ring, two 64x64 output slots per consumer, and each
  consumer's row and column scales, each scale buffer taking whole KiB (as
  Mosaic GPU aligns them: 128 x 192 tiles with 4 stages and fp32 partials
  lower to 232,544 bytes, 96 past the H100's limit, where the scales'
  bare sizes would sum to 232,448)."""
  wm, wn = wg_tile(block_m, block_n)
  ring = num_stages * (block_m + block_n) * BLOCK_K
  out_item = out_itemsize if out_itemsize else 4
  slots = min(2, (wm * wn) // (EPI_TILE * EPI_TILE))
  scales = sum(-(-2 * d * 4 // 1024) * 1024 for d in (wm, wn))
  return ring + 2 * slots * EPI_TILE * EPI_TILE * out_item + scales + _BARRIER_BYTES


def check_shapes(m: int, n: int, k: int, dtype, w_dtype, config: MosaicMatmulConfig) -> None:
  """Raises ``ValueError`` unless the kernel runs ``[m, k] x [n, k]`` with ``config``."""
  for name, d in (("x", dtype), ("w", w_dtype)):
    if jnp.dtype(d).name not in DTYPES:
      raise ValueError(f"the Mosaic GPU FP8 GEMM takes {DTYPES} operands; got {name} "
                       f"{jnp.dtype(d).name}")
  if k % BLOCK_K or n % N_MULTIPLE:
    raise ValueError(f"the Mosaic GPU FP8 GEMM needs K a multiple of {BLOCK_K} and N of "
                     f"{N_MULTIPLE}; got N={n}, K={k} (use the XLA config)")
  if m > M_MULTIPLE and m % M_MULTIPLE:
    raise ValueError(f"the Mosaic GPU FP8 GEMM needs M a multiple of {M_MULTIPLE} or below "
                     f"it; got M={m} (use the XLA config)")
  if config.block_n not in (64, 128, 192, 256):
    raise ValueError(f"config {config}: block_n must be 64, 128, 192 or 256")
  if config.num_stages < 3:
    raise ValueError(f"config {config}: the FP8 GEMM needs num_stages >= 3 (a ring slot "
                     f"is released one step late)")
  if k_steps(k, config.split_k) < 2:
    raise ValueError(f"config {config}: the FP8 GEMM needs at least 2 K steps of {BLOCK_K} "
                     f"per split; K={k} gives {k_steps(k, config.split_k)} (use fewer "
                     f"splits or the XLA config)")


#: Rates of the config rule's cost model (:func:`estimate_us`), fitted on an H100:
#: the FP8 GEMM's rate at 128 x 256 tiles, achievable HBM bandwidth, the time a
#: TMA load spends in flight under load, and the split-K reduction's launch.
_RATE, _BW, _LATENCY_S, _SPLIT_S = 1.5e15, 2.6e12, 2.4e-6, 2e-6
#: Peak HBM bandwidth (TB/s) by device key: the rule scales ``_BW``, fitted on
#: the H100 SXM (3.35 TB/s peak), to the GPU's peak. On an H200 (4.8 TB/s) the
#: H100's bandwidth made the rule pick 80 CTAs of 64 x 128 tiles (K split 2)
#: for Mistral-Nemo-12B's down projection at one row, 30.3 us against XLA's
#: 25.1; scaled, it picks 64 x 256 tiles with a split of 4, 22.0 us
#: (``benchmarks/fp8_gemm.py --weights mistral_nemo_12b.down --m 1 --full``).
#: GPUs not listed keep the H100's fit.
HBM_TBS = {"nvidia_h100_80gb_hbm3": 3.35, "nvidia_h200": 4.8}
_FIT_TBS = HBM_TBS["nvidia_h100_80gb_hbm3"]
#: Tile rate relative to 128 x 256 (measured at 2k-8k rows).
_TILE_EFF = {(128, 256): 1.0, (256, 128): 0.98, (128, 192): 0.97, (128, 128): 0.93,
             (64, 256): 0.75, (64, 128): 0.6}
#: The tiles and stages the rule chooses among.
RULE_TILES = ((128, 256, 3), (128, 128, 5), (64, 256, 4), (64, 128, 4))
#: 128 x 192 tiles (4 stages, no K split: fp32 partials do not fit shared
#: memory), which the rule also weighs on :data:`WIDE_TILE_GPUS`. Their N
#: tiles fill a wave where 256-column ones leave SMs idle or spill into one
#: more wave: on an H200 (``benchmarks/fp8_gemm.py --rule-set --shapes ...``)
#: the rule's config with them ran 1.009-1.270x the rule's config without them
#: on all 19 problems where it changed, and 128 x 192 was the fastest config
#: the rule weighs on 19 of the 20 problems timed with several.
WIDE_TILES = ((128, 192, 4),)
#: GPUs whose rule weighs :data:`WIDE_TILES` (measured there; the H100 not yet).
WIDE_TILE_GPUS = ("nvidia_h200",)


def rule_tiles(device_key: str | None) -> tuple:
  """The tiles the rule weighs on ``device_key``'s GPU."""
  return RULE_TILES + (WIDE_TILES if device_key in WIDE_TILE_GPUS else ())


def estimate_us(m: int, n: int, k: int, config: MosaicMatmulConfig, num_sms: int,
                hbm_tbs: float | None = None) -> float:
  """The config rule's cost model, microseconds: the larger of the MMA time
  (waves of CTA tiles, each ``2 bm bn K / split`` flops at its tile's rate
  per SM) and the time to read both operands (each CTA keeps its ring of
  ``num_stages`` blocks in flight, at most the HBM bandwidth), plus the split-K
  reduction (a launch and the fp32 partials written and read). ``hbm_tbs``:
  the GPU's peak HBM bandwidth in TB/s, which scales the achievable one
  (default: the H100's, where the rates were fitted)."""
  bm, bn, sk = config.block_m, config.block_n, config.split_k
  max_bw = _BW * (hbm_tbs / _FIT_TBS if hbm_tbs else 1.0)
  ctas = -(-m // bm) * -(-n // bn) * sk
  waves = -(-ctas // num_sms)
  eff = _TILE_EFF.get((bm, bn), 0.6)
  mma = waves * 2 * bm * bn * k / sk / (_RATE / num_sms * eff)
  in_flight = config.num_stages * (bm + bn) * BLOCK_K
  bw = min(max_bw, min(ctas, num_sms) * in_flight / _LATENCY_S)
  read = (n * k + m * k + 2 * m * n) / bw
  split = _SPLIT_S + 2 * sk * m * n * 4 / max_bw if sk > 1 else 0.0
  return 1e6 * (max(mma, read) + split)


def heuristic_config(m: int, n: int, k: int, num_sms: int, hbm_tbs: float | None = None, *,
                     out_itemsize: int = 2, tiles=RULE_TILES,
                     any_split: bool = False) -> MosaicMatmulConfig:
  """The config of least :func:`estimate_us` among ``tiles`` (default
  :data:`RULE_TILES`; :func:`rule_tiles` gives a GPU's)
  (64-row tiles up to 256 rows, 128-row ones from 65), each with no K split or the split that
  fills a wave (:func:`wave_split`); bands of 8 tiles (L2 reuse) where the
  output has more than a wave of tiles. On an H100 its config was the
  fastest of those measured (it and its neighbours) or within 1.1% of it on
  28 of the 29 problems where it ran, 6.8% slower on one
  (``benchmarks/fp8_gemm.py``). ``hbm_tbs``: as :func:`estimate_us`
  (:data:`HBM_TBS` by GPU); ``out_itemsize``: bytes of an output element;
  ``any_split``: as :func:`wave_split`."""
  return min(rule_candidates(m, n, k, num_sms, tiles=tiles, out_itemsize=out_itemsize,
                             any_split=any_split),
             key=lambda c: estimate_us(m, n, k, c, num_sms, hbm_tbs))


def rule_candidates(m: int, n: int, k: int, num_sms: int, *, tiles=RULE_TILES,
                    out_itemsize: int = 2, any_split: bool = False) -> list[MosaicMatmulConfig]:
  """The configs :func:`heuristic_config` weighs: each of ``tiles`` (``(block_m,
  block_n, num_stages)``; 64-row tiles up to 256 rows, 128-row ones from 65)
  with no K split and with the split that fills a wave, in bands of 8 tiles
  where the output has more than a wave of tiles; those whose shared memory
  (``out_itemsize`` bytes an output, fp32 partials under a split) passes the
  Hopper limit left out."""
  out = []
  for bm, bn, st in tiles:
    if (bm == 64 and m > 256) or (bm > 64 and m <= 64):
      continue
    n_tiles = -(-m // bm) * -(-n // bn)
    for sk in sorted({1, wave_split(n_tiles, k, num_sms, any_split)}):
      if smem_bytes(block_m=bm, block_n=bn, num_stages=st,
                    out_itemsize=4 if sk > 1 else out_itemsize) > SMEM_LIMIT:
        continue
      out.append(MosaicMatmulConfig(block_m=bm, block_n=bn, num_stages=st, split_k=sk,
                                    grid_width=8 if n_tiles > num_sms else 1))
  return out


def wave_split(tiles: int, k: int, num_sms: int, any_split: bool = False) -> int:
  """The largest power-of-two K split (any count with ``any_split``, none of
  its splits empty) whose CTAs (``tiles`` times the split) fit one wave,
  with at least four K steps a split."""
  sk = 1
  if any_split:
    blocks = -(-k // BLOCK_K)
    for s in range(2, num_sms // max(tiles, 1) + 1):
      if k_steps(k, s) >= 4 and not empty_split(blocks, s):
        sk = s
    return sk
  while tiles * sk * 2 <= num_sms and k_steps(k, sk * 2) >= 4:
    sk *= 2
  return sk


def operand_pipeline(body, compute_context, *, block_m: int, block_n: int, steps: int,
                     num_stages: int):
  """The warp-specialized TMA ring of the FP8 GEMMs: ``[block_m, 128]`` blocks
  of x and ``[block_n, 128]`` blocks of w (K-major, 128-byte swizzle), one
  producer and two consumer warpgroups (axis ``"wg"``), ring slots released
  one step late (the consumer waits with :func:`wgmma_wait_delayed`)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  transforms = (plgpu.TilingTransform((8, BLOCK_K)), plgpu.SwizzleTransform(128))
  return plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(steps,),
      memory_registers=_MEMORY_REGISTERS,
      in_specs=[
          plgpu.BlockSpec((block_m, BLOCK_K), lambda kk: (0, kk), transforms=transforms,
                          memory_space=plgpu.SMEM, delay_release=1),
          plgpu.BlockSpec((block_n, BLOCK_K), lambda kk: (0, kk), transforms=transforms,
                          memory_space=plgpu.SMEM, delay_release=1),
      ],
      wg_axis="wg",
      num_compute_wgs=2,
      max_concurrent_steps=min(num_stages, steps),
      compute_context=compute_context,
  )


def ring_scratch(stages: int, block_m: int, block_n: int, dtype) -> dict:
  """Shared memory of the FP8 GEMMs' own TMA ring (``ring=True``, here and in
  :mod:`pallas_kernels.ragged_dot.fp8`): ``stages`` K-major ``[block_m, 128]``
  and ``[block_n, 128]`` blocks (128-byte swizzle), their ready barriers and
  the slots' ``consumed`` barriers (one arrival per consumer warpgroup)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  transforms = (plgpu.TilingTransform((8, BLOCK_K)), plgpu.SwizzleTransform(128))
  return dict(
      x_smem=plgpu.SMEM((stages, block_m, BLOCK_K), dtype, transforms=transforms),
      w_smem=plgpu.SMEM((stages, block_n, BLOCK_K), dtype, transforms=transforms),
      x_ready=plgpu.Barrier(num_barriers=stages),
      w_ready=plgpu.Barrier(num_barriers=stages),
      consumed=plgpu.Barrier(num_arrivals=2, num_barriers=stages))


def ring_tile(acc_ref, g, x_ring, w_ring, *, steps: int, stages: int, x_ready, w_ready,
              consumed) -> None:
  """A consumer's ``steps`` K steps of one work tile on the FP8 ring from
  ring step ``g``: ``x_ring`` / ``w_ring`` its rows of the slots, one wgmma in
  flight (:func:`~pallas_kernels.ragged_dot.mosaic.ring_consume`)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  def wait_ready(slot):
    plgpu.barrier_wait(x_ready.at[slot])
    plgpu.barrier_wait(w_ready.at[slot])

  def mma(acc_ref, slot):
    plgpu.wgmma(acc_ref, x_ring.at[slot], plgpu.transpose_ref(w_ring.at[slot], (1, 0)))

  ring_consume(acc_ref, g, steps=steps, stages=stages, wait_ready=wait_ready, mma=mma,
               consumed=consumed, hold=True)


def ring_load(x_src, w_src, slot, *, x_smem, w_smem, x_ready, w_ready) -> None:
  """The producer's TMA copies of one K step (``x_src``, ``w_src``: the
  step's blocks in global memory) into ring ``slot``."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  plgpu.copy_gmem_to_smem(x_src, x_smem.at[slot], x_ready.at[slot])
  plgpu.copy_gmem_to_smem(w_src, w_smem.at[slot], w_ready.at[slot])


def fp8_matmul(x: jax.Array, w: jax.Array, x_scales: jax.Array, w_scales: jax.Array, *,
               config: MosaicMatmulConfig, out_dtype=jnp.bfloat16,
               num_sms: int | None = None, ring: bool | None = None) -> jax.Array:
  """``(x @ w.T) * x_scales[:, None] * w_scales[None, :]`` on FP8 operands (Hopper only).

  Args:
    x: ``[M, K]`` float8_e4m3fn activations.
    w: ``[N, K]`` float8_e4m3fn weight (K contiguous).
    x_scales: ``[M]`` float32, one per row (token).
    w_scales: ``[N]`` float32, one per output channel.
    config: launch parameters (:class:`MosaicMatmulConfig`), used as given.
    out_dtype: bfloat16, float16 or float32.
    num_sms: CTAs of the persistent grid (default: the default device's SMs).
    ring: True streams the K blocks through one TMA ring across all of a
      CTA's work tiles (module doc), False through Pallas's pipeline, which
      drains between tiles; None (default): the ring where a split has at
      most :data:`RING_MAX_STEPS` K steps.

  Raises:
    ValueError: bad shapes or dtypes, shapes the kernel does not run, or no
      Hopper GPU.
  """
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
    raise ValueError(f"need x [M, K] and w [N, K]; got {x.shape}, {w.shape}")
  if x_scales.shape != (x.shape[0],) or w_scales.shape != (w.shape[0],):
    raise ValueError(f"need x_scales [M] and w_scales [N]; got {x_scales.shape}, "
                     f"{w_scales.shape}")
  out_dtype = jnp.dtype(out_dtype)
  if out_dtype.name not in ("bfloat16", "float16", "float32"):
    raise ValueError(f"the Mosaic GPU FP8 GEMM writes bfloat16, float16 or float32; got "
                     f"{out_dtype.name}")
  (m, k), n = x.shape, w.shape[0]
  check_shapes(m, n, k, x.dtype, w.dtype, config)
  if ring is None:
    ring = k_steps(k, config.split_k) <= RING_MAX_STEPS
  if num_sms is None:
    num_sms = int(require_compute_capability("9.0", "Mosaic GPU FP8 GEMM",
                                             "use the XLA config").core_count)
  return _matmul(x, w, x_scales.astype(jnp.float32), w_scales.astype(jnp.float32),
                 config=config, out_dtype=out_dtype, num_sms=int(num_sms), ring=bool(ring))


@functools.partial(jax.jit, static_argnames=("config", "out_dtype", "num_sms", "ring"))
def _matmul(x, w, xs, ws, *, config: MosaicMatmulConfig, out_dtype, num_sms: int, ring: bool):
  if config.split_k == 1:
    return _kernel_call(x, w, xs, ws, config=config, out_dtype=out_dtype, num_sms=num_sms,
                        ring=ring)
  acc = _kernel_call(x, w, xs, ws, config=config, out_dtype=None, num_sms=num_sms, ring=ring)
  return (acc.sum(axis=0) * xs[:, None] * ws[None, :]).astype(out_dtype)


def _kernel_call(x, w, xs, ws, *, config: MosaicMatmulConfig, out_dtype, num_sms: int,
                 ring: bool):
  """The kernel; ``out_dtype=None`` writes unscaled fp32 partials ``[split_k, M, N]``."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  (m, k), n = x.shape, w.shape[0]
  sk = config.split_k
  scaled = out_dtype is not None
  out_dtype = jnp.dtype(out_dtype if scaled else jnp.float32)
  bm, bn = config.block_m, config.block_n
  wm, wn = wg_tile(bm, bn)
  split_m = bm >= 128
  tiles_m, tiles_n = pl.cdiv(m, bm), pl.cdiv(n, bn)
  steps = k_steps(k, sk)
  split_len = steps * BLOCK_K

  out_swizzle = plgpu.find_swizzle(EPI_TILE * out_dtype.itemsize * 8)
  out_elems = out_swizzle // out_dtype.itemsize
  out_transforms = (plgpu.TilingTransform((8, out_elems)), plgpu.SwizzleTransform(out_swizzle))
  epi_m, epi_n = min(EPI_TILE, wm), min(EPI_TILE, wn)
  num_slots = min(2, (wm * wn) // (epi_m * epi_n))

  def fetch_scales(xs_gmem, ws_gmem, row_smem, col_smem, scale_bars, wg, m_slice, n_slice,
                   wg_m, wg_n):
    """Consumer ``wg``'s row and column scales of a work tile, by TMA (none
    for unscaled partials)."""
    if scaled:
      plgpu.copy_gmem_to_smem(xs_gmem.at[m_slice].at[wg_m], row_smem.at[wg],
                              scale_bars.at[2 * wg])
      plgpu.copy_gmem_to_smem(ws_gmem.at[n_slice].at[wg_n], col_smem.at[wg],
                              scale_bars.at[2 * wg + 1])

  def epilogue(acc_ref, wg, out_smem, row_smem, col_smem, scale_bars, dst):
    """Consumer ``wg``'s finished fp32 tile, scaled by its scales
    (:func:`fetch_scales`), cast and stored to ``dst``."""
    acc = acc_ref[...]
    if scaled:
      plgpu.barrier_wait(scale_bars.at[2 * wg])
      plgpu.barrier_wait(scale_bars.at[2 * wg + 1])
      rows = plgpu.load(row_smem.at[wg], (), layout=plgpu.Layout.WGMMA.reduce(1))
      cols = plgpu.load(col_smem.at[wg], (), layout=plgpu.Layout.WGMMA.reduce(0))
      acc = (acc * lax.broadcast_in_dim(rows, (wm, wn), [0])
             * lax.broadcast_in_dim(cols, (wm, wn), [1]))
    store_tile(acc.astype(out_dtype), out_smem, wg, dst, epi=(epi_m, epi_n))

  def epilogue_scratch():
    """Shared memory of the epilogue: each consumer's output slots, its
    scales and their barriers."""
    return dict(out_smem=plgpu.SMEM((2, num_slots, epi_m, epi_n), out_dtype,
                                    transforms=out_transforms),
                row_smem=plgpu.SMEM((2, wm), jnp.float32),
                col_smem=plgpu.SMEM((2, wn), jnp.float32),
                scale_bars=plgpu.Barrier(num_barriers=4))

  def get_pipeline(body, compute_context):
    return operand_pipeline(body, compute_context, block_m=bm, block_n=bn, steps=steps,
                            num_stages=config.num_stages)

  def kernel(x_gmem, w_gmem, xs_gmem, ws_gmem, out_gmem):
    ignore = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem),
        **epilogue_scratch(),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, out_smem, row_smem, col_smem, scale_bars):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((tiles_m * tiles_n * sk,), collective_axes="sm")
      def _tile_loop(info: plgpu.NDLoopInfo):
        (lin,) = info.index
        split, m_slice, n_slice, k_slice, wg_m, wg_n = work_tile(
            lin, wg, tiles=(tiles_m, tiles_n), config=config, split_len=split_len)
        out_ref = out_gmem.at[split] if sk > 1 else out_gmem
        # This consumer's w rows (the tile's columns): all of them where the
        # warpgroups split M, its half where they split N.
        w_rows = slice(None) if split_m else wg_n

        def compute_context(eval_pipeline):
          # Fetch the scales while the K loop runs.
          fetch_scales(xs_gmem, ws_gmem, row_smem, col_smem, scale_bars, wg, m_slice, n_slice,
                       wg_m, wg_n)

          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wm, wn), jnp.float32))
          def _acc_scope(acc_ref):
            eval_pipeline(acc_ref)
            plgpu.wgmma_wait(0)
            epilogue(acc_ref, wg, out_smem, row_smem, col_smem, scale_bars,
                     out_ref.at[m_slice, n_slice].at[wg_m, wg_n])

        def mma_body(idx, x_smem, w_smem, acc_ref):
          plgpu.wgmma(acc_ref, x_smem.at[wg_m],
                      plgpu.transpose_ref(w_smem.at[w_rows], (1, 0)))
          wgmma_wait_delayed(idx[0], steps, 1)  # the last step's: its slot is released next
          return acc_ref

        get_pipeline(mma_body, compute_context)(
            x_gmem.at[m_slice, k_slice],
            w_gmem.at[n_slice, k_slice],
            allocations=pipeline_allocs,
        )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  ctas = min(num_sms, tiles_m * tiles_n * sk)

  def ring_kernel(x_gmem, w_gmem, xs_gmem, ws_gmem, out_gmem):
    """``ring``: one TMA ring through all of this CTA's work tiles (tiles
    ``cta``, ``cta + ctas``, ... of the persistent grid's order), its slots
    counted across them (:func:`~pallas_kernels.ragged_dot.mosaic.ring_consume`,
    :func:`~pallas_kernels.ragged_dot.mosaic.ring_produce`)."""
    stages = config.num_stages

    @functools.partial(pl.run_scoped, **ring_scratch(stages, bm, bn, x_gmem.dtype),
                       **epilogue_scratch(), collective_axes="wg")
    def _scope(x_smem, w_smem, x_ready, w_ready, consumed, out_smem, row_smem, col_smem,
               scale_bars):
      wg = lax.axis_index("wg")
      cta = lax.axis_index("sm")
      n_local = local_items(cta, tiles_m * tiles_n * sk, ctas)
      bars = dict(x_ready=x_ready, w_ready=w_ready)

      def item(i):
        return work_tile(cta + i * ctas, wg, tiles=(tiles_m, tiles_n), config=config,
                         split_len=split_len)

      @pl.when(wg < 2)
      def _consumers():
        plgpu.set_max_registers(consumer_registers(2), action="increase")

        def run_item(i, g):
          split, m_slice, n_slice, _, wg_m, wg_n = item(i)
          out_ref = out_gmem.at[split] if sk > 1 else out_gmem
          # The scales arrive while the K loop runs.
          fetch_scales(xs_gmem, ws_gmem, row_smem, col_smem, scale_bars, wg, m_slice, n_slice,
                       wg_m, wg_n)
          w_rows = slice(None) if split_m else wg_n

          def tile(acc_ref):
            ring_tile(acc_ref, g, x_smem.at[:, wg_m], w_smem.at[:, w_rows], steps=steps,
                      stages=stages, consumed=consumed, **bars)
            epilogue(acc_ref, wg, out_smem, row_smem, col_smem, scale_bars,
                     out_ref.at[m_slice, n_slice].at[wg_m, wg_n])

          pl.run_scoped(tile, plgpu.ACC((wm, wn), jnp.float32))
          return g + steps

        lax.fori_loop(0, n_local, run_item, jnp.int32(0))

      @pl.when(wg == 2)
      def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        def item_loads(i):
          split, m_slice, n_slice, _, _, _ = item(i)

          def load(kk, slot):
            k_slice = pl.ds(split * split_len + kk * BLOCK_K, BLOCK_K)
            ring_load(x_gmem.at[m_slice, k_slice], w_gmem.at[n_slice, k_slice], slot,
                      x_smem=x_smem, w_smem=w_smem, **bars)
          return load

        ring_produce(n_local, steps=steps, stages=stages, consumed=consumed,
                     item_loads=item_loads)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return launch(ring_kernel if ring else kernel, (x, w, xs, ws), out_shape=(m, n), split_k=sk,
                out_dtype=out_dtype, work_tiles=tiles_m * tiles_n * sk, num_sms=num_sms)
