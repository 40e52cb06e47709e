"""The Mosaic GPU backend of the grouped-GEMM family
(``pallas_kernels.ragged_dot.mosaic``)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax.numpy as jnp
import numpy as np

from pallas_kernels.matmul.mosaic import k_steps
from pallas_kernels.ragged_dot import mosaic as kernel
from pallas_kernels.ragged_dot.mosaic import MosaicRaggedDotConfig
from wavetune_jax.core.family import Backend
from wavetune_jax.core.hardware import Hardware
from wavetune_jax.families.matmul.triton import _aux, _cdiv, _next_pow2
from wavetune_jax.families.ragged_dot.problem import RaggedDotProblem
from wavetune_jax.families.ragged_dot.routing import expected_tasks, expected_tasks_spread

__all__ = ["MosaicRaggedDot", "MosaicRaggedDotConfig"]

#: Tiles of three 64-row consumer warpgroups (the kernel's own ring): the
#: rule's, outside the swept space (TRIPLE_GPUS).
TRIPLE_TILES = ((192, 192), (192, 128))
#: GPUs (exact ``device_key``) whose rule takes a 192-row tile where a
#: balanced router's experts fit one task of it and the 128-row tiles need
#: two (measured on an H200 only, docs/results.md).
TRIPLE_GPUS = frozenset({"nvidia_h200"})
#: The gain in wave-quantized tile work (the waves of the work items times
#: the tile's area) a 192-row tile needs over the 128 x 256 rule. Under a
#: balanced router (H200, 21 problems of 130-224 rows per expert,
#: docs/results.md) the ratio was 1.067-1.231 where the 192-row tiles won,
#: 0.667-0.978 where they did not.
TRIPLE_MARGIN = 1.05
#: At most this share of the experts may spill into a second 192-row task
#: (on an H200 the 192-row tiles ran 1.06-1.17x the 128 x 256 rule at a
#: spill of 0.11-0.27, 1.01x at 0.38 and 0.74-0.92x from 0.5) ...
TRIPLE_SPILL = 0.3
#: ... and with fewer than TRIPLE_MANY experts at most TRIPLE_SPILL_FEW, a
#: cautious choice on one decoder: Mixtral-8x7B's w13 at 175 rows per expert
#: (a 0.14 spill) ran 1.061x in one draw of the router at 176 rows, but its
#: grouped GEMMs 0.985x in a four-layer decoder's prefill (32 experts:
#: gpt-oss-20b's prefill 1.019x). No decoder of 9-31 experts was run.
TRIPLE_SPILL_FEW = 0.1
TRIPLE_MANY = 16
#: ... and 128-row tiles must take at least this many tasks an expert.
TRIPLE_SPLIT = 1.5
#: Task tiles (block_m, block_n).
TILES = ((64, 128), (64, 256), (128, 64), (128, 128), (128, 192), (128, 256), (256, 64),
         (256, 128))
STAGES = (2, 3, 4, 5, 6)
SPLIT_K = (1, 2, 4, 8)
#: Orders of the swept space (order 2 under RG7).
ORDERS = (1, 0, 2)
#: Tiles that walk experts in order 2 (RG7).
ORDER2_TILES = ((64, 256), (128, 256), (256, 128))

# The space (see MosaicRaggedDot.space), on compute capability 9.0 only:
#  RG1 shape:  bfloat16/float16 inputs, N and K multiples of 64.
#  RG2 smem:   the operand ring and the whole output tile fit the shared
#              memory (the unpruned space: the output as the kernel stages
#              it, a slice at a time where the whole tile does not fit).
#  RG3 size:   block_m <= max(64, next_pow2(rows per expert)) under balanced
#              routing: taller tasks load rows of other experts.
#  RG4 split:  split_k > 1 only while the expected tasks x column tiles
#              fill less than one wave, with work * split_k <= 2 * SMs and
#              at least 4 K steps per split.
#  RG5 order:  both orders only where the work takes more than one wave.
#  RG6 stages: pruned: 4, or the deepest ring that fits below 4.
#  RG7 by expert: order 2 only with the 64 x 256, 128 x 256 and 256 x 128
#              tiles, above 64 rows per expert (balanced routing; at 64 or
#              fewer an expert's tasks share no weight tile). On an H100, of
#              the order-2 configs on 10 problems of 128 to 2,048 rows per
#              expert, one of these was the fastest on 8, and 128 x 128 with
#              6 stages (out of RG6's space) on 2 by at most 0.4%
#              (benchmarks/ragged_dot_efficiency.py --mode orders,
#              data/probes/ragged_dot_efficiency_orders_h100.json).
#  RG8 deeper ring: order 2 on 128 x 256 tiles also at 4 stages, which fit
#              only with the output staged a slice at a time (RG2 and RG6
#              count the whole tile). On an H100 it ran 0.99-1.08x the
#              3-stage ring (geomean 1.03x) on 11 problems of 128 to 2,048
#              rows per expert (--mode epilogue,
#              data/probes/ragged_dot_efficiency_epilogue_h100.json).

#: GPUs (``device_key`` prefixes) whose rule runs order 2 on 128 x 256 tiles
#: with 4 stages (RG8), not 3. Over the 128-511 rows per expert of the
#: sweeps, 4 stages over 3: 1.031x on the H100 (42 problems, 0.946-1.102x),
#: 1.008x on the H200 (40 problems); Mixtral-8x7B's four-layer prefill on the
#: H200 ran 0.958x at 2,048 tokens with 4 (docs/results.md). Elsewhere 3,
#: including the H100's PCIe and NVL forms, never measured.
DEEPER_RING = ("nvidia_h100_80gb_hbm3",)


class MosaicRaggedDot(Backend):
  """The persistent Mosaic GPU grouped GEMM (Hopper): a run-time work list of
  8-row-aligned row tasks, TMA ring, wgmma, row-exact stores, split-K."""

  name = "mosaic"
  kernel_cache = True
  config_cls = MosaicRaggedDotConfig
  macro_fields = ("block_m", "block_n", "split_k")
  micro_fields = ("num_stages", "grid_minor")
  folded_fields = ("split_k",)
  interpret = False

  def supported_on(self, hw: Hardware) -> bool:
    return hw.compute_capability == kernel.COMPUTE_CAPABILITY

  @staticmethod
  def runs_shape(p: RaggedDotProblem) -> bool:
    return (p.dtype in kernel.DTYPES and p.n % kernel.NK_MULTIPLE == 0
            and p.k % kernel.NK_MULTIPLE == 0)

  def smem_bytes(self, p: RaggedDotProblem, c: MosaicRaggedDotConfig,
                 out_slots: int = -1) -> int:
    """Shared memory of ``c`` with the kernel's output staging (``out_slots``
    -1, the default: as it runs; 0: the whole tile)."""
    return kernel.smem_bytes(block_m=c.block_m, block_n=c.block_n, num_stages=c.num_stages,
                             itemsize=p.itemsize,
                             out_itemsize=4 if c.split_k > 1 else
                             jnp.dtype(p.out_dtype).itemsize, out_slots=out_slots)

  def space(self, p: RaggedDotProblem, hw: Hardware, *, prune: bool = True):
    if not self.runs_shape(p):
      return ()
    out = []
    for c in self._weight_candidates(p.g, p.n, p.k, p.dtype, p.out_dtype, hw, prune):
      if self._keep(p, c, hw, prune):
        out.append(c)
    return tuple(out)

  @functools.lru_cache(maxsize=256)
  def _weight_candidates(self, g, n, k, dtype, out_dtype, hw: Hardware, prune: bool):
    p = RaggedDotProblem(m=8, g=g, k=k, n=n, dtype=dtype, out_dtype=out_dtype)
    out = []
    for (bm, bn), sk, gm in itertools.product(TILES, SPLIT_K, ORDERS):
      if sk > _cdiv(k, kernel.BLOCK_K) or (prune and sk > 1 and k_steps(k, sk) < 4):
        continue  # validity, RG4 (K part)
      if sk > 1 and gm != ORDERS[0]:
        continue  # RG5: split-K runs in one wave or two
      if gm == 2 and (bm, bn) not in ORDER2_TILES:
        continue  # RG7
      fits = [ns for ns in STAGES
              if self.smem_bytes(p, MosaicRaggedDotConfig(
                  block_m=bm, block_n=bn, num_stages=ns, split_k=sk),
                  0 if prune else -1) <= hw.smem_per_block]
      if not fits:
        continue  # RG2
      stages = [max(s for s in fits if s <= 4)] if prune and min(fits) <= 4 else fits
      if prune and gm == 2 and (bm, bn) == (128, 256) and 4 not in stages:
        c4 = MosaicRaggedDotConfig(block_m=bm, block_n=bn, num_stages=4, split_k=sk)
        if self.smem_bytes(p, c4) <= hw.smem_per_block:
          stages = stages + [4]  # RG8
      for ns in stages:  # RG6
        out.append(MosaicRaggedDotConfig(block_m=bm, block_n=bn, num_stages=ns, split_k=sk,
                                         grid_minor=gm))
    return tuple(out)

  @staticmethod
  def _keep(p: RaggedDotProblem, c: MosaicRaggedDotConfig, hw: Hardware, prune: bool) -> bool:
    work = int(expected_tasks(p.m, p.g, c.block_m)) * _cdiv(p.n, c.block_n)
    if c.split_k > 1 and not (work < hw.num_sms and work * c.split_k <= 2 * hw.num_sms):
      return False  # RG4
    if c.grid_minor != ORDERS[0] and work <= hw.num_sms:
      return False  # RG5
    if c.grid_minor == 2 and p.m <= 64 * min(p.g, p.m):
      return False  # RG7
    if prune:
      per = -(-p.m // min(p.g, p.m))
      if c.block_m > max(64, _next_pow2(per)):
        return False  # RG3
    return True

  def validate(self, p: RaggedDotProblem, config, hw: Hardware | None = None) -> None:
    if not isinstance(config, MosaicRaggedDotConfig):
      raise ValueError(f"config must be a MosaicRaggedDotConfig; got {config!r}")
    if (config.block_m, config.block_n) not in TILES + TRIPLE_TILES:
      raise ValueError(f"the Mosaic GPU grouped GEMM runs the tiles {TILES + TRIPLE_TILES}; "
                       f"got {config.block_m}x{config.block_n}")
    kernel.check_shapes(p.m, p.n, p.k, p.dtype, p.out_dtype, config)
    if hw is not None and self.smem_bytes(p, config) > hw.smem_per_block:
      raise ValueError(f"config {config} needs {self.smem_bytes(p, config)} bytes of shared "
                       f"memory; {hw.name} allows {hw.smem_per_block} per block")

  def heuristic(self, p: RaggedDotProblem, hw: Hardware) -> MosaicRaggedDotConfig | None:
    """A rule from the H100 and H200 sweeps (``data/sweeps/*/ragged_dot_bfloat16.jsonl.gz``).

    ``r`` = rows per expert under balanced routing. None (XLA's ragged dot)
    where every one of fewer than 16 experts is likely busy, ``r < 32`` and
    the weight is wider than deep (``N > K``, a w13): both read all the
    weights at the memory's speed, and XLA was 0-5% faster (Mixtral's w13,
    16-64 tokens). On a deep, narrow weight (``K > N``, a w2) XLA's op falls
    behind as rows grow: Mixtral's w2 (K 14,336, N 4,096) at 32 / 96 / 128
    rows ran 1.01 / 1.04 / 1.09x faster with the rule's 64 x 256 tiles on the
    H100 and 1.01 / 1.08 / 1.12x on the H200. Elsewhere the Mosaic kernel: it reads only the
    experts that have rows, and XLA's ragged dot slows down with many
    experts (Arctic's 128: 8.1x). ``r > 128``: 128 x 256 tiles, 3 stages
    (4 on the H100, :data:`DEEPER_RING`), walked expert by expert (``grid_minor`` 2: an expert's tasks read each
    weight tile together, their rows stay in L2). On an H100
    (``benchmarks/ragged_dot_efficiency.py``, uniform routing, 7 problems
    of 192 to 2,048 rows per expert) it ran at 0.89-1.00 of cuBLAS's
    batched GEMM on the same rows (geomean 0.945 with one 48-row problem),
    where the orders of the sweeps' rule (tasks first where the weight has
    more than 16 column tiles of 256, column tiles first below) ran at
    0.56-0.89 (geomean 0.777): tasks first re-reads every row once per
    column tile, column tiles first an expert's weight once per task.
    Under a skewed router it was 1.14-1.36x faster than those orders on 5
    of 7 and 0.92-0.98x on 3 (order 0 won where the hot experts' rows fit
    L2). ``64 < r <= 128``: the same order on 64 x 256 tiles, 4 stages:
    within 5% of the best config on 17 / 18 of the 18 problems of 96-128
    rows per expert (0.989 / 0.996 of the best, H200 / H100), where 128 x 256
    ran at 0.955 / 0.969 of it (64 x 256 over it 1.035x / 1.028x, 0.95-1.11x;
    a 128-row task at 96-128 rows leaves rows empty under balanced routing,
    and twice the tasks fill the waves). ``56 <= r <= 64``: 64 x 128 tiles, 4
    stages, tasks first where the weight has more than 16 column tiles of
    128 (column tiles first at 16 or fewer, below; where 128-row tiles are
    out of the space, RG3):
    the best at 64 rows per expert on every problem of the H100 and H200
    sweeps, where 64 x 256 ran at 0.76-0.97 of it; at 48-50 rows per
    expert 64 x 256 was 1-6% faster again, and between 50 and 64 nothing
    was measured (twice the column tiles
    balance the waves; walking an expert's row tasks first reuses its
    weight tile). With at most 16 column tiles of 128 (OLMoE's N of 2,048)
    column tiles first: 1.00 and 0.998 of the best on the H100 at 4,096
    rows, where tasks first ran at 0.81 and 0.89; with 32 to 224 column
    tiles tasks first won on every problem of both sweeps (the other order
    0.71-0.99 of the best). Below: 64 x 256, 4 stages, column tiles first, split-K
    where the tiles fill at most half the SMs. Measured as rules over both
    sweeps (six models each; 195 / 187 problems), before order 2 existed:
    0.978 / 0.988 of the oracle (H100 / H200).
    """
    if not (self.supported_on(hw) and self.runs_shape(p)):
      return None
    r = p.m / min(p.g, p.m)
    likely_all_busy = p.m > p.g * np.log(p.g)
    if p.g < 16 and likely_all_busy and r < 32 and p.n > p.k:
      return None
    deeper = False
    if r > 128:
      deeper = hw.device_key.startswith(DEEPER_RING)
      c = MosaicRaggedDotConfig(block_m=128, block_n=256, num_stages=4 if deeper else 3,
                                grid_minor=2)
      triple = self._triple(p, hw)
      if triple is not None:
        return triple
    elif r > 64:
      c = MosaicRaggedDotConfig(block_m=64, block_n=256, num_stages=4, grid_minor=2)
    elif r >= 56:  # measured at 64 (this wins) and 48-50 (64 x 256 wins by 1-6%)
      # Tasks first where the weight has more than 16 column tiles, as above.
      order = 0 if _cdiv(p.n, 128) > 16 else 1
      c = MosaicRaggedDotConfig(block_m=64, block_n=128, num_stages=4, grid_minor=order)
    else:
      # Split-K where the expected work tiles fill at most half the SMs and
      # each split keeps at least 16 K steps (Mixtral's w2 at one token:
      # split 4 ran 2.1x faster than split 1 on the H200).
      work = int(expected_tasks(p.m, p.g, 64)) * _cdiv(p.n, 256)
      sk = next((s for s in (4, 2) if work * s <= hw.num_sms and k_steps(p.k, s) >= 16), 1)
      c = MosaicRaggedDotConfig(block_m=64, block_n=256, num_stages=4, split_k=sk, grid_minor=1)
    # The ring is sized with the whole output tile staged (the sweeps' fp16
    # and bf16 outputs; a float32 output then takes fewer stages, as it
    # always did), except the H100's 4-stage ring for 16-bit outputs (RG8).
    rg8 = (deeper and c.num_stages == 4 and c.grid_minor == 2
           and jnp.dtype(p.out_dtype).itemsize == 2)
    while (self.smem_bytes(p, c, -1 if rg8 else 0) > hw.smem_per_block
           and c.num_stages > 2):
      c = dataclasses.replace(c, num_stages=c.num_stages - 1)
    return c

  def _triple(self, p: RaggedDotProblem, hw: Hardware) -> MosaicRaggedDotConfig | None:
    """A 192-row tile (three 64-row consumer warpgroups, walked by expert)
    where, under a balanced router with its spread
    (:func:`~wavetune_jax.families.ragged_dot.routing.expected_tasks_spread`),
    an expert's rows fit one 192-row task (at most
    :data:`TRIPLE_SPILL` of the experts take a second) while 128-row tiles
    take two (at least :data:`TRIPLE_SPLIT` tasks an expert), and the
    wave-quantized tile work (the waves of the work items times the tile's
    area) is :data:`TRIPLE_MARGIN` times smaller than the 128 x 256 rule's.
    On an H200 at 128 experts x 192 rows (K 2,048, N 1,536; uniform
    routing) 192 x 192 ran 1.24x the 128 x 256 rule's config (0.940 of
    cuBLAS's batched GEMM, against 0.756); where the two tilings take the
    same rows (375 per expert) it ran 0.93-1.02x. Under a balanced
    router (21 problems of 130-224 rows per expert, eight weights) the
    rule takes 192-row tiles on 11 of the 12 where they ran 1.02-1.17x the
    128 x 256 config (about 129-181 rows per expert; with fewer than 16
    experts up to about 172, :data:`TRIPLE_SPILL_FEW`) and keeps 128 x 256
    on the 9 where the best 192-row tile ran 0.74-1.01x: at a mean of 184
    rows and more, a third of the experts or more spill into a second
    task. None off :data:`TRIPLE_GPUS` and where the whole output tile
    does not fit next to the ring."""
    if hw.device_key not in TRIPLE_GPUS:
      return None
    active = min(p.g, p.m)
    spill = TRIPLE_SPILL if p.g >= TRIPLE_MANY else TRIPLE_SPILL_FEW
    if (expected_tasks_spread(p.m, p.g, 192) > (1 + spill) * active
            or expected_tasks_spread(p.m, p.g, 128) < TRIPLE_SPLIT * active):
      return None

    def work(bm, bn):
      items = expected_tasks_spread(p.m, p.g, bm) * _cdiv(p.n, bn)
      return math.ceil(items / hw.num_sms) * bm * bn

    base = work(128, 256)
    best, best_work = None, math.inf
    for (bm, bn), ns in zip(TRIPLE_TILES, (3, 4)):
      c = MosaicRaggedDotConfig(block_m=bm, block_n=bn, num_stages=ns, grid_minor=2)
      if self.smem_bytes(p, c, 0) > hw.smem_per_block:
        continue
      w = work(bm, bn)
      if w < best_work:
        best, best_work = c, w
    return best if best is not None and best_work * TRIPLE_MARGIN <= base else None

  def occupancy_bound(self, problem, config, hw: Hardware) -> int:
    return 1  # one persistent CTA per SM

  def size_quantum(self, p: RaggedDotProblem) -> int | None:
    return 1 if self.runs_shape(p) else None

  def coords(self, p: RaggedDotProblem, macro: dict) -> tuple[int, int]:
    """``G`` = expected row tasks (balanced routing) x column tiles x splits,
    ``L`` = K steps of one split."""
    tasks = int(expected_tasks(p.m, p.g, macro["block_m"]))
    return (tasks * _cdiv(p.n, macro["block_n"]) * macro["split_k"],
            k_steps(p.k, macro["split_k"]))

  def aux(self, p: RaggedDotProblem, config) -> tuple[float, ...]:
    return tuple(float(v) for v in _aux(p.m, p.n, config.split_k))

  def run(self, p: RaggedDotProblem, config, lhs, rhs, group_sizes, *,
          interpret: bool = False, num_sms: int | None = None):
    if interpret:
      raise NotImplementedError(kernel.NO_INTERPRET)
    return kernel.ragged_dot(lhs, rhs, group_sizes, config=config,
                             out_dtype=jnp.dtype(p.out_dtype), num_sms=num_sms)
