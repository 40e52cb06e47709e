"""The float32 attention reference every backend is checked against."""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.attention.common import check_qkv

__all__ = ["attention_reference"]


def attention_reference(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
                        scale: float | None = None, out_dtype=None,
                        q_chunk: int = 512) -> jax.Array:
  """Attention in float32 at highest precision (the test and sweep reference).

  Computed in chunks of ``q_chunk`` query rows, so long sequences never hold
  the whole ``[q_len, kv_len]`` score matrix.
  """
  check_qkv(q, k, v)
  out_dtype = q.dtype if out_dtype is None else out_dtype
  scale = 1.0 / math.sqrt(q.shape[3]) if scale is None else float(scale)
  return _reference(q, k, v, causal=bool(causal), scale=scale,
                    out_dtype=jnp.dtype(out_dtype), q_chunk=int(q_chunk))


@functools.partial(jax.jit, static_argnames=("causal", "scale", "out_dtype", "q_chunk"))
def _reference(q, k, v, *, causal, scale, out_dtype, q_chunk):
  batch, q_len, q_heads, head_dim = q.shape
  kv_len, kv_heads = k.shape[1], k.shape[2]
  group = q_heads // kv_heads
  hi = jax.lax.Precision.HIGHEST
  kf = k.astype(jnp.float32)
  vf = v.astype(jnp.float32)
  n_chunks = -(-q_len // q_chunk)
  pad = n_chunks * q_chunk - q_len
  qf = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, pad), (0, 0), (0, 0)))
  # [chunks, batch, q_chunk, kv_heads, group, head_dim]
  qc = qf.reshape(batch, n_chunks, q_chunk, kv_heads, group, head_dim).swapaxes(0, 1)

  def one(args):
    i, qi = args
    s = jnp.einsum("bqhgd,bkhd->bhgqk", qi, kf, precision=hi) * scale
    if causal:
      rows = i * q_chunk + jnp.arange(q_chunk)
      s = jnp.where(rows[:, None] >= jnp.arange(kv_len)[None, :], s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    return jnp.einsum("bhgqk,bkhd->bqhgd", p, vf, precision=hi)

  out = jax.lax.map(one, (jnp.arange(n_chunks), qc))
  out = out.swapaxes(0, 1).reshape(batch, n_chunks * q_chunk, q_heads, head_dim)
  return out[:, :q_len].astype(out_dtype)
