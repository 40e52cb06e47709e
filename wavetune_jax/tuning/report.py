"""Summaries of a sweep file: per-problem oracle, baselines, spread, failures."""

from __future__ import annotations

import collections
import dataclasses
import math
import statistics
import warnings

from wavetune_jax.core import hardware
from wavetune_jax.core.registry import get_family
from wavetune_jax.tuning import sweep

__all__ = ["ProblemSummary", "summarize", "render", "hardware_of", "plot_waves"]


@dataclasses.dataclass
class ProblemSummary:
  problem: object
  n_configs: int
  n_failed: int
  oracle_config: object | None
  oracle_us: float | None
  baseline_us: float | None
  default_us: float | None
  heuristic_us: float | None
  worst_us: float | None
  rel_spread: float | None  # median over configs of IQR / median
  wall_s: float | None
  n_missing: int = 0  # configs of the spec's space with no row (sweep cut short)
  backend_us: dict = dataclasses.field(default_factory=dict)  # backend -> its best time
  # Other reference ops a sweep timed (``baseline_<name>`` rows: the grouped
  # GEMM's cuBLAS batched GEMM on the same rows, ...) -> their time.
  other_baselines_us: dict = dataclasses.field(default_factory=dict)


def hardware_of(header: dict) -> hardware.Hardware:
  """The hardware a sweep was recorded on (preset limits, recorded SM count)."""
  try:
    hw = hardware.get_hardware(header["device_key"])
  except ValueError:
    hw = hardware.PRESETS["h100"]
  return dataclasses.replace(hw, num_sms=int(header.get("num_sms", hw.num_sms)))


def summarize(header: dict, rows: list[dict]) -> tuple[list[ProblemSummary], dict]:
  """Per-problem summaries and run-level facts (failures, repeatability)."""
  spec = sweep.recorded_family(get_family(header["kernel"]), rows)
  hw = hardware_of(header)
  by_problem: dict[str, list[dict]] = collections.defaultdict(list)
  problems = {}
  for r in rows:
    p = spec.problem_from_dict(r["problem"])
    key = spec.problem_key(p)
    problems[key] = p
    by_problem[key].append(r)
  out = []
  repeat_diffs = []
  failures = collections.Counter()
  errors: dict[str, str] = {}
  for key, rs in by_problem.items():
    p = problems[key]
    pallas = [r for r in rs if r["impl"] == "pallas"]
    ok = [r for r in pallas if r["status"] == "ok"]
    for r in pallas:
      if r["status"] != "ok":
        failures[r["status"]] += 1
        errors.setdefault(r["status"], str(r.get("error", ""))[:200])
    times = {spec.config_from_dict(r["config"]): r["median_us"] for r in ok}
    base = [r["median_us"] for r in rs if r["impl"] == "baseline" and r["status"] == "ok"]
    oracle = min(times, key=times.get) if times else None
    for r in rs:
      if r["impl"] == "repeat" and r["status"] == "ok":
        try:
          c = spec.config_from_dict(r["config"])
        except ValueError:  # a repeat of a backend no measurement row has: nothing to compare
          continue
        if c in times:
          repeat_diffs.append(abs(r["median_us"] - times[c]) / times[c])
    walls = [r["wall_s"] for r in rs if r["impl"] == "timing"]
    seen = {spec.config_from_dict(r["config"]) for r in pallas}
    out.append(ProblemSummary(
        problem=p, n_configs=len(pallas), n_failed=len(pallas) - len(ok),
        oracle_config=oracle, oracle_us=times.get(oracle),
        baseline_us=base[0] if base else None,
        default_us=times.get(spec.default(p)),
        heuristic_us=times.get(_heuristic(spec, p, hw)),
        worst_us=max(times.values()) if times else None,
        rel_spread=statistics.median(r["spread_us"] / r["median_us"] for r in ok)
        if ok and all(r.get("spread_us") is not None for r in ok) else None,
        wall_s=sum(walls) if walls else None,
        n_missing=sum(c not in seen for c in sweep.swept_space(spec, p, hw)),
        backend_us=_best_by_backend(spec, times),
        other_baselines_us={r["impl"][len("baseline_"):]: r["median_us"] for r in rs
                            if r["impl"].startswith("baseline_") and r["status"] == "ok"}))
  facts = {"failures": dict(failures), "first_errors": errors,
           "repeat_median_rel_diff": statistics.median(repeat_diffs) if repeat_diffs else None,
           "repeat_pairs": len(repeat_diffs)}
  return out, facts


def _heuristic(spec, problem, hw):
  """The family's heuristic config, None where none of the backends the file
  measured has one for the problem."""
  try:
    return spec.heuristic(problem, hw)
  except ValueError:
    return None


def _best_by_backend(spec, times: dict) -> dict:
  best = {}
  for c, t in times.items():
    name = spec.backend_of(c).name
    best[name] = min(best.get(name, math.inf), t)
  return best


