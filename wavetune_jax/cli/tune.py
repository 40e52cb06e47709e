"""``wavetune tune``, ``wavetune select`` and ``wavetune plot``."""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import sys
import time

from wavetune_jax.cli.common import (MAX_INT, CliError, add_family_arg, at_least,
                                     detect_gpu, existing_file, output_file, positive_int,
                                     pyplot)
from wavetune_jax.cli.eval import add_model_args, model_options
from wavetune_jax.tuning.sweep import _article

__all__ = ["add_commands"]


def _tune(args) -> int:
  import jax

  from wavetune_jax.cli.sweep import Progress, checked_m_range, problems
  from wavetune_jax.core.registry import get_family
  from wavetune_jax.tuning import evaluate
  from wavetune_jax.tuning import tuner as tuning

  command = "wavetune " + shlex.join(sys.argv[1:])
  spec = get_family(args.family)
  prov = {"command": command, "jax_version": jax.__version__}
  if args.fit_only:
    if args.replay:
      raise CliError("--fit-only reads --anchors, --replay a sweep: give one of them")
    return _fit_only(args, spec, prov)
  if args.replay:
    ignored = [o for o, v in (("--shapes", args.shapes != "train"), ("--weights", args.weights),
                              ("--m", args.m), ("--anchors", args.anchors),
                              ("--dtype", args.dtype != "bfloat16"),
                              ("--windows", args.windows)) if v]
    if ignored:
      raise CliError(f"--replay tunes on the sweep's problems: {', '.join(ignored)} does "
                     f"not apply (--m-range filters them)")
    checked_m_range(args)
    ds = evaluate.load_dataset(args.replay)
    if ds.family.name != spec.name:
      raise CliError(f"{args.replay} is {_article(ds.family.name)} {ds.family.name} sweep, not "
                     f"{spec.name}")
    mix = ds.header.get("lengths", "spread")
    if mix != "spread" and not args.out:
      raise CliError(f"{args.replay} was measured with --lengths {mix}; the default "
                     f"{spec.name} table assumes lengths spread over the cache, so a table "
                     f"from it goes to a file of its own: name it with --out")
    spec = ds.family  # the backends the sweep recorded
    hw = ds.hw
    out = _out_path(args, spec.name, hw.device_key)
    pool = [p for p in ds.problems
            if not args.m_range or args.m_range[0] <= spec.size_of(p) <= args.m_range[1]]
    if not pool:
      raise CliError(f"{args.replay} has no complete problem to tune on")
    backend = tuning.ReplayMeasurer(ds, pool)
    prov["source"] = args.replay
    progress = None
  else:
    from wavetune_jax.cli.sweep import gpu_devices
    from wavetune_jax.tuning import profiler, sweep
    devices = gpu_devices(args.devices)
    hw = detect_gpu("tune", "tune from a recorded sweep (--replay SWEEP) or anchor log "
                    "(--fit-only --anchors LOG)")
    out = _out_path(args, spec.name, hw.device_key)  # refused before anything is measured
    pool = problems(spec, args)
    log_path = args.anchors or f"data/anchors/{hw.device_key}/{spec.name}_{args.dtype}.jsonl.gz"
    header = sweep.make_header(spec, hw, jax_version=jax.__version__, command=command,
                               space="anchors")
    log = sweep.SweepFile(log_path, header, spec)
    progress = Progress(f"tune {spec.name}")
    if len(devices) > 1:
      from wavetune_jax.tuning import parallel
      backend = parallel.ParallelMeasurer(
          spec, log, devices=devices, progress=progress,
          worker_args={"iterations": args.iterations, "threads": args.threads})
      print(f"measuring on {len(devices)} GPUs ({', '.join(devices)}), one worker each",
            flush=True)
    else:
      backend = tuning.GpuMeasurer(spec, profiler.Profiler(iterations=args.iterations,
                                                          threads=args.threads),
                                  log=log, progress=progress)
    prov["source"] = log_path
    print(f"{hw.name}: {len(pool)} problems; anchors logged to {log_path} "
          f"({len(backend._known)} already there)", flush=True)
  budget = args.budget
  if budget is None:
    fraction = args.budget_fraction or tuning.DEFAULT_BUDGET_FRACTION
    budget = max(1, round(fraction * sum(len(spec.space(p, hw)) for p in pool)))
  if progress is not None:
    progress.start(budget)
  t0 = time.perf_counter()
  try:
    res = tuning.tune(spec, hw, pool, backend, budget=budget, seed=args.seed,
                      **model_options(args), provenance=prov,
                      log=lambda s: print(s, flush=True))
  finally:
    if progress is not None:
      progress.stop()
  _write_table(res.table, out, hw)
  measured = ("s of GPU time recorded for them in the sweep" if args.replay else "s measuring")
  print(f"{res.measurements} anchors ({res.table.provenance['failed_anchors']} failed), "
        f"{res.seconds:.0f} {measured}, {time.perf_counter() - t0:.0f} s in all")
  _print_written(args, out)
  return 0


