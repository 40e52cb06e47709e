"""The Mosaic GPU backend of the attention family (``pallas_kernels.attention.mosaic``)."""

from __future__ import annotations

import functools
import itertools

from pallas_kernels.attention import mosaic as kernel
from pallas_kernels.attention.mosaic import MosaicAttentionConfig
from wavetune_jax.core.family import Backend
from wavetune_jax.core import hardware
from wavetune_jax.core.hardware import Hardware
from wavetune_jax.families.attention.problem import AttentionProblem, coords, next_pow2
from wavetune_jax.families.attention.triton import TritonAttention

__all__ = ["PERSISTENT_WINDOW_GPUS", "MosaicAttention", "MosaicAttentionConfig", "cudnn_runs",
           "lengths_rule", "pads",
           "persistent_grid", "persistent_runs", "persistent_wins", "runs_rule_config",
           "triton_recompute",
           "wins_above_one_wave", "would_pad"]

STAGES = (2, 3, 4)

# The space (see MosaicAttention.space), on compute capability 9.0 only:
#  M1 shape:     head_dim a multiple of 16 in [64, 256] (the swizzle of its
#                tiles), q_len <= kv_len under a causal mask; no block
#                larger than the next power of two of its length (floors: the
#                smallest blocks, 128 and 64).
#  M2 smem:      (block_q + 2 * num_stages * block_k) * head_dim * itemsize
#                (+ barriers) <= shared memory per block.
#  M3 registers: fp32 accumulator and scores per consumer thread,
#                (block_q / 2) * (head_dim + block_k) / 128, at most 160 of
#                the 232 registers a consumer warpgroup gets.
#  M4 padding:   (pruning) no config where q_len or kv_len is not a multiple
#                of 8: the kernel pads them on the device, and those copies
#                ran it at 0.53-0.84x cuDNN on the H100; the wave models,
#                fitted on unpadded calls, do not see that cost.


#: A window of at most this many keys a row runs 64-key blocks (see
#: :meth:`MosaicAttention.heuristic`).
NARROW_WINDOW_KEYS = 256


def narrow_window(p: AttentionProblem) -> bool:
  """Each query row sees at most :data:`NARROW_WINDOW_KEYS` keys: the left
  side bounded, and the right side bounded or causal."""
  if p.window_left < 0 or not (p.causal or p.window_right >= 0):
    return False
  right = 0 if p.causal else p.window_right
  return p.window_left + 1 + right <= NARROW_WINDOW_KEYS


#: GPUs (device keys) whose windowed prefill runs the kernel's persistent
#: grid: where it was measured. Elsewhere (the H100 among them) one CTA per
#: program, as measured there.
PERSISTENT_WINDOW_GPUS = frozenset({"nvidia_h200"})


def persistent_grid(p: AttentionProblem, c: MosaicAttentionConfig, device_key: str) -> bool:
  """Whether the kernel runs its persistent grid (one CTA per SM walking its
  share of the programs; the kernel keeps one CTA per program where there
  are no more programs than SMs): on the GPUs of
  :data:`PERSISTENT_WINDOW_GPUS`, under a causal window of at most half the
  keys without KV lengths, where nearly every program reads the window's
  blocks, so a static share of them stays balanced, and where the second Q/O tile fits in
  shared memory (not at head_dim 256). Measured on an H200
  (``benchmarks/attention_persistent.py``, docs/results.md "A persistent
  grid for windowed prefill"). Under a plain causal mask the programs'
  lengths run from one block to all of them, which the hardware's
  scheduling of CTAs balances and a static share would not."""
  if (device_key not in PERSISTENT_WINDOW_GPUS or not p.causal or p.window_left < 0
      or p.lengths or 2 * (p.window_left + 1) > p.kv_len):
    return False
  return kernel.smem_bytes(block_q=c.block_q, block_k=c.block_k, num_stages=c.num_stages,
                           head_dim=p.head_dim, itemsize=p.itemsize,
                           persistent=True) <= kernel.SMEM_LIMIT


