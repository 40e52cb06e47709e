"""Sweep logic with a fake timer: resume after a kill, failures, header, report."""

import gzip
import os

import pytest

from synthetic import HW, FakeMeasure, header, wave_us
from synthetic import MATMUL
from wavetune_jax import MatmulProblem
from wavetune_jax.tuning import report, sweep

PROBLEMS = [MatmulProblem(m=m, n=256, k=512) for m in (1, 100, 1000)]
_header = header
fake_us = wave_us


def test_resume_after_kill_measures_nothing_twice(tmp_path):
  path = str(tmp_path / "s.jsonl.gz")
  total = sum(len(sweep.sweep_configs(MATMUL, p, HW)) for p in PROBLEMS)
  first = FakeMeasure(crash_after=total // 2)
  with pytest.raises(KeyboardInterrupt):
    sweep.run_sweep(MATMUL, PROBLEMS, HW, sweep.SweepFile(path, _header()), first)
  header, rows = sweep.read_sweep(path)
  kept = [r for r in rows if r["impl"] == "pallas"]
  assert len(kept) == total // 2  # everything measured before the kill is on file
  second = FakeMeasure()
  counts = sweep.run_sweep(MATMUL, PROBLEMS, HW, sweep.SweepFile(path, _header()), second)
  assert counts["skipped"] >= total // 2
  measured_twice = set(map(repr, first.calls)) & set(map(repr, second.calls))
  assert not measured_twice
  _, rows = sweep.read_sweep(path)
  keys = [r["key"] for r in rows if r["impl"] in ("pallas", "baseline")]
  assert len(keys) == len(set(keys)) == total + len(PROBLEMS)
  # A third run finds nothing to do.
  third = FakeMeasure()
  sweep.run_sweep(MATMUL, PROBLEMS, HW, sweep.SweepFile(path, _header()), third)
  assert third.calls == []


def test_truncated_file_is_repaired(tmp_path):
  path = str(tmp_path / "s.jsonl.gz")
  sweep.run_sweep(MATMUL, PROBLEMS[:1], HW, sweep.SweepFile(path, _header()), FakeMeasure())
  _, rows = sweep.read_sweep(path)
  # Simulate a kill in the middle of writing a batch: a cut gzip member.
  with open(path, "ab") as f:
    f.write(gzip.compress(b'{"type": "row", "key": "x"}\n' * 50)[:40])
  f2 = sweep.SweepFile(path, _header())
  _, rows2 = sweep.read_sweep(path)
  assert rows2[:len(rows)] == rows  # complete lines survive, the cut one is gone
  assert f2.n_rows == len(rows2)
  # The repaired file takes appends and reads back whole.
  f2.append([{"type": "row", "key": "after"}])
  assert sweep._read_lines(path)[1] is True
  assert sweep.read_sweep(path)[1][-1]["key"] == "after"


def test_header_and_failures_recorded(tmp_path):
  path = str(tmp_path / "s.jsonl.gz")
  sweep.run_sweep(MATMUL, PROBLEMS, HW, sweep.SweepFile(path, _header()), FakeMeasure())
  header, rows = sweep.read_sweep(path)
  assert header["kernel"] == "matmul" and header["device_key"] == HW.device_key
  assert header["num_sms"] == 132 and header["schema"] == sweep.SCHEMA
  assert header["command"] == "wavetune sweep (test)" and header["date"]
  fails = [r for r in rows if r["status"] == "compile_error"]
  assert fails and all(r["error"].startswith("OutOfResources") and r["median_us"] is None
                       for r in fails)


def test_foreign_file_is_refused(tmp_path):
  path = str(tmp_path / "s.jsonl.gz")
  sweep.SweepFile(path, _header())
  other = dict(_header(), device_key="nvidia_h200")
  with pytest.raises(ValueError, match="device_key='nvidia_h100_80gb_hbm3'"):
    sweep.SweepFile(path, other)
  bad = str(tmp_path / "bad.jsonl.gz")
  with open(bad, "wb") as f:
    f.write(b"not gzip")
  with pytest.raises(ValueError, match="not a sweep file"):
    sweep.read_sweep(bad)


def test_report_finds_known_oracle(tmp_path):
  path = str(tmp_path / "s.jsonl.gz")
  sweep.run_sweep(MATMUL, PROBLEMS, HW, sweep.SweepFile(path, _header()), FakeMeasure())
  header, rows = sweep.read_sweep(path)
  summaries, facts = report.summarize(header, rows)
  for s in summaries:
    ok = [c for c in sweep.sweep_configs(MATMUL, s.problem, HW)
          if hash((s.problem, c)) % 7 != 0]
    best = min(ok, key=lambda c: fake_us(s.problem, c))
    assert s.oracle_us == pytest.approx(fake_us(s.problem, best))
    assert s.baseline_us == 5.0
    assert s.worst_us >= s.oracle_us
    # The default config is measured on every problem, in the space or not.
    if hash((s.problem, MATMUL.default(s.problem))) % 7:
      assert s.default_us == pytest.approx(fake_us(s.problem, MATMUL.default(s.problem)))
  png = str(tmp_path / "waves.png")
  text = report.render(path, plot=png)
  assert "geomean speedup of the oracle" in text and "compile_error" in text
  assert os.path.getsize(png) > 1000


def test_problem_cut_short_is_left_out_of_dataset_and_geomeans(tmp_path):
  from wavetune_jax.tuning import evaluate
  path = str(tmp_path / "s.jsonl.gz")
  n0 = len(sweep.sweep_configs(MATMUL, PROBLEMS[0], HW))
  with pytest.raises(KeyboardInterrupt):
    sweep.run_sweep(MATMUL, PROBLEMS, HW, sweep.SweepFile(path, _header()),
                    FakeMeasure(crash_after=n0 + 5))
  with pytest.warns(UserWarning, match=r"1 problem\(s\) swept only in part"):
    ds = evaluate.load_dataset(path)
  assert ds.problems == [PROBLEMS[0]]
  text = report.render(path)
  assert "1 problem(s) swept in part" in text
  partial_line, = [l for l in text.splitlines() if l.startswith(MATMUL.problem_key(PROBLEMS[1]))]
  assert "5*" in partial_line.split()[1]


def test_merge_takes_whole_problems_from_the_newer_file(tmp_path):
  a, b = str(tmp_path / "a.jsonl.gz"), str(tmp_path / "b.jsonl.gz")
  sweep.run_sweep(MATMUL, PROBLEMS[:2], HW, sweep.SweepFile(a, _header()), FakeMeasure())
  h = _header()
  h["command"] = "second run"
  sweep.run_sweep(MATMUL, PROBLEMS[1:], HW, sweep.SweepFile(b, h), FakeMeasure())
  _, rows_b = sweep.read_sweep(b)
  assert sweep.merge_sweeps(a, b) == (1, 1)  # PROBLEMS[1] replaced, PROBLEMS[2] added
  header, rows = sweep.read_sweep(a)
  assert header["merged"][0]["command"] == "second run"
  keys = [r["key"] for r in rows]
  assert len(keys) == len(set(keys))  # no problem holds rows of two runs
  pk1 = MATMUL.problem_key(PROBLEMS[1])
  assert [r for r in rows if r["key"].startswith(pk1 + "|")] == [
      r for r in rows_b if r["key"].startswith(pk1 + "|")]
  assert {r["key"].split("|")[0] for r in rows} == {MATMUL.problem_key(p) for p in PROBLEMS}
  other = _header()
  other["kernel"] = "attention"
  c = str(tmp_path / "c.jsonl.gz")
  sweep.SweepFile(c, other)
  with pytest.raises(ValueError, match="cannot merge"):
    sweep.merge_sweeps(a, c)


def test_report_states_each_backends_best_against_the_baseline_and_oracle():
  # The recorded H100 sweep of the Mosaic decode space next to the Triton and
  # library rows of the same 38 problems.
  import os
  import re
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                      "data", "probes", "decode_mosaic_sweep_h100.jsonl.gz")
  text = report.render(path)
  found = re.findall(r"best (\w+) config: ([\d.]+)x cuDNN, ([\d.]+) of the oracle "
                     r"\(geomean over (\d+) problems\), the oracle of (\d+)", text)
  assert {f[0] for f in found} == {"cudnn", "mosaic", "triton"}, text[-800:]
  assert all(f[3] == "38" and 0 < float(f[2]) <= 1.0 for f in found)
  assert sum(int(f[4]) for f in found) == 38  # every problem's oracle is one backend's best
  cudnn = next(f for f in found if f[0] == "cudnn")
  assert float(cudnn[1]) == 1.0  # the baseline against itself


