"""Exhaustive sweeps: every config of a spec's space, per problem, on file.

File format (``.jsonl.gz``): gzip-compressed JSON lines. The first line is the
header ``{"type": "header", "schema": 1, "kernel": <family>, "device_kind": ...,
"device_key": ..., "num_sms": ..., "jax_version": ..., "clocks": ..., "date": ...,
"command": ...}``. Every other line is a row ``{"type": "row", "problem": {...},
"impl": "pallas" | "baseline" | "baseline_<name>" | "repeat" | "timing",
"config": {"backend": name, ...} | null, "median_us", "spread_us", "samples",
"compile_s", "status", "error", "rel_error"}``. Rows recorded before configs
named their backend have none (or an int); the family reads them
(``Family.config_from_dict``) and row identities are compared in the current
form, so a resumed sweep never measures them twice.

Rows are appended in small gzip members, each closed (flushed) once written, so a
killed run loses at most the batch in flight. On resume, a truncated last member
is cut off (the file is rewritten atomically with the rows that survived) and
every (problem, config) already on file is skipped.

Readers that compute from a file (tuning by replay or from an anchor log,
evaluation, plots, merges) read it with ``read_sweep(path, strict=True)``: the
file must be intact and its header and every row valid (:func:`check_sweep`);
the first bad row is named by file, line, field and value.
"""

from __future__ import annotations

import dataclasses
import datetime
import gzip
import json
import math
import os
import shutil
import subprocess
import sys
import time
import zlib
from typing import Callable, Iterable, Iterator, Sequence

__all__ = ["SCHEMA", "SweepError", "SweepFile", "read_sweep", "check_sweep", "run_sweep",
           "plan_sweep", "remeasure_keys", "row_key",
           "read_clocks", "sweep_configs", "make_row", "recorded_family", "gpu_measure",
           "with_recorded_backends",
           "planned_measurements"]

SCHEMA = 1
_BATCH = 16


def row_key(problem_key: str, impl: str, config: dict | None) -> str:
  """The identity of a row: problem, implementation and config."""
  cfg = "" if config is None else json.dumps(config, sort_keys=True)
  return f"{problem_key}|{impl}|{cfg}"


def _read_lines(path: str) -> tuple[list[dict], bool]:
  """Rows of a (possibly truncated) gzip JSONL file; (rows, intact)."""
  out: list[dict] = []
  intact = True
  try:
    with gzip.open(path, "rt") as f:
      for line in f:
        if not line.endswith("\n"):
          intact = False  # the last line was cut
          break
        if line.strip():  # (a blank line, from an edit by hand, holds nothing)
          out.append(json.loads(line))
  except (EOFError, gzip.BadGzipFile, zlib.error, UnicodeDecodeError,
          json.JSONDecodeError):
    intact = False
  return out, intact


def _article(word: str) -> str:
  return "an" if word[:1] in "aeiou" else "a"


class SweepError(ValueError):
  """A sweep file that cannot be used: cut off, not a sweep, or a bad header
  or row (the message names the file, the line, the field and its value)."""


def read_sweep(path: str, *, strict: bool = False, check: bool | None = None,
               on_truncated: Callable[[str], None] | None = None
               ) -> tuple[dict, list[dict]]:
  """``(header, rows)`` of a sweep file.

  Args:
    path: the ``.jsonl.gz`` file.
    strict: its end must not be cut off (a run killed mid-write; the command
      that wrote it repairs it). Without it, the rows before the cut are read.
    check: validate the header and every row (:func:`check_sweep`); default:
      ``strict``.
    on_truncated: without ``strict``, called with a one-line message when
      the end is cut off.

  Raises:
    SweepError: the file has no header, or another schema, or (``strict``)
      its end is cut off, or (``check``) a header field or a row is invalid.
  """
  lines, intact = _read_lines(path)
  if not lines or not isinstance(lines[0], dict) or lines[0].get("type") != "header":
    raise SweepError(f"{path} is not a sweep file (no header line"
                     + ("" if intact else "; not gzip-compressed JSON lines, or cut off")
                     + ")")
  if not intact and (strict or on_truncated is not None):
    msg = (f"{path} is truncated or corrupt after line {len(lines)} (a run killed "
           f"mid-write?); rerun the command that wrote it to repair and complete it")
    if strict:
      raise SweepError(msg)
    on_truncated(msg)
  header = lines[0]
  if header.get("schema") != SCHEMA:
    raise SweepError(f"{path} has schema {header.get('schema')!r}; "
                     f"this version reads schema {SCHEMA}")
  if strict if check is None else check:
    check_sweep(path, lines)
  return header, [r for r in lines[1:] if isinstance(r, dict) and r.get("type") == "row"]