def persistent_runs(p: AttentionProblem, c: MosaicAttentionConfig, hw: Hardware) -> bool:
  """Whether ``c`` runs ``p`` with the persistent grid on ``hw``:
  :func:`persistent_grid` holds and its programs outnumber the SMs (with no
  more programs than SMs the kernel keeps one CTA per program)."""
  return (persistent_grid(p, c, hw.device_key)
          and p.batch * p.q_heads * -(-p.q_len // c.block_q) > hw.num_sms)


def persistent_wins(p: AttentionProblem, hw: Hardware) -> bool:
  """Where the kernel, with its persistent grid, takes a causal window from
  cuDNN's sliding window: :attr:`MosaicAttention.HEURISTIC` is in its space
  on ``hw`` (the kernel runs the shape there; lengths that need padding are
  pruned), runs the persistent grid (:func:`persistent_runs`) and
  ``head_dim`` is 128. On the H200 window sweep (80 problems of head_dim
  128, GQA groups of 4 and 8, windows of 128-4,096 keys) its 128 x 128
  config ran at 0.99-1.16x cuDNN (best config), its geomean 1.029x at a
  window of 128 and 1.047-1.051x at 512-4,096 (the same kernel with one CTA
  per program: 0.69-1.04x); on six held-out problems of head_dim 128 at
  1.039-1.069x, four of them of GQA groups the sweep lacks (2, 3, 5 and 7).
  At head_dim 64 the one problem measured (a window of 128) ran at 0.95x,
  so other head_dims keep cuDNN."""
  c = MosaicAttention.HEURISTIC
  return (p.head_dim == 128 and persistent_runs(p, c, hw) and p.q_len >= c.block_q
          and not pads(p) and c in _MOSAIC.space(p, hw))


def runs_rule_config(p: AttentionProblem, hw: Hardware) -> bool:
  """Whether :attr:`MosaicAttention.HEURISTIC` is in the kernel's space for
  ``p`` on ``hw`` (a Hopper GPU, a shape it runs, lengths it need not pad)."""
  return (hw.compute_capability == kernel.COMPUTE_CAPABILITY
          and MosaicAttention.HEURISTIC in _MOSAIC.space(p, hw))


class MosaicAttention(Backend):
  """The warp-specialized Mosaic GPU flash attention (Hopper: TMA ring,
  wgmma, one producer and two consumer warpgroups). No CPU interpret mode."""

  name = "mosaic"
  kernel_cache = True
  config_cls = MosaicAttentionConfig
  macro_fields = ("block_q", "block_k")
  micro_fields = ("num_stages",)
  interpret = False
  # Files recorded when both kernels shared one config class hold num_warps.
  dropped_fields = {"num_warps": kernel.NUM_WARPS}

  def supported_on(self, hw: Hardware) -> bool:
    return hw.compute_capability == kernel.COMPUTE_CAPABILITY

  @staticmethod
  def _runs_shape(p: AttentionProblem) -> bool:
    return (p.head_dim % kernel.HEAD_DIM_MULTIPLE == 0
            and kernel.HEAD_DIM_MIN <= p.head_dim <= kernel.HEAD_DIM_MAX
            and not (p.causal and not p.shifted and p.q_len > p.kv_len))

  def smem_bytes(self, problem: AttentionProblem, c: MosaicAttentionConfig) -> int:
    return kernel.smem_bytes(block_q=c.block_q, block_k=c.block_k, num_stages=c.num_stages,
                             head_dim=problem.head_dim, itemsize=problem.itemsize)

  def space(self, problem: AttentionProblem, hw: Hardware, *,
            prune: bool = True) -> tuple[MosaicAttentionConfig, ...]:
    """Rules M1-M4 (M1-M3 with ``prune=False``: they are validity)."""
    p = problem
    if not self._runs_shape(p) or (prune and pads(p)):
      return ()
    # Rule M1 sees the lengths only through next_pow2, capped at the largest
    # block: problems of any other length share one cached space.
    return self._space(min(next_pow2(p.q_len), kernel.BLOCK_Q[-1]),
                       min(next_pow2(p.kv_len), kernel.BLOCK_K[-1]), p.head_dim, p.dtype, hw)

  @functools.lru_cache(maxsize=1024)
  def _space(self, q_len, kv_len, head_dim, dtype, hw):
    p = AttentionProblem(batch=1, q_heads=1, kv_heads=1, q_len=q_len, kv_len=kv_len,
                         head_dim=head_dim, dtype=dtype)
    out = []
    for bq, bk, ns in itertools.product(kernel.BLOCK_Q, kernel.BLOCK_K, STAGES):
      if (bq > max(kernel.BLOCK_Q[0], next_pow2(q_len))
          or bk > max(kernel.BLOCK_K[0], next_pow2(kv_len))):
        continue  # M1
      c = MosaicAttentionConfig(block_q=bq, block_k=bk, num_stages=ns)
      if self.smem_bytes(p, c) > hw.smem_per_block:
        continue  # M2
      if (bq // 2) * (head_dim + bk) // 128 > 160:
        continue  # M3
      out.append(c)
    return tuple(out)

  def size_quantum(self, problem: AttentionProblem) -> int | None:
    """The speed changes with the ragged part of the last blocks (and the
    padding of lengths that are not multiples of 8): each length is decided
    on its own."""
    p = problem
    return 1 if self._runs_shape(p) else None

  def validate(self, problem: AttentionProblem, config: MosaicAttentionConfig,
               hw: Hardware | None = None) -> None:
    if not isinstance(config, MosaicAttentionConfig):
      raise ValueError(f"config must be a MosaicAttentionConfig; got {config!r}")
    p = problem
    kernel.check_shapes((p.batch, p.q_len, p.q_heads, p.head_dim),
                        (p.batch, p.kv_len, p.kv_heads, p.head_dim), p.dtype,
                        causal=p.causal and not p.shifted)
    if hw is not None and self.smem_bytes(p, config) > hw.smem_per_block:
      raise ValueError(
          f"config {config} needs {self.smem_bytes(p, config)} bytes of shared "
          f"memory; {hw.name} allows {hw.smem_per_block} per block")

  HEURISTIC = MosaicAttentionConfig(block_q=128, block_k=128, num_stages=2)
  #: Soft-capping or sinks where 128 x 128 does not fit (head_dim 256).
  OPTIONS_NARROW = MosaicAttentionConfig(block_q=128, block_k=64, num_stages=2)
  #: Below half the SMs, where the Triton kernel would recompute much of
  #: its last query block (see :func:`triton_recompute`).
  SHORT = MosaicAttentionConfig(block_q=128, block_k=64, num_stages=2)
  #: A window of at most :data:`NARROW_WINDOW_KEYS` keys a row: the same
  #: 128 x 64 tiles.
  NARROW = SHORT

  def heuristic(self, problem: AttentionProblem, hw: Hardware) -> MosaicAttentionConfig | None:
    """128x128 tiles with 2 stages where the kernel runs the shape without
    padding its lengths, ``q_len`` is at least its 128-row block and its
    programs fill half the SMs but not more than all of them (above, cuDNN
    answers first), or any number of them when ``head_dim`` is not a multiple
    of 64 (:func:`wins_above_one_wave`); else None (the Triton backend
    answers). Below half the SMs, 128x64 tiles where the Triton kernel
    would recompute more than :data:`SHORT_RECOMPUTE` of its rows. The
    128x128 config is the oracle of 66 of the 90 problems of the H100
    sweep and 67 of the H200's (``wavetune report`` lists each problem's
    oracle); with the Triton heuristic elsewhere this reaches 0.985 and 0.984
    of the oracle (geomean) on them. A window of at most
    :data:`NARROW_WINDOW_KEYS` keys a row takes 128x64 tiles (a 128-key
    window spans two or three 64-key blocks and two 128-key ones, each half
    masked): on the window sweeps the best Mosaic config at a window of
    128 was 128x64 on 19 of 20 problems (H100) and 20 of 20 (H200), the
    128x128 one at 0.980 and 0.965 of it; at 512 and above 128x128 was the
    best on all 60 problems of each GPU. Where the persistent grid runs the
    window (:func:`persistent_runs`, the H200), 128x128 at every window: on
    the H200 window sweep redone with it, the best config at a window of
    128 on all 20 problems (128x64 ran at 0.93 of it, geomean)."""
    p = problem
    c = self.HEURISTIC
    if not self._runs_shape(p):
      return None
    if narrow_window(p) and not persistent_runs(p, c, hw):
      c = self.NARROW
    if p.soft_cap or p.sinks or (p.windowed and not cudnn_runs(p, hw)):
      # cuDNN runs neither soft-capping nor sinks, nor a window with KV
      # lengths, the bottom-right alignment or a right side: XLA's attention
      # is the other backend that does. The kernel ran 6.5-72x faster than it
      # on an H100 with soft caps and sinks (benchmarks/attention_options.py)
      # and reads only a window's blocks (benchmarks/attention_band.py).
      return next((x for x in (c, self.OPTIONS_NARROW) if x in self.space(p, hw, prune=False)),
                  None)
    if p.lengths or p.shifted:
      return lengths_rule(p, hw)  # (None: the Triton kernel's rule)
    if p.q_len < c.block_q or pads(p):
      return None
    if p.batch * p.q_heads * -(-p.q_len // c.block_q) >= hw.num_sms // 2:
      return c if c in self.space(p, hw) else None
    if (triton_recompute(p, _TRITON.heuristic(p, hw).block_q) > SHORT_RECOMPUTE
        and self.SHORT in self.space(p, hw)):
      return self.SHORT
    return None


  def occupancy_bound(self, problem, config, hw: Hardware) -> int:
    # 2 x 128 threads at 232 registers and 128 at 40 take the register file.
    return 1

  def coords(self, problem: AttentionProblem, macro: dict) -> tuple[int, float]:
    """The Triton kernel's mapping: one program per ``block_q`` query rows."""
    return coords(problem, macro["block_q"], macro["block_k"])

  def run(self, problem: AttentionProblem, config: MosaicAttentionConfig, q, k, v, *extra,
          interpret: bool = False, scale: float | None = None):
    if interpret:
      raise NotImplementedError(kernel.NO_INTERPRET)
    from wavetune_jax.families.attention.family import split_extra
    kv_lengths, sinks = split_extra(problem, extra)
    return kernel.attention(q, k, v, config=config, causal=problem.causal, scale=scale,
                            soft_cap=problem.soft_cap, window_left=problem.window_left,
                            window_right=problem.window_right, sinks=sinks,
                            kv_lengths=kv_lengths, causal_align=problem.causal_align,
                            persistent=persistent_grid(problem, config,
                                                       hardware.current().device_key))


def lengths_rule(p: AttentionProblem, hw: Hardware) -> MosaicAttentionConfig | None:
  """The kernel's config for a call with KV lengths or the bottom-right
  alignment and no option (which the cuDNN backend does not run, so XLA's
  attention is the platform op), where the plain rule reaches (its 128-row
  programs fill at least half the SMs, no padding of the lengths); else
  None. 128 x 128 tiles, or 128 x 64 where at most 512 keys (a short
  sequence's ragged last block costs less) or where 128 x 128 does not fit
  (head_dim 256). On an H200 (``benchmarks/attention_band.py``) 128 x 128
  ran 1.38x and 1.51x the Triton kernel's rule and 12.8x and 6.9x XLA's
  attention (lengths at 8,192 tokens; a 2,048-token chunk at the end of an
  8,192-key cache), and 1.13x / 7.5x on a 512-token chunk over 1,024 keys;
  at 512 and 256 keys 128 x 64 ran 9.9 and 15.9 us against 10.6 and 18.4
  for 128 x 128, 10.5 and 15.8 for Triton, 64.5 and 78.1 for XLA; at
  head_dim 256, 1.52x Triton and 7.0x XLA."""
  c = MosaicAttention.HEURISTIC
  if not (p.plain and (p.lengths or p.shifted) and p.q_len >= c.block_q and not pads(p)
          and p.batch * p.q_heads * -(-p.q_len // c.block_q) >= hw.num_sms // 2):
    return None
  space = _MOSAIC.space(p, hw)
  order = ((MosaicAttention.NARROW, c) if p.kv_len <= LENGTHS_NARROW_KEYS
           else (c, MosaicAttention.NARROW))
  return next((x for x in order if x in space), None)


#: At most this many keys, calls with KV lengths take 128 x 64 tiles
#: (:func:`lengths_rule`).
LENGTHS_NARROW_KEYS = 512


def cudnn_runs(p: AttentionProblem, hw: Hardware | None = None) -> bool:
  """Whether the cuDNN backend runs ``p`` (its window: causal or a left side
  only, no KV lengths, no bottom-right alignment)."""
  from wavetune_jax.families.attention.cudnn import CudnnAttention
  return CudnnAttention()._why_not(p, hw) is None


def pads(p: AttentionProblem) -> bool:
  """Whether the kernel pads this call's lengths on the device first (a
  copy of each operand: 0.53-0.84x cuDNN on the H100 at 777-2,500 tokens,
  ``benchmarks/attention_mosaic.py --coverage``)."""
  return bool(p.q_len % kernel.SEQ_MULTIPLE or p.kv_len % kernel.SEQ_MULTIPLE)


def would_pad(p: AttentionProblem, hw: Hardware) -> bool:
  """Whether the kernel runs this call on ``hw`` only by padding its lengths."""
  return (pads(p) and MosaicAttention._runs_shape(p)
          and hw.compute_capability == kernel.COMPUTE_CAPABILITY)


#: Below half the SMs the Triton heuristic takes 64- or 32-row query
#: blocks; when q_len is not a multiple of the block its last block is
#: shifted back to end on the last row and the overlap is computed twice.
#: Above this share of q_len (200 tokens in 64-row blocks: 56 of 200 rows),
#: the Mosaic kernel answers instead: on the H100 at 200 tokens (28/4 and
#: 32/32 heads; head_dim 128 and 96) it ran 1.04-1.12x cuDNN where the
#: Triton config ran 0.89-0.91x; with 16/8 heads the Triton heuristic takes
#: 32-row blocks (24 of 200 rows twice) and ran 1.05x, Mosaic 1.01x
#: (``benchmarks/attention_mosaic.py --short``). No problem of the training
#: suite is above it.
SHORT_RECOMPUTE = 1 / 8

_TRITON = TritonAttention()


def triton_recompute(p: AttentionProblem, block_q: int = 64) -> float:
  """The share of ``q_len`` a Triton program of ``block_q`` rows computes
  twice (its last block shifted back to end on the last row)."""
  return (-p.q_len % block_q) / p.q_len


#: The shortest q_len at which the Mosaic config beat cuDNN above one wave
#: with a head_dim that is not a multiple of 64 (H100; at 200 tokens it ran
#: at 0.87x).
WIDE_MIN_Q_LEN = 1000


def wins_above_one_wave(p: AttentionProblem, hw: Hardware) -> bool:
  """Where the heuristic keeps the Mosaic config above one wave: head_dim
  not a multiple of 64 (measured at 80, 96, 160: the kernel runs the rows as
  they are, with a narrower swizzle) where the 128x128 config fits the
  shared memory and registers (up to 176 on Hopper), lengths that need no
  padding, ``q_len`` from :data:`WIDE_MIN_Q_LEN`. On the H100 it ran 1.09-1.15x cuDNN on five such
  problems of 1,000-6,000 tokens, 0.87x at 200 tokens (batch 6, 32 heads,
  head_dim 96), and 0.97x at head_dim 192 and 256
  (``benchmarks/attention_mosaic.py --coverage``, ``benchmarks/unseen_models.py``)."""
  return (p.head_dim % 64 != 0 and p.q_len >= WIDE_MIN_Q_LEN and not pads(p)
          and hw.compute_capability == kernel.COMPUTE_CAPABILITY
          and MosaicAttention.HEURISTIC in _MOSAIC.space(p, hw))


_MOSAIC = MosaicAttention()