# --- speed references (the grouped GEMM's batched-GEMM bounds) -------------------------


def _rd_problems():
  from wavetune_jax import RaggedDotProblem
  return [RaggedDotProblem(m=m, g=8, k=256, n=512) for m in (4, 2048)]


def test_baseline_rows_a_file_lacks_are_the_only_ones_measured(tmp_path):
  # A file recorded before the batched-GEMM references existed (baseline
  # rows only): a rerun times the two references and nothing else.
  import jax
  from wavetune_jax import RAGGED_DOT
  from wavetune_jax.tuning import measure
  fam = RAGGED_DOT.with_backends(["mosaic", "xla"])
  probs = _rd_problems()
  path = str(tmp_path / "rd.jsonl.gz")
  hdr = sweep.make_header(fam, HW, jax_version=jax.__version__, command="test")

  def old(problem, configs, with_baseline):  # the measure of an older version
    for c in configs:
      yield "pallas", c, _ok(1.0)
    if with_baseline:
      yield "baseline", None, _ok(2.0)
  calls = []

  def new(problem, configs, with_baseline):
    calls.append((problem, list(configs), tuple(with_baseline)))
    for impl in with_baseline:
      yield impl, None, _ok(3.0)
  f = sweep.SweepFile(path, hdr, fam)
  todo, _ = sweep.plan_sweep(fam, probs, HW, f)
  assert [b for _, _, b in todo] == [("baseline", "baseline_batched",
                                      "baseline_batched_padded")] * 2
  # The old file: every config and the baseline row.
  f.append([sweep.make_row(fam, p, impl, c, m) for p in probs
            for impl, c, m in old(p, sweep.sweep_configs(fam, p, HW), True)])
  sweep.run_sweep(fam, probs, HW, sweep.SweepFile(path, hdr, fam), new)
  assert calls == [(p, [], ("baseline_batched", "baseline_batched_padded")) for p in probs]
  assert measure.baseline_impls(fam, probs[0]) == ["baseline", "baseline_batched",
                                                   "baseline_batched_padded"]
  calls.clear()
  sweep.run_sweep(fam, probs, HW, sweep.SweepFile(path, hdr, fam), new)
  assert calls == []


