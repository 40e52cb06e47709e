"""The decode family on a paged KV cache.

Every backend that runs on a CPU (XLA on the gathered pages, the Triton
kernel in interpret mode) against the float32 reference of the contiguous
cache, with the pages shuffled in a pool that holds pages no sequence uses:
page sizes 16 and 64, GQA and MHA, one and three (causal) queries, lengths
0, 1, a partial page and full. NaN in K (Inf in V) past each length, in the
pages no sequence uses, and -1 in the table entries past each length must
not reach the output. Concrete bad tables raise one-line errors; traced ones
are clipped. The problem's key, dict round trip, space rules, the length
mixes of ``inputs`` and the sweep's ``--lengths`` are checked too.
"""

import argparse
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wavetune_jax as wt
from pallas_kernels.attention.reference import attention_reference
from pallas_kernels.decode import paging
from pallas_kernels.decode.triton import TritonDecodeConfig, decode_attention
from wavetune_jax import DECODE, DecodeProblem, get_hardware
from wavetune_jax.families.decode import library
from wavetune_jax.families.decode.triton import block_ks

H100 = get_hardware("h100")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import decode_paged  # noqa: E402
SPARE = 3  # pages of the pool no sequence uses (all NaN)


def paged_cache(b, t, hq, hkv, page, max_pages, lens, d=64, seed=0):
  """``(q, k, v, k_pages, v_pages, table, lengths)``: a contiguous cache with
  NaN in K and Inf in V past each length, and the same cache in shuffled
  pages of a pool with SPARE NaN pages; table entries past a sequence's
  last page hold -1 (benchmarks/decode_paged.py builds the GPU's alike)."""
  return decode_paged.paged_cache(b, hq, hkv, d, page, max_pages, lens, SPARE, seed=seed, t=t)


def reference(q, k, v, lengths, causal=True):
  return np.asarray(attention_reference(q, k, v, causal=causal, kv_lengths=lengths,
                                        causal_align="bottom_right", out_dtype=jnp.float32))


CASES = [
    # (b, q_len, q_heads, kv_heads, page, max_pages, lengths, causal)
    (4, 1, 8, 2, 16, 4, (0, 1, 21, 64), True),      # GQA, one query
    (4, 3, 4, 4, 16, 4, (0, 1, 37, 64), True),      # MHA, three causal queries
    (4, 3, 8, 2, 64, 2, (0, 1, 70, 128), True),     # GQA, three causal queries
    (2, 2, 8, 2, 16, 3, (5, 48), False),            # every valid key
]


def _configs(page):
  """XLA and Triton configs that run pages of ``page`` rows: 16-key blocks
  in one chunk, and page-sized blocks in two chunks."""
  return [wt.XlaDecodeConfig(), TritonDecodeConfig(block_k=16, num_splits=1),
          TritonDecodeConfig(block_k=min(page, 64), num_splits=2)]


@pytest.mark.parametrize("case", CASES)
def test_every_cpu_backend_matches_the_contiguous_cache(case):
  b, t, hq, hkv, page, max_pages, lens, causal = case
  q, k, v, kp, vp, table, lengths = paged_cache(b, t, hq, hkv, page, max_pages, lens)
  ref = reference(q, k, v, lengths, causal)
  for cfg in _configs(page):
    y = np.asarray(wt.decode_attention(q, kp, vp, kv_lengths=lengths, block_tables=table,
                                       causal=causal, config=cfg), np.float32)
    assert np.all(np.isfinite(y)), cfg
    np.testing.assert_allclose(y, ref, atol=2e-2, rtol=2e-2, err_msg=str(cfg))
    if 0 in lens:
      assert np.all(y[lens.index(0)] == 0), cfg


