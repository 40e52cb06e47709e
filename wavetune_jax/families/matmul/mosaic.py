"""The Mosaic GPU backend of the GEMM family (``pallas_kernels.matmul.mosaic``)."""

from __future__ import annotations

import functools
import itertools

import jax.numpy as jnp
import numpy as np

from pallas_kernels.matmul import mosaic as kernel
from pallas_kernels.matmul.mosaic import MosaicMatmulConfig
from wavetune_jax.core.family import Backend, interned
from wavetune_jax.core.hardware import Hardware
from wavetune_jax.families.matmul.problem import MatmulProblem
from wavetune_jax.families.matmul.triton import _aux, _cdiv

__all__ = ["MosaicMatmul", "MosaicMatmulConfig"]

#: CTA tiles (block_m, block_n); the consumer warpgroups split M from 128 rows.
TILES = ((64, 128), (64, 256), (128, 64), (128, 128), (128, 192), (128, 256), (256, 64),
         (256, 128))
STAGES = (2, 3, 4, 5, 6)
PRUNED_STAGES = (3, 4)
#: The tiles kept (pruned) where the 128x256 tile alone fills the SMs.
BIG_TILES = ((128, 192), (128, 256), (256, 128))
SPLIT_K = (1, 2, 3, 4, 6, 8, 12, 16)
#: (grid_minor, grid_width) orders of the tile grid.
ORDERS = ((1, 1), (0, 1), (1, 8), (0, 8))
PRUNED_ORDERS = ((1, 1), (0, 8))

# The space (see MosaicMatmul.space), on compute capability 9.0 only:
#  G1 shape:   bfloat16/float16 inputs, N and K multiples of 64, M a multiple of
#              8 or below 8 (TMA tiling of global memory).
#  G2 smem:    num_stages * (block_m + block_n) * 64 * itemsize + output slots
#              <= shared memory per block.
#  G3 size:    block_m <= max(64, next_pow2(M)): a taller tile only loads zeros.
#  G4 split-K: split_k > 1 only while the output tiles fill less than one
#              wave of SMs, with tiles * split_k <= 2 * SMs and at least 4 K
#              steps per split (as the Triton backend's R4).
#  G5 order:   the tile order matters only when the tiles take more than one
#              wave; in one wave only (N minor, width 1) is measured. Pruned:
#              (N minor, width 1) and (M minor, width 8).
#  G6 stages:  pruned: 4, and 3 for the 128x256 and 256x128 tiles (the only
#              two whose best ring depth differed, by up to 2.5%, in
#              benchmarks/matmul_mosaic.py --set quick on an H100).
#  G7 pruned:  where M >= 128 and the 128x256 tile alone gives at least one
#              wave, only the three largest tiles (BIG_TILES); elsewhere split_k is 1 or one
#              of the two largest splits that keep tiles * split_k <= SMs (the
#              best split of every quick problem on the H100 was one of them).


def _rep(n: int, k: int) -> tuple[int, int]:
  """``(n, k)`` with the same candidates (one cache entry for every large
  weight): N does not enter them, K only through min(K blocks, 64)."""
  return 64, min(k, 64 * kernel.BLOCK_K)


