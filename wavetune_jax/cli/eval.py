"""``wavetune eval``: score config-selection policies against a sweep."""

from __future__ import annotations

import argparse
import json

from wavetune_jax.cli.common import (CliError, add_family_arg, at_least, existing_file,
                                     output_file, positive_int, pyplot)

__all__ = ["add_commands", "format_table"]


def format_table(results, facts) -> str:
  lines = [f"{facts['device_kind']}: {facts['train_problems']} training / "
           f"{facts['test_problems']} held-out problems (seed {facts['seed']}); "
           f"profiling budget {facts['budget']} measurements "
           f"({100 * facts['budget'] / max(1, facts['train_points']):.1f}% of the "
           f"training split's {facts['train_points']})", ""]
  base = facts.get("baseline_name", "XLA")
  lines.append(f"{'policy':<10} {'geomean':>8} {'min':>6} {'p10':>6} {'<=5%':>6} "
               f"{'miss':>4} {'meas.':>7} {'GPU s':>7} {'cold us':>9} {'memo us':>8} "
               f"{'vs ' + base:>9} {'min':>6} {'vs dflt*':>8}")
  for r in results:
    xla = f"{r.vs_xla_geomean:>9.3f}" if r.vs_xla_geomean else f"{'-':>9}"
    xla += f" {r.vs_xla_min:>6.3f}" if r.vs_xla_min else f" {'-':>6}"
    d = r.vs_default_where_differ
    xla += f" {d:>8.3f}" if d else f" {'-':>8}"
    lines.append(f"{r.policy:<10} {r.geomean:>8.3f} {r.minimum:>6.3f} {r.p10:>6.3f} "
                 f"{100 * r.within_5pct:>5.0f}% {r.misses:>4} {r.measurements:>7} "
                 f"{r.gpu_seconds:>7.0f} {r.decision_us_cold:>9.1f} "
                 f"{r.decision_us_memo:>8.2f} {xla}")
  for r in results:
    if r.recall:
      ks = " ".join(f"@{k} {v:.2f}" for k, v in r.recall.items())
      f = r.refined
      x = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731 (no platform rows)
      lines.append(f"{r.policy}: recall of the wave model {ks}; first-use refinement "
                   f"replayed (top {f['k']}, {f['candidates']:.1f} candidates measured): "
                   f"{f['geomean']:.3f} of the oracle, {x(f['vs_platform_geomean'])}x the "
                   f"platform op (min {x(f['vs_platform_min'])}, {f['below_097']} below "
                   f"0.97x); tables alone: {x(r.vs_platform_geomean)}x (min "
                   f"{x(r.vs_platform_min)}, {r.below_097} below 0.97x)")
  lines.append("")
  lines.append("efficiency = t_oracle / t_policy on held-out shapes; <=5%: share within 5% "
               "of the oracle; miss: held-out problems where the policy's config has no "
               "recorded time (scored at that problem's slowest); meas./GPU s: profiling "
               "the policy needed; cold/memo: median "
               f"decision time; vs {base} / min: geomean and slowest speed of the chosen "
               f"configs over {base}; "
               "vs dflt*: geomean speedup over the fixed default where the default is > 10% "
               "slower than the oracle; recall@k: share of held-out problems with a config "
               "within 2% of the oracle among the wave model's top k; the platform op is the "
               "fastest of the family's platform configs (decode: cuDNN or XLA)")
  return "\n".join(lines)


def _plot(results, path: str) -> None:
  plt = pyplot()
  keys = sorted(results[0].efficiency)
  fig, ax = plt.subplots(figsize=(max(8, 0.18 * len(keys)), 4.5))
  width = 0.8 / len(results)
  for i, r in enumerate(results):
    ax.bar([j + i * width for j in range(len(keys))], [r.efficiency[k] for k in keys],
           width, label=f"{r.policy} ({r.geomean:.3f})")
  ax.set_xticks([j + 0.4 for j in range(len(keys))])
  ax.set_xticklabels([k.split(":")[0] for k in keys], rotation=90, fontsize=6)
  ax.set_ylabel("t_oracle / t_policy")
  ax.set_ylim(0, 1.05)
  ax.legend(fontsize=7, ncol=len(results))
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)