def _other_baselines(summaries, baseline_name: str) -> list[str]:
  """A line per other reference op the sweep timed (``baseline_<name>``
  rows): the oracle's speed over it, and over the faster of it and the
  platform op, geomean (min to max) over the problems with both."""
  lines = []
  for b in sorted({b for s in summaries for b in s.other_baselines_us}):
    with_b = [s for s in summaries if s.oracle_us and s.other_baselines_us.get(b)]
    over = [s.other_baselines_us[b] / s.oracle_us for s in with_b]
    if not over:  # (no problem with both: every config failed there)
      continue
    both = [min(s.other_baselines_us[b], s.baseline_us) / s.oracle_us for s in with_b
            if s.baseline_us]
    line = (f"oracle over baseline_{b}: {_geomean(over):.3f}x geomean ({min(over):.3f}x to "
            f"{max(over):.3f}x) over {len(over)} problems")
    if both:
      line += (f"; over the faster of it and {baseline_name}: {_geomean(both):.3f}x "
               f"({min(both):.3f}x to {max(both):.3f}x)")
    lines.append(line)
  return lines


def _geomean(xs):
  xs = [x for x in xs if x and x > 0 and math.isfinite(x)]
  return math.exp(sum(map(math.log, xs)) / len(xs)) if xs else float("nan")


def _cfg_str(c, spec=None) -> str:
  if c is None:
    return "-"
  values = "/".join(str(v) for v in dataclasses.asdict(c).values())
  return values if spec is None else f"{spec.backend_of(c).name}:{values}"


def _fields(spec) -> str:
  """``backend:field/field`` for each backend of ``spec``."""
  return ", ".join(f"{b.name}:{'/'.join(b.fields())}" for b in spec.backends)


def render(path: str, *, plot: str | None = None, on_truncated=None) -> str:
  """The report of a sweep file as text (and a PNG when ``plot`` is given).

  A file cut off at its end (a run killed mid-write) is reported up to the
  cut; ``on_truncated`` (default: :func:`warnings.warn`) is called with a
  one-line message saying so.
  """
  header, rows = sweep.read_sweep(path, check=True, on_truncated=on_truncated or (
      lambda msg: warnings.warn(msg, stacklevel=3)))
  rows = sweep.with_recorded_backends(get_family(header["kernel"]), hardware_of(header), rows)
  spec = sweep.recorded_family(get_family(header["kernel"]), rows)
  summaries, facts = summarize(header, rows)
  fields = _fields(spec)
  lines = [f"{path}: {header['kernel']} on {header['device_kind']} ({header['num_sms']} SMs), "
           f"jax {header['jax_version']}, {header['date']}",
           f"{len(summaries)} problems, {sum(s.n_configs for s in summaries)} config "
           f"measurements; config = {fields}", ""]
  lines.append(f"{'problem':<28} {'cfgs':>5} {'fail':>4} {'oracle config':<26} {'oracle':>9} "
               f"{spec.baseline_name:>9} {'default':>9} {'heur':>9} {'worst':>10} {'spread':>7} {'gpu s':>6}")

  def f(v, w=9, d=1):
    return f"{v:>{w}.{d}f}" if v is not None else f"{'-':>{w}}"

  for s in sorted(summaries, key=lambda s: spec.problem_key(s.problem)):
    n = f"{s.n_configs}*" if s.n_missing else str(s.n_configs)
    lines.append(f"{spec.problem_key(s.problem):<28} {n:>5} {s.n_failed:>4} "
                 f"{_cfg_str(s.oracle_config, spec):<26} {f(s.oracle_us)} {f(s.baseline_us)} "
                 f"{f(s.default_us)} {f(s.heuristic_us)} {f(s.worst_us, 10)} "
                 f"{f(100 * s.rel_spread if s.rel_spread is not None else None, 6)}% "
                 f"{f(s.wall_s, 6, 0)}")
  lines.append("")
  lines.append("times in microseconds (CUPTI median); spread = median over configs of IQR/median")
  partial = [s for s in summaries if s.n_missing]
  if partial:
    lines.append(f"* {len(partial)} problem(s) swept in part ({sum(s.n_missing for s in partial)} "
                 "configs missing) are left out of the geomeans; rerun the sweep to complete them")
  summaries = [s for s in summaries if not s.n_missing]
  vs_xla = _geomean([s.baseline_us / s.oracle_us for s in summaries
                     if s.oracle_us and s.baseline_us])
  vs_default = _geomean([s.default_us / s.oracle_us for s in summaries
                         if s.oracle_us and s.default_us])
  vs_heur = _geomean([s.heuristic_us / s.oracle_us for s in summaries
                      if s.oracle_us and s.heuristic_us])
  walls = [s.wall_s for s in summaries if s.wall_s is not None]
  names = sorted({b for s in summaries for b in s.backend_us})
  if len(names) > 1:
    for b in names:
      with_b = [s for s in summaries if b in s.backend_us]
      wins = sum(s.backend_us[b] == s.oracle_us for s in with_b)
      vs_base = _geomean([s.baseline_us / s.backend_us[b] for s in with_b if s.baseline_us])
      of_oracle = _geomean([s.oracle_us / s.backend_us[b] for s in with_b])
      lines.append(f"best {b} config: {vs_base:.3f}x {spec.baseline_name}, {of_oracle:.3f} of "
                   f"the oracle (geomean over {len(with_b)} problems), the oracle of {wins}")
  def x(v):  # a family with no default config (or no such times) has no geomean
    return "-" if math.isnan(v) else f"{v:.3f}x"

  lines.append(f"geomean speedup of the oracle: vs {spec.baseline_name} {x(vs_xla)}, "
               f"vs default {x(vs_default)}, vs heuristic {x(vs_heur)}")
  lines += _other_baselines(summaries, spec.baseline_name)
  if walls:
    lines.append(f"GPU seconds: {sum(walls):.0f} total, {statistics.median(walls):.1f} "
                 f"median per problem")
  if facts["repeat_median_rel_diff"] is not None:
    lines.append(f"repeatability: fastest config timed twice, median |diff| = "
                 f"{100 * facts['repeat_median_rel_diff']:.2f}% over "
                 f"{facts['repeat_pairs']} repeat pairs")
  lines.append(f"failed configs: {facts['failures'] or 'none'}")
  for status, err in facts["first_errors"].items():
    lines.append(f"  first {status}: {err}")
  if plot:
    plot_waves(header, summaries, rows, plot)
    lines.append(f"plot: {plot}")
  return "\n".join(lines)


