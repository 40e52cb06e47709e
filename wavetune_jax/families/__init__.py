"""The built-in families, registered explicitly.

A family is a folder here (its problem, argument parsing, shape-suite parsing
and one class per backend) plus a folder of kernels in ``pallas_kernels``;
``docs/extending.md`` shows how to add one.
"""

from wavetune_jax.core import registry
from wavetune_jax.families import attention, decode, matmul, qmatmul, qragged_dot, ragged_dot

__all__ = ["MATMUL", "ATTENTION", "RAGGED_DOT", "DECODE", "QMATMUL", "QRAGGED_DOT"]

MATMUL = registry.register(matmul.make())
ATTENTION = registry.register(attention.make())
RAGGED_DOT = registry.register(ragged_dot.make())
DECODE = registry.register(decode.make())
QMATMUL = registry.register(qmatmul.make())
QRAGGED_DOT = registry.register(qragged_dot.make())