def _eval(args) -> int:
  from wavetune_jax.tuning import evaluate
  if args.plot:
    pyplot()  # the error before the work
  ds = evaluate.load_dataset(args.sweep)
  if ds.family.name != args.family:
    raise CliError(f"{args.sweep} holds {ds.family.name!r} measurements, not {args.family!r}")
  unknown = sorted(set(args.policy.split(",")) - set(evaluate.POLICIES))
  if unknown:
    raise CliError(f"unknown policy {unknown}; policies are {sorted(evaluate.POLICIES)}")
  results, facts = evaluate.evaluate(
      ds, args.policy.split(","), seed=args.seed, budget=args.budget,
      wavetune={**model_options(args), "heuristic_margin": args.heuristic_margin})
  if args.json:
    print(json.dumps({"facts": facts, "results": [r.to_json() for r in results]}, indent=1))
  else:
    print(format_table(results, facts))
  if args.plot:
    _plot(results, args.plot)
  return 0


def parse_margin(s: str) -> float | None | str:
  """``--heuristic-margin``: ``spec``, ``none`` or a number >= 0."""
  if s in ("spec", "none"):
    return None if s == "none" else s
  return at_least(0.0)(s)


def add_margin_arg(ap: argparse.ArgumentParser) -> None:
  ap.add_argument("--heuristic-margin", type=parse_margin, default="spec",
                  help="selection guard: the model replaces the heuristic's config only "
                       "when it predicts a larger gain than this (spec: the family's "
                       "value; none: no guard; default: spec)")


def add_model_args(ap: argparse.ArgumentParser) -> None:
  """Options of the tables the wavetune tuner builds (``tune`` and ``eval``)."""
  from wavetune_jax.runtime import tables, wave_model
  ap.add_argument("--form", default="bilinear", choices=wave_model.FORMS,
                  help="wave model form (wavetune_jax/runtime/wave_model.py; default: "
                       "bilinear)")
  ap.add_argument("--distance-penalty", type=at_least(0.0),
                  default=tables.DEFAULT_DISTANCE_PENALTY,
                  help="penalty on predictions far from the anchors (0 turns it off; "
                       f"default: {tables.DEFAULT_DISTANCE_PENALTY})")
  ap.add_argument("--trust", type=at_least(1.0), default=tables.DEFAULT_TRUST,
                  help="trust region: a model answers within this factor of its "
                       f"anchors' G and L range (inf: everywhere; default: {tables.DEFAULT_TRUST})")
  ap.add_argument("--family-weight", type=at_least(0.0), default=0.0,
                  help="weight of the points of a variant's family (same macro tile) "
                       "in its fit (0: each variant alone)")


def model_options(args) -> dict:
  """The :func:`add_model_args` options as keyword arguments of the tuner."""
  return {"form": args.form, "distance_penalty": args.distance_penalty,
          "trust": args.trust, "family_weight": args.family_weight}


def add_commands(sub: argparse._SubParsersAction) -> None:
  ev = sub.add_parser(
      "eval", help="score config-selection policies on held-out shapes of a sweep",
      description="Replays policies against an exhaustive sweep: efficiency vs the "
      "oracle on held-out shapes, profiling cost, decision time, speed vs XLA.")
  add_family_arg(ev)
  ev.add_argument("--sweep", required=True, type=existing_file, help="a sweep file")
  ev.add_argument("--policy", default="default,heuristic,nearest,tree,gbdt,oracle",
                  help="comma-separated policies among default, heuristic, nearest, tree, "
                       "gbdt, wavetune, oracle (default: all but wavetune)")
  ev.add_argument("--seed", type=int, default=0, help="the held-out split (default: 0)")
  ev.add_argument("--budget", type=positive_int, default=None,
                  help="profiling budget in measurements (default: 3%% of training)")
  add_model_args(ev)
  add_margin_arg(ev)
  ev.add_argument("--json", action="store_true", help="print JSON instead of a table")
  ev.add_argument("--plot", type=output_file, help="PNG of efficiency per held-out shape")
  ev.set_defaults(func=_eval)
