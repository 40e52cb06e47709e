"""The grouped-GEMM family (``lax.ragged_dot``) and its backends."""

from wavetune_jax.families.ragged_dot.family import RaggedDotFamily, expert_weights
from wavetune_jax.families.ragged_dot.mosaic import MosaicRaggedDot, MosaicRaggedDotConfig
from wavetune_jax.families.ragged_dot.problem import RaggedDotProblem
from wavetune_jax.families.ragged_dot.triton import TritonRaggedDot, TritonRaggedDotConfig
from wavetune_jax.families.ragged_dot.xla import XlaRaggedDot, XlaRaggedDotConfig

__all__ = ["MosaicRaggedDot", "MosaicRaggedDotConfig", "RaggedDotFamily", "RaggedDotProblem",
           "TritonRaggedDot", "TritonRaggedDotConfig", "XlaRaggedDot", "XlaRaggedDotConfig",
           "expert_weights", "make"]


def make() -> RaggedDotFamily:
  """The grouped-GEMM family with every backend, in order of preference: on
  Hopper the Mosaic kernel's rule answers first (None where XLA is as fast),
  then XLA's, which always answers (elsewhere, with no table, the op is
  ``lax.ragged_dot``)."""
  return RaggedDotFamily([MosaicRaggedDot(), XlaRaggedDot(), TritonRaggedDot()])