_IMPLS = ("pallas", "baseline", "repeat", "timing")


def _finite(v, *, positive: bool) -> bool:
  return (not isinstance(v, bool) and isinstance(v, (int, float)) and math.isfinite(v)
          and (v > 0 if positive else v >= 0))


def check_sweep(path: str, lines: Sequence[dict]) -> None:
  """Checks a sweep file's parsed lines (``lines[0]`` the header).

  The header names a registered family (``kernel``), a known GPU
  (``device_key``: a hardware preset's, and the key of its ``device_kind``)
  and that preset's ``num_sms``. Every other line is a row (a second header is
  a concatenated file) with a string ``key``, ``status`` and ``impl`` (one
  of pallas, baseline, baseline_<name>, repeat, timing); its ``problem``
  parses into the family's problem and its ``config`` (when not null) into
  a config of one of the family's backends; an ``ok`` measurement has a
  finite positive ``median_us`` (and a ``spread_us``, where not null,
  finite and >= 0), a failed one a string ``error`` where it has one, a timing row
  a finite ``wall_s`` >= 0, and a row that names its ``device_key`` names
  the header's.

  Raises:
    SweepError: naming the file, the line (1 = the header), the field and
      its value of the first bad one.
  """
  from wavetune_jax.core import hardware
  from wavetune_jax.core.registry import get_family

  def bad(line: int, field: str, value, why: str) -> SweepError:
    v = repr(value)
    v = v if len(v) <= 120 else v[:117] + "..."
    return SweepError(f"{path} line {line}: {field}={v} {why}")

  header = lines[0]
  try:
    family = get_family(header.get("kernel"))
  except ValueError as e:
    raise bad(1, "kernel", header.get("kernel"), f"is not a family ({e})") from None
  key = header.get("device_key")
  known = sorted(hw.device_key for hw in hardware.PRESETS.values())
  if key not in known:
    raise bad(1, "device_key", key, f"is not a known GPU (known: {', '.join(known)})")
  kind = header.get("device_kind")
  if not isinstance(kind, str) or hardware.device_key(kind or "?") != key:
    raise bad(1, "device_kind", kind, f"does not match device_key={key!r}")
  if isinstance(header.get("num_sms"), bool) or not isinstance(header.get("num_sms"), int) \
      or header["num_sms"] < 1:
    raise bad(1, "num_sms", header.get("num_sms"), "is not an integer >= 1")
  preset = next(hw for hw in hardware.PRESETS.values() if hw.device_key == key)
  if header["num_sms"] != preset.num_sms:
    raise bad(1, "num_sms", header["num_sms"], f"is not the {preset.num_sms} SMs of {key!r}")
  parsed: dict = {}

  def parse(kind: str, d, fn):
    try:
      memo = (kind, tuple(sorted(d.items())))
      hash(memo)
    except (AttributeError, TypeError):
      return fn(d)
    if memo not in parsed:
      parsed[memo] = fn(d)
    return parsed[memo]

  for n, r in enumerate(lines[1:], start=2):
    if not isinstance(r, dict):
      raise bad(n, "line", r, "is not a JSON object")
    if r.get("type") != "row":
      why = ("is a second header (files concatenated? wavetune merge joins sweeps)"
             if r.get("type") == "header" else "is not 'row'")
      raise bad(n, "type", r.get("type"), why)
    for field in ("key", "status", "impl"):
      if not isinstance(r.get(field), str):
        raise bad(n, field, r.get(field), "is not a string")
    impl = r["impl"]
    if impl not in _IMPLS and not impl.startswith("baseline_"):
      raise bad(n, "impl", impl, f"is not one of {', '.join(_IMPLS)}, baseline_<name>")
    if "device_key" in r and r["device_key"] != key:
      raise bad(n, "device_key", r["device_key"], f"is not the header's {key!r}")
    try:
      parse("problem", r.get("problem"), family.problem_from_dict)
    except (TypeError, ValueError) as e:
      raise bad(n, "problem", r.get("problem"), f"is not {_article(family.name)} {family.name} problem ({e})") \
          from None
    if impl in ("pallas", "repeat") and r.get("config") is None:
      raise bad(n, "config", None, f"is missing (a {impl} row measures a config)")
    if r.get("config") is not None:
      try:
        parse("config", r["config"], family.config_from_dict)
      except (TypeError, ValueError) as e:
        raise bad(n, "config", r["config"], f"is not {_article(family.name)} {family.name} config ({e})") from None
    if impl == "timing":
      if not _finite(r.get("wall_s"), positive=False):
        raise bad(n, "wall_s", r.get("wall_s"), "is not a finite number >= 0")
    elif r["status"] == "ok" and not _finite(r.get("median_us"), positive=True):
      raise bad(n, "median_us", r.get("median_us"),
                "is not a finite positive time (an ok row's microseconds)")
    if (r["status"] == "ok" and r.get("spread_us") is not None
        and not _finite(r["spread_us"], positive=False)):
      raise bad(n, "spread_us", r["spread_us"], "is not a finite number >= 0")
    if r["status"] != "ok" and not isinstance(r.get("error", ""), str):
      raise bad(n, "error", r.get("error"), "is not a string (a failed row's message)")


