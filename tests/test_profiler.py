"""The profiler's ahead-of-time problem kit (CPU)."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wavetune_jax.tuning import profiler
from wavetune_jax import ATTENTION, AttentionProblem
from synthetic import MATMUL
from wavetune_jax import MatmulProblem


@pytest.mark.parametrize("spec,problem", [
    (MATMUL, MatmulProblem(m=5, n=48, k=40)),
    (ATTENTION, AttentionProblem(batch=1, q_heads=4, kv_heads=2, q_len=9, head_dim=64)),
])
def test_kit_matches_eager_setup(spec, problem):
  kit = profiler.Profiler.compile_kit(spec, problem)
  args, ref = kit.materialize()
  eager_args = spec.inputs(problem, jax.random.PRNGKey(0))
  for a, b in zip(args, eager_args):
    assert a.shape == b.shape and a.dtype == b.dtype
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               rtol=1e-2, atol=1e-2)
  np.testing.assert_allclose(ref, spec.reference(problem, *args), rtol=1e-5, atol=1e-5)
  assert kit.out_bytes == 4 * ref.size
  poison = np.asarray(kit.poison())
  assert poison.size == ref.size and np.isnan(poison).all()


def test_kit_reference_reads_the_rounded_inputs():
  # On a GPU, XLA fused the inputs' e4m3 cast into the reference and skipped
  # its rounding (every W8A8 candidate then read as 3.7% wrong): the
  # reference must come after a barrier on the inputs.
  from wavetune_jax import QMATMUL, QMatmulProblem
  p = QMatmulProblem(m=16, n=256, k=512, dtype="float8_e4m3fn",
                     w_dtype="float8_e4m3fn", w_layout="nk")
  jaxpr = jax.make_jaxpr(lambda key: profiler.kit_setup(QMATMUL, p, key))(
      jax.random.PRNGKey(0))
  names = [e.primitive.name for e in jaxpr.eqns]
  barrier = names.index("optimization_barrier")
  assert "dot_general" not in names[:barrier] and "dot_general" in names[barrier:]


def test_kit_error_matches_rel_error_and_flags_nan():
  problem = MatmulProblem(m=8, n=32, k=16)
  fn = MATMUL.build(problem, MATMUL.default(problem), interpret=True)
  kit = profiler.Profiler.compile_kit(MATMUL, problem, fn)
  args, ref = kit.materialize()
  out = fn(*args)
  assert kit.error(out, ref) == pytest.approx(profiler.rel_error(out, ref), rel=1e-5)
  assert kit.error(out, ref) < MATMUL.tolerance(problem)
  bad = out.at[0, 0].set(jnp.nan)
  assert kit.error(bad, ref) == float("inf")
  # Another output dtype than the one compiled for: the eager path answers.
  assert kit.error(out.astype(jnp.float32), ref) == pytest.approx(
      profiler.rel_error(out, ref), rel=1e-2)


class _CpuProfiler(profiler.Profiler):
  """The real check/time path on CPU: candidates run in interpret mode, the
  CUPTI timer is replaced by a known latency, the flush buffer is tiny."""

  def __init__(self, wrong=()):
    super().__init__(iterations=3, threads=4)
    self.wrong = set(wrong)
    self.timed = []

  def _buf(self):
    return jnp.zeros((8,), jnp.float32)

  def lower(self, fn, args):   # one step here: compile does both
    return fn, args

  def compile_lowered(self, lowered):
    return self.compile(*lowered)[0]

  def compile(self, fn, args):
    problem, config = fn.problem_config
    interp = MATMUL.build(problem, config, interpret=True)
    if config in self.wrong:
      def run(buf, *a):
        return buf, interp(*a) * 2
    else:
      def run(buf, *a):
        return buf, interp(*a)
    run.key = (problem, config)
    return run, 0.01

  def time_compiled(self, exe, args, out_bytes):
    self.timed.append(exe.key)
    p, c = exe.key
    return [synthetic_us(p, c)] * self.iterations


def synthetic_us(p, c):
  return 1.0 + p.m * 0.01 + c.block_m / 64


def _tag_builds(monkeypatch):
  """MATMUL.build marks each candidate with its (problem, config), which
  :class:`_CpuProfiler` reads back."""
  build = MATMUL.build

  def tagged_build(problem, config, **kw):
    fn = build(problem, config, **kw)
    fn.problem_config = (problem, config)
    return fn
  monkeypatch.setattr(MATMUL, "build", tagged_build)


def test_gpu_backend_logs_checks_and_resumes(tmp_path, monkeypatch):
  from wavetune_jax.tuning import sweep, tuner as tuning
  from synthetic import HW
  _tag_builds(monkeypatch)
  problems = [MatmulProblem(m=m, n=64, k=32) for m in (3, 40)]
  points = [(p, c) for p in problems for c in MATMUL.space(p, HW)[:3]]
  bad = points[1][1]
  log_path = str(tmp_path / "anchors.jsonl.gz")
  header = sweep.make_header(MATMUL, HW, jax_version="0", command="t", space="anchors")
  prof = _CpuProfiler(wrong={bad})
  backend = tuning.GpuMeasurer(MATMUL, prof, log=sweep.SweepFile(log_path, header))
  got = backend.measure(points)
  for (p, c), us in zip(points, got):
    assert us == (None if c == bad else pytest.approx(synthetic_us(p, c)))
  phases = backend.phase_seconds
  assert set(phases) == {"compile", "setup", "check_and_time", "lowering_summed",
                         "compiling_summed", "compiling_candidates_summed"}
  # every program compiled lowers and compiles; threads may overlap them
  assert phases["lowering_summed"] > 0 and phases["compiling_summed"] > 0
  _, rows = sweep.read_sweep(log_path)
  assert len(rows) == len(points)
  assert {r["status"] for r in rows} == {"ok", "wrong"}
  assert all(r["rel_error"] < 1e-2 for r in rows if r["status"] == "ok")
  # A new backend on the same log re-times nothing.
  prof2 = _CpuProfiler()
  again = tuning.GpuMeasurer(MATMUL, prof2, log=sweep.SweepFile(log_path, header))
  assert again.measure(points) == got and prof2.timed == []


def test_gpu_backend_keeps_the_chunks_done_when_stopped(tmp_path, monkeypatch):
  # One problem a chunk: the first problem's rows are on file when the
  # second one's compile stops the run, and a rerun times only the second.
  from wavetune_jax.tuning import sweep, tuner as tuning
  from synthetic import HW
  _tag_builds(monkeypatch)
  problems = [MatmulProblem(m=m, n=64, k=32) for m in (3, 40)]
  points = [(p, c) for p in problems for c in MATMUL.space(p, HW)[:2]]
  log_path = str(tmp_path / "anchors.jsonl.gz")
  header = sweep.make_header(MATMUL, HW, jax_version="0", command="t", space="anchors")

  class Stops(_CpuProfiler):
    def compile(self, fn, args):
      if fn.problem_config[0] is problems[1]:
        raise KeyboardInterrupt
      return super().compile(fn, args)
  with pytest.raises(KeyboardInterrupt):
    tuning.GpuMeasurer(MATMUL, Stops(), log=sweep.SweepFile(log_path, header),
                       chunk=1).measure(points)
  _, rows = sweep.read_sweep(log_path)
  assert {r["problem"]["m"] for r in rows} == {3} and len(rows) == 2
  prof = _CpuProfiler()
  tuning.GpuMeasurer(MATMUL, prof, log=sweep.SweepFile(log_path, header),
                     chunk=1).measure(points)
  assert {k[0] for k in prof.timed} == {problems[1]}


class _RecordingLock:
  """A stand-in for GpuLock that records what ran while it was held."""

  def __init__(self):
    self.held = False
    self.events = []

  def __call__(self):
    import contextlib

    @contextlib.contextmanager
    def hold():
      assert not self.held
      self.held = True
      try:
        yield
      finally:
        self.held = False
    return hold()


def test_shared_gpu_pallas_compiles_outside_the_lock_the_rest_inside():
  from wavetune_jax.tuning.measure import measure_points
  from wavetune_jax import MATMUL as FULL
  from wavetune_jax.families.matmul import XlaMatmulConfig
  from synthetic import HW
  fam = FULL.with_backends(["triton", "xla"])
  lock = _RecordingLock()

  class Prof(_CpuProfiler):
    def compile(self, fn, args):
      p, c = fn.problem_config
      lock.events.append(("compile", fam.backend_of(c).name, lock.held))
      if fam.backend_of(c).name == "xla":
        run = lambda buf, *a: (buf, fn(*a))  # noqa: E731
        run.key = (p, c)
        return run, 0.01
      return super().compile(fn, args)

    def time_compiled(self, exe, args, out_bytes):
      lock.events.append(("time", fam.backend_of(exe.key[1]).name, lock.held))
      if fam.backend_of(exe.key[1]).name == "xla":
        return [5.0] * self.iterations
      return super().time_compiled(exe, args, out_bytes)

  build = fam.build

  def tagged_build(problem, config, **kw):
    fn = build(problem, config, **kw)
    fn.problem_config = (problem, config)
    return fn
  p = MatmulProblem(m=40, n=64, k=32)
  configs = list(MATMUL.space(p, HW)[:3]) + [XlaMatmulConfig()]
  prof = Prof()
  prof.gpu_lock = lock
  import unittest.mock
  with unittest.mock.patch.object(fam, "build", tagged_build):
    rows = list(measure_points(fam, prof, [(p, configs)]))
  assert [r[3].status for r in rows] == ["ok"] * 4
  assert sorted(lock.events) == sorted(
      [("compile", "triton", False)] * 3 + [("compile", "xla", True)]
      + [("time", "triton", True)] * 3 + [("time", "xla", True)])


def test_gpu_lock_excludes_another_process(tmp_path):
  import subprocess
  import sys
  path = str(tmp_path / "gpu0.lock")
  lock = profiler.GpuLock(path)
  probe = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT);\n"
           "try:\n  fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB); print('free')\n"
           "except BlockingIOError:\n  print('held')")
  ask = lambda: subprocess.run([sys.executable, "-c", probe, path], capture_output=True,  # noqa: E731
                               text=True, check=True).stdout.strip()
  with lock():
    with lock():  # reentrant in one process
      assert ask() == "held"
    assert ask() == "held"
  assert ask() == "free"


def test_a_problem_whose_inputs_fail_is_recorded_and_the_next_is_measured(monkeypatch):
  """Out of memory making one problem's inputs or reference (Arctic's 128
  experts at 32k rows) fails that problem's rows, not the sweep."""
  from wavetune_jax.tuning.measure import measure_points
  from synthetic import HW
  big, small = MatmulProblem(m=48, n=64, k=32), MatmulProblem(m=40, n=64, k=32)
  orig, calls = profiler.ProblemKit.materialize, []

  def first_fails(self, *a, **kw):
    calls.append(1)
    if len(calls) == 1:
      raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 112.00GiB")
    return orig(self, *a, **kw)

  monkeypatch.setattr(profiler.ProblemKit, "materialize", first_fails)
  _tag_builds(monkeypatch)
  work = [(p, list(MATMUL.space(p, HW)[:2])) for p in (big, small)]
  rows = list(measure_points(MATMUL, _CpuProfiler(), work))
  assert [(r[0], r[3].status) for r in rows] == [(big, "run_error")] * 2 + [(small, "ok")] * 2
  assert "Out of memory" in rows[0][3].error


