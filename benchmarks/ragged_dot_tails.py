"""The grouped GEMM under the sweeps' balanced router: partial last tasks.

A balanced router gives each expert about ``m / g`` rows, not exactly: at
256 rows per expert half the experts get a few rows more and a third
128-row task of a few rows. Those tail tasks cost a full task each. This
benchmark times, per problem, with the group sizes of the sweeps' inputs
(``RAGGED_DOT.input_group_sizes``; CUPTI, L2 flushed, every config checked
against the float32 reference first):

* the Mosaic kernel at the Hopper rule's config and at 256 x 128 order 2,
  each with and without ``MosaicRaggedDotOptions(skip_idle=1)`` (a consumer
  warpgroup with no valid row in its half of a task skips its wgmmas);
* cuBLAS's batched GEMM (``jnp.einsum``) on the same rows at uniform routing
  (``ceil(m / g)`` rows per expert: the bound) and padded to the largest
  group of these sizes (what a batched GEMM runs on these rows);
* row tasks and the share of tail tasks (those holding at most half a task's
  rows);
* every Mosaic config checked once more under a skewed router (empty
  experts, experts of a few rows).

``--mode streamk`` times the same two configs with and without
``MosaicRaggedDotOptions(stream_k=1)`` (the last waves' items cut along K
so that every CTA runs the same K steps) instead of ``skip_idle``;
``--set issue`` runs the uniform-routing rows of
``benchmarks/ragged_dot_efficiency.py`` (every expert ``m / g`` rows) instead
of the sweeps' balanced sizes; ``--check`` first runs stream-K on the ragged
edge cases of ``benchmarks/ragged_dot_mosaic.py`` with grids of 3, 7, 16
and 132 CTAs (so that small problems cut items between CTAs).

    python3 benchmarks/ragged_dot_tails.py [--set worst|quick|issue] [--mode skip|streamk]
        [--check] [--json out.json]
    python3 benchmarks/ragged_dot_tails.py --summarize out.json   # CPU
"""

from __future__ import annotations

import argparse
import json
import math
import time

import numpy as np

#: (m, g, K, N): the H100 sweep's problems of >= 128 rows per expert furthest
#: below the batched GEMM (Mixtral w2, DBRX w13, Arctic, OLMoE w13, Mixtral
#: w13, Llama-4-Scout w13), and two of 512 to 1,024 rows per expert.
WORST = [(2048, 8, 14336, 4096), (4096, 16, 8192, 5120), (32768, 128, 7168, 9728),
         (16384, 64, 1024, 2048), (2048, 8, 4096, 28672), (4096, 16, 5120, 16384),
         (4096, 8, 14336, 4096), (8192, 16, 6144, 21504)]
#: (m, g, K, N) at uniform routing (m / g rows per expert): the rows of
#: benchmarks/ragged_dot_efficiency.py's issue and suite sets.
ISSUE = [(64 * 375, 64, 3584, 5120), (32 * 375, 32, 2880, 5760), (8 * 512, 8, 4096, 28672),
         (8 * 2048, 8, 4096, 28672), (128 * 192, 128, 2048, 1536), (64 * 48, 64, 3584, 5120),
         (8 * 1024, 8, 14336, 4096), (16 * 256, 16, 6144, 21504), (64 * 512, 64, 2048, 2048),
         (64 * 128, 64, 1024, 2048)]
SETS = {"worst": WORST, "quick": WORST[:1], "issue": ISSUE,
        "streamk": [WORST[0], (4096, 16, 8192, 5120), (12000, 32, 2880, 5760)]}
#: Option per mode: (MosaicRaggedDotOptions field, name suffix).
MODES = {"skip": ("skip_idle", "skip"), "streamk": ("stream_k", "sk")}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--set", choices=tuple(SETS), default="worst")
  ap.add_argument("--mode", choices=tuple(MODES), default="skip")
  ap.add_argument("--check", action="store_true",
                  help="stream-K on the ragged edge cases first")
  ap.add_argument("--iterations", type=int, default=10)
  ap.add_argument("--json", default=None)
  ap.add_argument("--summarize", metavar="JSON", help="summarize a run's rows (CPU)")
  a = ap.parse_args(argv)
  if a.summarize:
    summarize(a.summarize)
    return
  run(a)


