"""Sliding windows, logit soft-capping and sinks in ``wt.decode_attention`` (CPU).

The op (XLA's backend on a CPU) against the float32 reference on contiguous
and paged caches; the Mosaic kernel's plan of which keys each CTA reads and
masks, checked key by key against the reference's mask; its split combine
with sinks against a direct softmax; its lowering with every option; which
backends the selector offers; keys, fields and bad arguments. The kernel's
numerics on a Hopper GPU: ``benchmarks/decode_options.py``.
"""

import dataclasses
import itertools
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wavetune_jax as wt
from pallas_kernels.attention.common import valid_keys
from pallas_kernels.attention.reference import attention_reference
from pallas_kernels.decode import mosaic as kernel
from pallas_kernels.decode import paging
from wavetune_jax import DECODE, DecodeProblem
from wavetune_jax.families.decode.mosaic import bounded_window

warnings.filterwarnings("ignore", message=".*no GPU.*")
H100 = wt.get_hardware("h100")
MOSAIC = DECODE.backend("mosaic")


def _qkv(b=3, t=2, s=96, h=8, kvh=2, d=32, seed=0):
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(kq, (b, t, h, d), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(kk, (b, s, kvh, d), jnp.float32).astype(jnp.bfloat16)
  v = jax.random.normal(kv, (b, s, kvh, d), jnp.float32).astype(jnp.bfloat16)
  return q, k, v


def _close(got, want):
  np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), rtol=2e-2,
                             atol=2e-2)


SINKS = jax.random.normal(jax.random.PRNGKey(7), (8,), jnp.float32)
# Windows smaller than, equal to and larger than the cache (96), lengths
# shorter than the window, a length of 0, GQA, one and several queries.
CASES = [
    dict(local_window_size=(16, 0)),
    dict(local_window_size=(95, 0), t=1),
    dict(local_window_size=(500, 0)),
    dict(local_window_size=(0, 0), t=4),
    dict(local_window_size=(10, 3), causal=False, t=5),
    dict(logit_soft_cap=3.0),
    dict(sinks=SINKS, t=1),
    dict(local_window_size=(20, 0), logit_soft_cap=5.0, sinks=SINKS, t=3),
]


@pytest.mark.parametrize("kw", CASES)
@pytest.mark.parametrize("lengths", [None, (96, 9, 0)])
def test_op_matches_the_reference(kw, lengths):
  kw = dict(kw)
  q, k, v = _qkv(t=kw.pop("t", 2))
  lens = None if lengths is None else jnp.array(lengths, jnp.int32)
  got = jax.jit(lambda q, k, v: wt.decode_attention(q, k, v, kv_lengths=lens, **kw))(q, k, v)
  want = attention_reference(q, k, v, kv_lengths=lens, causal_align="bottom_right",
                             out_dtype=jnp.float32, **kw)
  assert got.shape == q.shape and got.dtype == q.dtype
  _close(got, want)


@pytest.mark.parametrize("kw", [CASES[0], CASES[4], CASES[-1]])
def test_paged_cache_matches_the_contiguous_one(kw):
  # Pages left of each window freed (-1), NaN in the pool's free pages.
  kw = dict(kw)
  q, k, v = _qkv(t=kw.pop("t", 2))
  page, lens = 16, jnp.array([96, 40, 70], jnp.int32)
  tables = paging.shuffled_tables(jax.random.PRNGKey(3), 3, 6, num_pages=20)
  kp = paging.to_pages(k, tables, 20, fill=jnp.nan)
  vp = paging.to_pages(v, tables, 20, fill=jnp.nan)
  left = (kw.get("local_window_size") or (-1,))[0]
  left = left if isinstance(left, int) else -1
  t = np.array(tables)
  if left >= 0:  # a serving stack frees the pages left of the window
    gone = np.maximum(np.asarray(lens) - q.shape[1] - left, 0) // page
    t[np.arange(6)[None, :] < gone[:, None]] = -1
    assert (t == -1).any()
  got = wt.decode_attention(q, kp, vp, kv_lengths=lens, block_tables=jnp.asarray(t), **kw)
  want = attention_reference(q, k, v, kv_lengths=lens, causal_align="bottom_right",
                             out_dtype=jnp.float32, **kw)
  assert not np.isnan(np.asarray(got, np.float32)).any()
  _close(got, want)
  if left >= 0:  # without the window those entries are read: a clear error
    with pytest.raises(ValueError, match=r"block_tables\[\d, \d\]=-1 is not a page"):
      wt.decode_attention(q, kp, vp, kv_lengths=lens, block_tables=jnp.asarray(t))


