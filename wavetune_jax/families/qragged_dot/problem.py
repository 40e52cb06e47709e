"""The quantized grouped-GEMM problem: ``lax.ragged_dot`` with 8-bit expert
weights and per-expert, per-channel scales (weight-only), or with e4m3
activations and per-row scales too (W8A8-FP8)."""

from __future__ import annotations

import dataclasses

from wavetune_jax.families.matmul.problem import GemmShape
from wavetune_jax.families.qmatmul.problem import (DTYPES, W_LAYOUTS, WEIGHT_DTYPES,
                                                   check_quantized_fields)

__all__ = ["QRaggedDotProblem", "DTYPES", "WEIGHT_DTYPES", "W_LAYOUTS"]


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class QRaggedDotProblem(GemmShape):
  """Static facts of one quantized grouped-GEMM call (group sizes are run-time
  values, as in :class:`~wavetune_jax.families.ragged_dot.problem.RaggedDotProblem`).

  Attributes:
    m: rows of ``x`` (tokens x experts per token).
    g: experts: ``w`` is ``[g, k, n]`` (or ``[g, n, k]``), ``scales`` ``[g, n]``.
    k, n: the expert weights' shape.
    dtype: the activations' dtype: ``"bfloat16"`` or ``"float16"``
      (weight-only), or ``"float8_e4m3fn"`` (W8A8: the call also takes
      ``x_scales [m]``).
    w_dtype: the weights' (``"int8"`` or ``"float8_e4m3fn"``; W8A8 takes e4m3).
    out_dtype: output dtype name (default: ``dtype``, bfloat16 for W8A8).
    w_layout: ``"kn"`` (default) or ``"nk"`` (K contiguous).
  """

  m: int
  g: int
  k: int
  n: int
  dtype: str = "bfloat16"
  w_dtype: str = "int8"
  out_dtype: str = ""
  w_layout: str = "kn"
  _key: tuple = dataclasses.field(init=False, repr=False, compare=False, default=())
  _hash: int = dataclasses.field(init=False, repr=False, compare=False, default=0)

  def __post_init__(self):
    check_quantized_fields(self, ("m", "g", "k", "n"))

  @property
  def w8a8(self) -> bool:
    """Both operands 8-bit (FP8), with per-row scales of ``x``."""
    return self.dtype == "float8_e4m3fn"
