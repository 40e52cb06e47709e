"""The quantized grouped-GEMM family (weight-only and W8A8-FP8) and its backends."""

from wavetune_jax.families.qragged_dot.backends import (MosaicQRaggedDot, XlaQRaggedDot,
                                                        XlaQRaggedDotConfig)
from wavetune_jax.families.qragged_dot.family import QRaggedDotFamily
from wavetune_jax.families.qragged_dot.problem import QRaggedDotProblem

__all__ = ["MosaicQRaggedDot", "QRaggedDotFamily", "QRaggedDotProblem", "XlaQRaggedDot",
           "XlaQRaggedDotConfig", "make"]


def make() -> QRaggedDotFamily:
  """The family with every backend, in order of preference (the Mosaic
  kernel's rule answers on Hopper where it runs, XLA's elsewhere)."""
  return QRaggedDotFamily([MosaicQRaggedDot(), XlaQRaggedDot()])