def test_op_under_jit_with_traced_block_tables():
  q, k, v, kp, vp, table, lengths = paged_cache(4, 1, 8, 2, 16, 4, (3, 16, 40, 64), seed=1)
  ref = reference(q, k, v, lengths)
  for cfg in (None, wt.XlaDecodeConfig(), {"backend": "triton", "block_k": 16,
                                           "num_splits": 2}):
    f = jax.jit(lambda *a, cfg=cfg: wt.decode_attention(a[0], a[1], a[2], kv_lengths=a[3],
                                                        block_tables=a[4], config=cfg))
    y = np.asarray(f(q, kp, vp, lengths, table), np.float32)
    np.testing.assert_allclose(y, ref, atol=2e-2, rtol=2e-2, err_msg=str(cfg))


def test_no_lengths_means_every_sequence_full():
  q, k, v, kp, vp, table, _ = paged_cache(2, 1, 8, 2, 16, 2, (32, 32), seed=2)
  ref = reference(q, k, v, None)
  for cfg in (wt.XlaDecodeConfig(), TritonDecodeConfig(block_k=16)):
    y = wt.decode_attention(q, kp, vp, block_tables=table, config=cfg)
    np.testing.assert_allclose(np.asarray(y, np.float32), ref, atol=2e-2, rtol=2e-2)


def test_traced_bad_tables_and_lengths_are_clipped():
  """Under jit nothing can be checked: page ids are clipped to the pool and
  lengths to the table's cache length, on every backend alike."""
  q, _, _, kp, vp, table, _ = paged_cache(2, 1, 8, 2, 16, 2, (32, 32), seed=3)
  kp = jnp.nan_to_num(kp)
  vp = jnp.nan_to_num(vp, posinf=0.0)
  n = kp.shape[0]
  bad = table.at[0, 1].set(10**6).at[1, 0].set(-7)
  lengths = jnp.array([40, 2**30], jnp.int32)  # both past the 32 keys of the table
  clipped = jnp.clip(bad, 0, n - 1)
  ref = reference(q, paging.gather_pages(kp, clipped), paging.gather_pages(vp, clipped),
                  jnp.array([32, 32], jnp.int32))
  for cfg in (wt.XlaDecodeConfig(), TritonDecodeConfig(block_k=16, num_splits=2)):
    f = jax.jit(lambda *a, cfg=cfg: wt.decode_attention(*a[:3], kv_lengths=a[3],
                                                        block_tables=a[4], config=cfg))
    y = np.asarray(f(q, kp, vp, lengths, bad), np.float32)
    np.testing.assert_allclose(y, ref, atol=2e-2, rtol=2e-2, err_msg=str(cfg))


def test_entries_past_a_length_are_never_checked_nor_read():
  q, k, v, kp, vp, table, lengths = paged_cache(2, 1, 8, 2, 16, 4, (17, 0), seed=4)
  # Sequence 0 uses two entries, sequence 1 none: the rest may hold anything.
  table = table.at[0, 2].set(10**6).at[0, 3].set(-5).at[1].set(-1)
  ref = reference(q, k, v, lengths)
  for cfg in _configs(16):
    y = np.asarray(wt.decode_attention(q, kp, vp, kv_lengths=lengths, block_tables=table,
                                       config=cfg), np.float32)
    np.testing.assert_allclose(y, ref, atol=2e-2, rtol=2e-2, err_msg=str(cfg))


@pytest.mark.parametrize("edit,match", [
    (lambda t, l: (t.at[1, 0].set(19), l), r"block_tables\[1, 0\]=19 is not a page of the pool "
                                          r"\[0, 19\)"),
    (lambda t, l: (t.at[2, 1].set(-1), l), r"block_tables\[2, 1\]=-1"),
    (lambda t, l: (t, l.at[2].set(65)), r"kv_lengths\[2\]=65 passes the block table's "
                                        r"max_pages \* page_size = 4 \* 16 = 64"),
    (lambda t, l: (t, None), r"block_tables\[0, 0\]=-1"),  # None: every sequence full
    (lambda t, l: (t[:, :, None], l), r"\[batch, max_pages\]"),
    (lambda t, l: (t[:3], l), r"\[batch, max_pages\] with batch=4"),
    (lambda t, l: (t.astype(jnp.float32), l), "block_tables must be integers"),
])
def test_static_bad_tables_raise_one_line(edit, match):
  q, _, _, kp, vp, table, lengths = paged_cache(4, 1, 8, 2, 16, 4, (0, 1, 21, 64))
  table, lengths = edit(table, lengths)
  for cfg in (wt.XlaDecodeConfig(), TritonDecodeConfig(block_k=16)):
    with pytest.raises(ValueError, match=match) as e:
      wt.decode_attention(q, kp, vp, kv_lengths=lengths, block_tables=table, config=cfg)
    assert "\n" not in str(e.value)
  # The kernel's own entry point checks the same.
  with pytest.raises(ValueError, match=match):
    decode_attention(q, kp, vp, config=TritonDecodeConfig(block_k=16), kv_lengths=lengths,
                     block_tables=table, interpret=True)


