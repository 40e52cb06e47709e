"""`wavetune tune` refuses bad sweeps and anchor logs (naming the row), writes
only tables that load back, atomically, and never over a shipped table
unless told; `report` and `merge` say when a sweep is cut off; CLI errors
are one line with exit status 2."""

import glob
import gzip
import hashlib
import json
import os
import subprocess
import sys

import pytest

from synthetic import HW, PROBLEMS, FakeMeasure, wave_us, write_sweep
from wavetune_jax import MATMUL
from wavetune_jax.cli import main as cli_main
from wavetune_jax.cli.main import build_parser
from wavetune_jax.runtime import selector, tables
from wavetune_jax.tuning import sweep

ROOT = os.path.join(os.path.dirname(__file__), "..")
TABLE = os.path.join(ROOT, "tables", "nvidia_h200", "matmul.json")
# Two weights at four sizes: a replay tune of them takes about a second.
SMALL = [p for p in PROBLEMS if (p.n, p.k) in ((256, 512), (384, 640))]


@pytest.fixture(scope="module")
def good(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("sweep") / "s.jsonl.gz")
  return write_sweep(path, SMALL, FakeMeasure(wave_us, with_failures=False))


@pytest.fixture(autouse=True)
def _no_user_tables(tmp_path, monkeypatch):
  """Every test writes its user tables under its own tmp_path."""
  monkeypatch.setenv("HOME", str(tmp_path / "home"))
  monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path / "xdg"))
  monkeypatch.delenv("WAVETUNE_TABLES", raising=False)
  monkeypatch.delenv("WAVETUNE_DEBUG", raising=False)
  selector.clear()
  yield
  selector.clear()


def _lines(path):
  with gzip.open(path, "rt") as f:
    return [json.loads(line) for line in f]


def _write(path, lines):
  with gzip.open(path, "wt") as f:
    for line in lines:
      f.write(json.dumps(line) + "\n")
  return str(path)


def _cli(argv, capsys):
  try:
    code = cli_main(argv)
  except SystemExit as e:  # argparse: usage + one error line
    code = e.code
  out, err = capsys.readouterr()
  return code, out, err.strip().splitlines()


def _error(argv, capsys):
  code, _, err = _cli(argv, capsys)
  assert code == 2, err
  assert err and not any("Traceback" in line for line in err), err
  assert err[-1].startswith("wavetune"), err[-1]
  return err[-1]


def _first_pallas(lines):
  return next(i for i, r in enumerate(lines) if r.get("impl") == "pallas")


def _edit_row(field, value):
  def edit(lines):
    lines[_first_pallas(lines)][field] = value
  return edit


def _edit_header(field, value):
  def edit(lines):
    lines[0][field] = value
  return edit


def _second_header(lines):
  lines.insert(3, dict(lines[0]))


def _not_ok_then_ok_without_time(lines):
  lines[_first_pallas(lines)].pop("median_us")


@pytest.mark.parametrize("edit,field,value", [
    (_edit_row("median_us", -3.0), "median_us", "-3.0"),
    (_edit_row("median_us", 0.0), "median_us", "0.0"),
    (_edit_row("median_us", float("nan")), "median_us", "nan"),
    (_edit_row("median_us", float("inf")), "median_us", "inf"),
    (_edit_row("median_us", "12"), "median_us", "'12'"),
    (_not_ok_then_ok_without_time, "median_us", "None"),
    (_edit_header("device_key", "tpu_v5"), "device_key", "'tpu_v5'"),
    (_edit_header("device_kind", "TPU v5"), "device_kind", "'TPU v5'"),
    (_edit_header("kernel", "convolution"), "kernel", "'convolution'"),
    (_edit_row("device_key", "nvidia_h200"), "device_key", "'nvidia_h200'"),
    (_edit_row("problem", {"m": 1, "n": 256, "k": 512, "batch": 2}), "problem", "'batch'"),
    (_edit_row("problem", {"m": -1, "n": 256, "k": 512}), "problem", "'m': -1"),
    (_edit_row("config", {"backend": "cutlass", "block_m": 64}), "config", "'cutlass'"),
    (_edit_row("config", {"backend": "triton", "block_m": 3}), "config", "'block_m': 3"),
    (_edit_row("impl", "magic"), "impl", "'magic'"),
    (_second_header, "type", "'header'"),
])
def test_tune_refuses_a_sweep_with_a_bad_row_naming_it(good, tmp_path, capsys, edit, field,
                                                      value):
  lines = _lines(good)
  edit(lines)
  bad = _write(tmp_path / "bad.jsonl.gz", lines)
  n = next(i for i, (a, b) in enumerate(zip(lines, _lines(good))) if a != b) + 1
  out = tmp_path / "t.json"
  msg = _error(["tune", "--family", "matmul", "--replay", bad, "--budget", "50",
                "--out", str(out)], capsys)
  assert f"{bad} line {n}: {field}=" in msg and value in msg, msg
  assert not out.exists() and not os.path.exists(tmp_path / "xdg")


