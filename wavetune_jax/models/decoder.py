"""A Llama-style decoder (dense or mixture-of-experts MLP) with a KV cache.

Real shapes, random weights, bf16. Per layer: RMSNorm, q/k/v projections,
causal attention with GQA (prefill) or decode attention against the cache
(one new token per sequence, per-sequence lengths), output projection, then
SwiGLU: dense (gate and up as one fused GEMM, down) or routed to experts
(router top-k, tokens sorted by expert, grouped GEMMs w13 and w2, weighted
unsort). Layers are unrolled, each with weights and a cache of its own (no
stacked arrays sliced per layer, so no setting pays for slicing copies).
Rotary embeddings are left out: elementwise, the same in every configuration.
Attention may have the options of current models (``ModelConfig.window``,
``global_every``, ``soft_cap``, ``sinks``): local and global layers,
soft-capped logits, per-head sinks.

The KV cache is contiguous (``prefill``, ``decode_step``: per layer
``[batch, max_len, kv_heads, head_dim]``) or paged as serving stacks keep it
(``paged_prefill``, ``paged_decode_step``: per layer a pool of pages
``[num_pages, page_size, kv_heads, head_dim]``, and one block table
``[batch, max_pages]`` shared by the layers naming each sequence's pages in
order; ``random_block_tables`` shuffles a pool as a serving allocator leaves
it).

``make_ops(name)`` is the one switch: ``"xla"`` is what a JAX user writes
(``jnp.dot``, ``jax.nn.dot_product_attention`` with cuDNN where it runs the
shape, ``lax.ragged_dot``); any selection policy of
``wavetune_jax.POLICIES`` (``"auto"``, ``"refine"``, ``"tables"``,
``"heuristic"``, ...) runs the wavetune ops under that policy, and
``"default"`` under ``"fixed"`` (the fixed config of an untuned library).
On a paged cache the wavetune decode attention takes the pages and the
block table; the xla setting gathers the pages into a contiguous cache
(``k_pages[block_tables]``) and calls ``jax.nn.dot_product_attention`` as
on a contiguous cache, what a JAX user writes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp

from pallas_kernels.decode import paging

__all__ = ["ModelConfig", "MODELS", "OPS", "Ops", "make_ops", "ops_names", "init",
           "quantize_params", "WEIGHT_FORMATS", "prefill",
           "decode_step", "paged_prefill", "paged_decode_step", "random_block_tables",
           "random_kv_caches", "moe_mlp", "library_attention_impl"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Shapes of a decoder (public configs). ``experts = 0``: a dense MLP.

  Attention options: ``window > 0``: local layers attend to the last
  ``window`` positions (the query's own included); ``global_every = k > 0``:
  every k-th layer (``i % k == k - 1``) is global, the others local (Gemma-3's
  five local to one global: 6; 0: every layer local). ``soft_cap``: attention
  logit soft-capping (Gemma-2: 50.0; 0: none). ``sinks``: a learned sink
  logit per query head in every layer (gpt-oss)."""

  name: str
  hidden: int
  inter: int
  q_heads: int
  kv_heads: int
  head_dim: int
  layers: int
  vocab: int
  experts: int = 0
  top_k: int = 0
  window: int = 0
  global_every: int = 0
  soft_cap: float = 0.0
  sinks: bool = False

  def __post_init__(self):
    for name in ("window", "global_every"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"ModelConfig.{name}={v!r} must be an int >= 0")
    if (isinstance(self.soft_cap, bool) or not isinstance(self.soft_cap, (int, float))
        or not self.soft_cap >= 0 or self.soft_cap == float("inf")):
      raise ValueError(f"ModelConfig.soft_cap={self.soft_cap!r} must be a finite float >= 0")

  def with_layers(self, layers: int) -> "ModelConfig":
    if layers < 1:
      raise ValueError(f"layers={layers} must be >= 1")
    return dataclasses.replace(self, layers=layers)

  def layer_window(self, i: int) -> int:
    """Layer ``i``'s window (0: global attention)."""
    if not self.window or (self.global_every and i % self.global_every == self.global_every - 1):
      return 0
    return self.window

  def attention_options(self, i: int, params: dict) -> dict:
    """Layer ``i``'s keyword options of ``wt.attention`` / ``wt.decode_attention``."""
    out = {}
    if self.layer_window(i):
      out["local_window_size"] = (self.layer_window(i) - 1, 0)
    if self.soft_cap:
      out["logit_soft_cap"] = float(self.soft_cap)
    if self.sinks:
      out["sinks"] = params["sinks"]
    return out