def test_refinement_times_decode_on_full_caches_too(monkeypatch):
  """First use times decode configs on the spread lengths and on full
  caches (the same compiled code): a config faster on the spread lengths but
  not MARGIN faster than the platform op on full caches is not kept."""
  from wavetune_jax import DECODE, DecodeProblem
  from wavetune_jax.families.decode.library import XlaDecodeConfig
  from wavetune_jax.runtime import refine
  from pallas_kernels.decode.triton import TritonDecodeConfig
  p = DecodeProblem(batch=2, q_heads=4, kv_heads=2, kv_len=32, head_dim=64)
  (full,) = DECODE.refine_mixes(p)
  assert full.length_mix == "full" and DECODE.length_mix == "spread"
  assert full.refine_mixes(p) == () and DECODE.refine_mixes(
      DecodeProblem(batch=3, q_heads=4, kv_heads=2, kv_len=64, head_dim=64, lengths=False)) == ()
  xla = XlaDecodeConfig()
  a, b = (TritonDecodeConfig(block_h=16, block_k=16, num_splits=s) for s in (4, 1))
  build = DECODE.build

  def tagged_build(problem, config, **kw):
    fn = build(problem, config, interpret=True)
    fn.config = config
    return fn
  monkeypatch.setattr(DECODE, "build", tagged_build)
  us = {}   # (config, full cache) -> us

  class Prof(_CpuProfiler):
    def compile(self, fn, args):   # ahead of time, as on a GPU
      exe = jax.jit(lambda buf, *x: (buf, fn(*x))).lower(
          jax.ShapeDtypeStruct((8,), jnp.float32), *args).compile()
      run = lambda *x: exe(*x)  # noqa: E731
      run.config = fn.config
      return run, 0.01

    def time_compiled(self, exe, args, out_bytes):
      whole = bool((np.asarray(args[3]) == p.kv_len).all())
      self.timed.append((exe.config, whole))
      if isinstance(us[exe.config, whole], Exception):
        raise us[exe.config, whole]
      return [us[exe.config, whole]] * self.iterations
  prof = Prof()
  monkeypatch.setattr(refine, "_profiler", lambda: prof)
  # a: 2x faster on spread lengths, 10% slower on full caches; b: 1.25x / 1.1x.
  us.update({(xla, False): 10.0, (xla, True): 10.0, (a, False): 5.0, (a, True): 11.0,
             (b, False): 8.0, (b, True): 9.0})
  out = refine.measure_candidates(DECODE, p, [xla, a, b], xla)
  assert not out.failed, out.failed
  assert sorted(prof.timed, key=str) == sorted(us, key=str)
  assert out.config == b and out.us == 8.0 and out.platform_us == 10.0
  spread, whole = ({c: us[c, w] for c in (xla, a, b)} for w in (False, True))
  # Slower than the platform op on full caches everywhere: the platform op.
  assert refine.pick(spread, xla, [{**whole, b: 10.5}]) == xla
  assert refine.pick(spread, xla, [{**whole, b: 9.9}]) == xla   # 1% there: under the margin
  # Without the platform config the spread lengths decide.
  assert refine.pick({a: 5.0, b: 8.0}, None, [whole]) == a
  assert refine.pick({xla: 10.0, a: 5.0}, xla, [{xla: 10.0}]) == xla   # a not timed there
  assert refine.pick({xla: 10.0, a: 5.0}, xla, [{a: 1.0}]) == xla   # platform failed there
  # The platform op failing on full caches: it stays (the fallback), and a
  # config that failed there is dropped and not timed on that mix.
  prof.timed.clear()
  us[xla, True] = RuntimeError("no kernel image")
  us[a, False] = RuntimeError("illegal address")
  out = refine.measure_candidates(DECODE, p, [xla, a, b], xla)
  assert out.config == xla and out.platform_us == 10.0
  assert [c for c, _ in out.failed] == [a]
  assert (a, True) not in prof.timed and (b, True) in prof.timed


