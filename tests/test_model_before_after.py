"""``benchmarks/model_before_after.py``: a decoder with a rule's constants as
they were and as they are, in fresh processes (CPU: compile and checks only)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "model_before_after.py"


def _load():
  from bench_module import load_benchmark
  return load_benchmark("model_before_after")


MOSAIC = "wavetune_jax.families.ragged_dot.mosaic"


@pytest.mark.parametrize("args,match", [
    (["--out", "x", "--before", f"{MOSAIC}:TRIPLE_SPILL", "--", "--model", "small_moe"], "module:NAME=value"),
    (["--out", "x", "--before", f"{MOSAIC}:NOPE=1", "--", "--model", "small_moe"], "has no NOPE"),
    (["--out", "x", "--before", "no_such_module:X=1", "--", "--model", "small_moe"], "cannot import"),
    (["--out", "x", "--before", f"{MOSAIC}:TRIPLE_SPILL=high", "--", "--model", "small_moe"], "is not a float"),
    (["--out", "x", "--before", f"{MOSAIC}:TRIPLE_TILES=1", "--", "--model", "small_moe"], "only numbers and strings"),
    (["--out", "x", "--before", f"{MOSAIC}:TRIPLE_SPILL=0.1"], "after --"),
    (["--out", "x", "--before", f"{MOSAIC}:TRIPLE_SPILL=0.1", "--rounds", "0", "--", "--model",
      "small_moe"], "--rounds must be"),
    (["--out", "x", "--before", f"{MOSAIC}:TRIPLE_SPILL=0.1", "--", "--json", "y"],
     "drop --json"),
    (["--out", "x", "--before", f"{MOSAIC}:TRIPLE_SPILL=0.1", "--", "--json=y"],
     "drop --json")])
def test_bad_arguments_get_one_line_errors(args, match, capsys):
  with pytest.raises(SystemExit):
    _load().main(args)
  err = capsys.readouterr().err
  assert match in err and "Traceback" not in err


def test_before_and_now_run_in_their_own_processes(tmp_path):
  """One round of the small MoE decoder: each side's bench ran with its
  constants (the child sets them before the bench runs), and the summary
  names both runs."""
  env = {**os.environ, "JAX_PLATFORMS": "cpu",
         "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
  r = subprocess.run(
      [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--rounds", "1",
       "--before", f"{MOSAIC}:TRIPLE_SPILL=0.1", "--", "--model", "small_moe", "--ops", "tables",
       "--prompt", "16", "--decode-batch", "1", "--cache", "32"],
      env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["before"] == [f"{MOSAIC}:TRIPLE_SPILL=0.1"]
  assert len(summary["runs"]["before"]) == len(summary["runs"]["now"]) == 1
  kinds = {(row["setting"], row["kind"]) for row in summary["rows"]}
  assert {("tables", "prefill"), ("tables", "decode")} <= kinds
  assert "now/before" in r.stdout
  # Each child says what it set before the bench ran: "before" the patch,
  # "now" nothing.
  assert f"set {MOSAIC}.TRIPLE_SPILL = 0.1" in (tmp_path / "before_0.log").read_text()
  assert "TRIPLE_SPILL" not in (tmp_path / "now_0.log").read_text()
  # A rerun into the same folder whose bench fails does not count the old files.
  (tmp_path / "now_0.json").write_text((tmp_path / "before_0.json").read_text())
  r = subprocess.run(
      [sys.executable, str(SCRIPT), "--out", str(tmp_path), "--rounds", "1",
       "--before", f"{MOSAIC}:TRIPLE_SPILL=0.1", "--", "--model", "no_such_model"],
      env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 1 and "the bench failed" in r.stdout
  assert not (tmp_path / "now_0.json").exists()


def test_the_child_sets_the_constants(monkeypatch):
  mod = _load()
  seen = {}

  def fake_main(argv):
    from wavetune_jax.families.ragged_dot import mosaic
    seen["spill"], seen["argv"] = mosaic.TRIPLE_SPILL, argv
    return 0

  import wavetune_jax.cli
  from wavetune_jax.families.ragged_dot import mosaic
  monkeypatch.setattr(wavetune_jax.cli, "main", fake_main)
  monkeypatch.setattr(mosaic, "TRIPLE_SPILL", mosaic.TRIPLE_SPILL)
  patch = mod.parse_patch(f"{MOSAIC}:TRIPLE_SPILL=0.1")
  assert mod.main(["--child", json.dumps([patch]), "--model", "small"]) == 0
  assert seen == {"spill": 0.1, "argv": ["bench", "model", "--model", "small"]}