MODELS = {m.name: m for m in (
    ModelConfig("llama3_8b", 4096, 14336, 32, 8, 128, 32, 128256),
    ModelConfig("llama3_70b", 8192, 28672, 64, 8, 128, 80, 128256),
    ModelConfig("mixtral_8x7b", 4096, 14336, 32, 8, 128, 32, 32000, experts=8, top_k=2),
    # Models outside the training suites (Hugging Face config.json; the
    # decoder keeps their GEMM and attention shapes, not Gemma's GeGLU,
    # soft-capping or sliding windows): Llama-3.2-1B (head_dim 64),
    # Qwen2.5-1.5B (12 query heads on 2 KV heads), Gemma-2-2B (head_dim 256,
    # q_heads * head_dim = 2048 != hidden 2304).
    ModelConfig("llama3_2_1b", 2048, 8192, 32, 8, 64, 16, 128256),
    ModelConfig("qwen2_5_1_5b", 1536, 8960, 12, 2, 128, 28, 151936),
    ModelConfig("gemma_2_2b", 2304, 9216, 8, 4, 256, 26, 256000),
    # Models whose attention has the options (their GEMM and attention shapes,
    # windows, soft caps and sinks): Gemma-3-4B (five local layers of 1,024
    # positions to one global), gpt-oss-20b (a mixture of 32 experts, top 4;
    # local layers of 128 positions alternating with global ones; sinks).
    ModelConfig("gemma_3_4b", 2560, 10240, 8, 4, 256, 34, 262144, window=1024,
                global_every=6),
    ModelConfig("gpt_oss_20b", 2880, 2880, 64, 8, 64, 24, 201088, experts=32, top_k=4,
                window=128, global_every=2, sinks=True),
    # Tiny versions of both kinds, for CPU tests (Pallas interpret mode).
    ModelConfig("small", 64, 128, 4, 2, 32, 2, 256),
    ModelConfig("small_moe", 64, 64, 4, 2, 32, 2, 256, experts=4, top_k=2),
    ModelConfig("small_local", 64, 128, 4, 2, 32, 3, 256, window=8, global_every=3,
                soft_cap=20.0, sinks=True),
)}

#: The op switch's usual settings (``wavetune bench model``'s default);
#: :func:`ops_names` lists every one it takes.
OPS = ("xla", "tables", "heuristic", "default")


def ops_names() -> tuple[str, ...]:
  """Every setting :func:`make_ops` takes: ``OPS`` and each selection
  policy of this library (read when called, so policies added later count)."""
  from wavetune_jax.runtime.selector import POLICIES
  return tuple(dict.fromkeys(OPS + tuple(POLICIES)))


class Ops(NamedTuple):
  """The ops a decoder calls, and the context its trace runs in."""

  name: str
  matmul: Callable
  attention: Callable         # (q, k, v, **options) -> causal prefill attention
  # (q, k_cache, v_cache, lengths, block_tables=None, **options) -> one token's
  # attention; with block_tables the caches are pages [num_pages, page_size,
  # kv_heads, head_dim]. options: ModelConfig.attention_options.
  decode_attention: Callable
  ragged_dot: Callable
  context: Callable           # () -> context manager active while tracing
  # (x, w_q, scales, x_scales=None, w_layout="kn", out_dtype=None) -> the
  # product with a weight of quantize_params (wt.quantized_matmul's arguments).
  qmatmul: Callable = None
  # (x, w_q, scales, group_sizes, x_scales=None, w_layout="kn", out_dtype=None)
  # -> the grouped product with 8-bit expert weights, weight-only or W8A8
  # (wt.quantized_ragged_dot's arguments).
  qragged_dot: Callable = None


def library_attention_impl(q: jax.Array) -> str | None:
  """``implementation=`` for ``jax.nn.dot_product_attention`` as a JAX user
  sets it: ``"cudnn"`` on a GPU where cuDNN runs the shape (16-bit, head_dim
  a multiple of 8 up to 128, or 256 on Hopper), else ``"xla"``; ``None`` off
  a GPU. (JAX's ``implementation=None`` means XLA's unfused attention, whose
  scores take O(length^2) memory.)"""
  if jax.default_backend() != "gpu":
    return None
  d = q.shape[-1]
  try:
    hopper = float(jax.devices()[0].compute_capability) >= 9.0
  except (AttributeError, TypeError, ValueError):
    hopper = False
  fits = d % 8 == 0 and d <= (256 if hopper else 128)
  return "cudnn" if fits and q.dtype in (jnp.bfloat16, jnp.float16) else "xla"


