"""First-use refinement: the wave model ranks, a measurement on this GPU decides.

The first time a process traces a problem the store does not know, the
selector (policy ``"refine"``, or ``"auto"`` on a GPU with a table-cache
folder) times on this GPU, with the one measuring pipeline of sweeps
(:mod:`wavetune_jax.tuning.measure`: L2 flushed, CUPTI, each candidate checked
against the float32 reference) and on synthetic inputs of the problem's
shapes and dtypes (``Family.inputs``; decode and the grouped GEMM on the
length and routing mixes their sweeps use):

* the platform config (:meth:`Family.platform_config`), and where the
  family sets :attr:`Family.refine_all_platforms` (decode) every other
  platform backend's config (XLA's attention next to cuDNN's);
* the table's answer after the guard, the exact entry, the heuristic's config;
* the own rule's config of each kernel backend the table holds no model of
  (a backend newer than the table);
* the wave model's top :data:`TOP_K` configs (:meth:`Decider.ranked`;
  :attr:`Family.refine_top_k` where the family sets it: the grouped GEMM's
  2, :func:`top_k`).

The platform config is left untimed where the family trusts every other
candidate over it without evidence, or, where the platform op is XLA's, one
(:func:`dominating`: XLA's dense ragged dot, XLA's attention with
soft-capping or sinks, XLA's FP8 dot where the FP8 kernel's rule fills its
waves): the fastest such candidate that ran then stands in for it
(:func:`choose`), so what is kept is at least as fast as a config the guard
would run unmeasured.

Decode with run-time lengths is also timed with every sequence at the full
cache (:meth:`Family.refine_mixes`): a config replaces the platform config
only if it is :data:`MARGIN` faster on both.

A decision also answers the other sizes of the problem's weight in the same
power-of-two size bucket (``(2**(j-1), 2**j]`` tokens or cache length) where
its config runs them: a server sees many token counts, and measures each
bucket once.

The fastest that ran and matched is kept. A candidate that fails to compile,
to run (out of memory) or to match is dropped, with one warning per process;
if nothing ran, the guarded answer stands. The user's call never fails
because of refinement.

Decisions are kept in a JSON file in the table-cache folder
(``refined-<family>-<key>.json``), keyed by the device key, the family's
kernel revisions and the JAX, jaxlib, CUDA and cuDNN versions (an upgrade of
any starts a new file: the platform ops change under us). A file lock per GPU
model around measure-and-write makes other processes on the machine wait (at
most :data:`LOCK_WAIT_S`) and then read the answer instead of measuring it
again, and keeps two measurements off the GPU at once; a folder that cannot
be locked or written means no measurement (one warning) and the table's
answer. Stored decisions are checked against this GPU when read (a row that
does not run here is left out, with one warning). Without a folder (policy
``"refine"`` with the cache off) decisions live in the process only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import logging
import math
import os
import tempfile
import threading
import time
import warnings
from typing import Any

from wavetune_jax.core import versions
from wavetune_jax.core.family import Family
from wavetune_jax.core.hardware import Hardware
from wavetune_jax.runtime import guard

#: Says, at INFO, when a first use measures and what it kept
#: (``logging.getLogger("wavetune_jax").setLevel(logging.INFO)``).
_log = logging.getLogger("wavetune_jax")

__all__ = ["TOP_K", "top_k", "ITERATIONS", "MARGIN", "candidates", "pick", "choose", "dominating",
           "Store", "stats", "measure_candidates"]

#: The wave model's candidates measured at first use (with the platform
#: config, the guarded answer, the exact entry and the heuristic's config).
#: From held-out recall@k of the recorded sweeps (docs/design.md).
TOP_K = 3
#: Timed calls per candidate (after the profiler's warm-up).
ITERATIONS = 5
#: A candidate replaces the platform config only when it measured this much
#: faster: at first use each candidate is timed a few times, and on an H100
#: a Triton GEMM measured faster than XLA's at ~10 us ran at 0.93x of it in
#: a later timing (docs/results.md, "Never slower").
MARGIN = 0.03
#: Most threads compiling at first use (a Mosaic GPU kernel's compile runs in
#: parallel threads; its lowering, Python, has a thread of its own).
COMPILE_THREADS = 8
#: Threads for each of the other programs measuring compiles (the problem's
#: inputs and reference, and each input mix's), besides one per candidate;
#: 0 leaves them waiting for a candidate's thread. 1 did not shorten first
#: use on an H200 (the grouped GEMM's compile phase 4.31 s with 0, 5.05 and
#: 5.93 s with 1, one run each; docs/results.md, "Where the compile phase
#: goes").
KIT_THREADS = 0
#: Longest wait for another process's measurement before giving up (the
#: table's answer then stands).
LOCK_WAIT_S = 120.0
#: Decisions kept in a store file, at most (later ones live in the process).
MAX_STORED = 8192
_FORMAT = "wavetune-refined"
#: 2: decode decided on both length mixes (``Family.refine_mixes``); the
#: decisions of version 1 are measured again.
_VERSION = 2

_stats = {"measured": 0, "seconds": 0.0, "reused": 0, "dropped": 0, "phases": {}}
_warned: set = set()
_lock = threading.Lock()


def stats() -> dict:
  """``{"measured": problems measured by this process, "seconds": wall
  seconds they took, "reused": decisions read from the store, "dropped":
  candidates that failed, "phases": wall seconds by measuring phase
  (compile, setup, check_and_time) and, of the compile phase, its
  programs' lowering and XLA-compile seconds summed over them (and over
  the threads that overlap them: lowering_summed, compiling_summed,
  compiling_candidates_summed)}``."""
  return {**_stats, "phases": dict(_stats["phases"])}


def top_k(spec: Family) -> int:
  """The wave model's candidates refinement measures for ``spec``'s problems
  (:attr:`Family.refine_top_k`, else :data:`TOP_K`)."""
  k = getattr(spec, "refine_top_k", None)
  return TOP_K if k is None else k


def candidates(spec: Family, problem, hw: Hardware, decider, base, *,
               k: int | None = None) -> list:
  """The configs refinement measures, platform config first (see module
  doc; ``k``: the wave model's, default :func:`top_k`)."""
  if k is None:
    k = top_k(spec)
  out = []
  plat = spec.platform_config(problem, hw)
  if plat is not None:
    out.append(plat)
  if base is not None:
    out.append(base)
  if decider is not None:
    hit = decider.table.exact.get(problem)
    if hit is not None:
      out.append(hit[0])
  try:
    out.append(spec.heuristic(problem, hw))
  except ValueError:
    pass
  # A kernel backend the table holds no model of (a backend newer than the
  # table, such as the Mosaic decode kernel next to tables swept before it)
  # is measured through its own rule, so first use can find it where it wins.
  held = set() if decider is None else {dict(v).get("backend") for v in decider.table.entries}
  for b in spec.available(hw):
    if b.platform and spec.refine_all_platforms:
      out += list(b.space(problem, hw))[:1]  # the other platform ops (one config each)
      continue
    if b.platform or b.name in held:
      continue
    try:
      c = b.heuristic(problem, hw)
    except ValueError:
      c = None
    if c is not None:
      out.append(c)
  if decider is not None:
    out += decider.ranked(problem, k)
  seen, keep = set(), []
  for c in out:
    if c in seen or not spec.supports(c, hw):
      continue
    seen.add(c)
    try:
      spec.validate(problem, c, hw)
    except ValueError:
      continue
    keep.append(c)
  return keep


# --- the store -----------------------------------------------------------------------------


def store_key(spec: Family, hw: Hardware) -> dict:
  return {"device_key": hw.device_key, "family": spec.name,
          "revisions": dict(sorted(spec.revisions().items())),
          "versions": dict(sorted(versions.current().items())), "format": _VERSION}


class Store:
  """The decisions of one family on one machine (see module doc)."""

  def __init__(self, spec: Family, hw: Hardware, folder):
    self.spec, self.hw = spec, hw
    self.key = store_key(spec, hw)
    digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:16]
    self.path = None if folder is None else os.path.join(
        str(folder), f"refined-{spec.name}-{digest}.json")
    self.decisions: dict = {}   # problem -> (config, us, platform_us)
    self._ident = None   # the file read last (inode, mtime, size)
    self.reload()

  def reload(self) -> None:
    """Reads the file if it changed (a corrupt one: one warning, ignored;
    the next write replaces it)."""
    if self.path is None:
      return
    try:
      st = os.stat(self.path)
    except OSError:
      return
    ident = _ident(st)
    if ident == self._ident:
      return
    self._ident = ident
    try:
      with open(self.path) as f:
        d = json.load(f)
      self.decisions.update(self._parse(d))
    except Exception as e:  # noqa: BLE001 - whatever the file holds, it is only ignored
      _warn(("corrupt", self.path), f"wavetune_jax: ignoring the refinement store "
                                    f"{self.path} ({type(e).__name__}: {e}); it is rewritten "
                                    f"at the next measurement")

  def _parse(self, d) -> dict:
    spec = self.spec
    if not isinstance(d, dict) or d.get("format") != _FORMAT or d.get("key") != self.key:
      raise ValueError("not a refinement store of this family, GPU and versions")
    out, bad = {}, []
    for r in d["decisions"]:
      try:
        p = spec.problem_from_dict(r["problem"])
        c = spec.config_from_dict(r["config"], legacy=False)
        if not spec.supports(c, self.hw):
          raise ValueError(f"a {spec.backend_of(c).name} config does not run here")
        spec.validate(p, c, self.hw)
        us = float(r["us"])
        plat = None if r.get("platform_us") is None else float(r["platform_us"])
        if not (math.isfinite(us) and us > 0):
          raise ValueError(f"time {us} must be finite and positive")
      except Exception as e:  # noqa: BLE001 - a bad row is left out, the others stand
        bad.append(f"{type(e).__name__}: {str(e)[:120]}")
        continue
      out[p] = (c, us, plat)
    if bad:
      _warn(("rows", self.path), f"wavetune_jax: the refinement store {self.path} has "
                                 f"{len(bad)} decision(s) this GPU cannot use, left out "
                                 f"(first: {bad[0]}); they are measured again")
    return out

  def get(self, problem):
    """The decision for ``problem``, or one measured at another size of its
    weight in the same power-of-two size bucket whose config runs
    ``problem`` (a server sees many token counts: each bucket is measured
    once); None."""
    for attempt in range(2):
      hit = self.decisions.get(problem)
      if hit is not None:
        return hit
      for p, d in self._by_bucket().get(_bucket_key(self.spec, problem), ()):
        if _runs(self.spec, problem, d[0], self.hw) and self._comparable(problem, d):
          return d
      if attempt == 0:
        self.reload()
    return None

  def _comparable(self, problem, decision) -> bool:
    """Whether a decision made at another size answers ``problem``: one
    that left the platform op untimed (:func:`dominating`) only where the
    family trusts its config over the platform op at ``problem`` too (a
    config that beat the trusted stand-in but is not trusted itself answers
    its own size only: the bucket's other sizes are measured)."""
    config, _, platform_us = decision
    if platform_us is not None:
      return True
    plat = self.spec.platform_config(problem, self.hw)
    return plat is None or config == plat or guard.trusted(self.spec, problem, config, plat,
                                                           self.hw)

  def _by_bucket(self) -> dict:
    memo = self.__dict__.get("_bucket_index")
    if memo is None or memo[0] != len(self.decisions):
      index: dict = {}
      for p, d in self.decisions.items():
        index.setdefault(_bucket_key(self.spec, p), []).append((p, d))
      memo = self._bucket_index = (len(self.decisions), index)
    return memo[1]

  @contextlib.contextmanager
  def locked(self):
    """One measurement at a time per GPU model on this machine: other
    processes wait here (at most :data:`LOCK_WAIT_S`) and then read what was
    measured. Yields False when the lock could not be had (a folder that
    cannot be written, or the wait ran out): the caller measures nothing."""
    if self.path is None:
      yield True
      return
    import fcntl
    fd = None
    try:
      os.makedirs(os.path.dirname(self.path), exist_ok=True)
      fd = os.open(os.path.join(os.path.dirname(self.path),
                                f"refine-{self.hw.device_key}.lock"), os.O_RDWR | os.O_CREAT,
                   0o644)
      deadline = time.monotonic() + LOCK_WAIT_S
      while True:
        try:
          fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
          break
        except BlockingIOError:
          if time.monotonic() > deadline:
            raise TimeoutError(f"another process held the lock for {LOCK_WAIT_S} s")
          time.sleep(0.05)
    except (OSError, TimeoutError) as e:
      if fd is not None:
        os.close(fd)
      _warn(("lock", self.path), f"wavetune_jax: first-use measurement skipped: cannot "
                                 f"lock the refinement store in {os.path.dirname(self.path)} "
                                 f"({type(e).__name__}: {e}); using the table's answer")
      yield False
      return
    try:
      yield True
    finally:
      fcntl.flock(fd, fcntl.LOCK_UN)
      os.close(fd)

  def put(self, problem, config, us: float, platform_us: float | None) -> None:
    self.decisions[problem] = (config, us, platform_us)
    if self.path is None or len(self.decisions) > MAX_STORED:
      return
    self.reload()  # (under the lock: what others wrote meanwhile is kept)
    spec = self.spec
    rows = [{"problem": spec.problem_to_dict(p), "config": spec.config_to_dict(c), "us": t,
             "platform_us": pt} for p, (c, t, pt) in self.decisions.items()]
    data = {"format": _FORMAT, "key": self.key, "decisions": rows}
    try:
      fd, tmp = tempfile.mkstemp(dir=os.path.dirname(self.path), suffix=".tmp")
      with os.fdopen(fd, "w") as f:
        json.dump(data, f)
      os.replace(tmp, self.path)
      self._ident = _ident(os.stat(self.path))
    except OSError as e:
      _warn(("write", self.path), f"wavetune_jax: cannot write the refinement store "
                                  f"{self.path} ({e}); decisions stay in this process")