class SweepFile:
  """Append-only sweep file with crash-safe batches.

  With ``family``, row identities on file are read in the current config
  form (:func:`normalized_key`)."""

  def __init__(self, path: str, header: dict, family=None):
    self.path = path
    self.family = family
    self.done: set[str] = set()
    self.n_rows = 0
    if os.path.exists(path):
      lines, intact = _read_lines(path)
      if not lines or not isinstance(lines[0], dict) or lines[0].get("type") != "header":
        raise SweepError(f"{path} exists but is not a sweep file; move it away")
      if intact:
        check_sweep(path, lines)  # a resumed sweep keeps only valid rows
      old = lines[0]
      for field in ("kernel", "device_key", "schema"):
        if old.get(field) != header.get(field):
          raise ValueError(
              f"{path} was recorded with {field}={old.get(field)!r}; this run has "
              f"{field}={header.get(field)!r}. Use another --out file.")
      if not intact:
        self._rewrite(lines)
      self.header = old
      for r in lines[1:]:
        if isinstance(r, dict) and r.get("type") == "row":
          self.done.add(r["key"] if family is None else normalized_key(family, r))
          self.n_rows += 1
    else:
      os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
      self.header = header
      self._rewrite([header])

  def record_run(self, header: dict) -> None:
    """Records a run that resumes this file (``header``: its own header) in
    the file's header, under ``"resumed"``: its date, command, clocks and
    versions (rows it adds may come from another software stack)."""
    lines, intact = _read_lines(self.path)
    if not intact:  # (the constructor repaired the file: never here)
      raise SweepError(f"{self.path} is truncated; rerun the command to repair it")
    entry = {k: header[k] for k in ("date", "command", "clocks", "versions", "jax_version")
             if k in header}
    self.header = dict(self.header, resumed=list(self.header.get("resumed", [])) + [entry])
    self._rewrite([self.header] + lines[1:])

  def forget(self, row_keys: set, problem_keys: set) -> int:
    """Drops the rows whose identity is in ``row_keys`` (see
    :func:`remeasure_keys`), so that a rerun measures them again, and lists
    ``problem_keys`` in the header's ``"remeasuring"`` until
    :meth:`finish_remeasure`: a run cut short and run again resumes the
    measuring instead of dropping what it had measured. One atomic rewrite;
    returns how many rows went."""
    lines, intact = _read_lines(self.path)
    if not intact:  # (the constructor repaired the file: never here)
      raise SweepError(f"{self.path} is truncated; rerun the command to repair it")

    def key(r: dict) -> str:
      return r["key"] if self.family is None else normalized_key(self.family, r)
    keep = [r for r in lines[1:] if r.get("type") != "row" or key(r) not in row_keys]
    dropped = len(lines) - 1 - len(keep)
    pending = sorted(set(self.header.get("remeasuring", ())) | set(problem_keys))
    self.header = dict(self.header, remeasuring=pending)
    self._rewrite([self.header] + keep)
    self.done = {key(r) for r in keep if r.get("type") == "row"}
    self.n_rows -= dropped
    return dropped

  def finish_remeasure(self, problem_keys: set) -> None:
    """Takes ``problem_keys`` (measured again in full) off the header's
    ``"remeasuring"`` list."""
    pending = [k for k in self.header.get("remeasuring", ()) if k not in problem_keys]
    if pending == list(self.header.get("remeasuring", ())):
      return
    lines, intact = _read_lines(self.path)
    if not intact:
      raise SweepError(f"{self.path} is truncated; rerun the command to repair it")
    self.header = {k: v for k, v in self.header.items() if k != "remeasuring"}
    if pending:
      self.header["remeasuring"] = pending
    self._rewrite([self.header] + lines[1:])

  def _rewrite(self, lines: Sequence[dict]) -> None:
    tmp = self.path + ".tmp"
    with gzip.open(tmp, "wt") as f:
      for line in lines:
        f.write(json.dumps(line) + "\n")
    os.replace(tmp, self.path)

  def append(self, rows: Sequence[dict]) -> None:
    if not rows:
      return
    # A row already on file (a problem a dead worker left half done and
    # another redid) is not written twice; timing rows are always new.
    rows = [r for r in rows if r["key"] not in self.done]
    if not rows:
      return
    with open(self.path, "ab") as raw, gzip.GzipFile(fileobj=raw, mode="wb") as f:
      f.write("".join(json.dumps(r) + "\n" for r in rows).encode())
    for r in rows:
      self.done.add(r["key"])
    self.n_rows += len(rows)


