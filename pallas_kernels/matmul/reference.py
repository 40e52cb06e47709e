"""The float32 GEMM reference every backend is checked against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["matmul_reference"]


def matmul_reference(x: jax.Array, w: jax.Array, out_dtype=None) -> jax.Array:
  """``x @ w`` in float32 at highest precision (the test reference)."""
  out_dtype = x.dtype if out_dtype is None else out_dtype
  y = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32),
              precision=jax.lax.Precision.HIGHEST)
  return y.astype(out_dtype)