@pytest.mark.parametrize("call,match", [
    (lambda q, kp, t: wt.decode_attention(q, kp[0], kp[0], block_tables=t), "rank 4"),
    (lambda q, kp, t: wt.decode_attention(q, kp, kp[:, :8], block_tables=t), "same shape"),
    (lambda q, kp, t: wt.decode_attention(q, kp[:0], kp[:0], block_tables=t), "at least one"),
    (lambda q, kp, t: wt.decode_attention(q, kp, kp[..., :32], block_tables=t), "same shape"),
    (lambda q, kp, t: wt.decode_attention(q, kp, kp, block_tables=t[:, :0]), "kv_len is 0"),
    (lambda q, kp, t: wt.decode_attention(q, kp, kp, block_tables=t, config={
        "backend": "triton", "block_k": 32}), "block_k=32 must divide page_size=16"),
    (lambda q, kp, t: decode_attention(q, kp, kp, config=TritonDecodeConfig(block_k=32),
                                       block_tables=t, interpret=True),
     "block_k=32 must divide page_size=16"),
])
def test_bad_pages_one_line_error(call, match):
  q, _, _, kp, _, table, _ = paged_cache(4, 1, 8, 2, 16, 4, (64, 64, 64, 64))
  with pytest.raises(ValueError, match=match):
    call(q, kp, table)


def test_wide_page_ids_clip_before_the_cast():
  """An int64 id past int32 is clipped to the last page, not wrapped to 0."""
  t = np.array([[2**32 + 1, 0]], np.int64)
  assert np.asarray(paging.table_int32(t, 5)).tolist() == [[4, 0]]
  assert np.asarray(paging.table_int32(np.array([[7, -1]], np.int32), 5)).tolist() == [[7, -1]]


# --- the problem -----------------------------------------------------------------------


def test_problem_key_dict_round_trip_and_checks():
  p = DecodeProblem(batch=4, q_heads=32, kv_heads=8, kv_len=1024, page_size=16)
  assert DECODE.problem_key(p) == "b4:h32/8:q1:kv1024:d128:causal:bfloat16:lengths:page16"
  d = DECODE.problem_to_dict(p)
  assert d["page_size"] == 16 and DECODE.problem_from_dict(d) == p
  c = DecodeProblem(batch=4, q_heads=32, kv_heads=8, kv_len=1024)
  # A contiguous problem's dict and key are as before pages (shipped tables).
  assert "page_size" not in DECODE.problem_to_dict(c)
  assert DECODE.problem_key(c) == "b4:h32/8:q1:kv1024:d128:causal:bfloat16:lengths"
  assert DECODE.problem_from_dict(DECODE.problem_to_dict(c)) == c
  assert DECODE.problem_from_dict({**DECODE.problem_to_dict(c), "page_size": 0}) == c
  assert c != p and p.max_pages == 64 and c.max_pages == 0
  # The guard's evidence of a paged problem is its own class.
  assert ("page_size", 16) in DECODE.evidence_features(p)[0]
  assert DECODE.evidence_features(c)[0] != DECODE.evidence_features(p)[0]
  # Sizes of a paged problem are whole pages.
  assert DECODE.size_quantum(p) == 16
  for bad, match in ((dict(page_size=-1), "page_size=-1 must be an int >= 0"),
                     (dict(page_size=True), "page_size=True"),
                     (dict(page_size=48), "multiple of page_size=48"),
                     (dict(page_size=16, lengths=False), "lengths=True")):
    with pytest.raises(ValueError, match=match):
      DecodeProblem(batch=4, q_heads=32, kv_heads=8, kv_len=1024, **bad)