PLAN_CASES = list(itertools.product(
    [1, 3, 8],                        # queries
    [(-1, -1), (0, -1), (5, -1), (100, -1), (1000, -1), (7, 2)],  # window
    [True, False],                    # causal
    [1, 3],                           # splits
    [64],                             # block_k (128: the same arithmetic)
)) + [(8, (100, -1), True, 4, 128), (3, (7, 2), False, 2, 128)]


@pytest.mark.parametrize("q_len,window,causal,splits,bk", PLAN_CASES)
def test_kernel_plan_reads_every_seen_key_once_and_masks_the_edges(q_len, window, causal,
                                                                   splits, bk):
  # The plan the kernel runs on its scalars, for lengths 0 to past a block:
  # every key some row sees lies in exactly one CTA's steps; a step of
  # [lead, full) is seen whole by every row; no step lies wholly left of
  # the window or past the length.
  kv_len, group = 640, 2
  lengths = [0, 1, q_len, 63, 64, 65, 200, 511, 640]
  for valid in lengths:
    ok = np.asarray(valid_keys(jnp.array([valid]), kv_len, q_len, causal=causal,
                               causal_align="bottom_right", batch=1,
                               window=window if window != (-1, -1) else None))[0]
    ok = np.repeat(ok, group, axis=0)  # rows r = t * group + g
    count = np.zeros(kv_len + 1024, int)
    for s in range(splits):
      first, lo, n, lead, full = (int(x) for x in kernel.chunk_plan(
          jnp.int32(valid), jnp.int32(s), q_len=q_len, kv_len=kv_len, splits=splits,
          block_k=bk, window=window, causal=causal, dynamic=True))
      assert 0 <= lead <= full <= n
      for j in range(n):
        keys = np.arange(lo + j * bk, lo + (j + 1) * bk)
        assert keys[-1] >= first and keys[0] < valid, (s, j)
        count[keys] += 1
        if lead <= j < full:
          assert (keys < valid).all() and ok[:, keys].all(), (valid, s, j)
    seen = np.nonzero(ok.any(axis=0))[0]
    assert (count[seen] == 1).all(), valid
    assert count.max() <= 1


def test_kernel_plan_without_lengths_or_window_is_the_static_chunking():
  for splits, bk in [(1, 64), (4, 128), (3, 64)]:
    a = kernel.chunk_plan(jnp.int32(640), jnp.int32(1), q_len=1, kv_len=640, splits=splits,
                          block_k=bk, window=(-1, -1), causal=True, dynamic=False)
    b = kernel.chunk_plan(jnp.int32(640), jnp.int32(1), q_len=1, kv_len=640, splits=splits,
                          block_k=bk, window=(-1, -1), causal=True, dynamic=True)
    assert [int(x) for x in a[1:3]] == [int(x) for x in b[1:3]]


def test_combine_adds_the_sink_once_across_splits():
  # Partials of two chunks, as the kernel writes them, merged with a sink,
  # against one softmax over every key and the sink.
  rng = np.random.default_rng(0)
  s = rng.normal(size=(5, 40)) * 3          # rows x keys (natural-log scores)
  v = rng.normal(size=(40, 8))
  sink = rng.normal(size=(5,))
  o, lse = [], []
  for part in (slice(0, 17), slice(17, 40)):
    e = np.exp(s[:, part])
    o.append(e @ v[part] / e.sum(1, keepdims=True))
    lse.append(np.log2(e.sum(1)))
  got = kernel.combine(jnp.asarray(np.stack(o), jnp.float32), jnp.asarray(np.stack(lse),
                       jnp.float32), jnp.float32, jnp.asarray(sink * np.log2(np.e), jnp.float32))
  e = np.exp(s)
  want = e @ v / (e.sum(1) + np.exp(sink))[:, None]
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-6)
  # One split with no key (lse -inf) and a sink: the row is 0.
  got = kernel.combine(jnp.zeros((1, 1, 8)), jnp.full((1, 1), -jnp.inf), jnp.float32,
                       jnp.zeros((1,)))
  assert float(jnp.abs(got).max()) == 0.0


