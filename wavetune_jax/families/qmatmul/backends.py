"""The backends of the quantized GEMM: XLA's dot (the platform op: on the
converted weight for weight-only problems, on the e4m3 operands for W8A8)
and the Mosaic GPU kernels (``pallas_kernels.matmul.weight_only``,
``pallas_kernels.matmul.weight_only_nk`` and ``pallas_kernels.matmul.fp8``)."""

from __future__ import annotations

import dataclasses
import itertools

import jax.numpy as jnp
from jax import lax

from pallas_kernels.matmul import fp8 as fp8_kernel
from pallas_kernels.matmul import weight_only as kernel
from pallas_kernels.matmul import weight_only_nk as nk_kernel
from pallas_kernels.matmul.mosaic import BLOCK_K, MosaicMatmulConfig
from wavetune_jax.core.family import Backend, OneConfigBackend
from wavetune_jax.core.hardware import Hardware
from wavetune_jax.families.qmatmul.problem import QMatmulProblem

__all__ = ["XlaQMatmul", "XlaQMatmulConfig", "MosaicQMatmul", "xla_qmatmul",
           "xla_dequantize_dot", "dequantized_product", "dequantize_int4"]

#: The nominal tiling of the XLA backend's (G, L).
NOMINAL_M, NOMINAL_N = 64, 128
#: Rows up to which the Mosaic kernel runs (its 64-row tile; above, XLA's
#: GEMM was faster on every problem measured).
MOSAIC_MAX_M = 64
STAGES = (3, 4, 5)
SPLIT_K = (1, 2, 4, 8, 16, 32)
#: Rows up to which the W4A16 backend runs the int4 kernel, in chunks of
#: its 64 rows (each chunk reads the whole weight).
INT4_MAX_M = 128
#: Stages of the weight-only ``[N, K]`` space.
NK_STAGES = (3, 4, 6)
#: CTA tiles of the W8A8 space.
FP8_TILES = ((64, 128), (64, 256), (128, 128), (128, 192), (128, 256), (256, 128))


def _dims(w_layout: str):
  return (((1,), (0 if w_layout == "kn" else 1,)), ((), ()))


