"""Every CLI error is one line on stderr and a non-zero exit, never a traceback."""

import gzip
import os
import shutil
import sys

import pytest

from wavetune_jax.cli import main as cli_main

ROOT = os.path.join(os.path.dirname(__file__), "..")
SWEEP = os.path.join(ROOT, "data", "sweeps", "nvidia_h200", "attention_bfloat16.jsonl.gz")
TABLE = os.path.join(ROOT, "tables", "nvidia_h200", "matmul.json")


def _run(argv, capsys):
  try:
    code = cli_main(argv)
  except SystemExit as e:  # argparse: usage line + one error line
    code = e.code
  err = capsys.readouterr().err.strip().splitlines()
  assert code != 0
  assert not any("Traceback" in line for line in err)
  return err[-1]


@pytest.fixture
def files(tmp_path):
  empty = tmp_path / "empty.jsonl.gz"
  empty.write_bytes(b"")
  truncated = tmp_path / "cut.jsonl.gz"
  data = open(SWEEP, "rb").read()
  truncated.write_bytes(data[: len(data) // 2])
  notgz = tmp_path / "table.jsonl.gz"
  shutil.copy(TABLE, notgz)
  badjson = tmp_path / "bad.json"
  badjson.write_text("{not json")
  nohead = tmp_path / "nohead.jsonl.gz"
  with gzip.open(nohead, "wt") as f:
    f.write('{"type": "row"}\n')
  return dict(empty=str(empty), truncated=str(truncated), notgz=str(notgz),
              badjson=str(badjson), nohead=str(nohead), out=str(tmp_path / "t.json"))


@pytest.mark.parametrize("argv,match", [
    (["report", "missing.jsonl.gz"], "no file"),
    (["report", "{empty}"], "is empty"),
    (["report", "{notgz}"], "not a sweep file"),
    (["report", "{nohead}"], "not a sweep file"),
    (["eval", "--family", "attention", "--sweep", "{truncated}"], "truncated"),
    (["tune", "--family", "attention", "--replay", "{truncated}", "--out", "{out}"],
     "truncated"),
    (["tune", "--family", "matmul", "--replay", SWEEP, "--out", "{out}"],
     "is an attention sweep, not matmul"),
    (["select", "matmul", "--m", "16", "--n", "64", "--k", "64", "--device", "b300"],
     "invalid choice: 'b300'"),
    (["select", "matmul", "--m", "16", "--n", "64", "--k", "64", "--device", "h200",
      "--table", "{badjson}"], "not readable JSON"),
    (["select", "attention", "--m", "16", "--set", "batch=1", "--set", "q_heads=8",
      "--set", "kv_heads=8", "--device", "h200", "--table", TABLE],
     "is for family 'matmul'"),
    (["select", "convolution", "--m", "16"], "invalid choice: 'convolution'"),
    (["bench", "model", "--cache-fill", "half"], "invalid choice: 'half'"),
    (["select", "matmul", "--m", "-3"], "not an integer >= 1"),
    (["select", "matmul", "--m", "16", "--n", "64", "--device", "h100"], "not a matmul problem"),
    (["select", "matmul", "--m", "16", "--n", "64", "--k", "64"], "no GPU here"),
    (["eval", "--family", "attention", "--sweep", SWEEP, "--budget", "x"],
     "not an integer"),
    (["eval", "--family", "attention", "--sweep", SWEEP, "--policy", "magic"],
     "unknown policy"),
    (["tune", "--family", "attention", "--replay", SWEEP, "--trust", "0.5"],
     "not a number >= 1.0"),
    (["tune", "--family", "matmul", "--fit-only", "--anchors", "{nohead}"],
     "not a sweep file"),
    (["sweep", "--family", "matmul"], "no GPU"),
])
def test_cli_errors_are_one_line(argv, match, files, capsys):
  argv = [a.format(**files) for a in argv]
  last = _run(argv, capsys)
  assert match in last, last
  assert not os.path.exists(files["out"])  # nothing written on an error


def test_every_option_of_every_command_has_help():
  import argparse

  from wavetune_jax.cli.main import build_parser
  sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
  assert set(sub.choices) == {"demo", "sweep", "report", "merge", "tune", "select", "plot",
                              "eval", "bench"}
  parsers = dict(sub.choices)
  for name, parser in list(parsers.items()):  # nested commands: "bench model"
    for action in parser._actions:
      if isinstance(action, argparse._SubParsersAction):
        parsers.update({f"{name} {n}": p for n, p in action.choices.items()})
  for name, parser in parsers.items():
    for action in parser._actions:
      if isinstance(action, argparse._HelpAction):
        continue
      assert action.help, f"wavetune {name} {action.option_strings or action.dest}: no help"
      if action.choices is None and action.default not in (None, False) \
          and not isinstance(action, argparse._StoreTrueAction):
        assert "default" in action.help, f"wavetune {name} {action.option_strings}: " \
                                         f"help does not say its default"


def test_a_warning_is_one_line(monkeypatch, capsys):
  # Printed as `wavetune COMMAND: warning: ...`, without the library's source
  # line; the default format is back after the command.
  import argparse
  import warnings

  import importlib
  main_mod = importlib.import_module("wavetune_jax.cli.main")

  def build():
    ap = argparse.ArgumentParser(prog="wavetune")
    sub = ap.add_subparsers(dest="command", required=True)

    def run(args):
      warnings.warn("first line\nsecond line", UserWarning)
      return 0
    sub.add_parser("demo").set_defaults(func=run)
    return ap
  monkeypatch.setattr(main_mod, "build_parser", build)
  plain = warnings.formatwarning
  with warnings.catch_warnings():
    warnings.simplefilter("always")
    # Python's default: write formatwarning's text to stderr (pytest records instead).
    monkeypatch.setattr(warnings, "showwarning", lambda m, c, f, n, file=None, line=None:
                        sys.stderr.write(warnings.formatwarning(m, c, f, n, line)))
    assert main_mod.main(["demo"]) == 0
  assert capsys.readouterr().err == "wavetune demo: warning: first line\nsecond line\n"
  assert warnings.formatwarning is plain


def _sweep_rows(path):
  import json
  with gzip.open(path, "rt") as f:
    return [json.loads(line) for line in f if line.strip()]


def _write_sweep(path, lines):
  import json
  with gzip.open(path, "wt") as f:
    f.writelines(json.dumps(r) + "\n" for r in lines)
  return str(path)


def test_tune_never_writes_over_its_input(tmp_path, capsys):
  # A table written over the sweep or anchor log would replace the GPU time
  # it is fitted from.
  sweep = tmp_path / "s.jsonl.gz"
  shutil.copy(SWEEP, sweep)
  before = sweep.read_bytes()
  for argv in (["tune", "--family", "attention", "--replay", str(sweep), "--out", str(sweep)],
               ["tune", "--family", "attention", "--fit-only", "--anchors", str(sweep),
                "--out", str(sweep)]):
    assert "would replace the measurements" in _run(argv, capsys)
  assert sweep.read_bytes() == before


def test_select_refuses_contradictions(capsys):
  mm = ["select", "matmul", "--m", "4096", "--n", "4096", "--k", "4096", "--device", "h200"]
  assert "does not apply to --policy fixed" in _run(mm + ["--table", TABLE, "--policy", "fixed"],
                                                    capsys)
  assert "m is given by --m already" in _run(mm + ["--set", "m=5"], capsys)


def test_select_set_parses_floats(capsys):
  argv = ["select", "attention", "--m", "1024", "--set", "batch=1", "--set", "q_heads=8",
          "--set", "kv_heads=8", "--set", "head_dim=128", "--set", "kv_len=1024", "--set",
          "soft_cap=1.5", "--device", "h200"]
  assert cli_main(argv) == 0
  assert ":cap1.5 on NVIDIA H200" in capsys.readouterr().out


def test_plot_set_names_fields(tmp_path, capsys):
  pytest.importorskip("matplotlib")
  out = str(tmp_path / "p.png")
  base = ["plot", "attention", "--sweep", SWEEP, "--out", out]
  assert "have no field 'bogus'" in _run(base + ["--set", "bogus=3"], capsys)
  # `true` as select takes it: the problems of one weight with causal=True.
  rows = _sweep_rows(SWEEP)
  p = next(r["problem"] for r in rows[1:] if r.get("problem", {}).get("causal"))
  keep = ("batch", "q_heads", "kv_heads", "kv_len", "head_dim")
  argv = base + [a for f in keep for a in ("--set", f"{f}={p[f]}")] + ["--set", "causal=true"]
  try:
    code = cli_main(argv)
  except SystemExit as e:
    code = e.code
  err = capsys.readouterr().err
  assert "no problem with" not in err and (code == 0 or "weights match" in err), err


def test_report_and_merge_refuse_malformed_rows(tmp_path, capsys):
  lines = _sweep_rows(SWEEP)
  ok = next(i for i, r in enumerate(lines) if r.get("status") == "ok" and "spread_us" in r)
  bad = [dict(r) for r in lines]
  bad[ok]["spread_us"] = "x"
  path = _write_sweep(tmp_path / "bad.jsonl.gz", bad)
  assert "spread_us='x' is not a finite number" in _run(["report", path], capsys)
  failed = [dict(r) for r in lines]
  i = next(i for i, r in enumerate(failed) if i and r.get("status") != "ok") \
      if any(r.get("status") not in ("ok", None) for r in failed[1:]) else ok
  failed[i] = dict(failed[i], status="compile_error", error=None)
  path = _write_sweep(tmp_path / "err.jsonl.gz", failed)
  assert "error=None is not a string" in _run(["report", path], capsys)
  copy = tmp_path / "copy.jsonl.gz"
  shutil.copy(SWEEP, copy)
  assert "into itself" in _run(["merge", str(copy), "--into", str(copy)], capsys)


def test_merge_and_replay_keep_the_length_mix(tmp_path, capsys):
  src = os.path.join(ROOT, "data", "sweeps", "nvidia_h200", "decode_bfloat16.jsonl.gz")
  lines = _sweep_rows(src)
  head = [r for r in lines[1:] if r["key"].split("|", 1)[0] == lines[1]["key"].split("|", 1)[0]]
  spread = _write_sweep(tmp_path / "spread.jsonl.gz", [lines[0]] + head)
  full = _write_sweep(tmp_path / "full.jsonl.gz", [dict(lines[0], lengths="full")] + head)
  assert "lengths='full'" in _run(["merge", full, "--into", spread], capsys)
  assert "was measured with --lengths full" in _run(
      ["tune", "--family", "decode", "--replay", full], capsys)


def test_sweep_and_table_num_sms_must_be_the_gpus(tmp_path, capsys):
  import json
  lines = _sweep_rows(SWEEP)
  path = _write_sweep(tmp_path / "sms.jsonl.gz", [dict(lines[0], num_sms=13)] + lines[1:])
  assert "is not the 132 SMs" in _run(["report", path], capsys)
  table = json.load(open(TABLE))
  table["num_sms"] = 1
  t = tmp_path / "t.json"
  t.write_text(json.dumps(table))
  assert "has 132 SMs" in _run(["select", "matmul", "--m", "64", "--n", "4096", "--k", "4096",
                                "--device", "h200", "--table", str(t)], capsys)


def test_replay_refuses_options_it_ignores(capsys):
  base = ["tune", "--family", "attention", "--replay", SWEEP]
  assert "--dtype does not apply" in _run(base + ["--dtype", "float16"], capsys)
  assert "--windows does not apply" in _run(base + ["--windows", "only"], capsys)
  assert "LO is above HI" in _run(base + ["--m-range", "10", "5"], capsys)


def test_out_folder_checked_before_work(tmp_path, capsys):
  # (A file where a folder should be: checked as root too.)
  f = tmp_path / "afile"
  f.write_text("")
  last = _run(["tune", "--family", "attention", "--replay", SWEEP, "--out",
               str(f / "sub" / "t.json")], capsys)
  assert f"{f} is not a writable folder" in last
  ro = tmp_path / "ro"
  ro.mkdir()
  ro.chmod(0o500)
  try:
    if os.access(ro, os.W_OK):
      pytest.skip("running as a user who can write anywhere")
    last = _run(["tune", "--family", "attention", "--replay", SWEEP, "--out",
                 str(ro / "sub" / "t.json")], capsys)
    assert f"{ro} is not a writable folder" in last and ".tmp" not in last
  finally:
    ro.chmod(0o700)


def test_a_train_folder_does_not_hide_the_built_in_suite(tmp_path, monkeypatch):
  from wavetune_jax.shapes import load_suite
  monkeypatch.chdir(tmp_path)
  (tmp_path / "train").mkdir()
  (tmp_path / "mine.json").write_text('{"gemm": {}}')
  assert load_suite("train") == load_suite() and load_suite("train")
  assert load_suite("mine.json") == {"gemm": {}}


def test_debug_env_off_values_keep_errors_one_line(monkeypatch, capsys):
  from wavetune_jax.cli.common import CliError
  argv = ["select", "matmul", "--m", "16", "--n", "64", "--k", "64"]  # no GPU here
  for value in ("false", "No", "off", "0", ""):
    monkeypatch.setenv("WAVETUNE_DEBUG", value)
    assert "no GPU here" in _run(argv, capsys)
  monkeypatch.setenv("WAVETUNE_DEBUG", "1")
  with pytest.raises(CliError):
    cli_main(argv)


def test_blank_lines_of_a_sweep_hold_nothing(tmp_path, capsys):
  import json
  lines = _sweep_rows(SWEEP)
  path = tmp_path / "blank.jsonl.gz"
  with gzip.open(path, "wt") as f:
    for r in lines:
      f.write(json.dumps(r) + "\n\n")
  assert cli_main(["report", str(path)]) == 0
  blank = capsys.readouterr().out.split("\n", 1)[1]  # (after the line naming the file)
  assert cli_main(["report", SWEEP]) == 0
  assert blank == capsys.readouterr().out.split("\n", 1)[1]


def test_report_skips_a_repeat_of_an_unmeasured_backend(tmp_path, capsys):
  from wavetune_jax.core.registry import get_family
  spec = get_family("attention")
  lines = _sweep_rows(SWEEP)
  name = lambda r: spec.backend_of(spec.config_from_dict(r["config"])).name  # noqa: E731
  rep = next(r for r in lines[1:] if r["impl"] == "repeat" and name(r) == "triton")
  keep = [lines[0]] + [r for r in lines[1:]
                       if not (r["impl"] == "pallas" and name(r) == name(rep))]
  assert rep in keep
  path = _write_sweep(tmp_path / "rep.jsonl.gz", keep)
  assert cli_main(["report", path]) == 0
  assert "has no backend" not in capsys.readouterr().err
