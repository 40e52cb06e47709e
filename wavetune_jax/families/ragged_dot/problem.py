"""The grouped-GEMM problem: the static facts of ``lax.ragged_dot(lhs [M, K],
rhs [G, K, N], group_sizes [G])``.

Group sizes are run-time values (the router's choices), so they are not part
of the problem: a problem is keyed by rows, experts, K, N and dtypes, and
tuned on realistic routing (:mod:`wavetune_jax.families.ragged_dot.routing`).
"""

from __future__ import annotations

import dataclasses


from wavetune_jax.families.matmul.problem import OUT_DTYPES, GemmShape, check_gemm_fields

__all__ = ["RaggedDotProblem", "DTYPES", "OUT_DTYPES"]

#: Input dtypes (both operands share one).
DTYPES = ("bfloat16", "float16", "float32")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class RaggedDotProblem(GemmShape):
  """Static facts of one grouped-GEMM call.

  Attributes:
    m: rows of ``lhs`` (tokens x experts per token, in an MoE layer).
    g: groups (experts): ``rhs`` is ``[g, k, n]``.
    k, n: the expert weights' shape.
    dtype: input dtype name; out_dtype: output dtype name (default ``dtype``).
  """

  m: int
  g: int
  k: int
  n: int
  dtype: str = "bfloat16"
  out_dtype: str = ""
  _key: tuple = dataclasses.field(init=False, repr=False, compare=False, default=())
  _hash: int = dataclasses.field(init=False, repr=False, compare=False, default=0)

  def __post_init__(self):
    check_gemm_fields(self, ("m", "g", "k", "n"), DTYPES)
