"""The attention problem and the (G, L) mapping its kernels share."""

from __future__ import annotations

import dataclasses
import functools
import math

import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention.common import MAX_HEAD_DIM, check_align, static_float
from pallas_kernels.attention.triton import q_block_start
from wavetune_jax.core.family import Problem

__all__ = ["AttentionProblem", "DTYPES", "OPTION_DEFAULTS", "OptionFields", "coords", "next_pow2"]

DTYPES = ("bfloat16", "float16")


class OptionFields(Problem):
  """The attention options an attention or decode problem shares: fields
  ``window_left``, ``window_right`` (-1: that side unbounded), ``soft_cap``
  (0.0: none) and ``sinks`` (bool), declared by each dataclass; their checks
  and views."""

  __slots__ = ()

  def _check_options(self) -> None:
    name = type(self).__name__
    for field in ("window_left", "window_right"):
      v = getattr(self, field)
      if isinstance(v, bool) or not isinstance(v, int) or v < -1:
        raise ValueError(f"{name}.{field}={v!r} must be an int >= 0, or -1 (unbounded)")
    cap = self.soft_cap
    must = "be a finite float >= 0 (0: no soft-capping)"
    if (isinstance(cap, bool) or not isinstance(cap, (int, float))
        or not math.isfinite(value := static_float(cap, f"{name}.soft_cap", must))
        or value < 0):
      raise ValueError(f"{name}.soft_cap={cap!r} must {must}")
    object.__setattr__(self, "soft_cap", value)
    if not isinstance(self.sinks, bool):
      raise ValueError(f"{name}.sinks={self.sinks!r} must be a bool")

  @property
  def windowed(self) -> bool:
    """A sliding window bounds one side or both."""
    return self.window_left >= 0 or self.window_right >= 0

  @property
  def plain(self) -> bool:
    """No window, no soft-capping, no sinks (what every backend runs)."""
    return not (self.windowed or self.soft_cap or self.sinks)

  @property
  def window(self) -> tuple[int, int] | None:
    return (self.window_left, self.window_right) if self.windowed else None

  @property
  def options(self) -> dict:
    """The option fields that differ from their defaults."""
    return {f: getattr(self, f) for f, d in OPTION_DEFAULTS.items() if getattr(self, f) != d}


#: The option fields and their defaults (no window, no soft cap, no sinks).
OPTION_DEFAULTS = {"window_left": -1, "window_right": -1, "soft_cap": 0.0, "sinks": False}


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class AttentionProblem(OptionFields):
  """Static facts of one attention call (layout ``[batch, seq, heads, head_dim]``).

  Attributes:
    batch, q_heads, kv_heads, head_dim: as in the arrays; ``kv_heads`` divides
      ``q_heads``.
    q_len, kv_len: query and key/value lengths (``kv_len=0`` means ``q_len``:
      self-attention prefill).
    causal: causal mask.
    dtype: ``"bfloat16"`` or ``"float16"``.
    lengths: the call gives per-sequence valid KV lengths (their values are
      run-time data, not part of the problem).
    causal_align: ``"top_left"`` or ``"bottom_right"`` (see
      ``pallas_kernels.attention.common.ALIGNS``).
    window_left, window_right: a sliding (local) window: query position
      ``i`` (aligned as ``causal_align`` says) sees keys ``i - window_left
      <= j <= i + window_right``; -1 leaves that side unbounded (the
      default: no window).
    soft_cap: logit soft-capping, ``cap * tanh(s / cap)`` of the scaled
      scores (Gemma-2); 0.0: none.
    sinks: the call gives per-query-head sink logits (their values are
      run-time data).
  """

  batch: int
  q_heads: int
  kv_heads: int
  q_len: int
  kv_len: int = 0
  head_dim: int = 128
  causal: bool = True
  dtype: str = "bfloat16"
  lengths: bool = False
  causal_align: str = "top_left"
  window_left: int = -1
  window_right: int = -1
  soft_cap: float = 0.0
  sinks: bool = False
  _key: tuple = dataclasses.field(init=False, repr=False, compare=False, default=())
  _hash: int = dataclasses.field(init=False, repr=False, compare=False, default=0)

  def __post_init__(self):
    if self.kv_len == 0:
      object.__setattr__(self, "kv_len", self.q_len)
    for name in ("batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"AttentionProblem.{name}={v!r} must be an int >= 1")
    if self.q_heads % self.kv_heads:
      raise ValueError(f"kv_heads={self.kv_heads} must divide q_heads={self.q_heads}")
    if self.head_dim > MAX_HEAD_DIM:
      raise ValueError(f"head_dim={self.head_dim} must be <= {MAX_HEAD_DIM}")
    if not isinstance(self.causal, bool):
      raise ValueError(f"AttentionProblem.causal={self.causal!r} must be a bool")
    try:
      dtype = jnp.dtype(self.dtype).name
    except TypeError:  # not a dtype at all ("bf16", 3, a list)
      dtype = None
    if dtype not in DTYPES:
      raise ValueError(f"AttentionProblem.dtype={self.dtype!r} must be one of {DTYPES}")
    object.__setattr__(self, "dtype", dtype)
    if not isinstance(self.lengths, bool):
      raise ValueError(f"AttentionProblem.lengths={self.lengths!r} must be a bool")
    check_align(self.causal_align)
    self._check_options()
    self._freeze()

  @property
  def shifted(self) -> bool:
    """The causal diagonal is not the top-left one for some sequence."""
    return self.causal and self.causal_align == "bottom_right" and (
        self.lengths or self.q_len != self.kv_len)

  @property
  def padded_head_dim(self) -> int:
    return max(16, 1 << math.ceil(math.log2(self.head_dim)))

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.dtype).itemsize

  @property
  def flops(self) -> float:
    """Useful FLOPs (two matmuls; half of the scores under a causal mask)."""
    q, kv = self.q_len, self.kv_len
    if self.windowed:
      pos = np.arange(q, dtype=np.int64)[:, None]
      lo = np.zeros_like(pos) if self.window_left < 0 else np.maximum(pos - self.window_left, 0)
      hi = np.full_like(pos, kv - 1)
      if self.causal:
        hi = np.minimum(hi, pos)
      if self.window_right >= 0:
        hi = np.minimum(hi, pos + self.window_right)
      pairs = int(np.maximum(hi - lo + 1, 0).sum())
      return 4.0 * self.batch * self.q_heads * self.head_dim * pairs
    if not self.causal:
      pairs = q * kv
    elif q <= kv:
      pairs = q * (q + 1) // 2
    else:
      pairs = kv * (kv + 1) // 2 + (q - kv) * kv
    return 4.0 * self.batch * self.q_heads * self.head_dim * pairs


