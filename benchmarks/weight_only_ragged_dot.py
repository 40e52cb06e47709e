"""Weight-only 8-bit grouped GEMM on a GPU: right, and how fast.

``y[r] = (x[r] @ w[g]) * scales[g]`` for the rows of expert ``g``: ``x``
bfloat16, expert weights ``w [G, K, N]`` int8 or float8_e4m3fn, a float32
scale per expert and output channel (``wt.quantized_ragged_dot``), at decode
sizes of the suite's mixture-of-experts weights, rows routed by the family's
balanced router.

``--check`` first runs the Mosaic kernel (``pallas_kernels.ragged_dot.weight_only``)
on the ragged edge cases of ``benchmarks/ragged_dot_mosaic.py`` (empty
experts, NaN past the groups, M not a multiple of 8, ...), every row against
the float32 product of the dequantized weights. Then per problem (CUPTI, L2
flushed, median of 10, every candidate checked first against that
reference): XLA's ragged dot on the converted weights with the scales after
it (the family's platform op, what a JAX user writes), ``wt.ragged_dot`` on
bfloat16 weights (what the 8-bit weight saves against), the Mosaic kernel at
its rule's config (``decode_config``) and a few around it, and what
``wt.quantized_ragged_dot`` runs.

    PYTHONPATH=. python3 benchmarks/weight_only_ragged_dot.py [--check] [--quick] [--tokens T ...]
        [--held-out] [--only WEIGHT ...] [--dtypes int8 ...] [--rule-only | --compare-rules]
        [--json out.json]

``--held-out`` runs the routed experts of the models outside the suites
(``benchmarks/unseen_models.py``, all three sets: w13 ``[E, hidden, 2 *
ffn]`` and w2 ``[E, ffn, hidden]``) instead of the suite's; ``--rule-only``
times the rule's config alone (with XLA's op, ``wt`` and bf16);
``--compare-rules`` only the problems where the rule's K split past one
wave (``decode_config``) differs from the rule before
(``past_one_wave=False``), both configs and XLA's op (no bf16).

Above 64 rows per expert (``--tokens`` of prefill sizes) the kernel has no
rule: 128 x 128 and 64 x 256 tiles are timed in both orders (by expert and
column tiles first).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import jax
import jax.numpy as jnp

import wavetune_jax as wt
from pallas_kernels.ragged_dot import weight_only as kernel
from wavetune_jax.families.qragged_dot.problem import QRaggedDotProblem
from wavetune_jax.tuning import profiler

#: (name, experts, top_k, K, N) of the suite's expert weights.
WEIGHTS = [("mixtral_8x7b.w13", 8, 2, 4096, 28672), ("mixtral_8x7b.w2", 8, 2, 14336, 4096),
           ("olmoe_1b_7b.w13", 64, 8, 2048, 2048), ("olmoe_1b_7b.w2", 64, 8, 1024, 2048)]
#: Tokens of a decode step (rows are tokens x top_k).
TOKENS = (1, 16, 64)


def held_out_weights():
  """(name, experts, top_k, K, N) of the routed experts of the models
  outside the suites (``benchmarks/unseen_models.py``, sets v1-v3)."""
  from unseen_models import MOE, MOE_V2, MOE_V3
  out = []
  for models in (MOE, MOE_V2, MOE_V3):
    for name, c in models.items():
      out += [(f"{name}.w13", c["E"], c["top_k"], c["hidden"], 2 * c["ffn"]),
              (f"{name}.w2", c["E"], c["top_k"], c["ffn"], c["hidden"])]
  return out


def configs(p: QRaggedDotProblem, rule_only: bool = False, compare_rules: bool = False,
            past_one_wave: bool = True):
  """The rule's config, 3 and 5 stages, its split halved and doubled, and
  128 x 128 tiles (order 1); the rule's alone with ``rule_only``; with
  ``compare_rules`` the rule's and the rule's before (no split past one
  wave) where they differ, else none. ``past_one_wave``: the rule's, as
  the family takes it on this GPU (``SPLIT_PAST_WAVE_GPUS``)."""
  rule = kernel.decode_config(p.m, p.g, p.n, p.k, 132,
                              past_one_wave=past_one_wave or compare_rules)
  if compare_rules:
    before = kernel.decode_config(p.m, p.g, p.n, p.k, 132, past_one_wave=False)
    return [] if rule == before else [rule, before]
  if rule_only:
    return [rule or kernel.prefill_config(p.m, p.g, p.n, p.k, 132)]
  if rule is None:  # above 64 rows per expert: no rule; both tiles, both orders
    cfg = wt.MosaicRaggedDotConfig
    return [cfg(block_m=128, block_n=128, num_stages=4, grid_minor=2),
            cfg(block_m=128, block_n=128, num_stages=4, grid_minor=1),
            cfg(block_m=64, block_n=256, num_stages=4, grid_minor=2),
            cfg(block_m=64, block_n=256, num_stages=4, grid_minor=1)]
  out = [rule, dataclasses.replace(rule, num_stages=3), dataclasses.replace(rule, num_stages=5),
         dataclasses.replace(rule, block_m=128, block_n=128)]
  for sk in (rule.split_k // 2, rule.split_k * 2):
    if sk >= 1:
      out.append(dataclasses.replace(rule, split_k=sk))
  return out


def _label(c) -> str:
  return (f"mosaic {c.block_m}x{c.block_n} s{c.num_stages} k{c.split_k}"
          + (f" o{c.grid_minor}" if c.grid_minor != 1 else ""))


def check(fam) -> int:
  """The kernel on the ragged edge cases, int8 and e4m3 weights."""
  from ragged_dot_mosaic import check_cases
  cfg = wt.MosaicRaggedDotConfig
  runs = {}
  for wd in ("int8", "float8_e4m3fn"):
    for c in (cfg(block_m=64, block_n=256, num_stages=4), cfg(block_m=64, block_n=256,
                                                              num_stages=3, split_k=2),
              cfg(block_m=128, block_n=128, num_stages=4, grid_minor=2)):
      f = jax.jit(lambda x, w, gs, c=c: kernel.weight_only_ragged_dot(x, w[0], w[1], gs,
                                                                       config=c))
      runs[f"{wd} {c.block_m}x{c.block_n} s{c.num_stages} k{c.split_k} o{c.grid_minor}"] = (
          lambda p, x, w, gs, f=f: f(x, w, gs))
  fails = 0
  for wd in ("int8", "float8_e4m3fn"):
    fails += check_cases({nm: f for nm, f in runs.items() if nm.startswith(wd)},
                         what=f"weight-only grouped GEMM, {wd}",
                         quantize=lambda rhs, wd=wd: _quantize(rhs, wd))
  return fails


def _quantize(rhs, wd):
  """``rhs [G, K, N]`` as 8-bit values and per-(expert, channel) scales."""
  amax = jnp.max(jnp.abs(rhs.astype(jnp.float32)), axis=1)  # [G, N]
  top = 127.0 if wd == "int8" else 448.0
  s = jnp.where(amax > 0, amax / top, 1.0)
  q = rhs.astype(jnp.float32) / s[:, None, :]
  q = jnp.round(q).astype(jnp.int8) if wd == "int8" else q.astype(jnp.float8_e4m3fn)
  return q, s


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--check", action="store_true", help="the ragged edge cases first")
  ap.add_argument("--quick", action="store_true",
                  help="int8, the set's first weight only (the suite's: Mixtral's w13)")
  ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS),
                  help="tokens per problem (default: the decode sizes 1, 16, 64)")
  ap.add_argument("--held-out", action="store_true",
                  help="the experts of the models outside the suites")
  ap.add_argument("--dtypes", nargs="+", choices=("int8", "float8_e4m3fn"),
                  default=["int8", "float8_e4m3fn"], help="weight dtypes (default both)")
  which = ap.add_mutually_exclusive_group()
  which.add_argument("--rule-only", action="store_true",
                     help="time the rule's config only (besides XLA, wt and bf16)")
  which.add_argument("--compare-rules", action="store_true",
                     help="the problems where the rule's split past one wave changes, both "
                          "rules (no bf16)")
  ap.add_argument("--only", nargs="+", metavar="WEIGHT",
                  help="these weights only (names as printed, e.g. mixtral_8x7b.w13)")
  ap.add_argument("--iterations", type=int, default=10)
  ap.add_argument("--json", default=None)
  a = ap.parse_args(argv)
  weights = held_out_weights() if a.held_out else WEIGHTS
  if a.only:
    unknown = sorted(set(a.only) - {w[0] for w in weights})
    if unknown:
      ap.error(f"--only: no weight {', '.join(unknown)} in this set "
               f"({', '.join(w[0] for w in weights)})")
    weights = [w for w in weights if w[0] in a.only]
  prof = profiler.Profiler(iterations=a.iterations)
  dev = jax.devices()[0]
  print(dev.device_kind, jax.__version__, flush=True)
  fam = wt.get_family("qragged_dot")
  out = {"device_kind": dev.device_kind, "jax": jax.__version__, "rows": []}
  if a.check:
    out["edge_failures"] = check(fam)
  mosaic = fam.backend("mosaic")
  hw = wt.detect()
  past = hw.device_key in kernel.SPLIT_PAST_WAVE_GPUS
  for wname, g, top_k, k, n in (weights[:1] if a.quick else weights):
    for wd in (("int8",) if a.quick else a.dtypes):
      for t in a.tokens:
        p = QRaggedDotProblem(m=t * top_k, g=g, k=k, n=n, dtype="bfloat16", w_dtype=wd)
        cfgs = configs(p, a.rule_only, a.compare_rules, past)
        if a.compare_rules and not cfgs:
          continue
        x, w, s, gs = fam.inputs(p, jax.random.PRNGKey(t))
        ref = fam.reference(p, x, w, s, gs)
        cands = {"xla": fam.baseline(p),
                 "wt": lambda x, w, s, gs: wt.quantized_ragged_dot(x, w, s, gs)}
        for c in cfgs:
          try:
            mosaic.validate(p, c, hw)
          except ValueError:
            continue
          else:
            cands[_label(c)] = (
                lambda c: lambda x, w, s, gs: mosaic.run(p, c, x, w, s, gs))(c)
        res = dict(zip(cands, prof.measure_many(list(cands.values()), (x, w, s, gs),
                                                reference=ref, tolerance=fam.tolerance(p),
                                                out_bytes=p.m * n * 4)))
        bf_us = math.nan
        if not a.compare_rules:
          w_bf16 = (w.astype(jnp.float32) * s[:, None, :]).astype(jnp.bfloat16)
          (bf,) = prof.measure_many([lambda x, wb, gs: wt.ragged_dot(x, wb, gs)],
                                    (x, w_bf16, gs))
          bf_us = bf.median_us
          del w_bf16
        del ref
        times = {lab: (r.median_us if r.status == "ok" else math.nan) for lab, r in res.items()}
        errs = {lab: f"{r.status}: {(r.error or '')[:150]}" for lab, r in res.items()
                if r.status != "ok"}
        mos = {lab: v for lab, v in times.items() if lab.startswith("mosaic") and v == v}
        best = min(mos, key=mos.get) if mos else None
        with wt.policy("tables"):
          chosen = wt.select("qragged_dot", p, wt.detect()).config
        rule = (kernel.decode_config(p.m, p.g, p.n, p.k, 132,
                                     past_one_wave=past or a.compare_rules)
                or kernel.prefill_config(p.m, p.g, p.n, p.k, 132))
        rlab = _label(rule)
        row = {"weight": wname, "g": g, "k": k, "n": n, "w_dtype": wd, "tokens": t, "m": p.m,
               "bf16_ragged_dot_us": None if a.compare_rules else bf_us, "times": times,
               "errors": errs,
               "best_mosaic": best, "rule": rlab, "chosen": repr(chosen)}
        out["rows"].append(row)
        line = f"{wname:<17} {wd:<13} {t:>3} tokens: "
        if not a.compare_rules:
          line += f"bf16 wt.ragged_dot {bf_us:7.1f} us | "
        line += f"XLA {times['xla']:7.1f} | wt {times['wt']:7.1f}"
        if rlab in times:
          r_ = times[rlab]
          line += f" | rule {r_:7.1f} us: "
          if not a.compare_rules:
            line += f"{bf_us / r_:.2f}x bf16, "
          line += f"{times['xla'] / r_:.2f}x XLA"
        if best:
          line += f" | best {best} {mos[best]:.1f}"
        if a.compare_rules:
          blab = _label(cfgs[1])
          row["before"] = blab
          line += f" | before {blab} {times.get(blab, math.nan):.1f}"
        print(line, flush=True)
        for lab, e in errs.items():
          print(f"    {lab}: {e}", flush=True)
        if a.json:  # after every row: a run cut short keeps its rows
          with open(a.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
