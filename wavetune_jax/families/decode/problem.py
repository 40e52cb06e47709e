"""The decode problem: a few new queries per sequence against a KV cache."""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from pallas_kernels.attention.common import MAX_HEAD_DIM
from wavetune_jax.families.attention.problem import OptionFields

__all__ = ["DecodeProblem", "DTYPES", "MAX_Q_LEN"]

DTYPES = ("bfloat16", "float16")
#: Most new queries per sequence (decode, speculative decoding's drafts);
#: longer chunks are prefill (``wt.attention``).
MAX_Q_LEN = 64


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class DecodeProblem(OptionFields):
  """Static facts of one decode-attention call.

  Attributes:
    batch, q_heads, kv_heads, head_dim: as in the arrays (``kv_heads``
      divides ``q_heads``).
    q_len: new queries per sequence, 1 to :data:`MAX_Q_LEN`.
    kv_len: the cache's length (the arrays' sequence axis; of a paged
      cache, ``max_pages * page_size``).
    dtype: ``"bfloat16"`` or ``"float16"``.
    lengths: the call gives per-sequence valid lengths (run-time values).
    causal: the queries are the last ``q_len`` positions (bottom-right
      diagonal); False: each query sees every valid key.
    page_size: 0, a contiguous cache ``[batch, kv_len, kv_heads, head_dim]``;
      above 0, a paged one (:mod:`pallas_kernels.decode.paging`): pages of
      ``page_size`` rows and a block table of ``kv_len / page_size`` pages
      per sequence. The size of the pool is not a field (a call reads the
      pages of its sequences, wherever the pool's other pages are). A paged
      problem always has ``lengths`` (a call without them passes every
      sequence's full length).
    window_left, window_right: a sliding (local) window: query position
      ``i`` (``t + L - q_len`` for new query ``t``, ``L`` the sequence's valid
      length) sees keys ``i - window_left <= j <= i + window_right``; -1
      leaves that side unbounded (the default: no window).
    soft_cap: logit soft-capping, ``cap * tanh(s / cap)`` of the scaled
      scores (Gemma-2); 0.0: none.
    sinks: the call gives per-query-head sink logits (run-time values).
  """

  batch: int
  q_heads: int
  kv_heads: int
  kv_len: int
  q_len: int = 1
  head_dim: int = 128
  dtype: str = "bfloat16"
  lengths: bool = True
  causal: bool = True
  page_size: int = 0
  window_left: int = -1
  window_right: int = -1
  soft_cap: float = 0.0
  sinks: bool = False
  _key: tuple = dataclasses.field(init=False, repr=False, compare=False, default=())
  _hash: int = dataclasses.field(init=False, repr=False, compare=False, default=0)

  def __post_init__(self):
    for name in ("batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"DecodeProblem.{name}={v!r} must be an int >= 1")
    if self.q_heads % self.kv_heads:
      raise ValueError(f"kv_heads={self.kv_heads} must divide q_heads={self.q_heads}")
    if self.q_len > MAX_Q_LEN:
      raise ValueError(f"DecodeProblem.q_len={self.q_len} must be <= {MAX_Q_LEN}")
    if self.head_dim > MAX_HEAD_DIM:
      raise ValueError(f"head_dim={self.head_dim} must be <= {MAX_HEAD_DIM}")
    for name in ("lengths", "causal"):
      if not isinstance(getattr(self, name), bool):
        raise ValueError(f"DecodeProblem.{name}={getattr(self, name)!r} must be a bool")
    ps = self.page_size
    if isinstance(ps, bool) or not isinstance(ps, int) or ps < 0:
      raise ValueError(f"DecodeProblem.page_size={ps!r} must be an int >= 0 (0: a contiguous "
                       f"cache)")
    if ps and self.kv_len % ps:
      raise ValueError(f"DecodeProblem.kv_len={self.kv_len} must be a multiple of "
                       f"page_size={ps} (max_pages * page_size)")
    if ps and not self.lengths:
      raise ValueError("a paged DecodeProblem has lengths=True (a call without lengths "
                       "passes every sequence's full length)")
    try:
      dtype = jnp.dtype(self.dtype).name
    except TypeError:  # not a dtype at all ("bf16", 3, a list)
      dtype = None
    if dtype not in DTYPES:
      raise ValueError(f"DecodeProblem.dtype={self.dtype!r} must be one of {DTYPES}")
    object.__setattr__(self, "dtype", dtype)
    self._check_options()
    self._freeze()

  @property
  def group(self) -> int:
    return self.q_heads // self.kv_heads

  @property
  def rows(self) -> int:
    """Query rows per KV head: the group's heads at every new position."""
    return self.q_len * self.group

  @property
  def padded_head_dim(self) -> int:
    return max(16, 1 << math.ceil(math.log2(self.head_dim)))

  @property
  def paged(self) -> bool:
    return self.page_size > 0

  @property
  def max_pages(self) -> int:
    """Block-table entries per sequence (0 for a contiguous cache)."""
    return self.kv_len // self.page_size if self.page_size else 0

  @property
  def span(self) -> int:
    """Keys a sequence of the full cache length reads: the cache, or under a
    left window bound the queries' positions widened by it (no key lies past
    the last query's position, so the right side adds none)."""
    if self.window_left < 0:
      return self.kv_len
    return min(self.kv_len, self.q_len + self.window_left)

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.dtype).itemsize

  @property
  def cache_bytes(self) -> int:
    """Bytes of K and V in the cache (what a full-length call reads)."""
    return 2 * self.batch * self.kv_len * self.kv_heads * self.head_dim * self.itemsize