def make_ops(name: str) -> Ops:
  """The ops of one setting of the switch (see the module doc)."""
  import wavetune_jax as wt
  if name == "xla":
    from wavetune_jax.families.qmatmul.backends import xla_qmatmul
    from wavetune_jax.families.qragged_dot.backends import xla_qragged_dot
    default_out = lambda x: jnp.bfloat16 if x.dtype == jnp.float8_e4m3fn else x.dtype
    return Ops("xla", lambda x, w: jnp.dot(x, w), _xla_attention, _xla_decode_attention,
               jax.lax.ragged_dot, contextlib.nullcontext,
               lambda x, w, s, out_dtype=None, **kw: xla_qmatmul(
                   x, w, s, out_dtype or default_out(x), **kw),
               lambda x, w, s, gs, out_dtype=None, **kw: xla_qragged_dot(
                   x, w, s, gs, out_dtype or default_out(x), **kw))
  from wavetune_jax.runtime.selector import POLICIES
  policy = "fixed" if name == "default" else name if name in POLICIES else None
  if policy is None:
    raise ValueError(f"unknown ops {name!r}; choose from {ops_names()}")
  return Ops(name, wt.matmul, lambda q, k, v, **o: wt.attention(q, k, v, causal=True, **o),
             lambda q, k, v, n, block_tables=None, **o: wt.decode_attention(
                 q, k, v, kv_lengths=n, block_tables=block_tables, **o),
             wt.ragged_dot, lambda: wt.policy(policy), wt.quantized_matmul,
             wt.quantized_ragged_dot)


def _cpu_float16(q) -> bool:
  """float16 on a CPU: ``jax.nn.dot_product_attention``'s XLA implementation
  asks for the F16_F16_F32 dot algorithm, which XLA's CPU backend refuses
  (JAX 0.10), so the xla setting writes the same attention out there."""
  return q.dtype == jnp.float16 and jax.default_backend() == "cpu"


def _xla_attention(q, k, v, **options):
  """The xla setting's prefill attention: ``jax.nn.dot_product_attention``
  (cuDNN where it runs the shape, with its sliding window); soft-capping or
  sinks, which it has no argument for: XLA's attention written out with a
  float32 softmax (``wt.XlaAttentionConfig``)."""
  if "logit_soft_cap" in options or "sinks" in options or _cpu_float16(q):
    import wavetune_jax as wt
    return wt.attention(q, k, v, causal=True, config=wt.XlaAttentionConfig(), **options)
  return jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                      local_window_size=options.get("local_window_size"),
                                      implementation=library_attention_impl(q))


def _xla_decode_attention(q, k, v, lengths, block_tables=None, **options):
  """The xla setting's decode attention: on a paged cache, the pages gathered
  into a contiguous ``[batch, max_pages * page_size, ...]`` cache first. A
  window, soft-capping or sinks: XLA's attention with the window's mask (the
  queries sit at each sequence's length, where ``jax.nn``'s window does not
  put them) and a float32 softmax (``wt.XlaDecodeConfig``)."""
  if options or _cpu_float16(q):
    import wavetune_jax as wt
    return wt.decode_attention(q, k, v, kv_lengths=lengths, block_tables=block_tables,
                               config=wt.XlaDecodeConfig(), **options)
  if block_tables is not None:
    b, pages = block_tables.shape
    k = k[block_tables].reshape(b, pages * k.shape[1], *k.shape[2:])
    v = v[block_tables].reshape(b, pages * v.shape[1], *v.shape[2:])
  return jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                      implementation=library_attention_impl(q))


def init(key: jax.Array, cfg: ModelConfig, dtype=jnp.bfloat16) -> dict:
  """Random weights (scaled normal); ``"layers"`` is a list, one dict of
  arrays per layer."""
  h, d = cfg.hidden, cfg.head_dim
  shapes = {"wqkv": (h, (cfg.q_heads + 2 * cfg.kv_heads) * d), "wo": (cfg.q_heads * d, h)}
  if cfg.experts:
    shapes.update(router=(h, cfg.experts), w13=(cfg.experts, h, 2 * cfg.inter),
                  w2=(cfg.experts, cfg.inter, h))
  else:
    shapes.update(w13=(h, 2 * cfg.inter), w2=(cfg.inter, h))
  if cfg.sinks:  # learned logits of the order of the scores
    shapes.update(sinks=(1, cfg.q_heads))
  keys = jax.random.split(key, len(shapes) + 2)

  def normal(k, shape, fan_in, dt=dtype):
    return (jax.random.normal(k, shape, jnp.float32) / fan_in ** 0.5).astype(dt)

  stacked = {n: normal(k, (cfg.layers,) + s, s[-2],
                      jnp.float32 if n in ("router", "sinks") else dtype)
             for k, (n, s) in zip(keys, shapes.items())}
  layers = [{n: w[i] for n, w in stacked.items()} for i in range(cfg.layers)]
  for p in layers:
    if "sinks" in p:
      p["sinks"] = p["sinks"][0]
  return {"embed": normal(keys[-2], (cfg.vocab, h), 1), "layers": layers,
          "lm_head": normal(keys[-1], (h, cfg.vocab), h)}


