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
