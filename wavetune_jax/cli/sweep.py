"""``wavetune sweep``, ``wavetune report`` and ``wavetune merge``."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time

from wavetune_jax.cli.common import (add_family_arg, detect_gpu, existing_file, output_file,
                                     positive_int, pyplot)

__all__ = ["add_commands", "add_problem_args", "problems", "Progress"]


class Progress:
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


def checked_m_range(args):
  """``--m-range LO HI`` as given (None when not), refused where LO > HI."""
  from wavetune_jax.cli.common import CliError
  if args.m_range and args.m_range[0] > args.m_range[1]:
    raise CliError(f"--m-range {args.m_range[0]} {args.m_range[1]}: LO is above HI")
  return args.m_range


def problems(spec, args):
  """The problems of ``args.shapes`` selected by ``add_problem_args``'s options."""
  if getattr(args, "problems_of", None):
    return problems_of(spec, args.problems_of)
  from wavetune_jax.shapes import load_suite
  suite = load_suite(args.shapes)
  probs = spec.problems_from_suite(
      suite, weights=args.weights.split(",") if args.weights else None,
      sizes=args.m, dtype=args.dtype)
  if checked_m_range(args):
    lo, hi = args.m_range
    probs = [p for p in probs if lo <= spec.size_of(p) <= hi]
  windows = getattr(args, "windows", None)
  if windows:
    variants = spec.window_variants(probs, suite)
    probs = variants if windows == "only" else probs + variants
  if not probs:
    raise ValueError(f"no {spec.name} problem in suite {args.shapes!r} matches the options")
  return probs


def problems_of(spec, path: str) -> list:
  """The problems of sweep file ``path``, in the order of their first rows."""
  from wavetune_jax.tuning import sweep
  header, rows = sweep.read_sweep(path, strict=True)
  if header.get("kernel") != spec.name:
    raise ValueError(f"{path} is a sweep of {header.get('kernel')!r}, not {spec.name!r}")
  seen = {}
  for r in rows:
    key = r["key"].split("|", 1)[0]
    if key not in seen:
      seen[key] = spec.problem_from_dict(r["problem"])
  if not seen:
    raise ValueError(f"{path} has no rows")
  return list(seen.values())


def _sweep(args) -> int:
  import jax

  from wavetune_jax.core.registry import get_family
  from wavetune_jax.tuning import profiler, sweep

  family = spec = with_family_options(get_family(args.family), args)
  if args.backends:
    spec = family.with_backends(args.backends.split(","))
  devices = gpu_devices(args.devices, check=not args.worker_measure,
                        workers_per_gpu=args.workers_per_gpu)
  hw = detect_gpu("sweep", "read a recorded sweep (data/sweeps/) with wavetune report SWEEP, "
                  "wavetune eval --family F --sweep SWEEP or wavetune tune --family F "
                  "--replay SWEEP")
  tail = "".join(f"_{v}" for k, v in family_options(family).items()
                 if v != FAMILY_OPTIONS[k][1])  # (a non-default input option)
  out = args.out or f"data/sweeps/{hw.device_key}/{spec.name}_{args.dtype}{tail}.jsonl.gz"
  header = sweep.make_header(spec, hw, jax_version=jax.__version__,
                             command="wavetune " + shlex.join(sys.argv[1:]),
                             space="wide" if args.wide else "pruned")
  header.update(family_options(family))
  f = sweep.SweepFile(out, header, family)  # rows of every backend on file
  check_resumed_options(out, f.header, header)
  probs = problems(spec, args)
  print(f"{hw.name}: {len(probs)} problems -> {out} ({f.n_rows} rows already there)",
        flush=True)
  if args.remeasure:
    sweep.plan_sweep(spec, probs, hw, f, prune=not args.wide)  # (its errors before any row goes)
    pending = set(f.header.get("remeasuring", ()))
    fresh = [p for p in probs if spec.problem_key(p) not in pending]
    dropped = f.forget(sweep.remeasure_keys(spec, fresh, hw, prune=not args.wide),
                       {spec.problem_key(p) for p in fresh})
    names = ", ".join(b.name for b in spec.backends)
    print(f"--remeasure: {dropped} rows of {len(fresh)} problems ({names} and the baseline) "
          f"to measure again; {len(probs) - len(fresh)} problems resume an earlier "
          f"--remeasure", flush=True)
  if f.n_rows and sweep.plan_sweep(spec, probs, hw, f, prune=not args.wide)[0]:
    f.record_run(header)  # this run adds rows to a file on record: its header says so
  t0 = time.perf_counter()
  if len(devices) > 1 or args.workers_per_gpu > 1:
    import tempfile

    from wavetune_jax.tuning import parallel
    todo, skipped = sweep.plan_sweep(spec, probs, hw, f, prune=not args.wide)
    slots = [d for d in devices for _ in range(args.workers_per_gpu)]
    print(f"{len(todo)} problems to measure on {len(devices)} GPU(s) ({', '.join(devices)}), "
          f"{args.workers_per_gpu} worker(s) each", flush=True)
    worker_args = {"iterations": args.iterations, "threads": args.threads,
                   "family_options": family_options(family)}
    with tempfile.TemporaryDirectory(prefix="wavetune_gpu_locks_") as locks:
      if args.workers_per_gpu > 1:
        worker_args["gpu_lock_dir"] = locks
      counts = parallel.run_parallel(
          spec, todo, f, devices=slots, worker_args=worker_args,
          progress=Progress(f"sweep {spec.name}"), measure=args.worker_measure)
    counts["skipped"] = skipped
    deaths = f", {counts['worker_deaths']} worker deaths" if counts["worker_deaths"] else ""
  else:
    prof = profiler.Profiler(iterations=args.iterations, threads=args.threads)
    counts = sweep.run_sweep(spec, probs, hw, f, sweep.gpu_measure(spec, prof),
                             prune=not args.wide, progress=Progress(f"sweep {spec.name}"))
    deaths = ""
  if f.header.get("remeasuring"):
    left = {spec.problem_key(p) for p, _, _ in
            sweep.plan_sweep(spec, probs, hw, f, prune=not args.wide)[0]}
    f.finish_remeasure({spec.problem_key(p) for p in probs} - left)
  print(f"measured {counts['measured']} ({counts['failed']} failed), skipped "
        f"{counts['skipped']} already on file{deaths}, {time.perf_counter() - t0:.0f} s")
  return 0


