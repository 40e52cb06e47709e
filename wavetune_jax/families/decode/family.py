"""The decode family: attention of a few new queries per sequence against a
KV cache (flash-decoding)."""

from __future__ import annotations

import copy

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention.common import (bounded_window, check_call, check_lengths,
                                             check_sinks, check_soft_cap, check_window,
                                             bound_sides)
from pallas_kernels.attention.reference import attention_reference
from pallas_kernels.decode import paging
from wavetune_jax.core.family import Call, Family
from wavetune_jax.core.partition import PartitionRule
from wavetune_jax.families.decode.library import library_attention, plain_mask
from wavetune_jax.families.decode.problem import MAX_Q_LEN, DecodeProblem
from wavetune_jax.families.attention.family import (canonical_window, fold_vmap_into_batch,
                                                     options_key, query_heads, window_variants)
from wavetune_jax.families.attention.problem import OPTION_DEFAULTS
from wavetune_jax.families.matmul.family import operand
from wavetune_jax.shapes import suite_entries

__all__ = ["DecodeFamily", "decode_models", "decode_extra", "LENGTH_MIXES"]

#: The valid lengths :meth:`DecodeFamily.inputs` gives a batch
#: (:meth:`DecodeFamily.with_lengths`): "spread", evenly over ``[q_len,
#: kv_len]`` (the default: a serving batch of mixed lengths); "full", every
#: sequence ``kv_len``.
LENGTH_MIXES = ("spread", "full")


def decode_models(suite: dict, names=None) -> dict[str, dict]:
  """``{model name: {"q_heads", "kv_heads", "head_dim"}}`` of a suite's
  ``decode`` section, optionally filtered."""
  return suite_entries(suite, "decode", "models", names)


def decode_extra(problem: DecodeProblem, extra: tuple):
  """``(kv_lengths, block_tables, sinks)`` of the arrays after ``q, k, v``
  of a call (each None where the problem has none)."""
  extra = list(extra)
  lengths = extra.pop(0) if problem.lengths and extra else None
  tables = extra.pop(0) if problem.page_size and extra else None
  sinks = extra.pop(0) if problem.sinks and extra else None
  return lengths, tables, sinks