def test_the_call_binds_a_paged_problem():
  q, _, _, kp, vp, table, lengths = paged_cache(4, 3, 8, 2, 16, 4, (0, 1, 21, 64))
  call = DECODE.bind(q, kp, vp, kv_lengths=lengths, block_tables=table)
  assert call.problem == DecodeProblem(batch=4, q_heads=8, kv_heads=2, kv_len=64, q_len=3,
                                       head_dim=64, page_size=16)
  assert call.kw_arrays == ("kv_lengths", "block_tables") and len(call.arrays) == 5
  assert call.arrays[4].dtype == jnp.int32
  # Without lengths: the call passes full ones.
  call = DECODE.bind(q, kp, vp, block_tables=jnp.abs(table))
  assert np.asarray(call.arrays[3]).tolist() == [64] * 4 and call.problem.lengths


def test_inputs_length_mixes_and_pages():
  p = DecodeProblem(batch=4, q_heads=8, kv_heads=2, kv_len=256, q_len=2, head_dim=64)
  key = jax.random.PRNGKey(0)
  spread = np.asarray(DECODE.inputs(p, key)[3])
  even = [2 + (254 * (2 * i + 1)) // 8 for i in range(4)]  # evenly over [q_len, kv_len]
  assert sorted(spread.tolist()) == even and len(set(even)) == 4
  full = DECODE.with_lengths("full")
  assert full.length_mix == "full" and DECODE.length_mix == "spread"  # a copy
  assert np.asarray(full.inputs(p, key)[3]).tolist() == [256] * 4
  with pytest.raises(ValueError, match="length mix 'some' must be one of"):
    DECODE.with_lengths("some")
  # A paged problem: a pool of batch * max_pages pages, tables a permutation of it.
  pp = DecodeProblem(batch=4, q_heads=8, kv_heads=2, kv_len=256, q_len=2, head_dim=64,
                     page_size=64)
  q, kp, vp, lens, table = full.inputs(pp, key)
  assert kp.shape == vp.shape == (16, 64, 2, 64) and table.shape == (4, 4)
  assert sorted(np.asarray(table).ravel().tolist()) == list(range(16))
  assert not np.array_equal(np.asarray(table).ravel(), np.arange(16))  # shuffled
  assert np.asarray(lens).tolist() == [256] * 4
  # The reference reads the pages in the table's order.
  ref = DECODE.reference(pp, q, kp, vp, lens, table)
  want = reference(q, paging.gather_pages(kp, table), paging.gather_pages(vp, table), lens)
  np.testing.assert_allclose(np.asarray(ref), want, atol=1e-5)


@pytest.mark.parametrize("cfg", [wt.XlaDecodeConfig(),
                                 TritonDecodeConfig(block_k=64, num_splits=2)])
def test_measured_path_on_paged_inputs(cfg):
  """What sweeps and refinement run: ``build`` on ``inputs``, against
  ``reference`` (and XLA's second baseline)."""
  p = DecodeProblem(batch=2, q_heads=8, kv_heads=2, kv_len=128, q_len=1, head_dim=64,
                    page_size=64)
  args = DECODE.inputs(p, jax.random.PRNGKey(1))
  ref = np.asarray(DECODE.reference(p, *args))
  y = DECODE.build(p, cfg, interpret=True)(*args)
  np.testing.assert_allclose(np.asarray(y, np.float32), ref, atol=2e-2, rtol=2e-2)
  xla = DECODE.extra_baselines(p)["xla"](*args)
  np.testing.assert_allclose(np.asarray(xla, np.float32), ref, atol=2e-2, rtol=2e-2)


# --- backends' spaces ------------------------------------------------------------------


@pytest.mark.parametrize("page", [16, 32, 48, 64, 256])
def test_triton_blocks_fit_the_pages(page):
  p = DecodeProblem(batch=8, q_heads=32, kv_heads=8, kv_len=page * 32, page_size=page)
  tri = DECODE.backend("triton")
  for prune in (True, False):
    space = tri.space(p, H100, prune=prune)
    assert space and all(page % c.block_k == 0 for c in space)
    # (Other rules may drop some: 256-key blocks by registers and shared memory.)
    assert {c.block_k for c in space} <= set(block_ks(page, prune))
  assert block_ks(16, True) == (16,) and block_ks(48, True) == (16,)
  assert block_ks(256, True) == (64, 128, 256)
  h = tri.heuristic(p, H100)
  assert h in tri.space(p, H100)
  for c in (h, DECODE.default(p), DECODE.heuristic(p, H100)):
    DECODE.validate(p, c, H100)
  # The table's decision arrays hold the same candidates as the space.
  configs, valid, *_ = DECODE.decision_arrays(p, [p.kv_len], H100)
  assert ({c for c, ok in zip(configs, valid[0]) if ok}
          == set(DECODE.space(p, H100)))
  with pytest.raises(ValueError, match="must divide page_size"):
    DECODE.validate(p, TritonDecodeConfig(block_k=512), H100)


def test_pages_the_triton_kernel_cannot_tile():
  p = DecodeProblem(batch=8, q_heads=32, kv_heads=8, kv_len=8 * 64, page_size=8)
  assert not DECODE.backend("triton").space(p, H100, prune=False)
  assert DECODE.backend("triton").size_quantum(p) is None
  assert DECODE.default(p) == wt.XlaDecodeConfig()
  assert not isinstance(DECODE.heuristic(p, H100), TritonDecodeConfig)
  assert DECODE.size_quantum(p) == 8


def test_cudnn_paged_space_and_missing_import(monkeypatch):
  p = DecodeProblem(batch=8, q_heads=32, kv_heads=8, kv_len=4096, page_size=64)
  assert wt.CudnnDecodeConfig() in DECODE.space(p, H100)
  assert DECODE.platform_config(p, H100) == wt.CudnnDecodeConfig()
  several = DecodeProblem(batch=8, q_heads=32, kv_heads=8, q_len=2, kv_len=4096, page_size=64)
  assert wt.CudnnDecodeConfig() not in DECODE.space(several, H100)
  monkeypatch.setattr(library, "_CUDNN_PAGED_MISSING", "ImportError: gone")
  assert wt.CudnnDecodeConfig() not in DECODE.space(p, H100)
  with pytest.raises(ValueError, match="no cuDNN paged attention"):
    DECODE.validate(p, wt.CudnnDecodeConfig(), H100)
  contiguous = DecodeProblem(batch=8, q_heads=32, kv_heads=8, kv_len=4096)
  assert wt.CudnnDecodeConfig() in DECODE.space(contiguous, H100)


def test_partition_rule_of_pages():
  p = DecodeProblem(batch=8, q_heads=32, kv_heads=8, kv_len=4096, page_size=64)
  rule = DECODE.partition_rule(p)
  assert rule.operand_factors() == [["b", "q", "g", "d"], ["n", "p", "g", "d"],
                                    ["n", "p", "g", "d"], ["b"], ["b", "m"],
                                    ["b", "q", "g", "d"]]
  assert "n" in rule.replicated and "b" not in rule.replicated and "g" not in rule.replicated


_SHARDED = textwrap.dedent("""
    import os
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_force_host_platform_device_count=4")
    os.environ["JAX_PLATFORMS"] = "cpu"
    import warnings; warnings.simplefilter("ignore")
    import sys; sys.path.insert(0, sys.argv[1])
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import NamedSharding, PartitionSpec as P
    import wavetune_jax as wt
    from test_decode_paged import paged_cache, reference
    mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
    put = lambda x, s: jax.device_put(x, NamedSharding(mesh, s))
    q, k, v, kp, vp, table, lengths = paged_cache(4, 1, 8, 4, 16, 4, (3, 16, 40, 64))
    ref = reference(q, k, v, lengths)
    f = jax.jit(lambda *a: wt.decode_attention(*a[:3], kv_lengths=a[3], block_tables=a[4],
                                               config=wt.XlaDecodeConfig()))
    y = f(put(q, P("a", None, "b")), put(kp, P(None, None, "b")), put(vp, P(None, None, "b")),
          put(lengths, P("a")), put(table, P("a")))
    err = np.abs(np.asarray(y, np.float32) - ref).max()
    print("sharding", y.sharding.spec, "err", err)
    assert err < 2e-2 and y.sharding.spec[0] == "a" and y.sharding.spec[2] == "b"
    print("OK")
""")


def test_sharded_jit_splits_batch_and_heads_of_pages():
  here = os.path.dirname(os.path.abspath(__file__))
  env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, "-c", _SHARDED, here], capture_output=True, text=True,
                       env=env, timeout=300)
  assert out.returncode == 0 and "OK" in out.stdout, out.stdout + out.stderr[-3000:]


