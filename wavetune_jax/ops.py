"""Public tuned ops."""

from __future__ import annotations

import functools
import logging

import jax
import jax.numpy as jnp

from pallas_kernels.attention import AttentionConfig, check_qkv
from pallas_kernels.attention import attention as pallas_attention
from pallas_kernels.matmul import MatmulConfig, check_operands
from pallas_kernels.matmul import matmul as pallas_matmul
from wavetune_jax import selector
from wavetune_jax.attention_spec import ATTENTION, AttentionProblem
from wavetune_jax.hardware import get_hardware
from wavetune_jax.matmul_spec import MATMUL, MatmulProblem

__all__ = ["matmul", "attention"]

_log = logging.getLogger("wavetune_jax")


@functools.lru_cache(maxsize=1)
def _hardware():
  return get_hardware()


@functools.lru_cache(maxsize=1)
def _interpret() -> bool:
  """Pallas Triton kernels need a GPU; elsewhere they run in interpret mode."""
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu:
    _log.warning("wavetune_jax: no GPU backend (%s); Pallas kernels run in "
                 "interpret mode, which is slow and meant for testing",
                 jax.default_backend())
  return not on_gpu


def matmul(x: jax.Array, w: jax.Array, *, config: MatmulConfig | dict | None = None,
           out_dtype=None) -> jax.Array:
  """``x @ w`` with the Pallas GEMM kernel and a chosen launch config.

  Works inside ``jax.jit``: the config is chosen at trace time from the static
  shapes and baked into the kernel.

  Args:
    x: ``[M, K]`` bfloat16, float16 or float32 array.
    w: ``[K, N]`` array of the same dtype.
    config: a :class:`MatmulConfig` (or a dict of its fields) to use as given.
      ``None`` lets the selector choose at trace time
      (``wavetune_jax.selector``): a config pinned with ``use_config``, else
      the active policy; by default the shipped table of this GPU (exact
      entry, then the wave model), and the rule-of-thumb heuristic where the
      table has no answer.
    out_dtype: output dtype (default ``x.dtype``); accumulation is fp32.

  Returns:
    ``[M, N]`` array of ``out_dtype``.

  Raises:
    ValueError: rank != 2, mismatched inner dimensions or dtypes, unsupported
      dtype, or a config that cannot run this problem (unknown field, block not
      a power of two, split_k larger than the number of K blocks, ...).
  """
  x = jnp.asarray(x)
  w = jnp.asarray(w)
  check_operands(x, w)
  m, k = x.shape
  n = w.shape[1]
  out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
  if m == 0 or n == 0 or k == 0:
    return jnp.zeros((m, n), out_dtype)
  problem = MatmulProblem(m=m, n=n, k=k, dtype=x.dtype.name, out_dtype=out_dtype.name)
  if config is None:
    config = selector.select(MATMUL, problem, _hardware()).config
  elif isinstance(config, dict):
    config = MatmulConfig.from_dict(config)
  MATMUL.validate(problem, config)
  return pallas_matmul(x, w, config=config, out_dtype=out_dtype,
                               interpret=_interpret())


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
              scale: float | None = None,
              config: AttentionConfig | dict | None = None) -> jax.Array:
  """Flash attention forward with the Pallas kernel and a chosen launch config.

  Works inside ``jax.jit``: the config is chosen at trace time from the static
  shapes, like :func:`matmul`.

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``, bfloat16 or float16.
    k, v: ``[batch, kv_len, kv_heads, head_dim]`` of the same dtype;
      ``kv_heads`` divides ``q_heads`` (grouped-query attention reads the
      shared K/V in place).
    causal: mask keys after the query, top-left aligned (query ``i`` sees keys
      ``j <= i``), as ``jax.nn.dot_product_attention(is_causal=True)``.
    scale: softmax scale (default ``1 / sqrt(head_dim)``).
    config: an :class:`AttentionConfig` (or a dict of its fields) to use as
      given; ``None`` lets the selector choose (pinned config, else the active
      policy: the shipped table of this GPU, then the heuristic).

  Returns:
    ``[batch, q_len, q_heads, head_dim]`` of ``q.dtype``.

  Raises:
    ValueError: wrong ranks; batch, head_dim or dtype mismatches; ``kv_heads``
      not dividing ``q_heads``; an unsupported dtype or head_dim (> 256); an
      empty KV sequence; or an invalid config.
  """
  q, k, v = jnp.asarray(q), jnp.asarray(k), jnp.asarray(v)
  check_qkv(q, k, v)
  batch, q_len, q_heads, head_dim = q.shape
  if batch == 0 or q_len == 0 or q_heads == 0:
    return jnp.zeros(q.shape, q.dtype)
  if k.shape[1] == 0:
    raise ValueError("kv_len is 0: softmax over no keys is undefined")
  problem = AttentionProblem(batch=batch, q_heads=q_heads, kv_heads=k.shape[2],
                             q_len=q_len, kv_len=k.shape[1], head_dim=head_dim,
                             causal=bool(causal), dtype=q.dtype.name)
  if config is None:
    config = selector.select(ATTENTION, problem, _hardware()).config
  elif isinstance(config, dict):
    config = AttentionConfig.from_dict(config)
  ATTENTION.validate(problem, config)
  return pallas_attention(q, k, v, config=config, causal=causal, scale=scale,
                          interpret=_interpret())
