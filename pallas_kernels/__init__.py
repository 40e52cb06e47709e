"""Pallas GPU kernels, each a pure function of (inputs, config).

This package knows nothing about tuning; :mod:`wavetune_jax` chooses configs.
"""

from pallas_kernels.matmul import MatmulConfig, matmul, matmul_reference

__all__ = ["MatmulConfig", "matmul", "matmul_reference"]
