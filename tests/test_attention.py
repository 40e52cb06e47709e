"""The attention family: the reference, the causal block split, argument
checks of the op, selection, the mapping and the tuner on the recorded sweeps
(each backend's own tests: test_attention_backends.py)."""

import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wavetune_jax as wt
from test_attention_backends import qkv
from pallas_kernels.attention.reference import attention_reference
from pallas_kernels.attention.triton import kv_blocks, q_block_start
from wavetune_jax import ATTENTION, AttentionProblem, CudnnAttentionConfig, MosaicAttentionConfig, TritonAttentionConfig, get_hardware
from wavetune_jax.runtime import selector
from wavetune_jax.tuning import evaluate
from wavetune_jax.tuning.profiler import rel_error

AttentionConfig = TritonAttentionConfig

H200 = get_hardware("h200")
H200_SWEEP = os.path.join(os.path.dirname(__file__), "..", "data", "sweeps", "nvidia_h200",
                          "attention_bfloat16.jsonl.gz")


def test_reference_matches_jax_nn():
  q, k, v = qkv(2, 37, 37, 8, 2, 64)
  ref = attention_reference(q, k, v, causal=True, out_dtype=jnp.float32, q_chunk=16)
  f32 = lambda a: a.astype(jnp.float32)  # noqa: E731
  nn = jax.nn.dot_product_attention(f32(q), f32(k), f32(v), is_causal=True)
  assert rel_error(ref, nn) < 1e-5


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_xla_backend_runs_one_element_shapes_on_a_cpu(dtype):
  """Pinned to XLA's attention, a call whose batch, lengths and heads are
  all 1 runs (XLA's CPU dot refuses 16-bit operands with a float32 result
  there; the backend computes in float32 on a CPU)."""
  q = jax.random.normal(jax.random.key(0), (1, 1, 1, 64), dtype)
  out = wt.attention(q, q, q, config={"backend": "xla"})
  dec = wt.decode_attention(q, q, q, config={"backend": "xla"})
  assert out.dtype == dec.dtype == dtype
  # One key: the output is its value.
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(q, np.float32))
  np.testing.assert_array_equal(np.asarray(dec, np.float32), np.asarray(q, np.float32))


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
    wt.attention(q, q, q, config={"backend": "triton", "block_q": 48})
  with pytest.raises(ValueError, match="unknown TritonAttentionConfig"):
    wt.attention(q, q, q, config={"backend": "triton", "block_m": 64})
  with pytest.raises(ValueError, match="no backend 'flash3'"):
    wt.attention(q, q, q, config={"backend": "flash3"})
  with pytest.raises(ValueError, match="TritonMatmulConfig"):
    wt.attention(q, q, q, config=wt.TritonMatmulConfig())


