"""The GEMM family and its backends."""

from wavetune_jax.families.matmul.family import MatmulFamily, gemm_weights
from wavetune_jax.families.matmul.problem import MatmulProblem
from wavetune_jax.families.matmul.triton import TritonMatmul, TritonMatmulConfig

__all__ = ["MatmulFamily", "MatmulProblem", "TritonMatmul", "TritonMatmulConfig",
           "gemm_weights", "make"]


def make() -> MatmulFamily:
  """The GEMM family with every backend, in order of preference."""
  return MatmulFamily([TritonMatmul()])