def recorded_family(family, rows: Sequence[dict]):
  """``family`` with only the backends a sweep file's configs belong to.

  A file with no config of a backend predates it (or did not measure it):
  its problems are complete without those configs, and policies evaluated on
  it choose among what it measured.
  """
  names = {family.backend_of(family.config_from_dict(r["config"])).name
           for r in rows if r.get("impl") == "pallas"}
  return family.with_backends([b.name for b in family.backends if b.name in names]) \
      if names else family


def make_row(family, problem, impl: str, config, m) -> dict:
  """The sweep-file row of one measurement."""
  cfg = None if config is None else family.config_to_dict(config)
  return {"type": "row", "key": row_key(family.problem_key(problem), impl, cfg),
          "problem": family.problem_to_dict(problem), "impl": impl, "config": cfg,
          **dataclasses.asdict(m)}


def normalized_key(family, r: dict) -> str:
  """A row's identity in the current config form (old rows lack ``backend``)."""
  if r.get("config") is None or r.get("impl") not in ("pallas", "repeat", "baseline"):
    return r["key"]
  p = family.problem_from_dict(r["problem"])
  return row_key(family.problem_key(p), r["impl"],
                 family.config_to_dict(family.config_from_dict(r["config"])))


def merge_sweeps(dst: str, src: str, same: dict | None = None) -> tuple[int, int]:
  """Puts the problems of sweep file ``src`` into ``dst`` (same kernel, GPU
  and schema, and the same value of each header key of ``same``, whose
  values are what a header without the key means: the inputs' options, e.g.
  ``{"lengths": "spread"}``). A problem in both keeps only ``src``'s rows, so every problem's
  configs come from one run. ``dst``'s header lists ``src``'s header under
  ``"merged"`` (date, command, clocks, JAX version). Written atomically.
  Both files are read strictly (intact, every row valid: :func:`check_sweep`).

  Returns:
    ``(problems replaced, problems added)``.
  """
  if os.path.exists(dst) and os.path.exists(src) and os.path.samefile(dst, src):
    raise ValueError(f"cannot merge {src} into itself")
  h_dst, r_dst = read_sweep(dst, strict=True)
  h_src, r_src = read_sweep(src, strict=True)
  fields = {f: None for f in ("kernel", "device_key", "schema")} | dict(same or {})
  for field, default in fields.items():
    if h_dst.get(field, default) != h_src.get(field, default):
      raise ValueError(f"cannot merge: {src} has {field}={h_src.get(field, default)!r}, "
                       f"{dst} has {h_dst.get(field, default)!r}")
  pk = lambda r: r["key"].split("|", 1)[0]  # noqa: E731
  new = {pk(r) for r in r_src}
  old = {pk(r) for r in r_dst}
  header = dict(h_dst)
  header["merged"] = list(h_dst.get("merged", [])) + [
      {k: h_src.get(k) for k in ("date", "command", "clocks", "jax_version")}]
  SweepFile(dst, h_dst)._rewrite([header] + [r for r in r_dst if pk(r) not in new] + r_src)
  return len(new & old), len(new - old)


