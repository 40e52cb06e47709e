"""The grouped GEMM against what a well-built grouped GEMM gets: cuBLAS's
batched GEMM on the same rows per expert, where the time goes, and the
Mosaic kernel's schedule options.

Per problem ``G`` experts x ``r`` rows each (uniform routing: every expert
gets exactly ``r`` rows), ``K``, ``N``, on one GPU, CUPTI, L2 flushed, every
candidate checked against the float32 reference first:

* ``batched``: ``jnp.einsum("gmk,gkn->gmn")`` on ``[G, r, K] x [G, K, N]``
  (cuBLAS batched GEMM), and ``lax.ragged_dot`` (XLA's op on this JAX);
* ``wt``: ``wt.ragged_dot`` with the shipped tables (policy ``tables``) and
  its per-kernel breakdown (work list, main kernel, split-K reduction,
  padding);
* the Mosaic kernel at a set of tiles and both work orders (the schedule
  of the shipped tables), then, on the best two, the schedule options of
  :class:`pallas_kernels.ragged_dot.mosaic.MosaicRaggedDotOptions`: 2-CTA
  clusters with the weight multicast, one wgmma in flight, task bands;
* the row tasks, column tiles, waves and tail rows of the best config, and
  the time floors of its FLOPs (989 TFLOP/s) and bytes (HBM);
* ``--mode epilogue``: order 2 with the output tile staged whole, then a
  column slice at a time through 2 or 1 slots with the shared memory freed
  given to deeper rings;
* ``--mode ring``: order 2 on 128 x 256 (3 and 4 stages), 256 x 128 and
  64 x 256 tiles on Pallas's pipeline, 128 x 256 (3 stages) also with one
  TMA ring through all of a CTA's work items (``item_ring``), and the
  192-row tiles (192 x 192, 192 x 128: three consumer warpgroups, on that
  ring); with ``--ring-set pairs``, each of the four order-2 configs on
  both;
* ``--mode pingpong``: the two consumer warpgroups taking alternate work
  items, a whole 128 x 128 or 64 x 256 tile each (``pingpong``), against
  the same tiles split between them and the 128 x 256 tiles of the tables;
* ``--mode cluster``: order 2 (and 1) on 2-CTA clusters that run the two
  halves of a ``2 * block_m``-row task with the weight multicast to both
  (``cluster_m=2``), against the same configs on one CTA, at 256 rows per
  expert and more;
* ``--skew``: under a skewed router, the kernel against the batched GEMM
  padded to the largest group;
* ``--router balanced``: every candidate on a balanced router's group sizes
  (``routing.group_sizes``, skew 0: about ``r`` rows an expert, spread
  ``sqrt(r)``), the batched GEMM still on exactly ``r`` (the waves and
  tail statistics stay those of uniform routing).

    python3 benchmarks/ragged_dot_efficiency.py [--set issue|suite|all|quick|r192]
        [--mode rule|orders|options|epilogue|ring|pingpong|cluster]
        [--ring-set tall|pairs|delay|deep192|edge192] [--skew] [--router uniform|balanced]
        [--problems G,r,K,N ...]
        [--json out.json]
    python3 benchmarks/ragged_dot_efficiency.py --summarize out.json   # CPU

``--summarize`` reads a run's rows (no GPU) and prints, per problem, the
batched GEMM's TFLOP/s, the speed over it of the rule's config before and
after order 2 (``rule`` runs) or of the best config of each order
(``orders`` runs) or with and without each option (``options`` runs) or
the best sliced staging over the best whole one (``epilogue`` runs) or
each config with ``item_ring`` over the same without (``ring`` runs) or
the best ping-pong config over the best other and each over the same
tile split between the warpgroups (``pingpong`` runs), the
work list's share of the op's time, and under ``--skew`` each config
against the padded batched GEMM.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

import wavetune_jax as wt
from wavetune_jax.cli.common import positive_ints
from pallas_kernels.ragged_dot import mosaic as kernel
from pallas_kernels.ragged_dot import worklist
from pallas_kernels.ragged_dot.mosaic import MosaicRaggedDotConfig as Config
from pallas_kernels.ragged_dot.mosaic import MosaicRaggedDotOptions as Options
from pallas_kernels.ragged_dot.reference import ragged_dot_reference
from wavetune_jax.families.ragged_dot import routing
from wavetune_jax.tuning import profiler

# (experts, rows per expert, K, N): the rows where the kernel lagged the
# batched GEMM, and one decode-size one.
ISSUE = [(64, 375, 3584, 5120), (32, 375, 2880, 5760), (8, 512, 4096, 28672),
         (8, 2048, 4096, 28672), (128, 192, 2048, 1536), (64, 48, 3584, 5120)]
# The training suite's models at prefill sizes (tokens x top_k rows over the
# experts): Mixtral w2 at 4,096 tokens, DBRX w13 at 1,024, OLMoE w13 at 4,096
# and w2 at 1,024, Phi-3.5-MoE w2 at 3,000, Llama-4-Scout w2 at 2,048.
SUITE = [(8, 1024, 14336, 4096), (16, 256, 6144, 21504), (64, 512, 2048, 2048),
         (64, 128, 1024, 2048), (16, 375, 6400, 4096), (16, 128, 8192, 5120)]
QUICK = ISSUE[:1] + ISSUE[2:3]
# Around the 192-row tiles' edge (H200 rule, MosaicRaggedDot._triple): 172,
# 192 and 224 rows per expert of Qwen3-30B-A3B's w13 (3,072 tokens: 192), its
# w2, DeepSeek-V2-Lite's w13 and Mixtral's w13 at 192 rows.
R192 = [(128, 172, 2048, 1536), (128, 192, 2048, 1536), (128, 224, 2048, 1536),
        (128, 192, 768, 2048), (64, 192, 2048, 2816), (8, 192, 4096, 28672)]
SETS = {"issue": ISSUE, "suite": SUITE, "all": ISSUE + SUITE, "quick": QUICK, "r192": R192}
TILES = [(128, 256, 3), (256, 128, 3), (128, 128, 4), (128, 128, 6), (64, 256, 4)]
PEAK_TFLOPS = 989.0
HBM_TBS = {"h100": 3.35, "h200": 4.8}


def _gb(x):
  return x / 1e9


def problem_stats(g, r, k, n, c: Config, cm: int, hbm: float):
  """Tiles, waves and floors of one config at uniform routing."""
  m = g * r
  sizes = jnp.full((g,), r, jnp.int32)
  tasks, count = worklist.row_tasks(sizes, m, c.block_m * cm)
  count = int(count[0])
  t = np.asarray(tasks)[:, :count]
  valid = t[worklist.SIZE].sum()
  tiles_n = -(-n // c.block_n)
  work = count * tiles_n * c.split_k
  units = 132 // cm
  flops = 2.0 * m * n * k
  bytes_ = (m * k + g * k * n + m * n) * 2
  return {"tasks": count, "tiles_n": tiles_n, "work": work, "waves": work / units,
          "row_fill": valid / (count * c.block_m * cm),
          "flops_us": flops / (PEAK_TFLOPS * 1e6), "bytes_us": bytes_ / (hbm * 1e6)}


def main():
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--set", choices=tuple(SETS), default="issue")
  ap.add_argument("--mode", choices=("rule", "orders", "options", "epilogue", "ring",
                                     "pingpong", "cluster"),
                  default="rule",
                  help="rule: the Hopper rule's config before and after order 2, and "
                       "the three orders on its tile; orders: tiles x work orders (0, 1, "
                       "2) and tile pipelining; options: orders 0 and 1, then clusters, "
                       "wgmma delay and fixed task bands on the best two; epilogue: "
                       "order 2 with the output staged whole or a slice at a time "
                       "(out_slots), the freed shared memory given to deeper rings; "
                       "ring: order-2 configs with and without item_ring; pingpong: "
                       "whole tiles per consumer warpgroup, alternate items")
  ap.add_argument("--ring-set", choices=("tall", "pairs", "delay", "deep192", "edge192"), default="tall",
                  help="--mode ring's configs: tall (with the 192-row tiles), pairs (every "
                       "order-2 config with and without the ring) or delay (the ring's "
                       "128 x 256, 192 x 192 and 64 x 256 tiles with and without a wgmma in "
                       "flight) or "
                       "deep192 (the 192-row tiles at 3 to 5 stages) or edge192 (128 x 256 "
                       "on the pipeline, 192 x 192 and 192 x 128 on the ring)")
  ap.add_argument("--skew", action="store_true")
  ap.add_argument("--router", choices=("uniform", "balanced"), default="uniform",
                  help="the group sizes every candidate runs: uniform (each expert exactly r "
                       "rows) or a balanced router's (routing.group_sizes, skew 0; the "
                       "batched GEMM keeps r rows an expert)")
  ap.add_argument("--iterations", type=int, default=20)
  ap.add_argument("--only", default=None, help="comma-separated problem indices")
  ap.add_argument("--problems", nargs="+", metavar="G,r,K,N", type=positive_ints("G,r,K,N"),
                  help="problems (experts, rows per expert, K, N) instead of --set")
  ap.add_argument("--budget-s", type=float, default=math.inf,
                  help="start no new problem after this many seconds")
  ap.add_argument("--json", default=None)
  ap.add_argument("--summarize", metavar="JSON", help="summarize a run's rows (CPU)")
  a = ap.parse_args()
  if a.summarize:
    summarize(a.summarize)
    return
  probs = SETS[a.set]
  if a.problems and a.only:
    ap.error("--problems names the problems: drop --only")
  if a.only:
    try:
      idx = [int(i) for i in a.only.split(",")]
    except ValueError:
      idx = [-1]
    if any(not 0 <= i < len(probs) for i in idx):
      ap.error(f"--only takes indices 0-{len(probs) - 1} of --set {a.set}, got {a.only!r}")
    probs = [probs[i] for i in idx]
  if a.problems:
    probs = a.problems
  dev = jax.devices()[0]
  hw = wt.detect()
  hbm = HBM_TBS["h200" if "H200" in dev.device_kind else "h100"]
  print(dev.device_kind, jax.__version__, f"{dev.core_count} SMs", flush=True)
  prof = profiler.Profiler(iterations=a.iterations)
  from wavetune_jax.core import versions
  # XLA lowers lax.ragged_dot to cuDNN's grouped GEMM from cuDNN 9.22: the
  # run records which cuDNN its "lax.ragged_dot" column ran on.
  out = {"device_kind": dev.device_kind, "jax": jax.__version__, "mode": a.mode,
         "router": a.router, "versions": versions.current(), "rows": []}
  print("versions:", out["versions"], flush=True)

  def dump():
    if a.json:
      with open(a.json, "w") as f:
        json.dump(out, f, indent=1)

  summary = []
  start = time.time()
  for g, r, k, n in probs:
    if time.time() - start > a.budget_s:
      print(f"budget spent: G={g} r={r} K={k} N={n} not run", flush=True)
      continue
    t0 = time.time()
    m = g * r
    kx, kw = jax.random.split(jax.random.PRNGKey(0))
    lhs = jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16)
    rhs = (jax.random.normal(kw, (g, k, n), jnp.float32) / math.sqrt(k)).astype(jnp.bfloat16)
    sizes = (jnp.full((g,), r, jnp.int32) if a.router == "uniform"
             else routing.group_sizes(jax.random.PRNGKey(5), m, g, routing.BALANCED))
    ref = ragged_dot_reference(lhs, rhs, sizes, jnp.float32)
    flops = 2.0 * m * n * k
    tf = lambda us: flops / (us * 1e-6) / 1e12 if us == us else math.nan  # noqa: E731
    row = {"g": g, "r": r, "k": k, "n": n, "times": {}}
    if a.router != "uniform":
      row["max_group"] = int(jnp.max(sizes))

    def batched(lhs, rhs, sizes):
      return jnp.einsum("gmk,gkn->gmn", lhs.reshape(g, r, k), rhs).reshape(m, n)

    def lax_op(lhs, rhs, sizes):
      return jax.lax.ragged_dot(lhs, rhs, sizes)

    with wt.policy("tables"):
      chosen = wt.select("ragged_dot", wt.RaggedDotProblem(m=m, g=g, k=k, n=n), hw)
    wt_cfg = chosen.config

    def wt_op(lhs, rhs, sizes):
      return wt.ragged_dot(lhs, rhs, sizes, config=wt_cfg)

    names = ["lax.ragged_dot", "wt"]
    fns = [lax_op, wt_op]
    # The batched GEMM runs exactly r rows an expert, whatever the router.
    uniform = jnp.full((g,), r, jnp.int32)
    (row["times"]["batched"],) = map(_rec, prof.measure_many(
        [batched], (lhs, rhs, uniform), tolerance=2e-2, out_bytes=m * n * 4,
        reference=ref if a.router == "uniform"
        else ragged_dot_reference(lhs, rhs, uniform, jnp.float32)))
    cands = (_rule_candidates(g, r, k, n, hw) if a.mode == "rule"
             else _epilogue_candidates(g, r, k, n, hw) if a.mode == "epilogue"
             else _ring_candidates(g, r, k, n, hw, a.ring_set) if a.mode == "ring"
             else _pingpong_candidates(r, hw) if a.mode == "pingpong"
             else _cluster_candidates(r, hw) if a.mode == "cluster"
             else _candidates(g, r, k, n, hw, a.mode))
    names += [_name(c, o) for c, o in cands]
    fns += [_mosaic(c, o) for c, o in cands]
    res = prof.measure_many(fns, (lhs, rhs, sizes), reference=ref, tolerance=2e-2,
                            out_bytes=m * n * 4)
    for nm, mres in zip(names, res):
      row["times"][nm] = _rec(mres)
    base = {nm: v["us"] for nm, v in row["times"].items() if nm.startswith("mosaic")
            and v["status"] == "ok" and " cl1 d0 b0 p0" in nm and " o2 " not in nm}
    top = sorted(base, key=base.get)[:2]
    if a.mode == "options" and top:
      opt = _options_on(top)
      opt_names = [_name(c, o) for c, o in opt if _name(c, o) not in row["times"]]
      res = prof.measure_many([_mosaic(*_parse(nm)) for nm in opt_names], (lhs, rhs, sizes),
                              reference=ref, tolerance=2e-2, out_bytes=m * n * 4)
      for nm, mres in zip(opt_names, res):
        row["times"][nm] = _rec(mres)
    # Breakdowns: wt's choice and the best Mosaic run.
    allm = {nm: v["us"] for nm, v in row["times"].items()
            if nm.startswith("mosaic") and v["status"] == "ok"}
    best = min(allm, key=allm.get) if allm else None
    row["breakdown_wt"] = prof.kernel_breakdown(wt_op, (lhs, rhs, sizes))
    if best:
      bc, bo = _parse(best)
      row["breakdown_best"] = prof.kernel_breakdown(_mosaic(bc, bo), (lhs, rhs, sizes))
      row["best"] = best
      row["stats_best"] = problem_stats(g, r, k, n, bc, bo.cluster_m, hbm)
    if isinstance(wt_cfg, Config):
      row["stats_wt"] = problem_stats(g, r, k, n, wt_cfg, 1, hbm)
    row["wt_config"] = str(wt_cfg)
    if a.skew:
      sk = routing.group_sizes(jax.random.PRNGKey(3), m, g, routing.SKEWED)
      big = int(jnp.max(sk))
      xs = jax.random.normal(kx, (g, big, k), jnp.float32).astype(jnp.bfloat16)
      ref_s = ragged_dot_reference(lhs, rhs, sk, jnp.float32)
      padded = prof.measure_many([lambda x, w: jnp.einsum("gmk,gkn->gmn", x, w)], (xs, rhs))
      sk_names = ["wt"] + ([_name(c, o) for c, o in cands] if a.mode == "rule"
                           else [best] if best else [])
      sk_fns = [lambda l, w, s: wt.ragged_dot(l, w, s, config=wt_cfg)]
      sk_fns += [_mosaic(*_parse(nm)) for nm in sk_names[1:]]
      sres = prof.measure_many(sk_fns, (lhs, rhs, sk), reference=ref_s, tolerance=2e-2,
                               out_bytes=m * n * 4)
      row["skew"] = {"max_group": big, "padded_batched": _rec(padded[0]),
                     **{nm: _rec(x) for nm, x in zip(sk_names, sres)}}
    out["rows"].append(row)
    dump()
    tb = row["times"]["batched"]["us"]
    tw = row["times"]["wt"]["us"]
    tbest = allm.get(best, math.nan) if best else math.nan
    tbase = min(base.values()) if base else math.nan
    if a.mode == "orders" and best:
      # The best of each work order.
      for o in (0, 1, 2):
        ts = {nm: us for nm, us in allm.items() if f" o{o} " in nm}
        if ts:
          b = min(ts, key=ts.get)
          row[f"best_o{o}"] = (b, ts[b])
    st = row.get("stats_best", {})
    print(f"\n== G={g} r={r} K={k} N={n}: {time.time() - t0:.0f} s", flush=True)
    print(f"  batched {tb:9.1f} us {tf(tb):6.0f} TF/s | lax.ragged_dot "
          f"{row['times']['lax.ragged_dot']['us']:9.1f} us | wt {tw:9.1f} us {tf(tw):6.0f} TF/s"
          f" ({wt_cfg})", flush=True)
    print(f"  best today's schedule {tbase:9.1f} us {tf(tbase):6.0f} TF/s ({top[0] if top else '-'})",
          flush=True)
    print(f"  best of all           {tbest:9.1f} us {tf(tbest):6.0f} TF/s ({best})", flush=True)
    if a.mode == "orders":
      print("  best per order: " + "; ".join(
          f"o{o} {row[f'best_o{o}'][1]:.1f} us ({row[f'best_o{o}'][0]})"
          for o in (0, 1, 2) if f"best_o{o}" in row), flush=True)
    if st:
      print(f"  best: {st['tasks']} row tasks x {st['tiles_n']} column tiles = {st['work']} "
            f"work items, {st['waves']:.2f} waves, rows {st['row_fill']:.3f} filled; floors: "
            f"FLOPs {st['flops_us']:.0f} us, bytes {st['bytes_us']:.0f} us", flush=True)
    print("  wt breakdown:   " + ", ".join(f"{nm[:40]} {us:.1f}" for nm, us in row["breakdown_wt"]),
          flush=True)
    if best:
      print("  best breakdown: " + ", ".join(f"{nm[:40]} {us:.1f}"
                                            for nm, us in row["breakdown_best"]), flush=True)
    if a.skew:
      s = row["skew"]
      pb = s["padded_batched"]["us"]
      print(f"  skew: max group {s['max_group']}, padded batched {pb:.1f} us; " + "; ".join(
          f"{nm} {v['us']:.1f} (x{pb / v['us']:.2f})" for nm, v in s.items()
          if isinstance(v, dict) and nm != "padded_batched"), flush=True)
    for nm in sorted(row["times"], key=lambda x: row["times"][x]["us"]
                     if row["times"][x]["us"] == row["times"][x]["us"] else 1e18):
      v = row["times"][nm]
      if v["status"] != "ok":
        print(f"    {nm:<58} {v['status']}: {v['error'][:160]}", flush=True)
      else:
        print(f"    {nm:<58} {v['us']:9.1f} us {tf(v['us']):6.0f} TF/s  x{tb / v['us']:.3f} "
              f"batched", flush=True)
    summary.append((g, r, k, n, tf(tb), tf(tw), tf(tbase), tf(tbest), tb / tw, tb / tbest))
  print(f"\n{'G x r, K, N':<26}{'batched':>9}{'wt':>7}{'today':>7}{'best':>8}"
        f"{'wt/bat':>8}{'best/bat':>9}   (TFLOP/s; ratios are speed over batched)")
  for g, r, k, n, a1, a2, a3, a4, r1, r2 in summary:
    print(f"{f'{g} x {r}, {k}, {n}':<26}{a1:9.0f}{a2:7.0f}{a3:7.0f}{a4:8.0f}{r1:8.2f}{r2:9.2f}")
  dump()


def _rec(m):
  return {"status": m.status, "us": m.median_us if m.status == "ok" else math.nan,
          "spread_us": m.spread_us, "error": (m.error or "")[:400]}


def _geo(xs):
  xs = [x for x in xs if x == x]
  return math.exp(sum(math.log(x) for x in xs) / len(xs)) if xs else math.nan


def summarize(path: str) -> dict:
  """Prints and returns the summary of a ``--json`` run (module doc)."""
  with open(path) as f:
    run = json.load(f)
  mode = run.get("mode", "rule")
  print(f"{run['device_kind']}, JAX {run['jax']}: {mode} run, {len(run['rows'])} problems "
        "(speed over cuBLAS's batched GEMM on the same rows; > 1 is faster)")
  out = {}
  for row in run["rows"]:
    g, r, k, n = row["g"], row["r"], row["k"], row["n"]
    t = {nm: v["us"] for nm, v in row["times"].items() if v["status"] == "ok"}
    # NaN where the batched GEMM has no time (a balanced-router run before
    # the batched GEMM was checked on its own uniform rows).
    tb = t.get("batched", math.nan)
    flops = 2.0 * g * r * k * n
    res = {"batched_tflops": flops / tb / 1e6, "wt": tb / t["wt"],
           "lax": tb / t.get("lax.ragged_dot", math.nan)}
    if mode == "epilogue":
      # The rule's config, the best with the whole tile staged and the best
      # staged a slice at a time (names ending e1, e2: deeper rings).
      mos = {nm: us for nm, us in t.items() if nm.startswith("mosaic")}
      whole = [us for nm, us in mos.items() if len(nm.split()) == 9]
      sliced = [us for nm, us in mos.items() if len(nm.split()) == 10]
      rule = min((us for nm, us in mos.items() if nm.startswith("mosaic 128x256 s3 ")
                  and len(nm.split()) == 9), default=math.nan)
      res["rule_e0"] = tb / rule
      res["best_e0"] = tb / min(whole) if whole else math.nan
      res["best_sliced"] = tb / min(sliced) if sliced else math.nan
      res["sliced_over_e0"] = res["best_sliced"] / res["best_e0"]
    elif mode == "ring":
      # The best config on Pallas's pipeline; the ring through the items
      # over the same config on that pipeline (pairs, by whether that
      # pipeline chains the items: K steps a multiple of the stages); the
      # best 192-row tile (on the ring) over the best of the others.
      mos = {nm: us for nm, us in t.items() if nm.startswith("mosaic")}
      tall = [us for nm, us in mos.items() if nm.startswith("mosaic 192x")]
      other = [us for nm, us in mos.items() if not nm.startswith("mosaic 192x")]
      res["best_pipeline"] = tb / min((us for nm, us in mos.items() if not nm.endswith(" r1")),
                                   default=math.nan)
      res["best_192"] = tb / min(tall) if tall else math.nan
      res["192_over_rest"] = min(other) / min(tall) if tall and other else math.nan
      res["pairs"] = [(mos[nm[:-3]] / us, (k // 64) % _parse(nm)[0].num_stages == 0)
                      for nm, us in mos.items() if nm.endswith(" r1") and nm[:-3] in mos]
      # On the ring, one wgmma in flight over none (the same config).
      res["delay_pairs"] = [mos[nm.replace(" d1 ", " d0 ")] / us for nm, us in mos.items()
                            if nm.endswith(" r1") and " d1 " in nm
                            and nm.replace(" d1 ", " d0 ") in mos]
    elif mode == "pingpong":
      # The best ping-pong config, the best other, and each ping-pong
      # config over the same tile split between the warpgroups.
      mos = {nm: us for nm, us in t.items() if nm.startswith("mosaic")}
      pp = [us for nm, us in mos.items() if nm.endswith(" pp")]
      other = [us for nm, us in mos.items() if not nm.endswith(" pp")]
      res["best_other"] = tb / min(other) if other else math.nan
      res["best_pingpong"] = tb / min(pp) if pp else math.nan
      res["pp_over_rest"] = res["best_pingpong"] / res["best_other"]
      res["pairs"] = [mos[nm[:-3]] / us for nm, us in mos.items()
                      if nm.endswith(" pp") and nm[:-3] in mos]
    elif mode == "cluster":
      # The best config on 2-CTA clusters over the best on one CTA, and
      # each on clusters over the same on one CTA.
      mos = {nm: us for nm, us in t.items() if nm.startswith("mosaic")}
      two = [us for nm, us in mos.items() if " cl2 " in nm]
      one = [us for nm, us in mos.items() if " cl1 " in nm]
      res["best_one_cta"] = tb / min(one) if one else math.nan
      res["best_cluster"] = tb / min(two) if two else math.nan
      res["cluster_over_one"] = res["best_cluster"] / res["best_one_cta"]
      res["pairs"] = [mos[nm.replace(" cl2 ", " cl1 ")] / us for nm, us in mos.items()
                      if " cl2 " in nm and nm.replace(" cl2 ", " cl1 ") in mos]
    elif mode == "rule":
      old = old_rule(g, r, k, n)
      res["old_rule"] = tb / t[_name(old, Options())] if old else res["wt"]
      res["new_rule"] = res["wt"]
    elif mode == "orders":
      for o in (0, 1, 2):
        ts = [us for nm, us in t.items() if nm.startswith("mosaic") and f" o{o} " in nm]
        res[f"best_o{o}"] = tb / min(ts) if ts else math.nan
      # Order 2 with its work items' pipelines chained (p1) over the same
      # config without (p0).
      res["p1_over_p0"] = [t[nm.replace(" p1", " p0")] / us for nm, us in t.items()
                           if " p1" in nm and nm.replace(" p1", " p0") in t]
    else:
      # Each option: the best config with it over the best without it.
      mos = [(tuple(nm.split()[5:8]), us) for nm, us in t.items() if nm.startswith("mosaic")]
      res["orders_0_1"] = tb / min(us for o, us in mos if o == ("cl1", "d0", "b0"))
      for label, on in (("cluster_2", lambda o: o[0] == "cl2"),
                        ("delay_1", lambda o: o[1] == "d1"),
                        ("task_band", lambda o: o[2] != "b0")):
        res[label] = (min(us for o, us in mos if not on(o)) / min(us for o, us in mos if on(o)))
    bd = dict(row.get("breakdown_wt", []))
    main = max(bd.values()) if bd else math.nan
    res["worklist_us"] = sum(bd.values()) - main if bd else math.nan
    res["worklist_share"] = res["worklist_us"] / t["wt"] if bd else math.nan
    if "skew" in row:
      sk = row["skew"]
      pb = sk["padded_batched"]["us"]
      res["skew_wt_vs_padded"] = pb / sk["wt"]["us"]
      if mode == "rule":
        res["skew_new_vs_old"] = (sk[_name(old, Options())]["us"] / sk["wt"]["us"] if old
                                  else 1.0)
    out[(g, r, k, n)] = res
  for m, label in (("cluster", "2-CTA clusters over the same config on one CTA"),
                   ("pingpong", "ping-pong over the same tile split between the warpgroups")):
    if mode == m:
      pairs = [x for res in out.values() for x in res.pop("pairs")]
      if pairs:
        print(f"{label}: {len(pairs)} pairs, {min(pairs):.3f}-{max(pairs):.3f}x, geomean "
              f"{_geo(pairs):.3f}x")
      out[f"{m}_pairs"] = pairs
  if mode == "ring":
    both = [x for res in out.values() for x in res.pop("pairs")]
    for label, keep in (("", lambda c: True), (" (Pallas's pipeline chains)", lambda c: c),
                        (" (it does not chain)", lambda c: not c)):
      pairs = [x for x, c in both if keep(c)]
      if pairs:
        print(f"item_ring over the same config on Pallas's pipeline{label}: {len(pairs)} "
              f"pairs, {min(pairs):.3f}-{max(pairs):.3f}x, geomean {_geo(pairs):.3f}x")
    out["ring_pairs"] = [x for x, _ in both]
    delays = [x for res in out.values() if isinstance(res, dict)
              for x in res.pop("delay_pairs", [])]
    if delays:
      print(f"on the ring, one wgmma in flight over none: {len(delays)} pairs, "
            f"{min(delays):.3f}-{max(delays):.3f}x, geomean {_geo(delays):.3f}x")
      out["delay_pairs"] = delays
    out["ring_pairs_chained"] = [x for x, c in both if c]
  if mode == "orders":
    pairs = [x for res in out.values() for x in res.pop("p1_over_p0")]
    print(f"order 2, pipelines chained over not: {len(pairs)} pairs, {min(pairs):.3f}-"
          f"{max(pairs):.3f}x, geomean {_geo(pairs):.3f}x")
    out["p1_over_p0"] = pairs
  cols = [c for c in next(iter(out.values())) if c != "batched_tflops"]
  print(f"{'G x r, K, N':<24}{'batched':>8}" + "".join(f"{c[:13]:>14}" for c in cols))
  if mode == "options":
    print("(cluster_2, delay_1, task_band: the best config with the option over the best "
          "without it)")
  rows = {key: res for key, res in out.items() if isinstance(key, tuple)}
  for key, res in rows.items():
    print(f"{'%d x %d, %d, %d' % key:<24}{res['batched_tflops']:8.0f}"
          + "".join(f"{res[c]:14.3f}" for c in cols))
  print("geomean" + " " * 25 + "".join(
      f"{_geo([res[c] for res in rows.values()]):14.3f}" if c != "worklist_us" else " " * 14
      for c in cols))
  return out


def _fits(c: Config, hw, out_slots: int = -1, pingpong: bool = False) -> bool:
  return kernel.smem_bytes(block_m=c.block_m, block_n=c.block_n, num_stages=c.num_stages,
                           itemsize=2, out_itemsize=2, out_slots=out_slots,
                           pingpong=pingpong) <= hw.smem_per_block


def _epilogue_candidates(g, r, k, n, hw):
  """Order 2 on its three tiles (those no taller than an expert's rows):
  the output staged whole at the deepest ring that fits, then a slice at a
  time through 2 or 1 slots at each deeper ring that fits; the rule's
  config first."""
  out = []
  for bm, bn in ((128, 256), (64, 256), (256, 128)):
    if bm > max(64, 2 ** math.ceil(math.log2(r))):
      continue
    whole = max(ns for ns in range(2, 9) if _fits(Config(block_m=bm, block_n=bn,
                                                         num_stages=ns), hw, 0))
    out.append((Config(block_m=bm, block_n=bn, num_stages=whole, grid_minor=2),
                Options(out_slots=0)))
    for slots in (2, 1):
      # The same ring sliced (is slicing free?) once, then deeper rings.
      for ns in range(whole + ((bm, bn, slots) != (128, 256, 2)), 9):
        c = Config(block_m=bm, block_n=bn, num_stages=ns, grid_minor=2)
        if _fits(c, hw, slots) and kernel.out_staging(bm, bn, 2, slots) < \
            kernel.out_staging(bm, bn, 2, 0):
          out.append((c, Options(out_slots=slots)))
  return list(dict.fromkeys(out))


def _candidates(g, r, k, n, hw, mode):
  """Today's orders (0, 1) on the tiles that fit an expert's rows; with
  ``mode`` "orders" also order 2, and order 2 with tile pipelining where
  the K steps allow it."""
  out = []
  for bm, bn, ns in TILES + ([(64, 128, 4)] if r <= 96 else []):
    if bm > max(64, 2 ** math.ceil(math.log2(r))):
      continue  # taller than an expert's rows: loads other experts' rows
    for gm in ((1, 0, 2) if mode == "orders" else (1, 0)):
      c = Config(block_m=bm, block_n=bn, num_stages=ns, grid_minor=gm)
      if not _fits(c, hw):
        continue
      out.append((c, Options()))
      if gm == 2 and (k // 64) % ns == 0:
        out.append((c, Options(pipeline_tiles=1)))
  return out


def old_rule(g, r, k, n) -> Config | None:
  """The Hopper rule's config before order 2, where it used 128 x 256 tiles."""
  if r <= 64:
    return None
  order = 0 if r >= 128 and -(-n // 256) > 16 else 1
  return Config(block_m=128, block_n=256, num_stages=3, grid_minor=order)


def _rule_candidates(g, r, k, n, hw):
  """The rule's config before and after order 2, the three orders on its
  tile, and order 2 on the other tiles of 64 to 256 rows."""
  from wavetune_jax import RAGGED_DOT
  new = RAGGED_DOT.backend("mosaic").heuristic(wt.RaggedDotProblem(m=g * r, g=g, k=k, n=n), hw)
  out = [old_rule(g, r, k, n), new]
  out += [dataclasses.replace(new, grid_minor=o) for o in (0, 1, 2)]
  if r > 64:
    out += [Config(block_m=256, block_n=128, num_stages=3, grid_minor=2),
            Config(block_m=64, block_n=256, num_stages=4, grid_minor=2)]
  out = [c for c in dict.fromkeys(c for c in out if c is not None) if _fits(c, hw)]
  return [(c, Options()) for c in out]


def _ring_candidates(g, r, k, n, hw, ring_set="tall"):
  """``ring_set`` "pairs": order 2 on 128 x 256 (3 and 4 stages), 256 x 128
  and 64 x 256 tiles, each on Pallas's pipeline and with one ring through
  the items (``item_ring``); "tall": those on Pallas's pipeline, 128 x 256
  (3 stages) also on the ring, and the 192-row tiles of three consumer
  warpgroups (which run on that ring)."""
  if ring_set == "delay":
    # On the ring, each with one wgmma in flight (delay_release) and without.
    out = []
    for (bm, bn, ns), dl in itertools.product(((128, 256, 3), (128, 256, 4), (192, 192, 3),
                                               (64, 256, 4)), (0, 1)):
      c = Config(block_m=bm, block_n=bn, num_stages=ns, grid_minor=2)
      if bm <= max(64, 2 ** math.ceil(math.log2(r))) and _fits(c, hw):
        out.append((c, Options(item_ring=1, delay_release=dl)))
    return out
  if ring_set == "pairs":
    tiles = [(bm, bn, ns, ring) for bm, bn, ns in ((128, 256, 3), (128, 256, 4), (256, 128, 3),
                                                  (64, 256, 4)) for ring in (0, 1)]
  elif ring_set == "edge192":
    # Where the H200 rule turns to 192-row tiles: the rule's 128 x 256 and
    # the two 192-row tiles.
    tiles = [(128, 256, 3, 0), (192, 192, 3, 1), (192, 128, 4, 1)]
  elif ring_set == "deep192":
    # The 192-row tiles at 3 and 4 stages (192 x 192 at 4 and 192 x 128 at
    # 5 stage the output a slice at a time) against 128 x 256 on the ring.
    tiles = [(128, 256, 3, 1), (192, 192, 3, 1), (192, 192, 4, 1), (192, 128, 4, 1),
             (192, 128, 5, 1)]
  else:
    tiles = [(128, 256, 3, 0), (128, 256, 3, 1), (128, 256, 4, 0), (64, 256, 4, 0),
             (256, 128, 3, 0), (192, 192, 3, 1), (192, 128, 4, 1)]
  out = []
  for bm, bn, ns, ring in tiles:
    if bm > max(64, 2 ** math.ceil(math.log2(r))):
      continue
    c = Config(block_m=bm, block_n=bn, num_stages=ns, grid_minor=2)
    if _fits(c, hw):
      out.append((c, Options(item_ring=ring)))
  return out


def _pingpong_candidates(r, hw):
  """Order 2 on 128 x 256 (the tables' tile, Pallas's pipeline); 128 x 128
  (4 stages, orders 1 and 2) and 64 x 256 (4 stages, order 2), each split
  between the consumer warpgroups (Pallas's pipeline) and ping-pong (a
  whole tile a warpgroup, on the kernel's ring); 128 x 128 ping-pong with 5
  stages."""
  out = []
  for bm, bn, ns, gm, pp in ((128, 256, 3, 2, 0),
                             (128, 128, 4, 2, 0), (128, 128, 4, 2, 1),
                             (128, 128, 4, 1, 0), (128, 128, 4, 1, 1),
                             (64, 256, 4, 2, 0), (64, 256, 4, 2, 1),
                             (128, 128, 5, 2, 1)):
    if bm > max(64, 2 ** math.ceil(math.log2(r))):
      continue
    c = Config(block_m=bm, block_n=bn, num_stages=ns, grid_minor=gm)
    if _fits(c, hw, pingpong=bool(pp)):
      out.append((c, Options(pingpong=pp)))
  return out


def _cluster_candidates(r, hw):
  """Order 2 on 128 x 256 (3 and 4 stages), 64 x 256 and 128 x 128 (4
  stages), and order 1 on 128 x 256 (4 stages), each on one CTA and on
  2-CTA clusters (a task of twice the rows, the weight multicast); none
  below 256 rows per expert (a cluster's task would be mostly empty)."""
  if r < 256:
    return []
  out = []
  for (bm, bn, ns, gm), cm in itertools.product(
      ((128, 256, 3, 2), (128, 256, 4, 2), (64, 256, 4, 2), (128, 128, 4, 2),
       (128, 256, 4, 1)), (1, 2)):
    c = Config(block_m=bm, block_n=bn, num_stages=ns, grid_minor=gm)
    if _fits(c, hw):
      out.append((c, Options(cluster_m=cm)))
  return out


def _options_on(top):
  """Clusters, wgmma delay and fixed task bands on the configs named in ``top``."""
  opt = []
  for nm in top:
    c, _ = _parse(nm)
    c0 = dataclasses.replace(c, grid_minor=0)
    for cm, dl, band in itertools.product((1, 2), (0, 1), (0, 3, 8)):
      if (cm, dl, band) != (1, 0, 0):
        opt.append((c0, Options(cluster_m=cm, delay_release=dl, task_band=band)))
    if c.grid_minor == 1:
      opt += [(c, Options(cluster_m=cm, delay_release=dl))
              for cm, dl in ((1, 1), (2, 0), (2, 1))]
    if c.block_m == 128 and c.block_n in (128, 256):
      # Two 64-row CTAs per 128-row task.
      c64 = dataclasses.replace(c0, block_m=64, num_stages=4)
      opt += [(c64, Options(cluster_m=2, delay_release=dl, task_band=band))
              for dl, band in ((0, 0), (0, 3), (1, 3))]
  return list(dict.fromkeys(opt))


def _name(c: Config, o: Options) -> str:
  return (f"mosaic {c.block_m}x{c.block_n} s{c.num_stages} k{c.split_k} o{c.grid_minor} "
          f"cl{o.cluster_m} d{o.delay_release} b{o.task_band} p{o.pipeline_tiles}"
          + (f" e{o.out_slots}" if o.out_slots > 0 else "")
          + (" pp" if o.pingpong else " r1" if o.item_ring else ""))


def _parse(name: str):
  p = name.split()
  pp = p[-1] == "pp"
  ring = p[-1] in ("r1", "pp")
  if ring:
    p = p[:-1]
  bm, bn = (int(v) for v in p[1].split("x"))
  c = Config(block_m=bm, block_n=bn, num_stages=int(p[2][1:]), split_k=int(p[3][1:]),
             grid_minor=int(p[4][1:]))
  o = Options(cluster_m=int(p[5][2:]), delay_release=int(p[6][1:]), task_band=int(p[7][1:]),
              pipeline_tiles=int(p[8][1:]), out_slots=int(p[9][1:]) if len(p) > 9 else -1,
              item_ring=int(ring and not pp), pingpong=int(pp))
  # (A name without an "e" runs the kernel's default staging: the whole tile
  # where it fits, as every config of the runs recorded before slices did.)
  return c, o


def _mosaic(c: Config, o: Options):
  def f(lhs, rhs, sizes):
    return kernel.ragged_dot(lhs, rhs, sizes, config=c, options=o)
  return f


if __name__ == "__main__":
  main()
