"""Parallel vs serial compilation of kernel candidates (the profiler's compile step).

Compiles two disjoint halves of one problem's config space (alternate configs,
so both halves are alike): one half in N threads, the other in 1 thread, and
prints seconds per config for each, split into lowering (tracing the kernel
and lowering it to the module XLA compiles: Python) and XLA's compile of
the lowered module (for a Mosaic GPU kernel, Mosaic's own compile to a
cubin inside it). Fresh jit functions, so nothing is shared.

    python3 benchmarks/compile_parallel.py [--family matmul] [--threads 16]
    python3 benchmarks/compile_parallel.py --family ragged_dot --backend mosaic --configs 4
"""

from __future__ import annotations

import argparse
import functools
import time

import jax

from wavetune_jax import AttentionProblem, MatmulProblem, RaggedDotProblem, get_family
from wavetune_jax.core import hardware
from wavetune_jax.tuning import profiler

PROBLEMS = {
    "matmul": MatmulProblem(m=1000, n=4096, k=4096),
    "attention": AttentionProblem(batch=2, q_heads=32, kv_heads=8, q_len=2048),
    # Mixtral-8x7B's w13 at 2,200 tokens: benchmarks/first_use_cost.py's problem
    "ragged_dot": RaggedDotProblem(m=2200, g=8, k=4096, n=28672),
}


def parse_args(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--family", "--kernel", dest="family", default="matmul",
                  choices=sorted(PROBLEMS))
  ap.add_argument("--backend", default=None,
                  help="only this backend's configs (default: every backend's, Triton first)")
  ap.add_argument("--threads", type=int, default=16)
  ap.add_argument("--configs", type=int, default=64, help="configs per half (at most)")
  a = ap.parse_args(argv)
  if a.threads < 1 or a.configs < 1:
    ap.error("--threads and --configs must be >= 1")
  spec = get_family(a.family)
  names = [b.name for b in spec.backends]
  if a.backend is not None and a.backend not in names:
    ap.error(f"--backend {a.backend!r}: the {a.family} family's backends are {names}")
  return a


def main(argv=None):
  a = parse_args(argv)
  spec = get_family(a.family)
  hw = hardware.detect()
  p = PROBLEMS[a.family]
  # Triton configs first, then the other backends' (attention: Mosaic), as the
  # space was ordered when the halves below were first drawn.
  space = sorted(spec.space(p, hw), key=lambda c: spec.backend_of(c).name != "triton")
  if a.backend is not None:
    space = [c for c in space if spec.backend_of(c).name == a.backend]
  halves = (space[0::2][:a.configs], space[1::2][:a.configs])
  args = spec.inputs(p, jax.random.PRNGKey(0))
  print(f"{hw.name}, jax {jax.__version__}: {spec.problem_key(p)}, "
        f"{len(halves[0])} + {len(halves[1])} configs"
        f"{'' if a.backend is None else ' of ' + a.backend}")
  # Warm the process (first-compile setup) with one config outside the halves.
  profiler.Profiler(threads=1).compile(spec.build(p, spec.default(p)), args)
  for threads, configs in ((a.threads, halves[0]), (1, halves[1])):
    if not configs:
      continue
    prof = profiler.Profiler(threads=threads)
    fns = [spec.build(p, c) for c in configs]
    t0 = time.perf_counter()
    lowered = prof.parallel([functools.partial(prof.lower, f, args) for f in fns])
    t1 = time.perf_counter()
    compiled = prof.parallel([lo.compile for lo in lowered if not isinstance(lo, BaseException)])
    t2 = time.perf_counter()
    failed = sum(isinstance(x, BaseException) for x in lowered + compiled)
    n = len(configs)
    print(f"  {threads:>2} thread(s): {n} configs in {t2 - t0:6.1f} s = "
          f"{(t2 - t0) / n:.3f} s per config: lowering {(t1 - t0) / n:.3f}, "
          f"compiling {(t2 - t1) / n:.3f} ({failed} failed)", flush=True)


if __name__ == "__main__":
  main()
