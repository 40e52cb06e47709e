"""W8A8-FP8 grouped GEMM on a GPU: right, and how fast.

``y[r] = (x[r] @ w[g].T) * x_scales[r] * w_scales[g]`` for the rows ``r`` of
expert ``g`` (``x [M, K]``, ``w [G, N, K]`` float8_e4m3fn, per-token and
per-expert-channel float32 scales, output bfloat16), under the sweeps'
balanced router. Per problem (CUPTI, L2 flushed, median of 10; every
candidate checked first against the float32 product of the dequantized
operands):

* ``wt.ragged_dot`` in bfloat16 on the dequantized operands, with the
  shipped tables (the target's baseline: what FP8 saves against), and
  ``lax.ragged_dot`` in bfloat16;
* XLA's FP8 path, what a JAX user writes: ``lax.ragged_dot_general`` on the
  e4m3 operands with ``preferred_element_type=float32``, the scales after;
* ``wt.quantized_ragged_dot`` as selected (no table: the rule and the guard);
* the Mosaic FP8 kernel (``pallas_kernels.ragged_dot.fp8``) at the rule's
  config and its neighbours; with ``--ring`` each also on the kernel's own
  ring (``ring=True``, labelled ``ring``).

``--edge`` instead checks the kernel's edge paths (no timing): M not a
multiple of 8, N not a multiple of the column tile, rows past the groups
holding NaN in ``x`` and ``x_scales`` (must come out zero), float32 output
with and without split-K, each on all SMs and on 7 CTAs.

    PYTHONPATH=. python3 benchmarks/fp8_ragged_dot.py [--quick] [--weights a,b]
        [--tokens 16 256 ...] [--shapes M,G,K,N ...] [--ring] [--rule-only | --orders]
        [--skip-xla] [--json out.json]
    PYTHONPATH=. python3 benchmarks/fp8_ragged_dot.py --edge [--ring]
"""

from __future__ import annotations

import argparse
import itertools
import json
import math

import jax
import jax.numpy as jnp
from jax import lax

import wavetune_jax as wt
from wavetune_jax.cli.common import positive_ints
from pallas_kernels.ragged_dot.fp8 import check_shapes, fp8_ragged_dot, smem_bytes
from pallas_kernels.ragged_dot.mosaic import MosaicRaggedDotConfig as C
from pallas_kernels.ragged_dot.reference import ragged_dot_reference
from wavetune_jax.families.qragged_dot.backends import (dequantized_ragged_product, fp8_rule,
                                                        xla_qragged_dot)
from wavetune_jax.families.ragged_dot import routing
from wavetune_jax.tuning import profiler

# (name, experts, top_k, K, N): MoE expert weights of Mixtral-8x7B, Qwen3-30B-A3B
# and DeepSeek-V2-Lite (w13: gate and up fused).
WEIGHTS = [("mixtral_8x7b.w13", 8, 2, 4096, 28672), ("mixtral_8x7b.w2", 8, 2, 14336, 4096),
           ("qwen3_30b_a3b.w13", 128, 8, 2048, 1536), ("qwen3_30b_a3b.w2", 128, 8, 768, 2048),
           ("deepseek_v2_lite.w13", 64, 6, 2048, 2816), ("deepseek_v2_lite.w2", 64, 6, 1408, 2048)]
TOKENS = (1, 16, 256, 1024, 4096)


