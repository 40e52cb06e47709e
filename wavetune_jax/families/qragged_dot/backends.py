"""The backends of the quantized grouped GEMM: XLA's ragged dot (the platform
op: on the converted weights for weight-only problems, on the e4m3 operands
for W8A8) and the Mosaic GPU kernels (``pallas_kernels.ragged_dot.fp8`` for
W8A8, ``pallas_kernels.ragged_dot.weight_only`` for 8-bit weights with 16-bit
activations)."""

from __future__ import annotations

import dataclasses
import itertools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._launch import SMEM_LIMIT
from pallas_kernels.matmul import fp8 as dense_fp8
from pallas_kernels.matmul.mosaic import k_steps as bf16_k_steps
from pallas_kernels.ragged_dot import fp8 as kernel
from pallas_kernels.ragged_dot import weight_only as wo_kernel
from pallas_kernels.ragged_dot.mosaic import MosaicRaggedDotConfig
from wavetune_jax.core import partition
from wavetune_jax.core.family import Backend, OneConfigBackend
from wavetune_jax.core.hardware import Hardware
from wavetune_jax.families.qragged_dot.problem import QRaggedDotProblem
from wavetune_jax.families.ragged_dot.routing import expected_tasks, expected_tasks_spread

__all__ = ["XlaQRaggedDot", "XlaQRaggedDotConfig", "MosaicQRaggedDot", "fp8_rule",
           "row_groups", "xla_qragged_dot", "dequantized_ragged_product"]

#: The nominal tiling of the XLA backend's (G, L).
NOMINAL_M, NOMINAL_N, NOMINAL_K = 64, 128, 64
STAGES = (3, 4, 5)
SPLIT_K = (1, 2, 4, 8)
ORDERS = (1, 0, 2)


def _dims(w_layout: str) -> lax.RaggedDotDimensionNumbers:
  return lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(([1], [1 if w_layout == "kn" else 2]), ([], [])),
      lhs_ragged_dimensions=[0], rhs_group_dimensions=[0])


def row_groups(group_sizes, m: int):
  """``[m]`` int32: each row's group, ``G`` for the rows past the groups
  (``group_sizes`` clipped: in ``[0, m]``, summing to at most ``m``)."""
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  return jnp.searchsorted(ends, jnp.arange(m, dtype=jnp.int32), side="right",
                          method="compare_all").astype(jnp.int32)


def _scaled(acc, scales, group_sizes, x_scales, out_dtype):
  """``acc [M, N]`` times each row's expert's channel scales (and the rows'
  scales), zeros past the groups."""
  g = scales.shape[0]
  gid = row_groups(group_sizes, acc.shape[0])
  y = acc * scales.astype(jnp.float32)[jnp.minimum(gid, g - 1)]
  if x_scales is not None:
    y = y * x_scales.astype(jnp.float32)[:, None]
  return jnp.where((gid < g)[:, None], y, 0.0).astype(out_dtype)


def xla_qragged_dot(x, w, scales, group_sizes, out_dtype, *, x_scales=None,
                    w_layout: str = "kn", out_sharding=None):
  """What a JAX user writes: XLA's ragged dot with fp32 accumulation, then the
  scales of each row's expert. Weight-only: the weights converted to the
  activations' dtype (exact for 8-bit values). W8A8: ``lax.ragged_dot_general``
  on the e4m3 operands with ``preferred_element_type=float32``, then the
  rows' scales too. Rows past the groups are zeros."""
  if x_scales is None:
    w = w.astype(x.dtype)
  acc = lax.ragged_dot_general(x, w, group_sizes, _dims(w_layout),
                               preferred_element_type=jnp.float32, out_sharding=out_sharding)
  return _scaled(acc, scales, group_sizes, x_scales, out_dtype)


def dequantized_ragged_product(x, w, scales, group_sizes, x_scales=None,
                               w_layout: str = "kn"):
  """The float32 grouped product of the dequantized operands at highest
  precision: the reference every backend is checked against. Where the
  whole dequantized weight would take more than
  :data:`~pallas_kernels.ragged_dot.reference.LOOP_ABOVE_BYTES` in float32
  (Arctic's 128 experts of 9,728 x 7,168: 36 GB), it is dequantized one
  expert at a time inside the product."""
  from pallas_kernels.ragged_dot import reference
  x32 = x.astype(jnp.float32)
  if x_scales is not None:
    x32 = x32 * x_scales.astype(jnp.float32)[:, None]
  s = scales.astype(jnp.float32)

  def dequantize(w, s):  # one expert's [K, N] or [N, K] weight -> [K, N] float32
    w32 = w.astype(jnp.float32)
    return w32 * s[None, :] if w_layout == "kn" else (w32 * s[:, None]).T

  g, n = s.shape
  if g * w.shape[1] * w.shape[2] * 4 > reference.LOOP_ABOVE_BYTES:
    pick = lambda a, e: jax.lax.dynamic_index_in_dim(a, e, 0, keepdims=False)  # noqa: E731
    return reference.ragged_dot_reference_by_expert(
        x32, lambda e: dequantize(pick(w, e), pick(s, e)), g, n, group_sizes, jnp.float32)
  return reference.ragged_dot_reference(x32, jax.vmap(dequantize)(w, s), group_sizes,
                                        jnp.float32)