#: ``quantize_params``'s formats: 16-bit weights as they are, the dense
#: GEMMs' weights in int8 / float8_e4m3fn with a scale per output channel
#: (weight-only), or ``"w8a8"``: e4m3 weights stored ``[N, K]`` (experts
#: ``[E, N, K]``) and e4m3 activations, each GEMM's input quantized per token
#: as it runs (``wavetune_jax.quantize_rows``), the FP8 tensor cores' GEMM.
WEIGHT_FORMATS = {"bf16": None, "int8": "int8", "fp8": "float8_e4m3fn", "int4": "int4",
                  "w8a8": "float8_e4m3fn"}
#: The layer weights quantize_params quantizes (dense MLPs, and experts under
#: ``"w8a8"``; the embedding and router stay 16-bit, the LM head unless asked).
_QUANTIZED = ("wqkv", "wo", "w13", "w2")


def quantize_params(params: dict, cfg: ModelConfig, weights: str, *, quantize=None,
                    lm_head: bool = False, experts: bool = False,
                    layout: str | None = None) -> dict:
  """``params`` with each layer's dense GEMM weights quantized
  (``wavetune_jax.quantize_weight``) to ``{"q": w_q, "s": scales}`` (``"w8a8"``:
  ``{"qt": w_q [N, K], "s": scales}``, its inputs quantized per token as they run);
  ``weights`` one of :data:`WEIGHT_FORMATS` (``"bf16"``: unchanged). A
  mixture-of-experts model's attention weights are quantized; its expert
  weights too under ``"w8a8"`` (``[E, N, K]`` e4m3, a scale per expert and
  channel: ``wavetune_jax.quantized_ragged_dot``), and stay 16-bit under the
  weight-only formats: at prefill sizes the Mosaic weight-only grouped
  GEMM ran 0.51-0.84x the 16-bit one on an H100 (docs/results.md), unless
  ``experts=True``: then they are quantized weight-only too (``[E, K, N]``, a
  scale per expert and channel), which halves the bytes of a model whose
  weights are mostly experts, at that prefill cost.

  ``quantize(w, dtype, layout=layout) -> (w_q, scales)`` quantizes each
  weight, called with ``dtype`` the name ``"int8"`` or ``"float8_e4m3fn"``
  and ``layout`` ``"kn"`` or ``"nk"`` by keyword (default
  ``wavetune_jax.quantize_weight``); ``examples/qwix_weights.py`` passes one
  that quantizes with qwix and converts with ``wavetune_jax.from_qwix``.

  ``lm_head=True`` quantizes the LM head ``[hidden, vocab]`` too, weight-only
  in the format's weight dtype (``"w8a8"``: e4m3 weights, 16-bit
  activations: the logits' GEMM keeps its input unrounded), to
  ``{"q": w_q, "s": scales}`` (``{"qn": ...}`` with ``layout="nk"``). A decode step of a few layers reads it as
  much as the layers' weights (Llama-3-8B: a 1.05 GB bf16 head, 0.53 GB in 8
  bits, against 0.22 GB a layer in 8 bits).

  ``layout="nk"`` stores the weight-only formats' dense weights (and the LM
  head) transposed, ``{"qn": w_q [N, K], "s": scales}``, the layout of most
  checkpoints, run with ``w_layout="nk"`` (at decode sizes by the swapped
  weight-only kernel); ``None`` (default) is ``"kn"`` for the 8-bit
  weight-only formats and ``"nk"`` for ``"w8a8"`` and ``"int4"``, which take
  no other. ``"int4"`` (W4A16) quantizes with a scale per 128 values of K
  (``quantize(w, "int4", layout="nk", group_size=128)``; ``gcd(128, K)``
  values where K is not a multiple of 128); a mixture-of-experts model's
  experts stay 16-bit under it.

  Raises:
    ValueError: an unknown ``weights``; ``lm_head=True`` with ``"bf16"``;
      ``experts=True`` with ``"bf16"``, ``"int4"`` or ``"w8a8"`` (whose
      experts are quantized already); ``layout`` not ``"kn"`` / ``"nk"``, or
      ``"kn"`` with ``"w8a8"`` or ``"int4"``."""
  if weights not in WEIGHT_FORMATS:
    raise ValueError(f"weights={weights!r} must be one of {sorted(WEIGHT_FORMATS)}")
  dtype = WEIGHT_FORMATS[weights]
  if layout not in (None, "kn", "nk"):
    raise ValueError(f"layout={layout!r} must be 'kn' or 'nk'")
  if experts and weights in ("bf16", "w8a8", "int4"):
    raise ValueError(f"experts=True needs weights 'int8' or 'fp8'; got {weights!r}")
  if dtype is None:
    if lm_head:
      raise ValueError("lm_head=True needs weights 'int8', 'fp8', 'int4' or 'w8a8'; got 'bf16'")
    return params
  if quantize is None:
    from wavetune_jax.families.qmatmul.quantize import quantize_weight as quantize
  names = _QUANTIZED[:2] if cfg.experts and weights != "w8a8" and not experts else _QUANTIZED
  if layout == "kn" and weights in ("w8a8", "int4"):
    raise ValueError(f"weights={weights!r} takes its weights as [N, K] (layout='nk')")
  layout = layout or ("nk" if weights in ("w8a8", "int4") else "kn")
  # "q": weight-only [K, N]; "qn": weight-only [N, K]; "qt": W8A8, [N, K].
  key = "q" if layout == "kn" else ("qt" if weights == "w8a8" else "qn")
  layers = []
  for p in params["layers"]:
    p = dict(p)
    for n in names:
      if cfg.experts and n not in _QUANTIZED[:2] and weights != "w8a8":
        q, s = quantize(p[n], dtype, layout="kn")  # weight-only experts: [E, K, N]
        p[n] = {"q": q, "s": s}
        continue
      q, s = quantize(p[n], dtype, layout=layout, **_groups(p[n], weights))
      p[n] = {key: q, "s": s}
    layers.append(p)
  out = {**params, "layers": layers}
  if lm_head:
    head_layout = "nk" if key == "qn" else "kn"
    q, s = quantize(params["lm_head"], dtype, layout=head_layout,
                    **_groups(params["lm_head"], weights))
    out["lm_head"] = {"qn" if key == "qn" else "q": q, "s": s}
  return out


