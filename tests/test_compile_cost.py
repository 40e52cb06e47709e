"""benchmarks/compile_cost.py --small on a CPU: both processes run every op,
and the second process compiles XLA's ops from the persistent cache."""

import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def test_compile_cost_small(tmp_path):
  root = os.path.dirname(HERE)
  out_json = tmp_path / "cost.json"
  env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "compile_cost.py"),
                        "--small", "--levels", "default", "--json", str(out_json)],
                       capture_output=True, text=True, env=env, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  runs = json.loads(out_json.read_text())
  assert [(r["lib"], r["state"]) for r in runs] == [
      ("xla", "cold"), ("xla", "warm"), ("wt", "cold"), ("wt", "warm")]
  for r in runs:
    assert len(r["rows"]) == 6  # 3 ops x 2 shapes
    for x in r["rows"]:
      assert min(x["trace_ms"], x["lower_ms"], x["compile_ms"], x["first_ms"]) > 0
  cold, warm = ({(x["case"], x["lib"], x["nth"]): x["compile_ms"] for x in r["rows"]}
                for r in runs[:2])
  # XLA's compiles are served from the cache the first process filled.
  for case in ("gemm", "attention", "grouped"):
    assert warm[(case, "xla", 1)] < 0.5 * cold[(case, "xla", 1)], (case, cold, warm)
  # wavetune's Pallas kernels: exported by the first process, loaded (not
  # lowered) by the second.
  wt_cold, wt_warm = (r["rows"][-1]["kernel_cache"] for r in runs[2:])
  assert wt_warm["misses"] == 0 and wt_warm["loads"] == wt_cold["misses"], (wt_cold, wt_warm)


def test_compile_parallel_args_and_recorded_mosaic_runs(capsys):
  """``benchmarks/compile_parallel.py``: its argument errors, and the H200
  runs of docs/results.md ("Compile parallelism"): Mosaic GPU kernels
  compile 2.6-3.3x faster a config in 3 threads than in one, their
  lowering does not overlap; JAX's persistent cache changes nothing."""
  import pathlib
  import re
  import pytest
  from bench_module import load_benchmark
  mod = load_benchmark("compile_parallel")
  for bad in (["--backend", "cudnn", "--family", "ragged_dot"], ["--threads", "0"],
              ["--family", "conv"]):
    with pytest.raises(SystemExit):
      mod.parse_args(bad)
    assert "error:" in capsys.readouterr().err
  probes = pathlib.Path(__file__).parent.parent / "data" / "probes"
  pat = re.compile(r"(\d+) thread\(s\): .* lowering ([\d.]+), compiling ([\d.]+)")

  def runs(text):
    return [(int(t), float(lo), float(c)) for t, lo, c in pat.findall(text)]

  ratio = {}
  for kernel in ("ragged_dot", "matmul", "attention"):
    (t3, lo3, c3), (t1, lo1, c1) = runs(
        (probes / f"compile_parallel_mosaic_{kernel}_h200.txt").read_text())
    assert (t3, t1) == (3, 1)
    ratio[kernel] = round(c1 / c3, 1)
  assert ratio == {"ragged_dot": 2.6, "matmul": 2.7, "attention": 3.3}
  cached = runs((probes / "compile_parallel_mosaic_caches_h200.txt").read_text())
  assert [c for t, _, c in cached if t == 3] == [0.419, 0.411, 0.789]
