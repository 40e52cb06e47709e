"""The cuDNN backend of the attention family: cuDNN's fused flash attention
through ``jax.nn.dot_product_attention(..., implementation="cudnn")``.

It has no launch parameters: one variant, modelled on the nominal tiling of
XLA's attention backend. Its sweep rows are the family's baseline rows (the
same call, timed the same way; see ``Backend.recorded_as``), so every
recorded attention sweep already measured it. With no table it is the
default wherever cuDNN runs the shape: the op is then exactly cuDNN.
"""

from __future__ import annotations

import dataclasses

import jax

from wavetune_jax.core.hardware import Hardware
from wavetune_jax.families.attention import mosaic
from wavetune_jax.families.attention.problem import AttentionProblem, coords
from wavetune_jax.families.attention.xla import NOMINAL_BLOCK, LibraryAttention

__all__ = ["CudnnAttention", "CudnnAttentionConfig"]

#: cuDNN's fused attention needs an Ampere or newer GPU.
MIN_COMPUTE_CAPABILITY = 8.0


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CudnnAttentionConfig:
  """``jax.nn.dot_product_attention(..., implementation="cudnn")``."""


def _capability(hw: Hardware) -> float:
  try:
    return float(hw.compute_capability)
  except (TypeError, ValueError):
    return 0.0