def _ident(st: os.stat_result) -> tuple:
  """A store file's identity: each write is a new file (``os.replace``)."""
  return st.st_ino, st.st_mtime_ns, st.st_size


def _bucket_key(spec: Family, problem) -> tuple:
  """The weight and the power-of-two bucket of the size, ``(2**(j-1), 2**j]``."""
  return spec.weight_of(problem), (max(1, spec.size_of(problem)) - 1).bit_length()


def _runs(spec: Family, problem, config, hw: Hardware) -> bool:
  if not spec.supports(config, hw):
    return False
  try:
    spec.validate(problem, config, hw)
  except ValueError:
    return False
  return True


_stores: dict = {}


def store(spec: Family, hw: Hardware, folder) -> Store:
  k = (spec.name, hw, None if folder is None else str(folder))
  s = _stores.get(k)
  if s is None:
    s = _stores[k] = Store(spec, hw, folder)
  return s


def clear() -> None:
  _stores.clear()
  _warned.clear()
  _stats.update(measured=0, seconds=0.0, reused=0, dropped=0, phases={})


def _warn(key, msg: str) -> None:
  if key not in _warned:
    _warned.add(key)
    warnings.warn(msg, stacklevel=5)


# --- measuring -------------------------------------------------------------------------------


@dataclasses.dataclass
class Outcome:
  config: Any
  us: float
  platform_us: float | None
  failed: list          # [(config, status: error)]


