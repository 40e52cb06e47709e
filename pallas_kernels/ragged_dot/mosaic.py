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
"""Pallas Mosaic GPU grouped GEMM for Hopper (``lax.ragged_dot`` semantics).

The GEMM core is the one of :mod:`pallas_kernels.matmul.mosaic` (persistent
grid of one CTA per SM, one producer warpgroup streaming TMA blocks into a
ring, two consumer warpgroups running wgmma). What makes it grouped:

* **the work list** (:mod:`pallas_kernels.ragged_dot.worklist`) is computed
  from ``group_sizes`` at run time by a few small XLA ops, vectorised over
  tasks: no loop over experts anywhere, in the kernel or around it, so 8 and
  256 experts cost the same code. The persistent loop runs over
  ``count * tiles_n * split_k`` work items, ``count`` read from memory: empty
  experts cost nothing;
* **row tasks start at multiples of 8 rows** inside each group, not at
  multiples of the tile, so a small group takes one task;
* **stores of a task's valid rows only**, through a ladder of TMA stores of
  ``2**i`` rows (a row count is a sum of powers of two), from a shared-memory
  tile laid out one row per swizzle tile so that any row can start a store
  (as JAX's ``ragged_dot_mgpu``);
* **tail rows** (past ``sum(group_sizes)``) read K blocks past the end of K,
  which TMA fills with zeros, and store those zeros: the result there is 0,
  even where ``lhs`` holds NaN;
* **split-K** as in the GEMM (fp32 partials and one XLA reduction), for
  decode-size groups whose tiles leave SMs idle.

Inputs bfloat16 or float16, fp32 accumulation, output bfloat16, float16 or
float32. ``K`` and ``N`` multiples of 64 (TMA tiling of global memory). TMA
also loads ``lhs`` in tiles of 8 rows: where ``M`` is above 8 and not a
multiple of 8, ``lhs`` is padded with zero rows to one (a copy of ``lhs``,
the smallest operand; the output is written in place, row by row).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._launch import check_ints, match_varying, out_struct
from pallas_kernels.matmul import mosaic as gemm
from pallas_kernels.ragged_dot import worklist

__all__ = ["MosaicRaggedDotConfig", "check_shapes", "ragged_dot", "smem_bytes"]

COMPUTE_CAPABILITY = gemm.COMPUTE_CAPABILITY
DTYPES = gemm.DTYPES
BLOCK_M = gemm.BLOCK_M
BLOCK_N = gemm.BLOCK_N
BLOCK_K = gemm.BLOCK_K
NK_MULTIPLE = gemm.NK_MULTIPLE
M_MULTIPLE = gemm.M_MULTIPLE
_BARRIER_BYTES = 1024
NO_INTERPRET = ("the Mosaic GPU grouped GEMM has no CPU interpret mode; its correctness "
                "is checked on a Hopper GPU (the sweep and benchmarks/ragged_dot_mosaic.py "
                "compare every config with the float32 reference)")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MosaicRaggedDotConfig:
  """Launch parameters of the Mosaic GPU grouped GEMM.

  Attributes:
    block_m: rows per task: 64, 128 or 256.
    block_n: weight columns per task: 64, 128, 192 or 256 (with
      ``block_m = 64``, 128 or 256).
    num_stages: blocks in flight (TMA ring), in [2, 8].
    split_k: K splits per task (>= 1); above 1, fp32 partials summed by XLA.
    grid_minor: order of the work items: 1 walks a task's column tiles
      first (its rows stay in L2), 0 the tasks of a column tile first (the
      expert's weight columns stay in L2).
  """

  block_m: int = 128
  block_n: int = 128
  num_stages: int = 4
  split_k: int = 1
  grid_minor: int = 1

  def __post_init__(self):
    check_ints(self)
    # The GEMM's config carries the tile rules.
    try:
      gemm.MosaicMatmulConfig(block_m=self.block_m, block_n=self.block_n,
                              num_stages=self.num_stages, split_k=self.split_k,
                              grid_minor=self.grid_minor)
    except ValueError as e:
      raise ValueError(str(e).replace("MosaicMatmulConfig", "MosaicRaggedDotConfig")) from None


def smem_bytes(*, block_m: int, block_n: int, num_stages: int, itemsize: int,
               out_itemsize: int) -> int:
  """Shared memory of one CTA: the operand ring and the output tile."""
  ring = num_stages * (block_m + block_n) * BLOCK_K * itemsize
  return ring + block_m * block_n * out_itemsize + _BARRIER_BYTES


def check_shapes(m: int, n: int, k: int, dtype, out_dtype, config) -> None:
  """Raises ``ValueError`` unless the kernel runs ``[m, k] x [G, k, n]``
  (any ``m``: rows are padded to a multiple of 8 for the loads)."""
  gemm.check_shapes(_round8(m), n, k, dtype, out_dtype, gemm.MosaicMatmulConfig(
      block_m=config.block_m, block_n=config.block_n, num_stages=config.num_stages,
      split_k=config.split_k))


def _round8(m: int) -> int:
  return m if m < M_MULTIPLE else -(-m // M_MULTIPLE) * M_MULTIPLE


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
               config: MosaicRaggedDotConfig, out_dtype=None,
               num_sms: int | None = None) -> jax.Array:
  """``lax.ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G])`` with the
  Mosaic GPU kernel (Hopper only).

  Args:
    lhs, rhs: bfloat16 or float16, the same dtype.
    group_sizes: ``[G]`` int32 (a traced array is fine).
    config: launch parameters; used as given.
    out_dtype: bfloat16, float16 or float32 (default ``lhs.dtype``).
    num_sms: CTAs of the persistent grid (default: the SMs of the default
      device, which must then be a Hopper GPU).

  Raises:
    ValueError: bad ranks, shapes or dtypes, shapes the kernel does not run
      (:func:`check_shapes`), or no Hopper GPU.
  """
  if not isinstance(config, MosaicRaggedDotConfig):
    raise ValueError(f"config must be a MosaicRaggedDotConfig; got {type(config).__name__}")
  worklist.check_operands(lhs, rhs, group_sizes)
  out_dtype = jnp.dtype(lhs.dtype if out_dtype is None else out_dtype)
  (m, k), n = lhs.shape, rhs.shape[2]
  check_shapes(m, n, k, lhs.dtype, out_dtype, config)
  if num_sms is None:
    num_sms = gemm.check_device()
  return _ragged_dot(lhs, rhs, group_sizes, config=config, out_dtype=out_dtype,
                     num_sms=int(num_sms))


@functools.partial(jax.jit, static_argnames=("config", "out_dtype", "num_sms"))
def _ragged_dot(lhs, rhs, group_sizes, *, config, out_dtype, num_sms):
  m = lhs.shape[0]
  tasks, count = worklist.row_tasks(group_sizes, m, config.block_m)
  pad = -m % M_MULTIPLE if m > M_MULTIPLE else 0
  if pad:
    # TMA loads lhs in tiles of 8 rows: M must be a multiple of 8. The
    # output is stored row by row and keeps its M rows.
    lhs = jnp.pad(lhs, ((0, pad), (0, 0)))
  if config.split_k == 1:
    return _kernel_call(tasks, count, lhs, rhs, m=m, config=config, out_dtype=out_dtype,
                        num_sms=num_sms)
  partials = _kernel_call(tasks, count, lhs, rhs, m=m, config=config,
                          out_dtype=jnp.dtype(jnp.float32), num_sms=num_sms)
  return partials.sum(axis=0).astype(out_dtype)


def _kernel_call(tasks, count, x, w, *, m, config, out_dtype, num_sms):
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  k, (groups, _, n) = x.shape[1], w.shape
  dtype = x.dtype
  sk = config.split_k
  bm, bn = config.block_m, config.block_n
  wm, wn = gemm.wg_tile(bm, bn)
  split_m = bm >= 128
  tiles_n = pl.cdiv(n, bn)
  steps = gemm.k_steps(k, sk)
  split_len = steps * BLOCK_K
  past_k = sk * split_len  # K offset of the tail tasks: every load is past K
  n_tasks = tasks.shape[1]

  out_swizzle = 128
  out_elems = out_swizzle // out_dtype.itemsize
  # One row per tile: a store may start at any row of the tile.
  out_transforms = (plgpu.TilingTransform((1, out_elems)), plgpu.SwizzleTransform(out_swizzle))

  def get_pipeline(body, compute_context):
    return gemm.operand_pipeline(body, compute_context, block_m=bm, block_n=bn,
                                 steps=steps, num_stages=config.num_stages, dtype=dtype)

  def kernel(tasks_gmem, count_gmem, x_gmem, w_gmem, out_gmem):
    ignore = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(
            x_gmem, w_gmem.at[0]),
        out_smem=plgpu.SMEM((2, wn // out_elems, wm, out_elems), out_dtype,
                            transforms=out_transforms),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, out_smem):
      wg = lax.axis_index("wg")
      count = count_gmem[0]
      per_split = count * tiles_n

      @plgpu.nd_loop((per_split * sk,), collective_axes="sm")
      def _work_loop(info: plgpu.NDLoopInfo):
        (lin,) = info.index
        split = lax.div(lin, per_split)
        rest = lax.rem(lin, per_split)
        if config.grid_minor == 1:
          task, ni = lax.div(rest, jnp.int32(tiles_n)), lax.rem(rest, jnp.int32(tiles_n))
        else:
          task, ni = lax.rem(rest, count), lax.div(rest, count)
        grp = tasks_gmem[worklist.GROUP, task]
        row0 = tasks_gmem[worklist.ROW0, task]
        start = tasks_gmem[worklist.START, task]
        size = tasks_gmem[worklist.SIZE, task]
        tail = grp >= groups
        expert = jnp.minimum(grp, groups - 1)
        k0 = jnp.where(tail, jnp.int32(past_k), split * split_len)
        m_slice = pl.ds(pl.multiple_of(row0, worklist.ALIGN), bm)
        n_slice = pl.ds(ni * bn, bn)
        k_slice = pl.ds(k0, split_len)
        out_ref = out_gmem.at[split] if sk > 1 else out_gmem
        if split_m:
          wg_m, wg_n = pl.ds(wg * wm, wm), slice(None)
          base = wg * wm
          lo = jnp.clip(start - base, 0, wm)
          rows = jnp.clip(start + size - base, 0, wm) - lo
          col0 = ni * bn
        else:
          wg_m, wg_n = slice(None), pl.ds(wg * wn, wn)
          base = jnp.int32(0)
          lo, rows = start, size
          col0 = ni * bn + wg * wn

        def compute_context(eval_pipeline):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wm, wn), jnp.float32))
          def _acc_scope(acc_ref):
            eval_pipeline(acc_ref)
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)
            # Column slices one swizzle wide (64 bf16, 32 fp32), one row per
            # tile: a store may start at any row.
            for j in range(wn // out_elems):
              out_smem[wg, j] = acc_ref[:, j * out_elems:(j + 1) * out_elems].astype(out_dtype)
            plgpu.commit_smem()
            # Store rows [lo, lo + rows) of this warpgroup's tile: one TMA
            # store per set bit of ``rows``, largest first.
            offset = lo
            p = wm
            while p >= 1:
              @pl.when((rows & p) != 0)
              def _store():
                for j in range(wn // out_elems):
                  plgpu.copy_smem_to_gmem(
                      out_smem.at[wg, j, pl.ds(offset, p)],
                      out_ref.at[pl.ds(row0 + base + offset, p),
                                 pl.ds(col0 + j * out_elems, out_elems)],
                      commit_group=False)
              offset = offset + (rows & p)
              p //= 2
            plgpu.commit_smem_to_gmem_group()

        def mma_body(_, x_smem, w_smem, acc_ref):
          plgpu.wgmma(acc_ref, x_smem.at[wg_m], w_smem.at[:, wg_n])
          plgpu.wgmma_wait(0)
          return acc_ref

        get_pipeline(mma_body, compute_context)(
            x_gmem.at[m_slice, k_slice],
            w_gmem.at[expert, k_slice, n_slice],
            allocations=pipeline_allocs,
        )

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  out_shape = (sk, m, n) if sk > 1 else (m, n)
  (tasks, count, x, w), axes = match_varying(tasks, count, x, w)
  return gemm.persistent_kernel(kernel, out_struct(out_shape, out_dtype, axes),
                                min(num_sms, n_tasks * tiles_n * sk))(tasks, count, x, w)