def test_sink_rows_follow_the_kernels_row_order():
  sinks = jnp.arange(8, dtype=jnp.float32)  # 2 KV heads of 4 query heads
  rows = kernel.sink_rows(sinks, batch=2, kv_heads=2, rows_p=16)
  assert rows.shape == (4, 16)
  np.testing.assert_allclose(np.asarray(rows[1, :5]) / np.log2(np.e), [4, 5, 6, 7, 4])
  np.testing.assert_allclose(np.asarray(rows[2]), np.asarray(rows[0]))


def _lower(p: DecodeProblem, c, page: int = 0, persistent: bool = False):
  q = jax.ShapeDtypeStruct((p.batch, p.q_len, p.q_heads, p.head_dim), jnp.bfloat16)
  if page:
    max_pages = p.kv_len // page
    k = jax.ShapeDtypeStruct((p.batch * max_pages, page, p.kv_heads, p.head_dim),
                             jnp.bfloat16)
    bt = jax.ShapeDtypeStruct((p.batch, max_pages), jnp.int32)
  else:
    k = jax.ShapeDtypeStruct((p.batch, p.kv_len, p.kv_heads, p.head_dim), jnp.bfloat16)
    bt = None
  ln = jax.ShapeDtypeStruct((p.batch,), jnp.int32)
  sk = jax.ShapeDtypeStruct((p.q_heads,), jnp.float32) if p.sinks else None

  def f(q, k, v, ln, bt, sk):
    return kernel.decode_attention(q, k, v, config=c, causal=p.causal, kv_lengths=ln,
                                   block_tables=bt, local_window_size=bounded_window(p),
                                   logit_soft_cap=p.soft_cap or None, sinks=sk,
                                   persistent=persistent, num_sms=132 if persistent else None)
  return jax.jit(f).trace(q, k, k, ln, bt, sk).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("kw", [dict(window_left=1024, window_right=0),
                                dict(window_left=100, window_right=20, causal=False, q_len=4),
                                dict(soft_cap=50.0, head_dim=256),
                                dict(sinks=True), dict(window_left=511, sinks=True, soft_cap=30.0)])
@pytest.mark.parametrize("page", [0, 16])  # (pages of 256: one copy per block, as 0)
def test_mosaic_kernel_with_options_lowers_for_cuda(kw, page):
  kw = dict(kw)
  p = DecodeProblem(batch=4, q_heads=32, kv_heads=8, kv_len=4096, q_len=kw.pop("q_len", 1),
                    head_dim=kw.pop("head_dim", 128), **kw)
  backend = DECODE.backend("mosaic")
  c = backend.heuristic(p, H100)
  assert c is not None
  backend.validate(p, c, H100)
  # Contiguous: one split and the rule's; pages: the rule's (the split code
  # is the same for both layouts).
  for splits in sorted({1, c.num_splits} if not page else {c.num_splits}):
    bk = 64 if p.head_dim > 128 else 128
    _lower(p, kernel.MosaicDecodeConfig(block_k=bk, num_stages=2, num_splits=splits),
           page=page)


@pytest.mark.parametrize("kw,splits,page", [
    (dict(), 8, 0), (dict(batch=32), 1, 64), (dict(window_left=1024, window_right=0), 4, 16),
    (dict(q_len=16), 2, 0), (dict(window_left=511, sinks=True, soft_cap=30.0, batch=32), 1, 0),
    (dict(sinks=True, head_dim=256), 4, 0)])
def test_persistent_kernel_lowers_for_cuda(kw, splits, page):
  # One CTA per SM walking several work items (KV heads x splits x row
  # tiles > 132), the next item's queries double-buffered.
  kw = dict(kw)
  p = DecodeProblem(batch=kw.pop("batch", 8), q_heads=32, kv_heads=8, kv_len=4096,
                    q_len=kw.pop("q_len", 1), head_dim=kw.pop("head_dim", 128), **kw)
  bk = 64 if p.head_dim > 128 else 128
  c = kernel.MosaicDecodeConfig(block_k=bk, num_stages=2, num_splits=splits)
  assert p.batch * p.kv_heads * splits * (2 if p.q_len == 16 else 1) > 132
  _lower(p, c, page=page, persistent=True)


