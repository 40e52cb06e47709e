"""Sliding windows, logit soft-capping and sinks in ``wt.attention`` (CPU).

The reference against ``jax.nn.dot_product_attention(local_window_size=)``
and against a direct NumPy computation; the op (XLA's backend on a CPU)
against the reference; which backends the selector offers; bad arguments.
"""

import json
import math
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wavetune_jax as wt
from pallas_kernels.attention.reference import attention_reference
from wavetune_jax import AttentionProblem

warnings.filterwarnings("ignore", message=".*no GPU.*")


def _qkv(b=2, t=40, s=None, h=4, kvh=2, d=32, seed=0):
  s = t if s is None else s
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(kq, (b, t, h, d), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(kk, (b, s, kvh, d), jnp.float32).astype(jnp.bfloat16)
  v = jax.random.normal(kv, (b, s, kvh, d), jnp.float32).astype(jnp.bfloat16)
  return q, k, v


def _f32(*xs):
  return [x.astype(jnp.float32) for x in xs]


# Windows smaller than, equal to and larger than the sequence (40), either
# side, an int (symmetric) and (0, 0) (each query sees itself).
WINDOWS = [3, (7, 2), (0, 0), (39, 0), 40, (100, 100), (5, 0)]


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [True, False])
def test_reference_window_is_jax_nn_local_window(window, causal):
  q, k, v = _qkv()
  lens = jnp.array([40, 17], jnp.int32)
  want = jax.nn.dot_product_attention(*_f32(q, k, v), is_causal=causal,
                                      local_window_size=window, key_value_seq_lengths=lens,
                                      implementation="xla")
  got = attention_reference(q, k, v, causal=causal, local_window_size=window, kv_lengths=lens,
                            out_dtype=jnp.float32)
  # A query that sees no key gives zeros here (jax.nn leaves its row to the
  # softmax of an all-masked row): compared where a key is seen.
  from pallas_kernels.attention.common import check_window, valid_keys
  sees = np.asarray(valid_keys(lens, 40, 40, causal=causal, causal_align="top_left", batch=2,
                               window=check_window(window)).any(axis=2))
  assert sees.sum() > 40
  np.testing.assert_allclose(np.asarray(got)[sees], np.asarray(want)[sees], rtol=1e-5,
                             atol=1e-5)
  assert not np.asarray(got)[~sees].any()


def _numpy_attention(q, k, v, *, causal, window, cap, sinks, shift=0):
  """One head at a time, in float64: the definitions written out."""
  q, k, v = (np.asarray(x, np.float64) for x in _f32(q, k, v))
  b, t, h, d = q.shape
  s_len, kvh = k.shape[1], k.shape[2]
  out = np.zeros_like(q)
  for bi in range(b):
    for hi in range(h):
      kh = hi // (h // kvh)
      for i in range(t):
        pos = i + shift
        js = [j for j in range(s_len)
              if (not causal or j <= pos)
              and (window is None or (window[0] < 0 or j >= pos - window[0])
                   and (window[1] < 0 or j <= pos + window[1]))]
        if not js:
          continue
        sc = np.array([q[bi, i, hi] @ k[bi, j, kh] / math.sqrt(d) for j in js])
        if cap:
          sc = cap * np.tanh(sc / cap)
        mx = max(sc.max(), sinks[hi]) if sinks is not None else sc.max()
        e = np.exp(sc - mx)
        den = e.sum() + (math.exp(sinks[hi] - mx) if sinks is not None else 0.0)
        out[bi, i, hi] = (e / den) @ v[bi, js, kh]
  return out


@pytest.mark.parametrize("causal,window,cap,with_sinks", [
    (True, None, 5.0, False), (True, None, None, True), (True, (6, 0), 2.0, True),
    (False, (3, 4), 30.0, True), (False, None, None, True)])
def test_reference_soft_cap_and_sinks_are_the_definitions(causal, window, cap, with_sinks):
  q, k, v = _qkv(b=1, t=12, h=4, kvh=2, d=16)
  sinks = (np.asarray(jax.random.normal(jax.random.PRNGKey(3), (4,))) * 2
           if with_sinks else None)
  got = attention_reference(q, k, v, causal=causal, local_window_size=window,
                            logit_soft_cap=cap, sinks=sinks, out_dtype=jnp.float32)
  want = _numpy_attention(q, k, v, causal=causal, window=window, cap=cap, sinks=sinks)
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kw", [
    dict(local_window_size=8), dict(local_window_size=(5, 3), causal=False),
    dict(logit_soft_cap=4.0), dict(with_sinks=True),
    dict(local_window_size=(6, 0), logit_soft_cap=3.0, with_sinks=True),
    dict(local_window_size=4, with_lengths=True, causal_align="bottom_right"),
    dict(with_sinks=True, with_lengths=True, q_len=5)])
def test_op_matches_the_reference(kw):
  kw = dict(kw)
  q_len = kw.pop("q_len", 40)
  q, k, v = _qkv(t=q_len, s=40)
  if kw.pop("with_sinks", False):
    kw["sinks"] = jax.random.normal(jax.random.PRNGKey(5), (4,))
  if kw.pop("with_lengths", False):
    kw["kv_lengths"] = jnp.array([40, 9], jnp.int32)
  got = jax.jit(lambda q, k, v: wt.attention(q, k, v, **kw))(q, k, v)
  want = attention_reference(q, k, v, out_dtype=jnp.float32, **kw)
  assert got.dtype == q.dtype and got.shape == q.shape
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2,
                             atol=2e-2)