def _groups(w, weights: str) -> dict:
  """``quantize``'s group size for ``"int4"``: 128 values of K, or the
  greatest common divisor of 128 and K where K is not a multiple of 128."""
  return {"group_size": math.gcd(128, w.shape[-2])} if weights == "int4" else {}


def _mm(ops: Ops, x, w):
  """``x @ w`` for a 16-bit weight or a quantized one (``quantize_params``)."""
  if isinstance(w, dict) and "qt" in w:
    from wavetune_jax.families.qmatmul.quantize import quantize_rows
    x8, xs = quantize_rows(x)
    return ops.qmatmul(x8, w["qt"], w["s"], x_scales=xs, w_layout="nk", out_dtype=x.dtype)
  if isinstance(w, dict) and "qn" in w:
    return ops.qmatmul(x, w["qn"], w["s"], w_layout="nk")
  if isinstance(w, dict):
    return ops.qmatmul(x, w["q"], w["s"])
  return ops.matmul(x, w)


def _norm(x):
  x32 = x.astype(jnp.float32)
  return (x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, -1, keepdims=True) + 1e-5)).astype(x.dtype)


def _mlp(p, h, cfg: ModelConfig, ops: Ops):
  """``h [tokens, hidden]`` through the SwiGLU MLP (dense or experts)."""
  if not cfg.experts:
    g, u = jnp.split(_mm(ops, h, p["w13"]), 2, axis=-1)
    m = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(h.dtype)
    return _mm(ops, m, p["w2"])
  return moe_mlp(p, h, top_k=cfg.top_k, gemm=functools.partial(_gmm, ops))


def _gmm(ops: Ops, x, w, sizes):
  """The grouped ``x @ w[g]`` for 16-bit expert weights, weight-only 8-bit
  ones or W8A8 ones."""
  if isinstance(w, dict) and "q" in w:
    return ops.qragged_dot(x, w["q"], w["s"], sizes, out_dtype=x.dtype)
  if isinstance(w, dict):
    from wavetune_jax.families.qmatmul.quantize import quantize_rows
    x8, xs = quantize_rows(x)
    return ops.qragged_dot(x8, w["qt"], w["s"], sizes, x_scales=xs, w_layout="nk",
                           out_dtype=x.dtype)
  return ops.ragged_dot(x, w, sizes)