def test_persistent_grid_rule_takes_windows_of_at_most_half_the_cache():
  from wavetune_jax.families.decode.mosaic import persistent_grid
  c = kernel.MosaicDecodeConfig(block_k=64, num_stages=2, num_splits=1)
  p = DecodeProblem(batch=64, q_heads=32, kv_heads=8, kv_len=8192, window_left=127,
                    window_right=0)
  h200 = "nvidia_h200"
  assert persistent_grid(p, c, h200)
  assert not persistent_grid(p, c, "nvidia_h100_80gb_hbm3")  # not measured there
  assert not persistent_grid(dataclasses.replace(p, window_left=-1, window_right=-1), c, h200)
  assert not persistent_grid(dataclasses.replace(p, window_left=4096), c, h200)  # > half
  # The second query tile must fit: 3 stages of 256 keys at head_dim 64 fit
  # with one tile, not with two (Mosaic refused that config on an H200).
  small = dataclasses.replace(p, head_dim=64)
  c3 = kernel.MosaicDecodeConfig(block_k=256, num_stages=3, num_splits=1)
  one = kernel.smem_bytes(block_k=256, num_stages=3, head_dim=64, itemsize=2, split=False)
  two = kernel.smem_bytes(block_k=256, num_stages=3, head_dim=64, itemsize=2, split=False,
                          persistent=True)
  assert one <= kernel.SMEM_LIMIT < two and not persistent_grid(small, c3, h200)


def test_the_backend_runs_the_persistent_grid_where_the_rule_says(monkeypatch):
  from wavetune_jax.families.decode import mosaic as fam
  seen = []
  monkeypatch.setattr(fam.kernel, "decode_attention",
                      lambda *a, **kw: seen.append(kw["persistent"]) or a[0])
  monkeypatch.setattr(fam.hardware, "current", lambda: wt.get_hardware("h200"))
  q = jnp.zeros((2, 1, 8, 64), jnp.bfloat16)
  k = jnp.zeros((2, 256, 2, 64), jnp.bfloat16)
  n = jnp.array([256, 100], jnp.int32)
  for left, want in ((31, True), (-1, False)):
    p = DecodeProblem(batch=2, q_heads=8, kv_heads=2, kv_len=256, head_dim=64,
                      window_left=left, window_right=0 if left >= 0 else -1)
    MOSAIC.run(p, kernel.MosaicDecodeConfig(block_k=64), q, k, k, n)
    assert seen[-1] is want


def test_persistent_grid_numbers_in_the_docs_match_the_recorded_runs():
  # docs/results.md, "A persistent grid for windowed decode" (H200).
  import json
  import pathlib
  root = pathlib.Path(__file__).parent.parent
  docs = (root / "docs" / "results.md").read_text()
  run = json.loads((root / "data/probes/decode_options_persistent_h200.json").read_text())
  assert run["device_kind"] == "NVIDIA H200"
  speed = {}
  for r in run["rows"]:
    t = {lab: v["us"] for lab, v in r["times"].items()}
    assert all(v["status"] == "ok" for v in r["times"].values())
    speed[r["name"]] = t["mosaic_one_per_item"] / t["mosaic"]
  many = [v for name, v in speed.items() if name != "llama-like w1024"]
  assert len(many) == 5 and (f"{min(many):.2f}", f"{max(many):.2f}") == ("1.03", "1.30")
  assert f"**{speed['w128 b64']:.3f}x**" in docs and f"**{max(many):.3f}x**" in docs
  assert abs(speed["llama-like w1024"] - 1) < 0.01  # 128 items: the same kernel
  # Without a window (decode_mosaic.py --persistent): the best config per
  # row moved 0.90-1.02x, configs under spread lengths down to 0.89x.
  rows = json.loads((root / "data/probes/decode_mosaic_persistent_h200.json").read_text())
  best, spread = [], []
  for r in rows["rows"]:
    t = r["times"]
    pairs = {lab: t[lab] / t[lab + " p"] for lab in t
             if lab.startswith("mosaic") and " p" not in lab and lab + " p" in t}
    if r["problem"][2] >= 8 or r["problem"][3] >= 4096:
      one = min(v for lab, v in t.items() if lab.startswith("mosaic") and " p" not in lab)
      best.append(one / min(v for lab, v in t.items() if lab.endswith(" p")))
      if r["mix"] == "spread":
        spread += pairs.values()
  assert (f"{min(best):.2f}", f"{max(best):.2f}", f"{min(spread):.2f}") == ("0.90", "1.02", "0.89")
  assert "0.90-1.02x" in docs and "0.89x" in docs