def test_compile_pipelined_lowers_in_one_thread_and_compiles_each_once_lowered():
  """Lowering (Python) runs in one thread, one job after another; each job
  compiles in the pool as soon as it is lowered, while the next lowers.
  Results keep the jobs' order, a failure (lowering or compiling) is
  recorded in its place, and the other tasks run alongside."""
  import threading
  events = []

  class P(profiler.Profiler):
    def lower(self, fn, args):
      events.append(("lower", fn, threading.get_ident(), time.perf_counter()))
      if fn == "bad":
        raise ValueError("cannot lower")
      time.sleep(0.2)
      return fn

    def compile_lowered(self, lowered):
      events.append(("compile", lowered, threading.get_ident(), time.perf_counter()))
      if lowered == "fails":
        raise RuntimeError("cannot compile")
      time.sleep(0.3)
      return lowered.upper()

  done, others = P(threads=4).compile_pipelined(
      [("a", ()), ("bad", ()), ("fails", ()), ("b", ())], [lambda: 1, lambda: 1 / 0])
  assert [d[0] for d in (done[0], done[3])] == ["A", "B"]
  assert isinstance(done[1][0], ValueError) and isinstance(done[2][0], RuntimeError)
  # a job's seconds are its lowering and compile, not its wait for a thread
  assert all(0 <= s < 1.5 for _, s in done)
  assert others[0] == 1 and isinstance(others[1], ZeroDivisionError)
  lowers = [e for e in events if e[0] == "lower"]
  assert [e[1] for e in lowers] == ["a", "bad", "fails", "b"]
  assert len({e[2] for e in lowers}) == 1
  at = {(e[0], e[1]): e[3] for e in events}
  # "a" compiled while "b" was still to be lowered, in another thread
  assert at[("compile", "a")] < at[("lower", "b")]
  assert {e[2] for e in events if e[0] == "compile"} - {lowers[0][2]}


def test_compile_pipelined_lowering_never_waits_for_the_other_tasks():
  """The lowering has a thread of its own: with every compile thread busy
  with a slow other task (a problem's inputs and reference), the jobs still
  lower at once, and each compiles in the next free thread."""
  import threading
  starts = {}

  class P(profiler.Profiler):
    def lower(self, fn, args):
      starts["lower " + fn] = time.perf_counter()
      time.sleep(0.05)
      return fn

    def compile_lowered(self, lowered):
      starts["compile " + lowered] = time.perf_counter()
      time.sleep(0.05)
      return lowered

  t0 = time.perf_counter()
  slow = threading.Event()
  done, _ = P(threads=1).compile_pipelined([("a", ()), ("b", ())],
                                          [lambda: slow.wait(1.0)])
  assert [d[0] for d in done] == ["a", "b"]
  # both lowered while the slow task held the only compile thread
  assert starts["lower b"] - t0 < 0.5 and starts["compile a"] - t0 >= 0.9