def next_pow2(v: int) -> int:
  return 1 << max(0, math.ceil(math.log2(max(1, v))))


#: L under a causal mask: "mean" (the default) or "max" KV blocks over the
#: query blocks; benchmarks/attention_causal_l.py compares the two.
CAUSAL_L = "mean"


def coords(problem: AttentionProblem, block_q: int, block_k: int,
           causal_l: str = CAUSAL_L) -> tuple[int, float]:
  """``G = batch * q_heads * ceil(q_len / block_q)``; ``L`` = KV blocks per
  program, the mean over query blocks under a causal mask or a window (the
  kernels run the longest programs first, so the waves even out). Under a
  window a program visits the blocks from the one that holds its first
  row's first key to the one of its last row's last key: every kernel that
  runs windows skips the others (the Mosaic kernel, cuDNN's sliding window)."""
  p = problem
  n_q = -(-p.q_len // block_q)
  g = p.batch * p.q_heads * n_q
  if not (p.causal or p.windowed):
    return g, float(-(-p.kv_len // block_k))
  return g, _visited_l(p.q_len, p.kv_len, block_q, block_k, p.causal, p.window_left,
                       p.window_right, causal_l)


@functools.lru_cache(maxsize=4096)
def _visited_l(q_len: int, kv_len: int, block_q: int, block_k: int, causal: bool,
               left: int, right: int, causal_l: str) -> float:
  """KV blocks per program under a causal mask and a window ``(left,
  right)`` (-1: unbounded; cached: a decision asks for the same block pairs
  of many configs)."""
  q_block = np.arange(-(-q_len // block_q))
  # Without a window, the Triton kernel's programs (the last one ends at the
  # last row); under one, the Mosaic kernel's (the last one is partial).
  windowed = left >= 0 or (right >= 0 and not causal)
  first_row = (q_block * block_q if windowed
               else q_block_start(q_block, q_len=q_len, block_q=block_q))
  last_row = np.minimum(first_row + block_q, q_len) - 1
  n_kv = -(-kv_len // block_k)
  if causal:
    hi = np.minimum(last_row // block_k + 1, n_kv)
  elif right >= 0:
    hi = np.minimum((last_row + right) // block_k + 1, n_kv)
  else:
    hi = np.full_like(q_block, n_kv)
  lo = np.maximum(first_row - left, 0) // block_k if left >= 0 else 0
  total = np.maximum(hi - lo, 0)
  return float(np.max(total) if causal_l == "max" else np.mean(total))