def test_persistent_kernel_refuses_a_config_whose_second_query_tile_does_not_fit():
  p = DecodeProblem(batch=32, q_heads=32, kv_heads=8, kv_len=4096, head_dim=64,
                    window_left=511, window_right=0)
  c = kernel.MosaicDecodeConfig(block_k=256, num_stages=3, num_splits=1)
  _lower(p, c)  # one CTA per item: one query tile fits
  with pytest.raises(ValueError, match="persistent grid's two query tiles need 232960 bytes"):
    _lower(p, c, persistent=True)


def test_persistent_kernel_checks_num_sms():
  q = jnp.zeros((1, 1, 8, 64), jnp.bfloat16)
  k = jnp.zeros((1, 64, 8, 64), jnp.bfloat16)
  for bad in (0, -2, 1.5, True, "132"):
    with pytest.raises(ValueError, match="num_sms must be a positive int"):
      kernel.decode_attention(q, k, k, config=kernel.MosaicDecodeConfig(), persistent=True,
                              num_sms=bad)


def _problem(**kw):
  return DecodeProblem(batch=8, q_heads=32, kv_heads=8, kv_len=32768, **kw)


@pytest.mark.parametrize("kw,backend", [
    (dict(window_left=4095, window_right=0), "MosaicDecodeConfig"),
    (dict(soft_cap=50.0), "MosaicDecodeConfig"),
    (dict(sinks=True, window_left=127), "MosaicDecodeConfig"),
    (dict(sinks=True, page_size=64), "MosaicDecodeConfig"),
    (dict(soft_cap=50.0, head_dim=40), "XlaDecodeConfig"),
    (dict(), "CudnnDecodeConfig")])
def test_selector_offers_only_backends_that_run_the_options(kw, backend):
  # The Mosaic kernel where it runs the problem (guarded by the family's
  # measured rule: no table holds such problems), else XLA; cuDNN and the
  # Triton kernel run none of the options.
  kw = dict(kw)
  p = DecodeProblem(batch=1, q_heads=32, kv_heads=8, kv_len=32768,
                    head_dim=kw.pop("head_dim", 128), **kw)
  for policy in ("tables", "heuristic"):
    with wt.policy(policy):
      assert type(wt.select("decode", p, "h100").config).__name__ == backend
  if kw:
    assert not DECODE.backend("triton").space(p, H100)
    assert not DECODE.backend("cudnn").space(p, H100)
    # A window is modelled (its (G, L) counts the window's blocks); soft caps
    # and sinks are not (no sweep measures them).
    assert DECODE.modelled(p) == (not (p.soft_cap or p.sinks))


def test_mosaic_coords_count_the_windows_keys():
  mosaic = DECODE.backend("mosaic")
  cfg = kernel.MosaicDecodeConfig(block_k=64, num_stages=2, num_splits=4)
  g, l = mosaic.coords(_problem(), {"block_k": 64, "num_splits": 4})
  gw, lw = mosaic.coords(_problem(window_left=1023), {"block_k": 64, "num_splits": 4})
  assert g == gw == 8 * 8 * 4
  assert l == 32768 // 4 // 64
  # 1,024 keys of the window and up to one block before it, in 4 chunks.
  assert lw == 5
  # XLA's attention masks the whole cache: its L does not follow the window.
  xla = DECODE.backend("xla")
  assert xla.coords(_problem(window_left=1023), {}) == xla.coords(_problem(), {})
  assert mosaic.validate(_problem(window_left=1023), cfg, H100) is None


def test_splits_follow_the_window_not_the_cache():
  plain = DECODE.backend("mosaic").heuristic(_problem(), H100)
  local = DECODE.backend("mosaic").heuristic(_problem(window_left=511), H100)
  assert local.num_splits < plain.num_splits


def test_pinned_configs_that_cannot_run_the_options_are_clear_errors():
  q, k, v = _qkv()
  with pytest.raises(ValueError, match="no sliding window, logit soft-capping or sinks"):
    wt.decode_attention(q, k, v, logit_soft_cap=3.0, config={"backend": "triton"})
  with pytest.raises(ValueError, match="aligns a sliding window at the first key"):
    wt.decode_attention(q, k, v, local_window_size=8, config={"backend": "cudnn"})