def _ok(us):
  from wavetune_jax.tuning.profiler import Measurement
  return Measurement(status="ok", median_us=us, spread_us=0.0, samples=5)


def test_batched_references_run_the_rows_of_the_problem():
  # Uniform: ceil(m / g) rows for each of min(g, m) experts; padded: every
  # expert at the largest group of the sweep's own inputs.
  import jax
  import jax.numpy as jnp
  import numpy as np
  from wavetune_jax import RAGGED_DOT, RaggedDotProblem
  p = RaggedDotProblem(m=1000, g=8, k=64, n=128)
  refs = RAGGED_DOT.speed_references(p)
  (fn, (xs, ws)), (_, (xp, wp)) = refs["batched"], refs["batched_padded"]
  assert (xs.shape, ws.shape) == ((8, 125, 64), (8, 64, 128))
  sizes = np.asarray(RAGGED_DOT.inputs(p, jax.random.PRNGKey(0))[2])
  assert xp.shape == (8, sizes.max(), 64) and sizes.sum() == 1000 and sizes.max() > 125
  small = RAGGED_DOT.speed_references(RaggedDotProblem(m=3, g=8, k=64, n=128))["batched"][1]
  assert [s.shape for s in small] == [(3, 1, 64), (3, 64, 128)]
  x = jax.random.normal(jax.random.PRNGKey(1), (2, 3, 64), jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(jax.random.PRNGKey(2), (2, 64, 128), jnp.float32).astype(jnp.bfloat16)
  want = jnp.stack([x[i].astype(jnp.float32) @ w[i].astype(jnp.float32) for i in range(2)])
  np.testing.assert_allclose(np.asarray(fn(x, w), np.float32), want, rtol=2e-2, atol=2e-2)


def test_problems_of_a_file_and_a_resumed_run_in_its_header(tmp_path):
  from wavetune_jax import RAGGED_DOT
  from wavetune_jax.cli.sweep import problems_of
  src = os.path.join(os.path.dirname(__file__), "..", "data", "sweeps",
                     "nvidia_h100_80gb_hbm3", "ragged_dot_bfloat16.jsonl.gz")
  probs = problems_of(RAGGED_DOT, src)
  assert len(probs) == len(set(probs)) == 195
  with pytest.raises(ValueError, match="is a sweep of 'ragged_dot', not 'matmul'"):
    problems_of(MATMUL, src)
  path = str(tmp_path / "s.jsonl.gz")
  f = sweep.SweepFile(path, _header())
  sweep.run_sweep(MATMUL, PROBLEMS[:1], HW, f, FakeMeasure())
  again = sweep.SweepFile(path, _header())
  again.record_run(dict(_header(), command="wavetune sweep (resumed)"))
  head, rows = sweep.read_sweep(path, strict=True)
  assert [e["command"] for e in head["resumed"]] == ["wavetune sweep (resumed)"]
  assert len(rows) == again.n_rows


def test_a_baseline_the_family_does_not_time_leaves_no_config_missing():
  # Attention's XLA config is measured by its baseline_xla row, which the
  # sweeps leave out where XLA's float32 score matrix would not fit: there
  # the problem is whole without it.
  from wavetune_jax import ATTENTION, AttentionProblem, get_hardware
  h100 = get_hardware("h100")
  small = AttentionProblem(batch=1, q_heads=32, kv_heads=8, q_len=4096, head_dim=128)
  big = AttentionProblem(batch=8, q_heads=8, kv_heads=1, q_len=16384, head_dim=128,
                         window_left=127, window_right=0)
  names = lambda p: {ATTENTION.backend_of(c).name for c in sweep.swept_space(ATTENTION, p, h100)}
  assert "xla" in names(small) and "xla" not in names(big)
  assert "xla" in {ATTENTION.backend_of(c).name for c in ATTENTION.space(big, h100)}
  assert names(big) - {"xla"} == {ATTENTION.backend_of(c).name
                                  for c in ATTENTION.space(big, h100)} - {"xla"}


def test_forget_drops_the_swept_backends_and_baseline_of_the_given_problems(tmp_path):
  # `wavetune sweep --remeasure`: a kernel changed, so its configs' rows (and
  # the platform baseline, to compare in the same run) of the selected
  # problems go; other problems, other backends and the extra baselines
  # stay, a rerun measures exactly what went, and the header lists the
  # problems until they are whole again.
  import jax
  from wavetune_jax import RAGGED_DOT
  fam = RAGGED_DOT.with_backends(["mosaic", "xla"])
  probs = _rd_problems()
  path = str(tmp_path / "rd.jsonl.gz")
  hdr = sweep.make_header(fam, HW, jax_version=jax.__version__, command="test")

  def measure(problem, configs, with_baseline):
    for c in configs:
      yield "pallas", c, _ok(1.0)
    for impl in with_baseline:
      yield impl, None, _ok(2.0)
  sweep.run_sweep(fam, probs, HW, sweep.SweepFile(path, hdr, fam), measure)
  _, before = sweep.read_sweep(path)
  f = sweep.SweepFile(path, hdr, fam)
  key = fam.problem_key(probs[0])
  mosaic = RAGGED_DOT.with_backends(["mosaic"])
  n = len(sweep.sweep_configs(mosaic, probs[0], HW))
  assert n and f.forget(sweep.remeasure_keys(mosaic, probs[:1], HW), {key}) == n + 1
  header, after = sweep.read_sweep(path)
  assert header["remeasuring"] == [key]
  gone = {r["key"] for r in before} - {r["key"] for r in after}
  assert all(k.startswith(key + "|") for k in gone)
  assert {k.split("|")[1] for k in gone} == {"pallas", "baseline"}
  assert f.n_rows == len(after)
  calls = []

  def again(problem, configs, with_baseline):
    calls.append((problem, len(configs), tuple(with_baseline)))
    yield from measure(problem, configs, with_baseline)
  f = sweep.SweepFile(path, hdr, fam)
  sweep.run_sweep(fam, probs, HW, f, again)
  assert calls == [(probs[0], n, ("baseline",))]
  f.finish_remeasure({key})
  header, rows = sweep.read_sweep(path)
  assert "remeasuring" not in header and len(rows) == len(after) + n + 2  # + a timing row
  # Timing rows stay unique after rows went (their key is not a row count).
  timing = [r["key"] for r in rows if r["impl"] == "timing"]
  assert len(timing) == len(set(timing)) == 3


def test_report_states_the_oracle_over_the_batched_gemm_rows():
  """A grouped-GEMM sweep's ``baseline_batched`` rows (cuBLAS's batched GEMM
  on the same rows per expert): the report gives the oracle's speed over
  them, computed here from the raw rows of the recorded H200 sweep."""
  import collections
  import math
  path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                      "sweeps", "nvidia_h200", "ragged_dot_bfloat16.jsonl.gz")
  _, rows = sweep.read_sweep(path)
  best, batched, xla = collections.defaultdict(lambda: math.inf), {}, {}
  for r in rows:
    if r["status"] != "ok":
      continue
    key = r["key"].split("|")[0]  # the problem's part of the row's key
    if r["impl"] == "pallas":
      best[key] = min(best[key], r["median_us"])
    elif r["impl"] == "baseline_batched":
      batched[key] = r["median_us"]
    elif r["impl"] == "baseline":
      xla[key] = r["median_us"]
  over = [batched[k] / best[k] for k in batched if k in best]
  both = [min(batched[k], xla[k]) / best[k] for k in batched if k in best and k in xla]
  g = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))
  text = report.render(path)
  line = next(x for x in text.splitlines() if x.startswith("oracle over baseline_batched:"))
  assert line == (f"oracle over baseline_batched: {g(over):.3f}x geomean ({min(over):.3f}x to "
                  f"{max(over):.3f}x) over {len(over)} problems; over the faster of it and "
                  f"XLA: {g(both):.3f}x ({min(both):.3f}x to {max(both):.3f}x)"), line
  assert len(over) == 187
  # docs/results.md ("The H200 sweep with order 2 and the batched-GEMM rows")
  assert (f"{g(over):.3f}", f"{min(over):.3f}", f"{max(over):.3f}") == ("0.872", "0.471",
                                                                       "1.579")
  assert all(batched[k] <= xla[k] for k in batched)  # the faster of the two on every one
  assert g(both) == pytest.approx(g(over))
  h100 = report.render(path.replace("nvidia_h200", "nvidia_h100_80gb_hbm3"))
  assert ("oracle over baseline_batched: 0.920x geomean (0.525x to 1.638x) over 195 problems"
          in h100)
  assert "oracle over baseline_batched_padded: 1.142x geomean" in h100
  assert "oracle over baseline_batched_padded: 1.068x geomean" in text
  assert "vs default -," in text  # the grouped GEMM has no default config