def read_clocks() -> dict:
  """Clocks as ``nvidia-smi`` reads them now (empty when it is not there)."""
  if shutil.which("nvidia-smi") is None:
    return {}
  fields = ["clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem",
            "power.limit", "temperature.gpu"]
  try:
    out = subprocess.run(
        ["nvidia-smi", f"--query-gpu={','.join(fields)}", "--format=csv,noheader"],
        capture_output=True, text=True, timeout=10, check=True).stdout
  except (OSError, subprocess.SubprocessError):
    return {}
  values = [v.strip() for v in out.splitlines()[0].split(",")] if out else []
  return dict(zip(fields, values))


def gpu_measure(family, prof) -> "MeasureFn":
  """The sweep's measuring function on a GPU: every config, the baselines and
  the fastest config once more (:func:`wavetune_jax.tuning.measure.measure_points`)."""
  from wavetune_jax.tuning.measure import measure_points

  def measure(problem, configs, with_baseline):
    # with_baseline: True (every baseline row) or the impls to time.
    which = (bool(with_baseline) if isinstance(with_baseline, bool)
             else {problem: tuple(with_baseline)})
    for _, impl, c, m in measure_points(family, prof, [(problem, configs)],
                                        baselines=which, repeat_best=True):
      yield impl, c, m
  return measure


def _versions() -> dict:
  from wavetune_jax.core import versions
  return versions.current()


def make_header(spec, hw, *, jax_version: str, command: str | None = None,
                space: str = "pruned") -> dict:
  return {
      "type": "header", "schema": SCHEMA, "kernel": spec.name,
      "device_kind": hw.name, "device_key": hw.device_key, "num_sms": hw.num_sms,
      "jax_version": jax_version, "versions": _versions(), "clocks": read_clocks(),
      "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
      "command": command if command is not None else " ".join(sys.argv),
      "space": space,
  }


# measure(problem, configs, with_baseline) -> iterator of (impl, config, Measurement);
# with_baseline: a bool, or the baseline impls to time; impl "pallas" (a config of the space), "baseline" (config None: XLA,
# cuDNN), "baseline_<name>" (the spec's extra_baselines) or "repeat" (a config timed a second time, for repeatability). The
# real one uses the profiler; tests pass fakes.
MeasureFn = Callable[[object, Sequence, bool], Iterator[tuple[str, object, object]]]


def sweep_configs(spec, problem, hw, *, prune: bool = True) -> list:
  """The space, plus the default and heuristic configs where pruning dropped
  them (policies that use them are evaluated on every problem); not the
  configs of backends a baseline row measures (``Backend.recorded_as``)."""
  configs = list(spec.space(problem, hw, prune=prune))
  for extra in (spec.default(problem), spec.heuristic(problem, hw)):
    if extra not in configs:
      try:
        spec.validate(problem, extra, hw)
      except ValueError:
        continue
      configs.append(extra)
  return [c for c in configs if spec.backend_of(c).recorded_as is None]


def swept_space(spec, problem, hw) -> list:
  """The configs of ``problem``'s space a complete sweep has a row of: a
  backend measured by a baseline row (``Backend.recorded_as``) counts only
  where the family times that baseline (attention's XLA, not where its
  score matrix would not fit)."""
  from wavetune_jax.tuning.measure import baseline_impls
  space = spec.space(problem, hw)
  if all(spec.backend_of(c).recorded_as is None for c in space):
    return list(space)  # (no baseline to ask for: building them costs, e.g. speed references)
  impls = set(baseline_impls(spec, problem))
  return [c for c in space if spec.backend_of(c).recorded_as in (None, *impls)]