def dequantize_int4(w, scales, dtype=jnp.float32):
  """An int4 ``w [N, K]`` with ``scales [K // group, N]`` -> the ``[N, K]``
  weight in ``dtype`` (each value times its group's scale, in float32)."""
  n, k = w.shape
  g = k // scales.shape[0]
  w32 = w.astype(jnp.float32).reshape(n, k // g, g) * scales.astype(jnp.float32).T[:, :, None]
  return w32.reshape(n, k).astype(dtype)


def xla_qmatmul(x, w, scales, out_dtype, *, x_scales=None, w_layout: str = "kn"):
  """What a JAX user writes, XLA's dot with fp32 accumulation and the scales
  on the result. Weight-only: the weight converted to the activations'
  dtype (exact for 8-bit values; XLA fuses the conversion into its GEMM,
  reading the 8-bit weight). W8A8: ``lax.dot_general`` on the e4m3
  operands with ``preferred_element_type=float32`` (XLA's FP8 GEMM), then
  the rows' and the channels' scales. W4A16 (an int4 ``w [N, K]``, scales
  ``[K // group, N]``): the weight dequantized to the activations' dtype,
  then the dot (the scales vary along K, so they cannot wait for the
  result)."""
  if w.dtype == jnp.int4:
    acc = lax.dot_general(x, dequantize_int4(w, scales, x.dtype), _dims(w_layout),
                          preferred_element_type=jnp.float32)
    return acc.astype(out_dtype)
  if x_scales is None:
    acc = lax.dot_general(x, w.astype(x.dtype), _dims(w_layout),
                          preferred_element_type=jnp.float32)
    return (acc * scales.astype(jnp.float32)).astype(out_dtype)
  acc = lax.dot_general(x, w, _dims(w_layout), preferred_element_type=jnp.float32)
  return (acc * x_scales.astype(jnp.float32)[:, None]
          * scales.astype(jnp.float32)[None, :]).astype(out_dtype)


def dequantized_product(x, w, scales, x_scales=None, w_layout: str = "kn"):
  """The float32 product of the dequantized operands at highest precision:
  the reference every backend is checked against."""
  x32 = x.astype(jnp.float32)
  if x_scales is not None:
    x32 = x32 * x_scales.astype(jnp.float32)[:, None]
  if w.dtype == jnp.int4:
    w32 = dequantize_int4(w, scales)
  else:
    w32 = w.astype(jnp.float32)
    w32 = w32 * scales.astype(jnp.float32) if w_layout == "kn" else (
        w32 * scales.astype(jnp.float32)[:, None])
  return lax.dot_general(x32, w32, _dims(w_layout), precision=lax.Precision.HIGHEST)


def xla_dequantize_dot(x, w, scales, out_dtype):
  """What a JAX user writes first: the weight dequantized to the
  activations' dtype, then ``jnp.dot`` (rounds the scaled weight to 16 bits)."""
  wd = (w.astype(jnp.float32) * scales.astype(jnp.float32)).astype(x.dtype)
  return jnp.dot(x, wd, preferred_element_type=jnp.float32).astype(out_dtype)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class XlaQMatmulConfig:
  """XLA's dot on the converted weight, scales after (:func:`xla_qmatmul`)."""


class XlaQMatmul(OneConfigBackend):
  """XLA's GEMM on the converted 8-bit weight: the platform op."""

  name = "xla"
  config_cls = XlaQMatmulConfig

  def coords(self, problem: QMatmulProblem, macro: dict) -> tuple[int, float]:
    return (-(-problem.m // NOMINAL_M) * -(-problem.n // NOMINAL_N),
            float(-(-problem.k // BLOCK_K)))

  def run(self, problem: QMatmulProblem, config, x, w, scales, x_scales=None, *,
          interpret: bool = False):
    return xla_qmatmul(x, w, scales, jnp.dtype(problem.out_dtype), x_scales=x_scales,
                       w_layout=problem.w_layout)


class MosaicQMatmul(Backend):
  """The Mosaic GPU kernels (Hopper). Weight-only, up to 64 rows (int4: 128): with ``w
  [K, N]`` 64 x 256 tiles, K split to fill the SMs; with ``w [N, K]``
  (``w_layout="nk"``) the swapped kernel, 128 or 256 channels a CTA, the
  8-bit block converted in registers and fed to wgmma from there.
  W8A8-FP8: FP8 wgmma on ``x [M, K]`` and ``w [N, K]`` (``w_layout="nk"``),
  the scales in the epilogue. W4A16 (int4 ``[N, K]``, a scale per group of
  64 or 128 values of K): the swapped kernel, each int4 sub-block converted
  and scaled by its group's scales in registers. No CPU interpret mode."""

  name = "mosaic"
  kernel_cache = True
  config_cls = MosaicMatmulConfig
  macro_fields = ("block_m", "block_n", "split_k")
  micro_fields = ("num_stages", "grid_minor", "grid_width")
  folded_fields = ("split_k",)
  interpret = False

  def supported_on(self, hw: Hardware) -> bool:
    return hw.compute_capability == "9.0"

  @staticmethod
  def why_not(p: QMatmulProblem, c: MosaicMatmulConfig | None = None) -> str | None:
    """Why the kernel cannot run ``p`` (with ``c``); None where it can."""
    def refusal(check, default: MosaicMatmulConfig, *extra, m: int = p.m) -> str | None:
      try:
        check(m, p.n, p.k, p.dtype, p.w_dtype, c or default, *extra)
      except ValueError as e:
        return str(e)
      return None

    if p.w8a8:
      if p.w_layout != "nk":
        return ("the Mosaic FP8 GEMM reads the weight as [N, K] (FP8 tensor cores take "
                "8-bit operands K-major); pass it with w_layout='nk' (or use the XLA config)")
      return refusal(fp8_kernel.check_shapes,
                     MosaicMatmulConfig(block_m=64, block_n=128, num_stages=4))
    nk_default = MosaicMatmulConfig(block_m=64, block_n=128, num_stages=3)
    if p.group_size and p.m > nk_kernel.MAX_M:
      if p.m > INT4_MAX_M:
        return (f"the Mosaic int4 GEMM runs up to {INT4_MAX_M} rows; got M={p.m} (use the "
                f"XLA config)")
      # Chunks of 64 rows, the last one the rest.
      why = refusal(nk_kernel.check_shapes, nk_default, p.group_size, m=nk_kernel.MAX_M)
      last = refusal(nk_kernel.check_shapes, nk_default, p.group_size, m=p.m - nk_kernel.MAX_M)
      return why or (last and f"the Mosaic int4 GEMM runs M={p.m} as chunks of "
                              f"{nk_kernel.MAX_M} rows, the last of {p.m - nk_kernel.MAX_M}: "
                              f"{last}")
    if p.w_layout == "nk":
      return refusal(nk_kernel.check_shapes, nk_default, p.group_size)
    if p.m > MOSAIC_MAX_M:
      return (f"the Mosaic weight-only GEMM runs up to {MOSAIC_MAX_M} rows; got M={p.m} "
              f"(use the XLA config)")
    c = c or MosaicMatmulConfig(block_m=64, block_n=256, num_stages=4)
    why = refusal(kernel.check_shapes, c)
    if why is None and c.num_stages < 3:
      return f"config {c}: the weight-only GEMM needs num_stages >= 3"
    return why

  def smem_bytes(self, p: QMatmulProblem, c: MosaicMatmulConfig) -> int:
    if p.w8a8:
      out = 4 if c.split_k > 1 else jnp.dtype(p.out_dtype).itemsize
      return fp8_kernel.smem_bytes(block_m=c.block_m, block_n=c.block_n,
                                   num_stages=c.num_stages, out_itemsize=out)
    if p.w_layout == "nk":
      return nk_kernel.smem_bytes(m=min(p.m, nk_kernel.MAX_M), block_n=c.block_n,
                                  num_stages=c.num_stages, itemsize=p.itemsize,
                                  group=p.group_size)
    return kernel.smem_bytes(block_m=c.block_m, block_n=c.block_n, num_stages=c.num_stages,
                             itemsize=p.itemsize)

  def space(self, problem: QMatmulProblem, hw: Hardware, *, prune: bool = True) -> tuple:
    """Weight-only ``[K, N]``: 64 x 256 tiles, 3-5 stages, power-of-two K
    splits with at least four K steps each and (pruned) column tiles times
    splits within two waves. Weight-only ``[N, K]``: 128- and 256-channel
    tiles, 3 / 4 / 6 stages, the same splits. W8A8: :data:`FP8_TILES`, 3-5 stages, K splits where the
    output has less than a wave of tiles, the tile order's band 1 or 8
    where it has more than a wave."""
    p = problem
    if self.why_not(p):
      return ()
    if p.w8a8:
      return self._fp8_space(p, hw, prune)
    if p.w_layout == "nk":
      return self._nk_space(p, hw, prune)
    tiles = -(-p.n // 256)
    out = []
    for st, sk in itertools.product(STAGES, SPLIT_K):
      if sk * 4 > p.k // BLOCK_K or (prune and sk > 1 and tiles * sk > 2 * hw.num_sms):
        continue
      c = MosaicMatmulConfig(block_m=64, block_n=256, num_stages=st, split_k=sk)
      if self.smem_bytes(p, c) <= hw.smem_per_block:
        out.append(c)
    return tuple(out)

  def _nk_space(self, p: QMatmulProblem, hw: Hardware, prune: bool) -> tuple:
    out = []
    for bn, st, sk in itertools.product(nk_kernel.BLOCK_N, NK_STAGES, SPLIT_K):
      tiles = -(-p.n // bn)
      if sk * 4 > p.k // BLOCK_K or (prune and sk > 1 and tiles * sk > 2 * hw.num_sms):
        continue
      c = MosaicMatmulConfig(block_m=64, block_n=bn, num_stages=st, split_k=sk)
      if not self.why_not(p, c) and self.smem_bytes(p, c) <= hw.smem_per_block:
        out.append(c)
    return tuple(out)

  def _fp8_space(self, p: QMatmulProblem, hw: Hardware, prune: bool) -> tuple:
    out = []
    for (bm, bn), st, sk in itertools.product(FP8_TILES, STAGES, SPLIT_K):
      tiles = -(-p.m // bm) * -(-p.n // bn)
      if fp8_kernel.k_steps(p.k, sk) < 4 and sk > 1:
        continue
      if prune and sk > 1 and (tiles >= hw.num_sms or tiles * sk > 2 * hw.num_sms):
        continue
      orders = ((1, 1),) if tiles <= hw.num_sms else ((1, 1), (1, 8), (0, 8))
      for minor, width in orders:
        c = MosaicMatmulConfig(block_m=bm, block_n=bn, num_stages=st, split_k=sk,
                               grid_minor=minor, grid_width=width)
        if not self.why_not(p, c) and self.smem_bytes(p, c) <= hw.smem_per_block:
          out.append(c)
    return tuple(out)

  def validate(self, problem: QMatmulProblem, config, hw: Hardware | None = None) -> None:
    if not isinstance(config, MosaicMatmulConfig):
      raise ValueError(f"config must be a MosaicMatmulConfig; got {config!r}")
    why = self.why_not(problem, config)
    if why:
      raise ValueError(why)
    if hw is not None and self.smem_bytes(problem, config) > hw.smem_per_block:
      raise ValueError(f"config {config} needs {self.smem_bytes(problem, config)} bytes of "
                       f"shared memory; {hw.name} allows {hw.smem_per_block} per block")

  def heuristic(self, problem: QMatmulProblem, hw: Hardware) -> MosaicMatmulConfig | None:
    """Weight-only: ``pallas_kernels.matmul.weight_only.decode_config``; on
    an H100 it was the fastest of its neighbours (split halved and doubled,
    3 and 5 stages) on 30 of 32 problems and within 0.9% on the others
    (``benchmarks/weight_only.py``; its splits then powers of two, any count
    since: 1.267x geomean over them on 16 problems of an H200,
    ``--layout kn --compare-splits``). Weight-only ``[N, K]``:
    ``pallas_kernels.matmul.weight_only_nk.decode_config``, within 3.3% of
    the fastest of up to 9 configs on 29 of 30 problems on an H100 and 8% on
    the last (``benchmarks/weight_only.py --layout nk``), with a 256-channel
    step's cost by GPU (``weight_only_nk.WIDE_STEP``: on an H200 the fastest
    of every channel tile and split up to 8 on all 12 problems at 1 and 16
    rows, six weights, ``--grid``; on an H200 every split count, not only
    powers of two: 1.145x geomean on 44 held-out problems of 8-bit weights
    and 1.250x on 16 of int4, ``--compare-splits``); on int4, its
    256-steps and the most stages up to 4 that fit shared memory (the
    config of 64 rows above them), within 6% of the fastest of its
    neighbours on all 23 problems measured on an H100
    (``benchmarks/weight_only.py --weights int4``). W8A8: ``pallas_kernels.matmul.fp8.
    heuristic_config`` (``benchmarks/fp8_gemm.py``)."""
    p = problem
    if self.why_not(p):
      return None
    if p.w8a8:
      c = fp8_kernel.heuristic_config(p.m, p.n, p.k, hw.num_sms,
                                      fp8_kernel.HBM_TBS.get(hw.device_key),
                                      out_itemsize=jnp.dtype(p.out_dtype).itemsize,
                                      tiles=fp8_kernel.rule_tiles(hw.device_key))
      return None if self.why_not(p, c) else c
    if p.w_layout == "nk":
      c = nk_kernel.decode_config(min(p.m, nk_kernel.MAX_M), p.k, p.n, hw.num_sms,
                                  group=p.group_size,
                                  smem_limit=hw.smem_per_block,
                                  wide_step=nk_kernel.WIDE_STEP.get(hw.device_key),
                                  any_split=hw.device_key in nk_kernel.ANY_SPLIT_GPUS)
      return None if c is None or self.why_not(p, c) else c
    return kernel.decode_config(p.m, p.k, p.n, hw.num_sms)

  def occupancy_bound(self, problem, config, hw: Hardware) -> int:
    return 1

  def coords(self, problem: QMatmulProblem, macro: dict) -> tuple[int, float]:
    sk = macro["split_k"]
    block_k = (fp8_kernel.BLOCK_K if problem.w8a8 else nk_kernel.INT4_STEP_K
               if problem.group_size else nk_kernel.STEP_K if problem.w_layout == "nk"
               else BLOCK_K)
    steps = -(-(problem.k // block_k) // sk)
    return (-(-problem.m // macro["block_m"]) * -(-problem.n // macro["block_n"]) * sk,
            float(steps))

  def run(self, problem: QMatmulProblem, config, x, w, scales, x_scales=None, *,
          interpret: bool = False):
    if interpret:
      raise NotImplementedError("the Mosaic GPU quantized GEMMs have no CPU interpret mode; "
                                "benchmarks/weight_only.py and benchmarks/fp8_gemm.py "
                                "check them on a Hopper GPU")
    out = jnp.dtype(problem.out_dtype)
    if problem.w8a8:
      return fp8_kernel.fp8_matmul(x, w, x_scales, scales, config=config, out_dtype=out)
    if problem.w_layout == "nk":
      chunk = nk_kernel.MAX_M  # int4 above 64 rows: chunks of 64
      return jnp.concatenate([
          nk_kernel.weight_only_matmul_nk(x[i:i + chunk], w, scales, config=config,
                                          out_dtype=out)
          for i in range(0, problem.m, chunk)]) if problem.m > chunk else (
              nk_kernel.weight_only_matmul_nk(x, w, scales, config=config, out_dtype=out))
    return kernel.weight_only_matmul(x, w, scales, config=config, out_dtype=out)
