"""Public tuned ops: thin wrappers over :func:`wavetune_jax.core.op.tuned_call`."""

from __future__ import annotations

import jax

from wavetune_jax.core.op import tuned_call
from wavetune_jax.families import ATTENTION, MATMUL

__all__ = ["matmul", "attention"]


def matmul(x: jax.Array, w: jax.Array, *, out_dtype=None, config=None) -> jax.Array:
  """``x @ w`` with a tuned kernel and launch config, chosen at trace time.

  Works inside ``jax.jit``: shapes are static there, so the choice is made
  once per shape, in microseconds, and baked into the kernel.

  Args:
    x: ``[M, K]`` bfloat16, float16 or float32 array.
    w: ``[K, N]`` array of the same dtype.
    out_dtype: output dtype, bfloat16, float16 or float32 (default
      ``x.dtype``); accumulation is float32.
    config: a backend's config (e.g. ``TritonMatmulConfig``) or a dict
      ``{"backend": name, **fields}`` to use as given. ``None`` lets the
      selector choose: a config pinned with ``use_config``, else the active
      policy (by default the shipped table of this GPU, then the heuristic).

  Returns:
    ``[M, N]`` array of ``out_dtype``.

  Raises:
    ValueError: rank != 2, mismatched inner dimensions or dtypes, an
      unsupported dtype or out_dtype, or a config that cannot run this problem
      here (unknown field, block not a power of two, split_k larger than the
      number of K blocks, beyond the GPU's shared memory, ...).
  """
  return tuned_call(MATMUL, x, w, out_dtype=out_dtype, config=config)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
              scale: float | None = None, config=None) -> jax.Array:
  """Flash attention forward with a tuned kernel and launch config.

  Works inside ``jax.jit`` like :func:`matmul`.

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``, bfloat16 or float16.
    k, v: ``[batch, kv_len, kv_heads, head_dim]`` of the same dtype;
      ``kv_heads`` divides ``q_heads`` (grouped-query attention reads the
      shared K/V in place).
    causal: a Python bool: mask keys after the query, top-left aligned (query
      ``i`` sees keys ``j <= i``), as ``jax.nn.dot_product_attention(is_causal=True)``.
    scale: softmax scale, a Python float (default ``1 / sqrt(head_dim)``).
    config: a backend's config (``TritonAttentionConfig``,
      ``MosaicAttentionConfig``) or a dict ``{"backend": name, **fields}``;
      ``None`` lets the selector choose.

  Returns:
    ``[batch, q_len, q_heads, head_dim]`` of ``q.dtype``.

  Raises:
    ValueError: wrong ranks; batch, head_dim or dtype mismatches; ``kv_heads``
      not dividing ``q_heads``; an unsupported dtype or head_dim (> 256); an
      empty KV sequence; ``causal`` or ``scale`` of the wrong type; or a config
      that cannot run this problem here.
  """
  return tuned_call(ATTENTION, q, k, v, causal=causal, scale=scale, config=config)