def test_check_sweep_accepts_every_recorded_sweep_and_anchor_log():
  files = glob.glob(os.path.join(ROOT, "data", "sweeps", "*", "*.jsonl.gz")) + glob.glob(
      os.path.join(ROOT, "data", "anchors", "*", "*.jsonl.gz"))
  assert len(files) >= 12
  for path in files:
    header, rows = sweep.read_sweep(path, strict=True)
    assert rows and header["device_key"] in path


def test_fit_only_refuses_an_anchor_log_with_a_bad_row(good, tmp_path, capsys):
  lines = _lines(good)
  lines[_first_pallas(lines) + 2]["median_us"] = float("nan")
  bad = _write(tmp_path / "anchors.jsonl.gz", lines)
  out = tmp_path / "t.json"
  msg = _error(["tune", "--family", "matmul", "--fit-only", "--anchors", bad, "--out",
                str(out)], capsys)
  assert f"line {_first_pallas(lines) + 3}: median_us=nan" in msg, msg
  assert not out.exists()


def _hashes(folder):
  return {p: hashlib.sha256(open(p, "rb").read()).hexdigest()
          for p in glob.glob(os.path.join(folder, "**", "*"), recursive=True)
          if os.path.isfile(p)}


def test_tune_without_out_writes_the_user_folder_never_the_shipped_tables(good, tmp_path):
  """A real process: HOME, XDG_DATA_HOME and WAVETUNE_TABLES in tmp_path."""
  before = _hashes(tables.shipped_dir())
  assert before
  env = dict(os.environ, HOME=str(tmp_path / "home"), XDG_DATA_HOME=str(tmp_path / "xdg"),
             JAX_PLATFORMS="cpu")
  env.pop("WAVETUNE_TABLES", None)
  cmd = [sys.executable, "-c", "import sys; from wavetune_jax.cli import main; "
         "sys.exit(main())", "tune", "--family", "matmul", "--replay", good, "--budget", "50"]
  r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  user = tmp_path / "xdg" / "wavetune" / "tables" / HW.device_key / "matmul.json"
  assert f"table written to {user}" in r.stdout
  assert tables.load(str(user), MATMUL, HW).provenance["mode"] == "replay"
  assert _hashes(tables.shipped_dir()) == before
  # WAVETUNE_TABLES set: the table goes there.
  env["WAVETUNE_TABLES"] = str(tmp_path / "mine")
  r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
  assert r.returncode == 0, r.stderr
  assert (tmp_path / "mine" / HW.device_key / "matmul.json").is_file()
  assert _hashes(tables.shipped_dir()) == before


def test_the_selector_reads_the_user_table_before_the_shipped_one(good, tmp_path, capsys,
                                                                  monkeypatch):
  monkeypatch.setattr(tables, "shipped_dir", lambda: str(tmp_path / "shipped"))
  shipped = os.path.join(tables.shipped_dir(), HW.device_key, "matmul.json")
  assert tables.default_path("matmul", HW.device_key) == shipped  # no user table yet
  assert cli_main(["tune", "--family", "matmul", "--replay", good, "--budget", "50"]) == 0
  user = str(tmp_path / "xdg" / "wavetune" / "tables" / HW.device_key / "matmul.json")
  assert tables.default_path("matmul", HW.device_key) == user
  assert tables.default_path("attention", HW.device_key).startswith(tables.shipped_dir())
  assert selector.active_table("matmul", HW).provenance["source"] == good
  # $WAVETUNE_TABLES replaces both (a missing file there: no table).
  monkeypatch.setenv("WAVETUNE_TABLES", str(tmp_path / "other"))
  assert tables.default_path("matmul", HW.device_key) == str(
      tmp_path / "other" / HW.device_key / "matmul.json")
  # Without XDG_DATA_HOME: ~/.local/share.
  monkeypatch.delenv("WAVETUNE_TABLES")
  monkeypatch.delenv("XDG_DATA_HOME")
  assert tables.user_dir() == str(tmp_path / "home" / ".local" / "share" / "wavetune" /
                                  "tables")