def moe_mlp(params, x, *, top_k: int, gemm):
  """``x [tokens, hidden]`` through a mixture-of-experts SwiGLU MLP:
  router top-k -> the (token, expert) pairs sorted by expert -> ``gemm``
  (a ragged dot) with the fused gate/up weights ``w13 [experts, hidden, 2 *
  inter]`` -> SiLU(gate) * up -> ``gemm`` with ``w2`` -> unsort -> the sum
  over each token's experts weighted by the router's softmax."""
  tokens = x.shape[0]
  experts = params["router"].shape[1]
  logits = x.astype(jnp.float32) @ params["router"]
  weights, chosen = jax.lax.top_k(logits, top_k)             # [tokens, k]
  weights = jax.nn.softmax(weights, axis=-1)
  flat = chosen.reshape(-1)                                   # [tokens * k]
  order = jnp.argsort(flat, stable=True)                      # rows grouped by expert
  rows = x[order // top_k]
  sizes = jnp.bincount(flat, length=experts).astype(jnp.int32)
  g, u = jnp.split(gemm(rows, params["w13"], sizes), 2, axis=-1)
  m = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype)
  y = gemm(m, params["w2"], sizes)                            # [tokens * k, hidden]
  y = jnp.zeros_like(y).at[order].set(y).reshape(tokens, top_k, -1)
  return jnp.einsum("tkh,tk->th", y.astype(jnp.float32), weights).astype(x.dtype)


def _qkv(p, x, cfg: ModelConfig, ops: Ops):
  b, s, _ = x.shape
  d = cfg.head_dim
  qkv = _mm(ops, _norm(x).reshape(b * s, cfg.hidden), p["wqkv"])
  q, k, v = jnp.split(qkv, [cfg.q_heads * d, (cfg.q_heads + cfg.kv_heads) * d], axis=-1)
  return (q.reshape(b, s, cfg.q_heads, d), k.reshape(b, s, cfg.kv_heads, d),
          v.reshape(b, s, cfg.kv_heads, d))


def _finish(p, x, a, cfg: ModelConfig, ops: Ops):
  b, s, _ = x.shape
  x = x + _mm(ops, a.reshape(b * s, -1), p["wo"]).reshape(x.shape)
  return x + _mlp(p, _norm(x).reshape(b * s, cfg.hidden), cfg, ops).reshape(x.shape)


def _prefill(params, tokens, cfg: ModelConfig, ops: Ops):
  """``(logits of the last position, keys, values)``, keys and values per
  layer ``[batch, seq, kv_heads, head_dim]``."""
  ks, vs = [], []
  with ops.context():
    x = params["embed"][tokens]
    for i, p in enumerate(params["layers"]):
      q, k, v = _qkv(p, x, cfg, ops)
      x = _finish(p, x, ops.attention(q, k, v, **cfg.attention_options(i, p)), cfg, ops)
      ks.append(k)
      vs.append(v)
    logits = _mm(ops, _norm(x[:, -1]), params["lm_head"])
  return logits, ks, vs


def prefill(params, tokens, *, cfg: ModelConfig, ops: Ops, max_len: int):
  """The prompt ``tokens [batch, seq]`` through the model: ``(logits of the
  last position [batch, vocab], k caches, v caches)``, one cache per layer,
  ``[batch, max_len, kv_heads, head_dim]``, holding the prompt."""
  b, s = tokens.shape
  if s > max_len:
    raise ValueError(f"prompt length {s} exceeds max_len={max_len}")
  logits, ks, vs = _prefill(params, tokens, cfg, ops)
  pad = ((0, 0), (0, max_len - s), (0, 0), (0, 0))
  return logits, [jnp.pad(k, pad) for k in ks], [jnp.pad(v, pad) for v in vs]


def random_kv_caches(cfg: ModelConfig, shape: tuple, dtype=jnp.bfloat16) -> tuple[list, list]:
  """Keys and values of every layer, random ``dtype`` of ``shape``, in arrays
  of their own (as a serving cache holds them: one array passed as both
  would let a kernel read the values from L2); the same draws on every
  call (``wavetune bench model``'s caches)."""
  keys = [jax.random.normal(jax.random.PRNGKey(i), shape, dtype) for i in range(cfg.layers)]
  values = [jax.random.normal(jax.random.PRNGKey(1000 + i), shape, dtype)
            for i in range(cfg.layers)]
  return keys, values


