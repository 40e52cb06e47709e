"""Sweeps over all of a host's GPUs: one worker process per device.

The parent (``wavetune sweep --devices N``) plans the sweep as a one-GPU run
would (:func:`~wavetune_jax.tuning.sweep.plan_sweep`), then hands problems
to workers, one at a time, each worker a process that sees one GPU
(``CUDA_VISIBLE_DEVICES``). Workers send their rows back in batches as JSON
lines; the parent is the only writer of the one sweep file, so rows are
appended in crash-safe batches as in a one-GPU sweep, and a row already on
file is never written twice. When a worker dies (a crash, a kernel that
takes the GPU down, a kill), the rows it sent stay; the rest of its problem
goes back on the queue for another worker, and the dead worker is restarted.
Rows come back one per line as measured, so the parent knows which config a
worker died on: a config on which two workers died gets a ``run_error`` row
and the rest of its problem goes on; a worker that dies three times before it
is ready stops the sweep with an error; a worker silent for
``WORKER_TIMEOUT_S`` is killed (hung). Rerunning the command resumes, as
always.

A device may be listed more than once (``--workers-per-gpu``): its workers
then share it through a :class:`~wavetune_jax.tuning.profiler.GpuLock`
(``worker_args["gpu_lock_dir"]``), so Pallas lowering, which holds Python's
GIL and dominates a grouped-GEMM sweep, runs in several processes while one
at a time times kernels; such workers allocate GPU memory as they need it
and free it when done (``XLA_PYTHON_CLIENT_ALLOCATOR=platform``).
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
from typing import Callable, Sequence

from wavetune_jax.tuning import sweep

__all__ = ["run_parallel", "local_gpu_count", "worker_main", "ParallelMeasurer"]

#: Deaths of workers on one config before it is recorded failed.
MAX_DEATHS = 2
#: Seconds a worker may go without sending a row before it is killed (hung).
WORKER_TIMEOUT_S = 1800


def local_gpu_count() -> int:
  """GPUs of this host, counted without starting JAX's GPU client here
  (the workers need the memory)."""
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:
    return len([d for d in visible.split(",") if d.strip()])
  try:
    out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
  except (OSError, subprocess.TimeoutExpired):
    return 0
  return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


@dataclasses.dataclass
class _Job:
  problem: object
  configs: list
  baseline: tuple  # the baseline impls to time ("baseline", "baseline_<name>")
  deaths: int = 0


def run_parallel(spec, todo: Sequence[tuple], out: sweep.SweepFile, *, devices: Sequence[str],
                 worker_args: dict, progress=None, measure: str | None = None,
                 on_rows: Callable | None = None) -> dict:
  """Runs ``todo`` (from ``plan_sweep``) on one worker per device.

  Args:
    spec: the family (with the backends swept).
    todo: ``[(problem, configs, baseline impls)]`` (``plan_sweep``'s).
    out: the sweep file; the only writer is this process.
    devices: device ids, one worker each (``CUDA_VISIBLE_DEVICES``); an id
      listed k times gets k workers that share it (module doc).
    worker_args: ``{"iterations": n, "threads": n}`` for the workers' profilers;
      ``"gpu_lock_dir"``: where the locks of shared devices live.
    progress: as for ``run_sweep``.
    measure: ``"module:function"``, a factory ``f(family, worker_args) ->
      MeasureFn`` used by the workers instead of the GPU profiler (tests).
    on_rows: called with every batch of rows received.

  Returns:
    ``{"measured": n, "failed": n, "worker_deaths": n}``.
  """
  jobs: queue.Queue = queue.Queue()
  for p, cfgs, base in todo:
    jobs.put(_Job(p, list(cfgs), base))
  pending = [len(todo)]
  lock = threading.Lock()
  counts = {"measured": 0, "failed": 0, "worker_deaths": 0}
  names = [b.name for b in spec.backends]
  if progress is not None:
    progress.start(sweep.planned_measurements(spec, todo))

  def record(rows):
    with lock:
      out.append(rows)
      if on_rows is not None:
        on_rows(rows)
      for r in rows:
        if r["impl"] in ("timing",):
          continue
        counts["measured"] += 1
        counts["failed"] += r["status"] != "ok"
        if progress is not None and r["impl"] != "repeat":
          progress.advance(r["status"])

  def remaining(job: _Job) -> _Job:
    pk = spec.problem_key(job.problem)
    cfgs = [c for c in job.configs
            if sweep.row_key(pk, "pallas", spec.config_to_dict(c)) not in out.done]
    base = tuple(i for i in job.baseline if sweep.row_key(pk, i, None) not in out.done)
    return _Job(job.problem, cfgs, base, job.deaths)

  def finish(job):
    with lock:
      pending[0] -= 1
      if pending[0] == 0:
        for _ in devices:
          jobs.put(None)

  errors: list[str] = []

  def stop_all(message: str):
    with lock:
      errors.append(message)
      for _ in devices:
        jobs.put(None)

  def serve(device: str):
    proc = None
    silent_deaths = 0  # deaths in a row before a worker said it was ready
    try:
      while not errors:
        job = jobs.get()
        if job is None:
          break
        if proc is None or proc.poll() is not None:
          proc = _start_worker(spec.name, names, device, worker_args, measure)
        t0 = time.perf_counter()
        ok, ready = _run_job(proc, spec, job, record,
                             timeout_s=worker_args.get("timeout_s", WORKER_TIMEOUT_S))
        pk = spec.problem_key(job.problem)
        record([{"type": "row", "key": f"{pk}|timing|{device}|{time.time_ns()}",
                 "problem": spec.problem_to_dict(job.problem), "impl": "timing",
                 "config": None, "status": "ok", "wall_s": time.perf_counter() - t0,
                 "device": device}])
        silent_deaths = 0 if ready else silent_deaths
        if ok:
          finish(job)
          continue
        with lock:
          counts["worker_deaths"] += 1
        proc = None
        if not ready:
          silent_deaths += 1
          if silent_deaths >= 3:
            jobs.put(job)
            stop_all(f"the worker on device {device} died 3 times before it was ready "
                     f"(see its messages above)")
            break
          jobs.put(job)
          continue
        rest = remaining(job)
        rest.deaths += 1
        if not (rest.configs or rest.baseline):
          finish(job)
          continue
        if rest.deaths >= MAX_DEATHS:
          # Rows come one by one in the order sent: the first one missing is
          # the one the workers died on. It is recorded failed; the rest goes on.
          culprit = _Job(rest.problem, rest.configs[:1],
                         () if rest.configs else tuple(rest.baseline[:1]), rest.deaths)
          _record_failed(spec, culprit, record)
          rest = remaining(rest)
          rest.deaths = MAX_DEATHS - 1
          if not (rest.configs or rest.baseline):
            finish(job)
            continue
        jobs.put(rest)
    except BaseException as e:  # noqa: BLE001 - a serving thread must never die silently
      stop_all(f"device {device}: {type(e).__name__}: {e}")
      if proc is not None:
        proc.kill()  # it may be mid-problem, blocked on a pipe no one reads
    finally:
      if proc is not None and proc.poll() is None:
        try:
          proc.stdin.close()
          proc.wait(timeout=60)
        except (OSError, subprocess.TimeoutExpired):
          proc.kill()

  if not todo:
    return counts
  threads = [threading.Thread(target=serve, args=(d,), daemon=True) for d in devices]
  try:
    for t in threads:
      t.start()
    for t in threads:
      t.join()
  finally:
    if progress is not None:
      progress.stop()
  if errors:
    raise RuntimeError("; ".join(errors) + "; the rows measured so far are on file")
  return counts


class ParallelMeasurer:
  """The tuner's measurer on several GPUs: each round's anchors, grouped by
  problem, go to one worker per device (:func:`run_parallel`); every
  measurement is appended to the anchor log, and anchors already there are
  read, not re-timed (as :class:`wavetune_jax.tuning.tuner.GpuMeasurer`)."""

  mode = "gpu"

  def __init__(self, spec, log: sweep.SweepFile, *, devices: Sequence[str], worker_args: dict,
               progress=None, measure: str | None = None):
    import collections
    self.spec, self.log, self.devices = spec, log, list(devices)
    self.worker_args, self.progress, self._measure = worker_args, progress, measure
    self.seconds = 0.0
    self.phase_seconds = collections.Counter()
    self._known: dict = {}
    _, rows = sweep.read_sweep(log.path, check=True)
    self._learn(rows)

  def _learn(self, rows):
    for r in rows:
      if r.get("impl") == "pallas":
        key = (self.spec.problem_from_dict(r["problem"]),
               self.spec.config_from_dict(r["config"]))
        self._known[key] = r["median_us"] if r["status"] == "ok" else None

  def measure(self, points: Sequence[tuple]) -> list:
    todo: dict = {}
    for p, c in dict.fromkeys(points):
      if (p, c) not in self._known:
        todo.setdefault(p, []).append(c)
    t0 = time.perf_counter()
    if todo:
      run_parallel(self.spec, [(p, cs, ()) for p, cs in todo.items()], self.log,
                   devices=self.devices, worker_args=self.worker_args,
                   measure=self._measure, on_rows=self._on_rows)
    self.seconds += time.perf_counter() - t0
    return [self._known.get(pc) for pc in points]

  def _on_rows(self, rows):
    self._learn(rows)
    if self.progress is not None:
      for r in rows:
        if r.get("impl") == "pallas":
          self.progress.advance(r["status"])


def _record_failed(spec, job: _Job, record):
  from wavetune_jax.tuning.profiler import Measurement
  m = Measurement(status="run_error",
                  error=f"the worker died {job.deaths} times on this problem")
  rows = [sweep.make_row(spec, job.problem, "pallas", c, m) for c in job.configs]
  rows += [sweep.make_row(spec, job.problem, i, None, m) for i in job.baseline]
  record(rows)


def _start_worker(family: str, backends: list, device: str, worker_args: dict,
                  measure: str | None) -> subprocess.Popen:
  visible = os.environ.get("CUDA_VISIBLE_DEVICES")
  if visible is not None:  # ids are indices into this process's visible GPUs
    ids = [d.strip() for d in visible.split(",") if d.strip()]
    device = ids[int(device)] if int(device) < len(ids) else device
  env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(device))
  if worker_args.get("gpu_lock_dir"):  # workers share this GPU (module doc)
    worker_args = dict(worker_args, gpu_lock=os.path.join(worker_args["gpu_lock_dir"],
                                                          f"gpu{device}.lock"))
    env.update(XLA_PYTHON_CLIENT_PREALLOCATE="false", XLA_PYTHON_CLIENT_ALLOCATOR="platform")
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  args = json.dumps({"family": family, "backends": backends, "measure": measure,
                     **worker_args})
  return subprocess.Popen([sys.executable, "-m", "wavetune_jax.tuning.parallel", args],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                          bufsize=1)


def _run_job(proc, spec, job: _Job, record: Callable, *, timeout_s: float
             ) -> tuple[bool, bool]:
  """Sends one problem; records the rows as they come. ``(finished, ready)``:
  not finished if the worker died (or hung for ``timeout_s`` and was killed);
  ready once the worker said it started."""
  msg = {"problem": spec.problem_to_dict(job.problem),
         "configs": [spec.config_to_dict(c) for c in job.configs],
         "baseline": list(job.baseline)}
  ready = getattr(proc, "ready", False)
  watchdog = [threading.Timer(timeout_s, proc.kill)]
  watchdog[0].start()
  try:
    try:
      proc.stdin.write(json.dumps(msg) + "\n")
      proc.stdin.flush()
    except (BrokenPipeError, OSError):
      return False, ready
    for line in proc.stdout:
      watchdog[0].cancel()
      watchdog[0] = threading.Timer(timeout_s, proc.kill)
      watchdog[0].start()
      try:
        reply = json.loads(line)
      except json.JSONDecodeError:
        continue  # a stray print of a library: not ours
      if not isinstance(reply, dict):
        continue
      if reply.get("ready"):
        ready = proc.ready = True
      if reply.get("rows"):
        record(reply["rows"])
      if reply.get("done"):
        return True, ready
    proc.wait()
    return False, ready
  finally:
    watchdog[0].cancel()


def worker_main(argv: Sequence[str]) -> int:
  """A worker: reads problems from stdin, writes rows to stdout (module doc)."""
  args = json.loads(argv[0])
  from wavetune_jax.core.registry import get_family
  family = get_family(args["family"])
  for key, value in args.get("family_options", {}).items():  # the sweep's input options
    family = getattr(family, f"with_{key}")(value)
  family = family.with_backends(args["backends"])
  if args.get("measure"):
    mod, fn = args["measure"].split(":")
    measure = getattr(importlib.import_module(mod), fn)(family, args)
  else:
    from wavetune_jax.tuning import profiler
    lock = profiler.GpuLock(args["gpu_lock"]) if args.get("gpu_lock") else None
    measure = sweep.gpu_measure(family, profiler.Profiler(
        iterations=args.get("iterations", 20), threads=args.get("threads", 16),
        gpu_lock=lock))
  out = sys.stdout
  sys.stdout = sys.stderr  # prints of libraries must not mix with the rows
  out.write(json.dumps({"ready": True}) + "\n")
  out.flush()
  for line in sys.stdin:
    msg = json.loads(line)
    p = family.problem_from_dict(msg["problem"])
    configs = [family.config_from_dict(c) for c in msg["configs"]]
    for impl, config, m in measure(p, configs, msg["baseline"]):
      # One row per line, as soon as measured: when a worker dies, the
      # parent knows which config it was on.
      out.write(json.dumps({"rows": [sweep.make_row(family, p, impl, config, m)]}) + "\n")
      out.flush()
    out.write(json.dumps({"done": True}) + "\n")
    out.flush()
  return 0


if __name__ == "__main__":
  sys.exit(worker_main(sys.argv[1:]))
