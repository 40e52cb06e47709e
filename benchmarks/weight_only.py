"""Weight-only 8-bit GEMM on a GPU: right, and how fast.

``y = (x @ w) * scales`` with ``x [M, K]`` bfloat16, ``w [K, N]`` int8 or
float8_e4m3fn and per-output-channel float32 scales. Per problem (CUPTI, L2
flushed, median of 10; every candidate checked first against the float32
product of ``x`` and the dequantized weight): bfloat16 ``jnp.dot`` on the
dequantized weight (what the 8-bit weight saves against), XLA's dequantize
then dot (what a JAX user writes: ``jnp.dot(x, (w * scales).astype(bf16))``),
XLA's dot on the converted 8-bit weight with the scales after it, and the
Mosaic kernel (``pallas_kernels.matmul.weight_only``) at a few configs.

``--layout nk`` takes the weight as ``[N, K]`` (K contiguous; ``y = (x @
w.T) * scales``), every candidate on that layout, and the Mosaic kernel is
the swapped one (``pallas_kernels.matmul.weight_only_nk``: the 8-bit block
converted in registers and fed to wgmma from there), up to 64 rows.

``--weights int4`` (layout ``[N, K]``) takes int4 weights with a float32
scale per ``--group`` (64 or 128) values of each channel along K, ``y = x @
dequant(w).T``: bfloat16 ``dot``, XLA's dequantize then dot, the swapped
kernel on the int4 weight (its rule and neighbours), and on the int8 weight
of the same shape at its rule (what the 4-bit weight saves against).

    PYTHONPATH=. python3 benchmarks/weight_only.py [--quick] [--layout kn|nk] [--json out.json]
    PYTHONPATH=. python3 benchmarks/weight_only.py --weights int4 [--group 128] [--json out.json]
    PYTHONPATH=. python3 benchmarks/weight_only.py --layout nk --grid [--only NAME ...] [--dtypes int8]

``--grid`` (``--layout nk``) times every channel tile and power-of-two K
split (up to 8) at the rule's stages instead of the rule and its
neighbours; ``--only`` keeps the named weights (``WEIGHTS``, and
``EXTRA_WEIGHTS``: Llama-3-8B's ``wqkv``, fused ``w13`` and LM head),
``--dtypes`` the named weight dtypes, ``--splits`` the grid's K splits
(default 1 2 4 8), ``--rows`` the row counts.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import jax
import jax.numpy as jnp

from pallas_kernels.matmul.mosaic import MosaicMatmulConfig, empty_split
from pallas_kernels.matmul import weight_only_nk as nk_kernel
from pallas_kernels.matmul.weight_only import check_shapes, decode_config, weight_only_matmul
from wavetune_jax.core.hardware import device_key
from wavetune_jax.tuning import profiler

# (name, K, N): Llama-3-8B's MLP and attention output.
WEIGHTS = [("llama3_8b.w1", 4096, 14336), ("llama3_8b.w2", 14336, 4096),
           ("llama3_8b.wo", 4096, 4096), ("qwen2_5_1_5b.w13", 1536, 17920),
           ("qwen2_5_1_5b.w2", 8960, 1536)]
#: Weights ``--only`` can name besides :data:`WEIGHTS`.
EXTRA_WEIGHTS = [("llama3_8b.wqkv", 4096, 6144), ("llama3_8b.w13", 4096, 28672),
                 ("llama3_8b.lm_head", 4096, 128256)]
#: Rows; 2,048 (prefill: XLA's GEMM is the faster there) on the first weight only.
MS = (1, 16, 64, 2048)


def configs(m: int, k: int, n: int):
  """The rule's config (``decode_config``), its split halved and doubled,
  and 5 stages; 128 x 128 tiles above 64 rows."""
  if m > 64:
    return [MosaicMatmulConfig(block_m=128, block_n=128, num_stages=4)]
  rule = decode_config(m, k, n, 132)
  out = [rule, dataclasses.replace(rule, num_stages=5), dataclasses.replace(rule, num_stages=3)]
  for sk in (rule.split_k // 2, rule.split_k * 2):
    if 1 <= sk <= k // 64:
      out.append(dataclasses.replace(rule, split_k=sk))
  return out


def _any_split() -> bool:
  """Whether the swapped kernel's rule takes any K split count on this GPU
  (``weight_only_nk.ANY_SPLIT_GPUS``), as the family's backend runs it."""
  return device_key(jax.devices()[0].device_kind) in nk_kernel.ANY_SPLIT_GPUS


