"""Decode attention on a paged KV cache, on a GPU: checks, then times.

Checks (every backend that runs here, and JAX's cuDNN paged attention under
both of its mask types): a cache in shuffled pages of a pool with pages no
sequence uses (all NaN), NaN in K and Inf in V past each sequence's length,
-1 in the table entries past it; lengths 0, 1, a partial page and full;
page sizes 16 and 64; one query. Each row gives the largest |out - ref|
against the float32 reference of the contiguous cache, whether the output is
finite, and whether a sequence of length 0 gave zeros. The cuDNN rows run on
a pool of exactly ``batch * max_pages`` pages (the only pool JAX's wrapper
takes) and on a larger one (the backend then gathers).

Times (CUPTI, L2 flushed, each checked against the reference): per paged
problem and length mix (spread, full), the Triton heuristic config and its
``num_splits`` neighbours, XLA on the gathered pages, cuDNN's paged
attention (the family's baseline), and cuDNN and the Triton heuristic on the
contiguous cache of the same shape (what the pages cost).

    PYTHONPATH=. python3 benchmarks/decode_paged.py --out paged.json [--quick]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import wavetune_jax as wt
from pallas_kernels.attention.reference import attention_reference
from pallas_kernels.decode import paging
from wavetune_jax import DECODE, DecodeProblem, get_hardware
from wavetune_jax.families.decode import library
from wavetune_jax.families.decode.triton import splits_of

# (q_heads, kv_heads, batch, kv_len, page_size)
TIMED = [(32, 8, 8, 4096, 16), (32, 8, 8, 4096, 64), (32, 8, 32, 8192, 64),
         (32, 8, 1, 32768, 64), (8, 1, 64, 4096, 16), (32, 8, 32, 4096, 128)]


def paged_cache(b, hq, hkv, d, page, max_pages, lens, spare, seed=0, t=1):
  """``(q, k, v, k_pages, v_pages, table, lengths)``: a contiguous cache with
  NaN in K and Inf in V past each length, and the same cache in shuffled
  pages of a pool with ``spare`` NaN pages no sequence uses; table entries
  past a sequence's last page hold -1 (the CPU tests build theirs here)."""
  s = page * max_pages
  ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(ks[0], (b, t, hq, d), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, s, hkv, d), jnp.float32).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, s, hkv, d), jnp.float32).astype(jnp.bfloat16)
  lengths = jnp.asarray(lens, jnp.int32)
  past = jnp.arange(s)[None, :, None, None] >= lengths[:, None, None, None]
  k = jnp.where(past, jnp.nan, k).astype(k.dtype)
  v = jnp.where(past, jnp.inf, v).astype(v.dtype)
  n = b * max_pages + spare
  ids = paging.shuffled_tables(ks[3], b, max_pages, n)
  kp = paging.to_pages(k, ids, n, fill=jnp.nan)
  vp = paging.to_pages(v, ids, n, fill=jnp.nan)
  used = -(-np.asarray(lens) // page)
  table = np.where(np.arange(max_pages)[None, :] < used[:, None], np.asarray(ids), -1)
  return q, k, v, kp, vp, jnp.asarray(table, jnp.int32), lengths


def check_row(name, out, ref, lens) -> dict:
  out = np.asarray(out, np.float32)
  finite = bool(np.all(np.isfinite(out)))
  err = float(np.nanmax(np.abs(out - ref))) if np.isfinite(out).any() else float("nan")
  zero = [bool(np.all(out[i] == 0)) for i, n in enumerate(lens) if n == 0]
  row = {"case": name, "max_err": err, "finite": finite, "len0_zeros": all(zero),
         "ok": finite and err <= 2e-2 and all(zero)}
  print(f"  {name:<58} err {err:9.2e} finite {finite!s:5} len0->0 {all(zero)!s:5} "
        f"{'ok' if row['ok'] else 'FAIL'}", flush=True)
  return row


def checks() -> list[dict]:
  rows = []
  hw = get_hardware()
  for page, max_pages in ((16, 8), (64, 4)):
    s = page * max_pages
    lens = (0, 1, page + 5, s)
    for spare in (0, 3):
      q, k, v, kp, vp, table, lengths = paged_cache(4, 32, 8, 128, page, max_pages, lens,
                                                    spare)
      ref = np.asarray(attention_reference(q, k, v, kv_lengths=lengths,
                                           causal_align="bottom_right", out_dtype=jnp.float32))
      p = DecodeProblem(batch=4, q_heads=32, kv_heads=8, kv_len=s, page_size=page)
      tag = f"page {page} pool {'exact' if spare == 0 else '+3'}"
      cfgs = [wt.XlaDecodeConfig(), wt.CudnnDecodeConfig(), DECODE.heuristic(p, hw),
              DECODE.backend("triton").heuristic(p, hw),
              dataclasses.replace(DECODE.backend("triton").heuristic(p, hw), num_splits=1)]
      for cfg in dict.fromkeys(cfgs):
        try:
          f = jax.jit(lambda *a, cfg=cfg: wt.decode_attention(
              *a[:3], kv_lengths=a[3], block_tables=a[4], config=cfg))
          rows.append(check_row(f"{tag} {cfg}", f(q, kp, vp, lengths, table), ref, lens))
        except Exception as e:  # noqa: BLE001 - a row per failure
          print(f"  {tag} {cfg}: {type(e).__name__}: {e}", flush=True)
          rows.append({"case": f"{tag} {cfg}", "error": f"{type(e).__name__}: {e}"})
      if spare == 0 and library._cudnn_paged is not None:
        for mask in ("NO_MASK", "PADDING"):
          try:
            f = jax.jit(lambda q, kp, vp, lengths, table, mask=mask: library._cudnn_paged(
                q, kp, vp, jnp.ones((4,), jnp.int32), lengths,
                jnp.clip(table, 0, kp.shape[0] - 1)[:, None, :, None],
                jnp.clip(table, 0, kp.shape[0] - 1)[:, None, :, None],
                scale=1 / np.sqrt(128), mask_type=getattr(library._MaskType, mask),
                qkv_layout="BTNH"))
            rows.append(check_row(f"{tag} jax paged_attention mask={mask}",
                                  f(q, kp, vp, lengths, table), ref, lens))
          except Exception as e:  # noqa: BLE001
            print(f"  {tag} mask={mask}: {type(e).__name__}: {e}", flush=True)
            rows.append({"case": f"{tag} mask={mask}", "error": f"{type(e).__name__}: {e}"})
  return rows


def timings(quick: bool, iterations: int) -> list[dict]:
  from wavetune_jax.tuning import profiler
  hw = get_hardware()
  prof = profiler.Profiler(iterations=iterations)
  tri = DECODE.backend("triton")
  rows = []
  for hq, hkv, b, s, page in (TIMED[:2] if quick else TIMED):
    for mix in ("spread", "full"):
      fam = DECODE.with_lengths(mix)
      p = DecodeProblem(batch=b, q_heads=hq, kv_heads=hkv, kv_len=s, page_size=page)
      c = dataclasses.replace(p, page_size=0)
      h = tri.heuristic(p, hw)
      cands = [h] + [dataclasses.replace(h, num_splits=ns)
                     for ns in (h.num_splits // 2, h.num_splits * 2)
                     if ns >= 1 and splits_of(s, ns, h.block_k) == ns]
      args = fam.inputs(p, jax.random.PRNGKey(0))
      ref = fam.reference(p, *args)
      names = [f"triton {x.block_k}/{x.num_splits}" for x in cands] + ["xla gather",
                                                                       "cudnn paged"]
      fns = ([fam.build(p, x) for x in cands] + [fam.build(p, wt.XlaDecodeConfig()),
                                                  fam.baseline(p)])
      res = prof.measure_many(fns, args, reference=ref, tolerance=fam.tolerance(p),
                              out_bytes=ref.size * 4)
      cargs = fam.inputs(c, jax.random.PRNGKey(0))
      cref = fam.reference(c, *cargs)
      hc = tri.heuristic(c, hw)
      cres = prof.measure_many([fam.build(c, hc), fam.baseline(c)], cargs, reference=cref,
                               tolerance=fam.tolerance(c), out_bytes=cref.size * 4)
      us = {n: (m.median_us if m.status == "ok" else m.status) for n, m in zip(names, res)}
      us[f"contiguous triton {hc.block_k}/{hc.num_splits}"] = (
          cres[0].median_us if cres[0].status == "ok" else cres[0].status)
      us["contiguous cudnn"] = cres[1].median_us if cres[1].status == "ok" else cres[1].status
      row = {"problem": DECODE.problem_key(p), "lengths": mix, "us": us,
             "selected": str(wt.select("decode", p, hw).config)}
      print(f"{row['problem']:<58}{mix:>7}  " + "  ".join(
          f"{k}={v:.1f}" if isinstance(v, float) else f"{k}={v}" for k, v in us.items()),
            flush=True)
      rows.append(row)
  return rows


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--out", required=True, help="JSON file for the results")
  ap.add_argument("--quick", action="store_true", help="the first 2 timed problems only")
  ap.add_argument("--iterations", type=int, default=20)
  ap.add_argument("--no-timing", action="store_true", help="the checks only")
  a = ap.parse_args()
  dev = jax.devices()[0]
  print(dev.device_kind, jax.__version__, flush=True)
  out = {"device": dev.device_kind, "jax": jax.__version__,
         "date": time.strftime("%Y-%m-%d %H:%M:%S"), "checks": checks()}
  if not a.no_timing:
    out["timings"] = timings(a.quick, a.iterations)
  with open(a.out, "w") as f:
    json.dump(out, f, indent=1)
  bad = [r["case"] for r in out["checks"] if not r.get("ok")]
  print(f"checks: {len(out['checks']) - len(bad)} ok, {len(bad)} not: {bad}")


if __name__ == "__main__":
  main()
