"""The XLA backend of the attention family: ``jax.nn.dot_product_attention``
with XLA's own implementation (no launch parameters)."""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pallas_kernels.attention.common import valid_keys
from wavetune_jax.core.family import Backend
from wavetune_jax.core.hardware import Hardware
from wavetune_jax.families.attention.problem import AttentionProblem, coords

__all__ = ["LibraryAttention", "XlaAttention", "XlaAttentionConfig", "masked_attention"]

#: The nominal blocks of the wave model's (G, L).
NOMINAL_BLOCK = 128


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class XlaAttentionConfig:
  """``jax.nn.dot_product_attention(..., implementation="xla")``."""


class LibraryAttention(Backend):
  """A library's attention (XLA's, cuDNN's): one config with no launch
  parameters, one variant modelled on a nominal 128 x 128 tiling."""

  platform = True

  macro_fields = ()
  micro_fields = ()
  heuristic_size_free = True

  def occupancy_bound(self, problem, config, hw: Hardware) -> int:
    return 1

  def coords(self, problem: AttentionProblem, macro: dict) -> tuple[int, float]:
    return coords(problem, NOMINAL_BLOCK, NOMINAL_BLOCK)


class XlaAttention(LibraryAttention):
  """XLA's attention: every shape, mask and length, and the op's path on a
  CPU inside ``shard_map``, where Pallas interpret mode cannot run. Its sweep
  rows are the family's ``baseline_xla`` rows (the same call)."""

  name = "xla"
  config_cls = XlaAttentionConfig
  interpret = True
  interpret_in_shard_map = True
  recorded_as = "baseline_xla"

  def coords(self, problem: AttentionProblem, macro: dict) -> tuple[int, float]:
    # XLA's attention writes every score and masks the window's: the work
    # of the problem without its window.
    return coords(dataclasses.replace(problem, window_left=-1, window_right=-1),
                  NOMINAL_BLOCK, NOMINAL_BLOCK)

  def space(self, problem, hw: Hardware, *, prune: bool = True):
    return (XlaAttentionConfig(),)

  def size_quantum(self, problem) -> int:
    return NOMINAL_BLOCK

  def heuristic(self, problem: AttentionProblem, hw: Hardware) -> XlaAttentionConfig | None:
    """Soft-capping, sinks, or a window cuDNN does not run: only XLA's
    attention runs them (None elsewhere: the other backends answer)."""
    return None if problem.plain else XlaAttentionConfig()

  def validate(self, problem, config, hw: Hardware | None = None) -> None:
    if not isinstance(config, XlaAttentionConfig):
      raise ValueError(f"config must be an XlaAttentionConfig; got {config!r}")

  def run(self, problem: AttentionProblem, config, q, k, v, *extra,
          interpret: bool = False, scale: float | None = None):
    # extra: kv_lengths where the problem has lengths, then sinks where it has them.
    from wavetune_jax.families.attention.family import split_extra
    kv_lengths, sinks = split_extra(problem, extra)
    if kv_lengths is None and not problem.shifted and problem.plain:
      return xla_attention(q, k, v, scale=scale, is_causal=problem.causal)
    return masked_attention(problem, q, k, v, kv_lengths, sinks, scale=scale)


def xla_attention(q, k, v, **kw):
  """``jax.nn.dot_product_attention(..., implementation="xla")``; on a CPU
  (the process's default backend) float16 and bfloat16 compute in float32:
  XLA's CPU dot rejects float16 operands with a float32 result, which JAX's
  attention asks for under a jit, and bfloat16 ones too where a dot
  degenerates to one element (batch, lengths and heads all 1); a CPU
  computes 16-bit products in float32 anyway."""
  if q.dtype in (jnp.float16, jnp.bfloat16) and jax.default_backend() == "cpu":
    f32 = lambda a: a.astype(jnp.float32)
    return jax.nn.dot_product_attention(f32(q), f32(k), f32(v), implementation="xla",
                                        **kw).astype(q.dtype)
  return jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)


def masked_attention(problem: AttentionProblem, q, k, v, kv_lengths=None, sinks=None, *,
                     scale=None):
  """XLA's attention with the op's mask (valid lengths, either causal
  alignment, a sliding window), soft-capping and sinks: keys past a
  sequence's length are zeroed before use (NaN there never reaches the
  output) and a query that sees no key gives zeros."""
  ok = valid_keys(kv_lengths, k.shape[1], q.shape[1], causal=problem.causal,
                  causal_align=problem.causal_align, batch=q.shape[0], window=problem.window)
  seen = jnp.any(ok, axis=1)[:, :, None, None]
  k = jnp.where(seen, k, jnp.zeros((), k.dtype))
  v = jnp.where(seen, v, jnp.zeros((), v.dtype))
  if problem.soft_cap or sinks is not None:
    out = _capped_attention(q, k, v, ok, sinks, scale=scale, cap=problem.soft_cap)
  else:
    out = xla_attention(q, k, v, scale=scale, mask=ok[:, None])
  sees = jnp.any(ok, axis=2)[:, :, None, None]
  return jnp.where(sees, out, jnp.zeros((), out.dtype))


def _capped_attention(q, k, v, ok, sinks, *, scale, cap: float):
  """Attention with soft-capped scores and sinks, float32 softmax (what
  ``jax.nn.dot_product_attention`` has no argument for)."""
  b, q_len, q_heads, d = q.shape
  kv_heads = k.shape[2]
  group = q_heads // kv_heads
  scale = 1.0 / math.sqrt(d) if scale is None else scale
  qg = q.reshape(b, q_len, kv_heads, group, d)
  s = jnp.einsum("bqhgd,bkhd->bhgqk", qg, k, preferred_element_type=jnp.float32) * scale
  if cap:
    s = cap * jnp.tanh(s / cap)
  s = jnp.where(ok[:, None, None], s, -jnp.inf)
  mx = jnp.max(s, axis=-1, keepdims=True)
  if sinks is not None:
    sk = sinks.astype(jnp.float32).reshape(kv_heads, group)[None, :, :, None, None]
    mx = jnp.maximum(mx, sk)
  mx = jnp.where(jnp.isfinite(mx), mx, 0.0)
  e = jnp.exp(s - mx)
  den = jnp.sum(e, axis=-1, keepdims=True)
  if sinks is not None:
    den = den + jnp.exp(sk - mx)
  # (A row with no key and no sink has den = 0: zeros. A NaN sink stays NaN.)
  p = (e / jnp.where(den == 0, 1.0, den)).astype(v.dtype)
  out = jnp.einsum("bhgqk,bkhd->bqhgd", p, v, preferred_element_type=jnp.float32)
  return out.reshape(b, q_len, q_heads, d).astype(q.dtype)
