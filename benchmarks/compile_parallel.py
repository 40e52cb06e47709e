"""Parallel vs serial compilation of kernel candidates (the profiler's compile step).

Compiles two disjoint halves of one problem's config space (alternate configs,
so both halves are alike): one half in 1 thread, the other in N threads, and
prints seconds per config for each. Fresh jit functions, so nothing is shared.

    python3 benchmarks/compile_parallel.py [--family matmul] [--threads 16]
"""

from __future__ import annotations

import argparse
import functools
import time

import jax

from wavetune_jax import AttentionProblem, MatmulProblem, get_family
from wavetune_jax.core import hardware
from wavetune_jax.tuning import profiler

PROBLEMS = {
    "matmul": MatmulProblem(m=1000, n=4096, k=4096),
    "attention": AttentionProblem(batch=2, q_heads=32, kv_heads=8, q_len=2048),
}


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--family", "--kernel", dest="family", default="matmul",
                  choices=sorted(PROBLEMS))
  ap.add_argument("--threads", type=int, default=16)
  ap.add_argument("--configs", type=int, default=64, help="configs per half (at most)")
  a = ap.parse_args()
  spec = get_family(a.family)
  hw = hardware.detect()
  p = PROBLEMS[a.family]
  # Triton configs first, then the other backends' (attention: Mosaic), as the
  # space was ordered when the halves below were first drawn.
  space = sorted(spec.space(p, hw), key=lambda c: spec.backend_of(c).name != "triton")
  halves = (space[0::2][:a.configs], space[1::2][:a.configs])
  args = spec.inputs(p, jax.random.PRNGKey(0))
  print(f"{hw.name}, jax {jax.__version__}: {spec.problem_key(p)}, "
        f"{len(halves[0])} + {len(halves[1])} configs")
  # Warm the process (first-compile setup) with one config outside the halves.
  profiler.Profiler(threads=1).compile(spec.build(p, spec.default(p)), args)
  for threads, configs in ((a.threads, halves[0]), (1, halves[1])):
    prof = profiler.Profiler(threads=threads)
    fns = [spec.build(p, c) for c in configs]
    t0 = time.perf_counter()
    compiled = prof.parallel([functools.partial(prof.compile_timed, f, args) for f in fns])
    failed = sum(isinstance(exe, BaseException) for exe, _ in compiled)
    wall = time.perf_counter() - t0
    print(f"  {threads:>2} thread(s): {len(configs)} configs in {wall:6.1f} s = "
          f"{wall / len(configs):.3f} s per config ({failed} failed)")


if __name__ == "__main__":
  main()
