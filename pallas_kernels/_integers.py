"""Run-time integer arguments (KV lengths, group sizes) as the kernels take them."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["INT32_MAX", "clipped_int32", "shape_and_dtype"]

INT32_MAX = int(np.iinfo(np.int32).max)
_INT64 = np.iinfo(np.int64)


def _from_sequence(x, name: str):
  """A (nested) Python sequence as a NumPy array, its integers clipped to
  int64's range first: Python integers have no width, and past int64 the
  clip to ``[0, hi]`` that follows gives what it would give on the exact
  values (NumPy would make them floats or objects). Booleans among them are
  an error (booleans are not integers here), as are traced values (a
  sequence of them is not one array)."""
  def walk(v):
    if isinstance(v, (list, tuple)):
      return [walk(u) for u in v]
    if isinstance(v, (bool, np.bool_)):
      raise ValueError(f"{name} must be integers; got a boolean ({v!r}) in a sequence")
    if isinstance(v, jax.core.Tracer):
      raise ValueError(f"{name}: a sequence of traced values is not an array; pass them "
                       f"as one (jnp.stack)")
    if isinstance(v, (int, np.integer)):
      return max(min(int(v), int(_INT64.max)), int(_INT64.min))
    return v
  return np.asarray(walk(x))


def shape_and_dtype(x, *, name: str) -> tuple[tuple[int, ...], np.dtype]:
  """``(shape, dtype)`` of an integer argument as given (a JAX or NumPy
  array, a sequence), without converting it (JAX would narrow NumPy's 64-bit
  integers to 32 bits).

  Raises:
    ValueError: ``x`` is not array-like (None, a dict, a string, a ragged
      nested sequence); the message names the argument ``name``.
  """
  if hasattr(x, "shape") and hasattr(x, "dtype"):
    return tuple(x.shape), np.dtype(x.dtype)
  try:
    if x is None or isinstance(x, (str, bytes, dict, set)):
      raise TypeError(f"a {type(x).__name__} is not an array")
    try:
      a = _from_sequence(x, name) if isinstance(x, (list, tuple)) else np.asarray(x)
    except ValueError as e:
      if str(e).startswith(name):
        raise
      raise TypeError("a ragged nested sequence") from None
    if a.dtype == object:
      raise TypeError("not a rectangular array of numbers")
  except TypeError as e:
    raise ValueError(f"{name} must be an integer array; got {type(x).__name__} {x!r:.60} "
                     f"({e})") from None
  return a.shape, a.dtype


def clipped_int32(x, hi: int, *, name: str, clip_narrow: bool = True) -> jax.Array:
  """``x`` clipped to ``[0, hi]``, as int32.

  ``x`` holds integers of any width, signed or unsigned (a JAX array, a
  NumPy array or a Python sequence). The clip happens before the cast, in
  ``x``'s own dtype: ``4294967295`` (uint32) or ``2**32 + 4`` (int64) becomes
  ``hi``, not the int32 it would wrap to. NumPy's 64-bit integers are
  clipped before JAX sees them (without ``jax_enable_x64`` JAX narrows them
  to 32 bits, wrapping).

  Args:
    x: integers; booleans are not integers here.
    hi: the upper bound (at most ``INT32_MAX`` is kept).
    name: the argument's name, for errors.
    clip_narrow: False: integers that int32 holds (int8 to int32, uint8,
      uint16) are only cast, for callers whose kernels clip them anyway (on
      a GPU the clip would be a kernel launch of its own, a microsecond
      or more on every call).

  Returns:
    An int32 array of ``x``'s shape.

  Raises:
    ValueError: ``x`` is not an integer array (floats, booleans).
  """
  hi = min(int(hi), INT32_MAX)
  xp = jnp if isinstance(x, jax.Array) else np
  if xp is np:
    x = _from_sequence(x, name) if isinstance(x, (list, tuple)) else np.asarray(x)
  if x.dtype == np.bool_ or not jnp.issubdtype(x.dtype, jnp.integer):
    raise ValueError(f"{name} must be integers; got {name}.dtype={x.dtype}")
  info = jnp.iinfo(x.dtype)   # (NumPy's knows no int4 or int2)
  if info.min < -INT32_MAX - 1 or info.max > INT32_MAX:
    # uint32, int64, uint64: 0 and hi fit the dtype; clip there, then cast.
    x = xp.clip(x, 0, hi)
  x = x.astype(np.int32)
  if clip_narrow:
    x = xp.clip(x, 0, hi)
  return jnp.asarray(x, jnp.int32)
