"""Checks and times every config of the GEMM space for a few shapes (GPU only).

For each shape: every config of ``MATMUL.space`` is compiled (in parallel),
checked against a float32 reference on random inputs and timed with CUPTI; XLA's
``jnp.dot`` is timed on the same timer. Prints a short table and writes every
row to ``--out`` (JSON).

  python3 benchmarks/matmul_space.py --weight llama3_8b.gate_up --m 16 1000 4096 \
      --out data/probes/space_gate_up.json
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import jax
import jax.numpy as jnp

from wavetune_jax import MATMUL, MatmulProblem, shapes
from wavetune_jax.core import hardware
from wavetune_jax.families.matmul import gemm_weights
from wavetune_jax.tuning import profiler


def run_shape(prof: profiler.Profiler, problem: MatmulProblem, hw, *, wide: bool,
              limit: int | None) -> dict:
  spec = MATMUL
  configs = list(spec.space(problem, hw, prune=not wide))
  if limit:
    configs = configs[:limit]
  args = spec.inputs(problem, jax.random.PRNGKey(0))
  ref = spec.reference(problem, *args)
  out_bytes = problem.m * problem.n * jnp.dtype(problem.out_dtype).itemsize
  fns = [spec.build(problem, c) for c in configs]
  fns.append(spec.baseline(problem))
  t0 = time.perf_counter()
  done = [0]

  def progress(i, m):
    done[0] += 1
    if done[0] % 50 == 0:
      print(f"  {done[0]}/{len(fns)} measured ({time.perf_counter() - t0:.0f} s)",
            flush=True)

  ms: list = [None] * len(fns)
  for i, m in prof.measure_iter(fns, args, reference=ref,
                                tolerance=spec.tolerance(problem), out_bytes=out_bytes):
    ms[i] = m
    progress(i, m)
  gpu_s = time.perf_counter() - t0
  rows = []
  for c, m in zip(configs, ms[:-1]):
    rows.append({"config": spec.config_to_dict(c), **m.__dict__})
  xla = ms[-1]
  heur = spec.heuristic(problem, hw)
  default = spec.default(problem)
  by_cfg = {MATMUL.config_from_dict(r["config"]): r for r in rows}
  ok = [r for r in rows if r["status"] == "ok"]
  best = min(ok, key=lambda r: r["median_us"]) if ok else None
  exe = prof.compile(fns[0], args)[0]
  names = prof.kernel_names(exe, args)
  return {
      "problem": spec.problem_to_dict(problem), "n_configs": len(configs),
      "n_ok": len(ok), "failures": {s: sum(r["status"] == s for r in rows)
                                    for s in ("compile_error", "run_error", "wrong")},
      "max_rel_error": max((r["rel_error"] for r in ok), default=None),
      "best": best, "xla": xla.__dict__,
      "heuristic": {"config": spec.config_to_dict(heur),
                    **(by_cfg[heur] if heur in by_cfg else {})},
      "default": {"config": spec.config_to_dict(default),
                  **(by_cfg[default] if default in by_cfg else {})},
      "gpu_seconds": gpu_s, "kernel_names": names, "rows": rows,
  }


def _fmt_cfg(c: dict) -> str:
  return (f"{c['block_m']}x{c['block_n']}x{c['block_k']} s{c['split_k']} "
          f"g{c['group_m']} w{c['num_warps']} st{c['num_stages']}")


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--weight", default="llama3_8b.gate_up")
  ap.add_argument("--m", type=int, nargs="+", default=[16, 1000, 4096])
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--wide", action="store_true", help="unpruned space")
  ap.add_argument("--limit", type=int, default=None, help="first N configs only")
  ap.add_argument("--iterations", type=int, default=25)
  ap.add_argument("--out", default=None)
  a = ap.parse_args(argv)
  hw = hardware.detect()
  n, k = gemm_weights(shapes.load_suite("train"), [a.weight])[a.weight]
  prof = profiler.Profiler(iterations=a.iterations)
  print(f"device: {hw.name} ({hw.num_sms} SMs), jax {jax.__version__}, "
        f"python {platform.python_version()}", flush=True)
  results = []
  for m in a.m:
    p = MatmulProblem(m=m, n=n, k=k, dtype=a.dtype)
    print(f"{a.weight} M={m}: {len(MATMUL.space(p, hw, prune=not a.wide))} configs",
          flush=True)
    results.append(run_shape(prof, p, hw, wide=a.wide, limit=a.limit))
    print(f"  kernels seen by CUPTI: {results[-1]['kernel_names']}", flush=True)
  if a.out:
    with open(a.out, "w") as f:
      json.dump({"device": hw.name, "jax": jax.__version__, "argv": sys.argv,
                 "results": results}, f)
  print()
  print(f"{'shape (MxNxK)':<20} {'cfgs':>5} {'ok':>5} {'fail':>4} {'max err':>8} "
        f"{'best config':<30} {'best us':>8} {'XLA us':>8} {'XLA/best':>8} "
        f"{'heur us':>8} {'dflt us':>8} {'gpu s':>6}")
  for r in results:
    p = r["problem"]
    best = r["best"] or {}
    xla = r["xla"].get("median_us")
    bu = best.get("median_us")
    print(f"{p['m']}x{p['n']}x{p['k']:<8} {r['n_configs']:>5} {r['n_ok']:>5} "
          f"{sum(r['failures'].values()):>4} {r['max_rel_error'] or 0:>8.1e} "
          f"{_fmt_cfg(best['config']) if best else '-':<30} {bu or 0:>8.1f} "
          f"{xla or 0:>8.1f} {(xla / bu) if (xla and bu) else 0:>8.3f} "
          f"{r['heuristic'].get('median_us') or 0:>8.1f} "
          f"{r['default'].get('median_us') or 0:>8.1f} {r['gpu_seconds']:>6.0f}")
  for r in results:
    for row in r["rows"]:
      if row["status"] != "ok":
        print(f"  failed {_fmt_cfg(row['config'])}: {row['status']} {row['error'][:160]}")


if __name__ == "__main__":
  main()
