"""A decoder with a rule's constants as they were and as they are now.

Runs ``wavetune bench model`` with the given arguments in fresh processes,
alternating "before" (each ``--before module:NAME=value`` set first) and
"now" (the code as it is) for ``--rounds`` rounds, with the table cache off
so that no decision of one run is read back by the other. Prints, per row
of the bench (prefill length or decode batch and cache, per op setting),
the median time of each side and now over before; writes every run's JSON
and the summary under ``--out``.

    PYTHONPATH=. python3 benchmarks/model_before_after.py --out DIR --rounds 2 \\
        --before wavetune_jax.families.ragged_dot.mosaic:TRIPLE_SPILL=0.1 \\
        --before wavetune_jax.families.ragged_dot.mosaic:TRIPLE_MARGIN=1.15 \\
        -- --model mixtral_8x7b --layers 4 --ops tables --prompt 700 --decode-batch 1 --cache 1024

Without a GPU the bench measures compile times and checks only (small
models); the table then has no times.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path


def parse_patch(text: str, option: str = "--before") -> tuple[str, str, object]:
  """``module:NAME=value`` -> (module, NAME, value of NAME's present type);
  ``option`` names the command-line option in the errors."""
  try:
    where, value = text.split("=", 1)
    module, name = where.split(":", 1)
  except ValueError:
    raise ValueError(f"{option} takes module:NAME=value, got {text!r}") from None
  try:
    mod = importlib.import_module(module)
  except ImportError as e:
    raise ValueError(f"{option} {text!r}: cannot import {module!r} ({e})") from None
  if not hasattr(mod, name):
    raise ValueError(f"{option} {text!r}: {module} has no {name}")
  old = getattr(mod, name)
  if not isinstance(old, (bool, int, float, str)):
    raise ValueError(f"{option} {text!r}: {module}.{name} is a {type(old).__name__}; only "
                     "numbers and strings can be set")
  try:
    new = (value.lower() in ("1", "true") if isinstance(old, bool) else type(old)(value))
  except ValueError:
    raise ValueError(f"{option} {text!r}: {value!r} is not a {type(old).__name__} like "
                     f"{module}.{name} = {old!r}") from None
  return module, name, new


def apply_patches(patches: list) -> None:
  """Sets each ``(module, NAME, value)`` of :func:`parse_patch`, saying so."""
  for module, name, value in patches:
    setattr(importlib.import_module(module), name, value)
    print(f"set {module}.{name} = {value!r}", flush=True)  # the log says what ran


def _child(patches: list, bench_args: list) -> int:
  apply_patches(patches)
  from wavetune_jax.cli import main
  return main(["bench", "model", *bench_args])


def _key(row: dict) -> tuple:
  return tuple(row.get(k) for k in ("setting", "kind", "length", "batch", "cache_layout"))


def summarize(runs: dict) -> list[dict]:
  """Per bench row: the median time of "before" and "now" over the rounds."""
  out = {}
  for side, paths in runs.items():
    for path in paths:
      for row in json.loads(Path(path).read_text())["rows"]:
        us = row.get("us")
        entry = out.setdefault(_key(row), {"row": {k: row.get(k) for k in (
            "setting", "kind", "length", "batch", "cache_layout")}, "before": [], "now": []})
        if isinstance(us, (int, float)) and us == us:
          entry[side].append(us)
  table = []
  for entry in out.values():
    b = statistics.median(entry["before"]) if entry["before"] else None
    n = statistics.median(entry["now"]) if entry["now"] else None
    table.append({**entry["row"], "before_us": b, "now_us": n,
                  "before_runs": entry["before"], "now_runs": entry["now"],
                  "now_over_before": b / n if b and n else None})
  return table


def main(argv=None) -> int:
  argv = list(sys.argv[1:] if argv is None else argv)
  if argv[:1] == ["--child"]:
    return _child(json.loads(argv[1]), argv[2:])
  bench = []
  if "--" in argv:
    i = argv.index("--")
    argv, bench = argv[:i], argv[i + 1:]
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--before", action="append", required=True, metavar="module:NAME=value")
  ap.add_argument("--rounds", type=int, default=2)
  ap.add_argument("--out", required=True, help="folder for every run's JSON and the summary")
  ap.add_argument("--timeout", type=float, default=600.0, help="seconds per bench run")
  a = ap.parse_args(argv)
  if a.rounds < 1:
    ap.error(f"--rounds must be >= 1, got {a.rounds}")
  if not bench:
    ap.error("give the bench's arguments after --, e.g. -- --model small_moe --ops tables")
  if any(x == "--json" or x.startswith("--json=") for x in bench):
    ap.error("the runs' JSON files go under --out: drop --json after --")
  try:
    patches = [parse_patch(p) for p in a.before]
  except ValueError as e:
    ap.error(str(e))
  out = Path(a.out)
  out.mkdir(parents=True, exist_ok=True)
  env = {**os.environ, "WAVETUNE_TABLE_CACHE": "off"}
  runs = {"before": [], "now": []}
  for rnd in range(a.rounds):
    for side, ps in (("before", patches), ("now", [])):
      path = out / f"{side}_{rnd}.json"
      path.unlink(missing_ok=True)  # a run left from before is not this one
      t0 = time.time()
      cmd = [sys.executable, __file__, "--child", json.dumps(ps), *bench, "--json", str(path)]
      try:
        r = subprocess.run(cmd, env=env, timeout=a.timeout, capture_output=True, text=True)
      except subprocess.TimeoutExpired as e:
        text = [x.decode(errors="replace") if isinstance(x, bytes) else (x or "")
                for x in (e.stdout, e.stderr)]
        (out / f"{side}_{rnd}.log").write_text("".join(text))
        print(f"{side} round {rnd}: stopped at --timeout {a.timeout:g} s", flush=True)
        continue
      (out / f"{side}_{rnd}.log").write_text(r.stdout + r.stderr)
      if r.returncode != 0 or not path.exists():
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["no output"]
        print(f"{side} round {rnd}: the bench failed (exit {r.returncode}): {tail[0]}",
              flush=True)
        continue
      runs[side].append(str(path))
      print(f"{side} round {rnd}: {time.time() - t0:.0f} s", flush=True)
  table = summarize(runs)
  (out / "summary.json").write_text(json.dumps(
      {"before": [f"{m}:{n}={v!r}" for m, n, v in patches], "bench": bench, "runs": runs,
       "rows": table}, indent=1))
  print(f"\n{'setting':<10}{'kind':<9}{'length':>8}{'batch':>7}{'before us':>12}{'now us':>12}"
        f"{'now/before':>12}   (speed; > 1: now is faster)")
  for t in table:
    fmt = lambda v: f"{v:12.1f}" if v else f"{'-':>12}"  # noqa: E731
    ratio = f"{t['now_over_before']:12.3f}" if t["now_over_before"] else f"{'-':>12}"
    print(f"{t['setting']!s:<10}{t['kind']!s:<9}{t['length']!s:>8}{t['batch']!s:>7}"
          f"{fmt(t['before_us'])}{fmt(t['now_us'])}{ratio}")
  return 0 if runs["before"] and runs["now"] else 1


if __name__ == "__main__":
  raise SystemExit(main())
