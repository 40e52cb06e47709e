"""The float32 grouped-GEMM reference every backend is checked against."""

from __future__ import annotations

import jax
import jax.numpy as jnp

__all__ = ["ragged_dot_reference"]


def ragged_dot_reference(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array,
                         out_dtype=None) -> jax.Array:
  """``lax.ragged_dot`` in float32 at highest precision (the test reference)."""
  out_dtype = lhs.dtype if out_dtype is None else out_dtype
  y = jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs.astype(jnp.float32),
                         group_sizes.astype(jnp.int32),
                         precision=jax.lax.Precision.HIGHEST)
  return y.astype(out_dtype)
