# Copyright 2025 The JAX Authors.
# Copyright 2026 The wavetune-jax Authors.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     https://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
"""Pallas Mosaic GPU GEMM for Hopper: ``y = x @ w``, persistent, with split-K.

The structure follows JAX's ``jax.experimental.pallas.ops.gpu.hopper_matmul_mgpu``:
one CTA per SM walks the work tiles of a persistent grid; in each CTA one
producer warpgroup streams ``x`` and ``w`` blocks with TMA into a ring of
``num_stages`` shared-memory buffers and two consumer warpgroups run wgmma on
them (fp32 accumulators in registers), then store the tile through shared
memory with TMA. What differs:

* **split-K**: a work tile is (tile row, tile column, K split). With
  ``split_k > 1`` every split writes fp32 partial sums to a
  ``[split_k, M, N]`` buffer and one fused XLA reduction adds them and casts.
  This is what fills the SMs when the output has fewer tiles than SMs
  (decode and small prefill shapes, long K);
* **any M, N, K tile remainder**: the last tile row, column and K block run
  past the edges of the arrays; TMA fills the rows and columns of a load past
  an edge with zeros (so they add nothing to the dot products) and drops the
  part of a store past it. No host-side padding, no extra copies. What TMA
  needs is in :func:`check_shapes`: ``M`` a multiple of 8 or below 8, ``N`` and
  ``K`` multiples of 64 (Mosaic tiles global memory as it tiles shared memory);
* **the two consumer warpgroups** split the CTA tile along M when
  ``block_m >= 128`` and along N otherwise, so CTA tiles start at 64 rows;
* the SM count is an argument (the caller's device), and the checks raise
  ``ValueError`` saying what to change.

Inputs bfloat16 or float16 (the same for both), fp32 accumulation, output
bfloat16, float16 or float32.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._launch import (check_ints, match_varying, out_struct,
                                     require_compute_capability)

__all__ = ["BLOCK_K", "BLOCK_M", "BLOCK_N", "COMPUTE_CAPABILITY", "DTYPES", "NO_INTERPRET",
           "MosaicMatmulConfig", "check_shapes", "launch", "matmul", "smem_bytes", "wg_tile",
           "wgmma_wait_delayed"]

#: The GPUs the kernel runs on (wgmma and TMA: Hopper).
COMPUTE_CAPABILITY = "9.0"
#: Input dtypes.
DTYPES = ("bfloat16", "float16")
#: CTA tile rows and columns.
BLOCK_M = (64, 128, 256)
BLOCK_N = (64, 128, 192, 256)
#: K step of the pipeline: 64 elements of 2 bytes, one 128-byte swizzle row.
BLOCK_K = 64
#: N and K must be multiples of this (TMA tiles global memory by 64 columns).
NK_MULTIPLE = 64
#: M must be a multiple of this, or smaller than it.
M_MULTIPLE = 8
#: The epilogue stores 64 x 64 sub-tiles.
EPI_TILE = 64
#: fp32 accumulator elements per consumer thread (128 threads) at most.
MAX_ACC_PER_THREAD = 128
_BARRIER_BYTES = 1024
_MEMORY_REGISTERS = 40
NO_INTERPRET = ("the Mosaic GPU GEMM has no CPU interpret mode; its correctness is "
                "checked on a Hopper GPU (the sweep and benchmarks/matmul_mosaic.py "
                "compare every config with the float32 reference)")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MosaicMatmulConfig:
  """Launch parameters of the Mosaic GPU GEMM (one producer and two consumer
  warpgroups per CTA, one CTA per SM).

  Attributes:
    block_m: CTA tile rows: 64, 128 or 256.
    block_n: CTA tile columns: 64, 128, 192 or 256 (with ``block_m = 64``,
      128 or 256: the two consumer warpgroups split N into halves of 64 or 128).
    num_stages: ``x``/``w`` blocks in flight (TMA ring), in [2, 8].
    split_k: K splits per output tile (>= 1); above 1, fp32 partials are
      summed by one XLA reduction.
    grid_minor: 0 walks the tile grid with M minor, 1 with N minor.
    grid_width: width of the bands of the planar-snake tile order (L2 reuse).
  """

  block_m: int = 128
  block_n: int = 256
  num_stages: int = 4
  split_k: int = 1
  grid_minor: int = 1
  grid_width: int = 1

  def __post_init__(self):
    check_ints(self)
    name = "MosaicMatmulConfig"
    if self.block_m not in BLOCK_M:
      raise ValueError(f"{name}.block_m={self.block_m} must be one of {BLOCK_M}")
    if self.block_n not in BLOCK_N:
      raise ValueError(f"{name}.block_n={self.block_n} must be one of {BLOCK_N}")
    wm, wn = wg_tile(self.block_m, self.block_n)
    if wm * wn // 128 > MAX_ACC_PER_THREAD:
      raise ValueError(f"{name}: a {self.block_m}x{self.block_n} tile gives each consumer "
                       f"warpgroup a {wm}x{wn} fp32 accumulator, more than "
                       f"{MAX_ACC_PER_THREAD} registers per thread")
    if self.block_m < 128 and self.block_n not in (128, 256):
      raise ValueError(f"{name}: block_m=64 needs block_n 128 or 256 (the two consumer "
                       f"warpgroups split N in halves of 64 or 128); got "
                       f"block_n={self.block_n}")
    if not 2 <= self.num_stages <= 8:
      raise ValueError(f"{name}.num_stages={self.num_stages} must be in [2, 8]")
    if self.split_k < 1:
      raise ValueError(f"{name}.split_k={self.split_k} must be >= 1")
    if self.grid_minor not in (0, 1):
      raise ValueError(f"{name}.grid_minor={self.grid_minor} must be 0 (M) or 1 (N)")
    if not 1 <= self.grid_width <= 64:
      raise ValueError(f"{name}.grid_width={self.grid_width} must be in [1, 64]")


def wg_tile(block_m: int, block_n: int) -> tuple[int, int]:
  """The tile of one consumer warpgroup: half the CTA tile, split along M
  when ``block_m >= 128``, else along N."""
  return (block_m // 2, block_n) if block_m >= 128 else (block_m, block_n // 2)


def k_steps(k: int, split_k: int) -> int:
  """Pipeline steps of one K split (the last split may run past K: zeros)."""
  return -(-(-(-k // BLOCK_K)) // split_k)


def empty_split(steps: int, split_k: int) -> bool:
  """Whether ``split_k`` splits of ``steps`` K steps, each of ``ceil(steps /
  split_k)``, leave the last one empty."""
  return (split_k - 1) * -(-steps // split_k) >= steps


def smem_bytes(*, block_m: int, block_n: int, num_stages: int, itemsize: int,
               out_itemsize: int) -> int:
  """Shared memory of one CTA: the operand ring and two 64x64 output slots
  per consumer warpgroup."""
  ring = num_stages * (block_m + block_n) * BLOCK_K * itemsize
  wm, wn = wg_tile(block_m, block_n)
  slots = min(2, (wm * wn) // (EPI_TILE * EPI_TILE))
  return ring + 2 * slots * EPI_TILE * EPI_TILE * out_itemsize + _BARRIER_BYTES


def check_shapes(m: int, n: int, k: int, dtype, out_dtype, config: MosaicMatmulConfig, *,
                 kernel: str = "Mosaic GPU GEMM") -> None:
  """Raises ``ValueError`` unless the kernel runs ``[m, k] @ [k, n]`` with
  ``config`` (``kernel``: its name in the messages)."""
  if jnp.dtype(dtype).name not in DTYPES:
    raise ValueError(f"the {kernel} takes {DTYPES}; got {jnp.dtype(dtype).name}")
  if jnp.dtype(out_dtype).name not in ("bfloat16", "float16", "float32"):
    raise ValueError(f"the {kernel} writes bfloat16, float16 or float32; got "
                     f"{jnp.dtype(out_dtype).name}")
  if n % NK_MULTIPLE or k % NK_MULTIPLE:
    raise ValueError(f"the {kernel} needs N and K multiples of {NK_MULTIPLE} (TMA "
                     f"tiles global memory by {NK_MULTIPLE} columns); got N={n}, K={k} "
                     f"(use a Triton or XLA config)")
  if m > M_MULTIPLE and m % M_MULTIPLE:
    raise ValueError(f"the {kernel} needs M a multiple of {M_MULTIPLE} or below it "
                     f"(TMA tiles global memory by {M_MULTIPLE} rows); got M={m} (use a "
                     f"Triton or XLA config)")
  k_blocks = -(-k // BLOCK_K)
  if config.split_k > k_blocks:
    raise ValueError(f"split_k={config.split_k} is more than the {k_blocks} K blocks of "
                     f"K={k}")


def check_device() -> int:
  """The SM count of the default device; raises ``ValueError`` unless it is
  a Hopper GPU."""
  dev = require_compute_capability(COMPUTE_CAPABILITY, "Mosaic GPU GEMM",
                                   "use a Triton or XLA config")
  return int(dev.core_count)


def matmul(x: jax.Array, w: jax.Array, *, config: MosaicMatmulConfig, out_dtype=None,
           num_sms: int | None = None) -> jax.Array:
  """``x [M, K] @ w [K, N]`` with the Mosaic GPU kernel (Hopper only).

  Args:
    x, w: bfloat16 or float16, the same dtype.
    config: launch parameters; used as given, never changed.
    out_dtype: bfloat16, float16 or float32 (default ``x.dtype``).
    num_sms: CTAs of the persistent grid (default: the SMs of the default
      device, which must then be a Hopper GPU).

  Raises:
    ValueError: bad ranks, shapes or dtypes, shapes this kernel does not run
      (:func:`check_shapes`), or no Hopper GPU.
  """
  if not isinstance(config, MosaicMatmulConfig):
    raise ValueError(f"config must be a MosaicMatmulConfig; got {type(config).__name__}")
  if x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[0]:
    raise ValueError(f"need x [M, K] and w [K, N]; got x.shape={x.shape}, w.shape={w.shape}")
  if x.dtype != w.dtype:
    raise ValueError(f"x.dtype={x.dtype} and w.dtype={w.dtype} must be the same")
  out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
  (m, k), n = x.shape, w.shape[1]
  check_shapes(m, n, k, x.dtype, out_dtype, config)
  if num_sms is None:
    num_sms = check_device()
  return _matmul(x, w, config=config, out_dtype=out_dtype, num_sms=int(num_sms))


@functools.partial(jax.jit, static_argnames=("config", "out_dtype", "num_sms"))
def _matmul(x, w, *, config: MosaicMatmulConfig, out_dtype, num_sms: int):
  if config.split_k == 1:
    return _kernel_call(x, w, config=config, out_dtype=out_dtype, num_sms=num_sms)
  partials = _kernel_call(x, w, config=config, out_dtype=jnp.dtype(jnp.float32),
                          num_sms=num_sms)
  return partials.sum(axis=0).astype(out_dtype)


def _kernel_call(x, w, *, config: MosaicMatmulConfig, out_dtype, num_sms: int):
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  (m, k), n = x.shape, w.shape[1]
  dtype = x.dtype
  sk = config.split_k
  bm, bn = config.block_m, config.block_n
  wm, wn = wg_tile(bm, bn)
  tiles_m, tiles_n = pl.cdiv(m, bm), pl.cdiv(n, bn)
  steps = k_steps(k, sk)  # pipeline steps per split
  split_len = steps * BLOCK_K

  out_swizzle = plgpu.find_swizzle(EPI_TILE * out_dtype.itemsize * 8)
  out_elems = out_swizzle // out_dtype.itemsize
  out_transforms = (plgpu.TilingTransform((8, out_elems)), plgpu.SwizzleTransform(out_swizzle))
  epi_m, epi_n = min(EPI_TILE, wm), min(EPI_TILE, wn)
  num_slots = min(2, (wm * wn) // (epi_m * epi_n))

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
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, out_smem):
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
            store_tile(acc_ref[...].astype(out_dtype), out_smem, wg,
                       out_ref.at[m_slice, n_slice].at[wg_m, wg_n], epi=(epi_m, epi_n))

        def mma_body(_, x_smem, w_smem, acc_ref):
          plgpu.wgmma(acc_ref, x_smem.at[wg_m], w_smem.at[:, wg_n])
          plgpu.wgmma_wait(0)
          return acc_ref

        get_pipeline(mma_body, compute_context)(
            x_gmem.at[m_slice, k_slice],
            w_gmem.at[k_slice, n_slice],
            allocations=pipeline_allocs,
        )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  return launch(kernel, (x, w), out_shape=(m, n), split_k=sk, out_dtype=out_dtype,
                work_tiles=tiles_m * tiles_n * sk, num_sms=num_sms)


def launch(kernel, arrays, *, out_shape: tuple[int, int], split_k: int, out_dtype,
           work_tiles: int, num_sms: int):
  """``kernel(*arrays, out)`` on the persistent grid of the GEMMs: ``out``
  ``[split_k, *out_shape]`` (a split's partials) or ``out_shape`` with one
  split; ``min(num_sms, work_tiles)`` CTAs."""
  full = (split_k, *out_shape) if split_k > 1 else tuple(out_shape)
  arrays, axes = match_varying(*arrays)
  return persistent_kernel(kernel, out_struct(full, out_dtype, axes),
                           min(num_sms, work_tiles))(*arrays)


def work_tile(lin, wg, *, tiles: tuple[int, int], config, split_len: int):
  """Work tile ``lin`` of a persistent GEMM grid, seen by consumer warpgroup
  ``wg``: ``(split, m_slice, n_slice, k_slice, wg_m, wg_n)``. Splits
  outermost (the CTAs of one wave share K ranges of w), tiles in
  ``config``'s planar-snake order; the warpgroups split the CTA tile along M
  from 128 rows, else along N (:func:`wg_tile`)."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  tiles_m, tiles_n = tiles
  bm, bn = config.block_m, config.block_n
  wm, wn = wg_tile(bm, bn)
  split = lax.div(lin, jnp.int32(tiles_m * tiles_n))
  mn = lax.rem(lin, jnp.int32(tiles_m * tiles_n))
  mi, ni = plgpu.planar_snake(mn, (tiles_m, tiles_n), config.grid_minor, config.grid_width)
  m_slice, n_slice = pl.ds(mi * bm, bm), pl.ds(ni * bn, bn)
  k_slice = pl.ds(split * split_len, split_len)
  if bm >= 128:
    wg_m, wg_n = pl.ds(wg * wm, wm), slice(None)
  else:
    wg_m, wg_n = slice(None), pl.ds(wg * wn, wn)
  return split, m_slice, n_slice, k_slice, wg_m, wg_n


def store_tile(acc, out_smem, wg, dst, *, epi: tuple[int, int]) -> None:
  """A consumer warpgroup's tile ``acc`` (in the output dtype) to ``dst``
  through ``out_smem[wg]``'s slots, ``epi``-sized sub-tiles, TMA stores
  overlapping the next sub-tile's copy to shared memory."""
  import jax.experimental.pallas.mosaic_gpu as plgpu
  wm, wn = acc.shape
  epi_m, epi_n = epi
  num_slots = out_smem.shape[1]
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  for ei in range(wm // epi_m):
    for ej in range(wn // epi_n):
      e_m = slice(ei * epi_m, (ei + 1) * epi_m)
      e_n = slice(ej * epi_n, (ej + 1) * epi_n)
      slot = (ei * (wn // epi_n) + ej) % num_slots
      plgpu.wait_smem_to_gmem(num_slots - 1, wait_read_only=True)
      out_smem[wg, slot] = acc[e_m, e_n]
      plgpu.commit_smem()
      plgpu.copy_smem_to_gmem(out_smem.at[wg, slot], dst.at[e_m, e_n])


def wgmma_wait_delayed(step, steps: int, delay: int) -> None:
  """A consumer's wait after issuing the wgmma of pipeline step ``step`` of
  ``steps`` when ring slots are released ``delay`` steps late: all but
  ``delay`` wgmmas, and at the last step all of them. (The pipeline never
  releases the last step's slot; the producer starts the next work tile's
  prologue, refilling every slot, as soon as it sees the step before
  released, which the pipeline signals right after this body returns.)"""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  plgpu.wgmma_wait(delay)
  if delay:
    @pl.when(step == steps - 1)
    def _drain():
      plgpu.wgmma_wait(0)


def operand_pipeline(body, compute_context, *, block_m: int, block_n: int, steps: int,
                     num_stages: int, dtype, w_collective: tuple[str, ...] = (),
                     delay_release: int = 0, pipeline_state=None, grid_steps=None):
  """The warp-specialized TMA ring both Mosaic GEMMs run: ``[block_m, 64]``
  blocks of x and ``[64, block_n]`` blocks of w, 128-byte swizzle, one
  producer and two consumer warpgroups (axis ``"wg"``).

  ``w_collective`` names the cluster axis whose CTAs share each w block (TMA
  multicast); ``delay_release`` releases a ring slot that many steps late
  (the consumer then waits for all but that many wgmmas); ``pipeline_state``
  (``plgpu.PipelinePipeline``) chains the pipelines of consecutive work
  tiles. ``grid_steps`` (a traced int32, at most ``steps``) runs that many
  steps instead, with the ring (and the allocations) of ``steps``: a piece
  of a work tile's K range; it takes no ``pipeline_state``."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  swizzle = 128
  transforms = (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)),
                plgpu.SwizzleTransform(swizzle))
  if grid_steps is not None and pipeline_state is not None:
    raise ValueError("operand_pipeline: a traced grid_steps takes no pipeline_state")
  return plgpu.emit_pipeline_warp_specialized(
      body,
      grid=(steps if grid_steps is None else grid_steps,),
      memory_registers=_MEMORY_REGISTERS,
      in_specs=[
          plgpu.BlockSpec((block_m, BLOCK_K), lambda kk: (0, kk), transforms=transforms,
                          memory_space=plgpu.SMEM, delay_release=delay_release),
          plgpu.BlockSpec((BLOCK_K, block_n), lambda kk: (kk, 0), transforms=transforms,
                          memory_space=plgpu.SMEM, delay_release=delay_release,
                          collective_axes=w_collective),
      ],
      wg_axis="wg",
      num_compute_wgs=2,
      max_concurrent_steps=min(num_stages, steps),
      compute_context=compute_context,
      **({} if pipeline_state is None else {"pipeline_state": pipeline_state}),
  )


def persistent_kernel(kernel, out_type, ctas: int, cluster: int = 1, num_threads: int = 3):
  """``kernel`` on a persistent grid of ``ctas`` CTAs (axis ``"sm"``) of
  ``num_threads`` warpgroups (axis ``"wg"``); with ``cluster > 1``, ``ctas``
  clusters of that many CTAs (axis ``"cluster"``)."""
  import jax.experimental.pallas.mosaic_gpu as plgpu

  clusters = dict(cluster=(cluster,), cluster_names=("cluster",)) if cluster > 1 else {}
  return plgpu.kernel(
      kernel,
      out_type=out_type,
      grid=(ctas,),
      grid_names=("sm",),
      **clusters,
      num_threads=num_threads,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )
