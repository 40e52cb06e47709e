"""The weight-only quantized GEMM problem: ``y = (x @ w) * scales``."""

from __future__ import annotations

import dataclasses


from wavetune_jax.families.matmul.problem import GemmShape, _dtype_name, check_gemm_fields

__all__ = ["QMatmulProblem", "DTYPES", "WEIGHT_DTYPES"]

#: Activation dtypes.
DTYPES = ("bfloat16", "float16")
#: 8-bit weight dtypes.
WEIGHT_DTYPES = ("int8", "float8_e4m3fn")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class QMatmulProblem(GemmShape):
  """Static facts of one weight-only quantized GEMM call.

  Attributes:
    m, n, k: ``x`` is ``[m, k]``, ``w`` is ``[k, n]``, ``scales`` ``[n]``.
    dtype: the activations' dtype (``"bfloat16"`` or ``"float16"``).
    w_dtype: the weight's (``"int8"`` or ``"float8_e4m3fn"``); the scales
      are float32, one per output channel (the layout is part of the family).
    out_dtype: output dtype name (default: ``dtype``).
  """

  m: int
  n: int
  k: int
  dtype: str = "bfloat16"
  w_dtype: str = "int8"
  out_dtype: str = ""
  _key: tuple = dataclasses.field(init=False, repr=False, compare=False, default=())
  _hash: int = dataclasses.field(init=False, repr=False, compare=False, default=0)

  def __post_init__(self):
    object.__setattr__(self, "w_dtype",
                       _dtype_name("QMatmulProblem.w_dtype", self.w_dtype, WEIGHT_DTYPES))
    check_gemm_fields(self, ("m", "n", "k"), DTYPES)
