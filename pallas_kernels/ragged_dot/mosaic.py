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
* **its own ring** (``MosaicRaggedDotOptions.item_ring``): one TMA ring and
  its barriers through all of a CTA's work items, slots counted across
  them; it also runs **192-row tiles** of three 64-row consumer warpgroups
  (``block_m=192``), which hold an expert's rows in one task where they fit
  (192 rows from an aligned start, 185 from any), and a **ping-pong**
  schedule (``MosaicRaggedDotOptions.pingpong``: the consumers take
  alternate items, a whole tile each), measured and not used.

Inputs bfloat16 or float16, fp32 accumulation, output bfloat16, float16 or
float32. ``K`` and ``N`` multiples of 64 (TMA tiling of global memory). TMA
also loads ``lhs`` in tiles of 8 rows: where ``M`` is above 8 and not a
multiple of 8, ``lhs`` is padded with zero rows to one (a copy of ``lhs``,
the smallest operand; the output is written in place, row by row).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels._launch import (SMEM_LIMIT, check_ints, local_items, match_varying,
                                    out_struct)
from pallas_kernels.matmul import mosaic as gemm
from pallas_kernels.ragged_dot import worklist

__all__ = ["Item", "MosaicRaggedDotConfig", "MosaicRaggedDotOptions", "check_shapes",
           "decode_item", "ragged_dot",
           "smem_bytes", "staging_slots", "stream_k_fixup", "stream_k_plan"]