_prof: list = []


def _profiler():
  """One profiler per process: its L2-flush buffer and kernel are made once,
  not at every new problem."""
  if not _prof:
    from wavetune_jax.tuning import profiler
    _prof.append(profiler.Profiler(iterations=ITERATIONS, warmup=1, threads=8))
  return _prof[0]


def measure_candidates(spec: Family, problem, configs: list, platform,
                       anchors: tuple | list = ()) -> Outcome:
  """Times ``configs`` on ``problem`` now (GPU) and picks one (:func:`choose`,
  ``platform``: the platform config or None; ``anchors``: with the platform
  untimed, the candidates trusted over it). Runs outside any trace
  (``ensure_compile_time_eval``); no config where no anchor ran."""
  import jax

  from wavetune_jax.tuning import measure
  prof = _profiler()
  # A thread for each candidate measuring compiles (and KIT_THREADS for the
  # problem's inputs and reference and each mix's; lowering has its own)
  prof.threads = min(COMPILE_THREADS, len(configs)
                     + KIT_THREADS * (1 + len(spec.refine_mixes(problem))))
  try:
    with jax.ensure_compile_time_eval():
      rows = list(measure.measure_points(spec, prof, [(problem, configs)], mixes=True,
                                         phase_seconds=_stats["phases"]))
  finally:
    prof._flush_buf = None   # (256 MiB of GPU memory; the flush kernel is kept)
  ok = {c: m.median_us for _, impl, c, m in rows if impl == "pallas" and m.status == "ok"}
  failed = [(c, f"{m.status}: {m.error[:160]}") for _, impl, c, m in rows
            if impl == "pallas" and m.status != "ok"]
  # The other mixes: a config that failed there is dropped (it ran wrong or
  # not at all on inputs a user's call can have), but for the platform
  # config, the fallback: where it has no time on a mix, :func:`pick` keeps it
  # (with ``anchors`` no config is exempt: an anchor dropped here cannot
  # stand in for the platform config).
  others: dict = {}
  for _, impl, c, m in rows:
    if impl.startswith("pallas@"):
      mix = others.setdefault(impl, {})
      if m.status == "ok":
        mix[c] = m.median_us
      elif c in ok and c != platform:
        del ok[c]
        failed.append((c, f"{m.status} on another input mix: {m.error[:140]}"))
  best = choose(ok, platform, list(others.values()), anchors) if ok else None
  if best is None:
    return Outcome(None, math.inf, None, failed)
  return Outcome(best, ok[best], ok.get(platform), failed)