def test_problem_key_fields_and_span():
  plain = _problem()
  assert DECODE.problem_key(plain) == "b8:h32/8:q1:kv32768:d128:causal:bfloat16:lengths"
  assert "window_left" not in DECODE.problem_to_dict(plain)  # files on record unchanged
  p = _problem(window_left=4095, window_right=0, soft_cap=50.0, sinks=True, page_size=64)
  assert DECODE.problem_key(p).endswith(":page64:w4095,0:cap50:sinks")
  assert DECODE.problem_from_dict(DECODE.problem_to_dict(p)) == p
  assert p.span == 4096 and plain.span == 32768
  assert _problem(window_left=100000).span == 32768
  for bad in (dict(window_left=-2), dict(soft_cap=-1.0), dict(sinks=1)):
    with pytest.raises(ValueError, match="DecodeProblem"):
      _problem(**bad)


def test_the_call_binds_the_options_and_the_sinks_last():
  q, k, v = _qkv()
  call = DECODE.bind(q, k, v, kv_lengths=jnp.array([5, 6, 7]), local_window_size=(8, 0),
                     logit_soft_cap=2.0, sinks=SINKS)
  assert call.problem.window == (8, 0) and call.problem.soft_cap == 2.0 and call.problem.sinks
  assert call.kw_arrays == ("kv_lengths", "sinks") and call.arrays[-1].dtype == jnp.float32
  rule = DECODE.partition_rule(call.problem)
  assert rule.rule.count(",") == 4


@pytest.mark.parametrize("kw,match", [
    (dict(local_window_size=-1), "local_window_size=-1 must be >= 0"),
    (dict(local_window_size=(1, 2, 3)), "must be an int"),
    (dict(logit_soft_cap=0.0), "logit_soft_cap=0.0 must be a finite"),
    (dict(logit_soft_cap="50"), "must be a finite"),
    (dict(sinks=jnp.zeros((3,))), r"sinks must have shape \[q_heads\] = \(8,\)"),
    (dict(sinks=jnp.zeros((8,), bool)), "sinks must be real numbers"),
])
def test_bad_options_are_one_line_errors(kw, match):
  q, k, v = _qkv()
  with pytest.raises(ValueError, match=match) as e:
    wt.decode_attention(q, k, v, **kw)
  assert "\n" not in str(e.value)


def test_fixed_policy_and_the_reference_take_one_sided_windows():
  # The fixed policy's Triton default runs no option: XLA's attention then;
  # a problem's unbounded side (-1) reaches the reference as the cache.
  q, k, v = _qkv()
  with wt.policy("fixed"):
    got = wt.decode_attention(q, k, v, local_window_size=(7, 0), logit_soft_cap=4.0)
    att = wt.attention(q[:, :1], k[:, :8], v[:, :8], local_window_size=3)
  assert got.shape == q.shape and att.shape == (3, 1, 8, 32)
  p = DecodeProblem(batch=2, q_heads=8, kv_heads=2, kv_len=64, head_dim=32, q_len=2,
                    window_left=7)
  arrays = DECODE.inputs(p, jax.random.PRNGKey(0))
  ref = DECODE.reference(p, *arrays)
  _close(DECODE.backend("xla").run(p, wt.XlaDecodeConfig(), *arrays), ref)
  ap = wt.AttentionProblem(batch=1, q_heads=4, kv_heads=2, q_len=32, head_dim=32,
                           window_left=5)
  assert wt.ATTENTION.reference(ap, *wt.ATTENTION.inputs(ap, jax.random.PRNGKey(0))).shape == (
      1, 32, 4, 32)