class MosaicMatmul(Backend):
  """The persistent, warp-specialized Mosaic GPU GEMM (Hopper: TMA ring,
  wgmma, one producer and two consumer warpgroups, split-K with fp32
  partials). No CPU interpret mode."""

  name = "mosaic"
  kernel_cache = True
  config_cls = MosaicMatmulConfig
  macro_fields = ("block_m", "block_n", "split_k")
  micro_fields = ("num_stages", "grid_minor", "grid_width")
  # split_k only changes (G, L) and adds the reduction (aux), as for Triton.
  folded_fields = ("split_k",)
  interpret = False

  def supported_on(self, hw: Hardware) -> bool:
    return hw.compute_capability == kernel.COMPUTE_CAPABILITY

  @staticmethod
  def runs_shape(p: MatmulProblem) -> bool:
    """Rule G1 (M included)."""
    return (p.dtype in kernel.DTYPES and p.n % kernel.NK_MULTIPLE == 0
            and p.k % kernel.NK_MULTIPLE == 0
            and (p.m < kernel.M_MULTIPLE or p.m % kernel.M_MULTIPLE == 0))

  def smem_bytes(self, problem: MatmulProblem, c: MosaicMatmulConfig) -> int:
    return kernel.smem_bytes(block_m=c.block_m, block_n=c.block_n, num_stages=c.num_stages,
                             itemsize=problem.itemsize,
                             out_itemsize=4 if c.split_k > 1 else
                             jnp.dtype(problem.out_dtype).itemsize)

  def space(self, problem: MatmulProblem, hw: Hardware, *,
            prune: bool = True) -> tuple[MosaicMatmulConfig, ...]:
    """Rules G1-G6 (``prune=False``: G1, G2, G4's validity, all orders and stages)."""
    if not self.runs_shape(problem):
      return ()
    cands, arr = self._weight_candidates(*_rep(problem.n, problem.k), problem.dtype,
                                         problem.out_dtype, hw, prune)
    mask = self._size_mask(np.array([[problem.m]]), problem.n, arr, hw, prune)[0]
    return tuple(c for c, ok in zip(cands, mask) if ok)

  @functools.lru_cache(maxsize=256)
  def _weight_candidates(self, n: int, k: int, dtype: str, out_dtype: str, hw: Hardware,
                         prune: bool):
    p = MatmulProblem(m=8, n=n, k=k, dtype=dtype, out_dtype=out_dtype)
    k_blocks = _cdiv(k, kernel.BLOCK_K)
    out = []
    stages = PRUNED_STAGES if prune else STAGES
    orders = PRUNED_ORDERS if prune else ORDERS
    for (bm, bn), sk, ns, (gm, gw) in itertools.product(TILES, SPLIT_K, stages, orders):
      if sk > k_blocks or (prune and sk > 1 and kernel.k_steps(k, sk) < 4):
        continue  # validity, G4 (K part)
      if sk > 1 and (gm, gw) != ORDERS[0]:
        continue  # G5: split-K runs in one wave or two
      if prune and ns == 3 and bm * bn < 128 * 256:
        continue  # G6
      c = interned(MosaicMatmulConfig, block_m=bm, block_n=bn, num_stages=ns, split_k=sk,
                   grid_minor=gm, grid_width=gw)
      if self.smem_bytes(p, c) > hw.smem_per_block:
        continue  # G2
      out.append(c)
    arr = {f: np.array([getattr(c, f) for c in out], np.int64)
           for f in ("block_m", "block_n", "split_k", "grid_minor", "grid_width")}
    return tuple(out), arr

  @staticmethod
  def _size_mask(m: np.ndarray, n: int, arr: dict, hw: Hardware, prune: bool) -> np.ndarray:
    bm, bn, sk = arr["block_m"], arr["block_n"], arr["split_k"]
    default_order = (arr["grid_minor"] == ORDERS[0][0]) & (arr["grid_width"] == ORDERS[0][1])
    tiles = -(-m // bm) * -(-n // bn)
    ok = np.ones(np.broadcast_shapes(m.shape, bm.shape), bool)
    ok &= (sk == 1) | ((tiles < hw.num_sms) & (tiles * sk <= 2 * hw.num_sms))  # G4
    ok &= default_order | (tiles > hw.num_sms)  # G5
    if prune:
      np2 = 1 << np.ceil(np.log2(np.maximum(m, 1))).astype(np.int64)
      ok &= bm <= np.maximum(64, np2)  # G3
      # (only from M >= 128: below, G3 leaves 64-row tiles alone)
      big = (m >= 128) & ((-(-m // 128) * -(-n // 256)) >= hw.num_sms)
      is_big = np.zeros(bm.shape, bool)
      for tm, tn in BIG_TILES:
        is_big |= (bm == tm) & (bn == tn)
      ok &= ~big | is_big  # G7 (tiles)
      # G7 (splits): per tile, the two largest splits with tiles * sk <= SMs.
      fits = (sk > 1) & (tiles * sk <= hw.num_sms)
      rank = np.zeros(ok.shape, np.int64)
      for s in SPLIT_K[1:]:
        rank += fits & (sk < s) & (tiles * s <= hw.num_sms)
      ok &= (sk == 1) | (fits & (rank < 2))
    return ok

  def size_quantum(self, problem: MatmulProblem) -> int | None:
    """CTA tiles are multiples of 64 rows, but TMA needs M a multiple of 8:
    sizes in (8(j-1), 8j] share the space where M is one; None where the
    kernel does not run this problem."""
    return kernel.M_MULTIPLE if self.runs_shape(problem) else None

  def decision_arrays(self, problem: MatmulProblem, sizes, hw: Hardware, n_aux: int,
                      with_size=None):
    cands, arr = self._weight_candidates(*_rep(problem.n, problem.k), problem.dtype,
                                         problem.out_dtype, hw, True)
    m = np.asarray(sizes, np.int64).reshape(-1, 1)
    valid = self._size_mask(m, problem.n, arr, hw, True)
    valid &= (m < kernel.M_MULTIPLE) | (m % kernel.M_MULTIPLE == 0)
    g, l = self._gl(m, problem.n, problem.k, arr["block_m"], arr["block_n"], arr["split_k"])
    aux = _aux(m, problem.n, arr["split_k"])
    return cands, valid, g, l, aux

  @staticmethod
  def _gl(m, n, k, bm, bn, sk):
    steps = -(-(-(-k // kernel.BLOCK_K)) // sk)
    return -(-m // bm) * -(-n // bn) * sk, steps * np.ones_like(bm)

  def validate(self, problem: MatmulProblem, config: MosaicMatmulConfig,
               hw: Hardware | None = None) -> None:
    if not isinstance(config, MosaicMatmulConfig):
      raise ValueError(f"config must be a MosaicMatmulConfig; got {config!r}")
    p = problem
    kernel.check_shapes(p.m, p.n, p.k, p.dtype, p.out_dtype, config)
    if hw is not None and self.smem_bytes(p, config) > hw.smem_per_block:
      raise ValueError(
          f"config {config} needs {self.smem_bytes(p, config)} bytes of shared "
          f"memory; {hw.name} allows {hw.smem_per_block} per block")

  def occupancy_bound(self, problem, config, hw: Hardware) -> int:
    # One CTA per SM: the persistent grid has one, and the ring fills the SMEM.
    return 1

  def coords(self, problem: MatmulProblem, macro: dict) -> tuple[int, int]:
    """``G`` = work tiles of the persistent grid (tiles x splits), ``L`` = K
    steps of one split."""
    g, l = self._gl(problem.m, problem.n, problem.k, macro["block_m"], macro["block_n"],
                    macro["split_k"])
    return int(g), int(l)

  def aux(self, problem: MatmulProblem, config: MosaicMatmulConfig) -> tuple[float, ...]:
    return tuple(float(v) for v in _aux(problem.m, problem.n, config.split_k))

  def run(self, problem: MatmulProblem, config: MosaicMatmulConfig, x, w, *,
          interpret: bool = False, num_sms: int | None = None):
    if interpret:
      raise NotImplementedError(kernel.NO_INTERPRET)
    return kernel.matmul(x, w, config=config, out_dtype=jnp.dtype(problem.out_dtype),
                         num_sms=num_sms)