def _wide_step():
  """The rule's cost of a 256-channel step on this GPU (``weight_only_nk.WIDE_STEP``;
  None: the default count of 2)."""
  return nk_kernel.WIDE_STEP.get(device_key(jax.devices()[0].device_kind))


def nk_configs(m: int, k: int, n: int):
  """The swapped kernel's rule (``weight_only_nk.decode_config`` with this
  GPU's ``WIDE_STEP``), every power-of-two split up to 16 at its stages, 3
  and 6 stages, and the other channel tile at the rule's split and at the
  split that gives the same CTAs."""
  rule = nk_kernel.decode_config(m, k, n, 132, wide_step=_wide_step(), any_split=_any_split())
  if rule is None:
    return []
  out = [rule] + [dataclasses.replace(rule, num_stages=st) for st in (3, 6)]
  out += [dataclasses.replace(rule, split_k=sk) for sk in (1, 2, 4, 8, 16) if sk != rule.split_k]
  other = 384 - rule.block_n
  out.append(dataclasses.replace(rule, block_n=other))
  # the other tile at the same CTAs: twice the split for 256 channels, half for 128
  sk = rule.split_k * 2 if other == 256 else rule.split_k // 2
  if sk >= 1 and k // nk_kernel.STEP_K // sk >= 2:
    out.append(dataclasses.replace(rule, block_n=other, split_k=sk))
  return out