def choose(times: dict, platform, other_mixes: list | None = None, anchors=()):
  """:func:`pick`; where ``anchors`` (the candidates trusted over the
  platform config, :func:`dominating`, which left it untimed) are given,
  the fastest anchor that ran stands in for it: another config
  replaces that one only :data:`MARGIN` faster on every mix, so what is kept
  is as fast as a config trusted over the platform op. None where no anchor
  ran (the caller then times the platform config)."""
  if anchors:
    if platform is not None:
      raise ValueError("refine.choose: anchors stand in for an untimed platform config; "
                       "pass platform=None with them")
    ran = [c for c in anchors if c in times]
    if not ran:
      return None
    platform = min(ran, key=times.get)
  return pick(times, platform, other_mixes)


def pick(times: dict, platform, other_mixes: list | None = None):
  """The config refinement keeps from measured ``times`` (config -> us): the
  fastest, unless ``platform`` ran and the fastest is not :data:`MARGIN`
  faster than it. ``other_mixes``: the same configs' times on the problem's
  other input mixes (:meth:`Family.refine_mixes`); where the platform config
  ran on the first, only configs :data:`MARGIN` faster than it on each mix
  (and timed there) can replace it; where the platform config has no time on
  a mix (it failed there), nothing replaces it."""
  t_plat = times.get(platform)
  if t_plat is not None:
    for mix in other_mixes or ():
      times = {c: t for c, t in times.items()
               if c == platform or (platform in mix and c in mix
                                    and mix[c] * (1 + MARGIN) <= mix[platform])}
  best = min(times, key=times.get)
  if t_plat is not None and best != platform and times[best] * (1 + MARGIN) > t_plat:
    return platform
  return best


