"""The attention family: flash-attention forward ``softmax(q k^T * scale) v``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from pallas_kernels.attention.common import (bounded_window, check_align, check_call,
                                             bound_sides,
                                             check_lengths, check_sinks, check_soft_cap,
                                             check_window)
from pallas_kernels.attention.reference import attention_reference
from wavetune_jax.core.family import Call, Family
from wavetune_jax.core.partition import PartitionRule
from wavetune_jax.families.attention.problem import AttentionProblem
from wavetune_jax.families.matmul.family import operand
from wavetune_jax.shapes import suite_entries

__all__ = ["AttentionFamily", "attention_models"]


def attention_models(suite: dict, names=None) -> dict[str, dict]:
  """``{model name: {"q_heads", "kv_heads", "head_dim"}}`` of a suite's attention
  section, optionally filtered."""
  found = suite_entries(suite, "attention", "models", names)
  return found


def split_extra(problem, extra: tuple):
  """``(kv_lengths, sinks)`` of the arrays after ``q, k, v`` of a call."""
  extra = list(extra)
  lengths = extra.pop(0) if problem.lengths and extra else None
  sinks = extra.pop(0) if problem.sinks and extra else None
  return lengths, sinks


def window_variants(problems: list, windows) -> list:
  """Each problem with each window ``w`` shorter than its keys: the query
  sees its last ``w`` positions, ``(w - 1, 0)``."""
  return [p.__class__(**{**{f: getattr(p, f) for f in p.__dataclass_fields__
                            if p.__dataclass_fields__[f].init},
                         "window_left": w - 1, "window_right": 0})
          for p in problems for w in windows if w < p.kv_len]


def fold_vmap_into_batch(axis_size: int, in_batched, arrays, op):
  """``jax.vmap`` of an attention op whose arrays are ``(q, k, v)``, then the
  batch-indexed integer arrays (``kv_lengths``; a paged cache's block table
  after them), then float ``sinks [q_heads]``: the vmapped axis is folded
  into the batch (``[V, B, ...] -> [V * B, ...]``, an unbatched array
  broadcast), and ``op`` runs one call of ``V * B`` sequences, its config
  chosen for them. JAX's cuDNN attention has no working batching rule with
  sequence lengths (it reshapes them to the wrong size), and one call of
  the whole batch is what a kernel runs best. Per-instance page pools
  become one pool of ``V`` pools, each instance's table offset into it
  (entries below 0 kept); per-instance sinks have no batch to fold into,
  so each instance is its own call.

  Returns:
    ``[V, B, q_len, q_heads, head_dim]``.
  """
  q, k, v, *rest = arrays
  qb, kb, vb, *rb = in_batched
  if any(b and not jnp.issubdtype(x.dtype, jnp.integer) for x, b in zip(rest, rb)):
    return jnp.stack([op(*(x[i] if b else x for x, b in zip(arrays, in_batched)))
                      for i in range(axis_size)])

  def fold(x, batched):
    x = x if batched else jnp.broadcast_to(x, (axis_size,) + x.shape)
    return x.reshape((-1,) + x.shape[2:])

  batch = q.shape[1] if qb else q.shape[0]
  ints = [i for i, x in enumerate(rest) if jnp.issubdtype(x.dtype, jnp.integer)]
  rest = list(rest)
  if len(ints) == 2 and (kb or vb):       # a paged cache, a pool per instance
    pages = (k if kb else v).shape[1]
    t = rest[ints[1]]
    t = t if rb[ints[1]] else jnp.broadcast_to(t, (axis_size,) + t.shape)
    offset = (jnp.arange(axis_size, dtype=t.dtype) * pages)[:, None, None]
    rest[ints[1]] = jnp.where(t < 0, t, t + offset).reshape((-1,) + t.shape[2:])
    rest[ints[0]] = fold(rest[ints[0]], rb[ints[0]])
    k, v = fold(k, kb), fold(v, vb)
  elif len(ints) == 2:                     # a paged cache, one pool
    for i in ints:
      rest[i] = fold(rest[i], rb[i])
  else:
    k, v = fold(k, kb), fold(v, vb)
    for i in ints:
      rest[i] = fold(rest[i], rb[i])
  y = op(fold(q, qb), k, v, *rest)
  return y.reshape((axis_size, batch) + y.shape[1:])


def query_heads(group: int, kv_heads: int) -> tuple[str, dict]:
  """The query heads in a partition rule and their factor sizes: the KV
  heads ``g``, each with ``r = group`` query heads, ``(g r)``; ``g`` where
  each KV head has one query head, ``r`` where there is one KV head (Shardy
  rejects a factor of size 1 in a compound dimension: multi-head and
  multi-query attention under ``jax.jit`` on several devices failed to
  lower)."""
  if group > 1 and kv_heads > 1:
    return "(g r)", {"r": group}
  return ("r", {}) if group > 1 else ("g", {})


def options_key(p) -> str:
  """The problem-key suffix of a window, soft-capping and sinks (empty
  without them: keys of plain attention are those of files on record)."""
  out = ""
  if p.windowed:
    out += f":w{p.window_left},{p.window_right}"
  if p.soft_cap:
    out += f":cap{p.soft_cap:g}"
  if p.sinks:
    out += ":sinks"
  return out



def canonical_window(problem):
  """``problem`` (attention or decode) with the window's sides that bound
  nothing dropped, as the ops key it
  (:func:`~pallas_kernels.attention.common.bound_sides`)."""
  w = bound_sides((problem.window_left, problem.window_right), problem.q_len,
                  problem.kv_len, problem.causal)
  if w == (problem.window_left, problem.window_right):
    return problem
  return dataclasses.replace(problem, window_left=w[0], window_right=w[1])

class AttentionFamily(Family):
  """Flash attention forward, layout ``[batch, seq, heads, head_dim]``, GQA;
  cuDNN (``jax.nn.dot_product_attention``) is the baseline."""

  name = "attention"
  problem_cls = AttentionProblem
  size_field = "q_len"
  # The selector keeps the heuristic's config unless the model predicts a gain
  # above this margin. On the Triton-only H200 sweep (3% budget, seed 0) a
  # model fitted on 1-3 anchors per variant scored 0.896 of the oracle held
  # out without the guard and 0.953 with it (the heuristic alone: 0.960).
  # With both backends the guard keeps the heuristic on every held-out
  # problem (docs/results.md, "Attention"). GEMM uses a 30% margin.
  heuristic_margin = 0.1
  baseline_name = "cuDNN"
  evidence_categorical = ("head_dim",)
  # The guard's rule: held-out replays of both GPUs' sweeps (5 splits;
  # benchmarks/guard_radius.py, docs/design.md "The guard").
  guard_rule = {"weight_radius": 1.0, "size_radius": 0.5, "win": 0.97}
  # Files recorded before backends were named: no "backend" key is a Triton
  # config, backend 1 a Mosaic one.
  legacy_default_backend = "triton"
  legacy_backends = {0: "triton", 1: "mosaic"}

  # --- the call ------------------------------------------------------------------------

  def canonical(self, problem):
    """:func:`canonical_window`."""
    return canonical_window(problem)
  def bind(self, q, k, v, *, causal: bool = True, scale: float | None = None,
           kv_lengths=None, causal_align: str = "top_left", local_window_size=None,
           logit_soft_cap: float | None = None, sinks=None):
    """Checks ``q [batch, q_len, q_heads, head_dim]``, ``k, v [batch,
    kv_len, kv_heads, head_dim]``, ``kv_lengths [batch]``, the window, the
    soft cap and ``sinks [q_heads]``; the problem of the call."""
    q, k, v = operand("q", q), operand("k", k), operand("v", v)
    if not isinstance(causal, (bool, jnp.bool_)) or isinstance(causal, jax.Array):
      raise ValueError(f"causal={causal!r} must be a Python bool (a static value)")
    scale = check_call(q, k, v, scale)
    check_align(causal_align)
    window = check_window(local_window_size)
    cap = check_soft_cap(logit_soft_cap)
    batch, q_len, q_heads, head_dim = q.shape
    lengths = check_lengths(kv_lengths, batch, k.shape[1])
    sinks = check_sinks(sinks, q_heads)
    if batch == 0 or q_len == 0 or q_heads == 0:
      return jnp.zeros(q.shape, q.dtype)
    window = bound_sides(window, q_len, k.shape[1], bool(causal))
    problem = AttentionProblem(batch=batch, q_heads=q_heads, kv_heads=k.shape[2],
                               q_len=q_len, kv_len=k.shape[1], head_dim=head_dim,
                               causal=bool(causal), dtype=q.dtype.name,
                               lengths=lengths is not None, causal_align=causal_align,
                               window_left=window[0], window_right=window[1], soft_cap=cap,
                               sinks=sinks is not None)
    arrays, names = (q, k, v), ()
    if lengths is not None:
      arrays, names = arrays + (lengths,), names + ("kv_lengths",)
    if sinks is not None:
      arrays, names = arrays + (sinks,), names + ("sinks",)
    return Call(problem, arrays, {"scale": scale}, names)

  def window_variants(self, problems: list, suite: dict) -> list:
    """Each problem with each of ``suite["attention"]["windows"]`` shorter
    than its sequence."""
    return window_variants(problems, suite["attention"].get("windows", ()))

  def modelled(self, problem: AttentionProblem) -> bool:
    """Plain attention only. The sweeps measure windows (``wavetune sweep
    --windows``) and (G, L) counts the KV blocks a window visits
    (``problem.coords``), but on the H100 sweep with windows the fitted
    models then sent plain 1,000-token problems to a Mosaic config at
    0.90-0.94x cuDNN, and the rule already picks the oracle's backend on
    every window of 128-1,024 (docs/results.md, "Windows in the sweeps and
    tables"). Window measurements make exact entries and evidence; soft
    caps and sinks are measured by no sweep (the backends' rules answer), nor
    are KV lengths or the bottom-right alignment (the rules answer: the
    Mosaic kernel's where it reaches, else Triton's under the guard)."""
    return problem.plain and not (problem.lengths or problem.shifted)

  def trusted_without_evidence(self, problem: AttentionProblem, config, platform, hw=None) -> bool:
    """The Mosaic kernel over XLA's attention where the problem soft-caps,
    has sinks or a window (XLA's attention is the platform op where cuDNN
    runs none of them: a window with KV lengths, the bottom-right alignment
    or a right side): no table holds such problems, and XLA writes the whole
    score matrix where the kernel reads a window's blocks. On an H100 the
    kernel ran 6.5-72x faster than it on every soft-capped or sink problem
    measured (``benchmarks/attention_options.py``), and on an H200 27-69x on
    every such window (``benchmarks/attention_band.py``; docs/results.md).
    Also its rule config on KV lengths or the bottom-right alignment without
    an option (:func:`~wavetune_jax.families.attention.mosaic.lengths_rule`:
    4.2-12.8x XLA's attention on an H200). And the kernel's
    rule config over cuDNN's sliding window where its persistent grid takes
    the window (:func:`~wavetune_jax.families.attention.mosaic.persistent_wins`:
    measured on GQA groups and windows the table's sweep does not hold), within
    what was measured: windows of 128-4,096 keys, GQA groups of 2-8,
    bfloat16."""
    from wavetune_jax.families.attention import mosaic
    from wavetune_jax.families.attention.cudnn import CudnnAttentionConfig
    from wavetune_jax.families.attention.xla import XlaAttentionConfig
    if not isinstance(config, mosaic.MosaicAttentionConfig):
      return False
    if isinstance(platform, XlaAttentionConfig):
      return (problem.soft_cap > 0 or problem.sinks or problem.windowed
              or (hw is not None and config == mosaic.lengths_rule(problem, hw)))
    # As measured: windows of 128-4,096 keys, GQA groups of 2-8, bfloat16.
    return (isinstance(platform, CudnnAttentionConfig) and hw is not None
            and problem.windowed and config == mosaic.MosaicAttention.HEURISTIC
            and 127 <= problem.window_left <= 4095   # 128-4,096 keys
            and 2 <= problem.q_heads // problem.kv_heads <= 8
            and problem.dtype == "bfloat16"
            and mosaic.persistent_wins(problem, hw))

  def batched_call(self, axis_size: int, in_batched, arrays, op):
    """:func:`fold_vmap_into_batch`."""
    return fold_vmap_into_batch(axis_size, in_batched, arrays, op)

  def partition_rule(self, problem):
    """Batch and heads split (a query head with its KV head: the KV heads
    are the factor ``g``, each with ``r`` query heads); the sequence and
    head_dim are gathered: a kernel needs every key of its query rows."""
    h, sizes = query_heads(problem.q_heads // problem.kv_heads, problem.kv_heads)
    lengths = ", b" if problem.lengths else ""
    sinks = f", {h}" if problem.sinks else ""
    return PartitionRule(f"b q {h} d, b s g d, b s g d{lengths}{sinks} -> b q {h} d",
                         factor_sizes=sizes, replicated=("q", "s", "d"))

  # --- problems ------------------------------------------------------------------------
  def problems_from_suite(self, suite, *, weights=None, sizes=None, dtype="bfloat16"):
    """``suite["attention"]``: every model at every batch and sequence length
    (causal self-attention, ``kv_len = q_len``)."""
    models = attention_models(suite, weights)
    att = suite["attention"]
    seqs = att["seq"] if sizes is None else sizes
    return [AttentionProblem(batch=b, q_heads=m["q_heads"], kv_heads=m["kv_heads"],
                             q_len=s, head_dim=m["head_dim"], causal=True, dtype=dtype)
            for m in models.values() for b in att["batch"] for s in seqs]

  def problem_key(self, problem: AttentionProblem) -> str:
    p = problem
    extra = (":lengths" if p.lengths else "") + (
        ":bottom_right" if p.causal_align == "bottom_right" else "") + options_key(p)
    return (f"b{p.batch}:h{p.q_heads}/{p.kv_heads}:q{p.q_len}:kv{p.kv_len}:d{p.head_dim}:"
            f"{'causal' if p.causal else 'full'}:{p.dtype}{extra}")

  def with_size(self, problem: AttentionProblem, size: int) -> AttentionProblem:
    """Prefill grows q_len and kv_len together (self-attention)."""
    kv = int(size) if problem.kv_len == problem.q_len else problem.kv_len
    return problem.__class__(batch=problem.batch, q_heads=problem.q_heads,
                             kv_heads=problem.kv_heads, q_len=int(size), kv_len=kv,
                             head_dim=problem.head_dim, causal=problem.causal,
                             dtype=problem.dtype, lengths=problem.lengths,
                             causal_align=problem.causal_align,
                             window_left=problem.window_left,
                             window_right=problem.window_right, soft_cap=problem.soft_cap,
                             sinks=problem.sinks)

  def weight_of(self, problem: AttentionProblem) -> tuple:
    """Every field but the lengths; self-attention (kv_len = q_len) is its own kind."""
    kv = "=q" if problem.kv_len == problem.q_len else problem.kv_len
    return (("batch", problem.batch), ("causal", problem.causal), ("dtype", problem.dtype),
            ("head_dim", problem.head_dim), ("kv_heads", problem.kv_heads),
            ("kv_len", kv), ("q_heads", problem.q_heads), ("lengths", problem.lengths),
            ("causal_align", problem.causal_align)) + (() if problem.plain else (
                ("window_left", problem.window_left), ("window_right", problem.window_right),
                ("soft_cap", problem.soft_cap), ("sinks", problem.sinks)))

  def inputs(self, problem: AttentionProblem, key: jax.Array):
    p = problem
    kq, kk, kv = jax.random.split(key, 3)
    dt = jnp.dtype(p.dtype)
    q = jax.random.normal(kq, (p.batch, p.q_len, p.q_heads, p.head_dim), jnp.float32)
    k = jax.random.normal(kk, (p.batch, p.kv_len, p.kv_heads, p.head_dim), jnp.float32)
    v = jax.random.normal(kv, (p.batch, p.kv_len, p.kv_heads, p.head_dim), jnp.float32)
    out = (q.astype(dt), k.astype(dt), v.astype(dt))
    if p.lengths:  # a KV cache: valid lengths from 1 to kv_len
      lens = jax.random.randint(jax.random.fold_in(key, 1), (p.batch,), 1, p.kv_len + 1)
      out += (lens.astype(jnp.int32),)
    if p.sinks:  # learned logits of the order of the scores
      out += (jax.random.normal(jax.random.fold_in(key, 2), (p.q_heads,), jnp.float32),)
    return out

  def reference(self, problem: AttentionProblem, q, k, v, *extra):
    kv_lengths, sinks = split_extra(problem, extra)
    return attention_reference(q, k, v, causal=problem.causal, out_dtype=jnp.float32,
                               kv_lengths=kv_lengths, causal_align=problem.causal_align,
                               local_window_size=bounded_window(problem.window,
                                                                problem.kv_len),
                               logit_soft_cap=problem.soft_cap or None, sinks=sinks)

  def baseline(self, problem: AttentionProblem):
    """cuDNN's fused attention through ``jax.nn.dot_product_attention``."""
    return self._jax_nn(problem, "cudnn")

  # XLA's attention writes the float32 score matrix: above this many bytes
  # of it the sweeps do not time it (an H100's autotuner runs out of memory
  # at 96 GiB and more; 32 GiB compiled and ran).
  XLA_SCORE_BYTES = 32 << 30

  def extra_baselines(self, problem: AttentionProblem) -> dict:
    """XLA's attention, where its float32 score matrix fits (``XLA_SCORE_BYTES``)."""
    p = problem
    if 4 * p.batch * p.q_heads * p.q_len * p.kv_len > self.XLA_SCORE_BYTES:
      return {}
    return {"xla": self._jax_nn(problem, "xla")}

  @staticmethod
  def _jax_nn(problem, implementation):
    from wavetune_jax.families.attention import cudnn, xla
    if (problem.shifted or (problem.lengths and implementation == "xla")
        or problem.soft_cap or problem.sinks
        or (implementation == "cudnn" and not cudnn.runs_window(problem))):
      # An explicit mask, XLA's implementation: what the XLA backend runs.
      return lambda q, k, v, *extra: xla.masked_attention(
          problem, q, k, v, *split_extra(problem, extra))

    def f(q, k, v, kv_lengths=None):
      return jax.nn.dot_product_attention(q, k, v, is_causal=problem.causal,
                                          key_value_seq_lengths=kv_lengths,
                                          local_window_size=cudnn.jax_nn_window(problem),
                                          implementation=implementation)
    return f

  def tolerance(self, problem: AttentionProblem) -> float:
    return 1e-2

  def default(self, problem: AttentionProblem):
    """The fixed config of an untuned library: the defaults of JAX's own Pallas
    flash attention (128x128 blocks, 8 warps above head_dim 64, 2 stages).
    XLA's attention where that kernel does not run the problem (a window,
    soft-capping or sinks)."""
    from wavetune_jax.families.attention.triton import TritonAttentionConfig
    if not problem.plain:
      from wavetune_jax.families.attention.xla import XlaAttentionConfig
      return XlaAttentionConfig()
    return TritonAttentionConfig(block_q=128, block_k=128,
                                 num_warps=4 if problem.head_dim <= 64 else 8, num_stages=2)
