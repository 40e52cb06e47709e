"""The backends of the weight-only quantized GEMM: XLA's dot on the converted
weight (the platform op) and the Mosaic GPU kernel
(``pallas_kernels.matmul.weight_only``)."""

from __future__ import annotations

import dataclasses
import itertools

import jax.numpy as jnp

from pallas_kernels.matmul import weight_only as kernel
from pallas_kernels.matmul.mosaic import BLOCK_K, MosaicMatmulConfig
from wavetune_jax.core.family import Backend
from wavetune_jax.core.hardware import Hardware
from wavetune_jax.families.qmatmul.problem import QMatmulProblem

__all__ = ["XlaQMatmul", "XlaQMatmulConfig", "MosaicQMatmul", "xla_qmatmul",
           "xla_dequantize_dot"]

#: The nominal tiling of the XLA backend's (G, L).
NOMINAL_M, NOMINAL_N = 64, 128
#: Rows up to which the Mosaic kernel runs (its 64-row tile; above, XLA's
#: GEMM was faster on every problem measured).
MOSAIC_MAX_M = 64
STAGES = (3, 4, 5)
SPLIT_K = (1, 2, 4, 8, 16, 32)


def xla_qmatmul(x, w, scales, out_dtype):
  """XLA's dot on the weight converted to the activations' dtype (exact for
  8-bit values), fp32 accumulation, the scales on the result: XLA fuses the
  conversion into its GEMM, reading the 8-bit weight."""
  acc = jnp.dot(x, w.astype(x.dtype), preferred_element_type=jnp.float32)
  return (acc * scales.astype(jnp.float32)).astype(out_dtype)


def xla_dequantize_dot(x, w, scales, out_dtype):
  """What a JAX user writes first: the weight dequantized to the
  activations' dtype, then ``jnp.dot`` (rounds the scaled weight to 16 bits)."""
  wd = (w.astype(jnp.float32) * scales.astype(jnp.float32)).astype(x.dtype)
  return jnp.dot(x, wd, preferred_element_type=jnp.float32).astype(out_dtype)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class XlaQMatmulConfig:
  """XLA's dot on the converted weight, scales after (:func:`xla_qmatmul`)."""


class XlaQMatmul(Backend):
  """XLA's GEMM on the converted 8-bit weight: the platform op."""

  name = "xla"
  config_cls = XlaQMatmulConfig
  macro_fields = ()
  micro_fields = ()
  interpret = True
  interpret_in_shard_map = True
  heuristic_size_free = True
  platform = True

  def space(self, problem, hw: Hardware, *, prune: bool = True):
    return (XlaQMatmulConfig(),)

  def validate(self, problem, config, hw: Hardware | None = None) -> None:
    if not isinstance(config, XlaQMatmulConfig):
      raise ValueError(f"config must be an XlaQMatmulConfig; got {config!r}")

  def heuristic(self, problem, hw: Hardware) -> XlaQMatmulConfig:
    return XlaQMatmulConfig()

  def occupancy_bound(self, problem, config, hw: Hardware) -> int:
    return 1

  def coords(self, problem: QMatmulProblem, macro: dict) -> tuple[int, float]:
    return (-(-problem.m // NOMINAL_M) * -(-problem.n // NOMINAL_N),
            float(-(-problem.k // BLOCK_K)))

  def run(self, problem: QMatmulProblem, config, x, w, scales, *, interpret: bool = False):
    return xla_qmatmul(x, w, scales, jnp.dtype(problem.out_dtype))


class MosaicQMatmul(Backend):
  """The Mosaic GPU weight-only GEMM (Hopper): up to 64 rows, 64 x 256
  tiles, K split to fill the SMs. No CPU interpret mode."""

  name = "mosaic"
  kernel_cache = True
  config_cls = MosaicMatmulConfig
  macro_fields = ("block_m", "block_n", "split_k")
  micro_fields = ("num_stages",)
  folded_fields = ("split_k",)
  interpret = False

  def supported_on(self, hw: Hardware) -> bool:
    return hw.compute_capability == "9.0"

  @staticmethod
  def why_not(p: QMatmulProblem, c: MosaicMatmulConfig | None = None) -> str | None:
    """Why the kernel cannot run ``p`` (with ``c``); None where it can."""
    if p.m > MOSAIC_MAX_M:
      return (f"the Mosaic weight-only GEMM runs up to {MOSAIC_MAX_M} rows; got M={p.m} "
              f"(use the XLA config)")
    c = c or MosaicMatmulConfig(block_m=64, block_n=256, num_stages=4)
    try:
      kernel.check_shapes(p.m, p.n, p.k, p.dtype, p.w_dtype, c)
    except ValueError as e:
      return str(e)
    if c.num_stages < 3:
      return f"config {c}: the weight-only GEMM needs num_stages >= 3"
    return None

  def smem_bytes(self, p: QMatmulProblem, c: MosaicMatmulConfig) -> int:
    return kernel.smem_bytes(block_m=c.block_m, block_n=c.block_n, num_stages=c.num_stages,
                             itemsize=p.itemsize)

  def space(self, problem: QMatmulProblem, hw: Hardware, *, prune: bool = True) -> tuple:
    """64 x 256 tiles, 3-5 stages, power-of-two K splits with at least four
    K steps each and (pruned) column tiles times splits within two waves."""
    p = problem
    if self.why_not(p):
      return ()
    tiles = -(-p.n // 256)
    out = []
    for st, sk in itertools.product(STAGES, SPLIT_K):
      if sk * 4 > p.k // BLOCK_K or (prune and sk > 1 and tiles * sk > 2 * hw.num_sms):
        continue
      c = MosaicMatmulConfig(block_m=64, block_n=256, num_stages=st, split_k=sk)
      if self.smem_bytes(p, c) <= hw.smem_per_block:
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
    """``pallas_kernels.matmul.weight_only.decode_config``: on an H100 it was
    the fastest of its neighbours (split halved and doubled, 3 and 5 stages)
    on 30 of 32 problems and within 0.9% on the others
    (``benchmarks/weight_only.py``)."""
    if self.why_not(problem):
      return None
    return kernel.decode_config(problem.m, problem.k, problem.n, hw.num_sms)

  def occupancy_bound(self, problem, config, hw: Hardware) -> int:
    return 1

  def coords(self, problem: QMatmulProblem, macro: dict) -> tuple[int, float]:
    sk = macro["split_k"]
    steps = -(-(problem.k // BLOCK_K) // sk)
    return (-(-problem.m // macro["block_m"]) * -(-problem.n // macro["block_n"]) * sk,
            float(steps))

  def run(self, problem: QMatmulProblem, config, x, w, scales, *, interpret: bool = False):
    if interpret:
      raise NotImplementedError("the Mosaic GPU weight-only GEMM has no CPU interpret mode; "
                                "benchmarks/weight_only.py checks it on a Hopper GPU")
    return kernel.weight_only_matmul(x, w, scales, config=config,
                                     out_dtype=jnp.dtype(problem.out_dtype))