def with_recorded_backends(family, hw, rows: Sequence[dict]) -> list[dict]:
  """``rows`` plus a config row for each baseline row that measured a
  backend's one config (``Backend.recorded_as``: the same call, timed the
  same way), where the config is in the backend's space and the problem has
  no row of it of its own. Readers of sweep files (evaluation, tuning by
  replay, reports) see those backends like any other."""
  backends = [b for b in family.backends if b.recorded_as is not None]
  if not backends:
    return list(rows)
  own = {(r["key"].split("|", 1)[0], (r.get("config") or {}).get("backend"))
         for r in rows if r.get("impl") == "pallas"}
  extra = []
  for r in rows:
    for b in backends:
      if r.get("impl") != b.recorded_as:
        continue
      pk = r["key"].split("|", 1)[0]
      if (pk, b.name) in own:
        continue
      space = b.space(family.problem_from_dict(r["problem"]), hw)
      if len(space) != 1:
        continue
      cfg = family.config_to_dict(space[0])
      extra.append({**r, "key": row_key(pk, "pallas", cfg), "impl": "pallas", "config": cfg})
  return list(rows) + extra


def remeasure_keys(spec, problems: Iterable, hw, *, prune: bool = True) -> set:
  """The row identities a sweep of ``spec`` (its backends) measures for
  ``problems``: each config of :func:`sweep_configs` and its repeat, and the
  platform baseline (kept in the same run as the configs it is compared with)."""
  keys = set()
  for p in problems:
    pk = spec.problem_key(p)
    keys.add(row_key(pk, "baseline", None))
    for c in sweep_configs(spec, p, hw, prune=prune):
      d = spec.config_to_dict(c)
      keys |= {row_key(pk, "pallas", d), row_key(pk, "repeat", d)}
  return keys


def plan_sweep(spec, problems: Iterable, hw, out: SweepFile, *, prune: bool = True):
  """``([(problem, configs not on file, baseline impls not on file)], rows
  skipped)``; the impls are ``"baseline"`` and ``"baseline_<name>"``."""
  from wavetune_jax.tuning.measure import baseline_impls
  todo = []
  skipped = 0
  for p in problems:
    pk = spec.problem_key(p)
    every = sweep_configs(spec, p, hw, prune=prune)
    cfgs = [c for c in every
            if row_key(pk, "pallas", spec.config_to_dict(c)) not in out.done]
    skipped += len(every) - len(cfgs)
    impls = baseline_impls(spec, p)
    with_base = tuple(i for i in impls if row_key(pk, i, None) not in out.done)
    skipped += len(impls) - len(with_base)
    if cfgs or with_base:
      todo.append((p, cfgs, with_base))
  return todo, skipped


def planned_measurements(spec, todo) -> int:
  """Measurements of a plan (configs, baselines), for progress."""
  return sum(len(c) + len(b) for _, c, b in todo)


def run_sweep(spec, problems: Iterable, hw, out: SweepFile, measure: MeasureFn, *,
              prune: bool = True, progress=None) -> dict:
  """Measures every config of every problem not yet on file.

  Args:
    spec: the kernel spec.
    problems: problems to sweep.
    hw: hardware (for the space).
    out: the sweep file (resume state included).
    measure: the measuring function (see ``MeasureFn``).
    prune: use the pruned space.
    progress: optional object with ``start(total)``, ``advance(status)`` and
      ``stop()``.

  Returns:
    Counts: ``{"measured": n, "skipped": n, "failed": n}``.
  """
  todo, skipped = plan_sweep(spec, problems, hw, out, prune=prune)
  total = planned_measurements(spec, todo)
  counts = {"measured": 0, "skipped": skipped, "failed": 0}
  if progress is not None:
    progress.start(total)
  try:
    for p, cfgs, with_base in todo:
      pk = spec.problem_key(p)
      batch: list[dict] = []
      t0 = time.perf_counter()
      try:
        for impl, config, m in measure(p, cfgs, with_base):
          batch.append(make_row(spec, p, impl, config, m))
          counts["measured"] += 1
          counts["failed"] += m.status != "ok"
          if progress is not None and impl != "repeat":
            progress.advance(m.status)
          if len(batch) >= _BATCH:
            out.append(batch)
            batch = []
      finally:
        # What was measured is kept, also on an interrupt; a timing row records
        # the wall seconds this part of the problem took.
        batch.append({"type": "row", "key": f"{pk}|timing|{len(out.done)}|{time.time_ns()}",
                      "problem": spec.problem_to_dict(p), "impl": "timing",
                      "config": None, "status": "ok",
                      "wall_s": time.perf_counter() - t0})
        out.append(batch)
  finally:
    if progress is not None:
      progress.stop()
  return counts
