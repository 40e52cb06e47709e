"""The weight-only quantized GEMM family and its backends."""

from wavetune_jax.families.qmatmul.backends import (MosaicQMatmul, XlaQMatmul,
                                                    XlaQMatmulConfig)
from wavetune_jax.families.qmatmul.family import QMatmulFamily
from wavetune_jax.families.qmatmul.problem import QMatmulProblem
from wavetune_jax.families.qmatmul.quantize import quantize_weight

__all__ = ["MosaicQMatmul", "QMatmulFamily", "QMatmulProblem", "XlaQMatmul",
           "XlaQMatmulConfig", "make", "quantize_weight"]


def make() -> QMatmulFamily:
  """The family with every backend, in order of preference (the Mosaic
  kernel's rule answers up to 64 rows on Hopper, XLA's elsewhere)."""
  return QMatmulFamily([MosaicQMatmul(), XlaQMatmul()])
