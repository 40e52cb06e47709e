"""Per-channel 8-bit and group-wise int4 quantization of a weight, as
:func:`wavetune_jax.quantized_matmul` takes it."""

from __future__ import annotations

import operator

import jax
import jax.numpy as jnp

from wavetune_jax.families.matmul.problem import _dtype_name
from wavetune_jax.families.qmatmul.problem import INT4, W_LAYOUTS, WEIGHT_DTYPES

__all__ = ["quantize_weight", "quantize_rows", "from_qwix", "FP8_MAX", "INT8_MAX", "INT4_MAX"]

#: The largest magnitudes the quantized values take.
INT8_MAX = 127.0
FP8_MAX = 448.0  # float8_e4m3fn
INT4_MAX = 7.0


def _scales(a: jax.Array, axis: int, top: float) -> jax.Array:
  """``max|a| / top`` along ``axis``: 1 where that is 0 (zeros, or nothing
  to reduce), NaN where a value is NaN or infinite, so that the whole
  channel (row, group) dequantizes to NaN, as a product with it would be
  (XLA's ``max`` does not pass NaN through the same way at every size)."""
  amax = jnp.max(jnp.abs(a), axis=axis, initial=0.0)
  finite = jnp.all(jnp.isfinite(a), axis=axis)
  return jnp.where(finite, jnp.where(amax > 0, amax / top, 1.0), jnp.nan)


