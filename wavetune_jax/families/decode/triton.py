"""The Triton backend of the decode family (``pallas_kernels.decode.triton``)."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import numpy as np

from pallas_kernels.decode import chunk_len, splits_of
from pallas_kernels.decode.triton import (MAX_ELEMENTS, MAX_SPLITS, TritonDecodeConfig,
                                          decode_attention)
from wavetune_jax.core.family import interned
from wavetune_jax.core.hardware import Hardware
from wavetune_jax.families import _triton
from wavetune_jax.families.decode.problem import DecodeProblem

__all__ = ["TritonDecode", "TritonDecodeConfig", "splits_of", "coords_aux"]

# Candidate values (``prune=False`` adds the UNPRUNED_* ones).
BLOCK_H = (16, 32, 64)
BLOCK_K = (64, 128, 256)
UNPRUNED_BLOCK_K = (32,)
#: Key blocks of a paged cache's pages under 64 rows (rule D6).
PAGED_SMALL_BLOCK_K = (16, 32)
NUM_SPLITS = (1, 2, 4, 8, 16, 32, 64)
NUM_WARPS = (4, 8)
NUM_STAGES = (2, 3)
#: The rule's full-cache step halves the splits only where the programs'
#: last wave loses at most this much of the SMs by it (``wave_efficiency``).
WAVE_LOSS = 0.1
#: How far past 512 the expected keys per chunk may go before the rule of
#: :meth:`TritonDecode.heuristic` doubles the splits: a cache of a power of
#: two plus a few rows (the new token's, a cache rounded up to 64) splits as
#: the power of two. On an H200, 32/8 heads at batch 8 and 4,097 positions
#: (512.1 expected keys per chunk at 4 splits): 4 splits ran 1.099x / 1.094x
#: cuDNN with spread / full lengths, the 8 the rule took without the slack
#: 0.985x / 0.917x (data/probes/decode_length_mix_{spread,full}_h200.txt).
#: No problem of the decode sweeps lies in the band it moves.
CHUNK_SLACK = 1 / 32
#: Long caches (at least this many positions) whose programs take more than
#: a wave and keep fewer than :data:`LONG_WAVE_FILL` of the SMs busy over
#: their waves: the rule splits them into chunks of at least
#: :data:`LONG_CHUNK` keys of a full cache, the count whose programs fill
#: their waves best (:meth:`TritonDecode._long_cache_split`).
LONG_CACHE = 8192
LONG_CHUNK = 4096
LONG_WAVE_FILL = 0.9
#: At most this many splits (the rule's own bound for one sequence).
LONG_MAX_SPLITS = 16
#: The GPUs the long-cache split is measured on; others keep one split
#: there until it is.
LONG_SPLIT_GPUS = frozenset({"nvidia_h200"})


def wave_efficiency(programs: int, num_sms: int) -> float:
  """The share of ``num_sms`` SMs busy over the waves ``programs`` equal
  programs take: 1.0 for whole waves, 0.61 for 160 programs on 132 SMs."""
  waves = programs / num_sms
  return waves / -(-programs // num_sms)

# Pruning rules of the space (see TritonDecode.space):
#  D1 rows:      one block_h, the next power of two of the rows per KV head
#                (16 to 64): a smaller block reads the KV chunk again per
#                row block, a larger one only masks.
#  D2 smem:      (num_stages * 2 * block_k + block_h) * head_dim_padded *
#                itemsize <= shared memory per block.
#  D3 splits:    num_splits as the chunks that hold keys (fewer than asked
#                where the blocks do not divide: each once), and programs (batch * kv_heads * row blocks *
#                splits) <= 4 waves' worth of SMs unless num_splits = 1:
#                beyond that the chunks only add partials to combine.
#  D4 warps:     8 warps only with 256-key blocks.
#  D5 registers: fp32 scores and output per thread,
#                block_h * (block_k + head_dim_padded) / (32 * num_warps),
#                at most 160.
#  D6 pages:     a paged cache: block_k divides page_size (a block lies in
#                one page; also unpruned). Pruned: the candidates of BLOCK_K
#                that divide it, or where none does (pages of 16 or 32
#                rows, or 48, 80, ...) the largest of 16 and 32 that does;
#                pages not a multiple of 16 rows: no Triton config.


def coords_aux(p: DecodeProblem, block_h: int, block_k: int, num_splits: int):
  """``(G, L, aux)``: programs, key blocks per program (of the full cache)
  and ``[splits > 1, MB of fp32 partials]``."""
  s = splits_of(p.kv_len, num_splits, block_k)
  g = p.batch * p.kv_heads * -(-p.rows // block_h) * s
  l = chunk_len(p.kv_len, num_splits, block_k) // block_k
  mb = s * p.batch * p.kv_heads * p.rows * p.head_dim * 4 / 1e6 if s > 1 else 0.0
  return g, float(l), (float(s > 1), mb)


def _rows_block(rows: int) -> int:
  return min(64, max(16, 1 << (rows - 1).bit_length()))


def block_ks(page_size: int, prune: bool) -> tuple[int, ...]:
  """The key blocks of the space (rule D6): BLOCK_K (and, unpruned,
  UNPRUNED_BLOCK_K) for a contiguous cache (``page_size`` 0); for pages,
  those that divide ``page_size``."""
  if not page_size:
    return BLOCK_K if prune else UNPRUNED_BLOCK_K + BLOCK_K
  fits = lambda bk: bk <= page_size and page_size % bk == 0  # noqa: E731
  big = tuple(bk for bk in BLOCK_K if fits(bk))
  small = tuple(bk for bk in PAGED_SMALL_BLOCK_K if fits(bk))
  if not prune:
    return small + big
  return big or small[-1:]


class TritonDecode(_triton.TritonBackend):
  """Pallas Triton flash-decoding: any length, head_dim up to 256 (padded in
  the kernel), per-sequence lengths, bottom-right causal, CPU interpret mode."""

  name = "triton"
  config_cls = TritonDecodeConfig
  macro_fields = ("block_h", "block_k", "num_splits")
  micro_fields = ("num_warps", "num_stages")
  # (G, L) and the partials column absorb the split completely.
  folded_fields = ("num_splits",)

  def smem_bytes(self, p: DecodeProblem, c: TritonDecodeConfig) -> int:
    return (c.num_stages * 2 * c.block_k + c.block_h) * p.padded_head_dim * p.itemsize

  @staticmethod
  def runs_layout(p: DecodeProblem) -> bool:
    """A paged cache's blocks of keys lie in one page (pages of a multiple
    of 16 rows); no window, soft-capping or sinks. At every cache length."""
    return p.page_size % 16 == 0 and p.plain

  @classmethod
  def runs_shape(cls, p: DecodeProblem) -> bool:
    """:meth:`runs_layout`, and the kernel addresses the cache with 32-bit
    offsets (a paged problem: its sequences' pages; a larger pool is
    refused when the kernel is called)."""
    return cls.runs_layout(p) and p.batch * p.kv_len * p.kv_heads * p.head_dim <= MAX_ELEMENTS

  def space(self, problem: DecodeProblem, hw: Hardware, *, prune: bool = True) -> tuple:
    p = problem
    if not self.runs_shape(p):
      return ()
    # The space sees kv_len through its 32-key blocks; a paged one's 16-key
    # blocks see it whole (a multiple of the page).
    kv = p.kv_len if p.page_size else -(-p.kv_len // 32) * 32
    return self._space(p.batch * p.kv_heads, p.rows, kv, p.padded_head_dim,
                       p.itemsize, hw, prune, p.page_size)

  @functools.lru_cache(maxsize=2048)
  def _space(self, heads, rows, kv_len, dp, itemsize, hw, prune, page_size=0):
    out = []
    bhs = (_rows_block(rows),) if prune else BLOCK_H
    bks = block_ks(page_size, prune)
    seen = set()
    for bh, bk, ns, nw, st in itertools.product(bhs, bks, NUM_SPLITS, NUM_WARPS, NUM_STAGES):
      if (st * 2 * bk + bh) * dp * itemsize > hw.smem_per_block:
        continue  # D2
      ns = splits_of(kv_len, ns, bk)  # D3: the chunks that hold keys
      if prune:
        if ns > 1 and heads * -(-rows // bh) * ns > 4 * hw.num_sms:
          continue  # D3
        if nw == 8 and bk < 256:
          continue  # D4
        if bh * (bk + dp) // (32 * nw) > 160:
          continue  # D5
      key = (bh, bk, ns, nw, st)
      if key in seen:
        continue
      seen.add(key)
      out.append(TritonDecodeConfig(block_h=bh, block_k=bk, num_splits=ns, num_warps=nw,
                                    num_stages=st))
    return tuple(out)

  @functools.lru_cache(maxsize=256)
  def _combos(self, rows, dp, itemsize, hw, page_size=0):
    """The pruned space's (block_h, block_k, num_splits asked, warps,
    stages) before the size-dependent part of rule D3."""
    p_rows = _rows_block(rows)
    out = []
    for bk, ns, nw, st in itertools.product(block_ks(page_size, True), NUM_SPLITS, NUM_WARPS,
                                            NUM_STAGES):
      if ((st * 2 * bk + p_rows) * dp * itemsize > hw.smem_per_block  # D2
          or (nw == 8 and bk < 256)  # D4
          or p_rows * (bk + dp) // (32 * nw) > 160):  # D5
        continue
      out.append((p_rows, bk, ns, nw, st))
    return tuple(out)

  def decision_arrays(self, problem: DecodeProblem, sizes, hw: Hardware, n_aux: int,
                      with_size=None):
    """The pruned space at many cache lengths at once, in array code (the
    same configs, (G, L) and aux as :meth:`space` and :func:`coords_aux`)."""
    p = problem
    kv = np.asarray(sizes, np.int64)[:, None]                    # [S, 1]
    if not self.runs_layout(p):  # rule D6 (no block fits the pages), or options
      s = len(kv)
      return ((), np.zeros((s, 0), bool), np.ones((s, 0), np.int64), np.ones((s, 0)),
              np.zeros((s, 0, n_aux), np.float32))
    combos = self._combos(p.rows, p.padded_head_dim, p.itemsize, hw, p.page_size)
    bh, bk, ns, nw, st = (np.array(c, np.int64) for c in zip(*combos))  # [C]
    heads = p.batch * p.kv_heads * -(-p.rows // bh)
    chunk = -(-(-(-kv // ns)) // bk) * bk                        # [S, C]
    eff = -(-kv // chunk)
    ok = ((eff == 1) | (heads * eff <= 4 * hw.num_sms)) & (
        p.batch * kv * p.kv_heads * p.head_dim <= MAX_ELEMENTS)
    # One column per (combo, effective splits); asked splits that give the
    # same chunks share it.
    code = (np.arange(len(combos)) * (MAX_SPLITS + 1) + eff)[ok]
    uniq, col_of = np.unique(code, return_inverse=True)
    ci, e = np.divmod(uniq, MAX_SPLITS + 1)
    key = np.stack([bh[ci], bk[ci], e, nw[ci], st[ci]], axis=1)
    key, remap = np.unique(key, axis=0, return_inverse=True)
    remap = remap.reshape(-1)
    configs = tuple(interned(TritonDecodeConfig, block_h=int(a), block_k=int(b),
                             num_splits=int(c), num_warps=int(d), num_stages=int(f))
                    for a, b, c, d, f in key)
    rows_i, combo_i = np.nonzero(ok)
    cols = remap[col_of]
    shape = (len(kv), len(configs))
    valid = np.zeros(shape, bool)
    g = np.ones(shape, np.int64)
    l = np.ones(shape, np.float64)
    aux = np.zeros(shape + (n_aux,), np.float32)
    e_ok = eff[ok]
    valid[rows_i, cols] = True
    g[rows_i, cols] = (heads[combo_i] * e_ok)
    l[rows_i, cols] = (chunk // bk)[ok]
    multi = e_ok > 1
    aux[rows_i, cols, 0] = multi
    aux[rows_i, cols, 1] = np.where(multi, e_ok * p.batch * p.kv_heads * p.rows * p.head_dim
                                    * 4 / 1e6, 0.0)
    return configs, valid, g, l, aux

  def size_quantum(self, problem: DecodeProblem) -> int | None:
    """The space and (G, L) see kv_len only through ``ceil(kv_len / 32)``;
    a paged problem's sizes are whole pages, one per bucket. None where the
    kernel cannot run the problem's pages or options (a window, soft cap or
    sinks)."""
    if not self.runs_layout(problem):
      return None
    return problem.page_size or 32

  def validate(self, problem: DecodeProblem, config, hw: Hardware | None = None) -> None:
    if not isinstance(config, TritonDecodeConfig):
      raise ValueError(f"config must be a TritonDecodeConfig; got {config!r}")
    p = problem
    if not p.plain:
      raise ValueError("the Pallas Triton decode kernel has no sliding window, logit "
                       "soft-capping or sinks (use a Mosaic or XLA config)")
    if p.page_size and p.page_size % 16:
      raise ValueError(f"the Triton decode kernel reads pages of a multiple of 16 rows (its "
                       f"blocks of keys, at least 16, lie in one page); got "
                       f"page_size={p.page_size} (use the Mosaic or xla backend)")
    if p.page_size and (config.block_k > p.page_size or p.page_size % config.block_k):
      raise ValueError(f"config {config}: block_k={config.block_k} must divide "
                       f"page_size={p.page_size} (a block of keys lies in one page)")
    if not self.runs_shape(problem):
      raise ValueError(f"the Triton decode kernel addresses the cache with 32-bit offsets: "
                       f"at most {MAX_ELEMENTS} elements per array; use the xla backend")
    splits = splits_of(p.kv_len, config.num_splits, config.block_k)
    partials = splits * p.batch * p.q_heads * p.q_len * p.head_dim
    if splits > 1 and partials > MAX_ELEMENTS:
      raise ValueError(f"config {config}: its float32 partials ({partials} elements) pass the "
                       f"kernel's 32-bit offsets ({MAX_ELEMENTS}); use fewer splits")
    if hw is not None and self.smem_bytes(problem, config) > hw.smem_per_block:
      raise ValueError(
          f"config {config} needs {self.smem_bytes(problem, config)} bytes of shared "
          f"memory; {hw.name} allows {hw.smem_per_block} per block")

  def heuristic(self, problem: DecodeProblem, hw: Hardware) -> TritonDecodeConfig | None:
    """Splits from the programs and the keys a sequence is expected to hold
    (half the cache with per-sequence lengths): enough programs for about 64
    (one sequence) or two waves (several, whose lengths differ), at most 16
    splits for that; at most 512 expected keys per chunk (:data:`CHUNK_SLACK`
    past it); at least 64; at
    most four waves of programs, two where the programs fill half the SMs
    and a full cache's chunks would hold fewer than 2,048 keys. 64-key
    blocks where chunks are under 1,024 keys, else 128 (64 above head_dim
    128); 4 warps, 3 stages. Read off the H100 and H200 decode sweeps
    (docs/results.md, "Decode"; the full-cache condition from
    data/probes/decode_length_mix_h100.txt)."""
    p = problem
    if not self.runs_shape(p):
      return None  # XLA's answers
    bh = _rows_block(p.rows)
    programs = p.batch * p.kv_heads * -(-p.rows // bh)
    keys = p.kv_len / 2 if p.lengths else p.kv_len
    target = 64 if p.batch == 1 else 2 * hw.num_sms
    ns = 1
    while programs * ns * 2 <= target and ns < 16:
      ns *= 2
    while keys / ns > 512 * (1 + CHUNK_SLACK) and ns < 64:
      ns *= 2
    while ns > 1 and (programs * ns > 4 * hw.num_sms or keys / ns < 64):
      ns //= 2
    # Where the programs alone fill half the SMs, splits past two waves with
    # chunks under 2,048 keys of a full cache (every sequence at kv_len, as a
    # batch of equal prompts) cost more in partials than the waves gain: at
    # batch 16, 32/8 heads, 4,096 keys, 4 splits ran 0.97x cuDNN with full
    # caches where 2 ran 0.99x, both 1.11x with spread lengths
    # (data/probes/decode_length_mix_h100.txt).
    # But not where halving leaves a last wave of few programs: 160 programs
    # (batch 40, 16/4 heads, 1,800 keys) on an H200's 132 SMs ran 0.87x
    # cuDNN with spread lengths on one split and 1.08x on two, 1.01x and
    # 1.03x with full caches (data/probes/decode_waves_{spread,full}_h200.txt).
    while (ns > 1 and 2 * programs > hw.num_sms and programs * ns > 2 * hw.num_sms
           and p.kv_len / ns < 2048
           and wave_efficiency(programs * (ns // 2), hw.num_sms)
           >= wave_efficiency(programs * ns, hw.num_sms) - WAVE_LOSS):
      ns //= 2
    c = self._rule_config(p, hw, bh, keys, ns)
    # As measured: a contiguous cache, head_dim 128, one query a sequence;
    # the cache length in 32-key steps, as the space reads it (the long-cache
    # step takes 8,161-8,192 alike).
    kv = -(-p.kv_len // 32) * 32
    if (kv >= LONG_CACHE and programs * c.num_splits > hw.num_sms and not p.page_size
        and p.head_dim == 128 and p.q_len == 1 and hw.device_key in LONG_SPLIT_GPUS
        and self._wave_fill(p, c, programs, hw) < LONG_WAVE_FILL):
      c = self._long_cache_split(p, hw, bh, keys, programs, ns, c, kv)
    return c

  def _wave_fill(self, p: DecodeProblem, c: TritonDecodeConfig, programs: int,
                 hw: Hardware) -> float:
    """The share of the SMs busy over the waves of ``c``'s programs (CTAs
    per SM from :meth:`occupancy_bound`)."""
    per_sm = max(1, self.occupancy_bound(p, c, hw))
    return wave_efficiency(programs * c.num_splits, hw.num_sms * per_sm)

  def _rule_config(self, p: DecodeProblem, hw: Hardware, bh: int, keys: float, ns: int):
    """The rule's config for ``ns`` splits: 64-key blocks where chunks hold
    under 1,024 expected keys (or head_dim is above 128), else 128; 4 warps,
    3 stages (fewer where shared memory is short)."""
    bk = 64 if keys / ns < 1024 or p.padded_head_dim > 128 else 128
    if p.page_size:  # rule D6: the largest block up to that which divides the pages
      bk = max(b for b in block_ks(p.page_size, False) if b <= bk)
    c = TritonDecodeConfig(block_h=bh, block_k=bk, num_splits=splits_of(p.kv_len, ns, bk),
                           num_warps=4, num_stages=3)
    while self.smem_bytes(p, c) > hw.smem_per_block and c.num_stages > 1:
      c = dataclasses.replace(c, num_stages=c.num_stages - 1)
    return c

  def _long_cache_split(self, p: DecodeProblem, hw: Hardware, bh: int, keys: float,
                        programs: int, ns: int, rule: TritonDecodeConfig,
                        kv: int) -> TritonDecodeConfig:
    """A long cache (:data:`LONG_CACHE`) whose programs take more than a
    wave at the rule's ``ns`` splits (its four-wave cap often leaves one;
    ``kv``: the cache length rounded up to 32 keys, as the space reads it)
    and fill their waves poorly (:data:`LONG_WAVE_FILL`): the fewest
    splits, from ``max(2, ns)`` to :data:`LONG_MAX_SPLITS`, with chunks of
    at least :data:`LONG_CHUNK` keys of a full cache and partials the
    kernel addresses, whose programs fill their waves best (CTAs per SM
    from shared memory: one for 128-key blocks at 3 stages); the rule's
    config where none fills them better. Few programs per SM stream a long
    cache in few waves, the last one part empty. On an H200, 32/8 heads at
    batch 36 and 32,768 positions (288 programs, 2.2 waves) ran one split
    at 0.998x / 0.938x cuDNN with full / spread lengths and four (8.7
    waves) at 1.218x / 1.144x; batch 40 at
    16,384: one 1.040x / 0.961x, two 1.151x / 1.083x
    (data/probes/decode_streaming_{full,spread}_h200.txt). Where one split's
    waves are nearly full (batch 48 and 128 at 8,192: 2.9 and 7.8 waves,
    97% busy) one split stays: 1.066x / 0.985x and 1.022x / 0.992x, two
    splits 1.056x / 1.065x and 1.007x / 1.017x."""
    best, best_eff = rule, self._wave_fill(p, rule, programs, hw)
    ns = max(2, ns)
    while kv / ns >= LONG_CHUNK and ns <= LONG_MAX_SPLITS:
      c = self._rule_config(p, hw, bh, keys, ns)
      if c.num_splits * p.batch * p.q_heads * p.q_len * p.head_dim > MAX_ELEMENTS:
        break  # the float32 partials (validate)
      eff = self._wave_fill(p, c, programs, hw)
      if eff > best_eff + 1e-9:
        best, best_eff = c, eff
      ns *= 2
    return best

  def occupancy_bound(self, problem: DecodeProblem, config, hw: Hardware) -> int:
    threads = 32 * config.num_warps
    live = config.block_h * (config.block_k + problem.padded_head_dim) // threads
    return _triton.occupancy_bound(hw, smem_bytes=self.smem_bytes(problem, config),
                                   threads=threads, acc_per_thread=live)

  def coords(self, problem: DecodeProblem, macro: dict) -> tuple[int, float]:
    g, l, _ = coords_aux(problem, macro["block_h"], macro["block_k"], macro["num_splits"])
    return g, l

  def aux(self, problem: DecodeProblem, config) -> tuple[float, ...]:
    return coords_aux(problem, config.block_h, config.block_k, config.num_splits)[2]

  def run(self, problem: DecodeProblem, config, q, k, v, *extra, interpret: bool = False,
          scale: float | None = None):
    from wavetune_jax.families.decode.family import decode_extra
    kv_lengths, block_tables, _ = decode_extra(problem, extra)
    return decode_attention(q, k, v, config=config, causal=problem.causal, scale=scale,
                            kv_lengths=kv_lengths, block_tables=block_tables,
                            interpret=interpret)