COMPUTE_CAPABILITY = gemm.COMPUTE_CAPABILITY
DTYPES = gemm.DTYPES
BLOCK_M = gemm.BLOCK_M
BLOCK_N = gemm.BLOCK_N
BLOCK_K = gemm.BLOCK_K
NK_MULTIPLE = gemm.NK_MULTIPLE
M_MULTIPLE = gemm.M_MULTIPLE
_BARRIER_BYTES = 1024
#: Registers a thread of the producer warpgroup keeps (the rest go to the
#: consumers: :func:`consumer_registers`).
PRODUCER_REGISTERS = 40
#: Work orders (``MosaicRaggedDotConfig.grid_minor``).
ORDERS = (0, 1, 2)
#: ``grid_minor`` 2: the rows of one band of an expert's tasks take at
#: most this many bytes (a third to a half of a Hopper GPU's L2), so they
#: stay in L2 while the band walks the expert's column tiles.
BAND_BYTES = 24 << 20
#: Tiles of three 64-row consumer warpgroups: ``block_m`` and its ``block_n``.
TRIPLE_M = 192
TRIPLE_N = (128, 192)
NO_INTERPRET = ("the Mosaic GPU grouped GEMM has no CPU interpret mode; its correctness "
                "is checked on a Hopper GPU (the sweep and benchmarks/ragged_dot_mosaic.py "
                "compare every config with the float32 reference)")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MosaicRaggedDotConfig:
  """Launch parameters of the Mosaic GPU grouped GEMM.

  Attributes:
    block_m: rows per task: 64, 128, 192 or 256. 192 runs three consumer
      warpgroups of 64 rows each on the kernel's own ring
      (``MosaicRaggedDotOptions.item_ring``), with ``block_n`` 128 or 192.
    block_n: weight columns per task: 64, 128, 192 or 256 (with
      ``block_m = 64``, 128 or 256).
    num_stages: blocks in flight (TMA ring), in [2, 8].
    split_k: K splits per task (>= 1); above 1, fp32 partials summed by XLA.
    grid_minor: order of the work items: 1 walks a task's column tiles
      first (its rows stay in L2), 0 the tasks of a column tile first (the
      expert's weight columns stay in L2), 2 expert by expert, each
      expert's column tiles in turn, its tasks first within a column
      tile: the tasks of an expert read each weight tile together (it
      comes from HBM once) and their rows stay in L2 (an expert whose rows
      pass :data:`BAND_BYTES` is walked in bands of tasks that fit). Order
      2 also streams the next work item's first K blocks while the
      consumers store the last one, where the K steps of a split are a
      multiple of ``num_stages``.
  """

  block_m: int = 128
  block_n: int = 128
  num_stages: int = 4
  split_k: int = 1
  grid_minor: int = 1

  def __post_init__(self):
    check_ints(self)
    if self.grid_minor not in ORDERS:
      raise ValueError(f"MosaicRaggedDotConfig.grid_minor={self.grid_minor} must be one of "
                       f"{ORDERS} (0: tasks first, 1: column tiles first, 2: by expert)")
    if self.block_m not in (*BLOCK_M, TRIPLE_M):
      raise ValueError(f"MosaicRaggedDotConfig.block_m={self.block_m} must be one of "
                       f"{tuple(sorted((*BLOCK_M, TRIPLE_M)))}")
    if self.block_m == TRIPLE_M and self.block_n not in TRIPLE_N:
      raise ValueError(f"MosaicRaggedDotConfig: block_m={TRIPLE_M} needs block_n in "
                       f"{TRIPLE_N}; got {self.block_n}")
    # The GEMM's config carries the tile rules (a 192-row tile: those of a
    # 128-row one with the same columns).
    try:
      gemm.MosaicMatmulConfig(block_m=128 if self.block_m == TRIPLE_M else self.block_m,
                              block_n=self.block_n,
                              num_stages=self.num_stages, split_k=self.split_k)
    except ValueError as e:
      raise ValueError(str(e).replace("MosaicMatmulConfig", "MosaicRaggedDotConfig")) from None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MosaicRaggedDotOptions:
  """Schedule options of the kernel, outside the tuned config (each default
  is the schedule the shipped tables were measured with).

  Attributes:
    cluster_m: 1, or 2 for clusters of two CTAs that run the two
      ``block_m``-row halves of one ``2 * block_m``-row task (one expert):
      each weight block is loaded once per cluster and multicast to both
      (TMA multicast), halving the weight traffic from L2. (Measured slower
      than one CTA on an H100, docs/results.md; like the next two options
      it is outside the tuned space.)
    delay_release: 0 waits for each wgmma before releasing its ring slot; 1
      keeps one wgmma in flight (the slot is released one step later).
    task_band: with ``grid_minor`` 0, the tasks are walked in bands of this
      many (column tiles of a band, then its tasks): the band's rows stay in
      L2 while an expert's weight tile is shared by its tasks. 0: one band.
    pipeline_tiles: 1 streams the next work item's first blocks while the
      consumers store the last one (one pipeline across a CTA's work
      items; ``grid_minor`` 2 does it wherever it can); needs the K steps
      of a split to be a multiple of ``num_stages`` and ``delay_release`` 0.
    skip_idle: 1 lets a consumer warpgroup whose half of a task (``block_m``
      of 128 or 256 rows) holds no valid row skip its wgmmas: an expert's
      last task of a few rows costs one warpgroup's MMAs, not two. Needs
      ``delay_release`` 0.
    out_slots: how a consumer warpgroup stages its output tile in shared
      memory for the stores. 0: the whole tile, then its stores; ``s >= 1``:
      one column slice (128 bytes wide) at a time through ``s`` slots, each
      slot's stores overlapping the next slice's copy, which leaves shared
      memory for a deeper operand ring (as many slots as slices, or more,
      is the whole tile). -1 (default): :func:`staging_slots` (the whole
      tile where it fits next to the ring, else 2 or 1 slots).
    stream_k: 1 balances the last waves (:func:`stream_k_plan`): where the
      work items do not fill whole waves of the CTAs, the last ``S + r``
      of them (``S`` CTAs, ``r`` items past the last whole wave) are cut
      along K so that every CTA runs the same number of K steps; an item
      cut between two CTAs is summed from their partial tiles after the
      kernel (one XLA scatter of at most ``S - 1`` tiles). Needs
      ``split_k`` 1, ``cluster_m`` 1 and ``delay_release`` 0.
    traced_steps: 1 runs every work item's pipeline with a traced step
      count, as stream-K's pieces run (a diagnostic of that pipeline's
      cost; no chaining across items).
    item_ring: 1 runs one TMA ring through all of a CTA's work items with
      the kernel's own barriers, its slots counted across items: the
      producer loads the next item's first blocks as soon as the consumers
      free slots of the last one, whatever the K steps and ``num_stages``
      (the chained pipeline of ``grid_minor`` 2 needs the steps to be a
      multiple of the stages, and without it the producer waits for the
      ring to drain between items). Needs ``cluster_m`` 1,
      ``pipeline_tiles`` 0, ``skip_idle`` 0, ``stream_k`` 0 and
      ``traced_steps`` 0 (``delay_release`` 1 keeps one wgmma in flight
      there too).
    pingpong: 1 runs that ring with the two consumer warpgroups taking
      alternate work items, each a whole ``block_m x block_n`` tile (at
      most 128 x 128 or 64 x 256: one warpgroup's accumulator), keeping
      one wgmma in flight whatever ``delay_release``: one warpgroup stores
      its tile while the other runs its MMAs, so the tensor cores do not
      idle through the epilogue. Runs on the ring (``item_ring`` 1 or not)
      with its conditions, and needs ``num_stages >= 3`` and ``block_m``
      64 or 128.
  """

  cluster_m: int = 1
  delay_release: int = 0
  task_band: int = 0
  pipeline_tiles: int = 0
  skip_idle: int = 0
  out_slots: int = -1
  stream_k: int = 0
  traced_steps: int = 0
  item_ring: int = 0
  pingpong: int = 0

  def __post_init__(self):
    check_ints(self)
    if self.cluster_m not in (1, 2):
      raise ValueError(f"MosaicRaggedDotOptions.cluster_m={self.cluster_m} must be 1 or 2")
    if self.delay_release not in (0, 1):
      raise ValueError(f"MosaicRaggedDotOptions.delay_release={self.delay_release} must be "
                       f"0 or 1")
    if self.task_band < 0:
      raise ValueError(f"MosaicRaggedDotOptions.task_band={self.task_band} must be >= 0")
    if self.pipeline_tiles not in (0, 1):
      raise ValueError(f"MosaicRaggedDotOptions.pipeline_tiles={self.pipeline_tiles} must be "
                       f"0 or 1")
    if self.pipeline_tiles and self.delay_release:
      raise ValueError("MosaicRaggedDotOptions: pipeline_tiles=1 needs delay_release=0")
    if self.skip_idle not in (0, 1):
      raise ValueError(f"MosaicRaggedDotOptions.skip_idle={self.skip_idle} must be 0 or 1")
    if self.skip_idle and self.delay_release:
      raise ValueError("MosaicRaggedDotOptions: skip_idle=1 needs delay_release=0")
    if self.stream_k not in (0, 1):
      raise ValueError(f"MosaicRaggedDotOptions.stream_k={self.stream_k} must be 0 or 1")
    if self.stream_k and (self.cluster_m > 1 or self.delay_release):
      raise ValueError("MosaicRaggedDotOptions: stream_k=1 needs cluster_m=1 and "
                       "delay_release=0")
    if self.traced_steps not in (0, 1):
      raise ValueError(f"MosaicRaggedDotOptions.traced_steps={self.traced_steps} must be 0 "
                       f"or 1")
    if self.item_ring not in (0, 1):
      raise ValueError(f"MosaicRaggedDotOptions.item_ring={self.item_ring} must be 0 or 1")
    if self.pingpong not in (0, 1):
      raise ValueError(f"MosaicRaggedDotOptions.pingpong={self.pingpong} must be 0 or 1")
    if self.ring and (self.cluster_m > 1 or self.pipeline_tiles
                      or self.skip_idle or self.stream_k or self.traced_steps):
      what = "pingpong=1 (on the kernel's ring)" if self.pingpong else "item_ring=1"
      raise ValueError(f"MosaicRaggedDotOptions: {what} needs cluster_m=1, "
                       "pipeline_tiles=0, skip_idle=0, stream_k=0 and traced_steps=0")
    if self.out_slots < -1:
      raise ValueError(f"MosaicRaggedDotOptions.out_slots={self.out_slots} must be >= -1 "
                       f"(-1: by the shared memory left, 0: the whole tile, s: s slots)")


  @property
  def ring(self) -> bool:
    """Whether the kernel runs on its own ring (``item_ring`` or
    ``pingpong``)."""
    return bool(self.item_ring or self.pingpong)


DEFAULT_OPTIONS = MosaicRaggedDotOptions()