def random_block_tables(key: jax.Array, batch: int, max_pages: int) -> jax.Array:
  """``[batch, max_pages]`` int32 block tables over a pool of ``batch *
  max_pages`` pages: each sequence's pages drawn from a random permutation of
  the pool, so a sequence's pages are neither in order nor adjacent (as a
  serving allocator leaves them after a while)."""
  if batch < 1 or max_pages < 1:
    raise ValueError(f"batch and max_pages must be >= 1; got {batch} and {max_pages}")
  return paging.shuffled_tables(key, batch, max_pages)


def _check_tables(block_tables, batch: int) -> None:
  if (block_tables.ndim != 2 or block_tables.shape[0] != batch
      or not jnp.issubdtype(block_tables.dtype, jnp.integer)):
    raise ValueError(f"block_tables must be [batch={batch}, max_pages] integers; got "
                     f"{block_tables.shape} {block_tables.dtype}")


def paged_prefill(params, tokens, block_tables, *, cfg: ModelConfig, ops: Ops,
                  page_size: int, num_pages: int | None = None):
  """:func:`prefill` into a paged cache: ``(logits [batch, vocab], k pages,
  v pages)``, per layer a pool ``[num_pages, page_size, kv_heads,
  head_dim]`` (default ``num_pages``: ``batch * max_pages``) holding each
  sequence's prompt in its pages ``block_tables [batch, max_pages]`` (the
  logical cache: ``max_pages * page_size`` positions). Only the pages the
  prompt reaches are written (their table entries must be pages of the
  pool); the rest of the pool is zeros."""
  b, s = tokens.shape
  _check_tables(block_tables, b)
  max_pages = block_tables.shape[1]
  if page_size < 1 or s > max_pages * page_size:
    raise ValueError(f"prompt length {s} exceeds the table's {max_pages} pages of "
                     f"{page_size} positions")
  num_pages = b * max_pages if num_pages is None else num_pages
  used = -(-s // page_size)
  ids = block_tables[:, :used].reshape(-1)
  if not isinstance(ids, jax.core.Tracer) and ids.size:
    lo, hi = int(jnp.min(ids)), int(jnp.max(ids))
    if lo < 0 or hi >= num_pages:
      raise ValueError(f"the prompt's pages must be in [0, {num_pages}) (the pool); got "
                       f"page ids {lo}..{hi}")
  logits, ks, vs = _prefill(params, tokens, cfg, ops)

  def to_pages(c):  # [b, s, h, d] -> the pool, one scatter of whole pages
    c = jnp.pad(c, ((0, 0), (0, used * page_size - s), (0, 0), (0, 0)))
    pool = jnp.zeros((num_pages, page_size) + c.shape[2:], c.dtype)
    return pool.at[ids].set(c.reshape((b * used, page_size) + c.shape[2:]))

  return logits, [to_pages(k) for k in ks], [to_pages(v) for v in vs]


def _check_tokens(tokens, lengths) -> None:
  if tokens.ndim != 1 or lengths.shape != tokens.shape:
    raise ValueError(f"tokens and lengths must both be [batch]; got {tokens.shape} and "
                     f"{lengths.shape}")
  if not (jnp.issubdtype(tokens.dtype, jnp.integer)
          and jnp.issubdtype(lengths.dtype, jnp.integer)):
    raise ValueError(f"tokens and lengths must be integers; got {tokens.dtype} and "
                     f"{lengths.dtype}")


def _check_step(params, kc, vc, lengths, tokens, cfg: ModelConfig) -> None:
  n = len(params["layers"])
  if len(kc) != n or len(vc) != n:
    raise ValueError(f"{n} layers need {n} k and v caches; got {len(kc)} and {len(vc)}")
  _check_tokens(tokens, lengths)
  want = (tokens.shape[0], None, cfg.kv_heads, cfg.head_dim)
  for c in list(kc) + list(vc):
    if (c.ndim != 4 or c.shape != kc[0].shape
        or any(w is not None and w != g for w, g in zip(want, c.shape))):
      raise ValueError(f"caches must all be [batch={want[0]}, max_len, kv_heads="
                       f"{cfg.kv_heads}, head_dim={cfg.head_dim}]; got {c.shape}")
  if not isinstance(lengths, jax.core.Tracer):
    lo, hi = int(jnp.min(lengths)), int(jnp.max(lengths))
    if lo < 0 or hi >= kc[0].shape[1]:
      raise ValueError(f"lengths must be in [0, {kc[0].shape[1]}) (the cache's length); "
                       f"got {lo}..{hi}")


def decode_step(params, kc, vc, lengths, tokens, *, cfg: ModelConfig, ops: Ops,
                write_cache: bool = True):
  """One new token per sequence: ``tokens [batch]`` at positions ``lengths
  [batch]`` (each sequence's filled cache, below the cache's length); returns
  ``(logits [batch, vocab], k caches, v caches)`` with the new keys and
  values written, one cache per layer.

  ``write_cache=False`` leaves the caches as they are and attends over
  ``lengths + 1`` positions as if the new token's keys and values were
  there: the step a benchmark times. (A serving loop writes them in place
  into a donated cache; a step called again on the same, undonated buffers
  makes XLA copy every layer's whole cache, for every setting alike.)"""
  _check_step(params, kc, vc, lengths, tokens, cfg)
  rows = jnp.arange(tokens.shape[0])
  return _decode(params, kc, vc, lengths, tokens, (rows, lengths), None, cfg, ops,
                 write_cache)


def _check_paged_step(params, kp, vp, block_tables, lengths, tokens,
                      cfg: ModelConfig) -> None:
  n = len(params["layers"])
  if len(kp) != n or len(vp) != n:
    raise ValueError(f"{n} layers need {n} k and v page pools; got {len(kp)} and {len(vp)}")
  _check_tokens(tokens, lengths)
  _check_tables(block_tables, tokens.shape[0])
  for c in list(kp) + list(vp):
    if c.ndim != 4 or c.shape != kp[0].shape or c.shape[2:] != (cfg.kv_heads, cfg.head_dim):
      raise ValueError(f"page pools must all be [num_pages, page_size, kv_heads="
                       f"{cfg.kv_heads}, head_dim={cfg.head_dim}]; got {c.shape}")
  num_pages, page_size = kp[0].shape[:2]
  cap = block_tables.shape[1] * page_size
  if not isinstance(lengths, jax.core.Tracer):
    lo, hi = int(jnp.min(lengths)), int(jnp.max(lengths))
    if lo < 0 or hi >= cap:
      raise ValueError(f"lengths must be in [0, {cap}) (the table's pages times the page "
                       f"size); got {lo}..{hi}")
    if not isinstance(block_tables, jax.core.Tracer):
      # Every page a sequence reads or writes: entries up to lengths // page_size.
      used = jnp.arange(block_tables.shape[1])[None, :] <= (lengths // page_size)[:, None]
      bad = used & ((block_tables < 0) | (block_tables >= num_pages))
      if bool(jnp.any(bad)):
        b, j = (int(i[0]) for i in jnp.nonzero(bad))
        raise ValueError(f"block_tables[{b}, {j}] = {int(block_tables[b, j])} is not a page "
                         f"of the pool [0, {num_pages})")


def paged_decode_step(params, k_pages, v_pages, block_tables, lengths, tokens, *,
                      cfg: ModelConfig, ops: Ops, write_cache: bool = True):
  """:func:`decode_step` on a paged cache: per layer the pools ``k_pages,
  v_pages [num_pages, page_size, kv_heads, head_dim]``, and ``block_tables
  [batch, max_pages]`` (each sequence's pages, in order; position ``j`` is
  row ``j % page_size`` of page ``block_tables[b, j // page_size]``). The
  new token's keys and values are scattered into row ``lengths % page_size``
  of page ``block_tables[b, lengths // page_size]``; returns ``(logits,
  k pages, v pages)``. ``write_cache=False`` as in :func:`decode_step`."""
  _check_paged_step(params, k_pages, v_pages, block_tables, lengths, tokens, cfg)
  page_size = k_pages[0].shape[1]
  rows = jnp.arange(tokens.shape[0])
  at = (block_tables[rows, lengths // page_size], lengths % page_size)
  return _decode(params, k_pages, v_pages, lengths, tokens, at, block_tables, cfg, ops,
                 write_cache)


def _decode(params, kc, vc, lengths, tokens, at, block_tables, cfg: ModelConfig, ops: Ops,
            write_cache: bool):
  """The decode step on caches (``block_tables`` None) or pages; ``at``: the
  index of each new token's row in them."""
  kc, vc = list(kc), list(vc)
  with ops.context():
    x = params["embed"][tokens][:, None]
    for i, p in enumerate(params["layers"]):
      q, k, v = _qkv(p, x, cfg, ops)
      if write_cache:
        kc[i] = kc[i].at[at].set(k[:, 0])
        vc[i] = vc[i].at[at].set(v[:, 0])
      options = cfg.attention_options(i, p)
      if block_tables is None:
        a = ops.decode_attention(q, kc[i], vc[i], lengths + 1, **options)
      else:
        a = ops.decode_attention(q, kc[i], vc[i], lengths + 1, block_tables, **options)
      x = _finish(p, x, a, cfg, ops)
    logits = _mm(ops, _norm(x[:, 0]), params["lm_head"])
  return logits, kc, vc