def run(a):
  import jax
  import jax.numpy as jnp

  import wavetune_jax as wt
  from pallas_kernels.ragged_dot import mosaic as kernel
  from pallas_kernels.ragged_dot import worklist
  from pallas_kernels.ragged_dot.reference import ragged_dot_reference
  from wavetune_jax.core import versions
  from wavetune_jax.families.ragged_dot import routing
  from wavetune_jax.families.ragged_dot.family import batched_reference
  from wavetune_jax.tuning import profiler

  fam = wt.RAGGED_DOT
  dev = jax.devices()[0]
  hw = wt.detect()
  print(dev.device_kind, jax.__version__, flush=True)
  prof = profiler.Profiler(iterations=a.iterations)
  out = {"device_kind": dev.device_kind, "versions": versions.current(), "rows": [],
         "mode": a.mode, "command": f"python3 benchmarks/ragged_dot_tails.py --set {a.set} "
                                    f"--mode {a.mode}"}
  if a.check:
    out["edge_failures"] = check_stream_k(kernel)
  field, suffix = MODES[a.mode]
  mosaic = fam.backend("mosaic")
  for m, g, k, n in SETS[a.set]:
    t0 = time.time()
    p = wt.RaggedDotProblem(m=m, g=g, k=k, n=n)
    lhs, rhs, sizes = fam.inputs(p, jax.random.PRNGKey(0))
    if (m, g, k, n) in ISSUE:  # uniform routing
      sizes = jnp.full((g,), m // g, jnp.int32)
    ref = ragged_dot_reference(lhs, rhs, sizes, jnp.float32)
    rule = mosaic.heuristic(p, hw)
    configs = list(dict.fromkeys([rule, wt.MosaicRaggedDotConfig(
        block_m=256, block_n=128, num_stages=3, grid_minor=2)]))
    names, fns = [], []
    for c in configs:
      for on in (0, 1):
        names.append(f"{c.block_m}x{c.block_n} s{c.num_stages} o{c.grid_minor} {suffix}{on}")
        fns.append(_mosaic(kernel, c, kernel.MosaicRaggedDotOptions(**{field: on})))
    if a.mode == "streamk":  # the pipeline stream-K's pieces run, on every item
      names.append(f"{rule.block_m}x{rule.block_n} s{rule.num_stages} o{rule.grid_minor} "
                   "traced steps")
      fns.append(_mosaic(kernel, rule, kernel.MosaicRaggedDotOptions(traced_steps=1)))
    res = prof.measure_many(fns, (lhs, rhs, sizes), reference=ref, tolerance=2e-2,
                            out_bytes=m * n * 4)
    # The same configs checked under a skewed router too (empty experts, and
    # experts of a few rows: warpgroups with no rows in most tasks).
    skew = routing.group_sizes(jax.random.PRNGKey(3), m, g, routing.SKEWED)
    ref_s = ragged_dot_reference(lhs, rhs, skew, jnp.float32)
    checks = prof.measure_many(fns, (lhs, rhs, skew), reference=ref_s, tolerance=2e-2,
                               out_bytes=m * n * 4)
    del ref_s
    row = {"m": m, "g": g, "k": k, "n": n, "max_group": int(jnp.max(sizes)), "times": {}}
    for nm, r, ch in zip(names, res, checks):
      row["times"][nm] = {"status": r.status, "us": r.median_us if r.status == "ok"
                          else math.nan, "error": (r.error or "")[:300],
                          "skewed": ch.status, "skewed_us": ch.median_us}
    del ref
    for label, rows_, experts in (("batched", None, None),
                                  ("batched_padded", row["max_group"], g)):
      fn, shapes = batched_reference(p, rows=rows_, experts=experts)
      args = [jax.random.normal(jax.random.PRNGKey(1), s.shape, jnp.float32).astype(s.dtype)
              if s.shape != rhs.shape else rhs for s in shapes]
      r = prof.measure_many([fn], args)[0]
      row["times"][label] = {"status": r.status, "us": r.median_us if r.status == "ok"
                             else math.nan, "error": (r.error or "")[:300]}
      del args
    if a.mode == "streamk":  # where the time goes, the rule's config with and without
      row["breakdown"] = {}
      for nm, f in zip(names[:2], fns[:2]):
        try:
          row["breakdown"][nm] = prof.kernel_breakdown(f, (lhs, rhs, sizes))
        except Exception as e:  # noqa: BLE001 (out of memory on the largest problems)
          row["breakdown"][nm] = [(f"failed: {type(e).__name__}", math.nan)]
    bm = rule.block_m
    tasks, count = worklist.row_tasks(sizes, m, bm)
    t = np.asarray(tasks)[:, :int(count[0])]
    row["tasks"] = int(count[0])
    row["tail_tasks"] = int(((t[worklist.SIZE] > 0) & (t[worklist.SIZE] <= bm // 2)).sum())
    out["rows"].append(row)
    if a.json:
      with open(a.json, "w") as f:
        json.dump(out, f, indent=1)
    print(f"== {m} x {g} x {k} x {n}: {time.time() - t0:.0f} s", flush=True)
    for nm, v in row["times"].items():
      print(f"  {nm:<28} {v['us']:9.1f} us {v['status']} (skewed router: "
            f"{v.get('skewed', '-')}) {v['error'][:120]}", flush=True)
    for nm, kernels in row.get("breakdown", {}).items():
      print(f"  {nm} kernels: " + ", ".join(f"{k[:36]} {us:.1f}" for k, us in kernels),
            flush=True)
  if a.json:
    summarize(a.json)


def _mosaic(kernel, c, o, num_sms=None, out_dtype=None):
  def f(lhs, rhs, sizes):
    return kernel.ragged_dot(lhs, rhs, sizes, config=c, options=o, num_sms=num_sms,
                             out_dtype=out_dtype)
  return f


def check_stream_k(kernel) -> int:
  """Stream-K configs on the ragged edge cases (every row, zeros past the
  groups), on grids of 3, 7, 16 and 132 CTAs; returns the failures."""
  import jax
  from ragged_dot_mosaic import check_cases
  cfg = kernel.MosaicRaggedDotConfig
  configs = [(cfg(block_m=128, block_n=256, num_stages=2, grid_minor=2), None),
             (cfg(block_m=64, block_n=256, num_stages=3, grid_minor=1), None),
             (cfg(block_m=256, block_n=128, num_stages=2, grid_minor=0), None),
             (cfg(block_m=128, block_n=128, num_stages=4, grid_minor=2), "float32")]
  runs = {}
  for ctas in (3, 7, 16, 132):
    for c, out in configs:
      f = jax.jit(_mosaic(kernel, c, kernel.MosaicRaggedDotOptions(stream_k=1), ctas, out))
      runs[f"{c.block_m}x{c.block_n} s{c.num_stages} o{c.grid_minor} {out or 'bf16'} "
           f"on {ctas} CTAs"] = lambda p, lhs, rhs, gs, f=f: f(lhs, rhs, gs)
  return check_cases(runs, what="stream-K")


def summarize(path: str) -> dict:
  """Per problem: rows per expert, tail tasks, the batched GEMMs' times, and
  each config's speed over the uniform and the padded batched GEMM; the
  speed of skip_idle=1 over 0."""
  with open(path) as f:
    run_ = json.load(f)
  print(f"{run_['device_kind']}: {len(run_['rows'])} problems (speed over the batched GEMM "
        "at uniform routing / padded to the largest group; > 1 is faster)")
  out = {}
  for row in run_["rows"]:
    t = {nm: v["us"] for nm, v in row["times"].items() if v["status"] == "ok"}
    key = (row["m"], row["g"], row["k"], row["n"])
    # Work items of the rule's 128 x 256 tiles and their waves on 132 SMs,
    # with these sizes and at uniform routing.
    tiles_n = -(-row["n"] // 256)
    uniform = row["g"] * -(-row["m"] // (row["g"] * 128))
    res = {"rows_per_expert": row["m"] / min(row["g"], row["m"]),
           "tail_tasks": f"{row['tail_tasks']}/{row['tasks']}",
           "waves": row["tasks"] * tiles_n / 132, "waves_uniform": uniform * tiles_n / 132}
    for nm, us in t.items():
      if nm.startswith("batched"):
        continue
      res[nm] = (t["batched"] / us, t["batched_padded"] / us)
    suffix = MODES[run_.get("mode", "skip")][1]
    res["gain"] = [t[nm[:-1] + "0"] / us for nm, us in t.items()
                   if nm.endswith(suffix + "1") and nm[:-1] + "0" in t]
    out[key] = res
    print(f"{'%d x %d x %d x %d' % key:<26} {res['rows_per_expert']:6.0f} rows/expert, tails "
          f"{res['tail_tasks']:>7}, waves {res['waves']:.2f} (uniform {res['waves_uniform']:.2f}): "
          + "; ".join(
              f"{nm} {v[0]:.3f}/{v[1]:.3f}" for nm, v in res.items() if isinstance(v, tuple)))
  gains = [x for r in out.values() for x in r["gain"]]
  if gains:
    field = MODES[run_.get("mode", "skip")][0]
    print(f"{field}=1 over 0: {min(gains):.3f}-{max(gains):.3f}x, geomean "
          f"{math.exp(sum(map(math.log, gains)) / len(gains)):.3f}x over {len(gains)} pairs")
  return out


if __name__ == "__main__":
  main()
