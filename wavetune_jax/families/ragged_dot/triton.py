"""The Triton backend of the grouped-GEMM family (``pallas_kernels.ragged_dot.triton``)."""

from __future__ import annotations

import functools
import itertools

import jax.numpy as jnp

from pallas_kernels.ragged_dot.triton import MAX_ELEMENTS, TritonRaggedDotConfig
from pallas_kernels.ragged_dot.triton import ragged_dot as triton_ragged_dot
from wavetune_jax.core.hardware import Hardware
from wavetune_jax.families import _triton
from wavetune_jax.families.matmul.triton import _cdiv, _next_pow2
from wavetune_jax.families.ragged_dot.problem import RaggedDotProblem
from wavetune_jax.families.ragged_dot.routing import expected_tasks

__all__ = ["TritonRaggedDot", "TritonRaggedDotConfig"]

BLOCK_M = (16, 32, 64, 128)
BLOCK_N = (64, 128, 256)
BLOCK_K = (32, 64, 128)
NUM_WARPS = (4, 8)
NUM_STAGES = (2, 3, 4)
PRUNED_BLOCK_K = (64,)
PRUNED_NUM_STAGES = (3,)
ACC_PER_THREAD = (16, 128)

# The space (see TritonRaggedDot.space):
#  RT1 size:  block_m <= max(16, next_pow2(rows per expert)) under balanced
#             routing, block_n <= next_pow2(N), block_k <= next_pow2(K).
#  RT2 smem:  num_stages * (bm*bk + bk*bn) * itemsize <= shared memory per block.
#  RT3 regs:  16 <= fp32 accumulator elements per thread <= 128 (as the GEMM's R3).
#  RT4 pruned: block_k 64 and 3 stages (the GEMM's best on the H100 and H200
#             sweeps in most problems; this backend is the portable one).


class TritonRaggedDot(_triton.TritonBackend):
  """Pallas Triton grouped GEMM: the same work list as the Mosaic kernel,
  masked rows; runs on any CUDA GPU and in interpret mode on a CPU."""

  name = "triton"
  config_cls = TritonRaggedDotConfig
  macro_fields = ("block_m", "block_n", "block_k")
  micro_fields = ("num_warps", "num_stages")

  def smem_bytes(self, p: RaggedDotProblem, c: TritonRaggedDotConfig) -> int:
    return c.num_stages * (c.block_m * c.block_k + c.block_k * c.block_n) * p.itemsize

  @staticmethod
  def runs_shape(p: RaggedDotProblem) -> bool:
    """The kernel addresses operands with 32-bit offsets."""
    return max(p.m * p.k, p.g * p.k * p.n, p.m * p.n) <= MAX_ELEMENTS

  def space(self, p: RaggedDotProblem, hw: Hardware, *, prune: bool = True):
    if not self.runs_shape(p):
      return ()
    per = -(-p.m // min(p.g, p.m))
    return tuple(c for c in self._weight_candidates(p.n, p.k, p.dtype, hw, prune)
                 if not prune or c.block_m <= max(16, _next_pow2(per)))  # RT1 (M)

  @functools.lru_cache(maxsize=256)
  def _weight_candidates(self, n, k, dtype, hw: Hardware, prune: bool):
    p = RaggedDotProblem(m=1, g=1, k=k, n=n, dtype=dtype)
    out = []
    bks = PRUNED_BLOCK_K if prune else BLOCK_K
    stages = PRUNED_NUM_STAGES if prune else NUM_STAGES
    for bm, bn, bk, nw, ns in itertools.product(BLOCK_M, BLOCK_N, bks, NUM_WARPS, stages):
      if prune and (bn > max(64, _next_pow2(n)) or bk > max(32, _next_pow2(k))):
        continue  # RT1
      c = TritonRaggedDotConfig(block_m=bm, block_n=bn, block_k=bk, num_warps=nw,
                                num_stages=ns)
      if self.smem_bytes(p, c) > hw.smem_per_block:
        continue  # RT2
      acc = bm * bn // (32 * nw)
      if prune and not ACC_PER_THREAD[0] <= acc <= ACC_PER_THREAD[1]:
        continue  # RT3
      out.append(c)
    return tuple(out)

  def validate(self, p: RaggedDotProblem, config, hw: Hardware | None = None) -> None:
    if not isinstance(config, TritonRaggedDotConfig):
      raise ValueError(f"config must be a TritonRaggedDotConfig; got {config!r}")
    if not self.runs_shape(p):
      raise ValueError(f"the Triton grouped GEMM addresses operands with 32-bit offsets; "
                       f"{p.g}x{p.k}x{p.n} weights or {p.m} rows are too many (use a "
                       f"Mosaic or XLA config)")
    if hw is not None and self.smem_bytes(p, config) > hw.smem_per_block:
      raise ValueError(f"config {config} needs {self.smem_bytes(p, config)} bytes of shared "
                       f"memory; {hw.name} allows {hw.smem_per_block} per block")

  def size_quantum(self, p: RaggedDotProblem) -> int | None:
    return 1 if self.runs_shape(p) else None

  def occupancy_bound(self, p: RaggedDotProblem, config, hw: Hardware) -> int:
    return _triton.occupancy_bound(
        hw, smem_bytes=self.smem_bytes(p, config), threads=32 * config.num_warps,
        acc_per_thread=config.block_m * config.block_n // (32 * config.num_warps))

  def coords(self, p: RaggedDotProblem, macro: dict) -> tuple[int, int]:
    """``G`` = expected row tasks x column tiles, ``L`` = K steps."""
    tasks = int(expected_tasks(p.m, p.g, macro["block_m"]))
    return tasks * _cdiv(p.n, macro["block_n"]), _cdiv(p.k, macro["block_k"])

  def run(self, p: RaggedDotProblem, config, lhs, rhs, group_sizes, *,
          interpret: bool = False):
    return triton_ragged_dot(lhs, rhs, group_sizes, config=config,
                             out_dtype=jnp.dtype(p.out_dtype), interpret=interpret)