# --- the sweep's --lengths -------------------------------------------------------------


def test_sweep_lengths_option():
  from wavetune_jax.cli import sweep as sweep_cli
  from wavetune_jax.cli.common import CliError
  fam = sweep_cli.with_family_options(DECODE, argparse.Namespace(lengths="full"))
  assert fam.length_mix == "full" and sweep_cli.family_options(fam) == {"lengths": "full"}
  assert sweep_cli.with_family_options(DECODE, argparse.Namespace(lengths=None)) is DECODE
  assert sweep_cli.family_options(wt.MATMUL) == {}
  with pytest.raises(CliError, match="--lengths: the matmul family has no such option"):
    sweep_cli.with_family_options(wt.MATMUL, argparse.Namespace(lengths="full"))
  # A file without the key was measured with the default mix.
  sweep_cli.check_resumed_options("f", {}, {"lengths": "spread"})
  with pytest.raises(ValueError, match="recorded with --lengths spread; this run has "
                                       "--lengths full"):
    sweep_cli.check_resumed_options("f", {}, {"lengths": "full"})
  sweep_cli.check_resumed_options("f", {"lengths": "full"}, {})  # matmul: no option
  from wavetune_jax.cli.main import main
  assert main(["sweep", "--family", "matmul", "--lengths", "full"]) == 2