@pytest.mark.parametrize("kw,match", [
    (dict(causal="False"), "causal='False' must be a Python bool"),
    (dict(causal=1), "must be a Python bool"),
    (dict(scale="0.1"), "scale='0.1' must be a Python float"),
    (dict(scale=float("nan")), "must be finite"),
])
def test_causal_and_scale_of_the_wrong_type(kw, match):
  q = jnp.ones((1, 8, 4, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match=match):
    wt.attention(q, q, q, **kw)


def test_on_a_cpu_the_op_picks_an_interpret_capable_backend():
  """The README's example shape: with no GPU the H100 preset would pick the
  Mosaic backend, which has no interpret mode; the op picks Triton."""
  q = jnp.ones((2, 3000, 32, 128), jnp.bfloat16)
  out = jax.eval_shape(wt.attention, q, q[:, :, :8], q[:, :, :8])
  assert out.shape == q.shape
  hw = get_hardware(None)
  assert hw.interpret
  sel = selector.select(ATTENTION, AttentionProblem(batch=2, q_heads=32, kv_heads=8,
                                                    q_len=3000), hw)
  assert isinstance(sel.config, TritonAttentionConfig)
  # The same problem for a named GPU answers with a GPU-only backend.
  sel = selector.select(ATTENTION, AttentionProblem(batch=2, q_heads=32, kv_heads=8,
                                                    q_len=3000), get_hardware("h100"))
  assert isinstance(sel.config, (MosaicAttentionConfig, CudnnAttentionConfig))
  with pytest.raises(ValueError, match="cannot run here"):
    wt.attention(q[:, :256], q[:, :256], q[:, :256], config=MosaicAttentionConfig())


def test_grad_is_a_clear_error():
  q = jnp.ones((1, 16, 2, 64), jnp.bfloat16)
  with pytest.raises(NotImplementedError, match="forward only"):
    jax.grad(lambda q: wt.attention(q, q, q).astype(jnp.float32).sum())(q)


def test_op_selects_at_trace_time_and_matches_reference():
  q, k, v = qkv(1, 50, 50, 4, 1, 64)
  with selector.use_config("attention", {"backend": "triton", "block_q": 32, "block_k": 32}):
    out = jax.jit(lambda q, k, v: wt.attention(q, k, v))(q, k, v)
  ref = attention_reference(q, k, v, causal=True, out_dtype=jnp.float32)
  assert rel_error(out, ref) < 1e-2


def test_spec_space_mapping_and_shipped_table():
  p = AttentionProblem(batch=2, q_heads=32, kv_heads=8, q_len=3000, head_dim=128)
  assert p.kv_len == 3000
  space = ATTENTION.space(p, H200)
  assert space and {ATTENTION.backend_of(c).name for c in space} == {"cudnn", "triton", "mosaic",
                                                                     "xla"}
  g, l = ATTENTION.coords(p, AttentionConfig(block_q=128, block_k=64))
  assert g == 2 * 32 * 24
  # Causal: mean KV blocks over query blocks, about half of the full row.
  assert 0.45 * 47 < l < 0.6 * 47
  g2, l2 = ATTENTION.coords(AttentionProblem(batch=2, q_heads=32, kv_heads=8, q_len=3000,
                                             causal=False), AttentionConfig(block_q=128, block_k=64))
  assert (g2, l2) == (g, 47.0)
  assert ATTENTION.with_size(p, 512).kv_len == 512
  # A window: the KV blocks from the first row's first key to the diagonal,
  # counted against every block a row of the query block sees.
  w = AttentionProblem(batch=2, q_heads=32, kv_heads=8, q_len=3000, head_dim=128,
                       window_left=511, window_right=0)
  bq, bk = 128, 64
  _, lw = ATTENTION.coords(w, AttentionConfig(block_q=bq, block_k=bk))
  visits = []  # the Mosaic kernel's programs (the last one is partial)
  for start in range(0, 3000, bq):
    keys = {j // bk for i in range(start, min(start + bq, 3000))
            for j in range(max(0, i - 511), i + 1)}
    visits.append(max(keys) - min(keys) + 1)
  assert lw == pytest.approx(np.mean(visits))
  assert lw < 10 < l
  # XLA's attention writes every score: its (G, L) ignores the window.
  xla = ATTENTION.backend("xla")
  assert xla.coords(w, {}) == xla.coords(p, {})
  with selector.policy("tables"):
    sel = selector.select(ATTENTION, p, H200)
  assert sel.source in ("exact", "model", "heuristic")
  assert sel.config in set(ATTENTION.space(p, H200)) | {ATTENTION.heuristic(p, H200)}


def test_replay_on_the_recorded_h200_attention_sweep():
  ds = evaluate.load_dataset(H200_SWEEP)
  assert sum(p.plain for p in ds.times) == 90 and len(ds.times) > 90  # and windows
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
  assert "config" in text and "answered by" in text and "G=1536" in text
  assert cli_main(["select", "attention", "--m", "3000", "--device", "h200"]) == 2
  err = capsys.readouterr().err
  assert "not an attention problem" in err and "give --set" in err


# --- the Mosaic GPU backend (runs on Hopper only; here: configs, spaces, errors) ----------

H100_SWEEP = os.path.join(os.path.dirname(__file__), "..", "data", "sweeps",
                          "nvidia_h100_80gb_hbm3", "attention_bfloat16.jsonl.gz")
MOSAIC_128 = MosaicAttentionConfig(block_q=128, block_k=128, num_stages=2)
MOSAIC = MosaicAttentionConfig


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
      assert not (q % 8 and isinstance(sel.config, MOSAIC))
    p = AttentionProblem(batch=1, q_heads=8, kv_heads=1, q_len=256)  # 16 programs
    sel = selector.select(ATTENTION, p, hw)
    # Triton's small tiles, unless no sweep row near this shape shows a
    # kernel beating cuDNN: the guard then keeps cuDNN.
    assert isinstance(sel.config, AttentionConfig) or (
        sel.source == "guard" and isinstance(sel.config, CudnnAttentionConfig)), sel
    # cuDNN's 128-row tiles fill the GPU: cuDNN, or a Mosaic config predicted faster.
    p = AttentionProblem(batch=4, q_heads=32, kv_heads=8, q_len=4096)
    assert isinstance(selector.select(ATTENTION, p, hw).config, (MOSAIC, CudnnAttentionConfig))


def test_recorded_space_of_a_file_that_predates_mosaic(tmp_path):
  """A sweep file with Triton configs only (as recorded before the Mosaic
  backend) is complete without Mosaic configs, and policies evaluated on it
  choose among Triton configs. Both GPUs' sweeps hold both backends, and on
  both a Mosaic config is the oracle of most problems, ragged lengths included."""
  from wavetune_jax.tuning import sweep
  header, rows = sweep.read_sweep(H200_SWEEP)
  old = str(tmp_path / "attention_bfloat16.jsonl.gz")
  sweep.SweepFile(old, header).append(
      [r for r in rows if (r.get("config") or {}).get("backend", 0) == 0])
  ds = evaluate.load_dataset(old)
  assert sum(p.plain for p in ds.times) == 90
  p = next(iter(ds.times))
  # Triton configs, and cuDNN and XLA (measured by the baseline rows).
  assert {ds.family.backend_of(c).name for c in ds.family.space(p, ds.hw)} == {
      "triton", "cudnn", "xla"}
  assert any(isinstance(c, MOSAIC) for c in ATTENTION.space(p, ds.hw))
  for path in (H100_SWEEP, H200_SWEEP):
    full = evaluate.load_dataset(path)
    assert len(full.times) >= 89
    oracles = {p: full.oracle(p) for p in full.times}
    assert sum(isinstance(c, MOSAIC) for c in oracles.values()) > len(oracles) // 4
    assert sum(isinstance(c, CudnnAttentionConfig) for c in oracles.values()) > len(oracles) // 4
    assert any(isinstance(c, MOSAIC) for p, c in oracles.items() if p.q_len in (1000, 3000))