def _fit_only(args, spec, prov) -> int:
  """Fits the table from a logged anchor file, measuring nothing."""
  from wavetune_jax.cli.sweep import problems
  from wavetune_jax.tuning import report, sweep
  from wavetune_jax.tuning import tuner as tuning
  if not args.anchors:
    raise CliError("--fit-only needs --anchors FILE")
  if not os.path.isfile(args.anchors):
    raise CliError(f"--anchors {args.anchors}: no such file")
  header, rows = sweep.read_sweep(args.anchors, strict=True)
  if header.get("kernel") != spec.name:
    raise CliError(f"{args.anchors} holds {header.get('kernel')!r} anchors, not {spec.name!r}")
  hw = report.hardware_of(header)
  points = [(spec.problem_from_dict(r["problem"]), spec.config_from_dict(r["config"]),
             r["median_us"] if r["status"] == "ok" else None)
            for r in rows if r["impl"] == "pallas"]
  prov.update(mode="gpu", source=args.anchors, anchors_jax_version=header.get("jax_version"),
              note="fitted from the anchor log")
  if not any(us is not None for *_, us in points):
    raise CliError(f"{args.anchors} has no successful anchor to fit")
  out = _out_path(args, spec.name, hw.device_key)
  table = tuning.build_table(spec, hw, problems(spec, args), points,
                             **model_options(args), provenance=prov)
  _write_table(table, out, hw)
  print(f"{hw.name}: {len(table.entries)} variant models and {len(table.exact)} exact "
        f"entries from {len(points)} anchors")
  _print_written(args, out)
  return 0


def _select(args) -> int:
  from wavetune_jax.core.hardware import PRESETS, detect, get_hardware
  from wavetune_jax.core.registry import get_family
  from wavetune_jax.runtime import selector, tables
  spec = get_family(args.family)
  if args.device is None:
    try:
      hw = detect()
    except RuntimeError:
      raise CliError(f"no GPU here: name one with --device ({', '.join(sorted(PRESETS))})") from None
  else:
    hw = get_hardware(args.device)
  fields = {"dtype": args.dtype}
  for name, value in (("m", args.m), ("n", args.n), ("k", args.k)):
    if value is not None:
      fields[spec.size_field if name == "m" else name] = value
  flags = {spec.size_field if n == "m" else n: f"--{n}" for n in ("m", "n", "k")
           if getattr(args, n) is not None}
  for name, value in args.set or ():
    if name in flags:
      raise CliError(f"--set {name}={value}: {name} is given by {flags[name]} already")
    if name in fields and name != "dtype":  # (--set dtype=... names any dtype)
      raise CliError(f"--set {name}={value}: {name} is given twice")
    fields[name] = _set_value(name, value)
    _check_set_type(spec, name, value, fields[name])
  try:
    problem = spec.problem_from_dict(fields)
  except (TypeError, ValueError) as e:
    missing = re.findall(r"'(\w+)'", str(e)) if "missing" in str(e) else []
    hint = "; give " + " ".join(f"--set {f}=..." for f in missing) if missing else ""
    raise CliError(f"not {_article(spec.name)} {spec.name} problem: {fields} ({e}){hint}") from None
  problem = spec.canonical(problem)  # as the ops key it (a window's sides)
  if args.table and args.policy != "tables":
    raise CliError(f"--table is the tables policy's table: it does not apply to --policy "
                   f"{args.policy}")
  if args.table:
    ctx = selector.use_tables(tables.load(args.table, spec, hw), spec.name)
  else:
    ctx = selector.policy(args.policy)
  with ctx:
    sel = selector.select(spec, problem, hw)
    table = selector.active_table(spec.name, hw) if args.policy == "tables" else None
  g, l = spec.coords(problem, sel.config)
  print(f"problem     {spec.problem_key(problem)} on {hw.name}")
  print(f"config      {spec.config_to_dict(sel.config)}")
  print(f"answered by {sel.source}" + (f" ({sel.note})" if sel.note else "")
        + (f"; the table was tuned from {table.provenance.get('source', '?')}"
           if table is not None else ""))
  pred = "-" if sel.predicted_us is None else f"{sel.predicted_us:.1f} us"
  print(f"predicted   {pred}")
  print(f"grid        G={g} CTAs, L={l:.4g} trips" +
        (f", {sel.waves} wave(s)" if sel.waves is not None else ""))
  for b in spec.backends:
    why = b.unavailable_reason(hw)
    if why is not None:
      print(f"skipped     {b.name}: {why}")
  return 0


