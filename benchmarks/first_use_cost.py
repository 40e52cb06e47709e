"""What a new shape costs the first time: wavetune's refinement against XLA's autotuned compile.

Per family (matmul, attention, decode, ragged_dot) and per new problem (a
shape the shipped tables do not hold), four fresh processes, each timing the
first ``jax.jit(op).trace(...).lower().compile()`` and the first call
(``block_until_ready``) on the wall clock:

  XLA, process 1   the op as a JAX user writes it (``jnp.dot``,
                   ``jax.nn.dot_product_attention`` with cuDNN, the same with
                   ``key_value_seq_lengths`` for decode, ``lax.ragged_dot``),
                   XLA's autotuner at its default level, empty caches: XLA's
                   autotuned compile
  XLA, process 2   the same, with the persistent compilation cache (and
                   XLA's per-fusion autotune results) process 1 filled
  wt, process 1    the wavetune op under the selection policy ``--policy``
                   (default ``refine``: the first time a problem is traced,
                   the platform op and the model's best candidates are
                   measured on the GPU and the decision is kept in the
                   parsed-table cache folder), empty caches (parsed tables,
                   lowered kernels, JAX's compilation cache); the trace's
                   measuring is split out (``selector.refinement_stats()``),
                   and by phase (compile, setup, check and time)
  wt, process 2    the same, with the caches process 1 filled: it should
                   measure nothing; the selection itself is timed once more
                   on its own (``wt.select`` under a fresh memo: the decision
                   read back from the store)

Each library and family has cache folders of its own (the CUDA driver's
compute cache among them, ``CUDA_CACHE_PATH``), so no process warms
another's; a process starts JAX's backend with a trivial jit before timing,
so the numbers are the shape's cost, not the process's start-up. The
subprocesses run this script with ``--worker`` and print their rows as JSON;
one that fails or passes ``--timeout`` is reported and the run goes on, and
past ``--budget`` (default 8 minutes) the rest are skipped. The exit status is
1 if any process failed or a second process measured again.

  python3 benchmarks/first_use_cost.py [--json out.json]        # a GPU, ~5 min
  python3 benchmarks/first_use_cost.py --families matmul --problem matmul:m=1100,n=5120,k=3584
  python3 benchmarks/first_use_cost.py --dry-run                 # the plan, nothing timed
  python3 benchmarks/first_use_cost.py --from-json out.json      # the table of a recorded run
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time

from model_before_after import apply_patches, parse_patch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

FAMILIES = ("matmul", "attention", "decode", "ragged_dot")
LIBS = ("xla", "wt")
#: The fields a problem is given by on the command line (the rest are the
#: family's defaults: bfloat16, causal, one new token per sequence in decode).
FIELDS = {
    "matmul": ("m", "n", "k"),
    "attention": ("batch", "q_len", "q_heads", "kv_heads", "head_dim"),
    "decode": ("batch", "kv_len", "q_heads", "kv_heads", "head_dim"),
    "ragged_dot": ("m", "g", "k", "n"),
}
#: Fields with a default (the others are required).
DEFAULTS = {"attention": {"batch": 1, "head_dim": 128}, "decode": {"head_dim": 128}}
#: New problems, realistic and in no shipped table (H100 and H200, exact or
#: anchor): a Qwen2-7B-sized prefill of 1,100 tokens (GEMM, attention), its
#: decode step at batch 12 against a 5,000-token cache, and Mixtral-8x7B's
#: w13 grouped GEMM for the same 1,100 tokens routed to 2 experts each.
DEFAULT_PROBLEMS = {
    "matmul": [dict(m=1100, n=5120, k=3584)],
    "attention": [dict(batch=1, q_len=1100, q_heads=28, kv_heads=4, head_dim=128)],
    "decode": [dict(batch=12, kv_len=5000, q_heads=28, kv_heads=4, head_dim=128)],
    "ragged_dot": [dict(m=2200, g=8, k=4096, n=28672)],
}
#: The line of a worker's stdout that holds its result.
MARK = "FIRST_USE_RESULT "
#: Every process of a run, for the dry run's time estimate: start-up and
#: imports, seconds (a GPU machine; refinement and compiles come on top).
_START_S = 8


class _Parser(argparse.ArgumentParser):
  """Argument errors as one line (no usage block)."""

  def error(self, message):
    raise SystemExit(f"first_use_cost.py: error: {message}")


def _fail(msg: str):
  raise SystemExit(f"first_use_cost.py: error: {msg}")


# --- problems ------------------------------------------------------------------------------


def problem_of(family: str, fields: dict):
  """The family's problem for command-line ``fields`` (what the op derives
  from the arrays :func:`make` builds). Raises ValueError for a problem the
  family refuses."""
  import wavetune_jax as wt
  f = dict(DEFAULTS.get(family, {}), **fields)
  if family == "matmul":
    return wt.MatmulProblem(m=f["m"], n=f["n"], k=f["k"])
  if family == "attention":
    return wt.AttentionProblem(batch=f["batch"], q_heads=f["q_heads"], kv_heads=f["kv_heads"],
                               q_len=f["q_len"], kv_len=f["q_len"], head_dim=f["head_dim"])
  if family == "decode":
    return wt.DecodeProblem(batch=f["batch"], q_heads=f["q_heads"], kv_heads=f["kv_heads"],
                            kv_len=f["kv_len"], head_dim=f["head_dim"])
  return wt.RaggedDotProblem(m=f["m"], g=f["g"], k=f["k"], n=f["n"])


def parse_problem(text: str) -> tuple[str, dict]:
  """``FAMILY:field=value,...`` -> ``(family, fields)``; a one-line
  SystemExit for anything else (unknown family or field, a value that is not
  a positive integer, a missing field, a problem the family refuses)."""
  family, sep, rest = text.partition(":")
  if not sep:
    _fail(f"--problem {text!r}: expected FAMILY:field=value,... (e.g. matmul:m=1100,n=5120,k=3584)")
  if family not in FIELDS:
    _fail(f"--problem {text!r}: unknown family {family!r}; choose from {', '.join(FAMILIES)}")
  fields = {}
  for item in filter(None, rest.split(",")):
    name, eq, value = item.partition("=")
    if not eq or name not in FIELDS[family]:
      _fail(f"--problem {text!r}: {item!r} is not field=value with a field of {family} "
            f"({', '.join(FIELDS[family])})")
    if not value.isdigit() or int(value) < 1:
      _fail(f"--problem {text!r}: {name}={value!r} is not a positive integer")
    if name in fields:
      _fail(f"--problem {text!r}: {name} given twice")
    fields[name] = int(value)
  missing = [n for n in FIELDS[family] if n not in fields and n not in DEFAULTS.get(family, {})]
  if missing:
    _fail(f"--problem {text!r}: missing {', '.join(missing)}")
  try:
    problem_of(family, fields)
  except (TypeError, ValueError) as e:
    _fail(f"--problem {text!r}: {str(e).splitlines()[0]}")
  return family, fields


def describe(fields: dict) -> str:
  """A problem's fields as a table cell: ``m=1100 n=5120 k=3584``."""
  return " ".join(f"{k}={v}" for k, v in fields.items())