def test_suite_windows_and_the_fit_leaves_soft_caps_and_sinks_out():
  import argparse

  from wavetune_jax.cli import sweep
  from wavetune_jax.tuning.tuner import fit_entries
  ns = argparse.Namespace(shapes="train", weights=None, m=[4096, 8192], m_range=None,
                          dtype="bfloat16", windows=True, problems_of=None)
  probs = sweep.problems(DECODE, ns)
  local = [p for p in probs if p.windowed]
  assert {p.window_left + 1 for p in local} == {128, 512, 1024, 4096}
  assert all(p.window_right == 0 and p.window_left < p.kv_len for p in local)
  assert len(probs) - len(local) == len([p for p in probs if p.plain])
  with pytest.raises(ValueError, match="no sliding windows"):
    sweep.problems(wt.MATMUL, ns)
  # Windowed problems fit wave models (their (G, L) counts the window's
  # keys); soft-capped ones and those with sinks do not.
  c = kernel.MosaicDecodeConfig(block_k=64, num_stages=2, num_splits=1)
  for kw, fits in ((dict(window_left=511), True), (dict(soft_cap=30.0), False),
                   (dict(sinks=True), False), ({}, True)):
    pts = [(DecodeProblem(batch=b, q_heads=32, kv_heads=8, kv_len=4096, **kw), c, 10.0 + b)
           for b in (1, 2, 4, 8)]
    assert bool(fit_entries(DECODE, H100, pts)) == fits, kw


def test_without_the_triton_kernel_plain_decode_keeps_cudnn(monkeypatch):
  # With no Triton lowering the Mosaic rule's config would be next in line:
  # on the sweeps' plain problems it ran at 0.454-1x of the oracle, cuDNN at
  # 0.938 of it; cuDNN comes first. Windows still go to the Mosaic kernel.
  from wavetune_jax.families.decode.triton import TritonDecode
  plain, local = _problem(), _problem(window_left=1023)
  assert type(DECODE.heuristic(plain, H100)).__name__ == "TritonDecodeConfig"
  monkeypatch.setattr(TritonDecode, "runs_on", lambda self, hw: False)
  assert type(DECODE.heuristic(plain, H100)).__name__ == "CudnnDecodeConfig"
  assert type(DECODE.heuristic(local, H100)).__name__ == "MosaicDecodeConfig"
  many = DecodeProblem(batch=16, q_heads=32, kv_heads=8, kv_len=4096)  # (not "few" pairs)
  assert type(DECODE.heuristic(many, H100)).__name__ == "CudnnDecodeConfig"


def test_the_models_offer_no_triton_config_for_a_window():
  # Windowed decode is modelled; the Triton kernel runs no window, so its
  # configs are no candidates there (not in the space, not in the arrays).
  import numpy as np
  triton = DECODE.backend("triton")
  local = _problem(window_left=1023)
  assert not triton.space(local, H100) and triton.size_quantum(local) is None
  configs, valid, *_ = DECODE.decision_arrays(local, np.array([8192, 32768]), H100)
  names = {DECODE.backend_of(c).name for c, ok in zip(configs, valid.any(axis=0)) if ok}
  assert names and "triton" not in names
  assert "triton" in {DECODE.backend_of(c).name
                      for c in DECODE.decision_arrays(_problem(), np.array([8192]), H100)[0]}