def test_to_pages_is_the_inverse_of_gather_pages():
  cache = jax.random.normal(jax.random.PRNGKey(5), (3, 48, 2, 8))
  table = paging.shuffled_tables(jax.random.PRNGKey(6), 3, 3, num_pages=11)
  assert sorted(np.asarray(table).ravel().tolist()) == sorted(set(np.asarray(table).ravel()))
  pool = paging.to_pages(cache, table, 11, fill=jnp.nan)
  np.testing.assert_array_equal(np.asarray(paging.gather_pages(pool, table)), np.asarray(cache))
  assert int(jnp.isnan(pool).all(axis=(1, 2, 3)).sum()) == 11 - 9  # the unused pages
  with pytest.raises(ValueError, match="cannot hold"):
    paging.shuffled_tables(jax.random.PRNGKey(0), 3, 3, num_pages=8)


def test_paged_errors_name_what_the_caller_passed():
  kp = jnp.ones((4, 16, 2, 64), jnp.bfloat16)
  table = jnp.arange(4, dtype=jnp.int32).reshape(2, 2)
  with pytest.raises(ValueError, match=r"k_pages.shape=\(4, 16, 2, 64\)"):
    wt.decode_attention(jnp.ones((2, 2, 3, 64), jnp.bfloat16), kp, kp, block_tables=table)
  # Pages of 5 rows on a pinned Triton config: the page size is the limit,
  # not a block_k the caller never chose.
  kp = jnp.ones((12, 5, 2, 64), jnp.bfloat16)
  table = jnp.arange(12, dtype=jnp.int32).reshape(2, 6)
  with pytest.raises(ValueError, match="pages of a multiple of 16 rows"):
    wt.decode_attention(jnp.ones((2, 1, 4, 64), jnp.bfloat16), kp, kp, block_tables=table,
                        config={"backend": "triton"})