def test_table_vs_sweep_per_problem_reproduces_the_recorded_lists():
  """``table_vs_sweep.py --vs-batched --per-problem`` on the sweeps and
  tables on record gives the files in data/probes (docs/results.md, "The
  H200 sweep with order 2 and the batched-GEMM rows"), and the faster of the
  batched GEMM and lax.ragged_dot is the batched GEMM but on one H100 problem."""
  import importlib.util
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  script = os.path.join(root, "benchmarks", "table_vs_sweep.py")
  for key, short in (("nvidia_h200", "h200"), ("nvidia_h100_80gb_hbm3", "h100")):
    out = subprocess.run(
        [sys.executable, script, f"data/sweeps/{key}/ragged_dot_bfloat16.jsonl.gz",
         f"tables/{key}/ragged_dot.json", "--vs-batched", "--per-problem"], cwd=root,
        capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=root,
                                                  JAX_PLATFORMS="cpu"), timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    recorded = open(os.path.join(root, "data", "probes",
                                 f"ragged_dot_vs_batched_per_problem_{short}.txt")).read()
    per = lambda text: text.split("every problem")[1].split("\nproblems of")[0]
    assert per(out.stdout) == per(recorded), key
    lines = [ln.split() for ln in per(recorded).splitlines()[1:] if ln.startswith("  ")]
    assert len(lines) == {"h200": 187, "h100": 195}[short]
    lax = [ln[0] for ln in lines if ln[4] == "lax.ragged_dot"]
    assert lax == ([] if short == "h200" else ["128x8x4096x28672:bfloat16:bfloat16"]), lax
  spec = importlib.util.spec_from_file_location("table_vs_sweep", script)
  assert spec is not None
  with pytest.raises(SystemExit, match="--per-problem goes with --vs-batched"):
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    mod.main([os.path.join(root, "data/sweeps/nvidia_h200/ragged_dot_bfloat16.jsonl.gz"),
              os.path.join(root, "tables/nvidia_h200/ragged_dot.json"), "--per-problem"])