def dominating(spec: Family, problem, cands: list, platform, hw: Hardware) -> list:
  """The candidates first use measures in place of the platform config
  (empty: the platform config is timed): those of ``cands`` the family
  trusts over it without evidence
  (:meth:`Family.trusted_without_evidence`, each family's measured rule: XLA's
  dense ragged dot, which multiplies every row by every expert's weight, lost
  to every Mosaic config measured where the grouped GEMM's rule trusts them;
  XLA's attention with a soft cap or sinks writes the whole score matrix;
  XLA's FP8 dot lost to the FP8 kernel's rule wherever that fills its
  waves), where every other candidate is trusted or the platform op is
  XLA's. Empty where the platform config is not among ``cands``. Timing
  such a platform op is most of a first use's cost: XLA's dense ragged dot
  for Qwen3-235B-A22B's w13 at 3,300 tokens runs 111 ms a call against 1.2
  ms for the kernel (H200), and at Arctic's sizes it needs more memory than
  the GPU has; the first use of XLA's FP8 dot (trace, compile, first
  call) took 10.9-12.3 s at 3,000 rows (H100, H200)."""
  if platform is None or platform not in cands:
    return []
  others = [c for c in cands if c != platform]
  trusted = [c for c in others if guard.trusted(spec, problem, c, platform, hw)]
  # One trusted candidate suffices where the platform op is XLA's (its dense
  # ragged dot, score matrix or autotuned FP8 dot: the costly ones to compile
  # and run); cuDNN's kernels are cheap to time, and where a trust's measured
  # margin is thin (cuDNN's sliding window, geomean 1.03-1.05x) timing them keeps the
  # decision measured, so there every other candidate must be trusted.
  if len(trusted) == len(others) or (trusted and spec.backend_of(platform).name == "xla"):
    return trusted
  return []