def test_window_lines_of_table_vs_sweep_reproduce_the_docs(capsys):
  """docs/results.md's window rows (H100 decode: share of the oracle and HBM
  share per window) and the replay without Triton come from
  ``table_vs_sweep.py`` on the sweep and table on record; the backend it
  passes over runs again afterwards."""
  import importlib.util
  import os
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  spec = importlib.util.spec_from_file_location(
      "table_vs_sweep", os.path.join(root, "benchmarks", "table_vs_sweep.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  gpu = "nvidia_h100_80gb_hbm3"
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    mod.main([os.path.join(root, "data", "sweeps", gpu, "decode_bfloat16.jsonl.gz"),
              os.path.join(root, "tables", gpu, "decode.json"), "--guarded", "--without",
              "triton", "--per-backend"])
  out = capsys.readouterr().out
  assert "window 1024: 0.987 (0.967)" in out and "window 512: 0.971 (0.886)" in out
  assert ">= 64 MB: 72% (84%), 14 problems" in out
  assert "problems without options (no window, soft cap or sinks): 0.994, min 0.920" in out
  assert "speed vs cuDNN 4.420x (min 1.000x)" in out
  assert ("cudnn 0.938 (0.739) / -, 9; mosaic 0.883 (0.642) / 0.820 (0.454), 0; "
          "triton 0.997 (0.924)") in out
  assert DECODE.backend("triton").runs_on(H100)


def test_benchmark_refuses_unknown_problem_names(capsys):
  import os
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  sys.path.insert(0, os.path.join(root, "benchmarks"))
  import decode_options
  with pytest.raises(SystemExit):
    decode_options.main(["--only", "w128 b64", "no such problem", "--one-per-item"])
  err = capsys.readouterr().err
  assert "--only: unknown problems ['no such problem']" in err and "w128 b64" in err


def test_sides_that_bound_nothing_are_dropped_under_a_causal_mask():
  """A causal mask hides every key right of the query, so any right side
  bounds nothing: ``(w, w)`` keys as ``(w, 0)``, and a left side that
  reaches past the cache (Mistral's 4,095 on a shorter cache) leaves a
  plain problem, which every backend runs; without the mask the right side
  stays. The output is the same."""
  import wavetune_jax as wt
  from pallas_kernels.attention.common import bound_sides
  assert bound_sides((4095, 0), 1, 1000, True) == (-1, -1)
  assert bound_sides((512, 512), 1, 8192, True) == (512, 0)
  assert bound_sides((512, 512), 1, 8192, False) == (512, 512)
  assert bound_sides(None, 1, 8192, True) == (-1, -1)
  # Under the mask a left side of max(q_len, kv_len) - 1 sees back to key 0.
  assert [bound_sides((4095, 0), 1, kv, True) for kv in (4095, 4096, 4097)] == \
      [(-1, -1), (-1, -1), (4095, 0)]
  assert bound_sides((49, 0), 50, 30, True) == (-1, -1)
  assert bound_sides((48, 0), 50, 30, True) == (48, 0)
  assert bound_sides((4095, 0), 1, 4096, False) == (4095, 0)
  dec, att = wt.get_family("decode"), wt.get_family("attention")
  key = jax.random.PRNGKey(0)
  q = jax.random.normal(key, (2, 1, 4, 64), jnp.bfloat16)
  k = jax.random.normal(jax.random.fold_in(key, 1), (2, 96, 2, 64), jnp.bfloat16)
  v = jax.random.normal(jax.random.fold_in(key, 2), (2, 96, 2, 64), jnp.bfloat16)
  lens = jnp.array([50, 96], jnp.int32)
  plain = dec.problem_key(dec.bind(q, k, v, kv_lengths=lens).problem)
  assert dec.problem_key(dec.bind(q, k, v, kv_lengths=lens,
                                  local_window_size=(4095, 0)).problem) == plain
  both = dec.bind(q, k, v, kv_lengths=lens, local_window_size=16).problem
  assert (both.window_left, both.window_right) == (16, 0)
  qa = jax.random.normal(key, (1, 40, 4, 64), jnp.bfloat16)
  ka, va = k[:1, :40], v[:1, :40]
  p = att.bind(qa, ka, va, causal=True, local_window_size=8).problem
  assert (p.window_left, p.window_right) == (8, 0)
  p = att.bind(qa, ka, va, causal=False, local_window_size=8).problem
  assert (p.window_left, p.window_right) == (8, 8)
  # The result: the float32 reference of the window given whole, and of no
  # window where the left side reaches past the cache.
  for window, ref_window in ((16, 16), ((4095, 0), None), ((95, 3), (95, 3)), ((94, 0), (94, 0))):
    out = wt.decode_attention(q, k, v, kv_lengths=lens, local_window_size=window)
    ref = attention_reference(q, k, v, kv_lengths=lens, causal=True, causal_align="bottom_right",
                              local_window_size=ref_window)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                               atol=2e-2)
  for align in ("top_left", "bottom_right"):
    for w in (8, (39, 5), (38, 0)):
      out = wt.attention(qa, ka, va, causal=True, local_window_size=w, causal_align=align)
      ref = attention_reference(qa, ka, va, causal=True, local_window_size=w, causal_align=align)
      np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref, np.float32),
                                 atol=2e-2)
  # Family.canonical keys a problem as the op does.
  from wavetune_jax import DecodeProblem
  windowed = DecodeProblem(batch=2, q_heads=32, kv_heads=8, kv_len=1000, q_len=1,
                           lengths=True, window_left=4095, window_right=0)
  assert dec.canonical(windowed) == dataclasses.replace(windowed, window_left=-1,
                                                        window_right=-1)
  plain_problem = dec.canonical(windowed)
  assert dec.canonical(plain_problem) is plain_problem
