"""Per-channel 8-bit quantization of a weight, as :func:`wavetune_jax.quantized_matmul` takes it."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from wavetune_jax.families.matmul.problem import _dtype_name
from wavetune_jax.families.qmatmul.problem import W_LAYOUTS, WEIGHT_DTYPES

__all__ = ["quantize_weight", "quantize_rows", "FP8_MAX", "INT8_MAX"]

#: The largest magnitudes the quantized values take.
INT8_MAX = 127.0
FP8_MAX = 448.0  # float8_e4m3fn


def quantize_weight(w: jax.Array, dtype: str = "int8",
                    layout: str = "kn") -> tuple[jax.Array, jax.Array]:
  """``w [K, N]`` -> ``(w_q, scales [N])`` with ``w ~ w_q * scales``, ``w_q``
  ``[K, N]`` (``layout="kn"``) or ``[N, K]`` (``"nk"``). Expert weights
  ``[G, K, N]`` give ``w_q [G, K, N]`` (or ``[G, N, K]``) and ``scales [G,
  N]``, each expert quantized on its own (what
  :func:`wavetune_jax.quantized_ragged_dot` takes).

  With ``layout="nk"`` ``w_q`` comes transposed, ``[N, K]`` with K
  contiguous: the layout FP8 tensor cores read, which
  ``quantized_matmul(..., w_layout="nk")`` takes (a weight is quantized once,
  so the transpose is paid once, not at every call).

  Symmetric, one scale per output channel (column): ``scales = max|w[:, n]|
  / 127`` for int8 (values rounded to nearest, in [-127, 127]) or ``/ 448``
  for float8_e4m3fn (cast, round to nearest even). A column of zeros gets
  scale 1. The dequantized weight's error is at most half a step of its
  column: ``scales / 2`` for int8.

  Raises:
    ValueError: ``w`` not a rank-2 or rank-3 floating array, an unknown
      ``dtype`` or ``layout``.
  """
  w = jnp.asarray(w)
  if w.ndim not in (2, 3) or not jnp.issubdtype(w.dtype, jnp.floating):
    raise ValueError(f"w must be a [K, N] (or [G, K, N]) floating array; got {w.shape} "
                     f"{w.dtype}")
  name = _dtype_name("dtype", dtype, WEIGHT_DTYPES)
  if layout not in W_LAYOUTS:
    raise ValueError(f"layout={layout!r} must be one of {W_LAYOUTS}")
  top = INT8_MAX if name == "int8" else FP8_MAX
  w32 = w.astype(jnp.float32)
  amax = jnp.max(jnp.abs(w32), axis=-2)
  scales = jnp.where(amax > 0, amax / top, 1.0)
  v = w32 / scales[..., None, :]
  if name == "int8":
    wq = jnp.clip(jnp.round(v), -INT8_MAX, INT8_MAX).astype(jnp.int8)
  else:
    wq = jnp.clip(v, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
  return (wq if layout == "kn" else jnp.swapaxes(wq, -1, -2)), scales.astype(jnp.float32)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``x [M, K]`` -> ``(x_q [M, K] float8_e4m3fn, x_scales [M] float32)``
  with ``x ~ x_q * x_scales[:, None]``: symmetric per-row (per-token)
  quantization of activations, ``x_scales = max|x[m, :]| / 448``, the form
  W8A8-FP8 ``quantized_matmul`` takes. Runs in XLA (one fused pass over
  ``x``), inside ``jit`` before each GEMM. A row of zeros gets scale 1.

  Raises:
    ValueError: ``x`` not a rank-2 floating array.
  """
  x = jnp.asarray(x)
  if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be a [M, K] floating array; got {x.shape} {x.dtype}")
  x32 = x.astype(jnp.float32)
  amax = jnp.max(jnp.abs(x32), axis=1)
  scales = jnp.where(amax > 0, amax / FP8_MAX, 1.0)
  xq = jnp.clip(x32 / scales[:, None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
  return xq, scales.astype(jnp.float32)