def smem_bytes(*, block_m: int, block_n: int, num_stages: int, itemsize: int,
               out_itemsize: int, out_slots: int = -1, pingpong: bool = False) -> int:
  """Shared memory of one CTA: the operand ring and the output staging (the
  whole tile, or ``out_slots`` column slices per consumer warpgroup; -1:
  :func:`staging_slots`). ``pingpong``: each consumer warpgroup stages a
  whole ``block_m x block_n`` tile (``MosaicRaggedDotOptions.pingpong``)."""
  ring = num_stages * (block_m + block_n) * BLOCK_K * itemsize
  if out_slots == -1:
    out_slots = staging_slots(block_m=block_m, block_n=block_n, num_stages=num_stages,
                              itemsize=itemsize, out_itemsize=out_itemsize,
                              pingpong=pingpong)
  return (ring + out_staging(block_m, block_n, out_itemsize, out_slots, pingpong=pingpong)
          + _BARRIER_BYTES)


def staging_slots(*, block_m: int, block_n: int, num_stages: int, itemsize: int,
                  out_itemsize: int, pingpong: bool = False) -> int:
  """The output staging a config runs with by default: 0 (the whole tile)
  where it fits next to the operand ring in :data:`SMEM_LIMIT`, else 2
  slots, else 1. Staged a slice at a time, 128 x 256 tiles take a ring of 4
  stages where the whole tile allowed 3: 0.99-1.08x the 3-stage ring on an
  H100 (docs/results.md); with the same ring, slices ran 0.995-1.014x the
  whole tile."""
  ring = num_stages * (block_m + block_n) * BLOCK_K * itemsize + _BARRIER_BYTES
  for slots in (0, 2, 1):
    if ring + out_staging(block_m, block_n, out_itemsize, slots,
                          pingpong=pingpong) <= SMEM_LIMIT:
      return slots
  return 1