#: :func:`fp8_rule` walks an expert's tasks together (order 2) only where a
#: balanced router gives more than this many 128-row tasks an active expert
#: (:func:`expected_tasks_spread`): with one task an expert there is no weight
#: tile to share, and column tiles first ran faster on every pair measured.
ONE_TASK_SPILL = 1.1


def fp8_rule(m: int, g: int, n: int, k: int, num_sms: int, smem_per_block: int = SMEM_LIMIT,
             out_dtype: str = "bfloat16") -> MosaicRaggedDotConfig | None:
  """The FP8 kernel's launch rule. ``r`` = rows per expert under balanced
  routing.

  - From 64: 128 x 256 tiles, 3 stages (the most that fit), walked expert by
    expert where the work takes more than a wave and the experts take
    several 128-row tasks (``grid_minor`` 2: an expert's tasks read each
    weight tile together; more than :data:`ONE_TASK_SPILL` tasks an active
    expert on average, from about 110 rows at 64 experts), column tiles
    first otherwise.
  - Below 64: 64 x 256 tiles, column tiles first, 4 stages, with the K split
    that fills a wave of the expected work (at least four K steps a split).

  Where a tile's ring and output slots (float32 output takes twice
  bfloat16's) pass ``smem_per_block``, fewer stages, then 128 columns; None
  if nothing fits.

  On an H100 (``benchmarks/fp8_ragged_dot.py``, Mixtral-8x7B's experts at
  1-4,096 tokens): at 64 rows per expert 128 x 256 ran 1.39x / 1.09x faster
  than 64 x 256 (w13 / w2); at 1,024 and 4,096 tokens (256 and 1,024 rows
  per expert) order 2 ran 1.08-1.77x faster than column tiles first; at 1
  and 16 tokens 64-row tiles were the fastest or within 1.3% of it. At 64
  and 96 rows per expert, one task an expert, column tiles first ran
  1.008-1.063x order 2 on all 19 pairs recorded (H100 and H200, ring and
  pipeline; ``tests/test_fp8_ragged_dot.py``,
  ``test_rule_orders_one_task_an_expert_by_column``)."""
  r = m / min(g, m)
  if r >= 64:
    work = int(expected_tasks(m, g, 128)) * -(-n // 256)
    several = expected_tasks_spread(m, g, 128) > ONE_TASK_SPILL * min(g, m)
    order = 2 if r > 64 and work > num_sms and several else 1
    tiles = [(128, 256, 3), (128, 128, 4), (128, 128, 3)]
    cands = [MosaicRaggedDotConfig(block_m=bm, block_n=bn, num_stages=st, grid_minor=order)
             for bm, bn, st in tiles]
  else:
    work = int(expected_tasks(m, g, 64)) * -(-n // 256)
    sk = 1
    while work * sk * 2 <= num_sms and dense_fp8.k_steps(k, sk * 2) >= 4 and sk < 8:
      sk *= 2
    cands = [MosaicRaggedDotConfig(block_m=64, block_n=bn, num_stages=st, split_k=sk)
             for bn, st in ((256, 4), (256, 3), (128, 4), (128, 3))]
  return next((c for c in cands if _smem(c, out_dtype) <= smem_per_block), None)


def _wo_smem(c: MosaicRaggedDotConfig, dtype: str, out_dtype: str) -> int:
  out = 4 if c.split_k > 1 else jnp.dtype(out_dtype).itemsize
  return wo_kernel.smem_bytes(block_m=c.block_m, block_n=c.block_n, num_stages=c.num_stages,
                              itemsize=jnp.dtype(dtype).itemsize, out_itemsize=out)


def _smem(c: MosaicRaggedDotConfig, out_dtype: str) -> int:
  out = 4 if c.split_k > 1 else jnp.dtype(out_dtype).itemsize
  return kernel.smem_bytes(block_m=c.block_m, block_n=c.block_n, num_stages=c.num_stages,
                           out_itemsize=out)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class XlaQRaggedDotConfig:
  """XLA's ragged dot, scales after (:func:`xla_qragged_dot`)."""


class XlaQRaggedDot(OneConfigBackend):
  """XLA's ragged dot on the 8-bit operands: the platform op."""

  name = "xla"
  config_cls = XlaQRaggedDotConfig

  def coords(self, p: QRaggedDotProblem, macro: dict) -> tuple[int, float]:
    return (-(-p.m // NOMINAL_M) * -(-p.n // NOMINAL_N), float(-(-p.k // NOMINAL_K) * p.g))

  def run(self, p: QRaggedDotProblem, config, x, w, scales, group_sizes, x_scales=None, *,
          interpret: bool = False):
    if partition.explicit_mesh((x, w, scales, group_sizes, x_scales)):
      # (ops.ragged_dot's XLA backend: JAX's ragged dot has no rule there.)
      (x, group_sizes, x_scales), w, out = partition.gathered_for_ragged_dot(
          (x, group_sizes, x_scales), w, n_dim=2 if p.w_layout == "kn" else 1,
          others=(scales,))
      scales = jax.sharding.reshard(scales, jax.sharding.NamedSharding(
          out.mesh, jax.sharding.PartitionSpec(None, out.spec[1])))
      return xla_qragged_dot(x, w, scales, group_sizes, jnp.dtype(p.out_dtype),
                             x_scales=x_scales, w_layout=p.w_layout, out_sharding=out)
    return xla_qragged_dot(x, w, scales, group_sizes, jnp.dtype(p.out_dtype),
                           x_scales=x_scales, w_layout=p.w_layout)


class MosaicQRaggedDot(Backend):
  """The Mosaic GPU quantized grouped GEMMs (Hopper): W8A8-FP8 with the
  weights ``[G, N, K]`` (FP8 wgmma), and weight-only with the weights ``[G,
  K, N]`` (each 8-bit block converted in registers before a 16-bit wgmma);
  both the bf16 grouped GEMM's run-time work list with the scales in the
  epilogue. No CPU interpret mode."""

  name = "mosaic"
  kernel_cache = True
  config_cls = MosaicRaggedDotConfig
  macro_fields = ("block_m", "block_n", "split_k")
  micro_fields = ("num_stages", "grid_minor")
  folded_fields = ("split_k",)
  interpret = False

  def supported_on(self, hw: Hardware) -> bool:
    return hw.compute_capability == "9.0"

  @staticmethod
  def why_not(p: QRaggedDotProblem, c: MosaicRaggedDotConfig | None = None) -> str | None:
    """Why the kernel cannot run ``p`` (with ``c``); None where it can."""
    if not p.w8a8:
      if p.w_layout != "kn":
        return ("the Mosaic weight-only grouped GEMM reads the weights as [G, K, N] "
                "(w_layout='kn'; or use the XLA config)")
      try:
        wo_kernel.check_shapes(p.m, p.n, p.k, p.dtype, p.w_dtype, c or MosaicRaggedDotConfig(
            block_m=64, block_n=256, num_stages=4))
      except ValueError as e:
        return str(e)
      return None
    if p.w_layout != "nk":
      return ("the Mosaic FP8 grouped GEMM reads the weights as [G, N, K] (FP8 tensor cores "
              "take 8-bit operands K-major); pass them with w_layout='nk' (or use the XLA "
              "config)")
    try:
      kernel.check_shapes(p.m, p.n, p.k, c or MosaicRaggedDotConfig(
          block_m=64, block_n=128, num_stages=4))
    except ValueError as e:
      return str(e)
    return None

  def smem_bytes(self, p: QRaggedDotProblem, c: MosaicRaggedDotConfig) -> int:
    if not p.w8a8:
      return _wo_smem(c, p.dtype, p.out_dtype)
    return _smem(c, p.out_dtype)

  def space(self, p: QRaggedDotProblem, hw: Hardware, *, prune: bool = True) -> tuple:
    """The kernel's tiles (:data:`~pallas_kernels.ragged_dot.fp8.TILES` for
    W8A8, :data:`~pallas_kernels.ragged_dot.weight_only.TILES` for
    weight-only), 3-5 stages, K splits
    (at least four K steps each) only where the expected work fills less
    than a wave and (pruned) at most two with the splits, and the
    weight-only rule's own split past one wave; both orders and
    order 2 (by expert) only where the work takes more than a wave, order 2
    above 64 rows per expert."""
    if self.why_not(p):
      return ()
    out = []
    per = p.m / min(p.g, p.m)
    tiles = kernel.TILES if p.w8a8 else wo_kernel.TILES
    for (bm, bn), st, sk, gm in itertools.product(tiles, STAGES, SPLIT_K, ORDERS):
      work = int(expected_tasks(p.m, p.g, bm)) * -(-p.n // bn)
      if sk > 1 and (gm != 1 or work >= hw.num_sms or self._k_steps(p, sk) < 4
                     or (prune and work * sk > 2 * hw.num_sms)):
        continue
      if gm != 1 and (work <= hw.num_sms or (gm == 2 and per <= 64)):
        continue
      if prune and bm > 64 and per <= 32:
        continue  # taller tasks than an expert's rows load other experts' rows
      c = MosaicRaggedDotConfig(block_m=bm, block_n=bn, num_stages=st, split_k=sk,
                                grid_minor=gm)
      if not self.why_not(p, c) and self.smem_bytes(p, c) <= hw.smem_per_block:
        out.append(c)
    if not p.w8a8:  # the weight-only rule's K split past one wave
      c = self._weight_only_rule(p, hw)
      if (c not in out and not self.why_not(p, c)
          and self.smem_bytes(p, c) <= hw.smem_per_block):
        out.append(c)
    return tuple(out)

  def validate(self, p: QRaggedDotProblem, config, hw: Hardware | None = None) -> None:
    if not isinstance(config, MosaicRaggedDotConfig):
      raise ValueError(f"config must be a MosaicRaggedDotConfig; got {config!r}")
    why = self.why_not(p, config)
    if why:
      raise ValueError(why)
    if hw is not None and self.smem_bytes(p, config) > hw.smem_per_block:
      raise ValueError(f"config {config} needs {self.smem_bytes(p, config)} bytes of shared "
                       f"memory; {hw.name} allows {hw.smem_per_block} per block")

  def heuristic(self, p: QRaggedDotProblem, hw: Hardware) -> MosaicRaggedDotConfig | None:
    """:func:`fp8_rule` (``benchmarks/fp8_ragged_dot.py``) for W8A8; for
    weight-only problems the kernel's ``decode_config`` up to 64 rows per
    expert (its K split past one wave on the GPUs of
    ``SPLIT_PAST_WAVE_GPUS``) and ``prefill_config`` above (64 x 256 tiles
    both; ``benchmarks/weight_only_ragged_dot.py``)."""
    if self.why_not(p):
      return None
    if p.w8a8:
      c = fp8_rule(p.m, p.g, p.n, p.k, hw.num_sms, hw.smem_per_block, p.out_dtype)
    else:
      c = self._weight_only_rule(p, hw)
      if self.smem_bytes(p, c) > hw.smem_per_block:
        c = None
    return None if c is None or self.why_not(p, c) else c

  @staticmethod
  def _weight_only_rule(p: QRaggedDotProblem, hw: Hardware) -> MosaicRaggedDotConfig:
    """``decode_config`` (a K split past one wave on the GPUs of
    ``SPLIT_PAST_WAVE_GPUS``), else ``prefill_config``."""
    return (wo_kernel.decode_config(
        p.m, p.g, p.n, p.k, hw.num_sms,
        past_one_wave=hw.device_key in wo_kernel.SPLIT_PAST_WAVE_GPUS)
            or wo_kernel.prefill_config(p.m, p.g, p.n, p.k, hw.num_sms))

  @staticmethod
  def _k_steps(p: QRaggedDotProblem, split_k: int) -> int:
    """K steps of a split: 128 per FP8 step, 64 per weight-only step."""
    return dense_fp8.k_steps(p.k, split_k) if p.w8a8 else bf16_k_steps(p.k, split_k)

  def occupancy_bound(self, problem, config, hw: Hardware) -> int:
    return 1  # one persistent CTA per SM

  def coords(self, p: QRaggedDotProblem, macro: dict) -> tuple[int, float]:
    """``G`` = expected row tasks x column tiles x splits, ``L`` = K steps of a split."""
    tasks = int(expected_tasks(p.m, p.g, macro["block_m"]))
    return (tasks * -(-p.n // macro["block_n"]) * macro["split_k"],
            float(self._k_steps(p, macro["split_k"])))

  def run(self, p: QRaggedDotProblem, config, x, w, scales, group_sizes, x_scales=None, *,
          interpret: bool = False):
    if interpret:
      raise NotImplementedError(kernel.NO_INTERPRET if p.w8a8 else wo_kernel.NO_INTERPRET)
    if not p.w8a8:
      return wo_kernel.weight_only_ragged_dot(x, w, scales, group_sizes, config=config,
                                              out_dtype=jnp.dtype(p.out_dtype))
    return kernel.fp8_ragged_dot(x, w, x_scales, scales, group_sizes, config=config,
                                 out_dtype=jnp.dtype(p.out_dtype))