#: Options that change a family's inputs (``--lengths``): the header key (the
#: family's method ``with_<key>`` returns a copy with a value), the family's
#: attribute that holds it, and the value files without the key were
#: measured with. Parallel workers get them as ``family_options``.
FAMILY_OPTIONS = {"lengths": ("length_mix", "spread")}


def with_family_options(family, args):
  """``family`` with the input options given on the command line.

  Raises:
    CliError: an option the family does not have.
  """
  from wavetune_jax.cli.common import CliError
  for key in FAMILY_OPTIONS:
    value, method = getattr(args, key, None), f"with_{key}"
    if value is None:
      continue
    if not hasattr(family, method):
      raise CliError(f"--{key}: the {family.name} family has no such option (its inputs "
                     f"have no {key} mix)")
    family = getattr(family, method)(value)
  return family


def family_options(family) -> dict:
  """The input options of ``family`` as a sweep header records them
  (``{"lengths": "spread"}`` for decode; empty for families without one)."""
  return {key: getattr(family, attr) for key, (attr, _) in FAMILY_OPTIONS.items()
          if hasattr(family, attr)}


def check_resumed_options(path: str, on_file: dict, header: dict) -> None:
  """Refuses to add rows measured with other input options to a sweep file
  (a file without the key was measured with the default).

  Raises:
    ValueError: the file's options differ from this run's.
  """
  for key, (_, default) in FAMILY_OPTIONS.items():
    if key in header and on_file.get(key, default) != header[key]:
      raise ValueError(f"{path} was recorded with --{key} {on_file.get(key, default)}; this "
                       f"run has --{key} {header[key]}. Use another --out file.")


def gpu_devices(spec: str, check: bool = True, workers_per_gpu: int = 1) -> list[str]:
  """The ``--devices`` of sweep and tune, checked against this host's GPUs;
  with several workers, this process leaves the GPUs' memory to them (call
  before JAX starts its GPU client)."""
  devices = _devices(spec)
  if len(devices) > 1 or workers_per_gpu > 1:
    if check:
      from wavetune_jax.tuning.parallel import local_gpu_count
      have = local_gpu_count()
      if max(int(d) for d in devices) >= have:
        raise ValueError(f"--devices {spec}: this host has {have} GPU(s)")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  return devices


def _devices(spec: str) -> list[str]:
  """``--devices``: ``all`` (this host's GPUs), a count, or comma-separated ids."""
  from wavetune_jax.tuning.parallel import local_gpu_count
  if spec == "all":
    n = local_gpu_count()
    return [str(i) for i in range(n)] if n > 1 else ["0"]
  if spec.isdigit():
    if int(spec) < 1:
      raise ValueError(f"--devices {spec}: need at least 1")
    return [str(i) for i in range(int(spec))]
  ids = [d.strip() for d in spec.split(",")]
  if not all(d.isdigit() for d in ids) or len(set(ids)) != len(ids):
    raise ValueError(f"--devices {spec!r}: give 'all', a count or distinct GPU ids "
                     f"like 0,1")
  return ids


def _merge(args) -> int:
  from wavetune_jax.tuning import sweep
  replaced, added = sweep.merge_sweeps(
      args.into, args.sweep, same={k: d for k, (_, d) in FAMILY_OPTIONS.items()})
  print(f"{args.into}: {added} problems added, {replaced} replaced from {args.sweep}")
  return 0


def _report(args) -> int:
  from wavetune_jax.tuning import report
  if args.plot:
    pyplot()  # the error before the work
  text = report.render(args.sweep, plot=args.plot, on_truncated=lambda msg: print(
      f"wavetune report: warning: {msg}; reporting the rows before the cut",
      file=sys.stderr, flush=True))
  print(text)
  return 0


