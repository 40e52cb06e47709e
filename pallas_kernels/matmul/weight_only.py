"""Pallas Mosaic GPU weight-only quantized GEMM for Hopper: ``y = (x @ w) * scales``.

``x [M, K]`` bfloat16 or float16, ``w [K, N]`` int8 or float8_e4m3fn (the
layout of ``jnp.dot(x, w)``), ``scales [N]`` float32, one per output channel:
the dequantized weight is ``w * scales``, and since a channel's scale is
common to its whole column it leaves the dot product: the kernel computes
``x @ w`` on the 8-bit values (exact in bfloat16 and float16) and the scales
multiply the fp32 result once. A step reads half the bytes of a bfloat16
weight, which is what bounds a decode step (a few rows against a whole
weight).

The structure is the project's Mosaic GEMM (:mod:`pallas_kernels.matmul.mosaic`):
a persistent grid, one producer warpgroup streaming ``[block_m, 64]`` blocks of
``x`` and ``[64, block_n]`` 8-bit blocks of ``w`` with TMA into a ring of
shared-memory buffers (128-byte swizzle), two consumer warpgroups, split-K
with fp32 partials. What differs: each consumer converts its half of the
8-bit block to the activations' dtype in registers and stores it to a
shared-memory buffer of its own, from which wgmma reads it (wgmma's right
operand lives in shared memory). The kernel writes fp32; one XLA fusion sums
the splits, applies the scales and casts.

Requirements (:func:`check_shapes`): compute capability 9.0; ``block_n = 256``
with ``block_m = 64`` (each consumer's half of an 8-bit block is one
128-byte swizzle row wide) or any ``block_n`` of 128 / 256 with ``block_m >=
128``; ``N`` a multiple of 128 and ``K`` of 64, at least two K steps of 64 per
split; ``M`` a multiple of 8 or below it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.matmul.mosaic import (BLOCK_K, M_MULTIPLE, MosaicMatmulConfig, empty_split,
                                          k_steps,
                                          launch, store_tile, wg_tile, wgmma_wait_delayed,
                                          work_tile)
from pallas_kernels._launch import require_compute_capability

__all__ = ["FAST_INT8_F16", "WEIGHT_DTYPES", "check_dtypes", "check_shapes", "decode_config",
           "int8_to_f16", "smem_bytes", "weight_only_matmul"]

#: 8-bit weight dtypes.
WEIGHT_DTYPES = ("int8", "float8_e4m3fn")
#: N must be a multiple of this (an 8-bit block is tiled by 128 columns).
N_MULTIPLE = 128
_BARRIER_BYTES = 1024
#: Columns of an fp32 epilogue store (one 128-byte swizzle row).
EPI_N = 32
_MEMORY_REGISTERS = 40
#: int8 weights with float16 ``x``: convert each pair of values with one
#: PRMT, one LOP3 and one packed f16 subtraction (:func:`int8_to_f16`)
#: instead of Mosaic's per-value conversion. Read when a kernel is traced
#: (set it before the first call; jit caches what it traced).
FAST_INT8_F16 = True
#: The constants of that conversion: PRMT's second operand (the exponent
#: byte of 1024.0 in float16) and selector (byte 0, 0x64, byte 1, 0x64),
#: the sign bits flipped, and 1152.0 twice in float16.
F16_PRMT = (0x64, 0x4140)
F16_SIGN_FLIP = 0x00800080
F16_BIAS = 0x64806480
#: int4: PRMT's selector for the first pair of a word (byte j of the word and
#: of the word shifted right by 4 for pair j: ``+ 0x101 * j``; the other two
#: bytes are masked), the LOP3's exponent and sign flip, and the
#: subtraction: 1032.0 (1024 + 8) twice in float16.
F16_INT4_PRMT = 0xF4F0
F16_INT4_BIAS = 0x64086408


def smem_bytes(*, block_m: int, block_n: int, num_stages: int, itemsize: int) -> int:
  """The operand ring (x blocks and 8-bit w blocks), two dequantized blocks
  per consumer, and two 64x32 fp32 output slots per consumer."""
  wm, wn = wg_tile(block_m, block_n)
  ring = num_stages * (block_m * BLOCK_K * itemsize + BLOCK_K * block_n)
  deq = 2 * 2 * BLOCK_K * (block_n if block_m >= 128 else wn) * itemsize
  return ring + deq + 2 * 2 * 64 * EPI_N * 4 + _BARRIER_BYTES


def check_dtypes(dtype, w_dtype, kernel: str = "weight-only GEMM") -> None:
  """Raises ``ValueError`` unless the activations are 16-bit and the weight
  8-bit (every weight-only kernel: dense, ``[N, K]`` and grouped)."""
  if jnp.dtype(dtype).name not in ("bfloat16", "float16"):
    raise ValueError(f"the Mosaic GPU {kernel} takes bfloat16 or float16 activations; got "
                     f"{jnp.dtype(dtype).name}")
  if jnp.dtype(w_dtype).name not in WEIGHT_DTYPES:
    raise ValueError(f"the Mosaic GPU {kernel} takes {WEIGHT_DTYPES} weights; got "
                     f"{jnp.dtype(w_dtype).name}")


def check_shapes(m: int, n: int, k: int, dtype, w_dtype, config: MosaicMatmulConfig) -> None:
  """Raises ``ValueError`` unless the kernel runs these shapes with ``config``."""
  check_dtypes(dtype, w_dtype)
  if config.block_n not in (128, 256) or (config.block_m == 64 and config.block_n != 256):
    raise ValueError(f"config {config}: the weight-only GEMM needs block_n 256 with "
                     f"block_m 64, or block_n 128 / 256 with block_m >= 128")
  if n % N_MULTIPLE or k % BLOCK_K:
    raise ValueError(f"the Mosaic GPU weight-only GEMM needs N a multiple of {N_MULTIPLE} "
                     f"and K of {BLOCK_K}; got N={n}, K={k} (use the XLA config)")
  if m > M_MULTIPLE and m % M_MULTIPLE:
    raise ValueError(f"the Mosaic GPU weight-only GEMM needs M a multiple of {M_MULTIPLE} "
                     f"or below it; got M={m} (use the XLA config)")
  if k_steps(k, config.split_k) < 2:
    raise ValueError(f"config {config}: the weight-only GEMM needs at least 2 K steps of "
                     f"{BLOCK_K} per split (a ring slot is released one step late); K={k} "
                     f"gives {k_steps(k, config.split_k)} (use fewer splits or the XLA "
                     f"config)")


def decode_config(m: int, k: int, n: int, num_sms: int,
                  any_split: bool = True) -> MosaicMatmulConfig | None:
  """The config for a few rows (``m <= 64``): 64 x 256 tiles, 4 stages, and
  the largest split of K (any count, none of its splits empty; a power of
  two with ``any_split=False``, the rule before) whose CTAs (column tiles
  times splits) fit one wave, with K's blocks at least four times the
  splits (the last split may hold fewer real blocks, the rest past K read
  as zeros); None above 64 rows (XLA's GEMM is the faster there: the
  conversion costs the consumers more than the halved bytes save). Any count fills the wave
  where powers of two leave it part empty (20 column tiles: 6 splits, 120
  CTAs of 132, where 4 gave 80): on an H200 1.060-1.422x, geomean 1.267x,
  on 16 problems of 8 weights outside the suite at 1 and 16 rows
  (``benchmarks/weight_only.py --layout kn --compare-splits``,
  ``data/probes/weight_only_kn_any_split_h200.json``). At one row, where
  the guard trusts this kernel without evidence (its CTAs fit one wave),
  powers of two ran 0.795-0.979x XLA's dot on 5 of those 8 weights and any
  count 1.086-2.316x on all 8. The tile is fixed, only the CTAs grow
  toward a full wave, so it applies on every GPU (not measured on an
  H100)."""
  if m > 64:
    return None
  tiles, blocks = -(-n // 256), k // BLOCK_K
  sk = 1
  if any_split:
    for s in range(2, num_sms // tiles + 1):
      if s * 4 <= blocks and not empty_split(blocks, s):
        sk = s
  else:
    while tiles * sk * 2 <= num_sms and sk * 2 * 4 <= blocks:  # >= 4 K steps a split
      sk *= 2
  return MosaicMatmulConfig(block_m=64, block_n=256, num_stages=4, split_k=sk)


def weight_only_matmul(x: jax.Array, w: jax.Array, scales: jax.Array, *,
                       config: MosaicMatmulConfig, out_dtype=None,
                       num_sms: int | None = None) -> jax.Array:
  """``(x @ w) * scales`` with 8-bit ``w`` (Hopper only).

  Args:
    x: ``[M, K]`` bfloat16 or float16.
    w: ``[K, N]`` int8 or float8_e4m3fn.
    scales: ``[N]`` float32, the dequantization scale of each output channel.
    config: launch parameters (:class:`MosaicMatmulConfig`), used as given.
    out_dtype: bfloat16, float16 or float32 (default ``x.dtype``).
    num_sms: CTAs of the persistent grid (default: the default device's SMs).

  Raises:
    ValueError: bad shapes or dtypes, shapes the kernel does not run, or no
      Hopper GPU.
  """
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0] or scales.shape != (w.shape[1],):
    raise ValueError(f"need x [M, K], w [K, N] and scales [N]; got {x.shape}, {w.shape}, "
                     f"{scales.shape}")
  out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
  (m, k), n = x.shape, w.shape[1]
  check_shapes(m, n, k, x.dtype, w.dtype, config)
  if config.num_stages < 3:
    raise ValueError(f"config {config}: the weight-only GEMM needs num_stages >= 3 (a ring "
                     f"slot of x is released one step late)")
  if num_sms is None:
    num_sms = int(require_compute_capability("9.0", "Mosaic GPU weight-only GEMM",
                                             "use the XLA config").core_count)
  return _matmul(x, w, scales, config=config, out_dtype=out_dtype, num_sms=int(num_sms))


@functools.partial(jax.jit, static_argnames=("config", "out_dtype", "num_sms"))
def _matmul(x, w, scales, *, config: MosaicMatmulConfig, out_dtype, num_sms: int):
  acc = _kernel_call(x, w, config=config, num_sms=num_sms)
  if config.split_k > 1:
    acc = acc.sum(axis=0)
  return (acc * scales.astype(jnp.float32)[None, :]).astype(out_dtype)


def x_block_transforms(dtype) -> tuple:
  """The 128-byte swizzle of a 16-bit block (``x`` and the dequantized ``w``)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  return (plgpu.TilingTransform((8, 128 // jnp.dtype(dtype).itemsize)),
          plgpu.SwizzleTransform(128))


def operand_pipeline(body, compute_context, *, block_m: int, block_n: int, steps: int,
                     num_stages: int, dtype):
  """The TMA ring of the weight-only GEMMs (dense and grouped): ``[block_m,
  64]`` 16-bit blocks of x and ``[64, block_n]`` 8-bit blocks of w (128-byte
  swizzle), one producer and two consumer warpgroups, each slot released one
  step late (x is read by a wgmma still in flight when the body returns)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  w_transforms = (plgpu.TilingTransform((8, 128)), plgpu.SwizzleTransform(128))
  return plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(steps,),
      memory_registers=_MEMORY_REGISTERS,
      in_specs=[
          plgpu.BlockSpec((block_m, BLOCK_K), lambda kk: (0, kk),
                          transforms=x_block_transforms(dtype), memory_space=plgpu.SMEM,
                          delay_release=1),
          plgpu.BlockSpec((BLOCK_K, block_n), lambda kk: (kk, 0), transforms=w_transforms,
                          memory_space=plgpu.SMEM, delay_release=1),
      ],
      wg_axis="wg",
      num_compute_wgs=2,
      max_concurrent_steps=min(num_stages, steps),
      compute_context=compute_context,
  )


def dequantized_mma(step, steps: int, acc_ref, x_block, w_block, deq_bufs) -> None:
  """One pipeline step of a consumer: its columns of the 8-bit block
  ``w_block`` converted in registers (exact: 8-bit values are bfloat16 /
  float16 values) into one of its two buffers ``deq_bufs`` while the last
  step's wgmma reads the other, then ``acc += x_block @ that buffer``."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  dtype = deq_bufs.dtype
  buf = lax.rem(step, 2)
  wv = w_block[...]
  if wv.dtype != jnp.int8 and dtype != jnp.float16:
    wv = wv.astype(jnp.float16)  # e4m3 -> bfloat16 has no single cvt on sm_90
  if FAST_INT8_F16 and wv.dtype == jnp.int8 and dtype == jnp.float16:
    deq_bufs[buf] = int8_to_f16(wv)
  else:
    deq_bufs[buf] = wv.astype(dtype)
  plgpu.commit_smem()
  plgpu.wgmma(acc_ref, x_block, deq_bufs.at[buf])
  # The last step's: its buffer is free for the next.
  wgmma_wait_delayed(step, steps, 1)


def _kernel_call(x, w, *, config: MosaicMatmulConfig, num_sms: int):
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  (m, k), n = x.shape, w.shape[1]
  dtype = x.dtype
  sk = config.split_k
  bm, bn = config.block_m, config.block_n
  wm, wn = wg_tile(bm, bn)
  split_m = bm >= 128
  deq_n = bn if split_m else wn  # the w columns one consumer needs
  tiles_m, tiles_n = pl.cdiv(m, bm), pl.cdiv(n, bn)
  steps = k_steps(k, sk)
  split_len = steps * BLOCK_K
  out_dtype = jnp.dtype(jnp.float32)
  out_transforms = (plgpu.TilingTransform((8, EPI_N)), plgpu.SwizzleTransform(128))
  epi_m, epi_n = min(64, wm), EPI_N
  num_slots = min(2, (wm * wn) // (epi_m * epi_n))
  x_transforms = x_block_transforms(dtype)

  def get_pipeline(body, compute_context):
    return operand_pipeline(body, compute_context, block_m=bm, block_n=bn, steps=steps,
                            num_stages=config.num_stages, dtype=dtype)

  def kernel(x_gmem, w_gmem, out_gmem):
    ignore = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(x_gmem, w_gmem),
        out_smem=plgpu.SMEM((2, num_slots, epi_m, epi_n), out_dtype,
                            transforms=out_transforms),
        deq_smem=plgpu.SMEM((2, 2, BLOCK_K, deq_n), dtype, transforms=x_transforms),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, out_smem, deq_smem):
      wg = lax.axis_index("wg")

      @plgpu.nd_loop((tiles_m * tiles_n * sk,), collective_axes="sm")
      def _tile_loop(info: plgpu.NDLoopInfo):
        (lin,) = info.index
        split, m_slice, n_slice, k_slice, wg_m, wg_n = work_tile(
            lin, wg, tiles=(tiles_m, tiles_n), config=config, split_len=split_len)
        out_ref = out_gmem.at[split] if sk > 1 else out_gmem

        def compute_context(eval_pipeline):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wm, wn), jnp.float32))
          def _acc_scope(acc_ref):
            eval_pipeline(acc_ref)
            plgpu.wgmma_wait(0)
            store_tile(acc_ref[...], out_smem, wg, out_ref.at[m_slice, n_slice].at[wg_m, wg_n],
                       epi=(epi_m, epi_n))

        def mma_body(idx, x_smem, w_smem, acc_ref):
          dequantized_mma(idx[0], steps, acc_ref, x_smem.at[wg_m], w_smem.at[:, wg_n],
                          deq_smem.at[wg])
          return acc_ref

        get_pipeline(mma_body, compute_context)(
            x_gmem.at[m_slice, k_slice],
            w_gmem.at[k_slice, n_slice],
            allocations=pipeline_allocs,
        )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return launch(kernel, (x, w), out_shape=(m, n), split_k=sk, out_dtype=out_dtype,
                work_tiles=tiles_m * tiles_n * sk, num_sms=num_sms)


