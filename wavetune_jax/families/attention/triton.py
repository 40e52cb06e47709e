"""The Triton backend of the attention family (``pallas_kernels.attention.triton``)."""

from __future__ import annotations

import dataclasses
import functools
import itertools

from pallas_kernels.attention.triton import TritonAttentionConfig
from pallas_kernels.attention.triton import attention as triton_attention
from wavetune_jax.core.hardware import Hardware
from wavetune_jax.families import _triton
from wavetune_jax.families.attention.problem import AttentionProblem, coords, next_pow2

__all__ = ["TritonAttention", "TritonAttentionConfig"]

# Candidate values. All blocks are powers of two >= 32 (16-row tiles are never
# faster on Hopper's 64-row MMA).
BLOCK_Q = (32, 64, 128)
BLOCK_K = (32, 64, 128)
NUM_WARPS = (4, 8)
NUM_STAGES = (2, 3, 4)
#: Rule LONG_ONE_WAVE of the heuristic: where 64-row programs fill half a wave
#: to one wave and each runs over at least this many keys (head_dim 128),
#: 128-key blocks. ``benchmarks/attention_mosaic.py --few-long`` on an H100
#: and an H200 (batch 1-2, 4-8 heads, 1,000-2,048 tokens): 1.03-1.19x faster
#: than 64-key blocks, 1-2% slower at 1,024 tokens; at 512-768 tokens and with head_dim 64
#: the 64-key blocks stay ahead. Above one wave (the sweeps' 2,048-16,384
#: tokens) 64-key blocks win again.
LONG_KV = 1000

# Pruning rules of the space (see TritonAttention.space). Evidence: the grid
# probe of benchmarks/attention_probe.py on an H200 (6 shapes, 24 configs each).
#  A1 size:      no block larger than the next power of two of its length
#                (floor 32): larger blocks only mask.
#  A2 smem:      (num_stages * 2 * block_k + block_q) * head_dim_padded *
#                itemsize <= shared memory per block (pipelined K and V tiles
#                plus the Q tile).
#  A3 warps:     8 warps only with block_q >= 128. With block_q = 64, 8 warps
#                were 1.4x-2.2x slower than 4 warps on every probed shape
#                (too few rows per warp for the MMA).
#  A4 registers: fp32 output accumulator per thread,
#                block_q * head_dim_padded / (32 * num_warps), at most 128.


