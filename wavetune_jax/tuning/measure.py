"""The one measuring pipeline of sweeps, the tuner and the exhaustive policy.

For a batch of ``(problem, configs)``: every candidate (each config's kernel,
and where asked the family's baselines) and each problem's kit (inputs,
float32 reference, NaN poison, error check) is compiled in parallel threads,
all before the first measurement (XLA's autotuner launches kernels of its own
while it compiles a baseline, which CUPTI would otherwise count). Then one
problem at a time: its inputs and reference are made on the device, and each
candidate is poisoned, checked against the reference and timed with CUPTI
(:class:`~wavetune_jax.tuning.profiler.Profiler`). A candidate that fails to
compile, to run or to match the reference is recorded with its error.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Iterator, Sequence

import jax

from wavetune_jax.core.family import Family
from wavetune_jax.tuning.profiler import Measurement, Profiler, compile_totals

__all__ = ["baseline_candidates", "baseline_impls", "measure_points"]


def measure_points(family: Family, prof: Profiler, work: Sequence[tuple], *,
                   baselines: bool | set = False, repeat_best: bool = False,
                   mixes: bool = False, phase_seconds: dict | None = None
                   ) -> Iterator[tuple[object, str, object, Measurement]]:
  """Measures ``work = [(problem, configs), ...]`` (see module doc).

  Args:
    family: the family of the problems.
    prof: the CUPTI profiler.
    work: problems and the configs to measure for each.
    baselines: also time the family's baseline, extra baselines and speed
      references (``True`` for every problem, a set of the problems that
      need them, or ``{problem: impls}``: of those, only the impls named,
      ``"baseline"`` or ``"baseline_<name>"``).
    repeat_best: time each problem's fastest config a second time
      (repeatability; impl ``"repeat"``, not checked).
    mixes: also check and time each config that ran right on the inputs of
      each family of ``family.refine_mixes(problem)`` (the same compiled
      code; impl ``"pallas@<i>"`` for the i-th mix, from 1).
    phase_seconds: if given, wall seconds are added under ``"compile"``,
      ``"setup"`` and ``"check_and_time"``.

  Yields:
    ``(problem, impl, config, Measurement)``, grouped by problem in the order
    of ``work``; impl is ``"pallas"`` (a config), ``"baseline"`` or
    ``"baseline_<name>"`` (config None), ``"repeat"`` or ``"pallas@<i>"``.
  """
  phases = phase_seconds if phase_seconds is not None else {}
  t0 = time.perf_counter()
  sums0 = compile_totals()
  cands, kits, shapes, alts = [], [], {}, []
  for p, configs in work:
    # (impl, config, fn, input shapes: None for the problem's own inputs)
    fns = [("pallas", c, family.build(p, c), None) for c in configs]
    fns += baseline_candidates(family, p, baselines)
    cands.append(fns)
    shapes[p] = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in
                 jax.eval_shape(functools.partial(family.inputs, p), jax.random.PRNGKey(0))]
    # The check is compiled for the output of a candidate that computes the op.
    own_inputs = [fn for _, _, fn, own in fns if own is None]
    kits.append(functools.partial(prof.compile_kit, family, p,
                                  own_inputs[0] if own_inputs else None))
    alts.append([functools.partial(prof.compile_kit, f, p, own_inputs[0] if own_inputs else None)
                 for f in (family.refine_mixes(p) if mixes and configs else ())])
  n_alt = [len(a) for a in alts]
  kits += [k for a in alts for k in a]
  jobs = [(fn, own or shapes[p]) for (p, _), fns in zip(work, cands) for _, _, fn, own in fns]
  if prof.gpu_lock is None:
    compiled, done = prof.compile_pipelined(jobs, kits)
    kit_of = _split_kits(done, n_alt)
    phases["compile"] = phases.get("compile", 0.0) + time.perf_counter() - t0
    _add_sums(phases, sums0)
    yield from _check_and_time(family, prof, work, cands, compiled, kit_of, phases,
                               repeat_best)
    return
  # Other processes time kernels on this GPU: Pallas kernels (lowered and
  # compiled on the CPU) compile while they do; library candidates (whose
  # autotuners run kernels) compile, and everything is timed, under the lock.
  pallas = [impl == "pallas" and family.backend_of(c).kernel_cache
            for fns in cands for impl, c, _, _ in fns]
  done, kits_done = prof.compile_pipelined([j for j, q in zip(jobs, pallas) if q], kits)
  quiet, kit_of = iter(done), _split_kits(kits_done, n_alt)
  with prof.on_gpu():
    loud = iter(prof.compile_pipelined([j for j, q in zip(jobs, pallas) if not q])[0])
    compiled = [next(quiet) if q else next(loud) for q in pallas]
    phases["compile"] = phases.get("compile", 0.0) + time.perf_counter() - t0
    _add_sums(phases, sums0)
    yield from _check_and_time(family, prof, work, cands, compiled, kit_of, phases,
                               repeat_best)


def _add_sums(phases: dict, before: dict) -> None:
  """Adds the compile phase's seconds summed over its programs and threads
  (:func:`~wavetune_jax.tuning.profiler.compile_totals`, since ``before``)
  as ``"lowering_summed"``, ``"compiling_summed"`` and, of the latter,
  ``"compiling_candidates_summed"``: next to the phase's wall seconds they
  show how much the threads overlapped, and which programs took the time."""
  after = compile_totals()
  for k in ("lowering", "compiling", "compiling_candidates"):
    phases[f"{k}_summed"] = phases.get(f"{k}_summed", 0.0) + after[k] - before[k]


def _split_kits(done: list, n_alt: list) -> list:
  """``[(kit, [alt kits])]`` per problem from the compiled kits: the
  problems' own first, then each problem's ``n_alt`` mixes in turn."""
  own, rest = done[:len(n_alt)], iter(done[len(n_alt):])
  return [(k, [next(rest) for _ in range(n)]) for k, n in zip(own, n_alt)]


def _check_and_time(family, prof, work, cands, compiled, kit_of, phases, repeat_best):
  """The measuring half of :func:`measure_points`, problem by problem."""
  pos = 0
  for (p, _), fns, (kit, alt_kits) in zip(work, cands, kit_of):
    exes = compiled[pos:pos + len(fns)]
    compiled[pos:pos + len(fns)] = [None] * len(fns)
    pos += len(fns)
    if isinstance(kit, BaseException):
      for impl, c, _, _ in fns:
        yield p, impl, c, Measurement(status="run_error",
                                      error=f"inputs or reference failed: {kit}"[:400])
      continue
    t1 = time.perf_counter()
    try:
      args, ref = kit.materialize()
      jax.block_until_ready(ref)
      failed = None
    except Exception as e:  # e.g. out of memory: this problem's rows say so, the rest go on
      failed = e
    phases["setup"] = phases.get("setup", 0.0) + time.perf_counter() - t1
    if failed is not None:
      for impl, c, _, _ in fns:
        yield p, impl, c, Measurement(status="run_error",
                                      error=f"inputs or reference failed: {failed}"[:400])
      continue
    tol = family.tolerance(p)
    best = (None, None, math.inf)
    ran = set()   # configs that ran right here: the ones the other mixes time
    for (impl, c, _, own), (exe, compile_s) in zip(fns, exes):
      t2 = time.perf_counter()
      if own is None:
        m = prof.check_and_time(exe, compile_s, args, ref, tol, kit.out_bytes, kit)
      else:  # a speed reference: its own random inputs, not checked
        m = _time_reference(prof, exe, compile_s, own, kit.out_bytes, args)
      phases["check_and_time"] = phases.get("check_and_time", 0.0) + time.perf_counter() - t2
      if impl == "pallas" and m.status == "ok":
        ran.add(c)
        if m.median_us < best[2]:
          best = (c, exe, m.median_us)
      yield p, impl, c, m
    if repeat_best and best[0] is not None:
      yield p, "repeat", best[0], prof.check_and_time(best[1], 0.0, args, None, None,
                                                      kit.out_bytes, kit)
    del args, ref, best
    for i, alt in enumerate(alt_kits, 1):
      yield from _time_mix(prof, p, fns, exes, ran, tol, alt, f"pallas@{i}", phases)
    del exes


def _time_mix(prof, p, fns, exes, ran, tol, kit, impl, phases):
  """Checks and times the configs of ``fns`` (compiled: ``exes``) that ran
  right on the problem's own inputs (``ran``) on the inputs of another mix's
  ``kit``; rows ``(p, impl, config, Measurement)``."""
  t1 = time.perf_counter()
  try:
    if isinstance(kit, BaseException):
      raise kit
    args, ref = kit.materialize()
    jax.block_until_ready(ref)
    failed = None
  except Exception as e:  # noqa: BLE001 - recorded per config
    failed = e
  phases["setup"] = phases.get("setup", 0.0) + time.perf_counter() - t1
  if failed is not None:
    for own_impl, c, _, _ in fns:
      if own_impl == "pallas" and c in ran:
        yield p, impl, c, Measurement(
            status="run_error", error=f"inputs or reference of the mix failed: {failed}"[:400])
    return
  for (own_impl, c, _, _), (exe, compile_s) in zip(fns, exes):
    if own_impl == "pallas" and c in ran:
      t2 = time.perf_counter()
      yield p, impl, c, prof.check_and_time(exe, compile_s, args, ref, tol, kit.out_bytes, kit)
      phases["check_and_time"] = phases.get("check_and_time", 0.0) + time.perf_counter() - t2
  del args, ref



def baseline_candidates(family: Family, p, baselines) -> list[tuple]:
  """``[(impl, None, fn, own input shapes or None)]`` of the baselines,
  extra baselines and speed references that ``baselines`` asks for ``p``
  (see :func:`measure_points`)."""
  if isinstance(baselines, dict):
    wanted = set(baselines.get(p, ()))
  elif baselines is True or (baselines and p in baselines):
    wanted = None  # all of them
  else:
    return []
  out = [("baseline", None, family.baseline(p), None)]
  out += [(f"baseline_{name}", None, fn, None)
          for name, fn in family.extra_baselines(p).items()]
  out += [(f"baseline_{name}", None, fn, tuple(shapes))
          for name, (fn, shapes) in family.speed_references(p).items()]
  return [c for c in out if wanted is None or c[0] in wanted]


def baseline_impls(family: Family, p) -> list[str]:
  """The impl names of ``p``'s baseline rows, in the order they are timed."""
  return [c[0] for c in baseline_candidates(family, p, True)]