def shipped_problems(family: str, device_key: str) -> set | None:
  """The problems the table the ops read for ``family`` on ``device_key``
  holds (exact entries and anchors), or None (no table). Reads the file
  only: the parsed-table cache is off and JAX's backend is not started."""
  import wavetune_jax as wt
  from wavetune_jax.runtime import table_cache
  from wavetune_jax.runtime import tables
  table_cache.set_dir(None)
  try:
    hw = wt.get_hardware(device_key)
    t = tables.load(tables.default_path(family, hw.device_key), wt.get_family(family), hw)
  except (ValueError, tables.TableError):
    return None
  return set(t.exact) | {p for p, _, _ in t.anchors}


# --- the processes -------------------------------------------------------------------------


def _xla_flags(flags: str) -> str:
  """``XLA_FLAGS`` without an autotune level: XLA's own default is timed."""
  return " ".join(f for f in flags.split() if not f.startswith("--xla_gpu_autotune_level"))


def build_plan(a, root: str, base_env: dict) -> list[dict]:
  """Every process of the run, in order: family, library, stage (1: empty
  caches, 2: those stage 1 filled), its cache folders, the environment it
  gets (``env``: only what differs from ``base_env``) and its argv."""
  procs = []
  for family in a.families:
    for lib in LIBS:
      d = os.path.join(root, family, lib)
      # (the CUDA driver's compute cache too: kept per machine otherwise,
      # it can hold a second of cuDNN's compile from an earlier run)
      caches = {"jax": os.path.join(d, "jax_cache"), "cuda": os.path.join(d, "cuda_cache")}
      env = {"XLA_FLAGS": _xla_flags(base_env.get("XLA_FLAGS", "")),
             "CUDA_CACHE_PATH": caches["cuda"]}
      if lib == "wt":
        caches["tables"] = os.path.join(d, "table_cache")
        env["WAVETUNE_TABLE_CACHE"] = caches["tables"]
        if a.kernel_cache:
          caches["kernels"] = os.path.join(d, "kernel_cache")
        env["WAVETUNE_KERNEL_CACHE"] = caches.get("kernels", "off")
      else:
        env.update(WAVETUNE_TABLE_CACHE="off", WAVETUNE_KERNEL_CACHE="off")
      if base_env.get("XLA_FLAGS") is None and not env["XLA_FLAGS"]:
        del env["XLA_FLAGS"]
      for stage in (1, 2):
        argv = [sys.executable, os.path.abspath(__file__), "--worker", "--lib", lib,
                "--stage", str(stage), "--families", family, "--jax-cache", caches["jax"],
                "--problems-json", json.dumps(a.problems[family], separators=(",", ":"))]
        if lib == "wt":
          argv += ["--policy", a.policy]
          for text in a.set:
            argv += ["--set", text]
        procs.append(dict(family=family, lib=lib, stage=stage, caches=caches, env=env,
                          argv=argv))
  return procs