def test_sinks_are_traced_and_vmapped():
  q, k, v = _qkv(b=1, t=16)
  sinks = jnp.stack([jnp.zeros(4), jnp.full((4,), 3.0)])
  f = jax.jit(jax.vmap(lambda s: wt.attention(q, k, v, sinks=s)))
  got = f(sinks)
  for i in range(2):
    want = attention_reference(q, k, v, sinks=sinks[i], out_dtype=jnp.float32)
    np.testing.assert_allclose(np.asarray(got[i], np.float32), np.asarray(want), rtol=2e-2,
                               atol=2e-2)
  # A large sink takes most of the mass: the output shrinks toward 0.
  assert float(jnp.abs(got[1].astype(jnp.float32)).mean()) < float(
      jnp.abs(got[0].astype(jnp.float32)).mean())


def _problem(**kw):
  return AttentionProblem(batch=1, q_heads=32, kv_heads=8, q_len=8192, head_dim=128, **kw)


@pytest.mark.parametrize("kw,backend,mosaic", [
    (dict(window_left=1024), "CudnnAttentionConfig", True),
    (dict(window_left=1024, window_right=0, causal=False), "CudnnAttentionConfig", True),
    # Two-sided: cuDNN does not run it, the Mosaic kernel reads the band only.
    (dict(window_left=4, window_right=4, causal=False), "MosaicAttentionConfig", True),
    (dict(window_left=1024, lengths=True), "MosaicAttentionConfig", True),
    (dict(window_left=1024, causal_align="bottom_right", q_len=8192), "CudnnAttentionConfig",
     True),  # (q_len == kv_len, no lengths: not shifted, cuDNN's window)
    (dict(lengths=True), "MosaicAttentionConfig", True),  # plain: the lengths rule
    # Not causal, bottom-right, q_len != kv_len: cuDNN would place the window
    # top-left.
    (dict(window_left=100, window_right=0, causal=False, causal_align="bottom_right",
          q_len=4096, kv_len=8192), "MosaicAttentionConfig", True),
    (dict(soft_cap=50.0), "MosaicAttentionConfig", True),
    (dict(window_left=512, sinks=True), "MosaicAttentionConfig", True),
    (dict(soft_cap=50.0, q_len=100, causal=False), "MosaicAttentionConfig", True),
    (dict(sinks=True, head_dim=40), "XlaAttentionConfig", False)])
def test_selector_offers_only_backends_that_run_the_options(kw, backend, mosaic):
  # cuDNN's window where it runs it (faster than the Mosaic kernel's on an
  # H100), the Mosaic kernel for soft-capping and sinks (guarded by the
  # family's measured rule: no table holds such problems), else XLA.
  kw = dict(kw)
  q_len, d = kw.pop("q_len", 8192), kw.pop("head_dim", 128)
  p = AttentionProblem(batch=1, q_heads=32, kv_heads=8, q_len=q_len, head_dim=d, **kw)
  for policy in ("tables", "heuristic"):
    with wt.policy(policy):
      assert type(wt.select("attention", p, "h100").config).__name__ == backend
  hw = wt.get_hardware("h100")
  assert bool(wt.ATTENTION.backend("triton").space(p, hw)) == p.plain
  assert bool(wt.ATTENTION.backend("mosaic").space(p, hw, prune=False)) == mosaic


def test_pinned_config_that_cannot_run_the_options_is_a_clear_error():
  q, k, v = _qkv(b=1, t=16)
  with pytest.raises(ValueError, match="no sliding window, logit soft-capping or sinks"):
    wt.attention(q, k, v, local_window_size=4, config=wt.TritonAttentionConfig())
  with pytest.raises(ValueError, match="soft-capping and no sinks"):
    wt.attention(q, k, v, logit_soft_cap=3.0, config={"backend": "cudnn"})


@pytest.mark.parametrize("kw", [dict(soft_cap=50.0), dict(window_left=100),
                                dict(window_left=300, soft_cap=20.0, sinks=True),
                                dict(sinks=True), dict(lengths=True),
                                dict(lengths=True, window_left=100, sinks=True),
                                dict(causal=False, window_left=64, window_right=200),
                                dict(causal=False, window_right=30, lengths=True),
                                dict(causal_align="bottom_right", lengths=True),
                                dict(causal_align="bottom_right", window_left=50, q_len=300),
                                dict(window_left=100, persistent=True),
                                dict(causal_align="bottom_right", lengths=True, q_len=900),
                                dict(window_left=64, lengths=True, persistent=True),
                                dict(lengths=True, window_left=10, kv_len=64, q_len=64),
                                dict(causal=False, window_left=2**40, window_right=5)])
def test_mosaic_kernel_with_options_lowers_for_cuda(kw, monkeypatch):
  # The GPU checks are benchmarks/attention_options.py and
  # benchmarks/attention_band.py (docs/results.md).
  from pallas_kernels.attention import mosaic as kernel
  monkeypatch.setattr(kernel, "check_device", lambda: None)
  kw = dict(kw)
  with_sinks = kw.pop("sinks", False)
  with_lengths = kw.pop("lengths", False)
  q_len = kw.pop("q_len", 777)
  kv_len = kw.pop("kv_len", 777)
  if kw.get("persistent"):
    kw["num_sms"] = 4

  def f(q, k, v, *extra):
    extra = list(extra)
    lens = extra.pop(0) if with_lengths else None
    return kernel.attention(q, k, v, config=kernel.MosaicAttentionConfig(),
                            **{"causal": True, **kw},
                            sinks=extra[0] if extra else None, kv_lengths=lens)
  args = (jax.ShapeDtypeStruct((2, q_len, 8, 128), jnp.bfloat16),
          jax.ShapeDtypeStruct((2, kv_len, 4, 128), jnp.bfloat16),
          jax.ShapeDtypeStruct((2, kv_len, 4, 128), jnp.bfloat16))
  args += (jax.ShapeDtypeStruct((2,), jnp.int32),) if with_lengths else ()
  args += (jax.ShapeDtypeStruct((8,), jnp.float32),) if with_sinks else ()
  jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