def quantize_weight(w: jax.Array, dtype: str = "int8", layout: str = "kn",
                    group_size: int = 128) -> tuple[jax.Array, jax.Array]:
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
  scale 1; a column holding NaN or an infinity gets a NaN scale (the
  column's outputs are NaN). The dequantized weight's error is at most half
  a step of its column: ``scales / 2`` for int8.

  ``dtype="int4"`` (W4A16; a ``[K, N]`` weight, ``layout="nk"``): a scale
  per ``group_size`` values of K of each channel, ``scales [K //
  group_size, N] = max|w[group, n]| / 7``, values rounded to nearest in
  [-7, 7]; ``w_q`` is ``[N, K]`` int4 (XLA packs two values a byte).
  ``group_size`` is used for int4 only.

  Raises:
    ValueError: ``w`` not a rank-2 or rank-3 floating array, an unknown
      ``dtype`` or ``layout``; for int4, ``w`` not rank 2, ``layout`` not
      ``"nk"``, or ``group_size`` not a positive divisor of K.
  """
  w = jnp.asarray(w)
  if w.ndim not in (2, 3) or not jnp.issubdtype(w.dtype, jnp.floating):
    raise ValueError(f"w must be a [K, N] (or [G, K, N]) floating array; got {w.shape} "
                     f"{w.dtype}")
  name = _dtype_name("dtype", dtype, WEIGHT_DTYPES + (INT4,))
  if layout not in W_LAYOUTS:
    raise ValueError(f"layout={layout!r} must be one of {W_LAYOUTS}")
  if name == INT4:
    return _quantize_int4(w, layout, group_size)
  top = INT8_MAX if name == "int8" else FP8_MAX
  w32 = w.astype(jnp.float32)
  scales = _scales(w32, -2, top)
  v = w32 / scales[..., None, :]
  if name == "int8":
    wq = jnp.clip(jnp.round(v), -INT8_MAX, INT8_MAX).astype(jnp.int8)
  else:
    wq = jnp.clip(v, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
  return (wq if layout == "kn" else jnp.swapaxes(wq, -1, -2)), scales.astype(jnp.float32)


def _check_int4(what: str, shape, layout: str) -> None:
  """int4 weights: ``[K, N]`` (no experts), stored ``[N, K]``."""
  if len(shape) != 2:
    raise ValueError(f"{what} takes a [K, N] weight; got shape {shape} (int4 expert "
                     f"weights are not supported)")
  if layout != "nk":
    raise ValueError("int4 weights are [N, K]: pass layout='nk'")


def _quantize_int4(w, layout: str, group_size: int) -> tuple[jax.Array, jax.Array]:
  _check_int4("int4 quantization", w.shape, layout)
  k, n = w.shape
  try:
    g = None if isinstance(group_size, bool) else operator.index(group_size)
  except TypeError:
    g = None
  if g is None or g <= 0 or k % g:
    raise ValueError(f"group_size={group_size!r} must be an int, a positive divisor of K={k}")
  group_size = g
  w32 = w.astype(jnp.float32).reshape(k // group_size, group_size, n)
  scales = _scales(w32, 1, INT4_MAX)  # [K // group, N]
  q = jnp.clip(jnp.round(w32 / scales[:, None, :]), -INT4_MAX, INT4_MAX)
  return q.reshape(k, n).T.astype(jnp.int4), scales.astype(jnp.float32)


def _int4_from_qwix(q, s, layout: str) -> tuple[jax.Array, jax.Array]:
  _check_int4("an int4 qwix weight", q.shape, layout)
  k, n = q.shape
  if s.ndim != 2 or s.shape[1] != n or not s.shape[0] or k % s.shape[0] or (
      not jnp.issubdtype(s.dtype, jnp.floating)):
    raise ValueError(f"the int4 qwix weight's scales have shape {s.shape} {s.dtype}; the "
                     f"quantized ops take a floating scale per group of K values of each "
                     f"channel, [K // group, N]: quantize with channelwise_axes=[1] and "
                     f"tiled_axes={{0: group}}")
  return q.T, s.astype(jnp.float32)


def quantize_rows(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``x [M, K]`` -> ``(x_q [M, K] float8_e4m3fn, x_scales [M] float32)``
  with ``x ~ x_q * x_scales[:, None]``: symmetric per-row (per-token)
  quantization of activations, ``x_scales = max|x[m, :]| / 448``, the form
  W8A8-FP8 ``quantized_matmul`` takes. Runs in XLA (one fused pass over
  ``x``), inside ``jit`` before each GEMM. A row of zeros gets scale 1; a
  row holding NaN or an infinity a NaN scale (its outputs are NaN).

  Raises:
    ValueError: ``x`` not a rank-2 floating array.
  """
  x = jnp.asarray(x)
  if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be a [M, K] floating array; got {x.shape} {x.dtype}")
  x32 = x.astype(jnp.float32)
  scales = _scales(x32, 1, FP8_MAX)
  xq = jnp.clip(x32 / scales[:, None], -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn)
  return xq, scales.astype(jnp.float32)


def from_qwix(qarray, layout: str = "kn") -> tuple[jax.Array, jax.Array]:
  """A weight quantized by `qwix <https://github.com/google/qwix>`_ ->
  ``(w_q, scales)`` as :func:`quantize_weight` gives them, for
  :func:`wavetune_jax.quantized_matmul` (``[K, N]``) or
  :func:`wavetune_jax.quantized_ragged_dot` (expert weights ``[G, K, N]``).

  ``qarray`` is a ``qwix.QArray`` of a weight that multiplies from the right
  (``x @ w``), quantized per output channel::

      q = qwix.quantize(w, jnp.int8, channelwise_axes=[1])          # w [K, N]
      q = qwix.quantize(w, jnp.float8_e4m3fn, channelwise_axes=[0, 2])  # w [G, K, N]
      w_q, scales = wt.from_qwix(q)

  Its ``qvalue`` (int8 or float8_e4m3fn; qwix's int8 may hold -128, which
  the kernels take as well) is taken as is, ``[K, N]`` or, with
  ``layout="nk"``, transposed to ``[N, K]`` (what W8A8 runs on); its scales
  (``[1, N]`` or ``[G, 1, N]``, in the weight's dtype) become float32 ``[N]`` or
  ``[G, N]`` (a scale per tensor or per expert is repeated over the
  channels).
  ``w_q * scales`` is then ``qwix.dequantize(qarray)`` computed in float32
  (qwix rounds its product to the scale's dtype).

  An int4 weight quantized per group of K values of each channel (W4A16)::

      q = qwix.quantize(w, jnp.int4, channelwise_axes=[1], tiled_axes={0: 128})
      w_q, scales = wt.from_qwix(q, layout="nk")  # [N, K] int4, [K // 128, N]

  takes ``layout="nk"`` only (qwix's int4 may hold -8, which the int4
  kernel takes as well). Only the attributes ``qvalue``, ``scale``,
  ``zero_point`` are read: qwix itself is not imported.

  Raises:
    ValueError: not a QArray-like object; an asymmetric quantization (a zero
      point); a value dtype other than int8, float8_e4m3fn or int4; 8-bit
      scales that are not one per output channel or per tensor (sub-channel
      tiles along K), int4 ones not per group of K of each channel, or an
      int4 weight with ``layout="kn"`` or experts; an unknown ``layout``.
  """
  if not all(hasattr(qarray, a) for a in ("qvalue", "scale", "zero_point")):
    raise ValueError(f"expected a qwix.QArray (with qvalue, scale and zero_point); got "
                     f"{type(qarray).__name__}")
  if layout not in W_LAYOUTS:
    raise ValueError(f"layout={layout!r} must be one of {W_LAYOUTS}")
  if qarray.zero_point is not None:
    raise ValueError("the qwix weight has a zero point (asymmetric quantization); the "
                     "quantized ops take symmetric weights: quantize with the default "
                     "calibration_method='absmax'")
  q, s = jnp.asarray(qarray.qvalue), jnp.asarray(qarray.scale)
  if q.dtype.name == INT4:
    return _int4_from_qwix(q, s, layout)
  if q.dtype.name not in WEIGHT_DTYPES:
    raise ValueError(f"the qwix weight holds {q.dtype.name} values; the quantized ops take "
                     f"{', '.join(WEIGHT_DTYPES + (INT4,))}")
  if q.ndim not in (2, 3):
    raise ValueError(f"the qwix weight must be [K, N] (or [G, K, N] experts); got shape "
                     f"{q.shape}")
  want = q.shape[:-2] + (1, q.shape[-1])
  if s.ndim == q.ndim and (s.shape[-2:] == (1, 1)
                          and s.shape[:-2] in (q.shape[:-2], (1,) * (q.ndim - 2))):
    s = jnp.broadcast_to(s, want)  # one scale per tensor (or per expert)
  if s.shape != want:
    raise ValueError(
        f"the qwix weight's scales have shape {s.shape}; the quantized ops take one scale "
        f"per output channel, shape {want}: quantize with channelwise_axes="
        f"{list(range(q.ndim - 2)) + [q.ndim - 1]} and no tiled_axes")
  if not jnp.issubdtype(s.dtype, jnp.floating):
    raise ValueError(f"the qwix weight's scales must be floating; got {s.dtype}")
  scales = s[..., 0, :].astype(jnp.float32)
  return (q if layout == "kn" else jnp.swapaxes(q, -1, -2)), scales
