"""The GEMM problem: the static facts of ``y[M, N] = x[M, K] @ w[K, N]``."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from wavetune_jax.core.family import Problem

__all__ = ["GemmShape", "MatmulProblem", "DTYPES", "OUT_DTYPES"]

#: Input dtypes (both operands share one).
DTYPES = ("bfloat16", "float16", "float32")
#: Output dtypes (accumulation is float32).
OUT_DTYPES = ("bfloat16", "float16", "float32")


class GemmShape(Problem):
  """Views shared by the GEMM-like problems (fields ``m``, ``n``, ``k``,
  ``dtype``)."""

  __slots__ = ()

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.dtype).itemsize

  @property
  def flops(self) -> int:
    return 2 * self.m * self.n * self.k


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class MatmulProblem(GemmShape):
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
    check_gemm_fields(self, ("m", "n", "k"), DTYPES)


def check_gemm_fields(problem, dims, dtypes) -> None:
  """Checks a GEMM-like problem's ``dims`` (ints >= 1) and dtypes, fills the
  default ``out_dtype`` and freezes it."""
  name = type(problem).__name__
  for d in dims:
    v = getattr(problem, d)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"{name}.{d}={v!r} must be an int >= 1")
  object.__setattr__(problem, "dtype", _dtype_name(f"{name}.dtype", problem.dtype, dtypes))
  object.__setattr__(problem, "out_dtype", _dtype_name(
      f"{name}.out_dtype", problem.out_dtype or problem.dtype, OUT_DTYPES))
  problem._freeze()


def _dtype_name(field: str, value, allowed) -> str:
  try:
    name = jnp.dtype(value).name
  except TypeError:
    name = None
  if name not in allowed:
    raise ValueError(f"{field}={value!r} must be one of {allowed}")
  return name