class DecodeFamily(Family):
  """Decode attention, layout ``[batch, seq, heads, head_dim]``, GQA, per-
  sequence valid lengths; the size is the cache length. cuDNN
  (``jax.nn.dot_product_attention`` with ``key_value_seq_lengths``) is the
  baseline, XLA's attention the second one.

  A paged cache (``block_tables``; ``DecodeProblem.page_size``): pages
  ``[num_pages, page_size, kv_heads, head_dim]`` and a block table per
  sequence (:mod:`pallas_kernels.decode.paging`); the baseline is cuDNN's
  paged attention, XLA's attention on the gathered pages the second one.

  ``length_mix`` is the mix of valid lengths :meth:`inputs` gives
  (:data:`LENGTH_MIXES`; :meth:`with_lengths`): sweeps and tables are
  measured with it.
  """

  name = "decode"
  problem_cls = DecodeProblem
  size_field = "kv_len"
  aux_names = ("split_launch", "split_partial_mb")
  # The wave model sees the cache length, not the run-time lengths, and
  # does not beat the heuristic here: held out (seed 0), with the heuristic
  # that sends few-pair long caches to cuDNN, a 0.5 margin scored 0.985 /
  # 0.974 of the oracle (H100 / H200), 3.0 (the models never override) 0.987 /
  # 0.983, the heuristic alone 0.988 / 0.982. The tables add exact entries.
  heuristic_margin = 3.0
  baseline_name = "cuDNN"
  #: XLA's decode attention beat cuDNN's on a model outside the suites
  #: (Gemma-3-1B, head_dim 256, batch 3: 11.7 against 14.9 us on an H200;
  #: docs/results.md, v3), where the sweeps (head_dim 128) never show it:
  #: first use measures both, at the cost of one XLA compile.
  refine_all_platforms = True
  evidence_categorical = ("head_dim", "q_len", "page_size")
  # The guard's rule: held-out replays of both GPUs' sweeps (5 splits;
  # benchmarks/guard_radius.py, docs/design.md "The guard").
  guard_rule = {"weight_radius": 1.0, "size_radius": 2.0, "win": 0.97}
  length_mix = "spread"

  def with_lengths(self, mix: str) -> "DecodeFamily":
    """A copy of this family whose inputs have the length mix ``mix``
    (:data:`LENGTH_MIXES`)."""
    if mix not in LENGTH_MIXES:
      raise ValueError(f"length mix {mix!r} must be one of {LENGTH_MIXES}")
    new = copy.copy(self)
    new.length_mix = mix
    return new

  def refine_mixes(self, problem: DecodeProblem) -> tuple["DecodeFamily", ...]:
    """With run-time lengths, first use also times the candidates with every
    sequence at the full cache: the split count is static and the two mixes
    want different splits (a Triton config chosen on spread lengths ran a
    four-layer decode step of full caches at 0.95x XLA + cuDNN)."""
    # (Spread over [q_len, kv_len]: with q_len >= kv_len they are all full.)
    if problem.lengths and self.length_mix != "full" and problem.q_len < problem.kv_len:
      return (self.with_lengths("full"),)
    return ()

  def heuristic(self, problem: DecodeProblem, hw):
    """cuDNN for few (sequence, KV head) pairs against a long cache: at most
    16 pairs and a cache of at least 16,384, at most 8 and 8,192, or at
    most 4 and 4,096 (where cuDNN runs the problem), and for plain problems
    where the Triton kernel cannot run (below); elsewhere the backends'
    rules in order (Triton, Mosaic, cuDNN, XLA). On the H100 / H200 decode
    sweeps the Triton rule ran the few-pair problems at up to 1.26x / 1.35x
    cuDNN's time (Llama-3-70B at TP8, one sequence, 16k-32k cache), at
    worst 0.978x / 0.999x; at 4,096 keys it ran one pair at 0.990x / 0.947x
    cuDNN's speed and eight at 1.04-1.12x / 1.02-1.15x."""
    from wavetune_jax.families.decode.library import CudnnDecode, CudnnDecodeConfig
    from wavetune_jax.families.decode.triton import TritonDecode
    pairs = problem.batch * problem.kv_heads
    # The cache length in 32-key steps, as the Triton rule reads it (8,161-
    # 8,192 alike; a paged cache whole).
    kv = problem.kv_len if problem.page_size else -(-problem.kv_len // 32) * 32
    few = ((pairs <= 16 and kv >= 16384) or (pairs <= 8 and kv >= 8192)
           or (pairs <= 4 and kv >= 4096))
    available = self.available(hw)
    # Without the Triton kernel (a JAX without the Pallas Triton lowering),
    # cuDNN before the Mosaic kernel's rule on problems cuDNN runs: on the
    # plain problems of the decode sweeps that rule's config ran at 0.820 /
    # 0.785 of the oracle (min 0.454 / 0.422; H100 / H200), cuDNN at 0.938 /
    # 0.936, and the guard, which compares backends, let the rule's config
    # through where another Mosaic config had won nearby (0.63x cuDNN).
    no_triton = problem.plain and not any(isinstance(b, TritonDecode) for b in available)
    if few or no_triton:
      cudnn = next((b for b in available if isinstance(b, CudnnDecode)), None)
      if cudnn is not None and cudnn.space(problem, hw):
        return CudnnDecodeConfig()
    return super().heuristic(problem, hw)

  # --- the call ------------------------------------------------------------------------

  def canonical(self, problem):
    """:func:`~wavetune_jax.families.attention.family.canonical_window`."""
    return canonical_window(problem)

  def bind(self, q, k, v, *, kv_lengths=None, block_tables=None, causal: bool = True,
           scale=None, local_window_size=None, logit_soft_cap=None, sinks=None):
    """Checks ``q [batch, q_len, q_heads, head_dim]`` (q_len at most
    :data:`MAX_Q_LEN`), ``k, v [batch, kv_len, kv_heads, head_dim]`` (or
    pages ``[num_pages, page_size, kv_heads, head_dim]`` with
    ``block_tables [batch, max_pages]``), ``kv_lengths [batch]``, the
    window, the soft cap and ``sinks [q_heads]``; the problem of the call.
    A paged call's arrays are always ``(q, k, v, kv_lengths, block_tables)``
    (full lengths where none are given), the table as int32; sinks come
    last (:func:`decode_extra`)."""
    q, k, v = operand("q", q), operand("k", k), operand("v", v)
    if not isinstance(causal, (bool, jnp.bool_)) or isinstance(causal, jax.Array):
      raise ValueError(f"causal={causal!r} must be a Python bool (a static value)")
    window = check_window(local_window_size) or (-1, -1)
    cap = check_soft_cap(logit_soft_cap)
    page_size = 0
    if block_tables is None:
      scale = check_call(q, k, v, scale)
      kv_len = k.shape[1]
    else:
      scale, kv_len, num_pages, page_size, table = paging.check_paged_call(
          q, k, v, block_tables, kv_lengths, scale, window_left=window[0])
    batch, q_len, q_heads, head_dim = q.shape
    window = bound_sides(window, q_len, kv_len, bool(causal))
    if q_len > MAX_Q_LEN:
      raise ValueError(f"decode_attention takes at most {MAX_Q_LEN} new queries per "
                       f"sequence; got q_len={q_len} (use wavetune_jax.attention with "
                       f"causal_align='bottom_right' for longer chunks)")
    lengths = check_lengths(kv_lengths, batch, kv_len)
    sinks = check_sinks(sinks, q_heads)
    if batch == 0 or q_len == 0 or q_heads == 0:
      return jnp.zeros(q.shape, q.dtype)
    if page_size and lengths is None:
      lengths = jnp.full((batch,), kv_len, jnp.int32)
    problem = DecodeProblem(batch=batch, q_heads=q_heads, kv_heads=k.shape[2],
                            kv_len=kv_len, q_len=q_len, head_dim=head_dim,
                            dtype=q.dtype.name, lengths=lengths is not None,
                            causal=bool(causal), page_size=page_size,
                            window_left=window[0], window_right=window[1], soft_cap=cap,
                            sinks=sinks is not None)
    arrays, names = (q, k, v), ()
    if page_size:
      arrays, names = arrays + (lengths, table), ("kv_lengths", "block_tables")
    elif lengths is not None:
      arrays, names = arrays + (lengths,), ("kv_lengths",)
    if sinks is not None:
      arrays, names = arrays + (sinks,), names + ("sinks",)
    return Call(problem, arrays, {"scale": scale}, names)

  def window_variants(self, problems: list, suite: dict) -> list:
    """Each problem with each of ``suite["decode"]["windows"]`` shorter than
    its cache."""
    return window_variants(problems, suite["decode"].get("windows", ()))

  def modelled(self, problem: DecodeProblem) -> bool:
    """No soft cap or sinks (no sweep measures them; the backends' rules
    answer those). A window is modelled: the Mosaic kernel's (G, L) counts
    the blocks of the window's keys (``mosaic.coords_aux``), and the sweeps
    measure windows (``wavetune sweep --windows``)."""
    return not (problem.soft_cap or problem.sinks)

  def trusted_without_evidence(self, problem: DecodeProblem, config, platform, hw=None) -> bool:
    """The Mosaic kernel over XLA's attention where the problem has a
    window, soft-capping or sinks (cuDNN's decode in JAX runs none of them,
    so XLA's attention of the whole cache is the platform op): no table
    holds such problems. Measured by ``benchmarks/decode_options.py``
    (docs/results.md, "Decode with windows, soft-capping and sinks")."""
    from wavetune_jax.families.decode.library import XlaDecodeConfig
    from wavetune_jax.families.decode.mosaic import MosaicDecodeConfig
    return (not problem.plain and isinstance(config, MosaicDecodeConfig)
            and isinstance(platform, XlaDecodeConfig))

  def batched_call(self, axis_size: int, in_batched, arrays, op):
    """:func:`~wavetune_jax.families.attention.family.fold_vmap_into_batch`."""
    return fold_vmap_into_batch(axis_size, in_batched, arrays, op)

  def partition_rule(self, problem: DecodeProblem):
    """Batch and heads split (a KV head with its query heads); the sequence
    and head_dim are gathered. A paged cache: the batch splits the queries,
    lengths and block tables, the heads split the queries and the pages;
    the pool of pages is whole on every batch shard (a table names pages
    anywhere in it), and a table's pages are gathered."""
    h, sizes = query_heads(problem.group, problem.kv_heads)
    sinks = f", {h}" if problem.sinks else ""
    if problem.page_size:
      return PartitionRule(f"b q {h} d, n p g d, n p g d, b, b m{sinks} -> b q {h} d",
                           factor_sizes=sizes, replicated=("q", "n", "p", "m", "d"))
    lengths = ", b" if problem.lengths else ""
    return PartitionRule(f"b q {h} d, b s g d, b s g d{lengths}{sinks} -> b q {h} d",
                         factor_sizes=sizes, replicated=("q", "s", "d"))

  # --- problems ------------------------------------------------------------------------
  def problems_from_suite(self, suite, *, weights=None, sizes=None, dtype="bfloat16"):
    """``suite["decode"]``: every model at every batch, cache length and
    query count, with per-sequence lengths, keeping ``batch * kv_len <=
    max_tokens`` (the caches of one GPU)."""
    models = decode_models(suite, weights)
    d = suite["decode"]
    cap = d.get("max_tokens")
    lens = d["kv_len"] if sizes is None else sizes
    return [DecodeProblem(batch=b, q_heads=m["q_heads"], kv_heads=m["kv_heads"], kv_len=s,
                          q_len=t, head_dim=m["head_dim"], dtype=dtype, lengths=True)
            for m in models.values() for t in d.get("q_len", [1]) for b in d["batch"]
            for s in lens if cap is None or b * s <= cap]

  def problem_key(self, problem: DecodeProblem) -> str:
    p = problem
    return (f"b{p.batch}:h{p.q_heads}/{p.kv_heads}:q{p.q_len}:kv{p.kv_len}:d{p.head_dim}:"
            f"{'causal' if p.causal else 'full'}:{p.dtype}{':lengths' if p.lengths else ''}"
            f"{f':page{p.page_size}' if p.page_size else ''}{options_key(p)}")

  def problem_to_dict(self, problem: DecodeProblem) -> dict:
    """The fields; ``page_size`` only for a paged problem (files written
    before pages, and the keys of their problems, stay as they were)."""
    d = super().problem_to_dict(problem)
    if not d["page_size"]:
      del d["page_size"]
    for name, default in OPTION_DEFAULTS.items():  # likewise the options
      if d[name] == default:
        del d[name]
    return d

  def size_quantum(self, problem: DecodeProblem) -> int:
    """A paged problem's sizes are whole pages: one size per bucket."""
    return problem.page_size or super().size_quantum(problem)

  def inputs(self, problem: DecodeProblem, key: jax.Array):
    """``(q, k, v[, kv_lengths])``, the lengths of :attr:`length_mix`. A
    paged problem: ``(q, k_pages, v_pages, kv_lengths, block_tables)``, a
    pool of ``batch * max_pages`` pages and tables that are a random
    permutation of it (each page read once, in no order)."""
    p = problem
    kq, kk, kv = jax.random.split(key, 3)
    dt = jnp.dtype(p.dtype)
    q = jax.random.normal(kq, (p.batch, p.q_len, p.q_heads, p.head_dim), jnp.float32)
    rows = ((p.batch * p.max_pages, p.page_size) if p.page_size else (p.batch, p.kv_len))
    k = jax.random.normal(kk, rows + (p.kv_heads, p.head_dim), dt)
    v = jax.random.normal(kv, rows + (p.kv_heads, p.head_dim), dt)
    out = (q.astype(dt), k, v)
    if p.lengths:
      out += (self.length_values(p, jax.random.fold_in(key, 1)),)
    if p.page_size:
      out += (paging.shuffled_tables(jax.random.fold_in(key, 2), p.batch, p.max_pages),)
    if p.sinks:  # learned logits of the order of the scores
      out += (jax.random.normal(jax.random.fold_in(key, 3), (p.q_heads,), jnp.float32),)
    return out

  def length_values(self, problem: DecodeProblem, key: jax.Array) -> jax.Array:
    """The valid lengths of :meth:`inputs`: :meth:`lengths` ("spread") or
    every sequence ``kv_len`` ("full")."""
    if self.length_mix == "full":
      return jnp.full((problem.batch,), problem.kv_len, jnp.int32)
    return self.lengths(problem, key)

  @staticmethod
  def lengths(problem: DecodeProblem, key: jax.Array) -> jax.Array:
    """Valid lengths of a cache whose sequences are spread evenly over
    ``[q_len, kv_len]`` (quantiles of the uniform distribution, in random
    order): the batch holds the same mix of short and long sequences at
    every draw, so sweeps at neighbouring sizes see the same work (a random
    draw of one sequence's length would be noise to the model)."""
    p = problem
    lo = min(p.q_len, p.kv_len)
    lens = lo + ((p.kv_len - lo) * (2 * np.arange(p.batch) + 1)) // (2 * p.batch)
    return jax.random.permutation(key, jnp.asarray(lens, jnp.int32))

  def reference(self, problem: DecodeProblem, q, k, v, *extra):
    # All queries in one chunk: no padding rows, so the float32 scores stay
    # [batch, heads, q_len, kv_len]. Pages: the gathered contiguous cache.
    kv_lengths, block_tables, sinks = decode_extra(problem, extra)
    if block_tables is not None:
      k, v = paging.gather_pages(k, block_tables), paging.gather_pages(v, block_tables)
    return attention_reference(q, k, v, causal=problem.causal, out_dtype=jnp.float32,
                               kv_lengths=kv_lengths, causal_align="bottom_right",
                               q_chunk=problem.q_len,
                               local_window_size=bounded_window(problem.window, problem.kv_len),
                               logit_soft_cap=problem.soft_cap or None, sinks=sinks)

  def baseline(self, problem: DecodeProblem):
    """cuDNN through ``jax.nn.dot_product_attention`` (lengths as
    ``key_value_seq_lengths``); XLA where JAX's cuDNN path has no such mask
    (several causal queries) or head_dim. A paged problem: cuDNN's paged
    attention where the cuDNN backend runs the problem, else XLA's on the
    gathered pages."""
    if problem.page_size or not problem.plain:
      from wavetune_jax.families.decode.library import CudnnDecode
      impl = "xla" if CudnnDecode()._why_not(problem, None) else "cudnn"
    else:
      impl = "cudnn" if plain_mask(problem) and problem.head_dim % 8 == 0 else "xla"
    return self._library(problem, impl)

  def extra_baselines(self, problem: DecodeProblem) -> dict:
    return {"xla": self._library(problem, "xla")}

  @staticmethod
  def _library(problem: DecodeProblem, impl: str):
    return lambda q, k, v, *extra: library_attention(problem, impl, q, k, v,
                                                     *decode_extra(problem, extra))

  def tolerance(self, problem: DecodeProblem) -> float:
    return 1e-2

  def default(self, problem: DecodeProblem):
    """The fixed config of an untuned library: the defaults of JAX's own
    Pallas decode attention (16 query rows, 128-key blocks, 16 splits, 4
    warps, 2 stages), rows and splits fitted to the problem. XLA's
    attention where the kernel does not run the problem (a window,
    soft-capping or sinks)."""
    from wavetune_jax.families.decode.library import XlaDecodeConfig
    from wavetune_jax.families.decode.triton import _rows_block, block_ks, splits_of
    from pallas_kernels.decode.triton import TritonDecodeConfig
    if not problem.plain:
      return XlaDecodeConfig()
    bk = 128
    if problem.page_size:  # the largest block up to 128 that fits the pages
      fits = [b for b in block_ks(problem.page_size, False) if b <= 128]
      if not fits:
        return XlaDecodeConfig()  # no Triton block fits these pages
      bk = fits[-1]
    return TritonDecodeConfig(block_h=_rows_block(problem.rows), block_k=bk,
                              num_splits=splits_of(problem.kv_len, 16, bk), num_warps=4,
                              num_stages=2)