def nk_grid(m: int, k: int, n: int, splits=(1, 2, 4, 8)):
  """Every channel tile and K split of ``splits`` (at least two K steps a
  split, none empty) at the rule's stages."""
  rule = nk_kernel.decode_config(m, k, n, 132)
  if rule is None:
    return []
  steps = k // nk_kernel.STEP_K
  return [dataclasses.replace(rule, block_n=bn, split_k=sk)
          for bn in nk_kernel.BLOCK_N for sk in splits
          if n % bn == 0 and steps // sk >= 2 and not empty_split(steps, sk)]


def int4_configs(m: int, k: int, n: int, a_group: int):
  """The swapped kernel's rule on int4 (steps of 256), 3 and 6 stages, the
  split halved and doubled, and the other channel tile."""
  rule = nk_kernel.decode_config(m, k, n, 132, group=a_group, any_split=_any_split())
  if rule is None:
    return []
  out = [rule] + [dataclasses.replace(rule, num_stages=st) for st in (3, 6)]
  out += [dataclasses.replace(rule, split_k=sk) for sk in (rule.split_k // 2, rule.split_k * 2)
          if sk >= 1]
  other = 384 - rule.block_n
  out.append(dataclasses.replace(rule, block_n=other))
  # the other tile at the same CTAs: twice the split for 256 channels, half for 128
  sk = rule.split_k * 2 if other == 256 else rule.split_k // 2
  if sk >= 1 and k // nk_kernel.STEP_K // sk >= 2:
    out.append(dataclasses.replace(rule, block_n=other, split_k=sk))
  return out


def dequantize_int4(w, s):
  """``w [N, K]`` int4 and ``s [K // group, N]`` -> the float32 ``[N, K]`` weight."""
  n, k = w.shape
  g = k // s.shape[0]
  return (w.astype(jnp.float32).reshape(n, k // g, g) * s.T[:, :, None]).reshape(n, k)


def _summary(res: dict):
  """``(times, errors, Mosaic times, fastest Mosaic label)`` of measured candidates."""
  times = {lab: (r.median_us if r.status == "ok" else math.nan) for lab, r in res.items()}
  errs = {lab: f"{r.status}: {(r.error or '')[:150]}" for lab, r in res.items()
          if r.status != "ok"}
  mos = {lab: t for lab, t in times.items() if lab.startswith("mosaic") and t == t}
  return times, errs, mos, (min(mos, key=mos.get) if mos else None)


def _report(line: str, errs: dict, rows: list, json_path, dev) -> None:
  """Prints a problem's line and its failed candidates; rewrites the JSON
  after every row (a run cut short keeps its rows)."""
  print(line, flush=True)
  for lab, e in errs.items():
    print(f"    {lab}: {e}", flush=True)
  if json_path:
    with open(json_path, "w") as f:
      json.dump({"device_kind": dev.device_kind, "jax": jax.__version__, "rows": rows}, f,
                indent=1)


def run_int4(a, prof, dev) -> None:
  """The int4 rows (``--weights int4``)."""
  dot = _dot("nk")
  rows = []
  for wname, k, n in (WEIGHTS[:1] if a.quick else WEIGHTS):
    kw, ks = jax.random.split(jax.random.PRNGKey(1))
    w = jax.random.randint(kw, (n, k), -8, 8, jnp.int32).astype(jnp.int4)
    s = jax.random.uniform(ks, (k // a.group, n), jnp.float32, 0.5, 1.5) / (7 * math.sqrt(k))
    w32 = dequantize_int4(w, s)
    w_bf16 = w32.astype(jnp.bfloat16)
    w8 = w.astype(jnp.int8)
    s8 = jax.random.uniform(ks, (n,), jnp.float32, 0.5, 1.5) / (127 * math.sqrt(k))
    for m in (1, 16, 64, 128):
      x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.float32).astype(jnp.bfloat16)
      ref = dot(x.astype(jnp.float32), w32, precision=jax.lax.Precision.HIGHEST)
      cands = {"xla_dequant_dot": lambda x, w, s: dot(x, dequantize_int4(w, s).astype(
          jnp.bfloat16))}
      # Above 64 rows: the rule's config at 64, on chunks of 64 rows (as the
      # quantized GEMM's Mosaic backend runs it).
      chunk = nk_kernel.MAX_M
      for c in (int4_configs(m, k, n, a.group) if m <= chunk else
                int4_configs(chunk, k, n, a.group)[:1]):
        try:
          nk_kernel.check_shapes(min(m, chunk), n, k, jnp.bfloat16, jnp.int4, c, a.group)
        except ValueError:
          continue
        cands[f"mosaic {c.block_m}x{c.block_n} st{c.num_stages} sk{c.split_k}"] = (
            lambda c: lambda x, w, s: jnp.concatenate([
                nk_kernel.weight_only_matmul_nk(x[i:i + chunk], w, s, config=c)
                for i in range(0, x.shape[0], chunk)]))(c)
      res = dict(zip(cands, prof.measure_many(list(cands.values()), (x, w, s), reference=ref,
                                              tolerance=2e-2, out_bytes=m * n * 4)))
      (bf,) = prof.measure_many([lambda x, wb: dot(x, wb)], (x, w_bf16))
      int8_t = math.nan
      rule8 = (nk_kernel.decode_config(m, k, n, 132, wide_step=_wide_step(),
                                       any_split=_any_split()) if m <= chunk else None)
      if rule8 is not None:
        (r8,) = prof.measure_many([lambda x, w, s: nk_kernel.weight_only_matmul_nk(
            x, w, s, config=rule8)], (x, w8, s8))
        int8_t = r8.median_us if r8.status == "ok" else math.nan
      times, errs, mos, best = _summary(res)
      rows.append({"weight": wname, "k": k, "n": n, "w_dtype": "int4", "group": a.group,
                   "m": m, "layout": "nk", "bf16_dot_us": bf.median_us,
                   "int8_nk_rule_us": int8_t, "times": times, "errors": errs,
                   "best_mosaic": best})
      line = (f"{wname} int4 g{a.group} M={m:<3} bf16 dot {bf.median_us:7.1f} us | XLA "
              f"dequant+dot {times['xla_dequant_dot']:7.1f} | int8 kernel {int8_t:6.1f}")
      if best:
        t = mos[best]
        line += (f" | {best} {t:6.1f} us: {bf.median_us / t:.2f}x bf16, "
                 f"{times['xla_dequant_dot'] / t:.2f}x XLA, {int8_t / t:.2f}x int8")
      _report(line, errs, rows, a.json, dev)


def compare_splits(a, prof, dev, shapes) -> None:
  """A kernel's rule over every K split against its rule over powers of two
  (``decode_config(any_split=False)``) where they differ, and XLA (its dot
  on the 8-bit weight; dequantize then dot for int4), each checked against
  the float32 product: the swapped kernel (``--layout nk``; ``--weights
  int4`` with ``--group``) or the ``[K, N]`` one (``--layout kn``)."""
  from pallas_kernels.matmul import weight_only as kn_kernel
  nk, int4 = a.layout == "nk", a.weights == "int4"
  print(dev.device_kind, jax.__version__, f"layout {a.layout}",
        f"int4 g{a.group}" if int4 else "", "every split against powers of two", flush=True)
  wide, rows, cores = _wide_step(), [], dev.core_count
  dot = _dot(a.layout)
  for k, n in shapes:
    for wd in ("int4",) if int4 else (a.dtypes or ("int8",)):
      kw, ks = jax.random.split(jax.random.PRNGKey(1))
      shape = (n, k) if nk else (k, n)
      if int4:
        w = jax.random.randint(kw, shape, -8, 8, jnp.int32).astype(jnp.int4)
        s = jax.random.uniform(ks, (k // a.group, n), jnp.float32, 0.5, 1.5) / (7 * math.sqrt(k))
        w32 = dequantize_int4(w, s)
      else:
        if wd == "int8":
          w = jax.random.randint(kw, shape, -127, 128, jnp.int32).astype(jnp.int8)
        else:
          w = (jax.random.normal(kw, shape, jnp.float32) * 64).astype(jnp.float8_e4m3fn)
        s = jax.random.uniform(ks, (n,), jnp.float32, 0.5, 1.5) / (127 * math.sqrt(k))
        w32 = w.astype(jnp.float32) * (s[:, None] if nk else s)
      for m in a.rows or (1, 16, 64):
        if nk:
          group = a.group if int4 else 0
          before, after = (nk_kernel.decode_config(m, k, n, cores, group=group, wide_step=wide,
                                                   any_split=any_split)
                           for any_split in (False, True))
          run = nk_kernel.weight_only_matmul_nk
        else:
          before, after = (kn_kernel.decode_config(m, k, n, cores, any_split=any_split)
                           for any_split in (False, True))
          run = weight_only_matmul
        if before is None or before == after:
          continue
        x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.float32).astype(jnp.bfloat16)
        ref = dot(x.astype(jnp.float32), w32, precision=jax.lax.Precision.HIGHEST)
        cands = [lambda x, w, s, c=c: run(x, w, s, config=c) for c in (before, after)]
        if int4:
          cands.append(lambda x, w, s: dot(x, dequantize_int4(w, s).astype(jnp.bfloat16)))
        else:
          cands.append(lambda x, w, s: (dot(x, w.astype(jnp.bfloat16),
                                            preferred_element_type=jnp.float32)
                                        * s).astype(jnp.bfloat16))
        tb, ta, tx = prof.measure_many(cands, (x, w, s), reference=ref, tolerance=2e-2,
                                       out_bytes=m * n * 4)
        row = {"k": k, "n": n, "m": m, "w_dtype": wd, "layout": a.layout,
               "group": a.group if int4 else 0,
               "before": [before.block_n, before.split_k], "after": [after.block_n, after.split_k],
               "before_us": tb.median_us, "after_us": ta.median_us, "xla_us": tx.median_us,
               "errors": {c: t.error for c, t in zip(("before", "after", "xla"), (tb, ta, tx))
                          if t.error}}
        rows.append(row)
        ratio = (tb.median_us / ta.median_us if tb.median_us and ta.median_us
                 else float("nan"))
        line = (f"K={k:6d} N={n:6d} M={m:3d} {wd:<13} before {before.block_n}/{before.split_k} "
                f"{tb.median_us or float('nan'):7.1f} us | after {after.block_n}/"
                f"{after.split_k} {ta.median_us or float('nan'):7.1f} us: {ratio:.3f}x | XLA "
                f"{tx.median_us or float('nan'):7.1f}")
        _report(line, row["errors"], rows, a.json, dev)


def _dot(layout: str):
  dims = (((1,), (0 if layout == "kn" else 1,)), ((), ()))
  return lambda x, w, **kw: jax.lax.dot_general(x, w, dims, **kw)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true",
                  help="the first weight only (and int8 only, without --weights int4)")
  ap.add_argument("--layout", choices=("kn", "nk"), default=None,
                  help="the weight as [K, N] (default) or [N, K]")
  ap.add_argument("--weights", choices=("int8", "int4"), default="int8",
                  help="8-bit weights (int8 and e4m3; default) or int4 ([N, K] only)")
  ap.add_argument("--group", type=int, choices=nk_kernel.INT4_GROUPS, default=128,
                  help="int4: values of K per scale (default 128)")
  ap.add_argument("--grid", action="store_true",
                  help="--layout nk: every channel tile and split up to 8")
  ap.add_argument("--splits", type=int, nargs="+", default=[1, 2, 4, 8],
                  help="--grid: the K splits to time (default 1 2 4 8)")
  ap.add_argument("--rows", type=int, nargs="+", default=None,
                  help="these row counts only (default 1 16 64, and 2048 on the first weight)")
  ap.add_argument("--only", nargs="+", default=None, help="these weights only")
  ap.add_argument("--compare-splits", nargs="+", default=None, metavar="K,N",
                  help="with --layout kn or nk (and --weights int4): on these weights, a "
                       "kernel's rule over every K split against its rule over powers of "
                       "two (and XLA), at --rows")
  ap.add_argument("--dtypes", nargs="+", choices=("int8", "float8_e4m3fn"), default=None,
                  help="these weight dtypes only")
  ap.add_argument("--iterations", type=int, default=10)
  ap.add_argument("--json", default=None)
  a = ap.parse_args(argv)
  if a.grid and a.layout != "nk":
    ap.error("--grid takes --layout nk")
  if any(sk < 1 for sk in a.splits) or any(m < 1 for m in a.rows or ()):
    ap.error("--splits and --rows take positive integers")
  names = [w[0] for w in WEIGHTS + EXTRA_WEIGHTS]
  for name in a.only or ():
    if name not in names:
      ap.error(f"--only: unknown weight {name!r}; known: {', '.join(names)}")
  shapes = []
  for spec in a.compare_splits or ():
    try:
      k, n = (int(v) for v in spec.split(","))
    except ValueError:
      ap.error(f"--compare-splits takes K,N pairs of integers; got {spec!r}")
    shapes.append((k, n))
  if shapes and (a.layout is None or (a.weights == "int4" and a.layout != "nk")):
    ap.error("--compare-splits takes --layout kn or nk (int4: nk)")
  prof = profiler.Profiler(iterations=a.iterations)
  dev = jax.devices()[0]
  if shapes:
    return compare_splits(a, prof, dev, shapes)
  if a.weights == "int4":
    if a.layout == "kn":
      ap.error("--weights int4 takes the weight as [N, K] (--layout nk)")
    print(dev.device_kind, jax.__version__, f"int4 weights [N, K], group {a.group}", flush=True)
    return run_int4(a, prof, dev)
  a.layout = a.layout or "kn"
  print(dev.device_kind, jax.__version__, f"weight layout {a.layout}", flush=True)
  nk = a.layout == "nk"
  dot = _dot(a.layout)
  rows = []
  wdtypes = a.dtypes or (("int8",) if a.quick else ("int8", "float8_e4m3fn"))
  weights = WEIGHTS[:1] if a.quick else WEIGHTS
  if a.only:
    weights = [w for w in WEIGHTS + EXTRA_WEIGHTS if w[0] in a.only]
  for wname, k, n in weights:
    for wd in wdtypes:
      kw, ks = jax.random.split(jax.random.PRNGKey(1))
      shape = (n, k) if nk else (k, n)
      if wd == "int8":
        w = jax.random.randint(kw, shape, -127, 128, jnp.int32).astype(jnp.int8)
      else:
        w = (jax.random.normal(kw, shape, jnp.float32) * 64).astype(jnp.float8_e4m3fn)
      s = jax.random.uniform(ks, (n,), jnp.float32, 0.5, 1.5) / (127 * math.sqrt(k))
      sb = s[:, None] if nk else s  # the scales along w's channel axis
      w_bf16 = (w.astype(jnp.float32) * sb).astype(jnp.bfloat16)
      for m in a.rows or (MS if wname == WEIGHTS[0][0] else MS[:-1]):
        if nk and m > nk_kernel.MAX_M:
          continue
        x = jax.random.normal(jax.random.PRNGKey(m), (m, k), jnp.float32).astype(jnp.bfloat16)
        ref = dot(x.astype(jnp.float32), w.astype(jnp.float32) * sb,
                  precision=jax.lax.Precision.HIGHEST)
        cands = {
            "xla_dequant_dot": lambda x, w, s: dot(
                x, (w.astype(jnp.float32) * (s[:, None] if nk else s)).astype(jnp.bfloat16)),
            "xla_dot_scale": lambda x, w, s: (dot(
                x, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
                * s).astype(jnp.bfloat16),
        }
        for c in ((nk_grid(m, k, n, a.splits) if a.grid else nk_configs(m, k, n)) if nk
                  else configs(m, k, n)):
          try:
            (nk_kernel.check_shapes if nk else check_shapes)(m, n, k, jnp.bfloat16, w.dtype, c)
          except ValueError:
            continue
          run = nk_kernel.weight_only_matmul_nk if nk else weight_only_matmul
          cands[f"mosaic {c.block_m}x{c.block_n} st{c.num_stages} sk{c.split_k}"] = (
              lambda c, run: lambda x, w, s: run(x, w, s, config=c))(c, run)
        res = dict(zip(cands, prof.measure_many(list(cands.values()), (x, w, s),
                                                reference=ref, tolerance=2e-2,
                                                out_bytes=m * n * 4)))
        (bf,) = prof.measure_many([lambda x, wb: dot(x, wb)], (x, w_bf16))
        times, errs, mos, best = _summary(res)
        row = {"weight": wname, "k": k, "n": n, "w_dtype": wd, "m": m, "layout": a.layout,
               "bf16_dot_us": bf.median_us, "times": times, "errors": errs,
               "best_mosaic": best}
        rows.append(row)
        xla = min(times["xla_dequant_dot"], times["xla_dot_scale"])
        line = (f"{wname} {wd:<13} M={m:<5} bf16 dot {bf.median_us:8.1f} us | XLA dequant+dot "
                f"{times['xla_dequant_dot']:8.1f} | XLA dot*scale {times['xla_dot_scale']:8.1f}")
        if best:
          t = mos[best]
          line += (f" | {best} {t:8.1f} us: {bf.median_us / t:.2f}x bf16, "
                   f"{xla / t:.2f}x XLA's best")
        _report(line, errs, rows, a.json, dev)


if __name__ == "__main__":
  main()
