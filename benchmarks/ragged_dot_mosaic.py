"""The grouped-GEMM backends side by side on one GPU: Mosaic (its space),
Triton (a few configs) and XLA's ``lax.ragged_dot``.

``--check`` first runs the Mosaic kernel on the edge cases of ragged rows
(empty experts, all rows in one expert, ``sum(group_sizes) < M`` with NaN in
the rows past the sum, M not a multiple of 8, 64 experts with most empty,
split-K, both work orders) and compares every row with the float32
reference, the tail rows with exact zeros.

Then, per problem, every config is checked against the float32 reference
before it is timed (CUPTI, L2 flushed, same process); prints the best time of
each backend, its ratio to XLA (x > 1: faster than XLA) and the best Mosaic
config. ``--skew`` also times the Mosaic space under a skewed router (a few hot
experts) and prints whether the best config changes and what keeping the
balanced-routing config costs there. ``--json`` writes every measurement.

    python3 benchmarks/ragged_dot_mosaic.py [--check [--check-only TEXT]]
        [--set quick|none] [--skew] [--json out.json]
    python3 benchmarks/ragged_dot_mosaic.py --summarize out.json [--device h100]   # CPU

``--summarize`` reads the rows of a run (no GPU): per problem XLA, the best
Mosaic config and the ratio, the geomean from 1,024 tokens, and the config
the Hopper heuristic picks, as a fraction of the best and against XLA.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from wavetune_jax import RAGGED_DOT, RaggedDotProblem
from wavetune_jax.core import hardware
from wavetune_jax.families.ragged_dot import MosaicRaggedDotConfig, routing
from wavetune_jax.shapes import load_suite
from wavetune_jax.tuning import evaluate, profiler

# (weight, tokens): every model of the suite at decode, mid and prefill sizes.
QUICK = [("mixtral_8x7b.w13", t) for t in (16, 64, 1024, 8192)] + \
        [("mixtral_8x7b.w2", t) for t in (64, 1024, 8192)] + \
        [("olmoe_1b_7b.w13", 4096), ("snowflake_arctic.w2", 1024),
         ("snowflake_arctic.w2", 64), ("dbrx.w13", 777), ("phi_3_5_moe.w2", 3000),
         ("llama4_scout.w13", 2048)]
SKEW = [("mixtral_8x7b.w13", 1024), ("olmoe_1b_7b.w13", 4096), ("snowflake_arctic.w2", 1024),
        ("dbrx.w13", 777)]
TRITON = [dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3),
          dict(block_m=16, block_n=128, block_k=64, num_warps=4, num_stages=3),
          dict(block_m=128, block_n=128, block_k=64, num_warps=8, num_stages=3)]


def problem(weights: dict, name: str, tokens: int) -> RaggedDotProblem:
  w = weights[name]
  return RaggedDotProblem(m=tokens * w["top_k"], g=w["E"], k=w["K"], n=w["N"])


def check_edges(only: str | None = None, stages_from: int = 0, item_ring: bool = False,
                pingpong: bool = False, delay: bool = False, cluster: bool = False,
                config: str | None = None) -> int:
  """Mosaic configs on ragged edge cases (those whose name holds ``only``,
  if given; the configs of at least ``stages_from`` stages), row by row;
  returns the failures. ``item_ring``: the 192-row tiles and the order-2
  configs (of at least ``stages_from`` stages) with one ring through a
  CTA's work items instead, on the full grid and on a grid of 7 CTAs (many
  items each); ``pingpong``: the ping-pong schedule (a whole tile per
  consumer warpgroup, alternate items) likewise; ``delay``: the ring's
  configs keep one wgmma in flight (``delay_release=1``); ``cluster``: 2-CTA
  clusters (``cluster_m=2``) in order 2 and 1, likewise; ``config``: only
  the runs whose name holds it (with ``item_ring``, among them 192 x 192
  at 4 stages)."""
  fam = RAGGED_DOT
  configs = [MosaicRaggedDotConfig(block_m=bm, block_n=bn, num_stages=ns, split_k=sk,
                                   grid_minor=gm)
             for bm, bn, sk, gm, ns in [
                 (64, 128, 1, 1, 3), (64, 256, 1, 0, 3), (128, 128, 1, 1, 3),
                 (128, 192, 1, 0, 3), (128, 256, 1, 1, 3), (256, 128, 1, 1, 3),
                 (128, 64, 2, 1, 3), (64, 128, 4, 1, 3),
                 # Order 2 (by expert), pipelined across work items (4 K steps
                 # of 64 over K = 256, a multiple of 4 and 2 stages) or not.
                 (128, 256, 1, 2, 3), (64, 256, 1, 2, 4), (128, 128, 2, 1, 2),
                 (128, 128, 1, 2, 2),
                 # The output staged a slice at a time: 2 slots (128 x 256,
                 # 4 stages) and 1 slot (256 x 128, 4 stages).
                 (128, 256, 1, 2, 4), (256, 128, 1, 2, 4), (128, 256, 1, 1, 4)]
             if ns >= stages_from]
  names = [f"{c.block_m}x{c.block_n}/s{c.num_stages}/k{c.split_k}/o{c.grid_minor}"
           for c in configs]
  runs = {nm: functools.partial(_build, c) for nm, c in zip(names, configs)}
  if item_ring:
    # The 192-row tiles (always on the ring), order 2 and 1, and split-K.
    ring = [MosaicRaggedDotConfig(block_m=192, block_n=bn, num_stages=ns, split_k=sk,
                                  grid_minor=gm)
            for bn, ns, sk, gm in [(192, 3, 1, 2), (128, 4, 1, 1), (192, 3, 2, 1)]
            # Offered to --check-config only: 192 x 192 at 4 stages (the
            # output staged a slice at a time).
            + ([(192, 4, 1, 2)] if config else [])]
    ring += [c for c in configs if c.grid_minor == 2 and c.num_stages >= stages_from]
    runs = {f"{c.block_m}x{c.block_n}/s{c.num_stages}/k{c.split_k}/o{c.grid_minor}/ring/"
            f"{'d1/' if delay else ''}{sms or 'all'}":
            functools.partial(_build_ring, c, sms, delay=int(delay))
            for c in ring for sms in (None, 7)}
  if pingpong:
    # Whole tiles of 128 x 128 and 64 x 256 a warpgroup, orders 1, 2 and 0,
    # split-K, and a ring deeper than the K steps.
    pp = [MosaicRaggedDotConfig(block_m=bm, block_n=bn, num_stages=ns, split_k=sk,
                                grid_minor=gm)
          for bm, bn, ns, sk, gm in [(128, 128, 4, 1, 1), (64, 256, 4, 1, 2),
                                     (128, 128, 3, 2, 0), (64, 128, 5, 1, 1)]]
    runs = {f"{c.block_m}x{c.block_n}/s{c.num_stages}/k{c.split_k}/o{c.grid_minor}/pp/"
            f"{sms or 'all'}": functools.partial(_build_ring, c, sms, pingpong=1)
            for c in pp for sms in (None, 7)}
  if cluster:
    # Two CTAs per task of 2 block_m rows, the weight multicast to both.
    cl = [MosaicRaggedDotConfig(block_m=bm, block_n=bn, num_stages=ns, grid_minor=gm)
          for bm, bn, ns, gm in [(128, 256, 3, 2), (64, 256, 4, 2), (128, 128, 4, 2),
                                 (128, 256, 4, 1)]]
    runs = {f"{c.block_m}x{c.block_n}/s{c.num_stages}/o{c.grid_minor}/cl2/{sms or 'all'}":
            functools.partial(_build_options, c, sms, dict(cluster_m=2))
            for c in cl for sms in (None, 14)}
  if config:
    runs = {nm: f for nm, f in runs.items() if config in nm}
  return check_cases(runs, only, "Mosaic configs")


def _build_options(c, num_sms, options, p, lhs, rhs, gs):
  from pallas_kernels.ragged_dot import mosaic as kernel
  o = kernel.MosaicRaggedDotOptions(**options)
  return jax.jit(lambda a, b, s: kernel.ragged_dot(a, b, s, config=c, options=o,
                                                   num_sms=num_sms))(lhs, rhs, gs)


def _build_ring(c, num_sms, p, lhs, rhs, gs, pingpong=0, delay=0):
  from pallas_kernels.ragged_dot import mosaic as kernel
  o = kernel.MosaicRaggedDotOptions(item_ring=1, pingpong=pingpong, delay_release=delay)
  return jax.jit(lambda a, b, s: kernel.ragged_dot(a, b, s, config=c, options=o,
                                                   num_sms=num_sms))(lhs, rhs, gs)


def _build(c, p, lhs, rhs, gs):
  return jax.jit(RAGGED_DOT.build(p, c))(lhs, rhs, gs)


def edge_cases() -> dict:
  """Ragged edge cases: name -> (M, group sizes)."""
  rng = np.random.default_rng(0)
  return {
      "empty experts": (1000, [0, 300, 0, 250, 0, 450, 0, 0]),
      "all rows in one expert": (512, [0, 0, 0, 512, 0, 0, 0, 0]),
      "sum < M, NaN past the sum": (1000, [100, 7, 0, 93, 200, 1, 0, 300]),
      "M = 1554 (not a multiple of 8)": (1554, [200, 300, 54, 0, 400, 100, 300, 200]),
      "M = 5": (5, [1, 0, 2, 0, 0, 1, 0, 1]),
      "64 experts, most empty": (640, list(rng.multinomial(640, np.r_[np.ones(6), np.full(58, 1e-3)] / (6 + 0.058)))),
  }


def check_cases(runs: dict, only: str | None = None, what: str = "runs", k: int = 256,
                n: int = 512, quantize=None) -> int:
  """Each of ``runs`` (name -> ``f(problem, lhs, rhs, group_sizes)``) on the
  :func:`edge_cases` (those whose name holds ``only``), every row against
  the float32 reference (zeros past the groups); returns the failures.
  ``quantize(rhs) -> (w, scales [G, N])``: the runs get ``(w, scales)`` as
  ``rhs``, and the reference is computed on ``w * scales``."""
  fails = 0
  print(f"edge cases ({what} vs float32 reference, every row):", flush=True)
  for name, (m, sizes) in edge_cases().items():
    if only and only not in name:
      continue
    g = len(sizes)
    kx, kw = jax.random.split(jax.random.PRNGKey(1))
    lhs = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    rhs = (jax.random.normal(kw, (g, k, n), jnp.float32) / 16).astype(jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    total = min(int(np.sum(sizes)), m)
    if total < m:
      lhs = lhs.at[total:].set(jnp.nan)
    rhs32 = rhs.astype(jnp.float32)
    if quantize is not None:
      rhs = quantize(rhs)
      rhs32 = rhs[0].astype(jnp.float32) * rhs[1][:, None, :]
    ref = np.array(jax.lax.ragged_dot(lhs.astype(jnp.float32), rhs32, gs,
                                        precision=jax.lax.Precision.HIGHEST))
    ref[total:] = 0.0
    p = RaggedDotProblem(m=m, g=g, k=k, n=n)
    bad = []
    for nm, f in runs.items():
      try:
        out = np.asarray(f(p, lhs, rhs, gs).astype(jnp.float32))
      except Exception as e:  # noqa: BLE001
        bad.append(f"{nm}: {type(e).__name__} {str(e)[:200]}")
        continue
      row_err = np.abs(out - ref).max(axis=1) / (np.abs(ref).max() + 1e-9)
      wrong = np.nonzero(~(row_err <= 2e-2))[0]
      tail_ok = total == m or np.all(out[total:] == 0.0)
      if len(wrong) or not tail_ok:
        bad.append(f"{nm}: {len(wrong)} wrong rows (first {wrong[:6].tolist()}), "
                   f"tail zeros {tail_ok}")
    fails += len(bad)
    print(f"  {name:<34} {len(runs) - len(bad)}/{len(runs)} right", flush=True)
    for b in bad:
      print(f"      {b}", flush=True)
  return fails


def measure(fam, p, cands, prof):
  args = fam.inputs(p, jax.random.PRNGKey(0))
  ref = fam.reference(p, *args)
  fns = [fam.build(p, c) for c in cands]
  return prof.measure_many(fns, args, reference=ref, tolerance=fam.tolerance(p),
                           out_bytes=ref.size * 4)


def summarize(path: str, device: str = "h100") -> dict:
  """Prints and returns the summary of a ``--json`` file (module doc)."""
  from wavetune_jax import get_hardware
  with open(path) as f:
    rows = json.load(f)["rows"]
  hw = get_hardware(device)
  by: dict = {}
  for r in rows:
    if r["status"] == "ok":
      by.setdefault((r["weight"], r["tokens"], r["problem"]), {})[
          json.dumps(r["config"], sort_keys=True)] = r["us"]
  fam = RAGGED_DOT
  out = {"speedup": {}, "heuristic_of_best": {}, "heuristic_vs_xla": {}}
  print(f"{'weight':<24}{'tokens':>7}{'xla us':>10}{'mosaic':>10}{'speedup':>9}"
        f"{'heur/best':>10}{'heur/xla':>9}  best mosaic config")
  for (w, t, key), times in by.items():
    x = times.get(json.dumps({"backend": "xla"}))
    mos = {c: us for c, us in times.items() if json.loads(c)["backend"] == "mosaic"}
    if x is None or not mos:
      continue
    best_c = min(mos, key=mos.get)
    m, g, k, n = (int(v) for v in key.split(":")[0].split("x"))
    h = fam.heuristic(RaggedDotProblem(m=m, g=g, k=k, n=n), hw)
    t_h = times.get(json.dumps(fam.config_to_dict(h), sort_keys=True), math.nan)
    best = min(times.values())
    out["speedup"][(w, t)] = x / mos[best_c]
    if t_h == t_h:  # the rule's config was in the run
      out["heuristic_of_best"][(w, t)] = best / t_h
      out["heuristic_vs_xla"][(w, t)] = x / t_h
    c = json.loads(best_c)
    print(f"{w:<24}{t:>7}{x:10.1f}{mos[best_c]:10.1f}{x / mos[best_c]:9.2f}"
          f"{best / t_h:10.2f}{x / t_h:9.2f}  {c['block_m']}x{c['block_n']} "
          f"s{c['num_stages']} k{c['split_k']} o{c['grid_minor']}")
  big = [v for (w, t), v in out["speedup"].items() if t >= 1024]
  hb = list(out["heuristic_of_best"].values())
  print(f"best Mosaic vs lax.ragged_dot from 1,024 tokens: {min(big):.2f}-{max(big):.2f}x, "
        f"geomean {evaluate._geomean(big):.2f}x over {len(big)}")
  missing = len(out["speedup"]) - len(hb)
  if hb:
    print(f"heuristic: within 5% of the best on {sum(v >= 0.95 for v in hb)} of {len(hb)}, "
          f"min {min(hb):.2f}, geomean {evaluate._geomean(hb):.3f}; vs XLA min "
          f"{min(out['heuristic_vs_xla'].values()):.2f}x"
          + (f" ({missing} problems whose rule config the run did not time)" if missing else ""))
  return out


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--summarize", metavar="JSON", help="summarize a run's rows (CPU)")
  ap.add_argument("--device", default="h100", help="GPU preset of --summarize's heuristic")
  ap.add_argument("--check", action="store_true", help="the ragged edge cases first")
  ap.add_argument("--check-only", default=None, metavar="TEXT",
                  help="with --check: only the cases whose name holds TEXT")
  ap.add_argument("--check-stages-from", type=int, default=0, metavar="S",
                  help="check only the configs of at least S stages")
  ap.add_argument("--check-item-ring", action="store_true",
                  help="--check runs the 192-row tiles and the order-2 configs with "
                       "item_ring=1 instead (all SMs, and 7 CTAs)")
  ap.add_argument("--check-ring-delay", action="store_true",
                  help="--check-item-ring with the ring keeping one wgmma in flight "
                       "(delay_release=1)")
  ap.add_argument("--check-config", default=None, metavar="TEXT",
                  help="with --check: only the configs whose name holds TEXT (with "
                       "--check-item-ring also 192x192/s4, 4 stages)")
  ap.add_argument("--check-cluster", action="store_true",
                  help="--check runs 2-CTA clusters (cluster_m=2) in orders 2 and 1 "
                       "instead (all SMs, and 7 clusters)")
  ap.add_argument("--check-pingpong", action="store_true",
                  help="--check runs ping-pong configs (pingpong=1: a whole tile per "
                       "consumer warpgroup) instead (all SMs, and 7 CTAs)")
  ap.add_argument("--set", choices=("quick", "none"), default="quick")
  ap.add_argument("--skew", action="store_true", help="also a skewed router (see doc)")
  ap.add_argument("--iterations", type=int, default=10)
  ap.add_argument("--json", default=None)
  a = ap.parse_args()
  if a.summarize:
    summarize(a.summarize, a.device)
    return
  if sum((a.check_item_ring or a.check_ring_delay, a.check_pingpong, a.check_cluster)) > 1:
    ap.error("--check-item-ring (or --check-ring-delay), --check-pingpong and "
             "--check-cluster run different config lists: give one")
  a.check_item_ring = a.check_item_ring or a.check_ring_delay
  dev = jax.devices()[0]
  print(dev.device_kind, jax.__version__, flush=True)
  hw = hardware.detect()
  weights = load_suite("train")["grouped_gemm"]["weights"]
  fam = RAGGED_DOT
  out = {"device_kind": dev.device_kind, "jax": jax.__version__, "rows": [], "skew": []}
  if a.check:
    out["edge_failures"] = check_edges(a.check_only, a.check_stages_from, a.check_item_ring,
                                       a.check_pingpong, a.check_ring_delay,
                                       a.check_cluster, a.check_config)
  prof = profiler.Profiler(iterations=a.iterations)
  mosaic, triton, xla = (fam.backend(n) for n in ("mosaic", "triton", "xla"))

  def dump():  # after every problem: a killed run keeps what it measured
    if a.json:
      with open(a.json, "w") as f:
        json.dump(out, f)

  ratios = []
  t0 = time.time()
  if a.set == "quick":
    print(f"{'problem':<30}{'rows':>7}{'xla us':>10}{'mosaic':>10}{'triton':>10}{'mos/xla':>9}"
          f"{'tri/xla':>9}  best mosaic config (TFLOP/s) [ok/bad]", flush=True)
  for name, tokens in (QUICK if a.set == "quick" else []):
    p = problem(weights, name, tokens)
    tri = [triton.config_cls(**t) for t in TRITON] if triton.space(p, hw) else []
    cands = list(mosaic.space(p, hw)) + tri + [xla.space(p, hw)[0]]
    res = measure(fam, p, cands, prof)
    best, nbad, first = {}, 0, None
    for c, r in zip(cands, res):
      b = fam.backend_of(c).name
      out["rows"].append({"weight": name, "tokens": tokens, "problem": fam.problem_key(p),
                          "config": fam.config_to_dict(c), "status": r.status,
                          "us": r.median_us, "rel_error": r.rel_error,
                          "error": (r.error or "")[:300]})
      if r.status != "ok":
        nbad += b == "mosaic"
        first = first or f"{c}: {r.status} {(r.error or '')[:300]}"
      elif b not in best or r.median_us < best[b][0]:
        best[b] = (r.median_us, c)
    x = best.get("xla", (math.nan,))[0]
    tm, tt = best.get("mosaic", (math.nan, None)), best.get("triton", (math.nan, None))
    rm, rt = x / tm[0], x / tt[0]
    if rm == rm:
      ratios.append(max(rm, rt) if rt == rt else rm)
    c = tm[1]
    cs = f"{c.block_m}x{c.block_n} s{c.num_stages} k{c.split_k} o{c.grid_minor}" if c else "-"
    tf = p.flops / (tm[0] * 1e-6) / 1e12 if tm[0] == tm[0] else math.nan
    n_ok = sum(1 for cc, r in zip(cands, res) if fam.backend_of(cc).name == "mosaic"
               and r.status == "ok")
    print(f"{name:<24}{tokens:>6}{p.m:>7}{x:10.1f}{tm[0]:10.1f}{tt[0]:10.1f}{rm:9.2f}{rt:9.2f}"
          f"  {cs} ({tf:.0f}) [{n_ok}/{nbad}]", flush=True)
    if first:
      print(f"    first failure: {first}", flush=True)
    dump()
  if ratios:
    big = [r for (n_, t), r in zip(QUICK, ratios) if t >= 1024]
    print(f"elapsed {time.time() - t0:.0f} s; best Pallas vs lax.ragged_dot: geomean "
          f"{evaluate._geomean(ratios):.2f}x (min {min(ratios):.2f}) over {len(ratios)}; "
          f"at >= 1024 tokens {evaluate._geomean(big):.2f}x over {len(big)}", flush=True)
  if a.skew:
    print("router skew: best Mosaic config under balanced and skewed routing", flush=True)
    skewed = fam.with_routing(routing.SKEWED)
    for name, tokens in SKEW:
      p = problem(weights, name, tokens)
      cands = list(mosaic.space(p, hw)) + [xla.space(p, hw)[0]]
      tb = [r.median_us if r.status == "ok" else math.inf for r in measure(fam, p, cands, prof)]
      ts = [r.median_us if r.status == "ok" else math.inf
            for r in measure(skewed, p, cands, prof)]
      ib, is_ = int(np.argmin(tb[:-1])), int(np.argmin(ts[:-1]))
      cost = ts[is_] / ts[ib]
      out["skew"].append({"weight": name, "tokens": tokens, "balanced_us": tb, "skewed_us": ts,
                          "configs": [fam.config_to_dict(c) for c in cands]})
      print(f"  {name:<24}{tokens:>6}: balanced best {cands[ib]} {tb[ib]:.1f} us (xla "
            f"{tb[-1]:.1f}); skewed best {cands[is_]} {ts[is_]:.1f} us (xla {ts[-1]:.1f}); "
            f"balanced config under skew: {cost:.3f} of the skewed best", flush=True)
      dump()
  dump()


if __name__ == "__main__":
  main()