def test_writing_into_the_shipped_tables_needs_the_flag(good, tmp_path, capsys, monkeypatch):
  shipped = tmp_path / "shipped"
  monkeypatch.setattr(tables, "shipped_dir", lambda: str(shipped))
  target = shipped / HW.device_key / "matmul.json"
  target.parent.mkdir(parents=True)
  target.write_text("{}")
  base = ["tune", "--family", "matmul", "--replay", good, "--budget", "50"]
  msg = _error(base + ["--out", str(target)], capsys)
  assert "--overwrite-shipped" in msg and str(target) in msg
  monkeypatch.setenv("WAVETUNE_TABLES", str(shipped))  # the default path, in shipped/
  assert "--overwrite-shipped" in _error(base, capsys)
  monkeypatch.delenv("WAVETUNE_TABLES")
  site = tmp_path / "venv" / "lib" / "site-packages" / "wavetune_jax" / "t.json"
  site.parent.mkdir(parents=True)
  assert "--overwrite-shipped" in _error(base + ["--out", str(site)], capsys)
  assert target.read_text() == "{}" and not site.exists()
  code, out, _ = _cli(base + ["--overwrite-shipped"], capsys)
  assert code == 0 and f"table written to {target}" in out
  assert tables.load(str(target), MATMUL, HW).provenance["source"] == good


def test_a_table_that_does_not_load_back_is_not_written(good, tmp_path, capsys, monkeypatch):
  to_json = tables.Table.to_json

  def corrupt(self):
    d = to_json(self)
    entry = d["model"]["entries"][0]
    entry["coef"] = [-1.0] + list(entry["coef"][1:])
    return d
  monkeypatch.setattr(tables.Table, "to_json", corrupt)
  out = tmp_path / "out" / "t.json"
  msg = _error(["tune", "--family", "matmul", "--replay", good, "--budget", "50",
                "--out", str(out)], capsys)
  assert "fails the checks of tables.load" in msg and "coef" in msg and str(out) in msg
  assert os.listdir(out.parent) == []  # no table, no temp file


def test_the_table_is_written_by_a_rename_in_its_folder(good, tmp_path, capsys, monkeypatch):
  out = tmp_path / "t.json"
  out.write_text("old")
  renames = []
  real = os.replace

  def spy(src, dst):
    renames.append((str(src), str(dst)))
    assert out.read_text() == "old"  # untouched until the rename
    real(src, dst)
  monkeypatch.setattr(os, "replace", spy)
  assert cli_main(["tune", "--family", "matmul", "--replay", good, "--budget", "50",
                   "--out", str(out)]) == 0
  (src, dst), = [r for r in renames if r[1] == str(out)]
  assert os.path.dirname(src) == str(tmp_path) and not os.path.exists(src)
  assert tables.load(str(out), MATMUL, HW).provenance["mode"] == "replay"
  assert sorted(os.listdir(tmp_path)) == ["t.json"]


