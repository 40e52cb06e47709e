"""The quantized GEMM problem: ``y = (x @ w) * scales`` with 8-bit weights
(weight-only, W8A16), ``(x @ w) * x_scales[:, None] * scales`` with 8-bit
activations too (W8A8-FP8), or ``x @ dequant(w)`` with int4 weights and a
scale per group of K values (W4A16)."""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from wavetune_jax.families.matmul.problem import GemmShape, _dtype_name, check_gemm_fields

__all__ = ["QMatmulProblem", "DTYPES", "WEIGHT_DTYPES", "INT4", "W_LAYOUTS",
           "check_quantized_fields"]

#: Activation dtypes: 16-bit (weight-only) or e4m3 with per-row scales (W8A8).
DTYPES = ("bfloat16", "float16", "float8_e4m3fn")
#: 8-bit weight dtypes.
WEIGHT_DTYPES = ("int8", "float8_e4m3fn")
#: The 4-bit weight dtype (W4A16: ``[N, K]``, scales per group of K).
INT4 = "int4"
#: The weight's layout: ``"kn"`` (``[K, N]``, as ``jnp.dot(x, w)`` takes it) or
#: ``"nk"`` (``[N, K]``, K contiguous: what FP8 tensor cores read).
W_LAYOUTS = ("kn", "nk")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class QMatmulProblem(GemmShape):
  """Static facts of one quantized GEMM call.

  Attributes:
    m, n, k: ``x`` is ``[m, k]``, ``w`` is ``[k, n]`` (or ``[n, k]``),
      ``scales`` ``[n]``.
    dtype: the activations' dtype: ``"bfloat16"`` or ``"float16"``
      (weight-only), or ``"float8_e4m3fn"`` (W8A8: the call then also takes
      ``x_scales [m]``, one float32 scale per row).
    w_dtype: the weight's (``"int8"`` or ``"float8_e4m3fn"``, W8A8 taking
      e4m3, with float32 scales, one per output channel; or ``"int4"``, with
      ``w_layout="nk"`` and scales ``[k // group_size, n]``).
    out_dtype: output dtype name (default: ``dtype``, bfloat16 for W8A8).
    w_layout: ``"kn"`` (default) or ``"nk"`` (:data:`W_LAYOUTS`).
    group_size: int4 only: the values of K that share a scale (a divisor of
      ``k``); 0 for 8-bit weights.
  """

  m: int
  n: int
  k: int
  dtype: str = "bfloat16"
  w_dtype: str = "int8"
  out_dtype: str = ""
  w_layout: str = "kn"
  group_size: int = 0
  _key: tuple = dataclasses.field(init=False, repr=False, compare=False, default=())
  _hash: int = dataclasses.field(init=False, repr=False, compare=False, default=0)

  def __post_init__(self):
    check_quantized_fields(self, ("m", "n", "k"), int4=True)
    g = self.group_size
    if self.w_dtype == INT4:
      if self.w_layout != "nk":
        raise ValueError("QMatmulProblem: int4 weights are [N, K] (w_layout='nk')")
      if not isinstance(g, int) or isinstance(g, bool) or g <= 0 or self.k % g:
        raise ValueError(f"QMatmulProblem.group_size={g!r}: int4 weights take a positive "
                         f"group size dividing k={self.k}")
    elif g != 0:
      raise ValueError(f"QMatmulProblem.group_size={g!r}: only int4 weights have groups "
                       f"(8-bit weights take one scale per channel: 0)")

  @property
  def w8a8(self) -> bool:
    """Both operands 8-bit (FP8), with per-row scales of ``x``."""
    return self.dtype == "float8_e4m3fn"


def check_quantized_fields(problem, dims, int4: bool = False) -> None:
  """Checks a quantized GEMM-like problem's ``dims``, dtypes (``int4``: int4
  weights too) and ``w_layout`` (one-line errors), fills the default
  ``out_dtype`` (bfloat16 for e4m3 activations) and freezes it."""
  name = type(problem).__name__
  allowed = WEIGHT_DTYPES + ((INT4,) if int4 else ())
  object.__setattr__(problem, "w_dtype",
                     _dtype_name(f"{name}.w_dtype", problem.w_dtype, allowed))
  if problem.w_layout not in W_LAYOUTS:
    raise ValueError(f"{name}.w_layout={problem.w_layout!r} must be one of {W_LAYOUTS}")
  try:
    fp8 = jnp.dtype(problem.dtype).name == "float8_e4m3fn"
  except TypeError:
    fp8 = False
  if fp8 and not problem.out_dtype:
    object.__setattr__(problem, "out_dtype", "bfloat16")
  check_gemm_fields(problem, dims, DTYPES)
  if fp8 and problem.w_dtype != "float8_e4m3fn":
    raise ValueError(f"{name}: e4m3 activations take an e4m3 weight; got "
                     f"w_dtype={problem.w_dtype}")
