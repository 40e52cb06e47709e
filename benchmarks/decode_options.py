"""Decode with sliding windows, soft-capping and sinks on a GPU: right, and how fast.

Checks (each against the float32 reference of the contiguous cache): the
Mosaic kernel and XLA's attention with every option, on contiguous and paged
caches, lengths 0, 1, inside the first block, inside and past the window and
full, NaN in K and Inf in V past each length, table entries left of each
window freed (-1) and the pool's unused pages NaN; one and several queries,
splits 1 and 4.

Times (CUPTI, L2 flushed, every sequence at the cache's full length, each
candidate checked first): ``wt.decode_attention`` with the option (the
backend the selector picks), the Mosaic kernel's heuristic config, XLA's
attention (the platform op: cuDNN's decode in JAX runs none of the options),
the same Mosaic config without the option (what soft-capping or sinks cost;
for a window, the whole cache), and cuDNN's decode of the whole cache
without the option (what a model runs when its library has no window). The
bytes a step must read (K and V of each sequence's window) over the time,
against the GPU's nominal HBM bandwidth.

    PYTHONPATH=. python3 benchmarks/decode_options.py [--quick] [--only NAME ...] \
        [--one-per-item] [--json out.json]

``--one-per-item`` also times, where the kernel runs its persistent grid
(``families.decode.mosaic.persistent_grid``), the same config with one CTA
per work item.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math

import jax
import jax.numpy as jnp
import numpy as np

import wavetune_jax as wt
from pallas_kernels.attention.reference import attention_reference
from pallas_kernels.decode import mosaic as km
from wavetune_jax.families.decode.mosaic import persistent_grid
from pallas_kernels.decode import paging
from wavetune_jax import DECODE
from wavetune_jax.tuning import profiler

#: Nominal HBM bandwidth (bytes/s) by device kind.
PEAK_BW = {"NVIDIA H100 80GB HBM3": 3.35e12, "NVIDIA H200": 4.8e12}

# (name, q_heads, kv_heads, head_dim, batch, kv_len, q_len, page_size, options)
PROBLEMS = [
    ("llama-like w1024", 32, 8, 128, 16, 32768, 1, 0, dict(local_window_size=(1023, 0))),
    ("mistral w4096", 32, 8, 128, 8, 32768, 1, 0, dict(local_window_size=(4095, 0))),
    ("w128 b64", 32, 8, 128, 64, 8192, 1, 0, dict(local_window_size=(127, 0))),
    ("llama-like w1024 paged64", 32, 8, 128, 16, 32768, 1, 64,
     dict(local_window_size=(1023, 0))),
    ("w1024 q4 (speculative)", 32, 8, 128, 16, 16384, 4, 0, dict(local_window_size=(1023, 0))),
    ("gemma-2 cap 50", 8, 4, 256, 16, 8192, 1, 0, dict(logit_soft_cap=50.0)),
    ("gemma-2 cap 50 w4096", 8, 4, 256, 16, 16384, 1, 0,
     dict(logit_soft_cap=50.0, local_window_size=(4095, 0))),
    ("sinks", 64, 8, 64, 16, 8192, 1, 0, dict(sinks=True)),
    ("sinks w128", 64, 8, 64, 32, 8192, 1, 0, dict(sinks=True, local_window_size=(127, 0))),
    ("sinks w128 paged16", 64, 8, 64, 32, 8192, 1, 16,
     dict(sinks=True, local_window_size=(127, 0))),
    # Not used to write the window rule (MosaicDecode.heuristic):
    ("w512 b4", 32, 8, 128, 4, 16384, 1, 0, dict(local_window_size=(511, 0))),
    ("w2048 b32 16/2 d64", 16, 2, 64, 32, 16384, 1, 0, dict(local_window_size=(2047, 0))),
    ("w1024 b2 64/8 d128 q2", 64, 8, 128, 2, 32768, 2, 0, dict(local_window_size=(1023, 0))),
    # Not used to write the persistent grid's rule (families.decode.mosaic.persistent_grid):
    ("w1024 b128 8k", 32, 8, 128, 128, 8192, 1, 0, dict(local_window_size=(1023, 0))),
    ("w512 b32 32k", 32, 8, 128, 32, 32768, 1, 0, dict(local_window_size=(511, 0))),
    ("w256 b256 8/1 MQA", 8, 1, 128, 256, 8192, 1, 0, dict(local_window_size=(255, 0))),
    ("w128 b64 paged16 sinks cap", 32, 8, 128, 64, 8192, 1, 16,
     dict(local_window_size=(127, 0), sinks=True, logit_soft_cap=30.0)),
]

#: Checked only: (name, q_heads, kv_heads, head_dim, q_len, page_size, options).
CHECKS = [
    ("w100", 32, 8, 128, 1, 0, dict(local_window_size=(100, 0))),
    ("w0", 8, 2, 64, 1, 0, dict(local_window_size=(0, 0))),
    ("w300 q5", 32, 8, 128, 5, 0, dict(local_window_size=(300, 0))),
    ("w(50,7) not causal q8", 16, 4, 128, 8, 0, dict(local_window_size=(50, 7), causal=False)),
    ("cap 20 d256", 8, 4, 256, 1, 0, dict(logit_soft_cap=20.0)),
    ("sinks", 64, 8, 64, 1, 0, dict(sinks=True)),
    ("w100 cap sinks q3", 32, 8, 128, 3, 0,
     dict(local_window_size=(100, 0), logit_soft_cap=20.0, sinks=True)),
    ("w100 paged16", 32, 8, 128, 1, 16, dict(local_window_size=(100, 0))),
    ("w300 sinks paged64 q2", 32, 8, 128, 2, 64,
     dict(local_window_size=(300, 0), sinks=True)),
    ("cap paged256", 8, 4, 256, 1, 256, dict(logit_soft_cap=30.0)),
]


def _inputs(b, t, hq, hkv, d, s, lens, key, *, poison: bool):
  ks = jax.random.split(key, 4)
  q = jax.random.normal(ks[0], (b, t, hq, d), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(ks[1], (b, s, hkv, d), jnp.float32).astype(jnp.bfloat16)
  v = jax.random.normal(ks[2], (b, s, hkv, d), jnp.float32).astype(jnp.bfloat16)
  lengths = jnp.asarray(lens, jnp.int32)
  if poison:  # NaN in K and Inf in V past each length
    past = jnp.arange(s)[None, :, None, None] >= lengths[:, None, None, None]
    k = jnp.where(past, jnp.nan, k).astype(k.dtype)
    v = jnp.where(past, jnp.inf, v).astype(v.dtype)
  sinks = jax.random.normal(ks[3], (hq,), jnp.float32)
  return q, k, v, lengths, sinks


def _paged(k, v, lens, page, t, left, key):
  """``(k_pages, v_pages, table, full_table)``: the cache in shuffled pages
  of a pool with 3 unused NaN pages; the table's entries past each length
  and wholly left of each window -1 (the full table's past each length)."""
  b, s = k.shape[:2]
  max_pages = s // page
  n = b * max_pages + 3
  ids = paging.shuffled_tables(key, b, max_pages, n)
  kp = paging.to_pages(k, ids, n, fill=jnp.nan)
  vp = paging.to_pages(v, ids, n, fill=jnp.nan)
  lens = np.asarray(lens)
  j = np.arange(max_pages)[None, :]
  used = j < (-(-lens // page))[:, None]
  keep = used & (j >= (np.maximum(lens - t - left, 0) // page)[:, None]) if left >= 0 else used
  table = lambda m: jnp.asarray(np.where(m, np.asarray(ids), -1), jnp.int32)  # noqa: E731
  return kp, vp, table(keep), table(used)


def _kw(opts, sinks):
  kw = dict(opts)
  if kw.pop("sinks", False):
    kw["sinks"] = sinks
  return kw


def checks() -> list[dict]:
  rows = []
  hw = wt.get_hardware()
  for name, hq, hkv, d, t, page, opts in CHECKS:
    s = 1024
    lens = (0, 1, 37, 290, 700, s)
    q, k, v, lengths, sinks = _inputs(len(lens), t, hq, hkv, d, s, lens,
                                      jax.random.PRNGKey(1), poison=True)
    kw = _kw(opts, sinks)
    ref = np.asarray(attention_reference(q, k, v, kv_lengths=lengths,
                                         causal_align="bottom_right", out_dtype=jnp.float32,
                                         q_chunk=t, **kw))
    left = (kw.get("local_window_size") or (-1, 0))[0]
    if page:
      k, v, tables, _ = _paged(k, v, lens, page, t, left, jax.random.PRNGKey(2))
    else:
      tables = None
    problem = DECODE.bind(q, k, v, kv_lengths=lengths, block_tables=tables, **kw).problem
    mosaic = DECODE.backend("mosaic").heuristic(problem, hw)
    cfgs = [None, wt.XlaDecodeConfig()]
    if mosaic is not None:
      cfgs += [wt.MosaicDecodeConfig(block_k=mosaic.block_k, num_stages=2, num_splits=n)
               for n in (1, 4)]
    for cfg in cfgs:
      label = f"{name} {'wt' if cfg is None else cfg}"
      try:
        out = jax.jit(lambda q, k, v, n, bt, cfg=cfg: wt.decode_attention(
            q, k, v, kv_lengths=n, block_tables=bt, config=cfg, **kw))(q, k, v, lengths, tables)
        out = np.asarray(out, np.float32)
        finite = bool(np.isfinite(out).all())
        err = float(np.nanmax(np.abs(out - ref))) if np.isfinite(out).any() else math.nan
        zero = bool(np.all(out[0] == 0))
        ok = finite and err <= 2e-2 and zero
        rows.append({"case": label, "max_err": err, "finite": finite, "len0_zeros": zero,
                     "ok": ok})
        print(f"  {label:<72} err {err:9.2e} finite {finite!s:5} len0->0 {zero!s:5} "
              f"{'ok' if ok else 'FAIL'}", flush=True)
      except Exception as e:  # noqa: BLE001 - a row per failure
        msg = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append({"case": label, "error": msg, "ok": False})
        print(f"  {label}: {msg}", flush=True)
  return rows


def timings(prof, problems, grid: bool = False, one_per_item: bool = False) -> list[dict]:
  rows = []
  hw = wt.get_hardware()
  peak = PEAK_BW.get(jax.devices()[0].device_kind)
  for name, hq, hkv, d, b, s, t, page, opts in problems:
    lens = (s,) * b
    q, k, v, lengths, sinks = _inputs(b, t, hq, hkv, d, s, lens, jax.random.PRNGKey(0),
                                      poison=False)
    kw = _kw(opts, sinks)
    left = (kw.get("local_window_size") or (-1, 0))[0]
    tables = None
    if page:
      kc, vc = k, v
      k, v, tables, full_tables = _paged(k, v, lens, page, t, left, jax.random.PRNGKey(2))
    problem = DECODE.bind(q, k, v, kv_lengths=lengths, block_tables=tables, **kw).problem
    plain_kw = {}
    with wt.policy("tables"):
      chosen = wt.select("decode", problem, hw).config
    mosaic = DECODE.backend("mosaic").heuristic(problem, hw)
    args = (q, k, v, lengths) + ((tables,) if page else ())
    # (one chunk of q_len rows: the reference's default 512 would pad the scores)
    ref = attention_reference(q, kc if page else k, vc if page else v, kv_lengths=lengths,
                              causal_align="bottom_right", out_dtype=jnp.float32, q_chunk=t,
                              **kw)

    def call(cfg, options):
      return lambda q, k, v, n, bt=None: wt.decode_attention(
          q, k, v, kv_lengths=n, block_tables=bt, config=cfg, **options)
    cands = {"wt": call(None, kw), "xla": call(wt.XlaDecodeConfig(), kw)}
    if mosaic is not None:
      cands["mosaic"] = call(mosaic, kw)
      if one_per_item and persistent_grid(problem, mosaic, hw.device_key):
        # The same config with one CTA per work item (the persistent grid's A/B).
        cands["mosaic_one_per_item"] = (
            lambda q, k, v, n, bt=None: km.decode_attention(
                q, k, v, config=mosaic, kv_lengths=n, block_tables=bt, persistent=False, **kw))
    res = dict(zip(cands, prof.measure_many(list(cands.values()), args, reference=ref,
                                            tolerance=2e-2, out_bytes=q.size * 4)))
    if grid and mosaic is not None:
      space = DECODE.backend("mosaic").space(problem, hw)
      ms = prof.measure_many([call(c, kw) for c in space], args, reference=ref, tolerance=2e-2,
                             out_bytes=q.size * 4)
      timed = sorted((m.median_us, str(c)) for c, m in zip(space, ms) if m.status == "ok")
      res_grid = [{"config": c, "us": us} for us, c in timed]
      print(f"  space of {len(space)}: best {timed[0][1]} {timed[0][0]:.1f} us; "
            f"next {[f'{c} {us:.1f}' for us, c in timed[1:4]]}", flush=True)
    # Without the option: the same Mosaic config (soft-capping and sinks: their
    # cost; a window: the whole cache), the window alone where there are
    # others, and cuDNN's decode of the whole cache.
    plain = {}
    window_only = {"local_window_size": kw.get("local_window_size")}
    plain_args = (q, k, v, lengths, full_tables) if page else args
    if mosaic is not None:
      plain["mosaic_plain"] = (call(mosaic, plain_kw), plain_kw, plain_args)
      if "local_window_size" in kw and len(kw) > 1:
        plain["mosaic_window_only"] = (call(mosaic, window_only), window_only, args)
    # (cuDNN on the contiguous cache: its paged attention takes no other pool)
    plain["cudnn_whole_cache"] = (call(wt.CudnnDecodeConfig(), plain_kw), plain_kw,
                                  (q, kc, vc, lengths) if page else args)
    for label, (fn, opt, a_) in plain.items():
      ref_p = attention_reference(q, kc if page else k, vc if page else v, kv_lengths=lengths,
                                  causal_align="bottom_right", out_dtype=jnp.float32,
                                  q_chunk=t, **opt)
      res[label] = prof.measure_many([fn], a_, reference=ref_p, tolerance=2e-2,
                                     out_bytes=q.size * 4)[0]
    keys = min(s, t + left) if left >= 0 else s
    nbytes = 2 * b * keys * hkv * d * q.dtype.itemsize
    row = {"name": name, "batch": b, "kv_len": s, "q_len": t, "q_heads": hq, "kv_heads": hkv,
           "head_dim": d, "page_size": page,
           "options": {k_: ("array" if hasattr(v_, "shape") else v_) for k_, v_ in kw.items()},
           "chosen": str(chosen), "mosaic": str(mosaic), "bytes": nbytes,
           "space": res_grid if grid and mosaic is not None else None,
           "times": {lab: {"status": m.status,
                           "us": m.median_us if m.status == "ok" else math.nan,
                           "error": (m.error or "")[:200]} for lab, m in res.items()}}
    rows.append(row)
    print(f"== {name}: batch {b}, cache {s}, q {t}, {hq}/{hkv} heads, d {d}"
          f"{f', pages {page}' if page else ''}; wt chose {chosen}; "
          f"{nbytes / 1e6:.1f} MB of K/V to read", flush=True)
    base = row["times"]["xla"]["us"]
    for lab, r in row["times"].items():
      us = r["us"]
      if us != us:
        print(f"  {lab:<20} {r['status']}: {r['error']}", flush=True)
        continue
      bw = nbytes / (us * 1e-6)
      frac = (f" {100 * bw / peak:5.1f}% of peak"
              if peak and lab.startswith(("wt", "mosaic")) else "")
      print(f"  {lab:<20} {us:10.1f} us  {base / us:7.2f}x xla  {bw / 1e9:7.0f} GB/s{frac}",
            flush=True)
    del q, k, v, ref
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="the first three timed problems")
  ap.add_argument("--no-checks", action="store_true")
  ap.add_argument("--space", action="store_true",
                  help="also time every config of the Mosaic kernel's pruned space")
  ap.add_argument("--iterations", type=int, default=10)
  ap.add_argument("--json", default=None)
  ap.add_argument("--one-per-item", action="store_true",
                  help="where the Mosaic kernel runs its persistent grid, also time the "
                       "same config with one CTA per work item")
  ap.add_argument("--only", nargs="+", default=None, metavar="NAME",
                  help="time these problems only (names of PROBLEMS)")
  a = ap.parse_args(argv)
  unknown = sorted(set(a.only or ()) - {p[0] for p in PROBLEMS})
  if unknown:
    ap.error(f"--only: unknown problems {unknown}; known: {[p[0] for p in PROBLEMS]}")
  dev = jax.devices()[0]
  print(dev.device_kind, jax.__version__, flush=True)
  out = {"device_kind": dev.device_kind, "jax": jax.__version__}
  if not a.no_checks:
    print("checks:", flush=True)
    out["checks"] = checks()
    bad = [r["case"] for r in out["checks"] if not r.get("ok")]
    print(f"{len(out['checks']) - len(bad)} of {len(out['checks'])} checks ok"
          + (f"; FAILED: {bad}" if bad else ""), flush=True)
  prof = profiler.Profiler(iterations=a.iterations)
  probs = PROBLEMS[:3] if a.quick else PROBLEMS
  if a.only:
    probs = [p for p in PROBLEMS if p[0] in a.only]
  out["rows"] = timings(prof, probs, grid=a.space, one_per_item=a.one_per_item)
  if a.json:
    with open(a.json, "w") as f:
      json.dump(out, f, indent=1)


if __name__ == "__main__":
  main()