def print_plan(a, procs: list[dict], root: str) -> None:
  """The dry run's output: the problems, the processes and their
  environments, and the time a GPU run should take."""
  from wavetune_jax.runtime import selector
  print("first-use cost: plan (dry run, nothing is timed)")
  note = "" if a.policy in selector.POLICIES else (
      f"  (not a policy of this wavetune_jax: {', '.join(selector.POLICIES)}; a run stops)")
  print(f"policy of the wavetune processes: {a.policy}{note}")
  have = hasattr(selector, "refinement_stats")
  print(f"selector.refinement_stats: {'present' if have else 'missing (its columns read None)'}")
  print("XLA's autotuner: its default level (--xla_gpu_autotune_level is dropped from XLA_FLAGS)")
  print(f"kernel cache of the wavetune processes: {'on' if a.kernel_cache else 'off'}")
  print(f"work folder: {root}")
  print(f"\nproblems (new: not in the {a.device_key} table the ops read):")
  for family in a.families:
    known = shipped_problems(family, a.device_key)
    for fields in a.problems[family]:
      p = problem_of(family, fields)
      new = "no table" if known is None else ("new" if p not in known else "IN THE TABLE")
      print(f"  {family:<10} {describe(fields):<58} {new}")
  print(f"\nprocesses ({len(procs)}, one after another, each a fresh Python, at most "
        f"{a.timeout} s each and {a.budget} s in all):")
  for i, p in enumerate(procs, 1):
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in p["env"].items())
    print(f"  {i:2}. {p['family']:<10} {p['lib']:<3} process {p['stage']} "
          f"({'empty caches' if p['stage'] == 1 else 'the caches process 1 filled'})")
    print(f"      {env} {shlex.join(p['argv'][1:])}")
  n = sum(len(a.problems[f]) for f in a.families)
  print(f"\nexpected on an H100: about {len(procs) * _START_S + n * 30} s "
        f"({len(procs)} process starts, {n} problems)")