def out_staging(block_m: int, block_n: int, out_itemsize: int, out_slots: int = 0, *,
                pingpong: bool = False) -> int:
  """Bytes of shared memory that stage the output tile for its stores
  (``out_slots`` 0: the whole tile; ``s >= 1``: ``s`` column slices per
  consumer warpgroup; -1 is resolved by :func:`smem_bytes`)."""
  if out_slots < 0:
    raise ValueError(f"out_staging needs out_slots >= 0 (resolve -1 with staging_slots); "
                     f"got {out_slots}")
  wm, wn = wg_tile(block_m, block_n, pingpong)
  slices = _out_slices(wn, out_itemsize)
  return (consumers(block_m) * min(slices, out_slots or slices) * wm * (wn // slices)
          * out_itemsize)


def consumer_registers(n_cons: int) -> int:
  """Registers a consumer thread takes: those the producer leaves, shared by
  the ``n_cons`` consumer warpgroups (as the GEMM's pipeline)."""
  return min(256, (512 - PRODUCER_REGISTERS) // n_cons) // 8 * 8


def consumers(block_m: int) -> int:
  """Consumer warpgroups of a ``block_m``-row tile: 3 for 192 rows, else 2."""
  return 3 if block_m == TRIPLE_M else 2


#: ``MosaicRaggedDotOptions.pingpong``: one warpgroup's accumulator holds at
#: most this many fp32 values (128 registers a thread).
PINGPONG_ELEMS = 128 * 128


def wg_tile(block_m: int, block_n: int, pingpong: bool = False) -> tuple[int, int]:
  """One consumer warpgroup's tile: the whole tile under ``pingpong``, 64
  rows of a 192-row tile, else the GEMM's split
  (:func:`pallas_kernels.matmul.mosaic.wg_tile`)."""
  if pingpong:
    return block_m, block_n
  return (64, block_n) if block_m == TRIPLE_M else gemm.wg_tile(block_m, block_n)


def _out_slices(wn: int, out_itemsize: int) -> int:
  """Column slices (one 128-byte swizzle wide) of a warpgroup's tile."""
  return max(1, wn * out_itemsize // 128)


def check_shapes(m: int, n: int, k: int, dtype, out_dtype, config) -> None:
  """Raises ``ValueError`` unless the kernel runs ``[m, k] x [G, k, n]``
  (any ``m``: rows are padded to a multiple of 8 for the loads)."""
  gemm.check_shapes(_round8(m), n, k, dtype, out_dtype, gemm.MosaicMatmulConfig(
      block_m=128 if config.block_m == TRIPLE_M else config.block_m, block_n=config.block_n,
      num_stages=config.num_stages, split_k=config.split_k), kernel="Mosaic GPU grouped GEMM")


def _round8(m: int) -> int:
  return m if m < M_MULTIPLE else -(-m // M_MULTIPLE) * M_MULTIPLE


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
               config: MosaicRaggedDotConfig, out_dtype=None,
               num_sms: int | None = None,
               options: MosaicRaggedDotOptions = DEFAULT_OPTIONS) -> jax.Array:
  """``lax.ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G])`` with the
  Mosaic GPU kernel (Hopper only).

  Args:
    lhs, rhs: bfloat16 or float16, the same dtype.
    group_sizes: ``[G]`` int32 (a traced array is fine).
    config: launch parameters; used as given.
    out_dtype: bfloat16, float16 or float32 (default ``lhs.dtype``).
    num_sms: CTAs of the persistent grid (default: the SMs of the default
      device, which must then be a Hopper GPU).
    options: schedule options (:class:`MosaicRaggedDotOptions`).

  Raises:
    ValueError: bad ranks, shapes or dtypes, shapes the kernel does not run
      (:func:`check_shapes`), or no Hopper GPU.
  """
  if not isinstance(config, MosaicRaggedDotConfig):
    raise ValueError(f"config must be a MosaicRaggedDotConfig; got {type(config).__name__}")
  if not isinstance(options, MosaicRaggedDotOptions):
    raise ValueError(f"options must be MosaicRaggedDotOptions; got {type(options).__name__}")
  if options.task_band and config.grid_minor != 0:
    raise ValueError(f"options.task_band={options.task_band} needs config.grid_minor=0")
  if options.delay_release and config.num_stages < 3:
    raise ValueError("options.delay_release=1 needs config.num_stages >= 3")
  if config.block_m == TRIPLE_M and not options.ring:
    # Three consumer warpgroups run on the kernel's own ring only.
    try:
      options = dataclasses.replace(options, item_ring=1)
    except ValueError as e:
      raise ValueError(f"block_m={TRIPLE_M} runs on the kernel's own ring: {e}") from None
  if options.pingpong and (config.block_m not in (64, 128)
                          or config.block_m * config.block_n > PINGPONG_ELEMS
                          or config.num_stages < 3):
    raise ValueError(f"options.pingpong=1 runs a whole tile per consumer warpgroup: it needs "
                     f"block_m 64 or 128, block_m * block_n <= {PINGPONG_ELEMS} (128 x 128, "
                     f"64 x 256 or less) and num_stages >= 3; got {config.block_m} x "
                     f"{config.block_n}, {config.num_stages} stages")
  if options.stream_k and config.split_k > 1:
    raise ValueError(f"options.stream_k=1 needs config.split_k=1; got {config.split_k}")
  worklist.check_operands(lhs, rhs, group_sizes)
  out_dtype = jnp.dtype(lhs.dtype if out_dtype is None else out_dtype)
  (m, k), n = lhs.shape, rhs.shape[2]
  check_shapes(m, n, k, lhs.dtype, out_dtype, config)
  if options.pipeline_tiles and gemm.k_steps(k, config.split_k) % config.num_stages:
    raise ValueError(f"options.pipeline_tiles=1 needs the {gemm.k_steps(k, config.split_k)} "
                     f"K steps of a split to be a multiple of num_stages="
                     f"{config.num_stages}")
  if num_sms is None:
    num_sms = gemm.check_device()
  return _ragged_dot(lhs, rhs, group_sizes, config=config, out_dtype=out_dtype,
                     num_sms=int(num_sms), options=options)


@functools.partial(jax.jit, static_argnames=("config", "out_dtype", "num_sms", "options"))
def _ragged_dot(lhs, rhs, group_sizes, *, config, out_dtype, num_sms, options=DEFAULT_OPTIONS):
  m = lhs.shape[0]
  bm = config.block_m * options.cluster_m
  tasks, count = worklist.row_tasks(group_sizes, m, bm,
                                    band_cap=band_cap(bm, lhs.shape[1], lhs.dtype.itemsize)
                                    if config.grid_minor == 2 else 0)
  pad = -m % M_MULTIPLE if m > M_MULTIPLE else 0
  if pad:
    # TMA loads lhs in tiles of 8 rows: M must be a multiple of 8. The
    # output is stored row by row and keeps its M rows.
    lhs = jnp.pad(lhs, ((0, pad), (0, 0)))
  if options.stream_k:
    out, parts = _kernel_call(tasks, count, lhs, rhs, m=m, config=config,
                              out_dtype=out_dtype, num_sms=num_sms, options=options)
    return stream_k_fixup(out, parts, tasks, count, steps=gemm.k_steps(lhs.shape[1], 1),
                          block_n=config.block_n, grid_minor=config.grid_minor,
                          band=options.task_band)
  if config.split_k == 1:
    return _kernel_call(tasks, count, lhs, rhs, m=m, config=config, out_dtype=out_dtype,
                        num_sms=num_sms, options=options)
  partials = _kernel_call(tasks, count, lhs, rhs, m=m, config=config,
                          out_dtype=jnp.dtype(jnp.float32), num_sms=num_sms, options=options)
  return partials.sum(axis=0).astype(out_dtype)


def band_cap(block_m: int, k: int, itemsize: int) -> int:
  """Tasks per band under ``grid_minor`` 2 (:data:`BAND_BYTES` of rows)."""
  return max(1, BAND_BYTES // (block_m * k * itemsize))


def _pipelined(config, options, steps: int) -> bool:
  if options.pipeline_tiles:
    return True
  return config.grid_minor == 2 and not options.delay_release and steps % config.num_stages == 0


def _kernel_call(tasks, count, x, w, *, m, config, out_dtype, num_sms, options):
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu

  k, (groups, _, n) = x.shape[1], w.shape
  dtype = x.dtype
  sk = config.split_k
  bm, bn = config.block_m, config.block_n
  pp = bool(options.pingpong)
  wm, wn = wg_tile(bm, bn, pp)
  split_m = bm >= 128
  tiles_n = pl.cdiv(n, bn)
  steps = gemm.k_steps(k, sk)
  split_len = steps * BLOCK_K
  past_k = sk * split_len  # K offset of the tail tasks: every load is past K
  n_tasks = tasks.shape[1]
  cm = options.cluster_m
  delay = options.delay_release
  band = options.task_band
  ctas = min(num_sms // cm, n_tasks * tiles_n * sk)
  stream = bool(options.stream_k)
  halves = partial_halves(out_dtype)

  out_swizzle = 128
  out_elems = out_swizzle // out_dtype.itemsize
  slices = wn // out_elems
  slots = options.out_slots
  if slots == -1:
    slots = staging_slots(block_m=bm, block_n=bn, num_stages=config.num_stages,
                          itemsize=dtype.itemsize, out_itemsize=out_dtype.itemsize,
                          pingpong=pp)
  slots = min(slices, slots or slices)
  # One row per tile: a store may start at any row of the tile.
  out_transforms = (plgpu.TilingTransform((1, out_elems)), plgpu.SwizzleTransform(out_swizzle))

  def make_emit(out_smem, wg):
    """Consumer ``wg``'s store of its output tile through ``out_smem``."""

    def emit(acc_ref, value, dst, row0, base, lo, rows, col0):
      """Stores rows [lo, lo + rows) of this warpgroup's tile ``value(acc
      slice)`` to ``dst`` (module doc: row-exact TMA stores, the whole
      tile or a column slice at a time through the slots)."""
      plgpu.wait_smem_to_gmem(0, wait_read_only=True)
      # Column slices one swizzle wide (64 bf16, 32 fp32), one row per
      # tile: a store may start at any row.
      def stage(j, slot):
        out_smem[wg, slot] = value(acc_ref[:, j * out_elems:(j + 1) * out_elems])
      if slots == slices:  # the whole tile, then its stores
        for j in range(slices):
          stage(j, j)
        plgpu.commit_smem()
        store_rows(out_smem, wg, dst, row0, base, lo, rows, col0)
      else:  # a slice at a time through the slots
        for j in range(slices):
          if j >= slots:
            plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
          stage(j, j % slots)
          plgpu.commit_smem()
          store_rows(out_smem, wg, dst, row0, base, lo, rows, col0,
                     parts=((j % slots, j),))
    return emit

  def get_pipeline(body, compute_context, state=None, grid_steps=None):
    return gemm.operand_pipeline(body, compute_context, block_m=bm, block_n=bn,
                                 steps=steps, num_stages=config.num_stages, dtype=dtype,
                                 w_collective=("cluster",) if cm > 1 else (),
                                 delay_release=delay, pipeline_state=state,
                                 grid_steps=grid_steps)

  def kernel(tasks_gmem, count_gmem, x_gmem, w_gmem, out_gmem, *parts_gmem):
    ignore = lambda *_, **__: None

    @functools.partial(
        pl.run_scoped,
        pipeline_allocs=get_pipeline(ignore, ignore).get_allocations(
            x_gmem, w_gmem.at[0]),
        out_smem=plgpu.SMEM((2, slots, wm, out_elems), out_dtype,
                            transforms=out_transforms),
        collective_axes="wg",
    )
    def _scope(pipeline_allocs, out_smem):
      wg = lax.axis_index("wg")
      cta = lax.axis_index("cluster") if cm > 1 else 0
      count = count_gmem[0]
      per_split = count * tiles_n

      emit = make_emit(out_smem, wg)

      def run_item(lin, *, kb0=0, grid_steps=None, state=None, piece=None):
        """Work item ``lin`` (split-major), K blocks ``[kb0, kb0 +
        grid_steps)`` of its split (default: all). ``piece`` ``(whole,
        slot)``: store the tile to the output where ``whole``, else as
        partial ``slot`` of this CTA (stream-K)."""
        split, ni, row0, start, size, expert, k0 = decode_item(
            lin, per_split, count, tasks_gmem, tiles_n=tiles_n, grid_minor=config.grid_minor,
            groups=groups, past_k=past_k, split_len=split_len, band=band)
        if cm > 1:
          # This CTA's half of the cluster's task: rows [cta * bm, cta * bm + bm).
          lo_c = jnp.clip(start - cta * bm, 0, bm)
          hi_c = jnp.clip(start + size - cta * bm, 0, bm)
          row0 = row0 + cta * bm
          start, size = lo_c, hi_c - lo_c
        k0 = k0 + kb0 * BLOCK_K
        m_slice, n_slice, k_slice, out_ref = item_windows(
            row0, ni, k0, split, out_gmem, block_m=bm, block_n=bn, split_len=split_len,
            split_k=sk)
        wg_m, wg_n, base, lo, rows, col0 = consumer_part(wg, ni, start, size, block_n=bn,
                                                         wg_tile=(wm, wn))
        cast = lambda a: a.astype(out_dtype)

        def compute_context(eval_pipeline):
          @functools.partial(pl.run_scoped, acc_ref=plgpu.ACC((wm, wn), jnp.float32))
          def _acc_scope(acc_ref):
            eval_pipeline(acc_ref)
            if delay:
              plgpu.wgmma_wait(0)
            if piece is None:
              emit(acc_ref, cast, out_ref, row0, base, lo, rows, col0)
              return
            whole, slot = piece
            pl.when(whole)(lambda: emit(acc_ref, cast, out_ref, row0, base, lo, rows, col0))

            @pl.when(jnp.logical_not(whole))
            def _partial():
              # The whole [wm, wn] part, as ``halves`` terms whose sum is
              # the fp32 tile (hi, then the rest) in the output dtype.
              pbase, pcol = (base, 0) if wn == bn else (jnp.int32(0), wg * wn)
              dst = parts_gmem[0].at[lax.axis_index("sm"), slot]
              emit(acc_ref, cast, dst.at[0], 0, pbase, 0, jnp.int32(wm), pcol)
              if halves == 2:
                emit(acc_ref, lambda a: cast(a - cast(a).astype(jnp.float32)), dst.at[1], 0,
                     pbase, 0, jnp.int32(wm), pcol)

        def mma_body(idx, x_smem, w_smem, acc_ref):
          def mma():
            plgpu.wgmma(acc_ref, x_smem.at[wg_m], w_smem.at[:, wg_n])
            gemm.wgmma_wait_delayed(idx[0], steps, delay)
          if options.skip_idle and split_m:
            # This warpgroup's rows of the task are all past its group.
            pl.when(rows > 0)(mma)
          else:
            mma()
          return acc_ref

        get_pipeline(mma_body, compute_context, state, grid_steps)(
            x_gmem.at[m_slice, k_slice],
            w_gmem.at[expert, k_slice, n_slice],
            allocations=pipeline_allocs,
        )

      total = per_split * sk
      if stream:
        dp_items, sk_steps = stream_k_plan(total, ctas, steps)
      else:
        dp_items = total

      @plgpu.nd_loop((dp_items,), collective_axes="sm")
      def _work_loop(info: plgpu.NDLoopInfo):
        (lin,) = info.index
        state = None
        # (Not under stream-K: a CTA of one whole item would leave its
        # pipeline, START alone, unquiesced before its pieces.)
        if options.traced_steps:
          # A value known only at run time (a constant could be folded).
          run_item(lin, grid_steps=lax.div(per_split, per_split) * steps)
          return
        if not stream and _pipelined(config, options, steps):
          # One pipeline across this CTA's work items: the first fills the
          # ring, the last drains it, the others keep it streaming.
          state = jnp.where(info.local_index == 0, plgpu.PipelinePipeline.START,
                            jnp.where(info.local_index == info.num_local_steps - 1,
                                      plgpu.PipelinePipeline.STOP,
                                      plgpu.PipelinePipeline.STEADY)).astype(jnp.int32)
        run_item(lin, state=state)

      if stream:
        # This CTA's share of the last items' K steps: at most a piece of
        # an item begun by the CTA before, whole items, and the first
        # piece of an item the next CTA ends (stream_k_plan).
        c = lax.axis_index("sm")
        first = lax.div(c * sk_steps, jnp.int32(ctas))
        end = lax.div((c + 1) * sk_steps, jnp.int32(ctas))

        def piece_body(_, pos):
          item = lax.div(pos, jnp.int32(steps))
          kb0 = lax.rem(pos, jnp.int32(steps))
          kb1 = jnp.minimum(jnp.int32(steps), kb0 + end - pos)
          whole = (kb0 == 0) & (kb1 == steps)

          @pl.when(pos < end)
          def _piece():
            run_item(dp_items + item, kb0=kb0, grid_steps=kb1 - kb0,
                     piece=(whole, jnp.where(kb0 > 0, 0, 1)))
          return jnp.where(pos < end, pos + kb1 - kb0, pos)

        lax.fori_loop(0, STREAM_K_PIECES, piece_body, first)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  def ring_kernel(tasks_gmem, count_gmem, x_gmem, w_gmem, out_gmem):
    """``options.ring``: one TMA ring through all of this CTA's work
    items (items ``cta``, ``cta + ctas``, ...), its slots counted across
    them, with the kernel's own ready and consumed barriers. Under
    ``options.pingpong`` the consumer warpgroups take alternate items, each
    with its own ready barriers (a warpgroup waits on every phase of its
    own, none of the other's)."""
    stages = config.num_stages
    n_cons = consumers(bm)
    owners = 2 if pp else 1
    elems = 128 // dtype.itemsize
    in_transforms = (plgpu.TilingTransform((8, elems)), plgpu.SwizzleTransform(128))

    @functools.partial(
        pl.run_scoped,
        x_smem=plgpu.SMEM((stages, bm, BLOCK_K), dtype, transforms=in_transforms),
        w_smem=plgpu.SMEM((stages, BLOCK_K, bn), dtype, transforms=in_transforms),
        out_smem=plgpu.SMEM((n_cons, slots, wm, out_elems), out_dtype,
                            transforms=out_transforms),
        x_ready=plgpu.Barrier(num_barriers=owners * stages),
        w_ready=plgpu.Barrier(num_barriers=owners * stages),
        consumed=plgpu.Barrier(num_arrivals=1 if pp else n_cons, num_barriers=stages),
        collective_axes="wg",
    )
    def _scope(x_smem, w_smem, out_smem, x_ready, w_ready, consumed):
      wg = lax.axis_index("wg")
      cta = lax.axis_index("sm")
      n_local, item = cta_items(cta, ctas, count_gmem[0], tasks_gmem, out_gmem,
                                tiles_n=tiles_n, split_k=sk, grid_minor=config.grid_minor,
                                groups=groups, past_k=past_k, split_len=split_len,
                                block_m=bm, block_n=bn, band=band)

      def wait_ready(ready, slot):
        plgpu.barrier_wait(x_ready.at[ready + slot])
        plgpu.barrier_wait(w_ready.at[ready + slot])

      def mma_steps(acc_ref, g, ready, x_ring, w_ring, *, hold: bool):
        """One item's K steps from ring step ``g`` (ready barriers from
        ``ready``; :func:`ring_consume`)."""
        ring_consume(acc_ref, g, steps=steps, stages=stages, consumed=consumed, hold=hold,
                     wait_ready=lambda slot: wait_ready(ready, slot),
                     mma=lambda acc, slot: plgpu.wgmma(acc, x_ring.at[slot], w_ring.at[slot]))

      @pl.when(wg < n_cons)
      def _consumers():
        # The registers the producer leaves, shared (as the GEMM's pipeline).
        plgpu.set_max_registers(consumer_registers(n_cons), action="increase")
        emit = make_emit(out_smem, wg)

        def run_item(i, g):
          it, (_, _, _, out_ref) = item(i)
          wg_m, wg_n, base, lo, rows, col0 = consumer_part(wg, it.ni, it.start, it.size,
                                                           block_n=bn, wg_tile=(wm, wn))

          def tile(acc_ref):
            mma_steps(acc_ref, g, 0, x_smem.at[:, wg_m], w_smem.at[:, :, wg_n],
                      hold=bool(delay))
            emit(acc_ref, lambda a: a.astype(out_dtype), out_ref, it.row0, base, lo, rows,
                 col0)

          pl.run_scoped(tile, plgpu.ACC((wm, wn), jnp.float32))
          return g + steps

        def run_own_item(j, carry):
          # This warpgroup's j-th item: the CTA's item 2 j + wg, the whole
          # tile, one wgmma kept in flight (a slot is released a step
          # late). Its ring slots start at the items before it.
          i = 2 * j + wg
          g = i * steps
          it, (_, _, _, out_ref) = item(i)

          def tile(acc_ref):
            mma_steps(acc_ref, g, wg * stages, x_smem, w_smem, hold=True)
            emit(acc_ref, lambda a: a.astype(out_dtype), out_ref, it.row0, jnp.int32(0),
                 it.start, it.size, it.ni * bn)

          pl.run_scoped(tile, plgpu.ACC((wm, wn), jnp.float32))
          return carry

        if pp:
          # Items wg, wg + 2, ... below n_local.
          lax.fori_loop(0, lax.div(n_local - wg + 1, 2), run_own_item, None)
        else:
          lax.fori_loop(0, n_local, run_item, jnp.int32(0))

      @pl.when(wg == n_cons)
      def _producer():
        plgpu.set_max_registers(PRODUCER_REGISTERS, action="decrease")

        def item_loads(i):
          it, (m_slice, n_slice, _, _) = item(i)
          # The ready barriers of the warpgroup that runs the item.
          ready = lax.rem(i, 2) * stages if pp else 0

          def load(kk, slot):
            k_slice = pl.ds(it.k0 + kk * BLOCK_K, BLOCK_K)
            plgpu.copy_gmem_to_smem(x_gmem.at[m_slice, k_slice], x_smem.at[slot],
                                    x_ready.at[ready + slot])
            plgpu.copy_gmem_to_smem(w_gmem.at[it.expert, k_slice, n_slice], w_smem.at[slot],
                                    w_ready.at[ready + slot])
          return load

        ring_produce(n_local, steps=steps, stages=stages, consumed=consumed,
                     item_loads=item_loads)

    plgpu.wait_smem_to_gmem(0, wait_read_only=True)

  out_shape = (sk, m, n) if sk > 1 else (m, n)
  (tasks, count, x, w), axes = match_varying(tasks, count, x, w)
  out_type = out_struct(out_shape, out_dtype, axes)
  if stream:
    out_type = (out_type, out_struct((ctas, 2, halves, bm, bn), out_dtype, axes))
  if options.ring:
    return gemm.persistent_kernel(ring_kernel, out_type, ctas,
                                  num_threads=consumers(bm) + 1)(tasks, count, x, w)
  return gemm.persistent_kernel(kernel, out_type, ctas, cluster=cm)(tasks, count, x, w)


def cta_items(cta, ctas: int, count, tasks, out_gmem, *, tiles_n: int, split_k: int,
              grid_minor: int, groups: int, past_k: int, split_len: int, block_m: int,
              block_n: int, band: int = 0):
  """The work items of CTA ``cta`` of ``ctas`` on a kernel's own ring (items
  ``cta``, ``cta + ctas``, ... below ``count * tiles_n * split_k``):
  ``(n_local, item)``, their number (0 where the items are fewer than the
  CTAs) and ``item(i)``, its ``i``-th as ``(Item, windows)``
  (:func:`decode_item`, :func:`item_windows`)."""
  per_split = count * tiles_n
  n_local = local_items(cta, per_split * split_k, ctas)

  def item(i):
    it = decode_item(cta + i * ctas, per_split, count, tasks, tiles_n=tiles_n,
                     grid_minor=grid_minor, groups=groups, past_k=past_k,
                     split_len=split_len, band=band)
    return it, item_windows(it.row0, it.ni, it.k0, it.split, out_gmem, block_m=block_m,
                            block_n=block_n, split_len=split_len, split_k=split_k)

  return n_local, item


def ring_consume(acc_ref, g, *, steps: int, stages: int, wait_ready, mma, consumed,
                 hold: bool) -> None:
  """A consumer warpgroup's K steps of one work item on a TMA ring of
  ``stages`` slots, from ring step ``g`` (the steps of the items before):
  per step ``wait_ready(slot)`` (the slot's ready barriers), ``mma(acc_ref,
  slot)`` (its wgmma), and the slot's ``consumed`` barrier arrived on once
  the wgmma is done. ``hold`` keeps one wgmma in flight (a slot is released
  one step late, the last at the end), else each is waited for."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  stages_ = jnp.int32(stages)

  def step(kk, carry):
    slot = lax.rem(g + kk, stages_)
    wait_ready(slot)
    mma(acc_ref, slot)
    if not hold:
      plgpu.wgmma_wait(0)
      plgpu.barrier_arrive(consumed.at[slot])
      return carry
    plgpu.wgmma_wait(1)

    @pl.when(kk > 0)
    def _release():
      plgpu.barrier_arrive(consumed.at[lax.rem(g + kk - 1, stages_)])
    return carry

  lax.fori_loop(0, steps, step, None)
  if hold:
    plgpu.wgmma_wait(0)
    plgpu.barrier_arrive(consumed.at[lax.rem(g + steps - 1, stages_)])


def ring_produce(n_local, *, steps: int, stages: int, consumed, item_loads) -> None:
  """The producer warpgroup of a TMA ring of ``stages`` slots through
  ``n_local`` work items of ``steps`` K steps each, slots counted across the
  items: ``item_loads(i)`` returns ``load(kk, slot)``, which issues item
  ``i``'s K block ``kk`` into ``slot`` (its TMA copies and ready barriers);
  a slot is refilled once its ``consumed`` barrier says the consumers are
  done with it, so the next item's first blocks stream while the consumers
  finish the last one."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  stages_ = jnp.int32(stages)

  def stream_item(i, g):
    load = item_loads(i)

    def step(kk, carry):
      slot = lax.rem(g + kk, stages_)

      @pl.when(g + kk >= stages)
      def _wait():
        plgpu.barrier_wait(consumed.at[slot])

      load(kk, slot)
      return carry

    lax.fori_loop(0, steps, step, None)
    return g + steps

  lax.fori_loop(0, n_local, stream_item, jnp.int32(0))


#: Pieces of one CTA's stream-K range: a piece of an item begun before, a
#: whole item, the first piece of the next (stream_k_plan).
STREAM_K_PIECES = 3


def partial_halves(out_dtype) -> int:
  """Terms of a stream-K partial tile in the output dtype: 1 for float32,
  else 2 (the rounded tile and what rounding lost, which sum to the fp32
  tile to about 16 bits)."""
  return 1 if jnp.dtype(out_dtype) == jnp.float32 else 2


def stream_k_plan(items, ctas: int, steps: int):
  """``(data-parallel items, stream-K steps)`` of ``items`` work items of
  ``steps`` K steps each on ``ctas`` CTAs (traced int32 or ints).

  Where the items fill whole waves, or less than one wave, all of them run
  whole (the second term is 0). Otherwise the first ``(items // ctas - 1) *
  ctas`` run whole, interleaved over the CTAs, and the last ``ctas + r``
  (``r = items % ctas``) are cut along K: CTA ``c`` runs their steps
  ``[c * T // ctas, (c + 1) * T // ctas)`` of ``T = (ctas + r) * steps``.
  Each CTA's range is at least ``steps`` long, so an item is cut between at
  most two consecutive CTAs: the first piece ends one CTA's range, the
  rest begins the next one's."""
  if isinstance(items, int):
    q, r = divmod(items, ctas)
    return ((q - 1) * ctas, (ctas + r) * steps) if q >= 1 and r > 0 else (items, 0)
  # lax.div and lax.rem: non-negative operands, and the ops a kernel lowers.
  q, r = lax.div(items, jnp.int32(ctas)), lax.rem(items, jnp.int32(ctas))
  on = (q >= 1) & (r > 0)
  return (jnp.where(on, (q - 1) * ctas, items),
          jnp.where(on, (ctas + r) * steps, 0).astype(jnp.int32))


def stream_k_fixup(out, parts, tasks, count, *, steps: int, block_n: int, grid_minor: int,
                   band: int = 0):
  """The output of a stream-K launch (:func:`stream_k_plan`): each item cut
  between CTAs ``c`` and ``c + 1`` is the sum of ``c``'s last partial
  (``parts[c, 1]``) and ``c + 1``'s first (``parts[c + 1, 0]``), stored to
  its task's valid rows (one scatter; the other rows are dropped)."""
  m, n = out.shape
  ctas, _, halves, bm, bn = parts.shape
  tiles_n = -(-n // block_n)
  dp_items, sk_steps = stream_k_plan(count[0] * tiles_n, ctas, steps)
  c = jnp.arange(ctas - 1, dtype=jnp.int32)
  end = (c + 1) * sk_steps // ctas
  cut = (sk_steps > 0) & (end % steps != 0)
  item = jnp.where(cut, dp_items + end // steps, 0)
  task, ni = work_item(item, count[0], tiles_n, grid_minor, tasks, band)
  row0, start, size = (tasks[r, task][:, None] for r in (worklist.ROW0, worklist.START,
                                                         worklist.SIZE))
  tile = sum(parts[:-1, 1, h].astype(jnp.float32) + parts[1:, 0, h].astype(jnp.float32)
             for h in range(halves))
  # One update window per row and 64 columns (N is a multiple of 64, so a
  # window is wholly inside N or wholly past it); rows outside the task's
  # valid ones, and items not cut, go to row m: dropped.
  r = jnp.arange(bm, dtype=jnp.int32)[None, :]
  rows = jnp.where(cut[:, None] & (r >= start) & (r < start + size), row0 + r, m)
  chunks = bn // NK_MULTIPLE
  cols = ni[:, None] * block_n + NK_MULTIPLE * jnp.arange(chunks, dtype=jnp.int32)[None, :]
  idx = jnp.stack(jnp.broadcast_arrays(rows[:, :, None], cols[:, None, :]), axis=-1)
  updates = tile.astype(out.dtype).reshape(-1, NK_MULTIPLE)
  dims = lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                     scatter_dims_to_operand_dims=(0, 1))
  return lax.scatter(out, idx.reshape(-1, 2), updates, dims, unique_indices=True,
                     mode=lax.GatherScatterMode.FILL_OR_DROP)


def work_item(rest, count, tiles_n: int, grid_minor: int, tasks, band: int = 0):
  """``(task, column tile)`` of work item ``rest`` of a split under the work
  order ``grid_minor`` (:class:`MosaicRaggedDotConfig`; with ``band``, order
  0 in bands of that many tasks). ``count`` is the tasks in use, ``tasks``
  the work list (a kernel's ref)."""
  if grid_minor == 1:
    return lax.div(rest, jnp.int32(tiles_n)), lax.rem(rest, jnp.int32(tiles_n))
  if grid_minor == 2:
    return worklist.banded_item(rest, tiles_n, tasks)
  if band:
    # Bands of ``band`` tasks (the last may be narrower), column tiles
    # outer within a band.
    b_idx = lax.div(rest, jnp.int32(band * tiles_n))
    b_rest = lax.rem(rest, jnp.int32(band * tiles_n))
    width = jnp.minimum(jnp.int32(band), count - b_idx * band)
    return b_idx * band + lax.rem(b_rest, width), lax.div(b_rest, width)
  return lax.rem(rest, count), lax.div(rest, count)


class Item(NamedTuple):
  """One work item of the grouped kernels, as :func:`decode_item` reads it."""
  split: jax.Array   # its K split
  ni: jax.Array      # its column tile
  row0: jax.Array    # the task's first row (a multiple of 8)
  start: jax.Array   # the task's first valid row within its block
  size: jax.Array    # the task's valid rows
  expert: jax.Array  # the weight it multiplies (the last one for the tail)
  k0: jax.Array      # its first K offset: past K for the tail, so its loads are zeros


def decode_item(lin, per_split, count, tasks, *, tiles_n: int, grid_minor: int, groups: int,
                past_k: int, split_len: int, band: int = 0) -> Item:
  """Work item ``lin`` (split-major; ``per_split`` = ``count * tiles_n``
  items a split) of the work list ``tasks`` under the order ``grid_minor``."""
  split = lax.div(lin, per_split)
  task, ni = work_item(lax.rem(lin, per_split), count, tiles_n, grid_minor, tasks, band)
  grp, row0, start, size = (tasks[r, task] for r in (worklist.GROUP, worklist.ROW0,
                                                     worklist.START, worklist.SIZE))
  k0 = jnp.where(grp >= groups, jnp.int32(past_k), split * split_len)
  return Item(split, ni, row0, start, size, jnp.minimum(grp, groups - 1), k0)


def item_windows(row0, ni, k0, split, out_gmem, *, block_m: int, block_n: int,
                 split_len: int, split_k: int):
  """A work item's ``(rows, columns, K)`` windows of ``x``, ``w`` and the
  output, and the output it writes (its split's partials where ``split_k >
  1``)."""
  import jax.experimental.pallas as pl
  return (pl.ds(pl.multiple_of(row0, worklist.ALIGN), block_m), pl.ds(ni * block_n, block_n),
          pl.ds(k0, split_len), out_gmem.at[split] if split_k > 1 else out_gmem)


def consumer_part(wg, ni, start, size, *, block_n: int, wg_tile: tuple[int, int]):
  """Consumer warpgroup ``wg``'s part of a task at column tile ``ni``: ``(rows
  slice of the x block, columns slice of the w block, first row of its part
  within the task, its first valid row and valid rows within that part, its
  first output column)``. The two consumers split ``block_m`` of 128 or more
  rows, else the columns; ``start, size`` are the task's valid rows."""
  import jax.experimental.pallas as pl
  wm, wn = wg_tile
  if wn == block_n:  # the consumers split M
    wg_m, wg_n = pl.ds(wg * wm, wm), slice(None)
    base = wg * wm
    lo = jnp.clip(start - base, 0, wm)
    rows = jnp.clip(start + size - base, 0, wm) - lo
    return wg_m, wg_n, base, lo, rows, ni * block_n
  wg_m, wg_n = slice(None), pl.ds(wg * wn, wn)
  return wg_m, wg_n, jnp.int32(0), start, size, ni * block_n + wg * wn


def store_rows(out_smem, wg, out_ref, row0, base, lo, rows, col0, parts=None) -> None:
  """Stores rows ``[lo, lo + rows)`` of consumer ``wg``'s output tile
  ``out_smem[wg]`` (``[consumers, column slices, rows, slice width]``, one row
  per swizzle tile) to ``out_ref`` rows from ``row0 + base + lo``, columns
  from ``col0``: one TMA store per set bit of ``rows``, largest first (a row
  count is a sum of powers of two), then one commit. ``parts``: the
  ``(slot, column slice)`` pairs to store (default: slot ``j`` holds slice
  ``j``, all of them)."""
  import jax.experimental.pallas as pl
  import jax.experimental.pallas.mosaic_gpu as plgpu
  _, slices, wm, width = out_smem.shape
  if parts is None:
    parts = tuple((j, j) for j in range(slices))
  offset = lo
  p = wm
  while p >= 1:
    @pl.when((rows & p) != 0)
    def _store():
      for slot, j in parts:
        plgpu.copy_smem_to_gmem(
            out_smem.at[wg, slot, pl.ds(offset, p)],
            out_ref.at[pl.ds(row0 + base + offset, p), pl.ds(col0 + j * width, width)],
            commit_group=False)
    offset = offset + (rows & p)
    p //= 2
  plgpu.commit_smem_to_gmem_group()
