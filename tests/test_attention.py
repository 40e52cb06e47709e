"""Flash attention: kernel in Pallas interpret mode against a float32 reference,
input validation, the spec's mapping, and the tuner on the recorded H200 sweep."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wavetune_jax as wt
from pallas_kernels.attention import (AttentionConfig, attention, attention_reference,
                                      kv_blocks, q_block_start)
from wavetune_jax import ATTENTION, AttentionProblem, evaluate, get_hardware, selector
from wavetune_jax.profiler import rel_error

H200 = get_hardware("h200")
H200_SWEEP = os.path.join(os.path.dirname(__file__), "..", "data", "sweeps", "nvidia_h200",
                          "attention_bfloat16.jsonl.gz")


def _qkv(b, sq, skv, hq, hkv, d, dtype=jnp.bfloat16, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(ks[0], (b, sq, hq, d), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (b, skv, hkv, d), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (b, skv, hkv, d), jnp.float32).astype(dtype)
  return q, k, v


def _check(q, k, v, config, causal, tol=1e-2, scale=None):
  out = attention(q, k, v, config=config, causal=causal, scale=scale, interpret=True)
  assert out.shape == q.shape and out.dtype == q.dtype
  # Interpret mode fills outputs with NaN first: unwritten rows show up here.
  assert not bool(jnp.isnan(out.astype(jnp.float32)).any()), "unwritten output rows"
  ref = attention_reference(q, k, v, causal=causal, scale=scale, out_dtype=jnp.float32)
  err = rel_error(out, ref)
  assert err < tol, f"relative error {err:.3g} >= {tol}"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("ratio", [1, 4, 8])
@pytest.mark.parametrize("length", [1, 7])
def test_short_lengths_gqa_head_dim_96(causal, ratio, length):
  q, k, v = _qkv(2, length, length, 2 * ratio, 2, 96)
  _check(q, k, v, AttentionConfig(block_q=16, block_k=16), causal)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("ratio", [1, 4, 8])
def test_length_1000(causal, ratio):
  # 1000 is not a multiple of any block: the last query block is shifted back
  # and the last KV block is masked.
  q, k, v = _qkv(1, 1000, 1000, ratio, 1, 96)
  _check(q, k, v, AttentionConfig(block_q=128, block_k=64), causal)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_head_dims_and_float16(d):
  q, k, v = _qkv(1, 100, 100, 4, 2, d, dtype=jnp.float16)
  _check(q, k, v, AttentionConfig(block_q=32, block_k=32), True)


@pytest.mark.parametrize("sq,skv", [(40, 100), (100, 40)])
def test_cross_lengths_and_scale(sq, skv):
  q, k, v = _qkv(1, sq, skv, 4, 1, 64)
  _check(q, k, v, AttentionConfig(block_q=16, block_k=32), True, scale=0.3)
  _check(q, k, v, AttentionConfig(block_q=32, block_k=16), False)


def test_reference_matches_jax_nn():
  q, k, v = _qkv(2, 37, 37, 8, 2, 64)
  ref = attention_reference(q, k, v, causal=True, out_dtype=jnp.float32, q_chunk=16)
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  nn = jax.nn.dot_product_attention(f32(q), f32(k), f32(v), is_causal=True)
  assert rel_error(ref, nn) < 1e-5


@pytest.mark.parametrize("q_len,kv_len,bq,bk", [
    (1, 1, 16, 16), (7, 7, 16, 32), (100, 100, 32, 16), (1000, 1000, 128, 64),
    (40, 100, 16, 32), (100, 40, 32, 16), (256, 256, 64, 64), (300, 300, 128, 32)])
def test_kv_block_split_matches_the_causal_mask(q_len, kv_len, bq, bk):
  """Blocks [0, full) are visible to every row of the query block, blocks
  past total to none, and every visible column is inside [0, total)."""
  n_q = -(-q_len // bq)
  for i in range(n_q):
    full, total = kv_blocks(i, q_len=q_len, kv_len=kv_len, block_q=bq, block_k=bk,
                            causal=True)
    start = int(q_block_start(i, q_len=q_len, block_q=bq))
    rows = np.arange(start, min(start + bq, q_len))
    assert rows.size and rows[-1] < q_len and start >= 0
    cols = np.arange(kv_len)
    vis = rows[:, None] >= cols[None, :]
    for j in range(-(-kv_len // bk)):
      blk = vis[:, j * bk:(j + 1) * bk]
      if j < full:
        assert blk.all() and blk.shape[1] == bk
      if j >= total:
        assert not blk.any()
  # Every row is covered by some query block.
  starts = [int(q_block_start(i, q_len=q_len, block_q=bq)) for i in range(n_q)]
  covered = set()
  for s in starts:
    covered.update(range(s, min(s + bq, q_len)))
  assert covered == set(range(q_len))


@pytest.mark.parametrize("bad,match", [
    (dict(q=(1, 8, 4, 64), k=(1, 8, 3, 64), v=(1, 8, 3, 64)), "divide"),
    (dict(q=(1, 8, 4, 64), k=(1, 8, 2, 64), v=(1, 8, 1, 64)), "same shape"),
    (dict(q=(8, 4, 64), k=(1, 8, 2, 64), v=(1, 8, 2, 64)), "rank 4"),
    (dict(q=(1, 8, 4, 64), k=(1, 8, 2, 32), v=(1, 8, 2, 32)), "head_dim"),
    (dict(q=(1, 8, 4, 64), k=(2, 8, 2, 64), v=(2, 8, 2, 64)), "batch"),
    (dict(q=(1, 8, 4, 512), k=(1, 8, 2, 512), v=(1, 8, 2, 512)), "head_dim"),
    (dict(q=(1, 8, 4, 64), k=(1, 0, 2, 64), v=(1, 0, 2, 64)), "kv_len is 0"),
])
def test_bad_input_is_a_clear_value_error(bad, match):
  q, k, v = (jnp.ones(bad[n], jnp.bfloat16) for n in ("q", "k", "v"))
  with pytest.raises(ValueError, match=match):
    wt.attention(q, k, v, config=AttentionConfig())


def test_bad_dtype_and_config():
  q = jnp.ones((1, 8, 4, 64), jnp.float32)
  with pytest.raises(ValueError, match="not supported"):
    wt.attention(q, q, q, config=AttentionConfig())
  q = q.astype(jnp.bfloat16)
  with pytest.raises(ValueError, match="share one dtype"):
    wt.attention(q, q.astype(jnp.float16), q, config=AttentionConfig())
  with pytest.raises(ValueError, match="power of two"):
    wt.attention(q, q, q, config={"block_q": 48})
  with pytest.raises(ValueError, match="unknown AttentionConfig"):
    wt.attention(q, q, q, config={"block_m": 64})


def test_op_selects_at_trace_time_and_matches_reference():
  q, k, v = _qkv(1, 50, 50, 4, 1, 64)
  with selector.use_config("attention", {"block_q": 32, "block_k": 32}):
    out = jax.jit(lambda q, k, v: wt.attention(q, k, v))(q, k, v)
  ref = attention_reference(q, k, v, causal=True, out_dtype=jnp.float32)
  assert rel_error(out, ref) < 1e-2


def test_spec_space_mapping_and_shipped_table():
  p = AttentionProblem(batch=2, q_heads=32, kv_heads=8, q_len=3000, head_dim=128)
  assert p.kv_len == 3000
  space = ATTENTION.space(p, H200)
  assert space and all(c.num_warps == 4 or c.block_q >= 128 for c in space)  # A3
  assert all(ATTENTION.smem_bytes(p, c) <= H200.smem_per_block for c in space)  # A2
  g, l = ATTENTION.coords(p, {"block_q": 128, "block_k": 64})
  assert g == 2 * 32 * 24
  # Causal: mean KV blocks over query blocks, about half of the full row.
  assert 0.45 * 47 < l < 0.6 * 47
  g2, l2 = ATTENTION.coords(AttentionProblem(batch=2, q_heads=32, kv_heads=8, q_len=3000,
                                             causal=False), {"block_q": 128, "block_k": 64})
  assert (g2, l2) == (g, 47.0)
  assert ATTENTION.with_size(p, 512).kv_len == 512
  with selector.policy("tables"):
    sel = selector.select(ATTENTION, p, H200)
  assert sel.source in ("exact", "model", "heuristic")
  assert sel.config in set(ATTENTION.space(p, H200)) | {ATTENTION.heuristic(p, H200)}


def test_replay_on_the_recorded_h200_attention_sweep():
  ds = evaluate.load_dataset(H200_SWEEP)
  assert len(ds.times) == 90
  res, facts = evaluate.evaluate(ds, ["wavetune", "default"], seed=0)
  wt_res, default_res = res
  assert wt_res.measurements <= facts["budget"]
  assert wt_res.misses == 0
  assert wt_res.geomean > default_res.geomean


def test_cli_select_attention(capsys):
  from wavetune_jax.cli import main as cli_main
  assert cli_main(["select", "attention", "--m", "3000", "--set", "batch=2",
                   "--set", "q_heads=32", "--set", "kv_heads=8", "--device", "h200"]) == 0
  text = capsys.readouterr().out
  assert "block_q" in text and "answered by" in text and "G=1536" in text
  with pytest.raises(SystemExit, match="not a attention problem"):
    cli_main(["select", "attention", "--m", "3000", "--device", "h200"])


# --- the Mosaic GPU backend (runs on Hopper only; here: configs, spaces, errors) ----------

H100_SWEEP = os.path.join(os.path.dirname(__file__), "..", "data", "sweeps",
                          "nvidia_h100_80gb_hbm3", "attention_bfloat16.jsonl.gz")
MOSAIC_128 = AttentionConfig(block_q=128, block_k=128, num_warps=12, num_stages=2, backend=1)


def test_mosaic_config_validation_and_dict_round_trip():
  assert AttentionConfig.from_dict(MOSAIC_128.to_dict()) == MOSAIC_128
  assert MOSAIC_128.to_dict()["backend"] == 1
  # Triton configs read and write as before the backend field existed.
  c = AttentionConfig(block_q=64, block_k=32)
  assert "backend" not in c.to_dict() and AttentionConfig.from_dict(c.to_dict()) == c
  for bad, match in [({"num_warps": 8}, "num_warps=12"), ({"block_q": 64}, "block_q=64"),
                     ({"block_k": 32}, "block_k=32"), ({"num_stages": 1}, "num_stages=1")]:
    with pytest.raises(ValueError, match=match):
      AttentionConfig(**{**MOSAIC_128.to_dict(), **bad})
  with pytest.raises(ValueError, match="backend=2"):
    AttentionConfig(backend=2)


@pytest.mark.parametrize("shape,causal,match", [
    ((1, 1001, 4, 128), True, "multiples of 8"),
    ((1, 256, 4, 96), True, "head_dim a multiple of 64"),
])
def test_mosaic_config_on_a_call_it_cannot_run_is_a_value_error(shape, causal, match):
  q = jnp.ones(shape, jnp.bfloat16)
  with pytest.raises(ValueError, match=match):
    attention(q, q, q, config=MOSAIC_128, causal=causal)


def test_mosaic_causal_needs_q_len_at_most_kv_len_and_a_hopper_gpu():
  q = jnp.ones((1, 256, 4, 128), jnp.bfloat16)
  k = jnp.ones((1, 128, 4, 128), jnp.bfloat16)
  with pytest.raises(ValueError, match="q_len <= kv_len"):
    attention(q, k, k, config=MOSAIC_128, causal=True)
  # Aligned, but this machine has no Hopper GPU: a clear error, not a crash.
  with pytest.raises(ValueError, match="compute capability 9.0"):
    attention(q, q, q, config=MOSAIC_128, causal=True)
  with pytest.raises(NotImplementedError, match="no CPU interpret mode"):
    attention(q, q, q, config=MOSAIC_128, causal=True, interpret=True)


def test_mosaic_space_rules():
  h100 = get_hardware("h100")
  a100 = get_hardware("a100")
  p = AttentionProblem(batch=1, q_heads=32, kv_heads=8, q_len=4096)
  mosaic = [c for c in ATTENTION.space(p, h100) if c.backend == 1]
  assert MOSAIC_128 in mosaic
  for c in mosaic:  # M1-M3
    assert ATTENTION.smem_bytes(p, c) <= h100.smem_per_block
    assert (c.block_q // 2) * (p.head_dim + c.block_k) // 128 <= 160
    ATTENTION.validate(p, c, h100)
  assert not [c for c in ATTENTION.space(p, a100) if c.backend == 1]  # Hopper only
  # Lengths that are not multiples of the blocks have the same Mosaic configs
  # (the kernel masks their ragged ends); lengths off a multiple of 8 have none.
  for q in (1000, 3000):
    assert [c for c in ATTENTION.space(ATTENTION.with_size(p, q), h100) if c.backend] == mosaic
  for q in (1001, 2044):
    assert not [c for c in ATTENTION.space(ATTENTION.with_size(p, q), h100) if c.backend]
  # No block beyond the next power of two of a short length (M1, as A1).
  short = [c for c in ATTENTION.space(ATTENTION.with_size(p, 72), h100) if c.backend]
  assert short and all(c.block_q == 128 and c.block_k <= 128 for c in short)
  assert not [c for c in ATTENTION.space(AttentionProblem(
      batch=1, q_heads=4, kv_heads=4, q_len=256, head_dim=96), h100) if c.backend]
  # Alignment tells apart neighbouring lengths, so each length is its own decision.
  assert ATTENTION.size_quantum(p) == 1
  assert ATTENTION.occupancy_bound(p, MOSAIC_128, h100) == 1
  with pytest.raises(ValueError, match="compute capability 9.0"):
    ATTENTION.validate(p, MOSAIC_128, a100)


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_mosaic_selected_only_where_it_runs_with_the_shipped_tables(gpu):
  """The shipped tables choose Mosaic configs (where the sweeps have them as
  the oracle) and never on a length the kernel cannot run."""
  hw = get_hardware(gpu)
  base = AttentionProblem(batch=4, q_heads=32, kv_heads=8, q_len=2048)
  with selector.policy("tables"):
    for q in (2048, 2047, 2049, 1000, 3000, 4096):
      p = ATTENTION.with_size(base, q)
      sel = selector.select(ATTENTION, p, hw)
      ATTENTION.validate(p, sel.config, hw)  # raises for a Mosaic config it cannot run
      if q % 8:
        assert sel.config.backend == 0
      else:
        assert sel.config.backend == 1
    p = AttentionProblem(batch=1, q_heads=8, kv_heads=1, q_len=256)  # 16 programs
    assert selector.select(ATTENTION, p, hw).config.backend == 0


def test_recorded_space_of_a_file_that_predates_mosaic(tmp_path):
  """A sweep file with Triton configs only (as recorded before the Mosaic
  backend) is complete without Mosaic configs, and policies evaluated on it
  choose among Triton configs. Both GPUs' sweeps hold both backends, and on
  both a Mosaic config is the oracle of most problems, ragged lengths included."""
  from wavetune_jax import sweep
  header, rows = sweep.read_sweep(H200_SWEEP)
  old = str(tmp_path / "attention_bfloat16.jsonl.gz")
  sweep.SweepFile(old, header).append(
      [r for r in rows if (r.get("config") or {}).get("backend", 0) == 0])
  ds = evaluate.load_dataset(old)
  assert len(ds.times) == 90
  p = next(iter(ds.times))
  assert all(c.backend == 0 for c in ds.spec.space(p, ds.hw))
  assert any(c.backend == 1 for c in ATTENTION.space(p, ds.hw))
  for path in (H100_SWEEP, H200_SWEEP):
    full = evaluate.load_dataset(path)
    assert len(full.times) == 90
    oracles = {p: full.oracle(p) for p in full.times}
    assert sum(c.backend == 1 for c in oracles.values()) > len(oracles) // 2
    assert any(c.backend == 1 for p, c in oracles.items() if p.q_len in (1000, 3000))
