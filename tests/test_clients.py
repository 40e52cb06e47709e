"""Real client libraries, installed from the package index (the
``clients`` extra), run unedited under ``wt.autotune``: tiny configs on the
CPU, logits against the untransformed model. Skipped where a library is not
installed."""

import importlib.util
import os
import pathlib

import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "autotune_keras_hub.py"


def load_example():
  pytest.importorskip("keras_hub", reason="keras-hub not installed (.[clients])")
  spec = importlib.util.spec_from_file_location("autotune_keras_hub", EXAMPLE)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_keras_hub_models_under_autotune(capsys, masks=True):
  """Llama-3 and Mixtral from Keras-Hub's config classes: prefill and one
  cached decode step; the example fails (returns 1) when the logits differ
  by more than 5% relative RMS (25% for the MoE model, whose router may
  flip a near tie)."""
  mod = load_example()
  import wavetune_jax as wt
  # XLA's paths of the ops (the kernels have their own tests; here, that
  # the model's calls map onto them with the same semantics).
  with wt.use_config("attention", wt.XlaAttentionConfig()), \
      wt.use_config("decode", wt.XlaDecodeConfig()), \
      wt.use_config("matmul", wt.XlaMatmulConfig()):
    assert mod.main(["--tiny"] + (["--masks"] if masks else [])) == 0
  out = capsys.readouterr().out
  lines = [ln for ln in out.splitlines() if ln.strip().startswith(("prefill", "decode"))]
  assert len(lines) == 4, out
  # Llama: its 2 x 7 projections and the LM head are GEMMs against weights;
  # with masks=True its 2 attention calls too (Keras-Hub passes a mask; the
  # unit tests check that without masks=True such a call is kept).
  assert all("replaced 17/21" in ln for ln in lines[:2]), out
  assert "kept: batch dimensions" in out  # Mixtral's experts: a dense einsum over all experts


def test_unknown_model_is_a_clear_error(capsys):
  mod = load_example()
  with pytest.raises(SystemExit):
    mod.main(["--models", "gpt5"])
  assert "unknown model 'gpt5'" in capsys.readouterr().err


def _gemma_modules():
  """Google's `gemma` library (pip `gemma`, with its kauldron and TensorFlow
  requirements); None where it does not import."""
  try:
    from gemma.gm.nn import _config, _modules, _transformer
  except Exception:  # noqa: BLE001 - not installed, or its requirements are not
    return None
  return _config, _modules, _transformer


@pytest.mark.skipif(_gemma_modules() is None, reason="gemma library not importable")
def test_gemma_library_transformer_under_autotune():
  """A tiny Gemma-3-style transformer of Google's `gemma` library, bfloat16,
  forward logits through wt.autotune against the untransformed model."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  import wavetune_jax as wt
  _config, _modules, _transformer = _gemma_modules()
  local, glob = _modules.AttentionType.LOCAL_SLIDING, _modules.AttentionType.GLOBAL
  cfg = _config.TransformerConfig(
      num_embed=256, embed_dim=64, hidden_dim=128, num_heads=4, head_dim=16, num_kv_heads=2,
      use_post_attn_norm=True, use_post_ffw_norm=True, sliding_window_size=4,
      query_pre_attn_norm=_config.QueryPreAttentionNormalisation.BY_ONE_OVER_SQRT_HEAD_DIM,
      final_logit_softcap=None, attn_logits_soft_cap=None, use_qk_norm=True,
      transpose_gating_einsum=True, local_base_frequency=10_000,
      global_base_frequency=1_000_000, attention_types=(local, glob), vision_encoder=None)
  model = _transformer.Transformer(config=cfg, dtype=jnp.bfloat16)
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 256, (2, 8)), jnp.int32)
  params = model.init(jax.random.PRNGKey(0), tokens)["params"]
  params = jax.tree.map(lambda p: p.astype(jnp.bfloat16), params)
  fwd = lambda p, t: model.apply({"params": p}, t).logits
  tuned = wt.autotune(fwd)
  out = np.asarray(jax.jit(tuned)(params, tokens), np.float32)
  ref = np.asarray(jax.jit(fwd)(params, tokens), np.float32)
  assert np.sqrt(np.mean((out - ref) ** 2) / np.mean(ref ** 2)) < 0.05
  replaced = [s for s in tuned.sites if s.replaced]
  kept = {s.reason for s in tuned.sites if not s.replaced}
  assert replaced, tuned.sites  # the down and output projections are [K, N] GEMMs
  # Its q/kv/gating weights are [heads, D, H] (contracted in the middle): kept.
  assert any("first ones" in r for r in kept), kept