def _plot(args) -> int:
  import collections

  import numpy as np

  from wavetune_jax.core.registry import get_family
  from wavetune_jax.runtime import tables
  from wavetune_jax.tuning import evaluate
  plt = pyplot()
  ds = evaluate.load_dataset(args.sweep)
  spec = ds.family
  if spec.name != args.family:
    raise CliError(f"{args.sweep} holds {spec.name!r} measurements, not {args.family!r}")
  # The table may hold backends the sweep did not measure: read it with them all.
  table = tables.load(args.table or tables.default_path(spec.name, ds.hw.device_key),
                      get_family(spec.name), ds.hw)
  want = {k: _set_value(k, v) for k, v in args.set or []}
  fields = {f.name for f in dataclasses.fields(spec.problem_cls) if not f.name.startswith("_")}
  unknown = sorted(set(want) - fields)
  if unknown:
    raise CliError(f"--set {unknown[0]}: {spec.name} problems have no field {unknown[0]!r} "
                   f"(fields: {', '.join(sorted(fields))})")
  probs = sorted((p for p in ds.times if all(getattr(p, k) == v for k, v in want.items())),
                 key=spec.size_of)
  weights = {spec.weight_of(p) for p in probs}
  if not probs:
    raise CliError(f"no problem with {want} in {args.sweep}")
  if len(weights) > 1:
    raise CliError(f"{len(weights)} weights match {want}; name more fields with --set, "
                   f"e.g. {dict(sorted(weights)[0])}")
  wins = collections.Counter(ds.oracle(p) for p in probs)
  configs = [c for c, _ in wins.most_common(args.configs)]
  fig, ax = plt.subplots(figsize=(8, 5))
  for i, c in enumerate(configs):
    color = f"C{i}"
    xs = [p for p in probs if c in ds.times[p]]
    ax.plot([spec.size_of(p) for p in xs], [ds.times[p][c] for p in xs], "o", color=color,
            label=f"{spec.config_to_dict(c)} measured")
    ms = np.unique(np.geomspace(1, spec.size_of(probs[-1]), 400).astype(int))
    pred = [table.predict(spec.with_size(probs[0], m), [c], trusted=False)[0] for m in ms]
    ax.plot(ms, pred, "-", color=color, alpha=0.7)
  ax.set_xscale("log"); ax.set_yscale("log")
  ax.set_xlabel(spec.size_field); ax.set_ylabel("latency (us)")
  ax.set_title(f"{spec.name} {' '.join(f'{k}={v}' for k, v in want.items())} on {ds.hw.name}: "
               "measured (dots) vs wave model (lines)")
  ax.legend(fontsize=6)
  fig.tight_layout()
  fig.savefig(args.out, dpi=120)
  print(f"wrote {args.out}")
  return 0


def _check_table(table) -> None:
  """A table with no model entry and no exact entry answers nothing: never write it."""
  if not table.entries and not table.exact:
    raise CliError("no model could be fitted (every anchor failed or too few per "
                   "variant); no table written")


def _is_shipped(path: str) -> bool:
  """Whether ``path`` is in the shipped tables' folder, or in an installed
  package's (site-packages)."""
  from wavetune_jax.runtime import tables
  real = os.path.realpath(path)
  shipped = os.path.realpath(tables.shipped_dir())
  parts = real.split(os.sep)
  return (os.path.commonpath([real, shipped]) == shipped
          or "site-packages" in parts or "dist-packages" in parts)


