"""Times any family's (problem, config) on the GPU with CUPTI.

Method (the same for every candidate and for the platform baseline):

* Each timed call is preceded by an L2 flush: a small Pallas kernel named
  ``wavetune_l2_flush`` reads a buffer of :data:`FLUSH_BYTES` (more than twice
  the L2 of any Hopper GPU), so weights come from HBM as in a real model. The
  flush runs in the same jitted function; its kernel is recognised by name in
  CUPTI's per-kernel list and left out of the time.
* ``jax.experimental.mosaic.gpu.profiler.measure`` sums every other kernel of a
  call (the Pallas kernel, a split-K reduction, cuBLAS, XLA fusions).
* Warm-up calls first, then the median over ``iterations`` calls, with the
  interquartile range as spread.
* Candidates are compiled in parallel threads, all before the first
  measurement, then measured one at a time. A
  config that fails to compile or to run, or computes a wrong result, is
  recorded with its error and skipped.
* Each problem's inputs, reference, NaN poison and error check are compiled
  ahead of time as one :class:`ProblemKit` (in the same thread pool as the
  candidates where the caller can), not op by op on first use: a tuner visits
  hundreds of distinct problems, and compiling eager random, reference and
  norm ops for each new shape on the timing thread cost seconds per problem.
  The float32 reference is compiled without XLA's autotuner (it only checks).
* Several workers may share one GPU (``wavetune sweep --workers-per-gpu``):
  their Pallas kernels lower and compile on the CPU at the same time, and a
  :class:`GpuLock` lets one of them at a time use the GPU (library compiles,
  whose autotuners launch kernels; inputs; checks; timing), so no kernel of
  another process runs inside a timing window.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import functools
import math
import os
import threading
import time
import warnings
from typing import Callable, Iterator, Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["Measurement", "Profiler", "ProblemKit", "GpuLock", "FLUSH_BYTES", "rel_error"]

FLUSH_BYTES = 256 * 1024 * 1024
_FLUSH_NAME = "wavetune_l2_flush"
_FLUSH_BLOCK = 8192
_CUPTI_RETRIES = 4


@dataclasses.dataclass
class Measurement:
  """One timed (problem, config) or baseline.

  Attributes:
    status: ``"ok"``, ``"compile_error"``, ``"run_error"`` or ``"wrong"``.
    median_us: median time of one call, microseconds (None unless timed).
    spread_us: interquartile range of the samples, microseconds.
    samples: number of timed calls.
    compile_s: seconds to lower and compile.
    rel_error: ``|out - ref| / |ref|`` when checked.
    error: the error message of a failure.
  """

  status: str
  median_us: float | None = None
  spread_us: float | None = None
  samples: int = 0
  compile_s: float | None = None
  rel_error: float | None = None
  error: str = ""


def rel_error(out, ref) -> float:
  """``|out - ref| / |ref|`` in float32 norms; NaN anywhere gives inf."""
  out = jnp.asarray(out, jnp.float32)
  ref = jnp.asarray(ref, jnp.float32)
  num = float(jnp.linalg.norm(out - ref))
  den = float(jnp.linalg.norm(ref))
  if not np.isfinite(num):
    return float("inf")
  return num / den if den > 0 else num


def _err_parts(out, ref):
  out = out.astype(jnp.float32)
  ref = ref.astype(jnp.float32)
  return jnp.linalg.norm(out - ref), jnp.linalg.norm(ref)


# The reference only checks results: XLA's autotuner would spend seconds per new
# shape choosing its float32 GEMM algorithm.
_NO_AUTOTUNE = {"xla_gpu_autotune_level": 0}


_totals_lock = threading.Lock()
_totals = {"lowering": 0.0, "compiling": 0.0, "compiling_candidates": 0.0}


def compile_totals() -> dict:
  """Seconds this process has spent in the profiler's compiles, summed over
  its programs and threads: ``lowering`` (tracing and lowering to the module
  XLA compiles, Python) and ``compiling`` (XLA's compile, a Mosaic GPU
  kernel's own compile to a cubin inside it), and of those
  ``compiling_candidates`` (the programs timed: candidates, baselines;
  :meth:`Profiler.compile_lowered`; the rest are the problems' inputs,
  references and checks). Threads overlap
  them, so the sums may pass the wall time; a diagnostic
  (``benchmarks/first_use_cost.py``)."""
  with _totals_lock:
    return dict(_totals)


def _count(kind: str, since: float) -> float:
  now = time.perf_counter()
  with _totals_lock:
    _totals[kind] += now - since
  return now


def _recorded(task: Callable[[], object]):
  """``task()``, or its exception in its place (a failed compile is recorded,
  never fatal)."""
  try:
    return task()
  except Exception as e:  # noqa: BLE001 - any failure is recorded
    return e


@contextlib.contextmanager
def _quiet_compiles():
  """Filters deprecation warnings while programs lower and compile. Python's
  warning filters are the process's: a pool's calling thread holds this
  around the whole pool (threads that each entered and left it would
  restore each other's filters out of order)."""
  with warnings.catch_warnings():
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    yield


def _lower_program(fn, *shapes):
  t = time.perf_counter()
  try:
    return jax.jit(fn).lower(*shapes)
  finally:
    _count("lowering", t)


def _compile_lowered(lowered, options=None):
  t = time.perf_counter()
  try:
    if options and jax.default_backend() == "gpu":
      try:
        return lowered.compile(options)
      except Exception:  # noqa: BLE001 - an XLA without the option: compile plainly
        pass
    return lowered.compile()
  finally:
    _count("compiling", t)


def _compile_program(fn, *shapes, options=None):
  return _compile_lowered(_lower_program(fn, *shapes), options)


def kit_setup(spec, problem, key):
  """``(inputs, reference)`` of ``problem``, as one program. The barrier makes
  the reference read the inputs as they are returned: in one program XLA may
  otherwise skip a rounding cast (excess precision); on a GPU the reference
  then saw e4m3 inputs unrounded, and every W8A8 candidate 3.7% off it."""
  args = jax.lax.optimization_barrier(spec.inputs(problem, key))
  return args, spec.reference(problem, *args)


@dataclasses.dataclass
class ProblemKit:
  """One problem's helpers, compiled ahead of time (see :meth:`Profiler.compile_kit`).

  Attributes:
    setup: ``setup(key) -> (inputs, reference)``.
    check: ``check(out, reference) -> (|out - ref|, |ref|)``.
    poison: ``poison() -> NaN buffer`` of the output's size.
    out_bytes: bytes of one float32 output.
    compile_s: seconds spent compiling the three.
  """

  setup: Callable
  check: Callable
  poison: Callable
  out_bytes: int
  compile_s: float

  def materialize(self, seed: int = 0):
    """``(inputs, reference)`` on the device."""
    return self.setup(jax.random.PRNGKey(seed))

  def error(self, out, ref) -> float:
    """:func:`rel_error` with the compiled check (eager for another output type)."""
    try:
      num, den = (float(v) for v in self.check(out, ref))
    except TypeError:  # e.g. a baseline whose output dtype differs from the kernel's
      return rel_error(out, ref)
    if not np.isfinite(num):
      return float("inf")
    return num / den if den > 0 else num


class GpuLock:
  """A lock on one GPU shared by the processes that time kernels on it: an
  exclusive ``flock`` on ``path`` (the system drops it when its holder dies).
  Reentrant within one process."""

  def __init__(self, path: str):
    self.path = path
    self._fd: int | None = None
    self._depth = 0

  @contextlib.contextmanager
  def __call__(self):
    import fcntl
    if self._depth == 0:
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      fcntl.flock(fd, fcntl.LOCK_EX)
      self._fd = fd
    self._depth += 1
    try:
      yield
    finally:
      self._depth -= 1
      if self._depth == 0:
        fd, self._fd = self._fd, None
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def _flush_kernel(x_ref, o_ref):
  o_ref[...] = jnp.sum(x_ref[...], keepdims=True)


@functools.lru_cache(maxsize=1)
def _flush_fn():
  from jax.experimental import pallas as pl

  from pallas_kernels import _triton_lowering
  _triton_lowering.require("the profiler's L2 flush (a Pallas Triton kernel)")
  n_blocks = FLUSH_BYTES // 4 // _FLUSH_BLOCK

  def flush(buf):
    with warnings.catch_warnings():
      warnings.filterwarnings("ignore", category=DeprecationWarning)
      return pl.pallas_call(
          _flush_kernel,
          out_shape=jax.ShapeDtypeStruct((n_blocks,), jnp.float32),
          grid=(n_blocks,),
          in_specs=[pl.BlockSpec((_FLUSH_BLOCK,), lambda i: (i,))],
          out_specs=pl.BlockSpec((1,), lambda i: (i,)),
          compiler_params=_triton_lowering.compiler_params(num_warps=4, num_stages=1),
          name=_FLUSH_NAME,
      )(buf)
  return flush


def _short(e: BaseException, limit: int = 400) -> str:
  msg = f"{type(e).__name__}: {e}".strip().replace("\n", " ")
  return msg if len(msg) <= limit else msg[:limit] + "..."


def enable_persistent_cache(path: str) -> None:
  """JAX's persistent compilation cache in ``path`` for every compile (no
  size or time threshold), with XLA's per-fusion autotune results there too
  where this JAX has that option. Call before the first compile."""
  os.makedirs(path, exist_ok=True)
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_entry_size_bytes", -1)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
  try:
    jax.config.update("jax_persistent_cache_enable_xla_caches",
                      "xla_gpu_per_fusion_autotune_cache_dir")
  except (AttributeError, ValueError):  # an older JAX: its compilation cache only
    pass


class Profiler:
  """CUPTI timer for kernel candidates.

  Args:
    iterations: timed calls per candidate (median over them); >= 20 advised.
    warmup: untimed calls before timing.
    threads: parallel compile threads.
    max_live_bytes: bound on the outputs kept alive during one timing batch
      (CUPTI's ``measure`` keeps every iteration's result until it returns).
    gpu_lock: a :class:`GpuLock` when other processes time kernels on the
      same GPU (None: this process is alone on it).
  """

  def __init__(self, *, iterations: int = 25, warmup: int = 2, threads: int = 16,
               max_live_bytes: int = 8 << 30, gpu_lock: GpuLock | None = None):
    if iterations < 1:
      raise ValueError(f"{iterations=} must be >= 1")
    self.gpu_lock = gpu_lock
    self.iterations = iterations
    self.warmup = warmup
    self.threads = threads
    self.max_live_bytes = max_live_bytes
    self._flush_buf = None

  # --- building blocks --------------------------------------------------------------
  def on_gpu(self):
    """Context in which this process alone uses the GPU (:class:`GpuLock`)."""
    return self.gpu_lock() if self.gpu_lock is not None else contextlib.nullcontext()

  def _buf(self):
    if self._flush_buf is None:
      self._flush_buf = jnp.ones((FLUSH_BYTES // 4,), jnp.float32)
    return self._flush_buf

  @staticmethod
  def timed_fn(fn: Callable) -> Callable:
    """``fn`` with an L2 flush in front, as one jittable function."""
    flush = _flush_fn()

    def f(buf, *args):
      return flush(buf), fn(*args)
    return f

  def lower(self, fn: Callable, args: Sequence):
    """Lowers ``timed_fn(fn)`` for arrays or shapes ``args``."""
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    buf = jax.ShapeDtypeStruct((FLUSH_BYTES // 4,), jnp.float32)
    return _lower_program(self.timed_fn(fn), buf, *shapes)

  def compile_lowered(self, lowered):
    """The executable of :meth:`lower`'s result."""
    t = time.perf_counter()
    try:
      return _compile_lowered(lowered)
    finally:
      _count("compiling_candidates", t)

  def compile(self, fn: Callable, args: Sequence) -> tuple[object, float]:
    """Lowers and compiles ``timed_fn(fn)`` for arrays or shapes ``args``;
    returns (executable, seconds)."""
    t0 = time.perf_counter()
    with _quiet_compiles():
      exe = self.compile_lowered(self.lower(fn, args))
    return exe, time.perf_counter() - t0

  def compile_pipelined(self, jobs: Sequence[tuple[Callable, Sequence]],
                        others: Sequence[Callable[[], object]] = ()) -> tuple[list, list]:
    """``(executable, seconds)`` of :meth:`compile` for each ``(fn, args)``
    of ``jobs`` (``(exception, seconds)`` where it failed; the seconds are
    its lowering and its compile, not its wait for a thread), and the tasks
    ``others``. One thread of its own lowers the jobs one after another and
    hands each to :attr:`threads` threads to compile as soon as it is
    lowered, where ``others`` run too: lowering is Python, so threads
    lowering together only share the GIL, and every lowering would end near
    the last one's end before any compile began (a Mosaic GPU kernel lowers
    in about 0.3-0.6 s and compiles in about 1 s on an H200's host;
    docs/results.md, "Compile parallelism"). Returns ``(job results, other
    results)``, a task's exception in its place, as :meth:`parallel`."""
    def finish(lowered, lower_s):
      t0 = time.perf_counter()
      try:
        return self.compile_lowered(lowered), lower_s + time.perf_counter() - t0
      except Exception as e:  # noqa: BLE001 - a failed config is recorded, not fatal
        return e, lower_s + time.perf_counter() - t0

    with _quiet_compiles(), \
        concurrent.futures.ThreadPoolExecutor(max(1, self.threads)) as pool, \
        concurrent.futures.ThreadPoolExecutor(1) as lowering:

      def lower_all():
        out = []
        for fn, args in jobs:
          t0 = time.perf_counter()
          try:
            lowered = self.lower(fn, args)
          except Exception as e:  # noqa: BLE001 - a failed config is recorded, not fatal
            out.append((e, time.perf_counter() - t0))
            continue
          out.append(pool.submit(finish, lowered, time.perf_counter() - t0))
        return out

      # (the lowering is queued first: it feeds the compiles; others wait
      # for a compile thread, not for the lowering)
      lowered = lowering.submit(lower_all)
      rest = [pool.submit(_recorded, t) for t in others]
      done = [x.result() if isinstance(x, concurrent.futures.Future) else x
              for x in lowered.result()]
      return done, [f.result() for f in rest]

  @staticmethod
  def compile_kit(spec, problem, candidate: Callable | None = None) -> ProblemKit:
    """Compiles ``problem``'s inputs + reference, poison and check.

    Args:
      spec: the family (``inputs``, ``reference``).
      problem: the problem.
      candidate: any ``f(*inputs)`` of the problem, whose output shape and
        dtype the check is compiled for (default: the reference's).
    """
    t0 = time.perf_counter()

    setup = functools.partial(kit_setup, spec, problem)

    key = jax.eval_shape(lambda: jax.random.PRNGKey(0))
    args_s, ref_s = jax.eval_shape(setup, key)
    out_s = ref_s if candidate is None else jax.eval_shape(candidate, *args_s)
    out_bytes = 4 * math.prod(ref_s.shape)
    n = max(1, out_bytes // 4)
    return ProblemKit(
        setup=_compile_program(setup, key, options=_NO_AUTOTUNE),
        check=_compile_program(_err_parts, out_s, ref_s),
        poison=_compile_program(lambda: jnp.full((n,), jnp.nan, jnp.float32)),
        out_bytes=out_bytes, compile_s=time.perf_counter() - t0)

  def parallel(self, tasks: Sequence[Callable[[], object]]) -> list:
    """Runs ``tasks`` in :attr:`threads` threads; a task's exception is
    returned in its place (a failed compile is recorded, never fatal)."""
    with _quiet_compiles(), concurrent.futures.ThreadPoolExecutor(self.threads) as pool:
      return list(pool.map(_recorded, tasks))

  def time_compiled(self, exe, args: Sequence, out_bytes: int) -> list[float]:
    """Per-call microseconds of ``exe`` (flush kernels excluded)."""
    from jax.experimental.mosaic.gpu import profiler as mgpu_profiler
    buf = self._buf()
    for _ in range(self.warmup):
      jax.block_until_ready(exe(buf, *args))
    chunk = max(1, min(self.iterations, self.max_live_bytes // max(1, out_bytes)))
    samples: list[float] = []
    while len(samples) < self.iterations:
      n = min(chunk, self.iterations - len(samples))
      for attempt in range(_CUPTI_RETRIES):
        try:
          _, timings = mgpu_profiler.measure(exe, aggregate=False, iterations=n)(buf, *args)
          break
        except RuntimeError as e:
          # CUPTI now and then loses a kernel record ("number of kernel
          # launches is not divisible by the number of iterations"): retry.
          if "kernel launches" not in str(e) or attempt == _CUPTI_RETRIES - 1:
            raise
      if timings is None:
        raise RuntimeError("CUPTI recorded no kernels")
      if n == 1:
        timings = [timings]
      for kernels in timings:
        samples.append(1e3 * sum(ms for name, ms in kernels if _FLUSH_NAME not in name))
    return samples

  def kernel_names(self, exe, args: Sequence) -> list[str]:
    """Names CUPTI reports for one call (flush included); for diagnostics."""
    from jax.experimental.mosaic.gpu import profiler as mgpu_profiler
    _, timings = mgpu_profiler.measure(exe, aggregate=False)(self._buf(), *args)
    return [name for name, _ in (timings or [])]

  def kernel_breakdown(self, fn: Callable, args: Sequence, *, iterations: int = 5
                       ) -> list[tuple[str, float]]:
    """Per-kernel microseconds of one call of ``fn`` (median over
    ``iterations`` calls, L2 flushed, flush excluded), kernels of one name
    summed, longest first; for diagnostics."""
    from jax.experimental.mosaic.gpu import profiler as mgpu_profiler
    exe, _ = self.compile(fn, args)
    buf = self._buf()
    jax.block_until_ready(exe(buf, *args))
    _, timings = mgpu_profiler.measure(exe, aggregate=False, iterations=iterations)(buf, *args)
    if iterations == 1:
      timings = [timings]
    per_call = []
    for kernels in timings or []:
      d: dict[str, float] = {}
      for name, ms in kernels:
        if _FLUSH_NAME not in name:
          d[name] = d.get(name, 0.0) + 1e3 * ms
      per_call.append(d)
    names = {n for d in per_call for n in d}
    med = {n: float(np.median([d.get(n, 0.0) for d in per_call])) for n in names}
    return sorted(med.items(), key=lambda kv: -kv[1])

  @staticmethod
  def summarize(samples: Sequence[float]) -> tuple[float, float]:
    a = np.asarray(samples, np.float64)
    q25, q50, q75 = np.percentile(a, [25, 50, 75])
    return float(q50), float(q75 - q25)

  # --- the main entry ------------------------------------------------------------------
  def measure_iter(self, fns: Sequence[Callable], args: Sequence, *,
                   reference=None, tolerance: float | None = None,
                   out_bytes: int = 0, kit: ProblemKit | None = None
                   ) -> Iterator[tuple[int, Measurement]]:
    """Compiles ``fns`` in parallel, then checks and times each one (for
    benchmarks timing arbitrary functions; sweeps and the tuner use
    :func:`wavetune_jax.tuning.measure.measure_points`).

    Args:
      fns: callables ``f(*args)`` (candidates and baselines alike).
      args: device arrays passed to every callable.
      reference: expected output; with ``tolerance``, a candidate whose
        relative error exceeds it is marked ``"wrong"`` and not timed.
      out_bytes: size of one output (bounds the live results while timing).
      kit: the problem's compiled poison and check (else eager ops).

    Yields:
      ``(index into fns, Measurement)`` in the order of ``fns``.
    """
    # Every compile finishes before the first measurement: XLA's autotuner
    # (compiling a baseline) launches kernels of its own, which CUPTI would
    # otherwise record inside a candidate's timing window.
    shapes = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args]
    compiled, _ = self.compile_pipelined([(f, shapes) for f in fns])
    for i, (exe, compile_s) in enumerate(compiled):
      yield i, self.check_and_time(exe, compile_s, args, reference, tolerance, out_bytes, kit)
      compiled[i] = None

  def measure_many(self, fns: Sequence[Callable], args: Sequence, **kw) -> list[Measurement]:
    """:meth:`measure_iter`, collected in the order of ``fns``."""
    results: list[Measurement | None] = [None] * len(fns)
    for i, m in self.measure_iter(fns, args, **kw):
      results[i] = m
    return results  # type: ignore[return-value]

  def check_and_time(self, exe, compile_s: float, args, reference, tolerance,
                     out_bytes: int, kit: ProblemKit | None = None) -> Measurement:
    """Checks a compiled candidate against ``reference`` (outputs poisoned
    first) and times it; ``exe`` an exception records a compile error."""
    if isinstance(exe, BaseException):
      return Measurement(status="compile_error", compile_s=compile_s, error=_short(exe))
    m = self._check_and_time(exe, args, reference, tolerance, out_bytes, kit)
    m.compile_s = compile_s
    return m

  def _check_and_time(self, exe, args, reference, tolerance, out_bytes,
                      kit: ProblemKit | None = None) -> Measurement:
    try:
      if reference is not None:
        # Poison: fill freed memory the output is likely to reuse with NaN.
        if kit is not None:
          poison = kit.poison()
        else:
          poison = jnp.full((max(1, out_bytes // 4),), jnp.nan, jnp.float32)
        poison.block_until_ready()
        del poison
        _, out = exe(self._buf(), *args)
        err = rel_error(out, reference) if kit is None else kit.error(out, reference)
        del out
        if tolerance is not None and not err <= tolerance:
          return Measurement(status="wrong", rel_error=err,
                             error=f"relative error {err:.3g} > {tolerance:.3g}")
      else:
        err = None
      samples = self.time_compiled(exe, args, out_bytes)
    except Exception as e:  # noqa: BLE001 - any failure is recorded
      return Measurement(status="run_error", error=_short(e))
    med, spread = self.summarize(samples)
    return Measurement(status="ok", median_us=med, spread_us=spread,
                       samples=len(samples), rel_error=err)

