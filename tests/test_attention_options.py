"""Sliding windows, logit soft-capping and sinks in ``wt.attention`` (CPU).

The reference against ``jax.nn.dot_product_attention(local_window_size=)``
and against a direct NumPy computation; the op (XLA's backend on a CPU)
against the reference; which backends the selector offers; bad arguments.
"""

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
    (dict(window_left=1024, window_right=0, causal=False), "CudnnAttentionConfig", False),
    (dict(window_left=4, window_right=4, causal=False), "XlaAttentionConfig", False),
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
  assert not wt.ATTENTION.backend("triton").space(p, hw)
  assert bool(wt.ATTENTION.backend("mosaic").space(p, hw, prune=False)) == mosaic


def test_pinned_config_that_cannot_run_the_options_is_a_clear_error():
  q, k, v = _qkv(b=1, t=16)
  with pytest.raises(ValueError, match="no sliding window, logit soft-capping or sinks"):
    wt.attention(q, k, v, local_window_size=4, config=wt.TritonAttentionConfig())
  with pytest.raises(ValueError, match="sliding window only with causal=True"):
    wt.attention(q, k, v, local_window_size=4, causal=False, config={"backend": "mosaic"})
  with pytest.raises(ValueError, match="soft-capping and no sinks"):
    wt.attention(q, k, v, logit_soft_cap=3.0, config={"backend": "cudnn"})


@pytest.mark.parametrize("kw", [dict(soft_cap=50.0), dict(window_left=100),
                                dict(window_left=300, soft_cap=20.0, sinks=True),
                                dict(sinks=True)])
def test_mosaic_kernel_with_options_lowers_for_cuda(kw, monkeypatch):
  # The GPU checks are benchmarks/attention_options.py (docs/results.md).
  from pallas_kernels.attention import mosaic as kernel
  monkeypatch.setattr(kernel, "check_device", lambda: None)
  kw = dict(kw)
  with_sinks = kw.pop("sinks", False)

  def f(q, k, v, *s):
    return kernel.attention(q, k, v, config=kernel.MosaicAttentionConfig(), causal=True,
                            sinks=s[0] if s else None, **kw)
  args = (jax.ShapeDtypeStruct((1, 777, 8, 128), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, 777, 4, 128), jnp.bfloat16),
          jax.ShapeDtypeStruct((1, 777, 4, 128), jnp.bfloat16))
  args += (jax.ShapeDtypeStruct((8,), jnp.float32),) if with_sinks else ()
  jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))
  with pytest.raises(ValueError, match="only with causal=True"):
    kernel.attention(jnp.zeros((1, 8, 2, 64), jnp.bfloat16), jnp.zeros((1, 8, 2, 64),
                     jnp.bfloat16), jnp.zeros((1, 8, 2, 64), jnp.bfloat16),
                     config=kernel.MosaicAttentionConfig(), causal=False, window_left=3)


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