def test_mosaic_kernel_band_rejects_bad_window_and_lengths(monkeypatch):
  from pallas_kernels.attention import mosaic as kernel
  monkeypatch.setattr(kernel, "check_device", lambda: None)
  x = jnp.zeros((1, 8, 2, 64), jnp.bfloat16)
  cfg = kernel.MosaicAttentionConfig()
  with pytest.raises(ValueError, match="window_left=-2 must be a Python int >= -1"):
    kernel.attention(x, x, x, config=cfg, window_left=-2)
  with pytest.raises(ValueError, match="window_right=1.5"):
    kernel.attention(x, x, x, config=cfg, causal=False, window_right=1.5)
  with pytest.raises(ValueError, match=r"kv_lengths must have shape \[batch\]"):
    kernel.attention(x, x, x, config=cfg, kv_lengths=jnp.zeros((3,), jnp.int32))
  with pytest.raises(ValueError, match="causal_align"):
    kernel.attention(x, x, x, config=cfg, causal_align="middle")


def _band_cases():
  rng = np.random.default_rng(0)
  cases = []
  for _ in range(60):
    causal = bool(rng.integers(2))
    align = ("top_left", "bottom_right")[int(rng.integers(2))]
    kv_len = int(rng.integers(1, 700))
    q_len = int(rng.integers(1, 700))
    if causal and align == "top_left":
      q_len = min(q_len, kv_len)
    left = int(rng.choice([-1, 0, 1, 37, 64, 127, 128, 300, 1000]))
    right = -1 if causal else int(rng.choice([-1, 0, 5, 64, 200, 1000]))
    lengths = rng.integers(0, kv_len + 1, size=3) if rng.integers(2) else None
    cases.append((causal, align, q_len, kv_len, left, right, lengths,
                  int(rng.choice([64, 128])), int(rng.choice([64, 128]))))
  # Hand-picked: an empty sequence, q_len > kv_len bottom-right, a window of 0.
  cases += [(True, "bottom_right", 300, 100, -1, -1, np.array([0, 100, 7]), 64, 64),
            (True, "top_left", 256, 256, 0, -1, None, 64, 128),
            (False, "top_left", 500, 120, 20, 20, np.array([120, 1, 60]), 128, 64)]
  return cases