def _out_path(args, family: str, device_key: str) -> str:
  """Where ``tune`` writes: ``--out``; else with ``--overwrite-shipped`` the
  shipped table; else the user's folder (:func:`tables.user_path`). A path in
  the shipped tables (or site-packages) needs ``--overwrite-shipped``."""
  from wavetune_jax.runtime import tables
  if args.out:
    out = args.out
  elif args.overwrite_shipped:
    out = os.path.join(tables.shipped_dir(), device_key, f"{family}.json")
  else:
    out = tables.user_path(family, device_key)
  for flag, src in (("--replay", getattr(args, "replay", None)),
                    ("--anchors", getattr(args, "anchors", None))):
    if src and os.path.exists(out) and os.path.exists(src) and os.path.samefile(out, src):
      raise CliError(f"--out {out} is the {flag} file; a table written there would replace "
                     f"the measurements it is fitted from: name another file")
  if os.path.isdir(out):
    raise CliError(f"--out {out} is a folder; name the table file, e.g. "
                   f"{os.path.join(out, device_key, family + '.json')}")
  folder = os.path.dirname(os.path.abspath(out))
  while not os.path.exists(folder) and os.path.dirname(folder) != folder:
    folder = os.path.dirname(folder)  # the nearest folder that exists
  if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
    raise CliError(f"cannot write the table {out}: {folder} is not a writable folder")
  if _is_shipped(out) and not args.overwrite_shipped:
    raise CliError(f"{out} is in the shipped tables ({tables.shipped_dir()}) or an "
                   f"installed package; pass --overwrite-shipped to replace it, or "
                   f"write elsewhere (--out)")
  return out


