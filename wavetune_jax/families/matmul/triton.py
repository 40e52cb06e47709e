"""The Triton backend of the GEMM family (``pallas_kernels.matmul.triton``)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax.numpy as jnp
import numpy as np

from pallas_kernels.matmul.triton import TritonMatmulConfig
from pallas_kernels.matmul.triton import matmul as triton_matmul
from wavetune_jax.core.family import interned
from wavetune_jax.core.hardware import Hardware
from wavetune_jax.families import _triton
from wavetune_jax.families.matmul.problem import MatmulProblem

__all__ = ["TritonMatmul", "TritonMatmulConfig"]


def _next_pow2(v: int) -> int:
  return 1 << max(0, math.ceil(math.log2(max(1, v))))


def _cdiv(a: int, b: int) -> int:
  return -(-a // b)


def _gl(m, n, k, bm, bn, bk, sk):
  """``(G, L)`` of the GEMM mapping; works on ints and on NumPy arrays."""
  return _cdiv(m, bm) * _cdiv(n, bn) * sk, _cdiv(_cdiv(k, bk), sk)


def _aux(m, n, sk):
  """Split-K columns of the wave model: ``[sk > 1, MB of fp32 partials]``
  (the partials are written by the kernel and summed by one XLA reduction).
  Works on ints and on NumPy arrays; returns ``[..., 2]``."""
  multi = np.asarray(sk > 1, np.float32)
  mb = multi * np.asarray(sk * m * n * 4, np.float64) / 1e6
  multi, mb = np.broadcast_arrays(multi, mb)
  return np.stack([multi, mb.astype(np.float32)], axis=-1)


# Candidate values. Blocks are powers of two >= 16 (tl.dot's minimum). The
# pruned space uses the PRUNED_* subsets; ``prune=False`` uses all values.
BLOCK_M = (16, 32, 64, 128, 256)
BLOCK_N = (32, 64, 128, 256)
BLOCK_K = (32, 64, 128)
SPLIT_K = (1, 2, 4, 8, 16)
GROUP_M = (1, 8)
NUM_WARPS = (4, 8)
NUM_STAGES = (2, 3, 4)
PRUNED_GROUP_M = (8,)
PRUNED_NUM_STAGES = (3, 4)

# Pruning rules of the space (see TritonMatmul.space). The measurements behind
# R5-R7 are in data/probes/space_gate_up_h200_r1r4.json: every config allowed
# by R1-R4 alone (stages 2-4, group_m 1 and 8, all block_m) checked and timed
# for llama3_8b.gate_up at M = 16, 1000, 4096 on an H200; the numbers below are
# (best config with that value) / (best config overall) in speed, as printed by
# `python3 benchmarks/pruning_evidence.py data/probes/space_gate_up_h200_r1r4.json`:
#  R1 size:      no block larger than the next power of two of its dimension
#                (floor 16 for M, 32 for N and K): larger blocks only mask.
#  R2 smem:      num_stages * (bm*bk + bk*bn) * itemsize <= shared memory per
#                block (the pipelined operand buffers must fit).
#  R3 registers: fp32 accumulator elements per thread,
#                bm*bn / (32*num_warps), at most 128 (above, the accumulator
#                spills); more than 4 warps only with >= 16 per thread (below,
#                the extra warps have no work).
#  R4 split-K:   split_k > 1 only while the output tile grid fills less than
#                one wave (tiles_m*tiles_n < num_SMs), with tiles*split_k <=
#                2*num_SMs and at least 2 K steps per split: split-K exists
#                to fill idle SMs; past a wave it only adds partial traffic.
#  R5 group_m:   8 only. group_m=1 was 0.88x and 0.94x of the best at
#                M = 1000 and 4096, and identical where the grid has one tile row.
#  R6 stages:    3 and 4 only. The best 2-stage config was 0.94x, 0.81x, 0.91x
#                of the best at M = 16, 1000, 4096.
#  R7 tiny bm:   block_m >= min(64, next_pow2(M) / 16). bm = 16 and 32 reached 0.24x and
#                0.41-0.44x of the best at M = 1000 and 4096 (too little reuse of w).
ACC_PER_THREAD = (16, 128)




def _smem(bm: int, bn: int, bk: int, stages: int, itemsize: int) -> int:
  return stages * (bm * bk + bk * bn) * itemsize


def _rep(n: int, k: int) -> tuple[int, int]:
  """``(n, k)`` with the same candidates (one cache entry for every large
  weight): N enters them only through min(next_pow2(N), 256) (R1), K through
  min(next_pow2(K), 128) (R1) and min(K blocks, 32) per block_k (split-K
  validity and R4), all saturated from K = 32 * 128."""
  return min(n, BLOCK_N[-1]), min(k, 32 * BLOCK_K[-1])


class TritonMatmul(_triton.TritonBackend):
  """Pallas Triton GEMM: masked edges (any M, N, K), grouped tile order,
  split-K with fp32 partials summed by one XLA reduction."""

  name = "triton"
  config_cls = TritonMatmulConfig
  macro_fields = ("block_m", "block_n", "block_k", "split_k")
  micro_fields = ("group_m", "num_warps", "num_stages")
  # split_k only changes (G, L) and adds the reduction (aux), so one wave
  # model serves every split of a tile: 160 models instead of 676 on the H200
  # sweep, and each gets the anchors of all its splits.
  folded_fields = ("split_k",)

  # --- space -------------------------------------------------------------------
  def smem_bytes(self, problem: MatmulProblem, c: TritonMatmulConfig) -> int:
    """Shared memory of the pipelined operand buffers."""
    return _smem(c.block_m, c.block_n, c.block_k, c.num_stages, problem.itemsize)

  def space(self, problem: MatmulProblem, hw: Hardware, *,
            prune: bool = True) -> tuple[TritonMatmulConfig, ...]:
    """Valid configs for ``problem`` on ``hw``, pruned by rules R1-R7.

    With ``prune=False`` only validity (R2 and split-K <= K blocks) applies;
    that wide space exists to check the pruning rules against measurements.
    """
    cands, arr = self._weight_candidates(*_rep(problem.n, problem.k), problem.dtype, hw, prune)
    mask = self._size_mask(np.array([[problem.m]]), problem.n, arr, hw, prune)[0]
    return tuple(c for c, ok in zip(cands, mask) if ok)

  @functools.lru_cache(maxsize=256)
  def _weight_candidates(self, n: int, k: int, dtype: str, hw: Hardware,
                         prune: bool) -> tuple[tuple[TritonMatmulConfig, ...], dict]:
    """Configs allowed by every rule that does not depend on M, and their
    fields as arrays (for the rules that do: ``_size_mask``)."""
    p = MatmulProblem(m=1, n=n, k=k, dtype=dtype)
    k_blocks = {bk: _cdiv(k, bk) for bk in BLOCK_K}
    out = []
    groups = PRUNED_GROUP_M if prune else GROUP_M  # R5
    stages = PRUNED_NUM_STAGES if prune else NUM_STAGES  # R6
    for bm, bn, bk in itertools.product(BLOCK_M, BLOCK_N, BLOCK_K):
      if prune and (bn > max(32, _next_pow2(n)) or bk > max(32, _next_pow2(k))):
        continue  # R1 (N and K; M in _size_mask)
      for sk in SPLIT_K:
        if sk > k_blocks[bk]:
          continue  # validity
        if prune and sk > 1 and _cdiv(k_blocks[bk], sk) < 2:
          continue  # R4 (K part; the tile-grid part in _size_mask)
        for gm, nw, ns in itertools.product(groups, NUM_WARPS, stages):
          # (the rules on plain ints first: only kept configs are built)
          if _smem(bm, bn, bk, ns, p.itemsize) > hw.smem_per_block:
            continue  # R2 (smem_bytes)
          acc = bm * bn // (32 * nw)
          if prune and (acc > ACC_PER_THREAD[1]
                        or (nw > 4 and acc < ACC_PER_THREAD[0])):
            continue  # R3
          out.append(interned(TritonMatmulConfig, block_m=bm, block_n=bn, block_k=bk,
                              split_k=sk, group_m=gm, num_warps=nw, num_stages=ns))
    arr = {f: np.array([getattr(c, f) for c in out], np.int64)
           for f in ("block_m", "block_n", "block_k", "split_k")}
    return tuple(out), arr

  @staticmethod
  def _size_mask(m: np.ndarray, n: int, arr: dict, hw: Hardware, prune: bool) -> np.ndarray:
    """``[S, n_cands]``: which candidates the M-dependent rules keep, per M."""
    bm, bn, sk = arr["block_m"], arr["block_n"], arr["split_k"]
    ok = np.ones(np.broadcast_shapes(m.shape, bm.shape), bool)
    if not prune:
      return ok
    np2 = 1 << np.ceil(np.log2(np.maximum(m, 1))).astype(np.int64)
    ok &= bm <= np.maximum(16, np2)  # R1 (M)
    ok &= bm >= np.minimum(64, np2 // 16)  # R7
    tiles = -(-m // bm) * -(-n // bn)
    ok &= (sk == 1) | ((tiles < hw.num_sms) & (tiles * sk <= 2 * hw.num_sms))  # R4
    return ok

  def size_quantum(self, problem: MatmulProblem) -> int:
    """Every block_m is a multiple of 16, so ceil(M / block_m), and with it
    (G, L) and the space, is the same for all M in (16(j-1), 16j]."""
    return BLOCK_M[0]

  def decision_arrays(self, problem: MatmulProblem, sizes, hw: Hardware, n_aux: int,
                      with_size=None):
    cands, arr = self._weight_candidates(*_rep(problem.n, problem.k), problem.dtype, hw, True)
    m = np.asarray(sizes, np.int64).reshape(-1, 1)
    valid = self._size_mask(m, problem.n, arr, hw, True)
    g, l = _gl(m, problem.n, problem.k, arr["block_m"], arr["block_n"], arr["block_k"],
               arr["split_k"])
    aux = _aux(m, problem.n, arr["split_k"])
    return cands, valid, g, l, aux

  def validate(self, problem: MatmulProblem, config: TritonMatmulConfig,
               hw: Hardware | None = None) -> None:
    if not isinstance(config, TritonMatmulConfig):
      raise ValueError(f"config must be a TritonMatmulConfig; got {config!r}")
    k_blocks = _cdiv(problem.k, config.block_k)
    if config.split_k > k_blocks:
      raise ValueError(
          f"config.split_k={config.split_k} is larger than the number of K blocks "
          f"ceil(K / block_k) = ceil({problem.k} / {config.block_k}) = {k_blocks}")
    if hw is not None and self.smem_bytes(problem, config) > hw.smem_per_block:
      raise ValueError(
          f"config {config} needs {self.smem_bytes(problem, config)} bytes of shared "
          f"memory; {hw.name} allows {hw.smem_per_block} per block")

  # --- rules of thumb ------------------------------------------------------------
  def heuristic(self, problem: MatmulProblem, hw: Hardware) -> TritonMatmulConfig:
    """Blocks from the next power of two of the dimensions, split-K for small M.

    ``block_m`` follows M up to 128; small M gets narrow ``block_n`` tiles and
    split-K until the grid fills the SMs; large M gets 128x256 tiles with 8 warps.
    """
    p = problem
    bm = min(128, max(16, _next_pow2(p.m)))
    bn = 64 if p.m <= 64 else (256 if bm == 128 else 128)
    bn = min(bn, max(32, _next_pow2(p.n)))
    bk = 64 if p.k >= 64 else 32
    nw = 8 if bm * bn >= 128 * 256 else 4
    ns = 3 if bm >= 128 else 4
    tiles = _cdiv(p.m, bm) * _cdiv(p.n, bn)
    k_blocks = _cdiv(p.k, bk)
    sk = 1
    while (tiles * sk * 2 <= hw.num_sms and sk * 2 <= SPLIT_K[-1]
           and _cdiv(k_blocks, sk * 2) >= 4):
      sk *= 2
    c = TritonMatmulConfig(block_m=bm, block_n=bn, block_k=bk, split_k=sk, group_m=8,
                     num_warps=nw, num_stages=ns)
    while self.smem_bytes(p, c) > hw.smem_per_block and c.num_stages > 1:
      c = dataclasses.replace(c, num_stages=c.num_stages - 1)
    return c

  def occupancy_bound(self, problem: MatmulProblem, config: TritonMatmulConfig,
                      hw: Hardware) -> int:
    """Analytic bound on CTAs per SM (shared memory, threads, registers)."""
    return _triton.occupancy_bound(
        hw, smem_bytes=self.smem_bytes(problem, config), threads=32 * config.num_warps,
        acc_per_thread=config.block_m * config.block_n // (32 * config.num_warps))

  # --- mapping ---------------------------------------------------------------------
  def coords(self, problem: MatmulProblem, macro: dict) -> tuple[int, int]:
    """``G = ceil(M/bm)*ceil(N/bn)*split_k``, ``L = ceil(K/(bk*split_k))``."""
    return _gl(problem.m, problem.n, problem.k, macro["block_m"], macro["block_n"],
               macro["block_k"], macro["split_k"])

  def aux(self, problem: MatmulProblem, config: TritonMatmulConfig) -> tuple[float, ...]:
    """Split-K's extra cost outside the tile grid (``MatmulFamily.aux_names``)."""
    return tuple(float(v) for v in _aux(problem.m, problem.n, config.split_k))

  # --- running ------------------------------------------------------------------------
  def run(self, problem: MatmulProblem, config: TritonMatmulConfig, x, w, *,
          interpret: bool = False):
    return triton_matmul(x, w, config=config, out_dtype=jnp.dtype(problem.out_dtype),
                         interpret=interpret)