@pytest.mark.parametrize("case", _band_cases())
def test_mosaic_band_plan_reads_every_seen_key_and_masks_only_edges(case):
  """The banded kernel's plan, replayed on the host: each program's KV
  blocks hold every key its rows see; a warpgroup's unmasked blocks hold
  only keys every one of its rows sees; the masked blocks apply exactly
  ``valid_keys``; and the online softmax over the plan's blocks, in the
  kernel's order, with a row that sees no key giving 0, equals the
  float32 reference."""
  from pallas_kernels.attention import mosaic as kernel
  from pallas_kernels.attention.common import valid_keys
  causal, align, q_len, kv_len, left, right, lengths, block_q, block_k = case
  batch = 3
  window = None if (left, right) == (-1, -1) else (left, right)
  ok = np.asarray(valid_keys(None if lengths is None else jnp.asarray(lengths, jnp.int32),
                             kv_len, q_len, causal=causal, causal_align=align, batch=batch,
                             window=window))
  rng = np.random.default_rng(1)
  scores = rng.normal(size=(batch, q_len, kv_len)).astype(np.float32)
  values = rng.normal(size=(batch, kv_len)).astype(np.float32)
  band = dict(block_kv=block_k, causal=causal, left=left, right=-1 if causal else right)
  wg_rows = block_q // 2
  q_pad = -(-q_len // 8) * 8
  kv_pad = -(-kv_len // 8) * 8
  for b in range(batch):
    seq_len = kv_len if lengths is None else int(lengths[b])
    shift = seq_len - q_len if align == "bottom_right" else 0
    for tile in range(-(-q_pad // block_q)):
      q0 = tile * block_q + shift
      start, t_end = (int(x) for x in kernel.tile_kv_blocks(q0, q0 + block_q - 1, seq_len,
                                                            **band))
      # (No block at all where every row's window starts past the keys.)
      assert 0 <= start <= t_end and (t_end == start or t_end <= -(-kv_pad // block_k))
      for wg in range(2):
        r0 = tile * block_q + wg * wg_rows
        e1, e2, end = (int(x) for x in kernel.kv_block_plan(
            r0 + shift, r0 + shift + wg_rows - 1, start, seq_len, **band))
        assert start <= e1 <= e2 <= end <= t_end
        rows = np.arange(r0, min(r0 + wg_rows, q_len))
        if not len(rows):
          continue
        seen = ok[b, rows]
        cols = np.nonzero(seen.any(axis=0))[0]
        if len(cols):  # every seen key is in a block this warpgroup reads
          assert start * block_k <= cols.min() and cols.max() < end * block_k
        # Unmasked blocks: every row (the padding rows too) sees every key.
        for blk in range(e1, e2):
          keys = np.arange(blk * block_k, (blk + 1) * block_k)
          assert keys.max() < seq_len
          pos_all = np.arange(r0, r0 + wg_rows) + shift
          assert np.asarray(kernel.band_mask(pos_all[:, None], keys[None, :], seq_len,
                                             causal=causal, left=band["left"],
                                             right=band["right"])).all()
        # The kernel's loop over [start, end): masked, unmasked, masked.
        m = np.full(len(rows), -1e30, np.float32)
        l = np.zeros(len(rows), np.float32)
        acc = np.zeros(len(rows), np.float32)
        for blk in range(start, end):
          keys = np.arange(blk * block_k, (blk + 1) * block_k)
          inside = keys < kv_len
          s = np.where(inside[None, :], scores[b][rows][:, np.minimum(keys, kv_len - 1)], 0.0)
          vals = np.where(inside, values[b][np.minimum(keys, kv_len - 1)], 0.0)
          if not e1 <= blk < e2:
            # The kernel's mask, as it calls it (no length compare under a
            # causal mask without lengths): keys past kv_len, zero-filled,
            # must stay masked for every row of the output too.
            mask = np.asarray(kernel.band_mask(
                (rows + shift)[:, None], keys[None, :],
                None if causal and lengths is None else seq_len, causal=causal,
                left=band["left"], right=band["right"]))
            np.testing.assert_array_equal(mask[:, inside], seen[:, keys[inside]])
            assert not mask[:, ~inside].any()
            s = np.where(mask, s, -np.inf)
          m_new = np.maximum(m, s.max(axis=1))
          alpha = np.exp(m - m_new)
          p = np.exp(s - m_new[:, None])
          l = l * alpha + p.sum(axis=1)
          acc = acc * alpha + p @ vals
          m = m_new
        out = acc / np.maximum(l, 1.0)
        ref_s = np.where(seen, scores[b][rows], -np.inf)
        ref_m = ref_s.max(axis=1, initial=-np.inf)
        ref_p = np.where(seen, np.exp(ref_s - np.where(np.isfinite(ref_m), ref_m, 0)[:, None]),
                         0.0)
        ref = np.where(seen.any(axis=1), ref_p @ values[b] / np.maximum(ref_p.sum(axis=1),
                                                                        1e-30), 0.0)
        np.testing.assert_allclose(out, ref, rtol=2e-5, atol=2e-6)


def test_problem_key_and_fields():
  plain = _problem()
  assert wt.ATTENTION.problem_key(plain) == "b1:h32/8:q8192:kv8192:d128:causal:bfloat16"
  p = _problem(window_left=1024, window_right=0, soft_cap=50.0, sinks=True)
  assert wt.ATTENTION.problem_key(p).endswith(":w1024,0:cap50:sinks")
  assert wt.ATTENTION.problem_from_dict(wt.ATTENTION.problem_to_dict(p)) == p
  assert wt.ATTENTION.with_size(p, 4096).window == (1024, 0)
  assert p.window == (1024, 0) and not p.plain and plain.plain
  # A 1,024 window at 8k tokens: about an eighth of the causal work.
  ratio = p.flops / plain.flops
  assert 0.2 < ratio < 0.3 and ratio == pytest.approx(
      (1025 * 8192 - 1024 * 1025 / 2) / (8192 * 8193 / 2), rel=1e-6)
  for bad in (dict(window_left=-2), dict(window_right=1.5), dict(soft_cap=-1.0),
              dict(soft_cap=math.inf), dict(sinks=1), dict(window_left=True)):
    with pytest.raises(ValueError, match="AttentionProblem"):
      _problem(**bad)


@pytest.mark.parametrize("kw,match", [
    (dict(local_window_size=-1), "local_window_size=-1 must be >= 0"),
    (dict(local_window_size=(1, 2, 3)), "local_window_size=.* must be an int"),
    (dict(local_window_size=2.5), "must be an int"),
    (dict(local_window_size=True), "must be an int"),
    (dict(local_window_size=jnp.array(3)), "must be an int"),
    (dict(logit_soft_cap=0.0), "logit_soft_cap=0.0 must be a finite"),
    (dict(logit_soft_cap=-2.0), "must be a finite"),
    (dict(logit_soft_cap=float("nan")), "must be a finite"),
    (dict(logit_soft_cap="50"), "must be a finite"),
    (dict(logit_soft_cap=jnp.float32(5.0)), "must be a finite"),
    (dict(sinks=jnp.zeros((3,))), r"sinks must have shape \[q_heads\] = \(4,\)"),
    (dict(sinks=jnp.zeros((4, 1))), "sinks must have shape"),
    (dict(sinks=jnp.zeros((4,), bool)), "sinks must be real numbers"),
    (dict(sinks=jnp.zeros((4,), jnp.complex64)), "sinks must be real numbers"),
    (dict(sinks="x"), "sinks must"),
])
def test_bad_options_are_one_line_errors(kw, match):
  q, k, v = _qkv(b=1, t=8)
  with pytest.raises(ValueError, match=match) as e:
    wt.attention(q, k, v, **kw)
  assert "\n" not in str(e.value)


def test_a_soft_cap_too_large_for_a_float_is_a_clear_error():
  from wavetune_jax import AttentionProblem
  huge = 10**5000  # (too many digits for repr: the message names its size)
  with pytest.raises(ValueError, match="soft_cap=<an int of .* bits> must be a finite float"):
    AttentionProblem(batch=1, q_heads=8, kv_heads=8, q_len=128, head_dim=64, soft_cap=huge)
  q = jnp.ones((1, 16, 2, 64), jnp.bfloat16)
  for call in (lambda: wt.attention(q, q, q, logit_soft_cap=huge),
               lambda: wt.decode_attention(q[:, :1], q, q, logit_soft_cap=huge)):
    with pytest.raises(ValueError, match="logit_soft_cap=<an int of .* bits> must be finite"):
      call()


@pytest.mark.parametrize("gpu", ["nvidia_h100_80gb_hbm3", "nvidia_h200"])
def test_mosaic_rule_takes_64_key_blocks_for_narrow_windows(gpu):
  # A window of 128 keys: 128 x 64 tiles (the best Mosaic config on 39 of
  # the 40 such problems of the two window sweeps); 512 and above, and the
  # options without a window: 128 x 128.
  from wavetune_jax.families.attention.mosaic import MosaicAttentionConfig
  from wavetune_jax.tuning import evaluate
  hw = wt.get_hardware("h100" if "h100" in gpu else "h200")
  mosaic = wt.ATTENTION.backend("mosaic")

  def rule(**kw):
    c = mosaic.heuristic(AttentionProblem(batch=1, q_heads=64, kv_heads=8, q_len=4096,
                                          kv_len=4096, head_dim=64, **kw), hw)
    return (c.block_q, c.block_k)
  # On the H200 the persistent grid runs these windows, with 128 x 128 tiles
  # (the best config at a window of 128 on all 20 problems of its sweep
  # measured again with it).
  narrow = (128, 128) if gpu == "nvidia_h200" else (128, 64)
  assert rule(window_left=127, window_right=0, sinks=True) == narrow
  assert rule(window_left=255, window_right=0, soft_cap=20.0) == narrow
  assert rule(window_left=256, window_right=0, soft_cap=20.0) == (128, 128)
  assert rule(window_left=511, window_right=0, sinks=True) == (128, 128)
  assert rule(sinks=True) == (128, 128)
  ds = evaluate.load_dataset(os.path.join(os.path.dirname(__file__), "..", "data", "sweeps",
                                          gpu, "attention_bfloat16.jsonl.gz"))
  share = []
  for p in ds.problems:
    ms = {c: t for c, t in ds.times[p].items() if isinstance(c, MosaicAttentionConfig)}
    r = mosaic.heuristic(p, ds.hw)
    if p.window_left == 127 and r in ms:
      share.append(min(ms.values()) / ms[r])
  assert len(share) == 20 and math.exp(np.mean(np.log(share))) >= 0.985


# --- the persistent grid for windowed prefill (H200) ---------------------------------

def _lower_prefill(b, t, h, kvh, d, cfg, ctas, **kw):
  from pallas_kernels.attention import mosaic as kmod
  q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
  k = jax.ShapeDtypeStruct((b, t, kvh, d), jnp.bfloat16)
  s = jax.ShapeDtypeStruct((h,), jnp.float32)

  def f(q, k, v, s):
    return kmod._attention(q, k, v, s, block_q=cfg.block_q, block_k=cfg.block_k,
                           num_stages=cfg.num_stages, causal=True, scale=d ** -0.5,
                           ctas=ctas, **kw)
  return jax.jit(f).trace(q, k, k, s).lower(lowering_platforms=("cuda",)).as_text()


@pytest.mark.parametrize("bk,kw", [(128, dict(window_left=1023)),
                                   (64, dict(window_left=127, soft_cap=20.0, has_sinks=True)),
                                   (128, dict())])
def test_persistent_prefill_kernel_lowers_for_hopper(bk, kw):
  # One CTA per SM walking the programs (more programs than CTAs): the
  # kernel lowers with its item loop, and with no more programs than CTAs it
  # is the one-CTA-per-program kernel.
  from pallas_kernels.attention.mosaic import MosaicAttentionConfig
  cfg = MosaicAttentionConfig(block_q=128, block_k=bk, num_stages=2)
  persistent = _lower_prefill(1, 2048, 16, 4, 128, cfg, 132, **kw)
  plain = _lower_prefill(1, 2048, 16, 4, 128, cfg, 0, **kw)
  assert "132" in persistent and persistent != plain
  assert _lower_prefill(1, 1024, 16, 4, 128, cfg, 132, **kw) == \
      _lower_prefill(1, 1024, 16, 4, 128, cfg, 0, **kw)


def test_persistent_prefill_refuses_a_second_tile_that_does_not_fit():
  from pallas_kernels.attention import mosaic as kmod
  cfg = kmod.MosaicAttentionConfig(block_q=128, block_k=64, num_stages=2)
  _lower_prefill(1, 4096, 8, 4, 256, cfg, 0, window_left=1023)  # one tile fits
  with pytest.raises(ValueError, match="two Q/O tiles need 263168 bytes"):
    _lower_prefill(1, 4096, 8, 4, 256, cfg, 132, window_left=1023)
  q = jnp.zeros((1, 128, 8, 64), jnp.bfloat16)
  for bad in (0, -1, 2.5, True):
    with pytest.raises(ValueError, match="num_sms must be a positive int"):
      kmod.attention(q, q, q, config=kmod.MosaicAttentionConfig(), persistent=True,
                     num_sms=bad)


def test_persistent_grid_rule_and_where_it_takes_windows_from_cudnn():
  from wavetune_jax.families.attention import mosaic as fm
  h100, h200 = wt.get_hardware("h100"), wt.get_hardware("h200")
  c = fm.MosaicAttention.HEURISTIC

  def p(**kw):
    d = dict(batch=1, q_heads=40, kv_heads=8, q_len=8192, kv_len=8192, head_dim=128,
             window_left=2047, window_right=0)
    d.update(kw)
    return AttentionProblem(**d)
  assert fm.persistent_grid(p(), c, h200.device_key)
  assert not fm.persistent_grid(p(), c, h100.device_key)  # not measured there
  assert not fm.persistent_grid(p(window_left=-1, window_right=-1), c, h200.device_key)
  assert not fm.persistent_grid(p(window_left=4096), c, h200.device_key)  # over half
  assert not fm.persistent_grid(p(head_dim=256), fm.MosaicAttention.OPTIONS_NARROW,
                                h200.device_key)  # two Q/O tiles do not fit
  assert fm.persistent_grid(p(head_dim=64), c, h200.device_key)
  assert fm.persistent_wins(p(), h200) and not fm.persistent_wins(p(), h100)
  assert not fm.persistent_wins(p(head_dim=64), h200)  # 0.95x cuDNN measured there
  assert not fm.persistent_wins(p(q_heads=8, kv_heads=8, q_len=1024, kv_len=1024,
                                  window_left=255), h200)  # 64 programs: under the SMs
  assert wt.ATTENTION.heuristic(p(), h200) == c
  assert isinstance(wt.ATTENTION.heuristic(p(), h100), wt.CudnnAttentionConfig)
  # The guard trusts it on a GQA group (5) no sweep holds.
  with wt.policy("tables"):
    assert wt.select("attention", p(), h200).config == c
    assert isinstance(wt.select("attention", p(), h100).config, wt.CudnnAttentionConfig)
    assert isinstance(wt.select("attention", p(head_dim=64), h200).config,
                      wt.CudnnAttentionConfig)


def _persistent_rows():
  with open(os.path.join(os.path.dirname(__file__), "..", "data", "probes",
                         "attention_persistent_h200.json")) as f:
    return json.load(f)["rows"]


def test_persistent_prefill_numbers_in_the_docs_are_the_runs():
  rows = _persistent_rows()
  assert len(rows) == 10
  over_cudnn, over_plain = {}, {}
  for r in rows:
    t = r["times"]
    over_cudnn[r["name"]] = t["cudnn"] / t["persistent 128x128x2"]
    over_plain[r["name"]] = t["plain 128x128x2"] / t["persistent 128x128x2"]
  d128 = [v for n, v in over_cudnn.items() if "d64" not in n]
  assert len(d128) == 9
  assert f"{min(d128):.3f}" == "1.039" and f"{max(d128):.3f}" == "1.069"
  assert f"{over_cudnn['w128 8k 64/8 d64']:.3f}" == "0.946"
  assert f"{min(over_plain.values()):.3f}" == "1.057"
  assert f"{max(over_plain.values()):.3f}" == "1.404"
  assert sum(v >= 1.05 for v in d128) == 7
  docs = open(os.path.join(os.path.dirname(__file__), "..", "docs", "results.md")).read()
  for s in ("1.039-1.069x", "0.946x", "1.057-1.404x", "7 of the 9"):
    assert s in docs, s


def test_windowed_prefill_sweep_and_decoder_numbers_in_the_docs():
  # The H200 window sweep measured again with the persistent grid: per
  # window the best Mosaic config and the rule's 128 x 128 over cuDNN.
  import gzip
  root = os.path.join(os.path.dirname(__file__), "..")
  by = {}
  with gzip.open(os.path.join(root, "data", "sweeps", "nvidia_h200",
                              "attention_bfloat16.jsonl.gz"), "rt") as f:
    for line in f:
      r = json.loads(line)
      if (r.get("type") != "row" or r["problem"].get("window_left", -1) < 0
              or r["status"] != "ok" or "median_us" not in r):
        continue
      p, c = r["problem"], r["config"] or {}
      key = (p["window_left"] + 1, p["batch"], p["q_heads"], p["q_len"])
      if r["impl"] == "pallas" and c.get("backend") == "mosaic":
        by.setdefault(key, {})[(c["block_q"], c["block_k"], c["num_stages"])] = r["median_us"]
      elif r["impl"] == "baseline":
        by.setdefault(key, {})["cudnn"] = r["median_us"]
  cells = []
  for w in (128, 512, 1024, 4096):
    ks = [k for k in by if k[0] == w]
    best = [by[k]["cudnn"] / min(v for c, v in by[k].items() if c != "cudnn") for k in ks]
    rule = [by[k]["cudnn"] / by[k][(128, 128, 2)] for k in ks]
    assert len(ks) == 20
    cells.append(f"{min(best):.2f}-{max(best):.2f}x ({sum(b > 1 for b in best)})")
    cells.append(f"{math.exp(np.mean(np.log(rule))):.3f}x; {sum(x >= 1.05 for x in rule)}")
  docs = open(os.path.join(root, "docs", "results.md")).read()
  assert ("| now | " + " | ".join(cells[0::2]) + " |") in docs
  assert ("| now, 128 x 128 (the rule's config), geomean; >= 1.05x | "
          + " | ".join(cells[1::2]) + " |") in docs
  # The decoder with local layers.
  rows = json.load(open(os.path.join(root, "data", "e2e",
                                     "llama3_8b_local_w1024_h200.json")))["rows"]
  us = {(r["setting"], r["kind"]): r["us"] for r in rows}
  ttft = us[("xla", "prefill")] / us[("tables", "prefill")]
  tpot = us[("xla", "decode")] / us[("tables", "decode")]
  assert f"**{ttft:.3f}x**" in docs and f"({tpot:.3f}x)" in docs
  # The table against the sweep (the recorded output of table_vs_sweep.py).
  tvs = open(os.path.join(root, "data", "probes", "attention_table_vs_sweep_h200.txt")).read()
  assert "geomean 0.989, min 0.763" in tvs and "speed vs cuDNN 1.038x (min 0.990x)" in tvs
  assert "geomean 0.982, min 0.731" in tvs and "speed vs cuDNN 1.031x (min 0.941x)" in tvs
  assert "| retuned | 0.989 (0.763) | 1.038x (0.990x) | 0 |" in docs


def test_h200_attention_table_against_its_sweep_reproduces_the_docs(capsys):
  import importlib.util
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location(
      "table_vs_sweep", os.path.join(root, "benchmarks", "table_vs_sweep.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    mod.main([os.path.join(root, "data", "sweeps", "nvidia_h200", "attention_bfloat16.jsonl.gz"),
              os.path.join(root, "tables", "nvidia_h200", "attention.json"), "--guarded",
              "--below", "0.97"])
  out = capsys.readouterr().out
  assert "efficiency vs oracle: geomean 0.989, min 0.763" in out
  assert "speed vs cuDNN 1.038x (min 0.990x)" in out
  assert "problems below 0.97x cuDNN (0)" in out


def test_sinks_with_the_persistent_grid_numbers_in_the_docs():
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "data", "probes",
                         "attention_options_sinks_w128_persistent_h200.json")) as f:
    (row,) = json.load(f)["rows"]
  t = {k: v["us"] for k, v in row["times"].items()}
  assert all(v["status"] == "ok" for v in row["times"].values())
  assert row["chosen_config"].startswith("MosaicAttentionConfig(block_q=128, block_k=128")
  cost = {k: t[k] / v - 1 for k, v in row["mosaic_without_cap_or_sinks_us"].items()}
  docs = open(os.path.join(root, "docs", "results.md")).read()
  for s in (f"ran in {t['wt']:.1f} us", f"{t['xla']:,.1f} us for XLA's",
            f"cost the persistent kernel {cost['mosaic']:+.1%} (128 x 128) and "
            f"{cost['mosaic64']:+.1%}"):
    assert s.replace("+-", "-") in docs, s


def test_narrow_windows_keep_64_key_blocks_where_the_persistent_grid_does_not_run():
  # On the H200 with no more programs than SMs the kernel keeps one CTA per
  # program, where 128 x 64 tiles were the best at a window of 128.
  h200 = wt.get_hardware("h200")
  mosaic = wt.ATTENTION.backend("mosaic")
  few = AttentionProblem(batch=1, q_heads=8, kv_heads=8, q_len=2048, kv_len=2048,
                         head_dim=64, window_left=127, window_right=0, sinks=True)
  many = AttentionProblem(batch=1, q_heads=64, kv_heads=8, q_len=4096, kv_len=4096,
                          head_dim=64, window_left=127, window_right=0, sinks=True)
  assert mosaic.heuristic(few, h200).block_k == 64    # 128 programs
  assert mosaic.heuristic(many, h200).block_k == 128  # 2,048 programs


def test_persistent_modes_check_has_cases_the_kernel_runs():
  # benchmarks/attention_persistent.py --modes (a GPU check): every case's
  # config fits two Q/O tiles, and has more programs than its CTAs.
  import sys
  from pallas_kernels.attention import mosaic as kmod
  sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
  import attention_persistent
  for name, b, h, kvh, d, t, causal, w, cfg, ctas in attention_persistent.MODES:
    c = attention_persistent._config(cfg)
    assert kmod.smem_bytes(block_q=c.block_q, block_k=c.block_k, num_stages=c.num_stages,
                           head_dim=d, itemsize=2, persistent=True) <= kmod.SMEM_LIMIT, name
    assert b * h * -(-t // c.block_q) > ctas, name


def test_persistent_modes_check_on_record_passed():
  """docs/results.md: ``attention_persistent.py --modes`` on an H200, every
  case right (relative error 2.0-2.2e-3)."""
  path = os.path.join(os.path.dirname(__file__), "..", "data", "probes",
                      "attention_persistent_modes_h200.txt")
  with open(path) as f:
    lines = [ln for ln in f if "CTAs" in ln]
  assert len(lines) == 5 and all(ln.rstrip().endswith(" ok") for ln in lines)
  errs = [float(ln.split("rel. error")[1].split()[0]) for ln in lines]
  assert 2.0e-3 <= min(errs) and max(errs) < 2.25e-3


def _load_rows(name):
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  with open(os.path.join(root, "data", "probes", name)) as f:
    return json.load(f)["rows"], open(os.path.join(root, "docs", "results.md")).read()


def test_band_kernel_numbers_in_the_docs():
  rows, docs = _load_rows("attention_band_h200.json")
  assert len(rows) == 18
  assert all(r["status"] == "ok" for row in rows for r in row["times"].values())
  for row in (r for r in rows if r["timed"]):
    t = {k: v["us"] for k, v in row["times"].items()}
    cells = [f"{t['wt']:,.1f}", f"{t['mosaic']:,.1f}", f"{t['mosaic64']:,.1f}",
             f"{t['xla']:,.1f}"] + ([f"{t['triton']:,.1f}"] if "triton" in t else [])
    line = next(ln for ln in docs.splitlines() if ln.startswith("|") and cells[0] in ln
                and cells[3] in ln)
    for c in cells:
      assert c in line, (row["name"], c)
    speed = t["xla"] / t["wt"]
    assert (f"{speed:.1f}x" in line or f"{speed:.2f}x" in line), (row["name"], speed)


def test_dropin_window_numbers_in_the_docs():
  for name in ("dropin_attention_band_h200.json", "dropin_attention_lengths_h200.json"):
    rows, docs = _load_rows(name)
    for row in rows:
      w, t = row["as_written"]["us"], row["autotune"]["us"]
      assert row["as_written"]["status"] == row["autotune"]["status"] == "ok"
      if row["name"] == "w1024 causal, key lengths" and "band" in name:
        continue  # (the lengths file has the later run of it)
      line = next((ln for ln in docs.splitlines()
                   if ln.startswith("|") and f"| {w:,.1f}" in ln), None)
      assert line is not None and f"| {t:,.1f} |" in line, row["name"]


def test_dropin_benchmark_dry_run_on_cpu(capsys):
  from bench_module import load_benchmark
  mod = load_benchmark("dropin_attention")
  assert mod.main(["--dry-run", "--only", "w128"]) == 0
  out = capsys.readouterr().out
  assert "w128 causal b4" in out and "local_window_size (128, 0)" in out
  with pytest.raises(SystemExit):
    mod.main(["--only", "no such problem"])


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_lengths_are_answered_by_the_rules_not_the_plain_model(gpu):
  # No sweep holds KV lengths: the tables' models (fitted on plain problems)
  # do not answer them; the Mosaic kernel's rule does where it reaches (here
  # the model had picked a Triton config, which the guard then refused for
  # XLA's attention).
  # 128 x 64 tiles over at most 512 keys, and at head_dim 256.
  for align, kv, d, bk in (("top_left", 512, 64, 64), ("bottom_right", 1024, 64, 128),
                           ("top_left", 2048, 256, 64)):
    p = AttentionProblem(batch=1, q_heads=32, kv_heads=8, q_len=512, kv_len=kv, head_dim=d,
                         lengths=True, causal_align=align)
    assert not wt.ATTENTION.modelled(p)
    with wt.policy("tables"):
      sel = wt.select("attention", p, gpu)
    assert sel.config == wt.MosaicAttentionConfig(block_q=128, block_k=bk, num_stages=2), p


def test_far_window_sides_are_unbounded_not_wrapped():
  # A side past every query position's reach sees every key on that side;
  # computed in int32 it wrapped (zeros) or overflowed (a deep JAX error).
  from pallas_kernels.attention.common import unbound_far_sides
  assert unbound_far_sides((3, 10**12), 16, 40) == (3, -1)
  assert unbound_far_sides((56, 56), 16, 40) is None
  assert unbound_far_sides((55, 0), 16, 40) == (55, 0)
  q, k, v = _qkv(b=1, t=16)
  f32 = lambda x: np.asarray(x, np.float32)  # noqa: E731
  np.testing.assert_allclose(  # each row sees its own key only
      f32(wt.attention(q, k, v, local_window_size=(0, 2**31 - 1))),
      f32(jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                       local_window_size=(0, 2**31 - 1))), atol=2e-2)
  want = f32(jax.nn.dot_product_attention(q, k, v, is_causal=True))
  for w in ((10**12, 0), 10**12):  # (JAX's own op overflows on these)
    np.testing.assert_allclose(f32(wt.attention(q, k, v, local_window_size=w)), want,
                               atol=2e-2)
  # Bottom-right with lengths and a right side near 2**31 (was off by up to 2.2).
  kk = jax.random.normal(jax.random.PRNGKey(3), (2, 40, k.shape[2], k.shape[3])).astype(k.dtype)
  qq = jnp.concatenate([q, q])
  lens = jnp.array([40, 10], jnp.int32)
  got = wt.attention(qq, kk, kk, local_window_size=(5, 2**31 - 30), causal=False,
                     causal_align="bottom_right", kv_lengths=lens)
  ref = attention_reference(qq, kk, kk, local_window_size=(5, 40), causal=False,
                            causal_align="bottom_right", kv_lengths=lens,
                            out_dtype=jnp.float32)
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(ref), atol=2e-2)
  # Decode: a far left side is no window.
  d1 = wt.decode_attention(q[:, :1], k, v, kv_lengths=jnp.array([10]),
                           local_window_size=(10**12, 0))
  d2 = wt.decode_attention(q[:, :1], k, v, kv_lengths=jnp.array([10]))
  np.testing.assert_allclose(np.asarray(d1, np.float32), np.asarray(d2, np.float32), atol=2e-2)


def test_a_nan_sink_gives_nan_not_an_unnormalised_output():
  q, k, v = _qkv(b=1, t=16)
  sinks = jnp.full((q.shape[2],), 0.0, jnp.float32).at[0].set(jnp.nan)
  out = np.asarray(wt.attention(q, k, v, sinks=sinks), np.float32)
  assert np.isnan(out[:, :, 0]).all() and np.isfinite(out[:, :, 1:]).all()


def test_lengths_grid_in_the_docs(monkeypatch):
  """docs/results.md ("Windows with KV lengths, ..."): of the 1,032 problems
  of this grid where the lengths rule reaches, the H200's tables send 28 to
  XLA's attention where their models answer them; now all take the rule."""
  import itertools
  from wavetune_jax.families.attention import mosaic as fm
  from wavetune_jax.runtime.selector import clear

  def picks(gpu):
    hw, out = wt.get_hardware(gpu), []
    for b, (h, kvh), d, q, align, lengths in itertools.product(
        (1, 2, 4, 8), ((32, 8), (16, 16), (8, 2), (64, 8)), (64, 128, 256),
        (256, 512, 1024, 2048, 4096, 8192), ("top_left", "bottom_right"), (True, False)):
      for kv in ((q,) if align == "top_left" else (q, 2 * q)):
        p = AttentionProblem(batch=b, q_heads=h, kv_heads=kvh, q_len=q, kv_len=kv,
                             head_dim=d, lengths=lengths, causal_align=align)
        if (p.lengths or p.shifted) and fm.lengths_rule(p, hw) is not None:
          with wt.policy("tables"):
            c = wt.select("attention", p, gpu).config
            out.append("rule" if c == fm.lengths_rule(p, hw) else type(c).__name__)
    return out

  for gpu in ("h100", "h200"):
    now = picks(gpu)
    assert (len(now), now.count("rule")) == (1032, 1032), gpu
  clear()
  monkeypatch.setattr(type(wt.ATTENTION), "modelled", lambda self, p: p.plain)
  before = picks("h200")
  clear()
  assert (len(before), before.count("XlaAttentionConfig"), before.count("rule")) == (
      1032, 28, 1004)
  docs = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                           "docs", "results.md")).read()
  text = " ".join(docs.split())
  assert "Of 1,032 such problems" in text and "would send 28 to XLA's attention" in text


def test_numpy_scalars_are_static_scales_and_caps():
  q = jnp.ones((1, 8, 2, 64), jnp.bfloat16) * 0.1
  want = wt.attention(q, q, q, scale=0.125, logit_soft_cap=30.0)
  got = wt.attention(q, q, q, scale=np.float32(0.125), logit_soft_cap=np.float64(30.0))
  assert jnp.array_equal(want, got)
  for bad in (jnp.float32(0.1), np.bool_(True), np.array([0.1])):
    with pytest.raises(ValueError, match="must be a Python float"):
      wt.attention(q, q, q, scale=bad)