def int8_to_f16(a):
  """int8 (or int4) -> float16 in registers, two values at a time. int8: the
  pair's bytes go under an exponent byte 0x64 (PRMT; 1024 + their unsigned
  value), the sign bits flip (XOR: 1024 + 128 + v) and one packed
  subtraction of 1152 leaves ``v``, exact. int4: the pair's nibbles go to
  the low bits of each half (PRMT of the byte and the byte shifted right by
  4), one LOP3 masks them, sets the exponent and flips their sign bits
  (1024 + 8 + v), and a packed subtraction of 1032 leaves ``v`` (Mosaic's
  int4 -> bfloat16, with float16's exponent). Mosaic's own conversions to
  float16 take one I2F a value (int4 first widened to int8). ``a`` in
  wgmma's 16-bit register layout (what a tiled load gives)."""
  import numpy as np
  import jax.experimental.pallas.mosaic_gpu as plgpu
  from jax._src.lib.mlir import ir
  from jax._src.lib.mlir.dialects import arith, llvm, vector
  from jax.experimental.mosaic import gpu as mgpu

  int4 = a.dtype == jnp.int4

  @plgpu.inline_mgpu(arg_types=(plgpu.Layout.WGMMA,),
                     return_type=plgpu.ShapeDtypeStruct(a.shape, jnp.float16,
                                                        layout=plgpu.Layout.WGMMA))
  def convert(ctx, arr):
    del ctx
    i32 = ir.IntegerType.get_signless(32)
    f16 = ir.F16Type.get()
    out = np.empty_like(arr.registers)
    for idx, reg in np.ndenumerate(arr.registers):
      (n,) = ir.VectorType(reg.type).shape
      if n % 2 or (int4 and n > 8):  # wgmma's 16-bit layout holds pairs
        raise NotImplementedError(f"int -> float16 pairs on a register of {n} values")
      words = []
      if int4:
        packed = ir.IntegerType.get_signless(4 * n)
        word = vector.extract(vector.bitcast(ir.VectorType.get((1,), packed), reg), [], [0])
        if 4 * n < 32:
          word = arith.extui(i32, word)
        high = arith.shrui(word, arith.constant(i32, 4))
        for j in range(n // 2):
          words.append(llvm.inline_asm(
              i32, [word, high],
              f"""{{
              .reg .b32 s<3>;
              prmt.b32 s0, $1, $2, {F16_INT4_PRMT + 0x101 * j:#x};
              lop3.b32 s1, s0, 0x000F000F, {F16_INT4_BIAS:#010x}, (0xf0 & 0xcc) ^ 0xaa;
              mov.b32 s2, {F16_INT4_BIAS:#010x};
              sub.f16x2 $0, s1, s2;
              }}""", "=r,r,r"))
      else:
        i16 = ir.IntegerType.get_signless(16)
        pairs = vector.bitcast(ir.VectorType.get((n // 2,), i16), reg)
        for j in range(n // 2):
          pair = arith.extui(i32, vector.extract(pairs, [], [j]))
          words.append(llvm.inline_asm(
              i32, [pair],
              f"""{{
              .reg .b32 s<3>;
              prmt.b32 s0, $1, {F16_PRMT[0]:#x}, {F16_PRMT[1]:#x};
              xor.b32 s1, s0, {F16_SIGN_FLIP:#010x};
              mov.b32 s2, {F16_BIAS:#010x};
              sub.f16x2 $0, s1, s2;
              }}""", "=r,r"))
      vec = vector.from_elements(ir.VectorType.get((n // 2,), i32), words)
      out[idx] = vector.bitcast(ir.VectorType.get((n,), f16), vec)
    return mgpu.FragmentedArray(_registers=out, _layout=arr.layout, _is_signed=None)

  return convert(a)