def add_problem_args(ap: argparse.ArgumentParser) -> None:
  """The options that choose a family and the problems of a suite (:func:`problems`)."""
  add_family_arg(ap)
  ap.add_argument("--shapes", default="train",
                  help="shape suite: a built-in name or a JSON file (default: train)")
  ap.add_argument("--weights", help="comma-separated weight (GEMM) or model (attention) "
                  "names of the suite (default: all)")
  ap.add_argument("--m", type=positive_int, nargs="+", metavar="SIZE",
                  help="token counts: the family's size field, GEMM M or attention "
                       "q_len (default: the suite's)")
  ap.add_argument("--m-range", type=positive_int, nargs=2, metavar=("LO", "HI"),
                  help="keep only sizes in [LO, HI]")
  ap.add_argument("--dtype", default="bfloat16",
                  choices=("bfloat16", "float16", "float32", "float8_e4m3fn"),
                  help="input dtype (default: bfloat16; float8_e4m3fn: the W8A8-FP8 problems of "
                  "qmatmul and qragged_dot only)")
  ap.add_argument("--windows", nargs="?", const="also", choices=("also", "only"),
                  help="also each problem with each of the suite's sliding windows shorter "
                  "than its sequence (attention and decode; train: 128, 512, 1024, 4096); "
                  "'--windows only': the windowed problems alone")


def add_commands(sub: argparse._SubParsersAction) -> None:
  sw = sub.add_parser(
      "sweep", help="exhaustive, resumable sweep of a family's config spaces (GPU)",
      description="Checks and times every config of the space for every problem "
      "(and the platform baseline) with CUPTI. Resumable: rerun the same command to "
      "fill what is missing; nothing on file is measured twice.")
  add_problem_args(sw)
  sw.add_argument("--out", help="result file (default: "
                  "data/sweeps/<device_key>/<family>_<dtype>.jsonl.gz)")
  sw.add_argument("--iterations", type=positive_int, default=20,
                  help="timed calls per config, median reported (default: 20)")
  sw.add_argument("--threads", type=positive_int, default=16,
                  help="parallel compile threads (default: 16)")
  sw.add_argument("--wide", action="store_true", help="the unpruned space (validity only)")
  sw.add_argument("--backends", help="comma-separated backends to sweep (default: all "
                  "that run on this GPU); rows already on file are kept, so a sweep of a "
                  "new backend can go into an existing file")
  sw.add_argument("--devices", default="all",
                  help="GPUs to sweep on, one worker process each: 'all' (default: "
                  "this host's GPUs), a count, or ids like 0,1; one result file either way")
  sw.add_argument("--workers-per-gpu", type=positive_int, default=1,
                  help="worker processes per GPU: their Pallas kernels compile at the "
                  "same time and one at a time times on the GPU; faster where compiling "
                  "dominates, as for grouped GEMM (default: 1)")
  sw.add_argument("--lengths", choices=("spread", "full"),
                  help="decode: the sequences' valid lengths, spread evenly over [q_len, "
                  "kv_len] (default: a serving batch of mixed lengths) or all full; "
                  "recorded in the file's header (a resumed file must match), and a "
                  "non-default mix has its own default --out file")
  sw.add_argument("--problems-of", type=existing_file, metavar="SWEEP",
                  help="measure the problems of this sweep file instead of the suite's "
                  "(e.g. the new configs of a grown space, or a new baseline, for the "
                  "problems on file; with --out the same file, only what is missing)")
  sw.add_argument("--remeasure", action="store_true",
                  help="measure the selected problems again after a kernel change: their "
                  "rows of the swept backends' configs (--backends) and of the baseline "
                  "are replaced, other rows (extra baselines, other backends, configs "
                  "outside the space) stay; the file's header records the command, and "
                  "lists the problems until they are measured in full, so a run cut "
                  "short and run again resumes")
  sw.add_argument("--worker-measure", help=argparse.SUPPRESS)  # tests: module:factory
  sw.set_defaults(func=_sweep)
  rp = sub.add_parser("report", help="tables and a wave plot of a sweep file",
                      description="Per problem: the oracle config and time, the "
                      "baseline, the fixed default, the heuristic, the worst config "
                      "and the spread; then geomeans, GPU seconds, repeatability, "
                      "failures. A file cut off at its end (a run killed mid-write) is "
                      "reported up to the cut, with a warning on stderr; a file that is "
                      "not a sweep is an error.")
  rp.add_argument("sweep", type=existing_file, help="a sweep file (.jsonl.gz)")
  rp.add_argument("--plot", type=output_file,
                  help="PNG path for latency against the size field")
  rp.set_defaults(func=_report)
  mg = sub.add_parser(
      "merge", help="put the problems of one sweep file into another",
      description="A problem in both files keeps only the rows of SWEEP, so each "
      "problem's configs come from one run; INTO's header records SWEEP's run. Both "
      "files must be intact and valid (as tune and eval read them): a truncated or "
      "corrupt one is an error, and nothing is written.")
  mg.add_argument("sweep", type=existing_file, help="the file whose problems are taken")
  mg.add_argument("--into", required=True, type=existing_file,
                  help="the sweep file to update")
  mg.set_defaults(func=_merge)