def _time_reference(prof: Profiler, exe, compile_s: float, shapes, out_bytes: int,
                    problem_args=()) -> Measurement:
  """Times a speed reference on random inputs of ``shapes`` (unchecked); an
  input of the same shape and dtype as one of the problem's is that array
  (a grouped GEMM's weights: no second copy on the GPU)."""
  if isinstance(exe, BaseException):
    return prof.check_and_time(exe, compile_s, (), None, None, out_bytes)
  jnp = jax.numpy

  def make(key, s):
    same = [a for a in problem_args if a.shape == s.shape and a.dtype == s.dtype]
    if same:
      return same[0]
    if jnp.issubdtype(s.dtype, jnp.floating):
      return jax.random.normal(key, s.shape, jnp.float32).astype(s.dtype)
    return jnp.zeros(s.shape, s.dtype)
  try:
    keys = jax.random.split(jax.random.PRNGKey(1), len(shapes))
    args = [make(key, s) for key, s in zip(keys, shapes)]
    jax.block_until_ready(args)
  except Exception as e:  # noqa: BLE001 - e.g. out of memory: recorded
    return Measurement(status="run_error", compile_s=compile_s,
                       error=f"inputs of the reference failed: {e}"[:400])
  try:
    return prof.check_and_time(exe, compile_s, args, None, None, out_bytes)
  finally:
    del args
