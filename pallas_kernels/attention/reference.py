"""The float32 attention reference every backend is checked against."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.attention.common import (check_align, check_lengths, check_qkv,
                                             check_sinks, check_soft_cap, check_window,
                                             valid_keys)

__all__ = ["attention_reference"]


def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                        scale: float | None = None, out_dtype=None, kv_lengths=None,
                        causal_align: str = "top_left", q_chunk: int = 512,
                        local_window_size=None, logit_soft_cap: float | None = None,
                        sinks=None) -> jax.Array:
  """Attention in float32 at highest precision (the test and sweep reference).

  ``kv_lengths [batch]``: keys at or past a sequence's length are not seen
  (nor their values read); a query that sees no key gives zeros.
  ``causal_align``: see ``pallas_kernels.attention.common.ALIGNS``.
  ``local_window_size``: an int ``w`` (``(w, w)``) or ``(left, right)``:
  query position ``i`` (aligned as ``causal_align`` says) sees keys ``i -
  left <= j <= i + right`` (``pallas_kernels.attention.common.valid_keys``).
  ``logit_soft_cap``: scaled scores ``s`` become ``cap * tanh(s / cap)``.
  ``sinks [q_heads]``: a logit per query head added to the softmax's
  denominator (``exp(sink)``, no value).
  Computed in chunks of ``q_chunk`` query rows, so long sequences never hold
  the whole ``[q_len, kv_len]`` score matrix.
  """
  check_qkv(q, k, v)
  kv_lengths = check_lengths(kv_lengths, q.shape[0], k.shape[1])
  out_dtype = q.dtype if out_dtype is None else out_dtype
  scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
  return _reference(q, k, v, kv_lengths, check_sinks(sinks, q.shape[2]), causal=bool(causal),
                    scale=scale, out_dtype=jnp.dtype(out_dtype), q_chunk=int(q_chunk),
                    causal_align=check_align(causal_align),
                    window=check_window(local_window_size),
                    soft_cap=check_soft_cap(logit_soft_cap))


@functools.partial(jax.jit, static_argnames=("causal", "scale", "out_dtype", "q_chunk",
                                             "causal_align", "window", "soft_cap"))
def _reference(q, k, v, kv_lengths, sinks, *, causal, scale, out_dtype, q_chunk, causal_align,
               window=None, soft_cap=0.0):
  batch, q_len, q_heads, head_dim = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  group = q_heads // kv_heads
  hi = jax.lax.Precision.HIGHEST
  n_chunks = -(-q_len // q_chunk)
  pad = n_chunks * q_chunk - q_len
  # [batch, q_len (padded), kv_len]: which keys each query sees.
  ok = valid_keys(kv_lengths, kv_len, n_chunks * q_chunk, causal=causal,
                  causal_align=causal_align, batch=batch, window=window)
  if causal_align == "bottom_right":  # rows counted from q_len, not the padding
    ok = valid_keys(kv_lengths, kv_len, q_len, causal=causal, causal_align=causal_align,
                    batch=batch, window=window)
    ok = jnp.pad(ok, ((0, 0), (0, pad), (0, 0)))
  # Values past a sequence's length are never read (NaN there must not leak).
  seen = jnp.any(ok, axis=1)[:, :, None, None]  # [batch, kv_len, 1, 1]
  kf = jnp.where(seen, k.astype(jnp.float32), 0.0)
  vf = jnp.where(seen, v.astype(jnp.float32), 0.0)
  qf = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))
  # [chunks, batch, q_chunk, kv_heads, group, head_dim]
  qc = qf.reshape(batch, n_chunks, q_chunk, kv_heads, group, head_dim).swapaxes(0, 1)

  okc = ok.reshape(batch, n_chunks, q_chunk, kv_len).swapaxes(0, 1)

  def one(args):
    qi, oki = args
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qi, kf, precision=hi) * scale
    if soft_cap:
      s = soft_cap * jnp.tanh(s / soft_cap)
    m = oki[:, None, None]  # [batch, 1, 1, q_chunk, kv_len]
    s = jnp.where(m, s, -jnp.inf)
    if sinks is None:
      p = jax.nn.softmax(s, axis=-1)
    else:  # the sink's exp joins the denominator
      sk = sinks.reshape(kv_heads, group)[None, :, :, None, None]
      mx = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), sk)
      e = jnp.exp(s - mx)
      p = e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sk - mx))
    p = jnp.where(jnp.any(m, axis=-1, keepdims=True), p, 0.0)  # no key seen: zeros
    return jnp.einsum("bhgqk,bkhd->bqhgd", p, vf, precision=hi)

  out = jax.lax.map(one, (qc, okc))
  out = out.swapaxes(0, 1).reshape(batch, n_chunks * q_chunk, q_heads, head_dim)
  return out[:, :q_len].astype(out_dtype)