def plot_waves(header: dict, summaries: list[ProblemSummary], rows: list[dict],
               path: str, max_configs: int = 4) -> None:
  """Latency vs M for a few configs of the weight with the most M values."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    raise ImportError('the plot needs matplotlib: pip install "wavetune-jax[report]"') from None
  spec = sweep.recorded_family(get_family(header["kernel"]), rows)
  size = spec.size_field
  groups = collections.defaultdict(list)
  for s in summaries:
    groups[spec.weight_of(s.problem)].append(s)
  weight, ss = max(groups.items(), key=lambda kv: len(kv[1]))
  ss.sort(key=lambda s: spec.size_of(s.problem))
  picks = [spec.default(ss[0].problem)]
  for s in ss[len(ss) // 3::max(1, len(ss) // 3)]:
    if s.oracle_config is not None and s.oracle_config not in picks:
      picks.append(s.oracle_config)
  picks = picks[:max_configs]
  times = collections.defaultdict(dict)
  base = []
  for r in rows:
    p = spec.problem_from_dict(r["problem"])
    if spec.weight_of(p) != weight or r["status"] != "ok":
      continue
    if r["impl"] == "pallas":
      times[spec.config_from_dict(r["config"])][spec.size_of(p)] = r["median_us"]
    elif r["impl"] == "baseline":
      base.append((spec.size_of(p), r["median_us"]))
  hw = hardware_of(header)
  fig, ax = plt.subplots(figsize=(9, 5))
  m_max = max(spec.size_of(s) for s in (x.problem for x in ss))
  m_cap = min(m_max, 4096)  # linear axes: the steps are visible up to a few waves
  for idx, c in enumerate(picks):
    pts = sorted((m, t) for m, t in times[c].items() if m <= m_cap)
    if not pts:
      continue
    line, = ax.plot([m for m, _ in pts], [t for _, t in pts], "o-", label=_cfg_str(c, spec))
    if idx == 0:
      # Wave boundaries of this config: G = k * num_SMs (one CTA per SM).
      # Wave boundaries of this config: sizes where G crosses k * num_SMs.
      proto = spec.problem_to_dict(ss[0].problem)
      waves_prev = None
      for m in range(1, m_cap + 1):
        g, _ = spec.coords(spec.problem_from_dict({**proto, size: m}), c)
        w = -(-g // hw.num_sms)
        if waves_prev is not None and w != waves_prev:
          ax.axvline(m - 0.5, color=line.get_color(), ls=":", lw=0.8)
        waves_prev = w
  base = sorted(b for b in base if b[0] <= m_cap)
  if base:
    ax.plot(*zip(*base), "k--", label=spec.baseline_name)
  ax.set_xlabel(f"{size} (tokens); dotted: wave boundaries of the first config")
  ax.set_ylabel("us (CUPTI median)")
  label = " ".join(f"{k}={v}" for k, v in weight if not isinstance(v, str))
  ax.set_title(f"{header['kernel']} {label} on {header['device_kind']} "
               f"({hw.num_sms} SMs)")
  ax.legend(fontsize=7, title=_fields(spec),
            title_fontsize=6)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