def _run_one(p: dict, base_env: dict, timeout: float) -> dict:
  """One worker process: its result, or ``{"error": ...}``."""
  t0 = time.perf_counter()
  try:
    out = subprocess.run(p["argv"], env=dict(base_env, **p["env"]), capture_output=True,
                         text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return {"error": f"past {round(timeout, 1):g} s", "process_s": time.perf_counter() - t0}
  wall = time.perf_counter() - t0
  lines = [x for x in out.stdout.splitlines() if x.startswith(MARK)]
  if out.returncode != 0 or not lines:
    tail = (out.stderr.strip().splitlines() or ["(no output)"])[-1]
    return {"error": f"exit status {out.returncode}: {tail}", "process_s": wall,
            "stderr_tail": out.stderr[-4000:]}
  r = json.loads(lines[-1][len(MARK):])
  r["process_s"] = wall
  return r


# --- the worker ----------------------------------------------------------------------------


def make(family: str, lib: str, fields: dict):
  """``(fn, args, problem)`` of one op on one problem: the arrays (on the
  default device), the op of ``lib``, and the problem the wavetune op
  derives from the arrays."""
  import jax
  import jax.numpy as jnp
  import wavetune_jax as wt
  f = dict(DEFAULTS.get(family, {}), **fields)
  if family == "decode":
    b, kv, d = f["batch"], f["kv_len"], f["head_dim"]
    key = jax.random.PRNGKey(0)
    q = jax.random.normal(key, (b, 1, f["q_heads"], d), jnp.bfloat16)
    k = jax.random.normal(key, (b, kv, f["kv_heads"], d), jnp.bfloat16)
    # Lengths spread over the cache, as a batch of sequences at different points.
    n = jnp.maximum(1, (jnp.arange(1, b + 1, dtype=jnp.int32) * kv) // b)
    args = (q, k, k, n)
    if lib == "xla":
      from wavetune_jax.models import library_attention_impl
      fn = lambda q, k, v, n: jax.nn.dot_product_attention(  # noqa: E731
          q, k, v, key_value_seq_lengths=n, implementation=library_attention_impl(q))
    else:
      fn = lambda q, k, v, n: wt.decode_attention(q, k, v, kv_lengths=n)  # noqa: E731
    return fn, args, wt.DECODE.bind(q, k, k, kv_lengths=n).problem
  # The other three are compile_cost.py's ops (the same user code, the same arrays).
  sys.path.insert(0, HERE)
  import compile_cost
  if family == "matmul":
    fn, args = compile_cost._make("gemm", lib, dict(m=f["m"], n=f["n"], k=f["k"]))
    return fn, args, wt.MATMUL.bind(*args).problem
  if family == "attention":
    fn, args = compile_cost._make("attention", lib, dict(
        b=f["batch"], s=f["q_len"], hq=f["q_heads"], hkv=f["kv_heads"], d=f["head_dim"]))
    return fn, args, wt.ATTENTION.bind(*args, causal=True).problem
  fn, args = compile_cost._make("grouped", lib, dict(m=f["m"], g=f["g"], k=f["k"], n=f["n"]))
  return fn, args, wt.RAGGED_DOT.bind(*args).problem


def refinement_stats() -> dict | None:
  """``selector.refinement_stats()`` (``measured``, ``seconds``, ``reused``,
  ...), or None where this wavetune_jax has none."""
  from wavetune_jax.runtime import selector
  f = getattr(selector, "refinement_stats", None)
  if f is None:
    return None
  return dict(f())


def stats_delta(before: dict | None, after: dict | None) -> dict | None:
  """``after - before`` per key (None where either is not a number); a dict
  of numbers (refinement's seconds by measuring phase) per its keys, a key
  ``before`` lacks counting from 0."""
  if before is None or after is None:
    return None
  num = (int, float)
  out = {}
  for k, v in after.items():
    b = before.get(k)
    if isinstance(v, num) and isinstance(b, num):
      out[k] = v - b
    elif isinstance(v, dict) and isinstance(b, dict):
      out[k] = {kk: vv - b.get(kk, 0) for kk, vv in v.items() if isinstance(vv, num)}
    else:
      out[k] = None
  return out


def _cache_events():
  """A counter of JAX's persistent-cache events (hits, and misses = entries
  written), fed from ``jax.monitoring``."""
  import collections
  import jax
  events = collections.Counter()

  def listen(name, **_):
    if name.startswith("/jax/compilation_cache/cache_"):
      events[name.rsplit("_", 1)[-1]] += 1
  jax.monitoring.register_event_listener(listen)
  return events


def worker(a) -> None:
  """One process: every problem of one family, with one library."""
  import jax
  import jax.numpy as jnp
  from wavetune_jax.tuning.profiler import enable_persistent_cache
  enable_persistent_cache(a.jax_cache)
  events = _cache_events()
  import wavetune_jax as wt
  from wavetune_jax.core import kernel_cache
  from wavetune_jax.runtime import selector, table_cache
  family = a.families[0]
  if a.lib == "wt":
    wt.set_policy(a.policy)
    apply_patches(a.patches)
  # JAX's backend and compile path start here, untimed.
  jax.block_until_ready(jax.jit(lambda x: x + 1)(jnp.zeros(8, jnp.float32)))
  rows = []
  for nth, fields in enumerate(json.loads(a.problems_json)):
    fn, args, problem = make(family, a.lib, fields)
    jax.block_until_ready(args)
    ev0 = dict(events)
    r0, d0 = refinement_stats(), selector.decision_stats()
    jf = jax.jit(fn)
    t = [time.perf_counter()]
    traced = jf.trace(*args); t.append(time.perf_counter())  # noqa: E702
    lowered = traced.lower(); t.append(time.perf_counter())  # noqa: E702
    exe = lowered.compile(); t.append(time.perf_counter())  # noqa: E702
    jax.block_until_ready(exe(*args)); t.append(time.perf_counter())  # noqa: E702
    r1, d1 = refinement_stats(), selector.decision_stats()
    ph = [b - a_ for a_, b in zip(t, t[1:])]
    row = dict(family=family, lib=a.lib, stage=a.stage, nth=nth, problem=fields,
               trace_s=ph[0], lower_s=ph[1], compile_s=ph[2], first_s=ph[3], total_s=sum(ph),
               jax_cache={k: events.get(k, 0) - ev0.get(k, 0) for k in ("hits", "misses")})
    if a.lib == "wt":
      sel = wt.select(family, problem)  # the decision the trace made (memoized)
      row.update(refine=stats_delta(r0, r1), decisions=d1[0] - d0[0],
                 decide_s=d1[1] - d0[1], backend=wt.get_family(family).backend_of(
                     sel.config).name, config=str(sel.config), source=sel.source,
                 predicted_us=None if sel.predicted_us is None else float(sel.predicted_us),
                 note=str(sel.note))
      # The selection alone, under a fresh memo (a context policy is a state
      # of its own): the stored decision read back, no trace, no compile.
      with selector.policy(a.policy):
        r2, d2 = refinement_stats(), selector.decision_stats()
        t0 = time.perf_counter()
        wt.select(family, problem)
        dt = time.perf_counter() - t0
        r3, d3 = refinement_stats(), selector.decision_stats()
      row.update(select_us=1e6 * dt, select_decisions=d3[0] - d2[0],
                 select_refine=stats_delta(r2, r3), kernel_cache=kernel_cache.stats(),
                 table_cache=table_cache.stats())
    rows.append(row)
  dev = jax.devices()[0]
  print(MARK + json.dumps({"device": dev.device_kind, "platform": dev.platform,
                           "jax": jax.__version__, "family": family, "lib": a.lib,
                           "stage": a.stage, "policy": a.policy if a.lib == "wt" else None,
                           "refinement_stats": refinement_stats() is not None,
                           "rows": rows}), flush=True)


# --- the report ----------------------------------------------------------------------------


def summarize(runs: list[dict]) -> list[dict]:
  """One row per (family, problem) from the four processes' results
  (``runs``, as the run records them: family, lib, stage, the problems
  asked, and rows or an error): seconds, the measuring inside wavetune's
  first use, what process 2 measured (must be 0) and its selection time. A
  process that failed leaves its columns None and its error in ``errors``."""
  by = {(r["family"], r["lib"], r["stage"]): r for r in runs}
  out = []
  for r in runs:
    if (r["lib"], r["stage"]) != ("xla", 1):
      continue
    fam, asked = r["family"], r.get("problems") or []
    n = max([len(asked)] + [len(by.get((fam, lib, st), {}).get("rows", []))
                            for lib in LIBS for st in (1, 2)])
    for i in range(n):
      cell = {}
      for lib in LIBS:
        for st in (1, 2):
          rows = by.get((fam, lib, st), {}).get("rows", [])
          cell[lib, st] = rows[i] if i < len(rows) else None
      wt1, wt2 = cell["wt", 1], cell["wt", 2]
      fields = next((c["problem"] for c in cell.values() if c is not None),
                    asked[i] if i < len(asked) else {})

      def get(c, k, sub=None):
        if c is None or c.get(k) is None:
          return None
        return c[k] if sub is None else c[k].get(sub)
      measured2 = get(wt2, "refine", "measured")
      out.append(dict(
          family=fam, problem=fields,
          wt_first_s=get(wt1, "total_s"), wt_measure_s=get(wt1, "refine", "seconds"),
          wt_measure_phases=get(wt1, "refine", "phases"),
          wt_measured_1=get(wt1, "refine", "measured"),
          xla_first_s=get(cell["xla", 1], "total_s"),
          wt_second_s=get(wt2, "total_s"), xla_second_s=get(cell["xla", 2], "total_s"),
          measured_2=measured2, reused_2=get(wt2, "refine", "reused"),
          select_us_2=get(wt2, "select_us"), backend=get(wt1, "backend"),
          xla_cache_hits_2=get(cell["xla", 2], "jax_cache", "hits"),
          ok=measured2 in (0, None) and all(c is not None for c in cell.values()),
          errors=[f"{lib} process {st}: {by[fam, lib, st]['error']}"
                  for lib in LIBS for st in (1, 2) if by.get((fam, lib, st), {}).get("error")]))
  return out


def _s(v, fmt="{:.2f}") -> str:
  return "-" if v is None else fmt.format(v)


def format_table(summary: list[dict]) -> str:
  """The summary as a text table (seconds; the selection in microseconds)."""
  head = (f"{'family':<10} {'problem':<46} {'wt first use s [measure s]':>26} "
          f"{'XLA autotuned s':>15} {'wt 2nd process s':>16} {'XLA cached s':>12} "
          f"{'measured in 2':>13} {'select us':>9} {'chosen':>7}")
  lines = [head, "-" * len(head)]
  for x in summary:
    first = f"{_s(x['wt_first_s'])} [{_s(x['wt_measure_s'])}]"
    m2 = _s(x["measured_2"], "{}") + ("" if x["measured_2"] in (0, None) else " FAIL")
    lines.append(f"{x['family']:<10} {describe(x['problem']):<46} {first:>26} "
                 f"{_s(x['xla_first_s']):>15} {_s(x['wt_second_s']):>16} "
                 f"{_s(x['xla_second_s']):>12} {m2:>13} {_s(x['select_us_2'], '{:.0f}'):>9} "
                 f"{x['backend'] or '-':>7}")
    phases = x.get("wt_measure_phases")
    if phases:
      lines.append("  wt first use's measuring: " + ", ".join(
          f"{k.replace('_', ' ')} {v:.2f} s" for k, v in phases.items()))
    lines += [f"  failed: {e}" for e in x["errors"]]
  return "\n".join(lines)


# --- main ----------------------------------------------------------------------------------


def parse_args(argv=None):
  ap = _Parser(description=__doc__.splitlines()[0])
  ap.add_argument("--families", default=",".join(FAMILIES),
                  help=f"comma-separated among {','.join(FAMILIES)} (default: all)")
  ap.add_argument("--problem", action="append", default=[], metavar="FAMILY:FIELD=N,...",
                  help="a new problem (repeatable; replaces the family's default problem), "
                       "e.g. matmul:m=1100,n=5120,k=3584, attention:q_len=1100,q_heads=28,"
                       "kv_heads=4, decode:batch=12,kv_len=5000,q_heads=28,kv_heads=4, "
                       "ragged_dot:m=2200,g=8,k=4096,n=28672")
  ap.add_argument("--policy", default="refine",
                  help="selection policy of the wavetune processes (default: refine)")
  ap.add_argument("--json", metavar="PATH", help="write the processes' rows and the summary here")
  ap.add_argument("--set", action="append", default=[], metavar="module:NAME=value",
                  help="set a constant of wavetune's code in the wavetune processes "
                       "(repeatable), e.g. wavetune_jax.runtime.refine:KIT_THREADS=1")
  ap.add_argument("--no-kernel-cache", dest="kernel_cache", action="store_false",
                  help="lower wavetune's Pallas kernels in every process (kernel cache off)")
  ap.add_argument("--timeout", type=int, default=150, metavar="S",
                  help="limit per process, seconds (default: 150)")
  ap.add_argument("--budget", type=int, default=480, metavar="S",
                  help="limit for the whole run, seconds: processes past it are skipped "
                       "(default: 480)")
  ap.add_argument("--work-dir", metavar="DIR",
                  help="cache folders here, kept (default: a temporary folder, removed)")
  ap.add_argument("--device-key", default="nvidia_h100_80gb_hbm3",
                  help="whose shipped tables the dry run checks the problems against")
  ap.add_argument("--dry-run", action="store_true", help="print the plan, time nothing")
  ap.add_argument("--from-json", metavar="PATH", help="print the table of a recorded --json")
  ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
  ap.add_argument("--lib", choices=LIBS, help=argparse.SUPPRESS)
  ap.add_argument("--stage", type=int, choices=(1, 2), help=argparse.SUPPRESS)
  ap.add_argument("--jax-cache", help=argparse.SUPPRESS)
  ap.add_argument("--problems-json", help=argparse.SUPPRESS)
  a = ap.parse_args(argv)
  fams = [f for f in a.families.split(",") if f]
  bad = [f for f in fams if f not in FAMILIES]
  if bad or not fams:
    _fail(f"--families {a.families!r}: unknown {', '.join(map(repr, bad)) or 'empty'}; "
          f"choose from {','.join(FAMILIES)}")
  if len(set(fams)) != len(fams):
    _fail(f"--families {a.families!r}: a family given twice")
  a.families = fams
  try:
    a.patches = [parse_patch(text, "--set") for text in a.set]
  except ValueError as e:
    _fail(str(e))
  if a.timeout < 1:
    _fail(f"--timeout {a.timeout}: must be >= 1 second")
  if a.budget < 1:
    _fail(f"--budget {a.budget}: must be >= 1 second")
  if a.worker:
    return a
  given: dict = {}
  for text in a.problem:
    family, fields = parse_problem(text)
    if family not in fams:
      _fail(f"--problem {text!r}: {family} is not in --families")
    if fields in given.get(family, []):
      _fail(f"--problem {text!r}: given twice")
    given.setdefault(family, []).append(fields)
  a.problems = {f: given.get(f, DEFAULT_PROBLEMS[f]) for f in fams}
  return a


def main(argv=None) -> int:
  a = parse_args(argv)
  if a.worker:
    worker(a)
    return 0
  if a.from_json:
    try:
      with open(a.from_json) as f:
        rec = json.load(f)
      summary = summarize(rec["runs"])
    except (OSError, ValueError, KeyError, TypeError) as e:
      _fail(f"--from-json {a.from_json}: not a recorded run ({type(e).__name__}: {e})")
    print(format_table(summary))
    return 0
  base_env = dict(os.environ)
  # This process only plans and reads tables: JAX stays on the CPU here
  # (the workers get the environment as it was).
  os.environ["JAX_PLATFORMS"] = "cpu"
  from wavetune_jax.runtime import selector
  if a.dry_run:
    root = a.work_dir or os.path.join(tempfile.gettempdir(), "first_use_cost-XXXXXX")
    print_plan(a, build_plan(a, root, base_env), root)
    return 0
  if a.policy not in selector.POLICIES:
    _fail(f"--policy {a.policy!r}: this wavetune_jax's policies are "
          f"{', '.join(selector.POLICIES)}")
  with contextlib.ExitStack() as stack:
    if a.work_dir:
      root = os.path.abspath(a.work_dir)
      if os.path.exists(root) and os.listdir(root):
        _fail(f"--work-dir {a.work_dir}: not empty (process 1 needs empty caches)")
    else:
      root = stack.enter_context(tempfile.TemporaryDirectory(prefix="first_use_cost-"))
    procs = build_plan(a, root, base_env)
    runs = []
    t_all = time.perf_counter()
    for i, p in enumerate(procs, 1):
      # A process starts only with at least half a second of the budget left,
      # and is stopped when the budget ends.
      left = a.budget - (time.perf_counter() - t_all)
      if left < 0.5:
        r = {"error": f"skipped: past --budget {a.budget} s", "process_s": 0.0}
      else:
        r = _run_one(p, base_env, min(a.timeout, left))
        if left < a.timeout and r.get("error", "").startswith("past "):
          r["error"] = f"stopped at --budget {a.budget} s"
      r.update(family=p["family"], lib=p["lib"], stage=p["stage"], caches=p["caches"],
               problems=a.problems[p["family"]])
      runs.append(r)
      status = f"error: {r['error']}" if "error" in r else f"{r['device']}"
      print(f"[{i}/{len(procs)}] {p['family']} {p['lib']} process {p['stage']}: "
            f"{r['process_s']:.1f} s, {status}", flush=True)
  summary = summarize(runs)
  print()
  print(format_table(summary))
  dev = next((r["device"] for r in runs if "device" in r), None)
  print(f"\n{dev}, JAX {next((r['jax'] for r in runs if 'jax' in r), '?')}, policy "
        f"{a.policy}, kernel cache {'on' if a.kernel_cache else 'off'}, "
        f"{''.join(f'set {t}, ' for t in a.set)}"
        f"{time.perf_counter() - t_all:.0f} s in all")
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"policy": a.policy, "kernel_cache": a.kernel_cache, "set": a.set,
                 "problems": a.problems,
                 "runs": runs, "summary": summary}, f, indent=1)
    print(f"wrote {a.json}")
  bad = [x for x in summary if not x["ok"]]
  if bad:
    print(f"{len(bad)} problem(s) failed or measured again in process 2", file=sys.stderr)
  return 1 if bad or len(summary) == 0 else 0


if __name__ == "__main__":
  sys.exit(main())