def refine(spec: Family, problem, hw: Hardware, decider, base, folder):
  """The refined ``(config, us, note)`` for ``problem``, or None (the base
  answer stands): from the store, else measured now and stored."""
  st = store(spec, hw, folder)
  hit = st.get(problem)
  if hit is not None:
    _stats["reused"] += 1
    return hit[0], hit[1], "measured on this GPU at first use (stored)"
  cands = candidates(spec, problem, hw, decider, base)
  if len(cands) < 2:
    return None
  plat = spec.platform_config(problem, hw)
  anchors = dominating(spec, problem, cands, plat, hw)
  if anchors:
    cands = [c for c in cands if c != plat]
  with st.locked() as have_lock:
    if not have_lock:
      return None
    hit = st.get(problem)   # another process measured it while we waited
    if hit is not None:
      _stats["reused"] += 1
      return hit[0], hit[1], "measured on this GPU at first use (stored)"
    t0 = time.perf_counter()
    _log.info("wavetune_jax: first use of %s %s on %s: measuring %d candidates (kept in %s)",
              spec.name, spec.problem_key(problem), hw.name, len(cands),
              st.path or "this process only")
    try:
      out = measure_candidates(spec, problem, cands, plat if plat in cands else None,
                               anchors=anchors)
      failed = list(out.failed)
      timed_platform = not anchors
      if out.config is None and anchors:
        # No trusted candidate ran here: the platform op after all, against
        # the candidates that did (timed again: a rare path).
        bad = [c for c, _ in failed]
        out = measure_candidates(spec, problem, [plat] + [c for c in cands if c not in bad],
                                 plat)
        failed += out.failed
        timed_platform = True
        if out.platform_us is None:
          # Nor did the platform op: nothing here is known to be as fast, so
          # the guarded answer stands.
          out = Outcome(None, math.inf, None, [])
    except Exception as e:  # noqa: BLE001 - refinement never fails the user's call
      _warn(("measure", spec.name, type(e).__name__),
            f"wavetune_jax: first-use measurement of {spec.problem_key(problem)} failed "
            f"({type(e).__name__}: {str(e)[:200]}); using the table's answer")
      return None
    finally:
      _stats["seconds"] += time.perf_counter() - t0
    _stats["measured"] += 1
    if failed:
      _stats["dropped"] += len(failed)
      names = "; ".join(f"{spec.config_to_dict(c)}: {why}" for c, why in failed[:3])
      _warn(("dropped", spec.name), f"wavetune_jax: first-use measurement dropped "
                                    f"{len(failed)} {spec.name} candidate(s) of "
                                    f"{spec.problem_key(problem)} that failed ({names})")
    _log.info("wavetune_jax: first use of %s %s: %s in %.1f s", spec.name,
              spec.problem_key(problem),
              "kept the table's answer" if out.config is None else
              f"kept {spec.config_to_dict(out.config)} at {out.us:.1f} us",
              time.perf_counter() - t0)
    if out.config is None:
      return None
    st.put(problem, out.config, out.us, out.platform_us)
  vs = (f", {out.platform_us / out.us:.2f}x the platform op" if out.platform_us
        else f"; the platform op not timed: {len(anchors)} candidate(s) trusted over it"
        if not timed_platform
        else "")
  return out.config, out.us, f"measured on this GPU at first use ({len(cands)} candidates{vs})"
