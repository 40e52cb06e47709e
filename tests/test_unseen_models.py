"""``benchmarks/unseen_models.py`` on a CPU: the problems, the selections it
would time (``--dry-run``), its summary of recorded H100 rows (``--report``),
and its errors."""

import importlib.util
import json
import pathlib

import pytest

ROOT = pathlib.Path(__file__).parent.parent
H100_ROWS = ROOT / "data" / "probes" / "unseen_models_h100.json"


def _mod():
  spec = importlib.util.spec_from_file_location(
      "unseen_models", ROOT / "benchmarks" / "unseen_models.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_problems_are_outside_the_training_suites():
  mod = _mod()
  plan = mod.problems(mod.FAMILIES, quick=False)
  assert len(plan) == 168
  dims = {p.head_dim for f, _, p in plan if f == "attention"}
  assert dims == {96, 128, 256}
  experts = {p.g for f, _, p in plan if f == "ragged_dot"}
  assert experts == {8, 60, 128}
  only = mod.problems(("attention",), quick=True, models=("phi_3_mini",))
  assert len(only) == 4 and all("phi_3_mini" in label for _, label, _ in only)


def test_dry_run_prints_each_selection(capsys):
  mod = _mod()
  assert mod.main(["--dry-run", "--device-key", "nvidia_h100_80gb_hbm3",
                   "--families", "attention", "--models", "phi_3_mini"]) == 0
  out = capsys.readouterr().out.splitlines()
  assert out[-1] == "8 problems"
  by_label = {line[11:51].strip(): line[51:] for line in out[:-1]}
  # head_dim 96 above one wave, 6,000 tokens: the Mosaic kernel; 777: cuDNN.
  assert by_label["phi_3_mini b=1 L=6000"].startswith("mosaic(")
  assert by_label["phi_3_mini b=6 L=777"].startswith("cudnn")


def test_report_summarizes_recorded_rows(capsys):
  mod = _mod()
  assert mod.main(["--report", str(H100_ROWS), "--families", "ragged_dot"]) == 0
  out = capsys.readouterr().out
  assert out.startswith("NVIDIA H100 80GB HBM3")
  line = next(x for x in out.splitlines() if x.startswith("ragged_dot: "))
  rows = json.loads(H100_ROWS.read_text())["rows"]
  n = sum(r["family"] == "ragged_dot" for r in rows)
  assert f"0 of {n} below 0.95x" in line


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
  mod = _mod()
  with pytest.raises(SystemExit):
    mod.main(["--families", "conv"])
  assert "--families: unknown ['conv']" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    mod.main(["--dry-run", "--models", "gpt5"])
  assert "--models: unknown ['gpt5']" in capsys.readouterr().err
  bad = tmp_path / "x.json"
  bad.write_text("{")
  assert mod.main(["--report", str(bad)]) == 2
  assert "is not readable JSON" in capsys.readouterr().err
  # Rows without their fields, and files of two GPUs.
  bad.write_text(json.dumps({"device_kind": "NVIDIA H100 80GB HBM3",
                             "rows": [{"family": "matmul", "label": "x"}]}))
  assert mod.main(["--report", str(bad)]) == 2
  assert "not a file this script wrote" in capsys.readouterr().err
  other = tmp_path / "h200.json"
  rows = json.loads(H100_ROWS.read_text())
  other.write_text(json.dumps({**rows, "device_kind": "NVIDIA H200"}))
  assert mod.main(["--report", str(H100_ROWS), str(other)]) == 2
  assert "several GPUs" in capsys.readouterr().err
  assert mod.main(["--report", str(H100_ROWS), "--models", "gpt5"]) == 2
  assert "--models: unknown ['gpt5']" in capsys.readouterr().err
  # Timing needs a GPU; a CPU says so.
  import jax
  if jax.default_backend() == "cpu":
    assert mod.main(["--families", "matmul"]) == 2
    assert "needs a GPU" in capsys.readouterr().err
