"""The quantized GEMM family (weight-only and W8A8-FP8) and its backends."""

from wavetune_jax.families.qmatmul.backends import (MosaicQMatmul, XlaQMatmul,
                                                    XlaQMatmulConfig)
from wavetune_jax.families.qmatmul.family import QMatmulFamily
from wavetune_jax.families.qmatmul.problem import QMatmulProblem
from wavetune_jax.families.qmatmul.quantize import from_qwix, quantize_rows, quantize_weight

__all__ = ["MosaicQMatmul", "QMatmulFamily", "QMatmulProblem", "XlaQMatmul",
           "XlaQMatmulConfig", "from_qwix", "make", "quantize_rows", "quantize_weight"]


def make() -> QMatmulFamily:
  """The family with every backend, in order of preference (the Mosaic
  kernels' rules answer on Hopper where they run, XLA's elsewhere)."""
  return QMatmulFamily([MosaicQMatmul(), XlaQMatmul()])
