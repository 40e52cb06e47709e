"""The Mosaic GPU backend of the decode family (``pallas_kernels.decode.mosaic``)."""

from __future__ import annotations

import dataclasses
import functools
import itertools

from pallas_kernels.attention import common
from pallas_kernels.decode import mosaic as kernel
from pallas_kernels.decode.mosaic import MosaicDecodeConfig
from wavetune_jax.core.family import Backend
from wavetune_jax.core import hardware
from wavetune_jax.core.hardware import Hardware
from wavetune_jax.families.decode.problem import DecodeProblem

__all__ = ["MosaicDecode", "MosaicDecodeConfig", "bounded_window", "coords_aux"]

STAGES = (2, 3)
NUM_SPLITS = (1, 2, 4, 8, 16, 32, 64)

# The space (see MosaicDecode.space), on compute capability 9.0 only:
#  K1 shape:     bfloat16 / float16, head_dim a multiple of 16 in [64, 256],
#                the cache's sequence dimension (kv_len, or page_size) a
#                multiple of 8; on a paged cache block_k and page_size
#                divide one another.
#  K2 smem:      the K/V ring, the query tile and the epilogue buffers
#                (kernel.smem_bytes) <= shared memory per block.
#  K3 registers: fp32 output and scores per consumer thread,
#                64 * (head_dim + block_k) / 128 <= 160.
#  K4 splits:    (pruning) num_splits as the chunks that hold keys, and
#                CTAs (KV heads x row tiles x splits) <= 4 waves of SMs
#                unless num_splits = 1; no block longer than the cache;
#                256-key blocks only up to head_dim 64 (above, one 64-key
#                block already moves 16-32 KB per operand, and 256 keys
#                leave a ring of 2 stages at most). Stages 2 and 3: on an
#                H100 (benchmarks/decode_mosaic.py) 4 stages never won.