def _cut(good, tmp_path):
  data = open(good, "rb").read()
  cut = tmp_path / "cut.jsonl.gz"
  cut.write_bytes(data[: len(data) * 2 // 3])
  return str(cut)


def test_report_warns_of_a_cut_sweep_and_reports_the_rows_before_it(good, tmp_path, capsys):
  cut = _cut(good, tmp_path)
  code, out, err = _cli(["report", cut], capsys)
  assert code == 0
  assert len(err) == 1 and err[0].startswith("wavetune report: warning: ")
  assert "truncated" in err[0] and "rows before the cut" in err[0]
  assert "geomean speedup of the oracle" in out
  _, rows = sweep.read_sweep(cut)
  problems = {r["key"].split("|")[0] for r in rows}
  assert f"{len(problems)} problems" in out
  assert "cut off at its end" in build_parser()._subparsers._group_actions[0] \
      .choices["report"].description
  code, out, err = _cli(["report", good], capsys)  # an intact file: no warning
  assert code == 0 and err == []


def test_merge_refuses_a_cut_or_invalid_sweep_and_writes_nothing(good, tmp_path, capsys):
  into = tmp_path / "into.jsonl.gz"
  into.write_bytes(open(good, "rb").read())
  before = into.read_bytes()
  cut = _cut(good, tmp_path)
  assert "truncated" in _error(["merge", cut, "--into", str(into)], capsys)
  assert "truncated" in _error(["merge", str(into), "--into", cut], capsys)
  lines = _lines(good)
  lines[_first_pallas(lines)]["median_us"] = -1.0
  bad = _write(tmp_path / "bad.jsonl.gz", lines)
  assert "median_us=-1.0" in _error(["merge", bad, "--into", str(into)], capsys)
  assert into.read_bytes() == before


@pytest.fixture
def no_matplotlib(monkeypatch):
  for name in list(sys.modules):
    if name == "matplotlib" or name.startswith("matplotlib."):
      monkeypatch.delitem(sys.modules, name)
  monkeypatch.setitem(sys.modules, "matplotlib", None)  # import raises ImportError


@pytest.mark.parametrize("argv", [
    ["plot", "matmul", "--sweep", "{good}", "--set", "n=256", "--out", "{tmp}/p.png"],
    ["report", "{good}", "--plot", "{tmp}/p.png"],
    ["eval", "--family", "matmul", "--sweep", "{good}", "--policy", "default",
     "--plot", "{tmp}/p.png"],
])
def test_plots_without_matplotlib_name_the_extra(argv, good, tmp_path, capsys, no_matplotlib):
  msg = _error([a.format(good=good, tmp=tmp_path) for a in argv], capsys)
  assert 'pip install "wavetune-jax[report]"' in msg
  assert not (tmp_path / "p.png").exists()


def _options_of(command):
  sub = build_parser()._subparsers._group_actions[0].choices[command]
  return {o for a in sub._actions for o in a.option_strings}


def test_measuring_commands_on_a_cpu_name_options_that_exist(capsys):
  import re
  for command in ("sweep", "tune"):
    msg = _error([command, "--family", "matmul"], capsys)
    assert "no GPU here" in msg and "preset" not in msg, msg
    named = re.findall(r"wavetune (\w+)((?: (?:--[\w-]+|[A-Z]+))*)", msg)
    options = re.findall(r"--[\w-]+", msg)
    assert options, msg
    for cmd, opts in named:  # options after a command name are that command's
      assert set(re.findall(r"--[\w-]+", opts)) <= _options_of(cmd), (cmd, opts)
    if command == "tune":
      assert set(options) <= _options_of("tune"), msg


@pytest.mark.parametrize("argv,match", [
    (["select", "matmul", "--m", "100000000000000000000", "--n", "64", "--k", "64",
      "--device", "h100"], "--m: 100000000000000000000 is too large"),
    (["select", "matmul", "--m", "-5", "--n", "64", "--k", "64", "--device", "h100"],
     "--m: -5 is not an integer >= 1"),
    (["select", "matmul", "--m", "1.5", "--device", "h100"], "--m: '1.5' is not an integer"),
    (["select", "matmul", "--m", "16", "--n", "64", "--k", "64", "--device", "h100",
      "--set", "bogus=3"], "unknown MatmulProblem field(s) ['bogus']"),
    (["select", "matmul", "--m", "16", "--n", "64", "--k", "64", "--device", "h100",
      "--set", "dtype=int3"], "dtype='int3'"),
    (["select", "attention", "--m", "16", "--device", "h100", "--set", "q_heads=8",
      "--set", "kv_heads=8", "--set", "batch=100000000000000000000000"],
     "--set batch=100000000000000000000000: too large"),
    (["select", "conv", "--m", "16"], "invalid choice: 'conv'"),
    (["select", "matmul", "--m", "16", "--n", "64", "--k", "64", "--device", "tpu"],
     "invalid choice: 'tpu'"),
    (["select", "matmul", "--m", "16", "--n", "64", "--k", "64", "--device", "h100",
      "--table", "{tmp}/missing.json"], "no file"),
    (["select", "matmul", "--m", "16", "--n", "64", "--k", "64", "--device", "h100",
      "--table", "{tmp}/bad.json"], "not readable JSON"),
    (["select", "matmul", "--m", "16", "--n", "64", "--k", "64", "--device", "h100",
      "--table", TABLE], "is for 'nvidia_h200'"),
    (["report", "{tmp}/missing.jsonl.gz"], "no file"),
    (["tune", "--family", "matmul", "--replay", "{good}", "--out", "{tmp}"], "is a folder"),
    (["tune", "--family", "matmul", "--replay", "{good}", "--fit-only", "--anchors",
      "{good}"], "give one of them"),
    (["tune", "--family", "matmul", "--replay", "{good}", "--m", "16"],
     "--m does not apply"),
    (["tune", "--family", "matmul", "--fit-only", "--anchors", "{tmp}/missing.jsonl.gz"],
     "no such file"),
    (["eval", "--family", "matmul", "--sweep", "{good}", "--plot", "{tmp}/no/p.png"],
     "no folder"),
    (["plot", "matmul", "--sweep", "{good}", "--set", "n=256", "--out", "{tmp}"],
     "is a folder"),
    (["bench", "model", "--model", "small", "--json", "{tmp}/no/rows.json"], "no folder"),
])
def test_cli_errors_are_one_line(argv, match, good, tmp_path, capsys):
  (tmp_path / "bad.json").write_text("{not json")
  msg = _error([a.format(good=good, tmp=tmp_path) for a in argv], capsys)
  assert match in msg, msg


def test_an_os_error_is_one_line_and_wavetune_debug_shows_the_traceback(
    good, tmp_path, capsys, monkeypatch):
  import wavetune_jax.cli.tune as tune_cli

  def fail(*a, **k):
    raise PermissionError(13, "Permission denied", str(tmp_path / "t.json"))
  monkeypatch.setattr(tune_cli, "_write_table", fail)
  argv = ["tune", "--family", "matmul", "--replay", good, "--budget", "50",
          "--out", str(tmp_path / "t.json")]
  assert _error(argv, capsys) == (f"wavetune tune: error: {tmp_path / 't.json'}: "
                                  f"Permission denied")
  monkeypatch.setenv("WAVETUNE_DEBUG", "1")
  with pytest.raises(PermissionError):
    cli_main(argv)


@pytest.mark.parametrize("value", ["12", float("nan"), -1.0])
def test_report_refuses_a_sweep_with_a_bad_row_in_one_line(good, tmp_path, capsys, value):
  lines = _lines(good)
  _edit_row("median_us", value)(lines)
  bad = _write(tmp_path / "bad.jsonl.gz", lines)
  assert "median_us" in _error(["report", bad], capsys)


def test_a_resumed_sweep_with_a_bad_row_is_refused(good, tmp_path):
  lines = _lines(good)
  _edit_row("median_us", "12")(lines)
  bad = _write(tmp_path / "bad.jsonl.gz", lines)
  with pytest.raises(sweep.SweepError, match="median_us"):
    sweep.SweepFile(bad, lines[0])
  not_a_sweep = _write(tmp_path / "list.jsonl.gz", [[1, 2], {"type": "row"}])
  with pytest.raises(sweep.SweepError, match="not a sweep file"):
    sweep.SweepFile(not_a_sweep, lines[0])


def test_a_tables_folder_of_another_package_is_not_the_shipped_one(tmp_path, monkeypatch):
  # Installed: site-packages/wavetune_jax/shipped_tables. A site-packages/tables
  # folder (PyTables) beside the package must not be taken for a checkout's.
  site = tmp_path / "site-packages"
  pkg = site / "wavetune_jax" / "runtime"
  pkg.mkdir(parents=True)
  (site / "tables" / "nvidia_h200").mkdir(parents=True)
  monkeypatch.setattr(tables, "__file__", str(pkg / "tables.py"))
  assert tables.shipped_dir() == str(site / "wavetune_jax" / "shipped_tables")
  (site / "wavetune_jax" / "shipped_tables").mkdir()
  assert tables.shipped_dir() == str(site / "wavetune_jax" / "shipped_tables")
  # A source checkout (setup.py beside tables/) reads tables/.
  (site / "setup.py").write_text("")
  (site / "wavetune_jax" / "shipped_tables").rmdir()
  assert tables.shipped_dir() == str(site / "tables")


def test_a_broken_user_table_falls_back_to_the_shipped_one(tmp_path):
  # A stale or corrupt table of the user's folder (a retune cut short, an
  # older schema) must not turn the shipped table off.
  from wavetune_jax.runtime import tables as tables_lib
  user = tmp_path / "xdg" / "wavetune" / "tables" / "nvidia_h200"
  user.mkdir(parents=True)
  (user / "matmul.json").write_text('{"schema": 1}')
  assert tables_lib.default_path("matmul", "nvidia_h200") == str(user / "matmul.json")
  with pytest.warns(UserWarning, match="using the shipped table"):
    t = selector.active_table("matmul", "h200")
  assert t is not None and t.device_key == "nvidia_h200"
