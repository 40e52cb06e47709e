"""The XLA backend of the GEMM family: ``jnp.dot`` (cuBLAS or XLA's own
Triton GEMM, as XLA's autotuner picks) as one more candidate.

It has no launch parameters: one variant, whose wave model is fitted on a
nominal tiling (64 x 128 output tiles, 64-deep K steps) so that its time
varies with the problem the way a tiled GEMM's does. Tables choose it
wherever it is predicted fastest, and with no table it is the default: the
op is then exactly ``jnp.dot``.
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp
import numpy as np

from wavetune_jax.core.family import OneConfigBackend
from wavetune_jax.core.hardware import Hardware
from wavetune_jax.families.matmul.problem import MatmulProblem

__all__ = ["XlaMatmul", "XlaMatmulConfig"]

#: The nominal tiling of the wave model's (G, L).
NOMINAL_M, NOMINAL_N, NOMINAL_K = 64, 128, 64


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class XlaMatmulConfig:
  """``jnp.dot(x, w, preferred_element_type=out_dtype)``: no launch parameters."""


def _gl(m, n, k):
  return -(-m // NOMINAL_M) * -(-n // NOMINAL_N), -(-k // NOMINAL_K)


class XlaMatmul(OneConfigBackend):
  """XLA's dot with fp32 accumulation: the baseline, as a backend (with no
  table the op is ``jnp.dot``: never slower than XLA)."""

  name = "xla"
  config_cls = XlaMatmulConfig

  def size_quantum(self, problem: MatmulProblem) -> int:
    return NOMINAL_M

  def coords(self, problem: MatmulProblem, macro: dict) -> tuple[int, int]:
    """The nominal tiling's ``(G, L)``."""
    return _gl(problem.m, problem.n, problem.k)

  def decision_arrays(self, problem: MatmulProblem, sizes, hw: Hardware, n_aux: int,
                      with_size=None):
    m = np.asarray(sizes, np.int64).reshape(-1, 1)
    g, l = _gl(m, problem.n, problem.k)
    return ((XlaMatmulConfig(),), np.ones((len(m), 1), bool), g,
            np.broadcast_to(np.asarray(l, np.float64), g.shape),
            np.zeros((len(m), 1, n_aux), np.float32))

  def run(self, problem: MatmulProblem, config, x, w, *, interpret: bool = False):
    return jnp.dot(x, w, preferred_element_type=jnp.dtype(problem.out_dtype))