class CudnnAttention(LibraryAttention):
  """cuDNN's flash attention: 16-bit inputs, head_dim a multiple of 8 up to
  256 on Hopper (128 before), causal top-left (JAX's ``is_causal``) or none.
  Per-sequence KV lengths and the bottom-right diagonal go to the other
  backends: JAX exposes no bottom-right mask for cuDNN, and cuDNN's handling
  of non-finite values past a sequence's length has not been measured."""

  name = "cudnn"
  config_cls = CudnnAttentionConfig
  recorded_as = "baseline"
  # Its heuristic answers by length (waves, padding, the Mosaic rules).
  heuristic_size_free = False

  def supported_on(self, hw: Hardware) -> bool:
    return _capability(hw) >= MIN_COMPUTE_CAPABILITY

  @staticmethod
  def head_dim_max(hw: Hardware | None) -> int:
    return 256 if hw is None or _capability(hw) >= 9.0 else 128

  def _why_not(self, p: AttentionProblem, hw: Hardware | None) -> str | None:
    if p.dtype not in ("bfloat16", "float16"):
      return f"cuDNN attention takes bfloat16 or float16, not {p.dtype}"
    hmax = self.head_dim_max(hw)
    if p.head_dim % 8 or p.head_dim > hmax:
      return f"cuDNN attention needs head_dim a multiple of 8 up to {hmax}; got {p.head_dim}"
    if (p.lengths or p.shifted
        or (p.windowed and p.causal_align == "bottom_right" and p.q_len != p.kv_len)):
      return ("the cuDNN backend takes no per-sequence KV lengths and no bottom-right "
              "alignment (use a Triton or XLA config)")
    if p.soft_cap or p.sinks:
      return ("the cuDNN backend (jax.nn.dot_product_attention) takes no logit soft-capping "
              "and no sinks (use the XLA config)")
    if not runs_window(p):
      return ("cuDNN's sliding window bounds the left side only: a window needs causal=True "
              "or a right side of 0 (use the XLA config)")
    return None

  def space(self, problem: AttentionProblem, hw: Hardware, *, prune: bool = True):
    return () if self._why_not(problem, hw) else (CudnnAttentionConfig(),)

  def size_quantum(self, problem: AttentionProblem) -> int | None:
    return None if self._why_not(problem, None) else NOMINAL_BLOCK

  def validate(self, problem: AttentionProblem, config, hw: Hardware | None = None) -> None:
    if not isinstance(config, CudnnAttentionConfig):
      raise ValueError(f"config must be a CudnnAttentionConfig; got {config!r}")
    why = self._why_not(problem, hw)
    if why:
      raise ValueError(why)

  def heuristic(self, problem: AttentionProblem, hw: Hardware) -> CudnnAttentionConfig | None:
    """cuDNN wherever it runs the shape and its 128-row query tiles fill at
    least half the SMs; None (a Pallas kernel with smaller tiles) below. On
    the first H100 and H200 sweeps every problem of one wave or less ran
    1.0-1.27x faster with a Pallas kernel, and cuDNN won at most sizes
    above. From half the SMs to one wave the Mosaic kernel's 128x128 rule
    answered until the H200 sweep was measured again with the kernel as it
    is now: cuDNN was the oracle on 7 of its 8 such problems (head_dim 128;
    the Mosaic kernel's best config at 0.91-0.97x of it, 1.01x on the
    eighth), where the first sweep's rows, 0.8-1.2 us faster at 128-512
    tokens than the kernel runs now, had it ahead; the H100's rows are the
    first sweep's, so it takes cuDNN there too. Only the Mosaic rule's
    answers move (where its config is in the kernel's space); Triton's, below
    half the SMs or where the Mosaic kernel does not run, stay. Exceptions:
    the Mosaic kernel keeps head_dims that are not multiples of 64 at any
    size above half the SMs
    (:func:`~wavetune_jax.families.attention.mosaic.wins_above_one_wave`:
    1.09-1.15x cuDNN on the H100's ``benchmarks/attention_mosaic.py
    --coverage``), and where the Mosaic kernel would pad the lengths (not
    multiples of 8) cuDNN takes the shape (Mosaic there 0.53-0.63x cuDNN at
    777 tokens, Triton 0.66-0.82x). Windows: see the comment below."""
    if self._why_not(problem, hw):
      return None
    if not problem.plain:
      # A window it runs: the platform op (the H100 window sweep's oracle at
      # every window of 128-1,024; the Mosaic kernel's best config ran at
      # 0.95-1.08x of it at 4,096, docs/results.md), but where the Mosaic
      # kernel's persistent grid runs it (the H200: 0.99-1.16x cuDNN).
      return None if mosaic.persistent_wins(problem, hw) else CudnnAttentionConfig()
    g, _ = coords(problem, NOMINAL_BLOCK, NOMINAL_BLOCK)
    if g > hw.num_sms:
      return None if mosaic.wins_above_one_wave(problem, hw) else CudnnAttentionConfig()
    if (g >= hw.num_sms // 2 and problem.q_len >= NOMINAL_BLOCK
        and (mosaic.would_pad(problem, hw)
             or (mosaic.runs_rule_config(problem, hw)
                 and not mosaic.wins_above_one_wave(problem, hw)))):
      return CudnnAttentionConfig()
    return None

  def run(self, problem: AttentionProblem, config, q, k, v, kv_lengths=None, *,
          interpret: bool = False, scale: float | None = None):
    if interpret:
      raise NotImplementedError("cuDNN attention runs on an NVIDIA GPU only")
    return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=problem.causal,
                                        local_window_size=jax_nn_window(problem),
                                        implementation="cudnn")


def runs_window(p: AttentionProblem) -> bool:
  """Whether cuDNN's sliding window (keys ``j > i - w`` of query ``i``,
  JAX's ``local_window_size=(w - 1, 0)``) runs ``p``'s window: a causal call
  (the right side is then moot) or a right side of 0."""
  return not p.windowed or p.causal or p.window_right == 0


def jax_nn_window(p: AttentionProblem) -> tuple[int, int] | None:
  """``local_window_size`` for ``jax.nn.dot_product_attention`` (top-left
  positions): an unbounded side as the whole sequence; under a causal mask
  the right side 0 (what cuDNN asks for; the mask bounds it anyway)."""
  if not p.windowed:
    return None
  far = max(p.q_len, p.kv_len)
  left = far if p.window_left < 0 else p.window_left
  right = 0 if p.causal else (far if p.window_right < 0 else p.window_right)
  if p.causal and p.window_left < 0:
    return None  # a right side under a causal mask bounds nothing
  return left, right