def coords_aux(p: DecodeProblem, block_k: int, num_splits: int):
  """``(G, L, aux)``: CTAs, key blocks per CTA (of the full cache; under a
  left window bound, of the window's keys and, on average, half a block
  before them: the chunks start at the block that holds the first key, and
  the kernel's splits cut them) and ``[splits > 1, MB of fp32 partials]``."""
  s = kernel.splits_of(p.kv_len, num_splits, block_k)
  tiles = -(-p.rows // kernel.BLOCK_H)
  g = p.batch * p.kv_heads * tiles * s
  if p.window_left < 0:
    l = kernel.chunk_len(p.kv_len, num_splits, block_k) // block_k
  else:
    l = kernel.chunk_len(min(p.kv_len, p.span + block_k // 2), s, block_k) // block_k
  mb = (s * p.batch * p.kv_heads * kernel.padded_rows(p.rows) * p.head_dim * 4 / 1e6
        if s > 1 else 0.0)
  return g, float(l), (float(s > 1), mb)


def bounded_window(p: DecodeProblem) -> tuple[int, int] | None:
  """The problem's window with an unbounded side (-1) as the cache's length
  (the same keys), as the kernel takes it; None without a window."""
  return common.bounded_window(p.window, p.kv_len)


class MosaicDecode(Backend):
  """Mosaic GPU flash-decoding (Hopper: TMA ring, wgmma, one producer and
  one consumer warpgroup; 64 query rows of one KV head per CTA), on a
  contiguous or a paged cache. No CPU interpret mode."""

  name = "mosaic"
  kernel_cache = True
  config_cls = MosaicDecodeConfig
  macro_fields = ("block_k", "num_splits")
  micro_fields = ("num_stages",)
  folded_fields = ("num_splits",)
  interpret = False

  def supported_on(self, hw: Hardware) -> bool:
    return hw.compute_capability == kernel.COMPUTE_CAPABILITY

  @staticmethod
  def why_not(p: DecodeProblem) -> str | None:
    """Why the kernel cannot run ``p`` (None: it can)."""
    page = p.page_size
    try:
      kernel.check_shapes((p.batch, p.q_len, p.q_heads, p.head_dim),
                          (p.batch, page or p.kv_len, p.kv_heads, p.head_dim), p.dtype,
                          page_size=page or None)
    except ValueError as e:
      return str(e)
    return None

  def smem_bytes(self, p: DecodeProblem, c: MosaicDecodeConfig) -> int:
    split = kernel.splits_of(p.kv_len, c.num_splits, c.block_k) > 1
    return kernel.smem_bytes(block_k=c.block_k, num_stages=c.num_stages,
                             head_dim=p.head_dim, itemsize=p.itemsize, split=split)

  def space(self, problem: DecodeProblem, hw: Hardware, *, prune: bool = True) -> tuple:
    """Rules K1-K4 (K1-K3 with ``prune=False``: they are validity)."""
    p = problem
    if self.why_not(p):
      return ()
    tiles = -(-p.rows // kernel.BLOCK_H)
    return self._space(p.batch * p.kv_heads * tiles, -(-p.kv_len // 64) * 64, p.head_dim,
                       p.itemsize, p.page_size, hw, prune)

  @functools.lru_cache(maxsize=2048)
  def _space(self, ctas, kv_len, head_dim, itemsize, page, hw, prune):
    out, seen = [], set()
    for bk, st, ns in itertools.product(kernel.BLOCK_K, STAGES, NUM_SPLITS):
      if page and page % bk and bk % page:
        continue  # K1
      if 64 * (head_dim + bk) // 128 > 160:
        continue  # K3
      ns = kernel.splits_of(kv_len, ns, bk)
      split = ns > 1
      if kernel.smem_bytes(block_k=bk, num_stages=st, head_dim=head_dim, itemsize=itemsize,
                           split=split) > hw.smem_per_block:
        continue  # K2
      if prune and (bk > max(64, kv_len) or (ns > 1 and ctas * ns > 4 * hw.num_sms)
                    or (bk == 256 and head_dim > 64)):
        continue  # K4
      key = (bk, st, ns)
      if key not in seen:
        seen.add(key)
        out.append(MosaicDecodeConfig(block_k=bk, num_stages=st, num_splits=ns))
    return tuple(out)

  def size_quantum(self, problem: DecodeProblem) -> int | None:
    """The space and (G, L) see kv_len through 64-key blocks, and the kernel
    runs multiples of 8 only: 8 where it runs ``problem`` (its size is then
    the top of its bucket), None where it does not (the other backends'
    quantum answers)."""
    return None if self.why_not(problem) else 8

  def validate(self, problem: DecodeProblem, config, hw: Hardware | None = None) -> None:
    if not isinstance(config, MosaicDecodeConfig):
      raise ValueError(f"config must be a MosaicDecodeConfig; got {config!r}")
    why = self.why_not(problem)
    if why:
      raise ValueError(why)
    page = problem.page_size
    if page and page % config.block_k and config.block_k % page:
      raise ValueError(f"config {config}: block_k and page_size={page} must divide one "
                       f"another")
    if hw is not None and self.smem_bytes(problem, config) > hw.smem_per_block:
      raise ValueError(f"config {config} needs {self.smem_bytes(problem, config)} bytes of "
                       f"shared memory; {hw.name} allows {hw.smem_per_block} per block")

  def heuristic(self, problem: DecodeProblem, hw: Hardware) -> MosaicDecodeConfig | None:
    """Two stages; 128-key blocks up to head_dim 128, else 64 (registers);
    splits, a power of two, so that the CTAs reach four waves with
    per-sequence lengths (a short sequence's CTAs finish early) and half a
    wave with full caches, at most 64, at least 256 keys per chunk (of the
    keys a sequence reads: half the cache with lengths, the whole cache
    without). A window of at most half the cache, with per-sequence
    lengths (without them, the full caches' rule): the window's keys, as
    many splits as fill one wave down to 128 keys a chunk, 64-key blocks,
    and 3 stages where the CTAs fill a wave unsplit. Read off the H100
    window sweep (``wavetune sweep --family decode --windows``, 72 window
    problems): 0.978 of the oracle (min 0.886) against 0.944 (min 0.797)
    for the rule before it (256 keys a chunk, always 2 stages). The rest
    is read off ``benchmarks/decode_mosaic.py`` on an H100 (docs/results.md,
    "Decode on Hopper: the Mosaic kernel and the paged cache")."""
    p = problem
    if self.why_not(p):
      return None
    page = p.page_size
    bk = 128 if p.head_dim <= 128 and not p.windowed else 64
    if page and page % bk and bk % page:
      bk = 64 if page % 64 == 0 or 64 % page == 0 else None
      if bk is None:
        return None
    ctas = p.batch * p.kv_heads * -(-p.rows // kernel.BLOCK_H)
    # A window at most half the cache: most sequences read all of it, so
    # their CTAs take equal time, as with full caches (one wave of them).
    local = p.lengths and p.window_left >= 0 and 2 * p.span <= p.kv_len
    target = hw.num_sms if local else (4 * hw.num_sms if p.lengths else hw.num_sms // 2)
    keys = p.span if local or not p.lengths else p.kv_len / 2
    least = 128 if local else 256  # keys a chunk
    ns = 1
    while ctas * ns * 2 <= target and ns < 64 and keys / (2 * ns) >= least:
      ns *= 2
    c = MosaicDecodeConfig(block_k=bk, num_stages=2,
                           num_splits=kernel.splits_of(p.kv_len, ns, bk))
    deeper = dataclasses.replace(c, num_stages=3)
    if (local and ns == 1 and ctas >= hw.num_sms
        and self.smem_bytes(p, deeper) <= hw.smem_per_block):
      c = deeper
    return c if self.smem_bytes(p, c) <= hw.smem_per_block else None

  def occupancy_bound(self, problem: DecodeProblem, config, hw: Hardware) -> int:
    return max(1, min(hw.smem_per_sm // max(1, self.smem_bytes(problem, config)), 2))

  def coords(self, problem: DecodeProblem, macro: dict) -> tuple[int, float]:
    g, l, _ = coords_aux(problem, macro["block_k"], macro["num_splits"])
    return g, l

  def aux(self, problem: DecodeProblem, config) -> tuple[float, ...]:
    return coords_aux(problem, config.block_k, config.num_splits)[2]

  def run(self, problem: DecodeProblem, config, q, k, v, *extra, interpret: bool = False,
          scale: float | None = None):
    if interpret:
      raise NotImplementedError(kernel.NO_INTERPRET)
    from wavetune_jax.families.decode.family import decode_extra
    kv_lengths, block_tables, sinks = decode_extra(problem, extra)
    return kernel.decode_attention(q, k, v, config=config, causal=problem.causal, scale=scale,
                                   kv_lengths=kv_lengths, block_tables=block_tables,
                                   local_window_size=bounded_window(problem),
                                   logit_soft_cap=problem.soft_cap or None, sinks=sinks,
                                   persistent=persistent_grid(problem, config,
                                                              hardware.current().device_key))


#: GPUs (device keys) whose windowed decode runs the persistent grid: where
#: it was measured. Elsewhere (the H100 among them) one CTA per item, as
#: measured there.
PERSISTENT_WINDOW_GPUS = frozenset({"nvidia_h200"})


def persistent_grid(p: DecodeProblem, c: MosaicDecodeConfig, device_key: str) -> bool:
  """Whether the kernel runs its persistent grid (one CTA per SM walking its
  share of the work items; the kernel keeps one CTA per item where there
  are no more items than SMs): on the GPUs of
  :data:`PERSISTENT_WINDOW_GPUS`, with a window of at most half the cache,
  where every sequence reads about the window's keys, so a static share of
  the items stays balanced, and where the second query tile fits. Measured
  on an H200 (docs/results.md, "A persistent grid for windowed decode"):
  1.03-1.30x on the five window problems with more items than SMs;
  without a window, under mixed lengths, the static share ran up to 11%
  slower than the hardware's scheduling, so the grid stays one CTA per
  item there."""
  if device_key not in PERSISTENT_WINDOW_GPUS or p.window_left < 0 or 2 * p.span > p.kv_len:
    return False
  split = kernel.splits_of(p.kv_len, c.num_splits, c.block_k) > 1
  return kernel.smem_bytes(block_k=c.block_k, num_stages=c.num_stages, head_dim=p.head_dim,
                           itemsize=p.itemsize, split=split,
                           persistent=True) <= kernel.SMEM_LIMIT
