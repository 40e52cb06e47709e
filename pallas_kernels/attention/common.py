"""Argument checks shared by every attention kernel and the reference."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._integers import clipped_int32, shape_and_dtype

__all__ = ["SUPPORTED_DTYPES", "MAX_HEAD_DIM", "ALIGNS", "check_qkv", "check_call",
           "check_lengths", "check_align", "unbound_far_sides", "bound_sides"]

#: Where the causal diagonal sits when q_len != kv_len (or the valid KV length
#: of a sequence differs from q_len): "top_left", query i sees keys j <= i
#: (``jax.nn.dot_product_attention(is_causal=True)``); "bottom_right", the
#: last query sees the last valid key, query i sees keys
#: j <= i + L - q_len (FlashAttention 2.1+, a KV cache with new queries at
#: its end: decode and chunked prefill).
ALIGNS = ("top_left", "bottom_right")

#: Input dtypes the kernels accept (q, k and v share one).
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16)
#: Largest head dimension (the padded Q, K, V tiles must fit on chip).
MAX_HEAD_DIM = 256


def check_qkv(q: jax.Array, k: jax.Array, v: jax.Array) -> None:
  """Raises ``ValueError`` unless ``q, k, v`` form a valid attention call."""
  for name, a in (("q", q), ("k", k), ("v", v)):
    if a.ndim != 4:
      raise ValueError(
          f"{name} must have rank 4 ([batch, seq, heads, head_dim]); "
          f"got {name}.shape={a.shape}")
  if k.shape != v.shape:
    raise ValueError(f"k and v must have the same shape; got k.shape={k.shape}, "
                     f"v.shape={v.shape}")
  if q.shape[0] != k.shape[0]:
    raise ValueError(f"batch differs: q.shape={q.shape}, k.shape={k.shape}")
  if q.shape[3] != k.shape[3]:
    raise ValueError(f"head_dim differs: q.shape={q.shape} (head_dim {q.shape[3]}), "
                     f"k.shape={k.shape} (head_dim {k.shape[3]})")
  hq, hkv = q.shape[2], k.shape[2]
  if hkv == 0 or hq % hkv:
    raise ValueError(
        f"kv_heads={hkv} must divide q_heads={hq} (grouped-query attention); "
        f"q.shape={q.shape}, k.shape={k.shape}")
  if not 1 <= q.shape[3] <= MAX_HEAD_DIM:
    raise ValueError(f"head_dim={q.shape[3]} must be in [1, {MAX_HEAD_DIM}]")
  if not (q.dtype == k.dtype == v.dtype):
    raise ValueError(
        f"q, k and v must share one dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
  if q.dtype not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
    raise ValueError(f"dtype {q.dtype} is not supported; use one of "
                     f"{[jnp.dtype(d).name for d in SUPPORTED_DTYPES]}")


#: Static numbers a scale or a soft cap may be: Python's, and NumPy scalars
#: (``np.float32(0.1)``: concrete, never traced; a JAX array is refused).
_STATIC_NUMBERS = (int, float, np.integer, np.floating)


def static_float(value, name: str, must: str = "be finite: it is past float's range") -> float:
  """A Python int or float (the caller checks the type) as a float; for an
  int past float's range, ``ValueError`` "<name>=<an int of N bits> must
  <must>" (its digits may be too many to print). Finiteness and sign are
  the caller's to check."""
  try:
    return float(value)
  except OverflowError:
    raise ValueError(f"{name}=<an int of {value.bit_length()} bits> must {must}") from None


def check_call(q, k, v, scale) -> float:
  """:func:`check_qkv`, a non-empty KV sequence and the scale; returns the
  scale as a float (default ``1 / sqrt(head_dim)``)."""
  check_qkv(q, k, v)
  if k.shape[1] == 0 and q.shape[1] > 0:
    raise ValueError("kv_len is 0: softmax over no keys is undefined")
  if scale is None:
    return 1.0 / math.sqrt(q.shape[3])
  if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, _STATIC_NUMBERS):
    raise ValueError(f"scale={scale!r} must be a Python float (a static value) or None")
  value = static_float(scale, "scale")
  if not math.isfinite(value):
    raise ValueError(f"scale={scale} must be finite")
  return value


def check_align(causal_align) -> str:
  if causal_align not in ALIGNS:
    raise ValueError(f"causal_align={causal_align!r} must be one of {ALIGNS}")
  return causal_align


def check_lengths(kv_lengths, batch: int, kv_len: int):
  """``kv_lengths`` as an int32 ``[batch]`` array, or None.

  Integers wider than int32 are clipped to ``[0, kv_len]`` in their own
  dtype, before the cast (a uint32 ``4294967295`` or an int64 ``2**32 + 4``
  is ``kv_len``, not what int32 wraps it to). Narrower ones are only cast:
  every consumer clips the lengths to ``[0, kv_len]`` itself (the kernels
  when they read them, :func:`valid_keys`, the decode combine), so an extra
  clip here would only add a kernel launch to every call.

  Raises:
    ValueError: not ``[batch]`` integers (booleans are not).
  """
  if kv_lengths is None:
    return None
  shape, _ = shape_and_dtype(kv_lengths, name="kv_lengths")
  if shape != (batch,):
    raise ValueError(f"kv_lengths must have shape [batch] = ({batch},); got {shape}")
  return clipped_int32(kv_lengths, kv_len, name="kv_lengths", clip_narrow=False)