class TritonAttention(_triton.TritonBackend):
  """Pallas Triton flash attention: any length and head_dim up to 256 (padded
  in the kernel), any GPU Triton supports, CPU interpret mode."""

  name = "triton"
  config_cls = TritonAttentionConfig
  macro_fields = ("block_q", "block_k")
  micro_fields = ("num_warps", "num_stages")
  revision = 2  # the shifted ragged query block

  def smem_bytes(self, problem: AttentionProblem, c: TritonAttentionConfig) -> int:
    return ((c.num_stages * 2 * c.block_k + c.block_q) * problem.padded_head_dim
            * problem.itemsize)

  def space(self, problem: AttentionProblem, hw: Hardware, *,
            prune: bool = True) -> tuple[TritonAttentionConfig, ...]:
    """Valid configs pruned by rules A1-A4 (``prune=False``: A2 only)."""
    p = problem
    if not p.plain:
      return ()  # no window, soft-capping or sinks in this kernel
    # Rule A1 sees the lengths only through next_pow2, capped at the largest
    # block: problems of any other length share one cached space.
    return self._space(min(next_pow2(p.q_len), BLOCK_Q[-1]),
                       min(next_pow2(p.kv_len), BLOCK_K[-1]), p.padded_head_dim, p.dtype,
                       hw, prune)

  @functools.lru_cache(maxsize=1024)
  def _space(self, q_len, kv_len, dp, dtype, hw, prune):
    p = AttentionProblem(batch=1, q_heads=1, kv_heads=1, q_len=q_len, kv_len=kv_len,
                         head_dim=dp, dtype=dtype)
    out = []
    for bq, bk, nw, ns in itertools.product(BLOCK_Q, BLOCK_K, NUM_WARPS, NUM_STAGES):
      c = TritonAttentionConfig(block_q=bq, block_k=bk, num_warps=nw, num_stages=ns)
      if self.smem_bytes(p, c) > hw.smem_per_block:
        continue  # A2
      if prune:
        if bq > max(32, next_pow2(q_len)) or bk > max(32, next_pow2(kv_len)):
          continue  # A1
        if nw > 4 and bq < 128:
          continue  # A3
        if bq * dp // (32 * nw) > 128:
          continue  # A4
      out.append(c)
    return tuple(out)

  def size_quantum(self, problem: AttentionProblem) -> int:
    """Every block is a multiple of 32: within (32(j-1), 32j] the block counts,
    and with them (G, L) and the space, are the same."""
    return 32 if problem.plain else None

  def validate(self, problem: AttentionProblem, config: TritonAttentionConfig,
               hw: Hardware | None = None) -> None:
    if not isinstance(config, TritonAttentionConfig):
      raise ValueError(f"config must be a TritonAttentionConfig; got {config!r}")
    if not problem.plain:
      raise ValueError("the Pallas Triton attention kernel has no sliding window, logit "
                       "soft-capping or sinks (use a Mosaic or XLA config; cuDNN runs some "
                       "causal windows, no soft cap or sinks)")
    if hw is not None and self.smem_bytes(problem, config) > hw.smem_per_block:
      raise ValueError(
          f"config {config} needs {self.smem_bytes(problem, config)} bytes of shared "
          f"memory; {hw.name} allows {hw.smem_per_block} per block")

  def heuristic(self, problem: AttentionProblem, hw: Hardware) -> TritonAttentionConfig:
    """128x64 tiles with 4 warps when they fill two waves, else 64-row query
    blocks (32 rows when even those leave most SMs idle), 3 stages, with
    128-key blocks where those programs are long and make at most one wave
    (:data:`LONG_KV`); where
    the whole KV sequence fits one 128-key block, or 32-row programs are
    few, 128-key blocks (2 stages up to 256 keys): the best Triton configs
    of the one-wave problems of the H100 and H200 sweeps."""
    p = problem
    if not p.plain:
      return None
    ctas = lambda bq: p.batch * p.q_heads * -(-p.q_len // bq)  # noqa: E731
    bk = min(64, max(32, next_pow2(p.kv_len)))
    long_k = min(128, max(32, next_pow2(p.kv_len)))
    if ctas(128) >= 2 * hw.num_sms and p.padded_head_dim <= 128:
      c = TritonAttentionConfig(block_q=128, block_k=bk, num_warps=4, num_stages=2)
    elif p.kv_len <= 128 and p.padded_head_dim <= 128:
      bq = 64 if ctas(64) >= hw.num_sms // 2 else 32
      c = TritonAttentionConfig(block_q=bq, block_k=long_k, num_warps=4, num_stages=2)
    elif ctas(64) >= hw.num_sms // 2:
      # At most one wave of long programs: 128-key blocks (rule LONG_ONE_WAVE).
      long_one_wave = (ctas(64) <= hw.num_sms and p.kv_len >= LONG_KV
                       and p.head_dim == 128)
      c = TritonAttentionConfig(block_q=64, block_k=long_k if long_one_wave else bk,
                                num_warps=4, num_stages=3)
    elif p.padded_head_dim <= 128:
      c = TritonAttentionConfig(block_q=32, block_k=long_k, num_warps=4,
                                num_stages=2 if p.kv_len <= 256 else 3)
    else:
      c = TritonAttentionConfig(block_q=32, block_k=bk, num_warps=4, num_stages=3)
    while self.smem_bytes(p, c) > hw.smem_per_block and c.num_stages > 1:
      c = dataclasses.replace(c, num_stages=c.num_stages - 1)
    return c

  def occupancy_bound(self, problem: AttentionProblem, config: TritonAttentionConfig,
                      hw: Hardware) -> int:
    threads = 32 * config.num_warps
    live = (config.block_q * problem.padded_head_dim  # output accumulator
            + config.block_q * config.block_k) // threads  # scores
    return _triton.occupancy_bound(hw, smem_bytes=self.smem_bytes(problem, config),
                                   threads=threads, acc_per_thread=live)

  def coords(self, problem: AttentionProblem, macro: dict) -> tuple[int, float]:
    return coords(problem, macro["block_q"], macro["block_k"])

  def run(self, problem: AttentionProblem, config: TritonAttentionConfig, q, k, v,
          kv_lengths=None, *, interpret: bool = False, scale: float | None = None):
    return triton_attention(q, k, v, config=config, causal=problem.causal, scale=scale,
                            kv_lengths=kv_lengths, causal_align=problem.causal_align,
                            interpret=interpret)
