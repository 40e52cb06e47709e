"""The library backends of the decode family: XLA's and cuDNN's attention
through ``jax.nn.dot_product_attention`` (no launch parameters); on a paged
cache, XLA's on the gathered pages and cuDNN's paged attention
(``jax._src.cudnn.fused_attention_stablehlo.paged_attention``)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention.common import valid_keys
from pallas_kernels.decode import paging
from wavetune_jax.core.family import Backend
from wavetune_jax.core.hardware import Hardware
from wavetune_jax.families.attention.cudnn import MIN_COMPUTE_CAPABILITY, _capability
from wavetune_jax.families.attention.xla import masked_attention, xla_attention
from wavetune_jax.families.decode.problem import DecodeProblem

__all__ = ["XlaDecode", "XlaDecodeConfig", "CudnnDecode", "CudnnDecodeConfig",
           "library_attention", "cudnn_paged_reason", "NOMINAL_BLOCK"]

#: Keys per nominal block of the library backends' (G, L).
NOMINAL_BLOCK = 128

try:  # JAX's cuDNN paged attention: a private module, guarded.
  from jax._src.cudnn.fused_attention_stablehlo import MaskType as _MaskType
  from jax._src.cudnn.fused_attention_stablehlo import paged_attention as _cudnn_paged
  _CUDNN_PAGED_MISSING = None
except Exception as e:  # noqa: BLE001 - any failure leaves the backend without pages
  _cudnn_paged = _MaskType = None
  _CUDNN_PAGED_MISSING = f"{type(e).__name__}: {e}"


def cudnn_paged_reason() -> str | None:
  """Why this JAX has no cuDNN paged attention (None where it has)."""
  if _CUDNN_PAGED_MISSING is None:
    return None
  return ("this JAX has no cuDNN paged attention (jax._src.cudnn.fused_attention_stablehlo."
          f"paged_attention: {_CUDNN_PAGED_MISSING})")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class XlaDecodeConfig:
  """``jax.nn.dot_product_attention(..., implementation="xla")``."""


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class CudnnDecodeConfig:
  """``jax.nn.dot_product_attention(..., implementation="cudnn")``."""


def plain_mask(p: DecodeProblem) -> bool:
  """The mask is JAX's own (valid lengths, no diagonal): one query, or none causal."""
  return p.q_len == 1 or not p.causal


def library_attention(p: DecodeProblem, implementation: str, q, k, v, kv_lengths=None,
                      block_tables=None, sinks=None, *, scale=None, safe: bool = False):
  """``jax.nn.dot_product_attention`` for a decode problem. ``safe``: values
  past a sequence's length are zeroed first, so NaN or Inf there never reaches
  the output (JAX masks the scores, but ``0 * NaN`` in ``p @ V`` is NaN).

  A paged cache (``block_tables``): cuDNN's paged attention where the pool
  holds exactly ``batch * max_pages`` pages (JAX's wrapper takes no other
  pool); otherwise, and for XLA, the pages are gathered into a contiguous
  cache first (page ids clipped to the pool).

  A window, soft-capping or sinks: XLA's attention with the window's mask
  over the whole cache and a float32 softmax (the prefill family's
  ``masked_attention``; NaN-safe), whatever ``implementation`` says."""
  if block_tables is not None:
    if (implementation == "cudnn" and _cudnn_paged is not None and p.plain
        and k.shape[0] == p.batch * p.max_pages):
      return _cudnn_paged_attention(p, q, k, v, kv_lengths, block_tables, scale=scale)
    k, v = paging.gather_pages(k, block_tables), paging.gather_pages(v, block_tables)
  if not p.plain:
    return masked_attention(as_attention(p), q, k, v, kv_lengths, sinks, scale=scale)
  if plain_mask(p):
    if kv_lengths is not None and implementation == "cudnn":
      # int32 lengths are clipped where they are used (check_lengths); XLA's
      # mask `arange < length` needs no clip, cuDNN's lengths do.
      kv_lengths = jnp.clip(kv_lengths, 0, p.kv_len)
    if safe and kv_lengths is not None:
      ok = jnp.arange(p.kv_len)[None, :] < kv_lengths[:, None]
      v = jnp.where(ok[:, :, None, None], v, jnp.zeros((), v.dtype))
    if implementation == "xla":
      return xla_attention(q, k, v, scale=scale, key_value_seq_lengths=kv_lengths)
    return jax.nn.dot_product_attention(q, k, v, scale=scale,
                                        key_value_seq_lengths=kv_lengths,
                                        implementation=implementation)
  ok = valid_keys(kv_lengths, p.kv_len, p.q_len, causal=True, causal_align="bottom_right",
                  batch=p.batch)
  if safe:
    seen = jnp.any(ok, axis=1)[:, :, None, None]
    v = jnp.where(seen, v, jnp.zeros((), v.dtype))
  out = xla_attention(q, k, v, scale=scale, mask=ok[:, None])
  return jnp.where(jnp.any(ok, axis=2)[:, :, None, None], out, jnp.zeros((), out.dtype))


def as_attention(p: DecodeProblem):
  """The prefill problem of the same call: bottom-right aligned queries."""
  from wavetune_jax.families.attention.problem import AttentionProblem
  return AttentionProblem(batch=p.batch, q_heads=p.q_heads, kv_heads=p.kv_heads,
                          q_len=p.q_len, kv_len=p.kv_len, head_dim=p.head_dim,
                          causal=p.causal, dtype=p.dtype, lengths=p.lengths,
                          causal_align="bottom_right", **p.options)


