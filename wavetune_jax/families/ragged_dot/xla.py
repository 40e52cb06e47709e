"""The XLA backend of the grouped-GEMM family: ``lax.ragged_dot``, its rows
past ``sum(group_sizes)`` set to zero."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._integers import INT32_MAX
from pallas_kernels.ragged_dot.worklist import clip_sizes
from wavetune_jax.core import partition
from wavetune_jax.core.family import OneConfigBackend
from wavetune_jax.core.versions import cudnn_below
from wavetune_jax.core.hardware import Hardware
from wavetune_jax.families.ragged_dot.problem import RaggedDotProblem

__all__ = ["XlaRaggedDot", "XlaRaggedDotConfig"]

NOMINAL_M, NOMINAL_N, NOMINAL_K = 64, 128, 64
#: The cuDNN from which XLA lowers ``lax.ragged_dot`` to cuDNN's grouped GEMM
#: instead of its dense form (openxla/xla PR 42313).
CUDNN_GROUPED_GEMM = (9, 22)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class XlaRaggedDotConfig:
  """``lax.ragged_dot(..., preferred_element_type=out_dtype)``: no launch parameters."""


def _gl(m, g, n, k):
  # A nominal tiling of the rows; L grows with the experts, as XLA's ragged
  # dot does work per expert.
  return -(-m // NOMINAL_M) * -(-n // NOMINAL_N), -(-k // NOMINAL_K) * g


class XlaRaggedDot(OneConfigBackend):
  """XLA's ragged dot: the baseline, as a backend (the op's default with no table)."""

  name = "xla"
  config_cls = XlaRaggedDotConfig

  def coords(self, p: RaggedDotProblem, macro: dict) -> tuple[int, int]:
    return _gl(p.m, p.g, p.n, p.k)

  def decision_arrays(self, p: RaggedDotProblem, sizes, hw: Hardware, n_aux: int,
                      with_size=None):
    m = np.asarray(sizes, np.int64).reshape(-1, 1)
    g, l = _gl(m, p.g, p.n, p.k)
    return ((XlaRaggedDotConfig(),), np.ones((len(m), 1), bool), g,
            np.broadcast_to(np.asarray(l, np.float64), g.shape),
            np.zeros((len(m), 1, n_aux), np.float32))

  def run(self, p: RaggedDotProblem, config, lhs, rhs, group_sizes, *,
          interpret: bool = False):
    # The op's sizes are each in [0, M] (Family.bind). XLA's dense ragged dot
    # (a GPU's, with a cuDNN older than 9.22) gives row r to the group whose
    # running sum first passes r: with no size negative and no sum
    # overflowing int32, sizes summing past M are already the groups cut at
    # row M, and the op adds nothing in front of it. Elsewhere (cuDNN's
    # grouped GEMM, a CPU, sums that could overflow) the running sum is
    # saturated at M first. The cuDNN is the tracing process's: a program
    # exported or compiled ahead of time for a machine with a newer cuDNN
    # takes the first path (ops.ragged_dot's docstring).
    kw = {}
    if partition.explicit_mesh((lhs, rhs, group_sizes)):
      (lhs, group_sizes), rhs, kw["out_sharding"] = partition.gathered_for_ragged_dot(
          (lhs, group_sizes), rhs, n_dim=2)
    if interpret or p.g * p.m > INT32_MAX or not cudnn_below(CUDNN_GROUPED_GEMM):
      group_sizes = clip_sizes(group_sizes, p.m)
    out = jax.lax.ragged_dot(lhs, rhs, group_sizes,
                             preferred_element_type=jnp.dtype(p.out_dtype), **kw)
    if not interpret:
      return out  # a GPU's ragged dot writes zeros past the groups itself
    # On the CPU, rows past sum(group_sizes) are made exactly zero: its dense
    # form of lax.ragged_dot multiplies them by every expert's weight (NaN
    # there gives NaN). (Not on a GPU: there it would be a pass over the
    # whole output.)
    rows = jnp.arange(p.m, dtype=group_sizes.dtype)[:, None]
    return jnp.where(rows < jnp.sum(group_sizes), out, jnp.zeros((), out.dtype))