def valid_keys(kv_lengths, kv_len: int, q_len: int, *, causal: bool, causal_align: str,
               batch: int, window: tuple[int, int] | None = None):
  """``[batch, q_len, kv_len]`` bool: which keys each query sees (the mask
  every backend implements; XLA's backend and the reference use it).

  ``window = (left, right)``: query position ``i`` (``i + L - q_len`` under
  the bottom-right alignment, ``L`` the sequence's valid length) sees keys
  ``i - left <= j <= i + right``; a side of -1 is unbounded."""
  lens = (jnp.full((batch,), kv_len, jnp.int32) if kv_lengths is None
          else jnp.clip(kv_lengths, 0, kv_len))
  cols = jnp.arange(kv_len)[None, None, :]
  ok = cols < lens[:, None, None]
  shift = ((lens - q_len) if causal_align == "bottom_right" else jnp.zeros_like(lens))
  pos = jnp.arange(q_len)[None, :, None] + shift[:, None, None]
  if causal:
    ok = ok & (cols <= pos)
  window = unbound_far_sides(window, q_len, kv_len)
  if window is not None:
    left, right = window
    if left >= 0:
      ok = ok & (cols >= pos - left)
    if right >= 0:
      ok = ok & (cols <= pos + right)
  return jnp.broadcast_to(ok, (batch, q_len, kv_len))


def bounded_window(window: tuple[int, int] | None, kv_len: int) -> tuple[int, int] | None:
  """A problem's ``(left, right)`` window (-1: a side unbounded) as the ops
  take it: an unbounded side becomes ``kv_len`` (the same keys); None stays
  None."""
  if window is None or window == (-1, -1):
    return None
  return tuple(kv_len if w < 0 else int(w) for w in window)


def unbound_far_sides(window: tuple[int, int] | None, q_len: int,
                      kv_len: int) -> tuple[int, int] | None:
  """``window`` with each side of at least ``q_len + kv_len`` made
  unbounded (-1): every query position (``-q_len <= pos < kv_len`` under
  either alignment) then sees every key on that side, and positions plus
  sides stay in int32. None where neither side bounds anything."""
  if window is None:
    return None
  reach = q_len + kv_len
  out = tuple(-1 if w >= reach else w for w in window)
  return None if out == (-1, -1) else out


def bound_sides(window: tuple[int, int] | None, q_len: int, kv_len: int,
                causal: bool) -> tuple[int, int]:
  """The sides of ``window`` that bound anything, ``(-1, -1)`` for none:
  :func:`unbound_far_sides`; under a causal mask the right side is 0
  whatever was given (the mask already hides every key right of the query,
  so any right side >= 0 bounds nothing), a left side of at least
  ``max(q_len, kv_len) - 1`` bounds nothing either (no query's aligned
  position passes that, under either alignment), and a window with no
  left bound is no window. Problems that mask alike get one key."""
  window = unbound_far_sides(window, q_len, kv_len) or (-1, -1)
  if causal and window != (-1, -1):
    left = window[0]
    window = (-1, -1) if left < 0 or left >= max(q_len, kv_len) - 1 else (left, 0)
  return window


def check_window(local_window_size) -> tuple[int, int] | None:
  """``local_window_size`` as ``jax.nn.dot_product_attention`` takes it (an
  int ``w``: ``(w, w)``; a ``(left, right)`` pair; None: no window) ->
  ``(left, right)`` or None. Raises ``ValueError`` on anything else."""
  if local_window_size is None:
    return None
  if _is_int(local_window_size):
    w = int(local_window_size)
    pair = (w, w)
  elif (isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2
        and all(_is_int(x) for x in local_window_size)):
    pair = tuple(int(x) for x in local_window_size)
  else:
    raise ValueError(f"local_window_size={local_window_size!r} must be an int >= 0 or a "
                     f"(left, right) pair of ints >= 0 (Python ints: a static value)")
  if min(pair) < 0:
    raise ValueError(f"local_window_size={local_window_size!r} must be >= 0 on each side")
  return pair


def check_soft_cap(logit_soft_cap) -> float:
  """``logit_soft_cap``: None or a finite Python float > 0 -> the cap (0.0: none)."""
  if logit_soft_cap is None:
    return 0.0
  if isinstance(logit_soft_cap, (bool, np.bool_)) or not isinstance(logit_soft_cap,
                                                                     _STATIC_NUMBERS):
    raise ValueError(f"logit_soft_cap={logit_soft_cap!r} must be a finite Python float > 0 "
                     f"(a static value), or None")
  value = static_float(logit_soft_cap, "logit_soft_cap")
  if not math.isfinite(value) or value <= 0:
    raise ValueError(f"logit_soft_cap={logit_soft_cap!r} must be a finite Python float > 0 "
                     f"(a static value), or None")
  return value


def check_sinks(sinks, q_heads: int):
  """``sinks``: None or ``[q_heads]`` real numbers -> a float32 array or None."""
  if sinks is None:
    return None
  shape = getattr(sinks, "shape", None)
  if shape is None:
    try:
      sinks = jnp.asarray(sinks)
    except (TypeError, ValueError):
      raise ValueError(f"sinks must be a [q_heads] = [{q_heads}] array of logits; "
                       f"got {type(sinks).__name__}") from None
    shape = sinks.shape
  dtype = jnp.dtype(sinks.dtype)
  if tuple(shape) != (q_heads,):
    raise ValueError(f"sinks must have shape [q_heads] = ({q_heads},); got {tuple(shape)}")
  if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
    raise ValueError(f"sinks must be real numbers (float32 logits); got {dtype}")
  return jnp.asarray(sinks).astype(jnp.float32)


def _is_int(x) -> bool:
  return not isinstance(x, bool) and isinstance(x, (int, np.integer))