def _cudnn_paged_attention(p: DecodeProblem, q, k_pages, v_pages, kv_lengths, block_tables, *,
                           scale=None):
  """JAX's cuDNN paged attention: page tables ``[batch, 1, max_pages, 1]``
  (clipped to the pool: cuDNN reads no entry past a length, but a -1 there
  must not be an address), lengths as ``kv_seqlen`` with cuDNN's padding
  mask (as the cuDNN paged-cache samples), ``q_seqlen`` all ``q_len``."""
  table = paging.clip_pages(block_tables, k_pages.shape[0])[:, None, :, None]
  lens = (jnp.full((p.batch,), p.kv_len, jnp.int32) if kv_lengths is None
          else jnp.clip(kv_lengths, 0, p.kv_len).astype(jnp.int32))
  q_lens = jnp.full((p.batch,), p.q_len, jnp.int32)
  return _cudnn_paged(q, k_pages, v_pages, q_lens, lens, table, table,
                      scale=1.0 / np.sqrt(p.head_dim) if scale is None else float(scale),
                      mask_type=_MaskType.PADDING, qkv_layout="BTNH")


class _Library(Backend):
  platform = True
  macro_fields = ()
  micro_fields = ()
  heuristic_size_free = True

  def occupancy_bound(self, problem, config, hw: Hardware) -> int:
    return 1

  def coords(self, problem: DecodeProblem, macro: dict) -> tuple[int, float]:
    return problem.batch * problem.kv_heads, float(-(-problem.kv_len // NOMINAL_BLOCK))

  def size_quantum(self, problem) -> int | None:
    if self._why_not(problem, None):
      return None
    # A paged problem's sizes are whole pages: one per bucket.
    return problem.page_size or NOMINAL_BLOCK

  def decision_arrays(self, problem: DecodeProblem, sizes, hw: Hardware, n_aux: int,
                      with_size=None):
    kv = np.asarray(sizes, np.int64).reshape(-1, 1)
    ok = not self._why_not(problem, hw)
    return ((self.config_cls(),), np.full((len(kv), 1), ok),
            np.full((len(kv), 1), problem.batch * problem.kv_heads, np.int64),
            (-(-kv // NOMINAL_BLOCK)).astype(np.float64),
            np.zeros((len(kv), 1, n_aux), np.float32))

  def _why_not(self, p: DecodeProblem, hw) -> str | None:
    return None

  def space(self, problem, hw: Hardware, *, prune: bool = True):
    return () if self._why_not(problem, hw) else (self.config_cls(),)

  def validate(self, problem, config, hw: Hardware | None = None) -> None:
    if not isinstance(config, self.config_cls):
      raise ValueError(f"config must be a {self.config_cls.__name__}; got {config!r}")
    why = self._why_not(problem, hw)
    if why:
      raise ValueError(why)


class XlaDecode(_Library):
  """XLA's attention with the decode mask; values past a sequence's length
  are zeroed first (NaN-safe). Runs everywhere, also inside ``shard_map`` on
  a CPU. Where nothing needs zeroing (no lengths) and JAX's mask is the
  problem's, it is the family's ``baseline_xla`` call."""

  name = "xla"
  config_cls = XlaDecodeConfig
  interpret = True
  interpret_in_shard_map = True

  def heuristic(self, problem: DecodeProblem, hw: Hardware) -> XlaDecodeConfig:
    """Where the Triton kernel's rule does not answer (a cache beyond its
    32-bit offsets)."""
    return XlaDecodeConfig()

  def run(self, problem: DecodeProblem, config, q, k, v, *extra, interpret: bool = False,
          scale: float | None = None):
    from wavetune_jax.families.decode.family import decode_extra
    return library_attention(problem, "xla", q, k, v, *decode_extra(problem, extra),
                             scale=scale, safe=True)


class CudnnDecode(_Library):
  """cuDNN's attention with JAX's own mask (one query, or not causal);
  head_dim a multiple of 8 up to 256. Per-sequence lengths with one query
  only: there NaN and Inf past a sequence's length stayed out of the output
  in every case of ``benchmarks/cudnn_lengths_nan.py`` (5 on an H200, 2 on
  an H100: lengths 1, full and off block boundaries, head_dim 64/128/256),
  while with 300 queries and a length of 1 they reached it (H200)."""

  name = "cudnn"
  config_cls = CudnnDecodeConfig
  recorded_as = "baseline"

  def supported_on(self, hw: Hardware) -> bool:
    return _capability(hw) >= MIN_COMPUTE_CAPABILITY

  def _why_not(self, p: DecodeProblem, hw) -> str | None:
    if not p.plain:
      return ("cuDNN's attention in JAX aligns a sliding window at the first key, where a "
              "decode step's window ends at each sequence's own length, and takes no "
              "soft-capping or sinks (use a Mosaic or XLA config)")
    if p.head_dim % 8 or p.head_dim > 256:
      return f"cuDNN attention needs head_dim a multiple of 8 up to 256; got {p.head_dim}"
    if p.paged and cudnn_paged_reason():
      return cudnn_paged_reason()
    if p.lengths and p.q_len > 1:
      return ("the cuDNN decode backend takes per-sequence lengths with one query only "
              "(use a Triton or XLA config)")
    if not plain_mask(p):
      return "cuDNN has no bottom-right causal mask in JAX (use a Triton or XLA config)"
    return None

  def run(self, problem: DecodeProblem, config, q, k, v, *extra, interpret: bool = False,
          scale: float | None = None):
    if interpret:
      raise NotImplementedError("cuDNN attention runs on an NVIDIA GPU only")
    from wavetune_jax.families.decode.family import decode_extra
    kv_lengths, block_tables, _ = decode_extra(problem, extra)
    return library_attention(problem, "cudnn", q, k, v, kv_lengths, block_tables,
                             scale=scale)
