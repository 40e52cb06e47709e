"""benchmarks/first_use_cost.py on a CPU: the plan (problems new to the
shipped tables, cache folders shared by a library's two processes and by no
one else), the ops it compares computing the same thing, the table from
recorded rows, one-line argument errors, and a whole run of one family."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "first_use_cost.py")
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
import first_use_cost as fuc  # noqa: E402

SMALL = {
    "matmul": dict(m=24, n=64, k=32),
    "attention": dict(q_len=40, q_heads=4, kv_heads=2, head_dim=32),
    "decode": dict(batch=3, kv_len=64, q_heads=4, kv_heads=2, head_dim=32),
    "ragged_dot": dict(m=24, g=4, k=32, n=64),
}


def _run(*args, timeout=120):
  env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
  return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True,
                        env=env, timeout=timeout)


def test_dry_run_plans_new_problems_and_times_nothing(tmp_path):
  work = tmp_path / "work"
  for key in ("nvidia_h100_80gb_hbm3", "nvidia_h200"):
    out = _run("--dry-run", "--work-dir", str(work), "--device-key", key)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.splitlines()
    # Every default problem is new to both GPUs' shipped tables.
    problems = [x for x in lines if x.startswith("  ") and x.split()[0] in fuc.FAMILIES]
    assert len(problems) == 4 and all(x.rstrip().endswith(" new") for x in problems), lines
    assert "processes (16," in out.stdout
    assert sum("--worker" in x for x in lines) == 16
  assert not work.exists()  # a dry run creates nothing


def test_default_problems_are_not_in_the_shipped_tables():
  for key in ("nvidia_h100_80gb_hbm3", "nvidia_h200"):
    for family, problems in fuc.DEFAULT_PROBLEMS.items():
      known = fuc.shipped_problems(family, key)
      assert known, (family, key)  # the table exists and holds problems
      for fields in problems:
        assert fuc.problem_of(family, fields) not in known, (family, fields, key)
  # (and the check can fail: a shipped anchor is reported as known)
  p = next(iter(fuc.shipped_problems("matmul", "nvidia_h100_80gb_hbm3")))
  assert p in fuc.shipped_problems("matmul", "nvidia_h100_80gb_hbm3")


def test_plan_shares_caches_between_a_librarys_two_processes_only(tmp_path):
  a = fuc.parse_args(["--families", "matmul,decode", "--problem", "decode:batch=2,kv_len=64,"
                      "q_heads=4,kv_heads=2"])
  base = {"XLA_FLAGS": "--xla_gpu_autotune_level=0 --xla_dump_to=/x", "PATH": "/bin"}
  procs = fuc.build_plan(a, str(tmp_path), base)
  assert [(p["family"], p["lib"], p["stage"]) for p in procs] == [
      (f, lib, st) for f in ("matmul", "decode") for lib in ("xla", "wt") for st in (1, 2)]
  seen = {}
  for p in procs:
    # XLA's default autotune level is timed; other flags are kept.
    assert p["env"]["XLA_FLAGS"] == "--xla_dump_to=/x"
    assert p["env"]["CUDA_CACHE_PATH"] == p["caches"]["cuda"]
    if p["lib"] == "wt":
      assert p["env"]["WAVETUNE_TABLE_CACHE"] == p["caches"]["tables"]
      assert p["env"]["WAVETUNE_KERNEL_CACHE"] == p["caches"]["kernels"]
    else:
      assert p["env"]["WAVETUNE_TABLE_CACHE"] == p["env"]["WAVETUNE_KERNEL_CACHE"] == "off"
    seen.setdefault((p["family"], p["lib"]), []).append(p)
    # The worker reads back what the plan means.
    w = fuc.parse_args(p["argv"][2:])
    assert (w.worker, w.lib, w.stage, w.families) == (True, p["lib"], p["stage"], [p["family"]])
    assert w.jax_cache == p["caches"]["jax"]
    assert json.loads(w.problems_json) == a.problems[p["family"]]
    assert (w.policy == "refine") if p["lib"] == "wt" else "--policy" not in p["argv"]
  folders = []
  for (fam, lib), (p1, p2) in seen.items():
    assert p1["caches"] == p2["caches"] and p1["env"] == p2["env"]
    folders += list(p1["caches"].values())
    assert all(v.startswith(str(tmp_path)) for v in p1["caches"].values())
  assert len(set(folders)) == len(folders)  # no folder shared by two libraries or families
  assert a.problems == {"matmul": fuc.DEFAULT_PROBLEMS["matmul"],
                        "decode": [dict(batch=2, kv_len=64, q_heads=4, kv_heads=2)]}
  no_kc = fuc.build_plan(fuc.parse_args(["--families", "matmul", "--no-kernel-cache"]),
                         str(tmp_path), {})
  assert [p["env"]["WAVETUNE_KERNEL_CACHE"] for p in no_kc if p["lib"] == "wt"] == ["off"] * 2
  assert all("XLA_FLAGS" not in p["env"] for p in no_kc)


@pytest.mark.parametrize("family", fuc.FAMILIES)
def test_compared_ops_compute_the_same(family):
  """The platform op and the wavetune op of a family take the same arrays and
  agree; the problem the op derives is the one the plan checks."""
  import jax
  fields = SMALL[family]
  fn_x, args_x, p_x = fuc.make(family, "xla", fields)
  fn_w, args_w, p_w = fuc.make(family, "wt", fields)
  assert p_x == p_w == fuc.problem_of(family, fields)
  for x, y in zip(args_x, args_w):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  ref = np.asarray(jax.jit(fn_x)(*args_x), np.float32)
  got = np.asarray(jax.jit(fn_w)(*args_w), np.float32)
  assert np.isfinite(ref).all()
  np.testing.assert_allclose(got, ref, rtol=3e-2, atol=3e-2)


def _row(lib, stage, total, **kw):
  return dict(family="matmul", lib=lib, stage=stage, nth=0, problem=dict(m=1, n=2, k=3),
              total_s=total, jax_cache={"hits": 0, "misses": 1}, **kw)


def _recorded(measured_2=0):
  wt = dict(backend="mosaic", select_us=41.0)
  return [
      dict(family="matmul", lib="xla", stage=1, rows=[_row("xla", 1, 0.70)]),
      dict(family="matmul", lib="xla", stage=2, rows=[_row("xla", 2, 0.05)]),
      dict(family="matmul", lib="wt", stage=1, rows=[_row(
          "wt", 1, 2.50, refine=dict(measured=1, seconds=1.75, reused=0), **wt)]),
      dict(family="matmul", lib="wt", stage=2, rows=[_row(
          "wt", 2, 0.08, refine=dict(measured=measured_2, seconds=0.0, reused=1), **wt)]),
      dict(family="attention", lib="xla", stage=1, rows=[dict(
          _row("xla", 1, 0.30), family="attention", problem=dict(q_len=9))]),
      dict(family="attention", lib="xla", stage=2, error="exit status 1: boom"),
      dict(family="attention", lib="wt", stage=1, rows=[dict(
          _row("wt", 1, 0.40), family="attention", problem=dict(q_len=9), refine=None)]),
      dict(family="attention", lib="wt", stage=2, error="past 300 s"),
  ] + [dict(family="decode", lib=lib, stage=st, problems=[dict(batch=2)], error="no GPU")
       for lib in ("xla", "wt") for st in (1, 2)]


def test_summary_and_table_of_recorded_rows(tmp_path, capsys):
  s = fuc.summarize(_recorded())
  assert [x["family"] for x in s] == ["matmul", "attention", "decode"]
  m, at, dec = s
  assert (m["wt_first_s"], m["wt_measure_s"], m["xla_first_s"], m["wt_second_s"],
          m["xla_second_s"], m["measured_2"], m["reused_2"], m["select_us_2"]) == (
              2.50, 1.75, 0.70, 0.08, 0.05, 0, 1, 41.0)
  assert m["ok"] and not m["errors"]
  # A failed process leaves its columns empty and says why; no stats: None.
  assert (at["xla_first_s"], at["wt_first_s"], at["wt_measure_s"], at["xla_second_s"],
          at["wt_second_s"], at["measured_2"]) == (0.30, 0.40, None, None, None, None)
  assert not at["ok"] and at["errors"] == ["xla process 2: exit status 1: boom",
                                          "wt process 2: past 300 s"]
  # A family whose every process failed still has its row.
  assert dec["problem"] == dict(batch=2) and len(dec["errors"]) == 4 and not dec["ok"]
  assert dec["wt_first_s"] is dec["xla_first_s"] is None
  table = fuc.format_table(s).splitlines()
  assert table[2].split() == ["matmul", "m=1", "n=2", "k=3", "2.50", "[1.75]", "0.70", "0.08",
                              "0.05", "0", "41", "mosaic"]
  assert table[3].split()[:8] == ["attention", "q_len=9", "0.40", "[-]", "0.30", "-", "-", "-"]
  assert table[4:6] == ["  failed: xla process 2: exit status 1: boom",
                        "  failed: wt process 2: past 300 s"]
  assert table[6].split() == ["decode", "batch=2", "-", "[-]"] + ["-"] * 6
  assert table[7:] == [f"  failed: {lib} process {st}: no GPU"
                       for lib in ("xla", "wt") for st in (1, 2)]
  # A second process that measured again is a failure, marked in the table.
  bad = fuc.summarize(_recorded(measured_2=1))[0]
  assert not bad["ok"] and "1 FAIL" in fuc.format_table([bad])
  # --from-json prints the table of a recorded run.
  path = tmp_path / "run.json"
  path.write_text(json.dumps({"runs": _recorded()}))
  assert fuc.main(["--from-json", str(path)]) == 0
  assert capsys.readouterr().out.splitlines() == table


@pytest.mark.parametrize("argv, says", [
    (["--families", "matmul,gemm"], "--families 'matmul,gemm': unknown 'gemm'"),
    (["--families", "matmul,matmul"], "a family given twice"),
    (["--problem", "matmul"], "expected FAMILY:field=value"),
    (["--problem", "gemm:m=1"], "unknown family 'gemm'"),
    (["--problem", "matmul:m=1,n=2"], "missing k"),
    (["--problem", "matmul:m=1,n=2,k=0"], "k='0' is not a positive integer"),
    (["--problem", "matmul:m=1,n=2,k=x"], "k='x' is not a positive integer"),
    (["--problem", "matmul:m=1,n=2,k=3,q=4"], "'q=4' is not field=value"),
    (["--problem", "matmul:m=1,m=2,n=2,k=3"], "m given twice"),
    (["--problem", "attention:q_len=8,q_heads=3,kv_heads=2"], "kv_heads=2 must divide q_heads=3"),
    (["--families", "matmul", "--problem", "decode:batch=1,kv_len=8,q_heads=2,kv_heads=1"],
     "decode is not in --families"),
    (["--problem", "matmul:m=1,n=2,k=3", "--problem", "matmul:k=3,n=2,m=1"], "given twice"),
    (["--timeout", "0"], "--timeout 0: must be >= 1"),
    (["--budget", "0"], "--budget 0: must be >= 1"),
    (["--bogus"], "unrecognized arguments: --bogus"),
    (["--set", "KIT_THREADS=0"], "--set takes module:NAME=value, got 'KIT_THREADS=0'"),
    (["--set", "wavetune_jax.runtime.refine:NO_SUCH=1"], "wavetune_jax.runtime.refine has no "
                                                         "NO_SUCH"),
    (["--set", "wavetune_jax.runtime.refine:KIT_THREADS=one"], "'one' is not a int"),
    (["--policy", "fastest"], "--policy 'fastest': this wavetune_jax's policies are"),
    (["--from-json", "/nonexistent/run.json"], "--from-json /nonexistent/run.json: not a "
                                               "recorded run"),
])
def test_argument_errors_are_one_line(argv, says):
  with pytest.raises(SystemExit) as e:
    fuc.main(argv)
  msg = e.value.code
  assert isinstance(msg, str) and "\n" not in msg, msg
  assert msg.startswith("first_use_cost.py: error: ") and says in msg, msg


def test_set_reaches_the_wavetune_processes_only(tmp_path):
  a = fuc.parse_args(["--families", "matmul", "--set", "wavetune_jax.runtime.refine:KIT_THREADS=0",
                      "--set", "wavetune_jax.runtime.refine:COMPILE_THREADS=3"])
  assert a.patches == [("wavetune_jax.runtime.refine", "KIT_THREADS", 0),
                       ("wavetune_jax.runtime.refine", "COMPILE_THREADS", 3)]
  procs = fuc.build_plan(a, str(tmp_path), {})
  for p in procs:
    sets = [p["argv"][i + 1] for i, x in enumerate(p["argv"]) if x == "--set"]
    assert sets == (a.set if p["lib"] == "wt" else []), p
  worker = fuc.parse_args(procs[-1]["argv"][2:])
  assert worker.worker and worker.patches == a.patches


def test_cpu_run_of_one_family(tmp_path):
  """The four processes run, report and are summarized; process 2 of each
  library reads what process 1 left (XLA's compile from the persistent cache,
  wavetune's tables from the table cache) and measures nothing."""
  out_json = tmp_path / "run.json"
  patch = "wavetune_jax.runtime.refine:KIT_THREADS=0"
  out = _run("--families", "matmul", "--problem", "matmul:m=24,n=64,k=32", "--work-dir",
             str(tmp_path / "work"), "--json", str(out_json), "--set", patch)
  assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
  assert f"set {patch}, " in out.stdout
  rec = json.loads(out_json.read_text())
  assert rec["set"] == [patch]
  runs = {(r["lib"], r["stage"]): r for r in rec["runs"]}
  assert sorted(runs) == [("wt", 1), ("wt", 2), ("xla", 1), ("xla", 2)]
  rows = {k: r["rows"][0] for k, r in runs.items()}
  for k, x in rows.items():
    assert x["problem"] == dict(m=24, n=64, k=32), k
    assert x["total_s"] == pytest.approx(x["trace_s"] + x["lower_s"] + x["compile_s"]
                                         + x["first_s"]), k
  for lib in ("xla", "wt"):
    assert rows[lib, 1]["jax_cache"]["misses"] >= 1 and rows[lib, 1]["jax_cache"]["hits"] == 0
    assert rows[lib, 2]["jax_cache"] == {"hits": rows[lib, 1]["jax_cache"]["misses"],
                                         "misses": 0}, lib
  assert rows["wt", 1]["table_cache"]["hits"] == 0 and rows["wt", 2]["table_cache"]["hits"] >= 1
  # The selection alone was a real decision (not the trace's memoized one).
  assert rows["wt", 2]["select_decisions"] == 1 and rows["wt", 2]["select_us"] > 0
  (s,) = rec["summary"]
  assert s["ok"] and s["measured_2"] in (0, None)
  assert s["xla_first_s"] == rows["xla", 1]["total_s"]
  assert s["wt_second_s"] == rows["wt", 2]["total_s"]
  assert "matmul     m=24 n=64 k=32" in out.stdout


def test_budget_bounds_the_run(tmp_path):
  """Past --budget, the running process is stopped and the rest skipped: the
  run ends, reports each, and fails."""
  out_json = tmp_path / "run.json"
  out = _run("--families", "matmul", "--problem", "matmul:m=24,n=64,k=32", "--budget", "1",
             "--json", str(out_json), timeout=60)
  assert out.returncode == 1, out.stdout + out.stderr
  runs = json.loads(out_json.read_text())["runs"]
  # Process 1 gets the whole second: on a fast machine it may finish in it
  # (no error), else it is stopped. Either way the budget is then spent, and
  # every later process is skipped without starting.
  first = runs[0].get("error")
  assert first in (None, "stopped at --budget 1 s"), first
  assert [r.get("error") for r in runs[1:]] == ["skipped: past --budget 1 s"] * 3
  assert all(r["process_s"] == 0.0 for r in runs[1:])
  (s,) = json.loads(out_json.read_text())["summary"]
  assert not s["ok"] and s["problem"] == dict(m=24, n=64, k=32)
  assert len(s["errors"]) == 3 + (first is not None)


def test_stats_delta():
  assert fuc.stats_delta({"measured": 1, "seconds": 0.5, "reused": 0, "what": "x"},
                         {"measured": 3, "seconds": 2.0, "reused": 1, "what": "y"}) == {
                             "measured": 2, "seconds": 1.5, "reused": 1, "what": None}
  assert fuc.stats_delta(None, {"measured": 1}) is None
  # Refinement's seconds by measuring phase, per phase (new phases from 0).
  assert fuc.stats_delta({"phases": {"compile": 1.0}},
                         {"phases": {"compile": 3.5, "check_and_time": 2.0}}) == {
                             "phases": {"compile": 2.5, "check_and_time": 2.0}}
  row = dict(family="ragged_dot", problem=dict(m=24, g=4, k=32, n=64), wt_first_s=9.2,
             wt_measure_s=7.6, wt_measure_phases={"compile": 5.0, "check_and_time": 2.5},
             xla_first_s=2.4, wt_second_s=0.25, xla_second_s=0.14, measured_2=0,
             select_us_2=226.0, backend="mosaic", errors=[])
  table = fuc.format_table([row])
  assert "wt first use's measuring: compile 5.00 s, check and time 2.50 s" in table
  assert "measuring" not in fuc.format_table([dict(row, wt_measure_phases=None)]).split("\n")[-1]


def test_kernel_cache_loads_mosaic_kernels_in_a_second_process_on_record():
  """docs/xla_autotuning.md ("The kernel cache"): after a loaded Mosaic
  kernel imports Mosaic GPU's runtime first, the H200 runs that had failed in
  their second process ("Failed to lookup host symbol ... kernel_mosaic_gpu")
  load every kernel from the cache and measure nothing."""
  e2e = os.path.join(ROOT, "data", "e2e")
  with open(os.path.join(e2e, "first_use_kernel_cache_h200.json")) as f:
    fu = json.load(f)
  assert fu["kernel_cache"] is True
  (row,) = fu["summary"]
  assert row["ok"] and not row["errors"] and row["backend"] == "mosaic"
  assert row["measured_2"] == 0 and row["reused_2"] == 1
  second = [r for run in fu["runs"] if run["lib"] == "wt" and run["stage"] == 2
            for r in run["rows"]]
  assert [r["kernel_cache"]["loads"] for r in second] == [1]
  assert all(r["kernel_cache"]["errors"] == 0 for r in second)
  with open(os.path.join(e2e, "compile_cost_kernel_cache_after_h200.json")) as f:
    cc = json.load(f)
  warm = [p for p in cc if p["lib"] == "wt" and p["state"] == "warm"]
  assert len(warm) == 1
  stats = warm[0]["rows"][-1]["kernel_cache"]  # the process's running counts
  assert stats == {"hits": 8, "misses": 0, "loads": 4, "errors": 0}
  assert [round(r["trace_ms"] + r["lower_ms"] + r["compile_ms"] + r["first_ms"], 1)
          for r in warm[0]["rows"]] == [248.4, 28.7, 62.3, 48.6]


def test_first_use_is_mostly_compiling_on_record(capsys):
  """docs/results.md ("On an H200"): a new grouped GEMM's first use measured
  by phase on an H200; the Mosaic kernels' compiles take most of it."""
  path = os.path.join(ROOT, "data", "e2e", "first_use_phases_h200.json")
  assert fuc.main(["--from-json", path]) == 0
  out = capsys.readouterr().out
  assert "wt first use's measuring: compile 6.04 s, setup 0.32 s, check and time 0.15 s" in out
  assert "wt first use's measuring: compile 1.85 s, setup 0.01 s, check and time 0.32 s" in out
  with open(path) as f:
    rows = {r["family"]: r for r in json.load(f)["summary"]}
  assert round(rows["ragged_dot"]["wt_first_s"], 2) == 7.88
  assert round(rows["ragged_dot"]["xla_first_s"], 2) == 2.21


@pytest.mark.parametrize("name,lines", [
    ("first_use_rd_sums_h200.json",
     ["ragged_dot m=2200 g=8 k=4096 n=28672                                     7.50 [6.20]"
      "            2.20",
      "compile 5.68 s, lowering summed 6.06 s, compiling summed 6.42 s, setup 0.32 s, "
      "check and time 0.17 s"]),
    ("first_use_rd_tables_h200.json",
     ["ragged_dot m=2200 g=8 k=4096 n=28672                                     2.04 [0.00]"
      "            2.03"]),
    ("first_use_attn_decode_h200.json",
     ["compile 1.93 s, setup 0.01 s, check and time 0.35 s",
      "compile 2.46 s, setup 0.01 s, check and time 0.51 s"]),
    ("first_use_pipelined_h200.json",
     ["compile 1.36 s, lowering summed 0.35 s, compiling summed 2.64 s",
      "compile 1.92 s, lowering summed 0.66 s, compiling summed 5.00 s",
      "compile 2.20 s, lowering summed 1.30 s, compiling summed 6.79 s",
      "compile 6.17 s, lowering summed 2.74 s, compiling summed 10.70 s"]),
    ("first_use_rd_nokc_h200.json",
     ["compile 6.39 s, lowering summed 2.99 s, compiling summed 11.40 s"]),
    # a thread for each kit (on a fresh machine), then without and with it
    ("first_use_threads_h200.json",
     ["compile 1.75 s, lowering summed 0.42 s, compiling summed 3.36 s",
      "compile 2.55 s, lowering summed 0.81 s, compiling summed 7.07 s",
      "compile 2.69 s, lowering summed 1.84 s, compiling summed 6.96 s",
      "compile 5.05 s, lowering summed 2.44 s, compiling summed 9.56 s"]),
    ("first_use_kit0_h200.json",
     ["compile 1.60 s, lowering summed 0.42 s, compiling summed 3.03 s",
      "compile 2.13 s, lowering summed 0.68 s, compiling summed 5.16 s",
      "compile 2.24 s, lowering summed 1.61 s, compiling summed 6.29 s",
      "compile 4.31 s, lowering summed 2.13 s, compiling summed 7.80 s"]),
    ("first_use_kit1_h200.json",
     ["compile 1.31 s, lowering summed 0.30 s, compiling summed 2.85 s",
      "compile 1.85 s, lowering summed 0.56 s, compiling summed 5.01 s",
      "compile 2.10 s, lowering summed 1.43 s, compiling summed 5.91 s",
      "compile 5.93 s, lowering summed 2.43 s, compiling summed 11.81 s"]),
])
def test_first_use_by_phase_on_record(name, lines, capsys):
  """docs/results.md ("On an H200", "Where the compile phase goes"): the
  recorded H200 runs as the script prints them."""
  assert fuc.main(["--from-json", os.path.join(ROOT, "data", "e2e", name)]) == 0
  out = capsys.readouterr().out
  for line in lines:
    assert line in out, line


def test_kit_threads_runs_on_record():
  """docs/results.md ("A thread for each kit"): the runs with and without
  the kit threads, their first-use and XLA seconds, and the second run's
  XLA attention and decode compiled from a cache outside the run."""
  runs = {}
  for name in ("first_use_threads_h200", "first_use_kit0_h200", "first_use_kit1_h200"):
    with open(os.path.join(ROOT, "data", "e2e", name + ".json")) as f:
      rec = json.load(f)
    runs[name] = {r["family"]: (round(r["wt_first_s"], 2), round(r["xla_first_s"], 2))
                  for r in rec["summary"]}
    assert rec.get("set", []) == (["wavetune_jax.runtime.refine:KIT_THREADS=0"]
                                  if name.endswith("kit0_h200") else []), name
  assert runs["first_use_threads_h200"] == {"matmul": (2.32, 0.78), "attention": (3.13, 1.01),
                                            "decode": (4.21, 0.58), "ragged_dot": (6.82, 2.31)}
  assert runs["first_use_kit0_h200"] == {"matmul": (2.09, 0.64), "attention": (2.56, 1.35),
                                         "decode": (3.67, 0.67), "ragged_dot": (6.11, 2.08)}
  assert runs["first_use_kit1_h200"] == {"matmul": (1.80, 0.52), "attention": (2.25, 0.15),
                                         "decode": (3.41, 0.12), "ragged_dot": (7.82, 2.06)}
