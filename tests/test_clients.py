"""Real client libraries, installed from the package index (the
``clients`` extra), run unedited under ``wt.autotune``: tiny configs on the
CPU, logits against the untransformed model. Skipped where a library is not
installed."""

import importlib.util
import os
import pathlib

import pytest

os.environ.setdefault("KERAS_BACKEND", "jax")
keras_hub = pytest.importorskip("keras_hub", reason="keras-hub not installed (.[clients])")

EXAMPLE = pathlib.Path(__file__).parent.parent / "examples" / "autotune_keras_hub.py"


def load_example():
  spec = importlib.util.spec_from_file_location("autotune_keras_hub", EXAMPLE)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


@pytest.mark.parametrize("masks", [False, True])
def test_keras_hub_models_under_autotune(capsys, masks):
  """Llama-3 and Mixtral from Keras-Hub's config classes: prefill and one
  cached decode step; the example fails (returns 1) when the logits differ
  by more than 5% relative RMS (25% for the MoE model, whose router may
  flip a near tie)."""
  mod = load_example()
  assert mod.main(["--tiny"] + (["--masks"] if masks else [])) == 0
  out = capsys.readouterr().out
  lines = [ln for ln in out.splitlines() if ln.strip().startswith(("prefill", "decode"))]
  assert len(lines) == 4, out
  # Llama: its 2 x 7 projections and the LM head are GEMMs against weights;
  # with masks=True its 2 attention calls too (Keras-Hub passes a mask).
  llama = [ln for ln in lines[:2]]
  want = "replaced 17/21" if masks else "replaced 15/21"  # 2 attention calls kept
  assert all(want in ln for ln in llama), out
  assert "kept: batch dimensions" in out  # Mixtral's experts: a dense einsum over all experts


def test_unknown_model_is_a_clear_error(capsys):
  mod = load_example()
  with pytest.raises(SystemExit):
    mod.main(["--models", "gpt5"])
  assert "unknown model 'gpt5'" in capsys.readouterr().err
