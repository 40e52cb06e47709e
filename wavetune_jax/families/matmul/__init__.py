"""The GEMM family and its backends."""

from wavetune_jax.families.matmul.family import MatmulFamily, gemm_weights
from wavetune_jax.families.matmul.problem import MatmulProblem
from wavetune_jax.families.matmul.mosaic import MosaicMatmul, MosaicMatmulConfig
from wavetune_jax.families.matmul.triton import TritonMatmul, TritonMatmulConfig
from wavetune_jax.families.matmul.xla import XlaMatmul, XlaMatmulConfig

__all__ = ["MatmulFamily", "MatmulProblem", "MosaicMatmul", "MosaicMatmulConfig",
           "TritonMatmul", "TritonMatmulConfig", "XlaMatmul", "XlaMatmulConfig",
           "gemm_weights", "make"]


def make() -> MatmulFamily:
  """The GEMM family with every backend, in order of preference (XLA's
  heuristic always answers: with no table the op is ``jnp.dot``)."""
  return MatmulFamily([XlaMatmul(), MosaicMatmul(), TritonMatmul()])
