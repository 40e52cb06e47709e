"""Per-channel 8-bit quantization of a weight, as :func:`wavetune_jax.quantized_matmul` takes it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from wavetune_jax.families.matmul.problem import _dtype_name
from wavetune_jax.families.qmatmul.problem import WEIGHT_DTYPES

__all__ = ["quantize_weight", "FP8_MAX", "INT8_MAX"]

#: The largest magnitudes the quantized values take.
INT8_MAX = 127.0
FP8_MAX = 448.0  # float8_e4m3fn


def quantize_weight(w: jax.Array, dtype: str = "int8") -> tuple[jax.Array, jax.Array]:
  """``w [K, N]`` -> ``(w_q [K, N], scales [N])`` with ``w ~ w_q * scales``.

  Symmetric, one scale per output channel (column): ``scales = max|w[:, n]|
  / 127`` for int8 (values rounded to nearest, in [-127, 127]) or ``/ 448``
  for float8_e4m3fn (cast, round to nearest even). A column of zeros gets
  scale 1. The dequantized weight's error is at most half a step of its
  column: ``scales / 2`` for int8.

  Raises:
    ValueError: ``w`` not a rank-2 floating array, or an unknown ``dtype``.
  """
  w = jnp.asarray(w)
  if w.ndim != 2 or not jnp.issubdtype(w.dtype, jnp.floating):
    raise ValueError(f"w must be a [K, N] floating array; got {w.shape} {w.dtype}")
  name = _dtype_name("dtype", dtype, WEIGHT_DTYPES)
  top = INT8_MAX if name == "int8" else FP8_MAX
  w32 = w.astype(jnp.float32)
  amax = jnp.max(jnp.abs(w32), axis=0)
  scales = jnp.where(amax > 0, amax / top, 1.0)
  v = w32 / scales
  if name == "int8":
    wq = jnp.clip(jnp.round(v), -INT8_MAX, INT8_MAX).astype(jnp.int8)
  else:
    wq = jnp.clip(v, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
  return wq, scales.astype(jnp.float32)
