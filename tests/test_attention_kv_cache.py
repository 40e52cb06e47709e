"""KV-cache attention in the op: per-sequence valid lengths and the causal
diagonal aligned to the end of each sequence (decode, chunked prefill).

The Triton kernel runs in interpret mode against the float32 reference, with
NaN in K and V past every sequence's length (it must not reach the output);
XLA's backend implements the same mask. The Mosaic kernel, which takes both
on a Hopper GPU, has no interpret mode: its plan is replayed on the host in
``test_attention_options.py`` and it is checked on a GPU, with NaN and Inf
past the lengths, by ``benchmarks/attention_band.py --check``.
"""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wavetune_jax as wt
from pallas_kernels.attention.reference import attention_reference
from pallas_kernels.attention.triton import TritonAttentionConfig, attention
from wavetune_jax import ATTENTION, AttentionProblem, get_hardware

CFG = TritonAttentionConfig(block_q=16, block_k=16, num_warps=4, num_stages=2)


def _qkv(b, ql, kl, hq, hkv, d, lengths=None, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(ks[0], (b, ql, hq, d), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, kl, hkv, d), jnp.float32).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, kl, hkv, d), jnp.float32).astype(jnp.bfloat16)
  if lengths is not None:  # NaN past each sequence's length
    past = jnp.arange(kl)[None, :, None, None] >= lengths[:, None, None, None]
    k = jnp.where(past, jnp.nan, k).astype(k.dtype)
    v = jnp.where(past, jnp.nan, v).astype(v.dtype)
  return q, k, v


SHAPES = [(3, 37, 37, 4, 2, 64), (3, 5, 50, 4, 1, 96), (3, 1, 40, 2, 2, 128),
          (3, 20, 33, 2, 1, 256)]


@pytest.mark.parametrize("shape,causal,align,with_lengths", [
    (s, c, a, w) for s, c, a, w in itertools.product(SHAPES[:1], (True, False),
                                                     ("top_left", "bottom_right"),
                                                     (False, True))
    if not (not w and a == "top_left")  # the plain case, tested elsewhere
] + [(s, True, "bottom_right", True) for s in SHAPES[1:]]
  + [(s, False, "top_left", True) for s in SHAPES[1:]]
  + [(SHAPES[1], True, "top_left", False), (SHAPES[1], True, "bottom_right", False)])
def test_triton_matches_reference(shape, causal, align, with_lengths):
  b, ql, kl = shape[:3]
  lengths = jnp.array([1, kl, kl // 2 + 1], jnp.int32) if with_lengths else None
  q, k, v = _qkv(*shape, lengths=lengths)
  y = attention(q, k, v, config=CFG, causal=causal, kv_lengths=lengths, causal_align=align,
                interpret=True)
  r = attention_reference(q, k, v, causal=causal, kv_lengths=lengths, causal_align=align,
                          out_dtype=jnp.float32)
  np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(r), atol=2e-2, rtol=2e-2)


def test_bottom_right_is_the_end_of_self_attention():
  """Chunked prefill: the last 5 queries against the whole sequence equal the
  last 5 rows of causal self-attention."""
  q, k, v = _qkv(2, 40, 40, 4, 2, 64)
  tail = attention(q[:, -5:], k, v, config=CFG, causal=True, causal_align="bottom_right",
                   interpret=True)
  full = attention(q, k, v, config=CFG, causal=True, interpret=True)
  np.testing.assert_allclose(np.asarray(tail, np.float32), np.asarray(full[:, -5:], np.float32),
                             atol=2e-2)


def test_op_decode_with_a_cache():
  lengths = jnp.array([1, 40, 0, 23], jnp.int32)  # 0: an empty sequence gives zeros
  q, k, v = _qkv(4, 1, 40, 8, 2, 64, lengths=lengths)
  ref = attention_reference(q, k, v, causal=True, kv_lengths=lengths,
                            causal_align="bottom_right", out_dtype=jnp.float32)
  assert np.all(np.asarray(ref)[2] == 0)
  for cfg in (None, wt.XlaAttentionConfig(), CFG):
    f = jax.jit(lambda a, b_, c, l, cfg=cfg: wt.attention(
        a, b_, c, kv_lengths=l, causal_align="bottom_right", config=cfg))
    y = np.asarray(f(q, k, v, lengths), np.float32)
    assert np.all(np.isfinite(y))
    np.testing.assert_allclose(y, np.asarray(ref), atol=2e-2, rtol=2e-2)


def test_op_rejects_bad_options():
  q, k, v = _qkv(2, 8, 16, 2, 2, 64)
  with pytest.raises(ValueError, match="kv_lengths must have shape"):
    wt.attention(q, k, v, kv_lengths=jnp.ones((3,), jnp.int32))
  with pytest.raises(ValueError, match="kv_lengths must be integers"):
    wt.attention(q, k, v, kv_lengths=jnp.ones((2,)))
  with pytest.raises(ValueError, match="causal_align"):
    wt.attention(q, k, v, causal_align="bottom")
  # The Mosaic kernel takes KV lengths and either alignment (on a GPU: here
  # the pinned config is refused for want of one, not for the lengths).
  p = AttentionProblem(batch=2, q_heads=2, kv_heads=2, q_len=8, kv_len=16, head_dim=64,
                       lengths=True, causal_align="bottom_right")
  ATTENTION.backend("mosaic").validate(p, wt.MosaicAttentionConfig(), get_hardware("h100"))
  with pytest.raises(ValueError, match="no GPU"):
    wt.attention(q, k, v, kv_lengths=jnp.ones((2,), jnp.int32),
                 config=wt.MosaicAttentionConfig())


def test_problems_and_selection():
  h100 = get_hardware("h100")
  p = AttentionProblem(batch=8, q_heads=32, kv_heads=8, q_len=1, kv_len=4096,
                       lengths=True, causal_align="bottom_right")
  assert ATTENTION.backend("mosaic").space(p, h100) == ()
  # No sweep has KV lengths: the guard keeps XLA's attention (the platform op
  # here: cuDNN does not take bottom-right lengths); the heuristic's answer is
  # Triton's kernel.
  sel = wt.select("attention", p, "h100")
  assert isinstance(sel.config, wt.XlaAttentionConfig) and sel.source == "guard"
  with wt.policy("heuristic"):
    assert isinstance(wt.select("attention", p, "h100").config, TritonAttentionConfig)
  # The keys of recorded problems (default options) are unchanged.
  plain = AttentionProblem(batch=1, q_heads=32, kv_heads=8, q_len=512)
  assert ATTENTION.problem_key(plain) == "b1:h32/8:q512:kv512:d128:causal:bfloat16"
  assert ATTENTION.problem_from_dict(ATTENTION.problem_to_dict(p)) == p
  args = ATTENTION.inputs(p.__class__(batch=2, q_heads=2, kv_heads=1, q_len=1, kv_len=64,
                                      head_dim=64, lengths=True,
                                      causal_align="bottom_right"), jax.random.PRNGKey(0))
  assert len(args) == 4 and args[3].shape == (2,) and int(args[3].min()) >= 1
