"""Decoders whose attention has windows, soft-capping and sinks (CPU).

Local and global layers as the presets say; a decode step continues the
prompt (the window and the sinks the same in prefill and decode); the
options change the logits; the wavetune ops match the xla setting; ``wavetune
bench model`` with the options, and its bad flags.
"""

import dataclasses
import json
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wavetune_jax.models as M
from wavetune_jax.cli.main import main

warnings.filterwarnings("ignore", message=".*no GPU.*")


def test_presets_layer_patterns():
  g3 = M.MODELS["gemma_3_4b"].with_layers(12)
  assert [g3.layer_window(i) for i in range(12)] == ([1024] * 5 + [0]) * 2
  oss = M.MODELS["gpt_oss_20b"].with_layers(4)
  assert [oss.layer_window(i) for i in range(4)] == [128, 0, 128, 0]
  assert oss.sinks and oss.experts == 32
  params = {"sinks": jnp.zeros((64,))}
  assert set(oss.attention_options(0, params)) == {"local_window_size", "sinks"}
  assert oss.attention_options(0, params)["local_window_size"] == (127, 0)
  assert set(oss.attention_options(1, params)) == {"sinks"}
  assert M.MODELS["llama3_8b"].attention_options(0, {}) == {}
  for bad in (dict(window=-1), dict(global_every=1.5), dict(soft_cap=-1.0)):
    with pytest.raises(ValueError, match="ModelConfig"):
      M.ModelConfig("x", 64, 64, 4, 2, 32, 2, 256, **bad)


@pytest.mark.parametrize("ops", ["tables"])  # (on a CPU the xla setting runs the same ops)
def test_decode_step_continues_the_prompt(ops):
  """Prefill of 11 tokens then one decode step = prefill of the 12 tokens,
  with a window of 4 (shorter than the prompt), soft-capping and sinks."""
  cfg = M.MODELS["small_local"].with_layers(3)
  cfg = dataclasses.replace(cfg, window=4)
  o = M.make_ops(ops)
  params = M.init(jax.random.PRNGKey(0), cfg, dtype=jnp.bfloat16)
  toks = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, cfg.vocab)
  full, _, _ = M.prefill(params, toks, cfg=cfg, ops=o, max_len=12)
  _, kc, vc = M.prefill(params, toks[:, :11], cfg=cfg, ops=o, max_len=16)
  step, _, _ = M.decode_step(params, kc, vc, jnp.array([11, 11]), toks[:, 11], cfg=cfg, ops=o)
  np.testing.assert_allclose(np.asarray(step, np.float32), np.asarray(full, np.float32),
                             rtol=5e-2, atol=5e-2)
  # Each option changes the logits (it is applied, not dropped).
  for change in (dict(window=0), dict(soft_cap=0.5), dict(sinks=False)):
    other = dataclasses.replace(cfg, **change)
    p2 = params if other.sinks else {**params, "layers": [
        {k: v for k, v in p.items() if k != "sinks"} for p in params["layers"]]}
    out, _, _ = M.prefill(p2, toks, cfg=other, ops=o, max_len=12)
    assert not np.allclose(np.asarray(out, np.float32), np.asarray(full, np.float32),
                           atol=1e-2), change


def test_bench_model_with_attention_options(tmp_path, capsys):
  out = tmp_path / "bench.json"
  rc = main(["bench", "model", "--model", "small_local", "--prompt", "24", "--decode-batch",
             "2", "--cache", "32", "--ops", "tables", "--cache-layout", "paged",
             "--page-size", "8", "--window", "12", "--json", str(out)])
  assert rc == 0
  text = capsys.readouterr().out
  assert "attention local/local/global (window 12), soft cap 20, sinks" in text
  got = json.loads(out.read_text())
  assert got["window"] == 12 and got["sinks"] and got["soft_cap"] == 20
  assert all(r["rel_diff_vs_xla"] < 5e-2 for r in got["rows"])


@pytest.mark.parametrize("argv,msg", [
    (["--window", "-3"], "--window -3: must be >= 0"),
    (["--soft-cap", "nan"], "--soft-cap nan: must be a finite number"),
    (["--sinks", "yes"], "invalid choice"),
])
def test_bench_model_bad_option_flags(argv, msg, capsys):
  with pytest.raises(SystemExit) if "choice" in msg else _nothing():
    rc = main(["bench", "model", "--model", "small_local", "--prompt", "8", "--cache", "8"]
              + argv)
    assert rc == 2
  assert msg in capsys.readouterr().err


class _nothing:
  def __enter__(self):
    return self

  def __exit__(self, *a):
    return False
