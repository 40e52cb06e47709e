"""W8A8-FP8 GEMM on a GPU: right, and how fast.

``y = (x @ w.T) * x_scales[:, None] * w_scales`` with ``x [M, K]`` and
``w [N, K]`` float8_e4m3fn (per-token and per-channel float32 scales, output
bfloat16). Per problem (CUPTI, L2 flushed, median of 10; every candidate
checked first against the float32 product of the dequantized operands):

* bf16 ``jnp.dot`` on the dequantized operands (what FP8 saves against);
* XLA's FP8 path, what a JAX user writes: ``lax.dot_general`` on the e4m3
  operands with ``preferred_element_type=float32``, the scales after it,
  with the weight as ``[K, N]`` (``xla_fp8_kn``) and as ``[N, K]``
  (``xla_fp8_nk``, cuBLASLt's layout);
* the Mosaic kernel (``pallas_kernels.matmul.fp8``) at a few configs, as
  ``fp8_matmul`` runs them (``mosaic``); with ``--ring`` each config both on
  Pallas's pipeline (``pipe``) and on the kernel's own ring (``ring``).

    PYTHONPATH=. python3 benchmarks/fp8_gemm.py [--quick] [--full] [--weights NAMES]
        [--m M ...] [--ring] [--rule-only] [--x-from-w] [--json out.json]
    PYTHONPATH=. python3 benchmarks/fp8_gemm.py --shapes 768,6144,4096 ... [--rule-set | --rule-only]
        [--vs-xla] [--json out.json]
    PYTHONPATH=. python3 benchmarks/fp8_gemm.py --edge

``--shapes`` runs ``M,N,K`` problems of no named weight; ``--rule-set`` times
every config the rule weighs (:func:`~pallas_kernels.matmul.fp8.rule_candidates`)
with 128 x 192 tiles (4 stages) among them, in place of the neighbours;
``--vs-xla`` times only XLA's FP8 dot on the ``[N, K]`` weight beside them.
``--edge`` checks the kernel's edge paths on both (ragged M and N, one row,
K splits whose last runs past K, fp32 output, 7 CTAs walking many tiles)
against the float32 reference and exits 1 on a failure.

The rule's config (first) is the one ``wt.quantized_matmul`` runs on this GPU
(its cost model scaled to the GPU's HBM bandwidth, over the GPU's tiles).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import sys

import jax
import jax.numpy as jnp
from jax import lax

from pallas_kernels.matmul.fp8 import (HBM_TBS, RULE_TILES, WIDE_TILES, check_shapes,
                                       fp8_matmul, heuristic_config, k_steps, rule_candidates,
                                       rule_tiles, smem_bytes, wave_split)
from pallas_kernels.matmul.mosaic import MosaicMatmulConfig as C
from wavetune_jax import get_hardware, quantize_rows
from wavetune_jax.core.hardware import device_key
from wavetune_jax.tuning import profiler

# (name, K, N): Llama-3-8B's and Qwen2.5-1.5B's MLP and attention output, and 8192^3.
WEIGHTS = [("llama3_8b.w1", 4096, 14336), ("llama3_8b.w2", 14336, 4096),
           ("llama3_8b.wo", 4096, 4096), ("qwen2_5_1_5b.w13", 1536, 17920),
           ("qwen2_5_1_5b.w2", 8960, 1536), ("square_8192", 8192, 8192)]
MS = (16, 64, 256, 2048, 4096, 8192)
#: Down projections of models outside the suite, run only when named in
#: --weights: where a rule's K split leaves part of the SMs idle at a few rows.
EXTRA_WEIGHTS = [("mistral_nemo_12b.down", 14336, 5120), ("gemma_2_9b.down", 14336, 3584),
                 ("qwen2_5_7b.down", 18944, 3584)]


def configs(m: int, n: int, k: int, full: bool, hbm_tbs: float | None = None,
            tiles=RULE_TILES):
  """The rule's config (for a GPU of ``hbm_tbs`` TB/s weighing ``tiles``) and
  some neighbours."""
  out = [heuristic_config(m, n, k, 132, hbm_tbs, tiles=tiles)]
  r = out[0]
  if r.block_n == 128:  # the 256-column tile the rule passed over
    out.append(C(block_m=r.block_m, block_n=256, num_stages=3 if r.block_m > 64 else 4,
                 split_k=r.split_k, grid_width=r.grid_width))
  if r.grid_width == 1:  # below a wave of tiles: the split halved and doubled, no
    # split, and 128-column tiles split to fill a wave
    for sk in sorted({1, max(1, r.split_k // 2), r.split_k * 2}):
      out.append(C(block_m=r.block_m, block_n=256, num_stages=3 if r.block_m > 64 else 4,
                   split_k=sk))
    if full and r.block_n == 128 and k_steps(k, r.split_k * 2) >= 4:  # twice the split
      out.append(dataclasses.replace(r, split_k=r.split_k * 2))
    for bm in ((64, 128) if m > 64 else (64,)):
      tiles = -(-m // bm) * -(-n // 128)
      for sk in sorted({1, wave_split(tiles, k, 132)}):
        out.append(C(block_m=bm, block_n=128, num_stages=4, split_k=sk))
  elif m > 64:
    out += [C(block_m=256, block_n=128, num_stages=4, grid_width=8),
            C(block_m=128, block_n=128, num_stages=5, grid_width=8),
            C(block_m=128, block_n=256, num_stages=3, grid_minor=0, grid_width=8)]
    if full:
      out += [C(block_m=128, block_n=192, num_stages=4, grid_width=8),
              C(block_m=128, block_n=256, num_stages=3, grid_width=16),
              C(block_m=256, block_n=128, num_stages=3, grid_width=1)]
  if full and m <= 64:
    out.append(C(block_m=64, block_n=128, num_stages=5, split_k=r.split_k))
    # Splits past a wave: shorter K per split (the accumulator's error grows
    # with it) for more CTAs than SMs.
    for bn in (128, 256):
      for sk in (8, 16):
        if k_steps(k, sk) >= 4:
          out.append(C(block_m=64, block_n=bn, num_stages=4, split_k=sk))
  seen, res = set(), []
  for c in out:
    if c not in seen:
      seen.add(c)
      res.append(c)
  return res


#: ``--edge``: (M, N, K) with M and N off the tiles, one row, and K of 6 and
#: 10 steps of 128 (a split of 4 runs its last split past K).
EDGE_PROBLEMS = ((1000, 448, 768), (1, 320, 768), (136, 1088, 1280))
EDGE_CONFIGS = (C(block_m=128, block_n=256, num_stages=3),
                C(block_m=128, block_n=128, num_stages=5, grid_minor=0, grid_width=8),
                C(block_m=64, block_n=256, num_stages=4, split_k=2),
                C(block_m=64, block_n=128, num_stages=4, split_k=4),
                C(block_m=256, block_n=128, num_stages=3),
                C(block_m=128, block_n=192, num_stages=4))
#: All SMs, and 7 CTAs (each walks many tiles: the ring's slots wrap across them).
EDGE_CTAS = (None, 7)
HOPPER_SMEM = get_hardware("h100").smem_per_block  # the H200 allows the same


def edge_cases() -> int:
  """Every edge config on Pallas's pipeline and on the ring, bf16 and fp32
  output, all SMs and 7 CTAs, against the float32 reference; returns the
  failures."""
  fails = 0
  for m, n, k in EDGE_PROBLEMS:
    x8, xs = quantize_rows(jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.float32))
    w8, ws = quantize_rows(jax.random.normal(jax.random.PRNGKey(n), (n, k), jnp.float32))
    ref = lax.dot_general(x8.astype(jnp.float32), w8.astype(jnp.float32),
                          (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST)
    ref = ref * xs[:, None] * ws[None, :]
    for c, out, ring, sms in itertools.product(EDGE_CONFIGS, (jnp.bfloat16, jnp.float32),
                                               (False, True), EDGE_CTAS):
      lab = (f"M={m} N={n} K={k} {c.block_m}x{c.block_n} st{c.num_stages} sk{c.split_k} "
             f"out={jnp.dtype(out).name} {'ring' if ring else 'pipe'}"
             f"{f' on {sms} CTAs' if sms else ''}")
      out_bytes = 4 if c.split_k > 1 else jnp.dtype(out).itemsize
      try:
        check_shapes(m, n, k, x8.dtype, w8.dtype, c)
      except ValueError as e:
        print(f"skip {lab}: {e}", flush=True)
        continue
      if smem_bytes(block_m=c.block_m, block_n=c.block_n, num_stages=c.num_stages,
                    out_itemsize=out_bytes) > HOPPER_SMEM:
        print(f"skip {lab}: does not fit shared memory", flush=True)
        continue
      y = fp8_matmul(x8, w8, xs, ws, config=c, out_dtype=out, ring=ring,
                     num_sms=sms).astype(jnp.float32)
      err = float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref)))
      ok = err < 2e-2 and bool(jnp.isfinite(y).all())
      fails += not ok
      print(f"{'ok ' if ok else 'FAIL'} {lab}: rel err {err:.2e}", flush=True)
  print(f"{fails} failed", flush=True)
  return fails


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true",
                  help="Llama-3-8B w1 and 8192^3 at M 16, 64, 2048, 8192")
  ap.add_argument("--full", action="store_true",
                  help="more configs: above 64 rows, and splits past a wave at 64 or fewer")
  ap.add_argument("--weights", help="comma-separated weight names, of the default set or of "
                  + ",".join(w[0] for w in EXTRA_WEIGHTS) + " (default: the set; with "
                  "--quick the names still choose the weights)")
  ap.add_argument("--m", type=int, nargs="+", help="rows (default: 16 64 256 2048 4096 8192)")
  ap.add_argument("--x-from-w", action="store_true",
                  help="x = the weight's first M rows (same-sign sums: an accuracy check)")
  ap.add_argument("--ring", action="store_true",
                  help="every config on Pallas's pipeline (pipe) and on the kernel's own ring")
  ap.add_argument("--rule-only", action="store_true", help="the rule's config only")
  ap.add_argument("--shapes", nargs="+", metavar="M,N,K", help="problems M,N,K (no named weight)")
  ap.add_argument("--vs-xla", action="store_true",
                  help="against XLA's FP8 dot on the [N, K] weight only (no bf16 dot, no [K, N])")
  ap.add_argument("--rule-set", action="store_true",
                  help="the rule's config and every other it weighs, 128 x 192 tiles among them")
  ap.add_argument("--compare-splits", action="store_true",
                  help="with --shapes: the rule over any K split count against the rule over "
                       "powers of two where they differ (and XLA's FP8 dot)")
  ap.add_argument("--edge", action="store_true",
                  help="check the edge cases on both (no timing); exit 1 on a failure")
  ap.add_argument("--iterations", type=int, default=10)
  ap.add_argument("--json", default=None)
  a = ap.parse_args(argv)
  if a.rule_only and a.rule_set:
    ap.error("--rule-only and --rule-set exclude each other")
  if a.compare_splits and (not a.shapes or a.rule_only or a.rule_set or a.full or a.ring):
    ap.error("--compare-splits takes --shapes and no other config flag")
  if a.shapes and (a.weights or a.m or a.quick):
    ap.error("--shapes names the problems: drop --weights, --m and --quick")
  if a.edge and (a.shapes or a.weights or a.m or a.quick or a.ring or a.rule_only or a.rule_set):
    ap.error("--edge runs the fixed edge cases: it takes no problem or config flags")
  shape_ms = {}
  for spec in a.shapes or ():
    try:
      m, n, k = (int(v) for v in spec.split(","))
    except ValueError:
      ap.error(f"--shapes: {spec!r} is not M,N,K")
    if min(m, n, k) < 1:
      ap.error(f"--shapes: {spec!r} needs positive sizes")
    shape_ms.setdefault((n, k), []).append(m)
  weights = [WEIGHTS[0], WEIGHTS[-1]] if a.quick else WEIGHTS
  if a.weights:
    names = a.weights.split(",")
    known = WEIGHTS + EXTRA_WEIGHTS
    unknown = sorted(set(names) - {w[0] for w in known})
    if unknown:
      ap.error(f"unknown weights {unknown}; choose from {[w[0] for w in known]}")
    weights = [w for w in known if w[0] in names]
  if a.edge:
    print(jax.devices()[0].device_kind, jax.__version__, flush=True)
    return 1 if edge_cases() else 0
  prof = profiler.Profiler(iterations=a.iterations)
  dev = jax.devices()[0]
  print(dev.device_kind, jax.__version__, flush=True)
  rows = []
  if shape_ms:
    weights = [(f"{n}x{k}", k, n) for n, k in shape_ms]
  for wname, k, n in weights:
    kw = jax.random.PRNGKey(1)
    w_src = jax.random.normal(kw, (n, k), jnp.float32)
    w_nk, ws = quantize_rows(w_src)
    w_kn = w_nk.T
    w_bf16 = (w_nk.astype(jnp.float32) * ws[:, None]).astype(jnp.bfloat16).T
    ms = shape_ms.get((n, k)) or ((8192,) if wname == "square_8192" else (
        (16, 64, 2048, 8192) if a.quick else tuple(a.m or MS)))
    for m in ms:
      if a.x_from_w and m > n:
        print(f"{wname} M={m}: --x-from-w needs M <= N={n}; skipped", flush=True)
        continue
      # x's key differs from w's at every M; --x-from-w takes x as w's first
      # rows, so that output (i, i) sums K products of one sign: the worst case
      # of an accumulator that keeps fewer bits than fp32.
      x_src = (w_src[:m] if a.x_from_w else
               jax.random.normal(jax.random.fold_in(jax.random.PRNGKey(2), m), (m, k), jnp.float32))
      x8, xs = quantize_rows(x_src)
      x_bf16 = (x8.astype(jnp.float32) * xs[:, None]).astype(jnp.bfloat16)
      ref = lax.dot_general(x8.astype(jnp.float32), w_nk.astype(jnp.float32),
                            (((1,), (1,)), ((), ())), precision=lax.Precision.HIGHEST)
      ref = ref * xs[:, None] * ws[None, :]

      def xla_fp8(dims):
        def f(x8, w, xs, ws):
          acc = lax.dot_general(x8, w, (dims, ((), ())), preferred_element_type=jnp.float32)
          return (acc * xs[:, None] * ws[None, :]).astype(jnp.bfloat16)
        return f

      cands = {"xla_fp8_nk": (xla_fp8(((1,), (1,))), w_nk)}
      if not a.vs_xla:
        cands["xla_fp8_kn"] = (xla_fp8(((1,), (0,))), w_kn)
      key = device_key(dev.device_kind)
      cfgs = configs(m, n, k, a.full, HBM_TBS.get(key), rule_tiles(key))
      if a.compare_splits:
        cfgs = [heuristic_config(m, n, k, 132, HBM_TBS.get(key), tiles=rule_tiles(key),
                                 any_split=s) for s in (False, True)]
        if cfgs[0] == cfgs[1]:
          continue
        print(f"{wname} M={m}: powers of two {cfgs[0]}, any split {cfgs[1]}", flush=True)
      if a.rule_set:
        cfgs = cfgs[:1] + [c for c in rule_candidates(m, n, k, 132, RULE_TILES + WIDE_TILES)
                           if c != cfgs[0]]
      for c, ring in itertools.product(cfgs[:1] if a.rule_only else cfgs,
                                       (False, True) if a.ring else (None,)):
        try:
          check_shapes(m, n, k, x8.dtype, w_nk.dtype, c)
        except ValueError as e:
          print(f"    {c}: not run ({e})", flush=True)
          continue
        kind = {None: "mosaic", False: "pipe", True: "ring"}[ring]
        lab = (f"{kind} {c.block_m}x{c.block_n} st{c.num_stages} sk{c.split_k} "
               f"g{c.grid_minor}/{c.grid_width}")
        cands[lab] = ((lambda c, ring: lambda x8, w, xs, ws: fp8_matmul(
            x8, w, xs, ws, config=c, ring=ring))(c, ring), w_nk)
      times, errs, rel = {}, {}, {}
      for lab, (fn, wt) in cands.items():
        (r,) = prof.measure_many([fn], (x8, wt, xs, ws), reference=ref, tolerance=2e-2,
                                 out_bytes=m * n * 2)
        times[lab] = r.median_us if r.status == "ok" else math.nan
        rel[lab] = r.rel_error
        if r.status != "ok":
          errs[lab] = f"{r.status}: {(r.error or '')[:300]}"
      bf_us = math.nan
      if not a.vs_xla:
        (bf,) = prof.measure_many([lambda x, wb: jnp.dot(x, wb)], (x_bf16, w_bf16))
        bf_us = bf.median_us
      mos = {lab: t for lab, t in times.items()
             if lab.startswith(("mosaic", "pipe", "ring")) and t == t}
      best = min(mos, key=mos.get) if mos else None
      tflops = lambda us: 2 * m * n * k / us / 1e6
      xla = min(times["xla_fp8_nk"], times.get("xla_fp8_kn", math.inf))
      row = {"weight": wname, "k": k, "n": n, "m": m,
             "bf16_dot_us": None if a.vs_xla else bf_us,
             "times": times, "errors": errs, "rel_errors": rel, "best_mosaic": best}
      rows.append(row)
      line = f"{wname:<16} M={m:<5} XLA fp8 nk {times['xla_fp8_nk']:8.1f} us"
      if not a.vs_xla:
        line = (f"{wname:<16} M={m:<5} bf16 {bf_us:8.1f} us ({tflops(bf_us):5.0f} TF/s) | "
                f"XLA fp8 nk {times['xla_fp8_nk']:8.1f} kn {times['xla_fp8_kn']:8.1f}")
      if best:
        t = mos[best]
        line += (f" | {best} {t:8.1f} us {tflops(t):5.0f} TF/s: "
                 + ("" if a.vs_xla else f"{bf_us / t:.2f}x bf16, ") + f"{xla / t:.3f}x XLA fp8")
      print(line, flush=True)
      for lab, t in mos.items():
        print(f"      {lab:<40} {t:8.1f} us {tflops(t):6.0f} TF/s", flush=True)
      for lab, e in errs.items():
        print(f"    {lab}: {e}", flush=True)
      if a.x_from_w:
        print("    relative errors: " + ", ".join(
            f"{lab} {e:.4f}" for lab, e in rel.items() if e is not None), flush=True)
      if a.json:  # after every row: a run cut short keeps its rows
        with open(a.json, "w") as f:
          json.dump({"device_kind": dev.device_kind, "jax": jax.__version__, "rows": rows},
                    f, indent=1)


if __name__ == "__main__":
  sys.exit(main())
