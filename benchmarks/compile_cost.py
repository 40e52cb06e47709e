"""What a new shape costs: XLA's autotuned ops against the wavetune ops.

For GEMM, attention and grouped GEMM, each op is jitted for two new shapes in
a row (the first pays the process's one-time costs: the op's table, cuDNN or
Mosaic start-up), and each phase is timed on the wall clock:

  trace    jax.jit(f).trace(...): Python, and the wavetune selection
  lower    .lower(): the StableHLO, with the Pallas kernels lowered to Mosaic GPU or Triton IR
  compile  .compile(): XLA (its autotuning included), or a persistent-cache hit
  first    the first call (kernels compiled at load time are built here)

plus the kernel time (CUPTI, L2 flushed) on a GPU. Each library runs in
fresh processes of its own (XLA's in-process autotune results would otherwise
serve the other's XLA-backed calls): XLA's default autotuning and
``--xla_gpu_autotune_level=0``, each with an empty persistent compilation
cache (cold) and then again with the cache the cold process filled (warm). XLA's per-fusion autotune results go
into the same cache directory (``jax_persistent_cache_enable_xla_caches``), and
so do wavetune's lowered Pallas kernels (``wavetune_jax.core.kernel_cache``,
turned on here with ``WAVETUNE_KERNEL_CACHE``; ``--no-kernel-cache`` times the
ops without it).

  python3 benchmarks/compile_cost.py [--json out.json]          # GPU
  python3 benchmarks/compile_cost.py --cases grouped --levels default --no-kernel-cache
  python3 benchmarks/compile_cost.py --small                     # CPU, tiny shapes
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

# (case, op, shapes): two new shapes per op, as a model meets them.
GPU_CASES = {
    "gemm": [dict(m=777, n=14336, k=4096), dict(m=3000, n=14336, k=4096)],
    "attention": [dict(b=1, s=1000, hq=32, hkv=8, d=128), dict(b=1, s=3000, hq=32, hkv=8, d=128)],
    "grouped": [dict(m=2048, g=8, k=4096, n=28672), dict(m=6000, g=8, k=4096, n=28672)],
}
CPU_CASES = {
    "gemm": [dict(m=24, n=64, k=32), dict(m=40, n=64, k=32)],
    "attention": [dict(b=1, s=40, hq=2, hkv=1, d=32), dict(b=1, s=72, hq=2, hkv=1, d=32)],
    "grouped": [dict(m=24, g=4, k=32, n=64), dict(m=40, g=4, k=32, n=64)],
}


def _make(case: str, lib: str, s: dict):
  """(fn, args) of one op on one shape."""
  import jax
  import jax.numpy as jnp
  import wavetune_jax as wt
  key = jax.random.PRNGKey(0)
  bf = jnp.bfloat16
  if case == "gemm":
    args = (jax.random.normal(key, (s["m"], s["k"]), bf), jax.random.normal(key, (s["k"], s["n"]), bf))
    fn = jnp.dot if lib == "xla" else wt.matmul
  elif case == "attention":
    q = jax.random.normal(key, (s["b"], s["s"], s["hq"], s["d"]), bf)
    kv = jax.random.normal(key, (s["b"], s["s"], s["hkv"], s["d"]), bf)
    args = (q, kv, kv)
    if lib == "xla":
      from wavetune_jax.models import library_attention_impl
      fn = lambda q, k, v: jax.nn.dot_product_attention(  # noqa: E731
          q, k, v, is_causal=True, implementation=library_attention_impl(q))
    else:
      fn = lambda q, k, v: wt.attention(q, k, v, causal=True)  # noqa: E731
  else:
    m, g = s["m"], s["g"]
    sizes = jnp.full((g,), m // g, jnp.int32).at[0].add(m - g * (m // g))
    args = (jax.random.normal(key, (m, s["k"]), bf), jax.random.normal(key, (g, s["k"], s["n"]), bf),
            sizes)
    fn = jax.lax.ragged_dot if lib == "xla" else wt.ragged_dot
  return fn, args


def worker(a) -> None:
  import jax
  from wavetune_jax.tuning.profiler import enable_persistent_cache
  if a.cache:
    enable_persistent_cache(a.cache)
  on_gpu = jax.devices()[0].platform == "gpu"
  prof = None
  if on_gpu:
    from wavetune_jax.tuning.profiler import Profiler
    prof = Profiler(iterations=20)
  cases = CPU_CASES if a.small else GPU_CASES
  rows = []
  for case, shapes_ in cases.items():
    if case not in a.cases.split(","):
      continue
    for lib in a.lib.split(","):
      for i, s in enumerate(shapes_):
        fn, args = _make(case, lib, s)
        jf = jax.jit(fn)
        t = [time.perf_counter()]
        traced = jf.trace(*args); t.append(time.perf_counter())
        lowered = traced.lower(); t.append(time.perf_counter())
        exe = lowered.compile(); t.append(time.perf_counter())
        jax.block_until_ready(exe(*args)); t.append(time.perf_counter())
        ph = [1e3 * (b - a_) for a_, b in zip(t, t[1:])]
        us = None
        if prof is not None:
          (meas,) = prof.measure_many([fn], args)
          us = meas.median_us if meas.status == "ok" else None
        from wavetune_jax.core import kernel_cache
        rows.append(dict(case=case, lib=lib, shape=s, nth=i, trace_ms=ph[0], lower_ms=ph[1],
                         compile_ms=ph[2], first_ms=ph[3], kernel_us=us,
                         kernel_cache=kernel_cache.stats()))
  json.dump({"device": jax.devices()[0].device_kind, "jax": jax.__version__, "rows": rows},
            sys.stdout)


def _run(level: str, lib: str, cache: str, small: bool, cases: str,
         kernel_cache: bool = True) -> dict:
  env = dict(os.environ)
  env["WAVETUNE_KERNEL_CACHE"] = (os.path.join(cache, "wavetune_kernels") if kernel_cache
                                   else "off")
  if level != "default":
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_gpu_autotune_level={level}").strip()
  cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--cache", cache,
         "--cases", cases, "--lib", lib]
  if small:
    cmd.append("--small")
  out = subprocess.run(cmd, env=env, capture_output=True, text=True)
  if out.returncode != 0:
    raise SystemExit(f"worker failed ({lib}, autotune {level}): "
                     f"{out.stderr.strip().splitlines()[-1:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--small", action="store_true", help="tiny shapes (a CPU run)")
  ap.add_argument("--levels", default="default,0",
                  help="XLA autotune levels, comma-separated (default: default,0)")
  ap.add_argument("--cases", default="gemm,attention,grouped",
                  help="comma-separated among gemm,attention,grouped (default: all)")
  ap.add_argument("--json", metavar="PATH", help="write every row here")
  ap.add_argument("--no-kernel-cache", action="store_true",
                  help="lower wavetune's Pallas kernels in every process (the cache off)")
  ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--lib", default="xla,wt", help=argparse.SUPPRESS)
  ap.add_argument("--cache", help=argparse.SUPPRESS)
  a = ap.parse_args(argv)
  if a.worker:
    return worker(a)
  runs = []
  # One process per library: XLA's in-process autotune results would
  # otherwise serve the other library's XLA-backed calls of the same shape.
  for level in a.levels.split(","):
    for lib in ("xla", "wt"):
      with tempfile.TemporaryDirectory() as cache:
        for state in ("cold", "warm"):
          t0 = time.perf_counter()
          r = _run(level, lib, cache, a.small, a.cases, not a.no_kernel_cache)
          r.update(level=level, lib=lib, state=state, process_s=time.perf_counter() - t0,
                   kernel_cache=not a.no_kernel_cache)
          runs.append(r)
          print(f"{r['device']}: {lib}, autotune {level}, {state} cache: process "
                f"{r['process_s']:.1f} s", flush=True)
  print(f"\nwavetune's kernel cache: {'off' if a.no_kernel_cache else 'on'}")
  print(f"\n{'case':<9} {'op':<3} {'shape':<28} {'autotune':>8} {'cache':>5} {'trace':>7} "
        f"{'lower':>7} {'compile':>8} {'first':>7} {'total ms':>9} {'kernel us':>10}")
  for r in runs:
    for x in r["rows"]:
      tot = x["trace_ms"] + x["lower_ms"] + x["compile_ms"] + x["first_ms"]
      shape = ",".join(f"{k}{v}" for k, v in x["shape"].items())
      ku = f"{x['kernel_us']:10.1f}" if x["kernel_us"] else f"{'-':>10}"
      print(f"{x['case']:<9} {x['lib']:<3} {shape:<28} {r['level']:>8} {r['state']:>5} "
            f"{x['trace_ms']:7.1f} {x['lower_ms']:7.1f} {x['compile_ms']:8.1f} "
            f"{x['first_ms']:7.1f} {tot:9.1f} {ku}")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(runs, f, indent=1)
    print(f"wrote {a.json}")


if __name__ == "__main__":
  main()
