"""``wavetune sweep`` and ``wavetune report``."""

from __future__ import annotations

import argparse
import math
import shlex
import sys
import time

__all__ = ["add_commands"]


class _Progress:
  """Configs done, failures and ETA (rich when installed, plain lines otherwise)."""

  def __init__(self, label: str):
    self.label = label
    self.done = self.failed = 0
    self._rich = None

  def start(self, total: int):
    self.total = total
    self.t0 = time.perf_counter()
    try:
      from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn,
                                 TimeElapsedColumn, TimeRemainingColumn)
      self._rich = Progress(TextColumn("{task.description}"), BarColumn(),
                            MofNCompleteColumn(), TextColumn("failed {task.fields[failed]}"),
                            TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn())
      self._task = self._rich.add_task(self.label, total=total, failed=0)
      self._rich.start()
    except ImportError:
      print(f"{self.label}: {total} measurements to do", flush=True)

  def advance(self, status: str):
    self.done += 1
    self.failed += status != "ok"
    if self._rich is not None:
      self._rich.update(self._task, advance=1, failed=self.failed)
    elif self.done % max(1, self.total // 20) == 0 or self.done == self.total:
      el = time.perf_counter() - self.t0
      eta = el / self.done * (self.total - self.done)
      print(f"  {self.done}/{self.total} done, {self.failed} failed, "
            f"{el:.0f} s elapsed, ETA {eta:.0f} s", flush=True)

  def stop(self):
    if self._rich is not None:
      self._rich.stop()


def _problems(spec, args):
  from wavetune_jax import shapes
  suite = shapes.load_suite(args.shapes)
  problems = spec.problems_from_suite(
      suite, weights=args.weights.split(",") if args.weights else None,
      sizes=args.m, dtype=args.dtype)
  if args.m_range:
    lo, hi = args.m_range
    problems = [p for p in problems if lo <= spec.size_of(p) <= hi]
  return problems


def _gpu_measure(spec, prof):
  """The sweep's measuring function: all configs + baseline + one repeat."""
  import jax

  def measure(problem, configs, with_baseline):
    fns = [spec.build(problem, c) for c in configs]
    kit = prof.compile_kit(spec, problem, fns[0] if fns else None)
    args, ref = kit.materialize()
    out_bytes = kit.out_bytes
    impls = ["pallas"] * len(fns)
    if with_baseline:
      fns.append(spec.baseline(problem))
      impls.append("baseline")
      for name, fn in spec.extra_baselines(problem).items():
        fns.append(fn)
        impls.append(f"baseline_{name}")
    best = (None, math.inf)
    for i, m in prof.measure_iter(fns, args, reference=ref, kit=kit,
                                  tolerance=spec.tolerance(problem), out_bytes=out_bytes):
      config = configs[i] if i < len(configs) else None
      if config is not None and m.status == "ok" and m.median_us < best[1]:
        best = (config, m.median_us)
      yield impls[i], config, m
    if best[0] is not None:
      # Repeatability: the fastest config timed a second time in the same run.
      (_, m), = prof.measure_iter([spec.build(problem, best[0])], args,
                                  out_bytes=out_bytes)
      yield "repeat", best[0], m
  return measure


def _sweep(args) -> int:
  import jax

  from wavetune_jax import hardware, profiler, sweep
  from wavetune_jax.spec import get_spec

  spec = get_spec(args.kernel)
  hw = hardware.detect()
  out = args.out or f"data/sweeps/{hw.device_key}/{spec.name}_{args.dtype}.jsonl.gz"
  header = sweep.make_header(spec, hw, jax_version=jax.__version__,
                             command="wavetune " + shlex.join(sys.argv[1:]),
                             space="wide" if args.wide else "pruned")
  f = sweep.SweepFile(out, header)
  problems = _problems(spec, args)
  print(f"{hw.name}: {len(problems)} problems -> {out} ({f.n_rows} rows already there)",
        flush=True)
  prof = profiler.Profiler(iterations=args.iterations, threads=args.threads)
  t0 = time.perf_counter()
  counts = sweep.run_sweep(spec, problems, hw, f, _gpu_measure(spec, prof),
                           prune=not args.wide, progress=_Progress(f"sweep {spec.name}"))
  print(f"measured {counts['measured']} ({counts['failed']} failed), skipped "
        f"{counts['skipped']} already on file, {time.perf_counter() - t0:.0f} s")
  return 0


def _merge(args) -> int:
  from wavetune_jax import sweep
  replaced, added = sweep.merge_sweeps(args.into, args.sweep)
  print(f"{args.into}: {added} problems added, {replaced} replaced from {args.sweep}")
  return 0


def _report(args) -> int:
  from wavetune_jax import report
  text = report.render(args.sweep, plot=args.plot)
  print(text)
  return 0


def add_problem_args(ap: argparse.ArgumentParser) -> None:
  """The options that choose a kernel and the problems of a suite (``_problems``)."""
  ap.add_argument("--kernel", default="matmul")
  ap.add_argument("--shapes", default="train", help="built-in suite name or JSON path")
  ap.add_argument("--weights", help="comma-separated weight names (default: all)")
  ap.add_argument("--m", type=int, nargs="+",
                  help="token counts, the spec's size_field (default: the suite's)")
  ap.add_argument("--m-range", type=int, nargs=2, metavar=("LO", "HI"))
  ap.add_argument("--dtype", default="bfloat16")


def add_commands(sub: argparse._SubParsersAction) -> None:
  sw = sub.add_parser(
      "sweep", help="exhaustive, resumable sweep of a kernel's config space (GPU)",
      description="Checks and times every config of the space for every problem "
      "(and the platform baseline) with CUPTI. Resumable: rerun the same command to "
      "fill what is missing; nothing on file is measured twice.")
  add_problem_args(sw)
  sw.add_argument("--out", help="default data/sweeps/<device_key>/<kernel>_<dtype>.jsonl.gz")
  sw.add_argument("--iterations", type=int, default=20)
  sw.add_argument("--threads", type=int, default=16, help="parallel compile threads")
  sw.add_argument("--wide", action="store_true", help="unpruned space")
  sw.set_defaults(func=_sweep)
  rp = sub.add_parser("report", help="tables and a wave plot of a sweep file")
  rp.add_argument("sweep")
  rp.add_argument("--plot", help="PNG path for latency vs M")
  rp.set_defaults(func=_report)
  mg = sub.add_parser(
      "merge", help="put the problems of one sweep file into another",
      description="A problem in both files keeps only the rows of SWEEP, so each "
      "problem's configs come from one run; INTO's header records SWEEP's run.")
  mg.add_argument("sweep", help="the file whose problems are taken")
  mg.add_argument("--into", required=True, help="the sweep file to update")
  mg.set_defaults(func=_merge)
