"""Wall time of one sweep on one GPU and on several, or with one worker and
with several per GPU: the same problems, the same configs, a fresh result
file each (the real ``wavetune sweep`` command).

Prints both wall times, their ratio, and whether both files hold the same
rows (every config of every problem exactly once). ``--keep FILE`` copies the
several-GPU file there (to merge into a suite's sweep with ``wavetune merge``).

    python3 benchmarks/sweep_devices.py --family matmul --weights llama3_8b.o \\
        --m 2 4 8 32 48 96 --backends mosaic,xla --devices 2
    python3 benchmarks/sweep_devices.py --family ragged_dot --weights olmoe_1b_7b.w13 \
        --m 8 200 3000 --backends mosaic,xla --devices 1 --workers-per-gpu 4
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time


def rows_of(path: str) -> list[str]:
  from wavetune_jax.tuning import sweep
  _, rows = sweep.read_sweep(path, strict=True)
  return [r["key"] for r in rows if r["impl"] == "pallas" or r["impl"].startswith("baseline")]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--family", required=True)
  ap.add_argument("--weights", required=True)
  ap.add_argument("--m", nargs="+", required=True)
  ap.add_argument("--backends", default=None)
  ap.add_argument("--devices", type=int, default=2, help="GPUs of the second run")
  ap.add_argument("--workers-per-gpu", type=int, default=1,
                  help="worker processes per GPU in the second run (default: 1)")
  ap.add_argument("--keep", default=None, help="copy the second run's result file here")
  a = ap.parse_args(argv)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(os.environ, PYTHONPATH=root + os.pathsep + os.environ.get("PYTHONPATH", ""))
  tmp = tempfile.mkdtemp(prefix="sweep_devices_")
  if (a.devices, a.workers_per_gpu) == (1, 1):
    ap.error("the second run needs --devices > 1 or --workers-per-gpu > 1")
  walls, files = {}, {}
  runs = {1: (1, 1), 2: (a.devices, a.workers_per_gpu)}
  for n, (gpus, workers) in runs.items():
    out = files[n] = os.path.join(tmp, f"run{n}.jsonl.gz")
    cmd = [sys.executable, "-m", "wavetune_jax.cli.main", "sweep", "--family", a.family,
           "--weights", a.weights, "--m", *a.m, "--devices", str(gpus),
           "--workers-per-gpu", str(workers), "--out", out]
    if a.backends:
      cmd += ["--backends", a.backends]
    print("$", " ".join(cmd[2:]), flush=True)
    t0 = time.perf_counter()
    rc = subprocess.run(cmd, env=env).returncode
    walls[n] = time.perf_counter() - t0
    if rc:
      print(f"sweep on {gpus} GPU(s), {workers} worker(s) each, failed with exit status "
            f"{rc}", file=sys.stderr)
      return rc
  one, many = rows_of(files[1]), rows_of(files[2])
  same = sorted(one) == sorted(many) and len(set(many)) == len(many)
  print(f"\n{'GPUs':>5} {'workers/GPU':>12} {'wall s':>8} {'rows':>6}")
  for n, (gpus, workers) in runs.items():
    print(f"{gpus:>5} {workers:>12} {walls[n]:>8.1f} {len(one if n == 1 else many):>6}")
  print(f"wall time of the second run / the first: {walls[2] / walls[1]:.3f}; "
        f"same rows, each once: {same}")
  if a.keep:
    shutil.copy(files[2], a.keep)
  shutil.rmtree(tmp, ignore_errors=True)
  return 0 if same else 1


if __name__ == "__main__":
  sys.exit(main())
