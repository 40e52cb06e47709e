"""The Mosaic GPU decode backend on a CPU.

The kernel has no interpret mode; its lowering to a CUDA module runs here,
and that is where Mosaic raises its layout, tiling and shared-memory errors:
configs of the space must lower, on contiguous and paged caches. Its
numerics are checked on a Hopper GPU (benchmarks/decode_mosaic.py checks
every config against the float32 reference, with NaN and Inf past the
lengths). The split combination runs here against the reference.
"""

import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wavetune_jax as wt
from pallas_kernels.attention.reference import attention_reference
from pallas_kernels.decode import mosaic as kernel
from wavetune_jax import DECODE, DecodeProblem, get_hardware
from wavetune_jax.families.decode.mosaic import coords_aux

H100 = get_hardware("h100")
MOSAIC = DECODE.backend("mosaic")


def _lower(p: DecodeProblem, c, page: int = 0):
  q = jax.ShapeDtypeStruct((p.batch, p.q_len, p.q_heads, p.head_dim), jnp.bfloat16)
  if page:
    max_pages = p.kv_len // page
    k = jax.ShapeDtypeStruct((p.batch * max_pages + 3, page, p.kv_heads, p.head_dim),
                             jnp.bfloat16)
    bt = jax.ShapeDtypeStruct((p.batch, max_pages), jnp.int32)
  else:
    k = jax.ShapeDtypeStruct((p.batch, p.kv_len, p.kv_heads, p.head_dim), jnp.bfloat16)
    bt = None
  ln = jax.ShapeDtypeStruct((p.batch,), jnp.int32) if p.lengths else None

  def f(q, k, v, ln, bt):
    return kernel.decode_attention(q, k, v, config=c, causal=p.causal, kv_lengths=ln,
                                   block_tables=bt)
  return jax.jit(f).trace(q, k, k, ln, bt).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("b,t,hq,hkv,s,d,lengths,causal", [
    (8, 1, 32, 8, 4096, 128, True, True),      # Llama-3-8B decode
    (2, 4, 32, 8, 1024, 128, True, True),      # speculative verification
    (2, 16, 32, 4, 2048, 64, True, True),      # 128 rows: two 64-row tiles
    (2, 1, 8, 8, 1024, 256, False, True),      # MHA, head_dim 256, no lengths
    (2, 1, 16, 2, 1000, 96, True, False),      # head_dim 96, not causal
])
def test_configs_of_the_space_lower_for_cuda(b, t, hq, hkv, s, d, lengths, causal):
  p = DecodeProblem(batch=b, q_len=t, q_heads=hq, kv_heads=hkv, kv_len=s, head_dim=d,
                    lengths=lengths, causal=causal)
  space = MOSAIC.space(p, H100, prune=False)
  assert space and MOSAIC.heuristic(p, H100) in space
  for c in space[:: max(1, len(space) // 4)] + (MOSAIC.heuristic(p, H100),):
    MOSAIC.validate(p, c, H100)
    _lower(p, c)  # raises on a layout, tiling or shared-memory error


@pytest.mark.parametrize("page,block_k", [(16, 128), (64, 64), (256, 128), (32, 64)])
def test_paged_caches_lower_for_cuda(page, block_k):
  # Pages smaller than a block take several TMA copies per stage.
  p = DecodeProblem(batch=4, q_heads=32, kv_heads=8, kv_len=4096)
  for splits in (1, 4):
    _lower(p, kernel.MosaicDecodeConfig(block_k=block_k, num_stages=2, num_splits=splits),
           page=page)


def test_smem_estimate_is_an_upper_bound_of_mosaics_count():
  # Over the H100's limit by Mosaic's own count (its error states the bytes):
  # the estimate must be at least that count and reject the config too.
  p = DecodeProblem(batch=4, q_heads=32, kv_heads=8, kv_len=4096)
  for c in (kernel.MosaicDecodeConfig(block_k=128, num_stages=3, num_splits=8),
            kernel.MosaicDecodeConfig(block_k=64, num_stages=6, num_splits=4)):
    with pytest.raises(ValueError, match="shared memory") as e:
      _lower(p, c)
    counted = int(re.search(r"smem_bytes=(\d+)", str(e.value)).group(1))
    assert MOSAIC.smem_bytes(p, c) >= counted > H100.smem_per_block
    assert c not in MOSAIC.space(p, H100, prune=False)
    with pytest.raises(ValueError, match="shared"):
      MOSAIC.validate(p, c, H100)


def test_space_rules_and_refusals():
  p = DecodeProblem(batch=8, q_heads=32, kv_heads=8, kv_len=4096)
  space = MOSAIC.space(p, H100)
  for c in space:
    assert MOSAIC.smem_bytes(p, c) <= H100.smem_per_block
    assert 64 * (p.head_dim + c.block_k) // 128 <= 160  # K3
    g, _, _ = coords_aux(p, c.block_k, c.num_splits)
    assert c.num_splits == 1 or g <= 4 * H100.num_sms  # K4
  # Shapes the kernel does not run: the backend steps aside (no quantum).
  for bad in (DecodeProblem(batch=2, q_heads=8, kv_heads=8, kv_len=1001),
              DecodeProblem(batch=2, q_heads=8, kv_heads=8, kv_len=1024, head_dim=48)):
    assert MOSAIC.space(bad, H100) == () and MOSAIC.size_quantum(bad) is None
    assert MOSAIC.heuristic(bad, H100) is None
    with pytest.raises(ValueError):
      MOSAIC.validate(bad, kernel.MosaicDecodeConfig(), H100)
  with pytest.raises(ValueError, match="block_k"):
    kernel.MosaicDecodeConfig(block_k=96)
  with pytest.raises(ValueError, match="num_stages"):
    kernel.MosaicDecodeConfig(num_stages=1)
  with pytest.raises(ValueError, match="num_splits"):
    kernel.MosaicDecodeConfig(num_splits=0)


def test_heuristic_splits_follow_the_ctas():
  # Few (sequence, KV head) pairs: more splits; many: one.
  few = DecodeProblem(batch=2, q_heads=8, kv_heads=1, kv_len=32768)
  many = DecodeProblem(batch=64, q_heads=32, kv_heads=8, kv_len=4096)
  assert MOSAIC.heuristic(few, H100).num_splits > 8
  assert MOSAIC.heuristic(many, H100).num_splits == 1
  wide = DecodeProblem(batch=16, q_heads=16, kv_heads=8, kv_len=8192, head_dim=256)
  assert MOSAIC.heuristic(wide, H100).block_k == 64


def test_interpret_mode_is_refused_with_a_reason():
  p = DecodeProblem(batch=1, q_heads=8, kv_heads=8, kv_len=128, lengths=False)
  q = jnp.zeros((1, 1, 8, 128), jnp.bfloat16)
  k = jnp.zeros((1, 128, 8, 128), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="interpret"):
    MOSAIC.run(p, kernel.MosaicDecodeConfig(), q, k, k, interpret=True)
  # On a CPU the op refuses a Mosaic config with a one-line reason.
  with pytest.raises(ValueError, match="cannot run here"):
    wt.decode_attention(q, k, k, config=kernel.MosaicDecodeConfig())


def test_combine_of_split_partials_matches_the_reference():
  # Partial outputs of key chunks, normalized, with their log2-sum-exp, as
  # the kernel writes them (a chunk with no key: lse -inf, output 0).
  rng = np.random.default_rng(0)
  b, hq, s, d = 2, 4, 96, 64
  q, k, v = (jnp.asarray(rng.standard_normal(sh), jnp.bfloat16).astype(jnp.float32)
             for sh in ((b, 1, hq, d), (b, s, hq, d), (b, s, hq, d)))
  lens = jnp.array([70, 0], jnp.int32)
  bf = lambda x: x.astype(jnp.bfloat16)  # noqa: E731 (the reference takes 16-bit inputs)
  ref = attention_reference(bf(q), bf(k), bf(v), causal=False, kv_lengths=lens,
                            out_dtype=jnp.float32)
  scale = 1 / math.sqrt(d)
  scores = jnp.einsum("bqhd,bkhd->bhqk", q, k) * scale * math.log2(math.e)
  scores = jnp.where(jnp.arange(s)[None, None, None] < lens[:, None, None, None], scores,
                     -jnp.inf)
  os_, ls_ = [], []
  for lo in range(0, s, 32):
    sc = scores[..., lo:lo + 32]
    m = jnp.max(sc, axis=-1, keepdims=True)
    m0 = jnp.where(m == -jnp.inf, 0.0, m)
    p = jnp.exp2(sc - m0)
    l = p.sum(-1)
    o = jnp.einsum("bhqk,bkhd->bhqd", p, v[:, lo:lo + 32]) / jnp.where(l == 0, 1, l)[..., None]
    os_.append(o)
    ls_.append(m[..., 0] + jnp.log2(l))
  out = kernel.combine(jnp.stack(os_), jnp.stack(ls_), jnp.float32)
  np.testing.assert_allclose(np.asarray(out.transpose(0, 2, 1, 3)), np.asarray(ref),
                             atol=1e-5, rtol=1e-5)
  assert np.all(np.asarray(out[1]) == 0)  # a sequence of length 0 gives zeros


def test_the_docs_figures_come_from_the_recorded_runs():
  # benchmarks/decode_mosaic.py --summarize on the two H100 runs on record.
  import os
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  sys.path.insert(0, os.path.join(root, "benchmarks"))
  import decode_mosaic
  runs = [os.path.join(root, "data", "probes", f"decode_mosaic_h100_{x}.json") for x in "ab"]
  text = decode_mosaic.summarize(runs)
  assert re.search(r"contiguous: best Mosaic config / faster platform op 1\.030x geomean, "
                   r"0\.936x min, 1\.424x max over 12 rows", text), text
  assert "pages of 16: worst 0.932x" in text and "pages of 256: worst 0.981x" in text
  shares = [int(x) for x in re.search(r"full caches, contiguous: (.*) of the", text)
            .group(1).replace("%", "").split(", ")]
  assert shares == sorted(shares) and len(shares) == 6 and 89 <= shares[-1] <= 93


def test_kernel_call_checks_its_inputs_before_the_device():
  q = jnp.zeros((2, 1, 8, 128), jnp.bfloat16)
  pages = jnp.zeros((4, 16, 2, 128), jnp.bfloat16)
  cfg = kernel.MosaicDecodeConfig(block_k=64)
  with pytest.raises(ValueError, match="block_tables"):  # a page id outside the pool
    kernel.decode_attention(q, pages, pages, config=cfg, block_tables=jnp.array([[0, 9], [1, 2]]),
                            kv_lengths=jnp.array([32, 32]))
  with pytest.raises(ValueError, match="head_dim"):
    kernel.decode_attention(q[..., :48], pages[..., :48], pages[..., :48], config=cfg,
                            block_tables=jnp.array([[0, 3], [1, 2]]))
  with pytest.raises(ValueError, match="Hopper|compute capability|GPU"):  # valid, but a CPU
    kernel.decode_attention(q, pages, pages, config=cfg, block_tables=jnp.array([[0, 3], [1, 2]]))
