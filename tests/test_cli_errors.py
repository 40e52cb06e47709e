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
     "is a attention sweep, not matmul"),
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