def configs(m: int, g: int, n: int, k: int, full: bool, orders: bool = False):
  """The rule's config and some neighbours; with ``orders`` 128 x 256 tiles
  walked column tiles first (order 1) and expert by expert (order 2) only."""
  r = fp8_rule(m, g, n, k, 132)
  if orders:
    return [C(block_m=128, block_n=256, num_stages=3, grid_minor=o) for o in (1, 2)]
  out = [r, C(block_m=128, block_n=256, num_stages=3, grid_minor=2),
         C(block_m=128, block_n=256, num_stages=3, grid_minor=1),
         C(block_m=64, block_n=256, num_stages=4, split_k=r.split_k),
         C(block_m=64, block_n=128, num_stages=5, split_k=r.split_k),
         C(block_m=128, block_n=128, num_stages=5)]
  if r.split_k > 1:
    out += [C(block_m=64, block_n=256, num_stages=4, split_k=s)
            for s in (r.split_k // 2, r.split_k * 2)]
  if full:
    out += [C(block_m=128, block_n=128, num_stages=5, grid_minor=2),
            C(block_m=256, block_n=128, num_stages=3, grid_minor=2),
            C(block_m=128, block_n=256, num_stages=3, grid_minor=0)]
  seen, res = set(), []
  for c in out:
    if c not in seen:
      seen.add(c)
      res.append(c)
  return res


HOPPER_SMEM = wt.get_hardware("h100").smem_per_block  # the H200 allows the same


def expert_weights(g: int, n: int, k: int):
  """Random expert weights quantized per output channel, one expert at a time
  (memory of one expert's float32 weight, not all of them: Arctic's 128 x
  9,728 x 7,168 took 36 GB a copy): ``(w [G, N, K] e4m3, scales [G, N],
  the dequantized weight [G, K, N] in bfloat16 for the bf16 baseline)``."""
  key = jax.random.PRNGKey(1)

  def one(e):
    return wt.quantize_rows(jax.random.normal(jax.random.fold_in(key, e), (n, k), jnp.float32))

  w_nk, ws = jax.lax.map(one, jnp.arange(g))
  w_bf16 = jax.jit(lambda w, s: jnp.swapaxes(
      (w.astype(jnp.float32) * s[:, :, None]).astype(jnp.bfloat16), 1, 2))(w_nk, ws)
  return w_nk, ws, w_bf16


#: ``--edge`` runs every case on all SMs and on 7 CTAs (each CTA then runs
#: several work items: the ring's slots wrap across items).
EDGE_CTAS = (None, 7)


def edge_cases(rings=(False,)) -> int:
  """The kernel's edge paths against the float32 reference (Pallas's pipeline,
  and the kernel's own ring where ``rings`` has True); returns the failures."""
  m, g, k, n = 1003, 8, 1024, 448
  x8, xs = wt.quantize_rows(jax.random.normal(jax.random.PRNGKey(0), (m, k), jnp.float32))
  w8, ws = wt.quantize_weight(jax.random.normal(jax.random.PRNGKey(1), (g, k, n)),
                              "float8_e4m3fn", layout="nk")
  gs = jnp.array([300, 0, 17, 250, 1, 200, 100, 32], jnp.int32)  # 900 rows: a tail of 103
  total = int(gs.sum())
  x8 = x8.at[total:].set(jnp.nan)
  xs = xs.at[total:].set(jnp.nan)
  ref = ragged_dot_reference(x8.astype(jnp.float32).at[total:].set(0) * jnp.nan_to_num(xs)[:, None],
                             jnp.swapaxes(w8.astype(jnp.float32) * ws[:, :, None], 1, 2), gs,
                             jnp.float32)
  fails = 0
  for c in (C(block_m=128, block_n=256, num_stages=3, grid_minor=2),
            C(block_m=128, block_n=128, num_stages=4, grid_minor=1),
            C(block_m=64, block_n=256, num_stages=4, split_k=2),
            C(block_m=64, block_n=128, num_stages=4, split_k=4, grid_minor=0),
            C(block_m=256, block_n=128, num_stages=3)):
    for out, ring, sms in itertools.product((jnp.bfloat16, jnp.float32), rings, EDGE_CTAS):
      out_bytes = 4 if c.split_k > 1 else jnp.dtype(out).itemsize
      lab = (f"{c} out={jnp.dtype(out).name}{' ring' if ring else ''}"
             f"{f' on {sms} CTAs' if sms else ''}")
      if smem_bytes(block_m=c.block_m, block_n=c.block_n, num_stages=c.num_stages,
                    out_itemsize=out_bytes) > HOPPER_SMEM:
        print(f"skip {lab}: does not fit shared memory", flush=True)
        continue  # the family's validation rejects it with a one-line error
      y = fp8_ragged_dot(x8, w8, xs, ws, gs, config=c, out_dtype=out, ring=ring,
                         num_sms=sms).astype(jnp.float32)
      err = float(jnp.max(jnp.abs(y[:total] - ref[:total])) / jnp.max(jnp.abs(ref)))
      tail = bool(jnp.all(y[total:] == 0))
      ok = err < 2e-2 and tail and bool(jnp.isfinite(y).all())
      fails += not ok
      print(f"{'ok ' if ok else 'FAIL'} {lab}: rel err {err:.2e}, tail zero {tail}", flush=True)
  return fails


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="Mixtral's w13 and DeepSeek-V2-Lite's w2, "
                  "16 and 1024 tokens")
  ap.add_argument("--full", action="store_true", help="more configs")
  ap.add_argument("--weights", help="comma-separated weight names (default: all)")
  ap.add_argument("--tokens", type=int, nargs="+", help="tokens (default: 1 16 256 1024 4096)")
  ap.add_argument("--iterations", type=int, default=10)
  ap.add_argument("--json", default=None)
  ap.add_argument("--edge", action="store_true", help="check the edge paths (no timing)")
  ap.add_argument("--ring", action="store_true",
                  help="also run every config on the kernel's own ring (ring=True)")
  ap.add_argument("--rule-only", action="store_true", help="time the rule's config only")
  ap.add_argument("--orders", action="store_true",
                  help="time 128 x 256 tiles in orders 1 and 2 only (with wt's pick)")
  ap.add_argument("--shapes", nargs="+", metavar="M,G,K,N", type=positive_ints("M,G,K,N"),
                  help="problems (rows, experts, K, N) instead of --weights x --tokens")
  ap.add_argument("--skip-xla", action="store_true",
                  help="leave out XLA's FP8 ragged dot and bf16 lax.ragged_dot (slow)")
  a = ap.parse_args(argv)
  if a.edge:
    return 1 if edge_cases((False, True) if a.ring else (False,)) else 0
  weights = [WEIGHTS[0], WEIGHTS[-1]] if a.quick else WEIGHTS
  if a.weights:
    names = a.weights.split(",")
    unknown = sorted(set(names) - {w[0] for w in WEIGHTS})
    if unknown:
      ap.error(f"unknown weights {unknown}; choose from {[w[0] for w in WEIGHTS]}")
    weights = [w for w in WEIGHTS if w[0] in names]
  tokens = (16, 1024) if a.quick else tuple(a.tokens or TOKENS)
  if a.rule_only and a.orders:
    ap.error("--rule-only and --orders choose different configs; give one")
  problems = [(wname, g, k, n, [(t, t * top_k) for t in tokens])
              for wname, g, top_k, k, n in weights]
  if a.shapes:
    if a.weights or a.tokens or a.quick:
      ap.error("--shapes names the problems: drop --weights, --tokens and --quick")
    problems = [(f"{g}x{k}x{n}", g, k, n, [(None, m)]) for m, g, k, n in a.shapes]
  prof = profiler.Profiler(iterations=a.iterations)
  dev = jax.devices()[0]
  print(dev.device_kind, jax.__version__, flush=True)
  rows = []
  for wname, g, k, n, sizes in problems:
    w_nk, ws, w_bf16 = expert_weights(g, n, k)
    for t, m in sizes:
      x8, xs = wt.quantize_rows(jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.float32))
      gs = routing.group_sizes(jax.random.PRNGKey(7), m, g)
      x_deq = x8.astype(jnp.float32) * xs[:, None]
      ref = dequantized_ragged_product(x8, w_nk, ws, gs, xs, "nk")
      x_bf16 = x_deq.astype(jnp.bfloat16)
      cands = {
          "xla_fp8": lambda x8, w, xs, ws, gs: xla_qragged_dot(
              x8, w, ws, gs, jnp.bfloat16, x_scales=xs, w_layout="nk"),
          "wt_fp8": lambda x8, w, xs, ws, gs: wt.quantized_ragged_dot(
              x8, w, ws, gs, x_scales=xs, w_layout="nk"),
      }
      if a.skip_xla:
        del cands["xla_fp8"]
      cfgs = configs(m, g, n, k, a.full, a.orders)
      for c, ring in itertools.product(cfgs[:1] if a.rule_only else cfgs,
                                       (False, True) if a.ring else (False,)):
        try:
          check_shapes(m, n, k, c)
        except ValueError:
          continue
        lab = (f"{'ring' if ring else 'mosaic'} {c.block_m}x{c.block_n} st{c.num_stages} "
               f"sk{c.split_k} g{c.grid_minor}")
        cands[lab] = (lambda c, ring: lambda x8, w, xs, ws, gs: fp8_ragged_dot(
            x8, w, xs, ws, gs, config=c, ring=ring))(c, ring)
      times, errs = {}, {}
      for lab, fn in cands.items():
        (r,) = prof.measure_many([fn], (x8, w_nk, xs, ws, gs), reference=ref,
                                 tolerance=2e-2, out_bytes=m * n * 2)
        times[lab] = r.median_us if r.status == "ok" else math.nan
        if r.status != "ok":
          errs[lab] = f"{r.status}: {(r.error or '')[:300]}"
      bf = {}
      for lab, fn in (("wt_bf16", lambda x, w, gs: wt.ragged_dot(x, w, gs)),
                      ("lax_bf16", lambda x, w, gs: lax.ragged_dot(x, w, gs))):
        if a.skip_xla and lab == "lax_bf16":
          bf[lab] = math.nan
          continue
        (r,) = prof.measure_many([fn], (x_bf16, w_bf16, gs), reference=ref, tolerance=2e-2,
                                 out_bytes=m * n * 2)
        bf[lab] = r.median_us if r.status == "ok" else math.nan
        if r.status != "ok":
          errs[lab] = f"{r.status}: {(r.error or '')[:300]}"
      mos = {lab: tm for lab, tm in times.items()
             if lab.startswith(("mosaic", "ring")) and tm == tm}
      best = min(mos, key=mos.get) if mos else None
      tflops = lambda us: 2 * m * n * k / us / 1e6
      row = {"weight": wname, "g": g, "k": k, "n": n, "tokens": t, "m": m,
             "rule": str(fp8_rule(m, g, n, k, 132)), "times": times, "bf16": bf,
             "errors": errs, "best_mosaic": best}
      rows.append(row)
      line = (f"{wname:<18} T={t or '-':<5} M={m:<6} bf16 wt {bf['wt_bf16']:8.1f} lax "
              f"{bf['lax_bf16']:8.1f} | XLA fp8 {times.get('xla_fp8', math.nan):8.1f} | wt fp8 "
              f"{times['wt_fp8']:8.1f} us ({tflops(times['wt_fp8']):5.0f} TF/s): "
              f"{bf['wt_bf16'] / times['wt_fp8']:.2f}x bf16 wt, "
              f"{times.get('xla_fp8', math.nan) / times['wt_fp8']:.2f}x XLA fp8")
      print(line, flush=True)
      for lab, tm in mos.items():
        print(f"      {lab:<36} {tm:8.1f} us {tflops(tm):6.0f} TF/s", flush=True)
      for lab, e in errs.items():
        print(f"    {lab}: {e}", flush=True)
      if a.json:  # after every row: a run cut short keeps its rows
        with open(a.json, "w") as f:
          json.dump({"device_kind": dev.device_kind, "jax": jax.__version__, "rows": rows},
                    f, indent=1)


if __name__ == "__main__":
  raise SystemExit(main())