def _write_table(table, out: str, hw) -> None:
  """Writes ``table`` to ``out`` only once the file loads back through
  ``tables.load`` (the checks every table read gets), atomically (a temp
  file in the same folder, then a rename)."""
  import json
  import tempfile

  from wavetune_jax.core.registry import get_family
  from wavetune_jax.runtime import tables
  _check_table(table)
  folder = os.path.dirname(os.path.abspath(out))
  os.makedirs(folder, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{os.path.basename(out)}.", suffix=".tmp")
  try:
    with os.fdopen(fd, "w") as f:
      json.dump(table.to_json(), f, indent=1)
      f.write("\n")
    try:
      tables.load(tmp, get_family(table.family.name), hw)
    except tables.TableError as e:
      raise CliError(f"the tuned table fails the checks of tables.load, so {out} is not "
                     f"written: {str(e).replace(tmp, out)}") from None
    os.chmod(tmp, 0o644)
    os.replace(tmp, out)
  finally:
    if os.path.exists(tmp):
      os.unlink(tmp)


def _print_written(args, out: str) -> None:
  from wavetune_jax.runtime import tables
  if args.out:
    note = " (load it with wt.load_tables, or WAVETUNE_TABLES=<folder> in its layout)"
  elif args.overwrite_shipped:
    note = " (replaced the shipped table)"
  elif os.environ.get("WAVETUNE_TABLES"):
    note = " (in $WAVETUNE_TABLES, which the ops read instead of the shipped tables)"
  else:
    note = (f" (the ops read tables in {tables.user_dir()} before the shipped ones; "
            f"the shipped table is unchanged)")
  print(f"table written to {out}{note}")


def _field(s: str) -> tuple[str, str]:
  name, sep, value = s.partition("=")
  if not sep or not name:
    raise argparse.ArgumentTypeError(f"{s!r}: expected FIELD=VALUE")
  return name, value


def add_commands(sub: argparse._SubParsersAction) -> None:
  from wavetune_jax.cli.sweep import add_problem_args
  from wavetune_jax.core.hardware import PRESETS
  tu = sub.add_parser(
      "tune", help="sparse wave-aware profiling -> a table of this GPU (user folder)",
      description="Measures anchors placed on the wave structure (GPU), or reads them "
      "from a recorded sweep (--replay, no GPU), fits the wave model per variant and "
      "writes the dual table. On a GPU every anchor is logged to a resumable file; a "
      "rerun reads what is there instead of timing it again. A sweep or anchor log "
      "with an invalid row (a time that is not finite and positive, a problem or "
      "config the family does not parse, an unknown GPU) is refused, naming the row; "
      "a table is written only once it loads back, and never over a shipped table "
      "without --overwrite-shipped.")
  add_problem_args(tu)
  tu.add_argument("--replay", type=existing_file,
                  help="sweep file to read anchors from instead of a GPU")
  tu.add_argument("--budget", type=positive_int,
                  help="measurements (default: 3%% of the pool's space)")
  tu.add_argument("--budget-fraction", type=at_least(1e-6),
                  help="budget as a fraction of the pool's space (default: 0.03)")
  tu.add_argument("--seed", type=int, default=0,
                  help="tie-breaking among targeted anchors (default: 0)")
  add_model_args(tu)
  tu.add_argument("--out", help="table file (default: <folder>/<device_key>/<family>.json, "
                  "<folder> $WAVETUNE_TABLES if set, else $XDG_DATA_HOME/wavetune/tables "
                  "(~/.local/share/wavetune/tables), which the ops read before the shipped "
                  "tables)")
  tu.add_argument("--overwrite-shipped", action="store_true",
                  help="write (without --out) or allow --out to replace a shipped table "
                       "(tables/ of a source checkout, or the copy an installed package "
                       "carries)")
  tu.add_argument("--anchors", help="anchor log (GPU mode; default "
                  "data/anchors/<device_key>/<family>_<dtype>.jsonl.gz)")
  tu.add_argument("--fit-only", action="store_true",
                  help="fit the table from the --anchors log without measuring")
  tu.add_argument("--iterations", type=positive_int, default=20,
                  help="timed calls per anchor (default: 20)")
  tu.add_argument("--threads", type=positive_int, default=16,
                  help="parallel compile threads (default: 16)")
  tu.add_argument("--devices", default="all",
                  help="GPUs to measure on, one worker process each: 'all' (default: this "
                  "host's GPUs), a count, or ids like 0,1")
  tu.set_defaults(func=_tune)

  se = sub.add_parser("select", help="the backend and config chosen for one problem",
                      description="What the ops would choose for one problem, on this GPU "
                      "or (--device) on a named one from any machine.")
  add_family_arg(se, positional=True)
  se.add_argument("--m", type=positive_int,
                  help="the size field (GEMM: M; attention: q_len)")
  se.add_argument("--n", type=positive_int, help="GEMM N")
  se.add_argument("--k", type=positive_int, help="GEMM K")
  se.add_argument("--set", action="append", metavar="FIELD=VALUE", type=_field,
                  help="any other problem field, e.g. --set batch=2 --set q_heads=32")
  se.add_argument("--dtype", default="bfloat16",
                  choices=("bfloat16", "float16", "float32", "float8_e4m3fn"),
                  help="input dtype (default: bfloat16; float8_e4m3fn: the W8A8 problems of "
                  "qmatmul and qragged_dot)")
  se.add_argument("--device", choices=sorted(PRESETS),
                  help="hardware preset (default: this GPU)")
  se.add_argument("--table", type=existing_file, help="table file (default: the shipped one)")
  se.add_argument("--policy", default="tables", choices=("tables", "heuristic", "fixed"),
                  help="selection policy (default: tables)")
  se.set_defaults(func=_select)

  pl = sub.add_parser("plot", help="wave model vs measured latency for one weight (PNG)")
  add_family_arg(pl, positional=True)
  pl.add_argument("--sweep", required=True, type=existing_file, help="a sweep file")
  pl.add_argument("--table", type=existing_file,
                  help="default: the shipped table of the sweep's GPU")
  pl.add_argument("--set", action="append", metavar="FIELD=VALUE", type=_field,
                  help="problem fields naming the weight, e.g. --set n=4096 --set k=4096 "
                       "or --set batch=1 --set q_heads=32")
  pl.add_argument("--configs", type=positive_int, default=4,
                  help="how many configs to draw (default: 4)")
  pl.add_argument("--out", required=True, type=output_file, help="PNG path")
  pl.set_defaults(func=_plot)


def _check_set_type(spec, name: str, given: str, value) -> None:
  """A ``--set`` value of the wrong kind for its field is named at once (not
  behind the fields still missing)."""
  import dataclasses
  kinds = {f.name: f.type for f in dataclasses.fields(spec.problem_cls)}
  want = kinds.get(name)
  want = getattr(want, "__name__", want)
  ok = {"int": lambda v: isinstance(v, int) and not isinstance(v, bool),
        "bool": lambda v: isinstance(v, bool),
        "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)}.get(want)
  if ok is not None and not ok(value):
    kind = {"int": "an integer", "bool": "true or false", "float": "a number"}[want]
    raise CliError(f"--set {name}={given}: {name} takes {kind}")


def _set_value(name: str, value: str):
  """A ``--set FIELD=VALUE`` value: a bool (true/false, any case), an int, a
  float, or the string as given."""
  value = value.strip()
  low = value.lower()
  if low in ("true", "false"):
    return low == "true"
  if value.lstrip("-").isdigit():
    if abs(int(value)) > MAX_INT:
      raise CliError(f"--set {name}={value}: too large (at most {MAX_INT})")
    return int(value)
  try:
    return float(value)
  except ValueError:
    return value


