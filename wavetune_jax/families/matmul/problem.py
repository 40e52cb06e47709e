"""The GEMM problem: the static facts of ``y[M, N] = x[M, K] @ w[K, N]``."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from wavetune_jax.core.family import Problem

__all__ = ["MatmulProblem", "DTYPES", "OUT_DTYPES"]

#: Input dtypes (both operands share one).
DTYPES = ("bfloat16", "float16", "float32")
#: Output dtypes (accumulation is float32).
OUT_DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class MatmulProblem(Problem):
  """Static facts of one GEMM call.

  Attributes:
    m, n, k: ``x`` is ``[m, k]``, ``w`` is ``[k, n]``.
    dtype: input dtype name (``"bfloat16"``, ``"float16"``, ``"float32"``).
    out_dtype: output dtype name (default: ``dtype``).
  """

  m: int
  n: int
  k: int
  dtype: str = "bfloat16"
  out_dtype: str = ""
  _key: tuple = dataclasses.field(init=False, repr=False, compare=False, default=())
  _hash: int = dataclasses.field(init=False, repr=False, compare=False, default=0)

  def __post_init__(self):
    for name in ("m", "n", "k"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"MatmulProblem.{name}={v!r} must be an int >= 1")
    object.__setattr__(self, "dtype", _dtype_name("dtype", self.dtype, DTYPES))
    object.__setattr__(self, "out_dtype",
                       _dtype_name("out_dtype", self.out_dtype or self.dtype, OUT_DTYPES))
    self._freeze()

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.dtype).itemsize

  @property
  def flops(self) -> int:
    return 2 * self.m * self.n * self.k


def _dtype_name(field: str, value, allowed) -> str:
  try:
    name = jnp.dtype(value).name
  except TypeError:
    name = None
  if name not in allowed:
    raise ValueError(f"MatmulProblem.{field}={value!r} must be one of {allowed}")
  return name
