"""Windows with KV lengths, the bottom-right alignment and two-sided windows in the Mosaic kernel: right, and how fast.

cuDNN's attention in JAX runs a window only causal, top-left and without
KV lengths; these problems fall to XLA's attention, which writes the whole
score matrix. Per problem (CUPTI, L2 flushed, each output checked against
the float32 reference first): ``wt.attention`` (the selector's pick), the
Mosaic kernel at 128 x 128 and 128 x 64 tiles, the Triton kernel where it
runs the problem (no window) and XLA's attention. ``--check`` first runs
the edge cases (empty sequences, rows that see no key, windows past the
sequence, GQA, head_dim 256, sinks and soft caps, the persistent grid),
checked only. Wherever a problem has KV lengths, K holds NaN and V Inf and
NaN past each length (what a cache may hold there).

    python3 benchmarks/attention_band.py [--check] [--only NAME] [--iterations 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp

import wavetune_jax as wt
from pallas_kernels.attention.reference import attention_reference

# (name, batch, q_len, kv_len, q_heads, kv_heads, head_dim, options): options
# are wt.attention's keywords; "lengths" is a list of KV lengths.
PROBLEMS = [
    ("w1024 causal + lengths", 2, 8192, 8192, 32, 8, 128,
     dict(causal=True, local_window_size=(1024, 0), lengths=[8192, 6000])),
    ("w4096 chunk bottom-right + lengths", 2, 2048, 16384, 32, 8, 128,
     dict(causal=True, local_window_size=(4096, 0), causal_align="bottom_right",
          lengths=[16384, 9000])),
    ("w(256,256) bidirectional", 1, 4096, 4096, 16, 16, 64,
     dict(causal=False, local_window_size=(256, 256))),
    ("w(512,512) bidirectional + lengths", 4, 4096, 4096, 16, 16, 128,
     dict(causal=False, local_window_size=(512, 512), lengths=[4096, 4000, 2500, 100])),
    ("w128 causal + lengths + sinks", 4, 4096, 4096, 64, 8, 64,
     dict(causal=True, local_window_size=(128, 0), lengths=[4096, 3000, 2000, 1000],
          sinks=True)),
    ("lengths causal (no window)", 2, 8192, 8192, 32, 8, 128,
     dict(causal=True, lengths=[8192, 5000])),
    ("chunk bottom-right (no window)", 1, 2048, 8192, 32, 8, 128,
     dict(causal=True, causal_align="bottom_right")),
    # Where the rule reaches at its smallest (its programs fill half the SMs).
    ("small lengths 512", 1, 512, 512, 32, 8, 64, dict(causal=True, lengths=[400])),
    ("small chunk 512 over 1024 bottom-right + lengths", 1, 512, 1024, 32, 8, 64,
     dict(causal=True, causal_align="bottom_right", lengths=[900])),
    ("small lengths 256, b8", 8, 256, 256, 16, 16, 128,
     dict(causal=True, lengths=[256, 200, 100, 1, 256, 255, 128, 64])),
    ("lengths d256", 2, 2048, 2048, 16, 8, 256, dict(causal=True, lengths=[2048, 1500])),
]
#: Checked only.
EDGES = [
    ("edge lengths 0/1/500", 3, 777, 777, 8, 2, 128,
     dict(causal=True, lengths=[0, 1, 500])),
    ("edge non-causal lengths", 3, 500, 777, 8, 8, 64, dict(causal=False, lengths=[777, 3, 0])),
    ("edge bottom-right q > L", 3, 300, 1000, 8, 2, 128,
     dict(causal=True, causal_align="bottom_right", lengths=[1000, 299, 0])),
    ("edge window (64,200)", 1, 1000, 1000, 8, 2, 128,
     dict(causal=False, local_window_size=(64, 200))),
    ("edge window (100,0) + lengths", 3, 777, 777, 8, 2, 128,
     dict(causal=True, local_window_size=(100, 0), lengths=[777, 50, 300])),
    ("edge bottom-right w50 q300", 2, 300, 777, 8, 2, 128,
     dict(causal=True, local_window_size=(50, 0), causal_align="bottom_right",
          lengths=[777, 120])),
    ("edge right side only + lengths", 2, 640, 640, 4, 4, 64,
     dict(causal=False, local_window_size=(640, 30), lengths=[640, 333])),
    ("edge window past the keys", 1, 1000, 200, 4, 4, 64,
     dict(causal=False, local_window_size=(10, 10))),
    ("edge cap + sinks + w300 + lengths, d256", 2, 1024, 1024, 8, 4, 256,
     dict(causal=True, local_window_size=(300, 0), lengths=[1024, 700], logit_soft_cap=20.0,
          sinks=True)),
    ("edge persistent: bottom-right w256", 8, 1024, 2048, 16, 4, 128,
     dict(causal=True, local_window_size=(256, 0), causal_align="bottom_right")),
    ("edge window 0 + lengths", 2, 512, 512, 4, 2, 64,
     dict(causal=True, local_window_size=(0, 0), lengths=[512, 17])),
]

_MOSAIC = {"mosaic": wt.MosaicAttentionConfig(block_q=128, block_k=128, num_stages=2),
           "mosaic64": wt.MosaicAttentionConfig(block_q=128, block_k=64, num_stages=2)}


def _arrays(b, t, s, h, kvh, d, opts, seed=0):
  kq, kk, kv, ks = jax.random.split(jax.random.PRNGKey(seed), 4)
  q = jax.random.normal(kq, (b, t, h, d), jnp.float32).astype(jnp.bfloat16)
  k = jax.random.normal(kk, (b, s, kvh, d), jnp.float32).astype(jnp.bfloat16)
  v = jax.random.normal(kv, (b, s, kvh, d), jnp.float32).astype(jnp.bfloat16)
  kw = {k_: v_ for k_, v_ in opts.items() if k_ not in ("lengths", "sinks")}
  if "lengths" in opts:
    kw["kv_lengths"] = jnp.asarray(opts["lengths"], jnp.int32)
    # Past each length a cache may hold anything: NaN in K, Inf and NaN in V.
    past = (jnp.arange(s)[None, :] >= kw["kv_lengths"][:, None])[:, :, None, None]
    k = jnp.where(past, jnp.nan, k).astype(k.dtype)
    v = jnp.where(past, jnp.where(jnp.arange(d) % 2 == 0, jnp.inf, jnp.nan), v).astype(v.dtype)
  if opts.get("sinks"):
    kw["sinks"] = jax.random.normal(ks, (h,), jnp.float32)
  return (q, k, v), kw


def _candidates(problem, kw, *, timed: bool):
  cands = {"wt": lambda q, k, v: wt.attention(q, k, v, **kw)}
  configs = list(_MOSAIC.items())
  if timed:
    configs += [("triton", None), ("xla", wt.XlaAttentionConfig())]
  for label, cfg in configs:
    if label == "triton":
      try:
        cfg = wt.ATTENTION.backend("triton").heuristic(problem, wt.detect())
      except Exception:  # noqa: BLE001 -- no Triton lowering in this JAX
        cfg = None
      if cfg is None:
        continue
    try:
      wt.ATTENTION.backend_of(cfg).validate(problem, cfg, wt.detect())
    except ValueError:
      continue
    if label == "xla" and 4 * problem.batch * problem.q_heads * problem.q_len * problem.kv_len > (
        24 << 30):
      continue
    cands[label] = (lambda cfg: lambda q, k, v: wt.attention(q, k, v, config=cfg, **kw))(cfg)
  return cands


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--check", action="store_true", help="first the edge cases, checked only")
  ap.add_argument("--only", default=None, metavar="NAME",
                  help="only the problems whose name contains NAME")
  ap.add_argument("--iterations", type=int, default=10)
  ap.add_argument("--json", default=None, metavar="PATH")
  a = ap.parse_args(argv)
  if a.iterations < 1:
    ap.error("--iterations must be >= 1")
  probs = [(p, False) for p in (EDGES if a.check else [])] + [(p, True) for p in PROBLEMS]
  if a.only is not None:
    probs = [pr for pr in probs if a.only in pr[0][0]]
    if not probs:
      ap.error(f"--only {a.only!r} matches no problem")
  from wavetune_jax.tuning import profiler
  prof = profiler.Profiler(iterations=a.iterations)
  dev = jax.devices()[0]
  print(dev.device_kind, jax.__version__, flush=True)
  rows, wrong = [], 0
  for (name, b, t, s, h, kvh, d, opts), timed in probs:
    (q, k, v), kw = _arrays(b, t, s, h, kvh, d, opts)
    ref_kw = dict(kw)
    ref_kw.setdefault("causal", True)
    ref = attention_reference(q, k, v, out_dtype=jnp.float32, **ref_kw)
    problem = wt.ATTENTION.bind(q, k, v, **kw)[0]
    with wt.policy("tables"):
      chosen = wt.select("attention", problem, wt.detect()).config
    cands = _candidates(problem, kw, timed=timed)
    res = prof.measure_many(list(cands.values()), (q, k, v), reference=ref, tolerance=2e-2,
                            out_bytes=q.size * 4)
    row = {"name": name, "batch": b, "q_len": t, "kv_len": s, "q_heads": h, "kv_heads": kvh,
           "head_dim": d, "timed": timed,
           "options": {k_: v_ for k_, v_ in opts.items()}, "chosen": repr(chosen),
           "times": {lab: {"status": m.status, "us": m.median_us if m.status == "ok"
                           else math.nan, "error": (m.error or "")[:300]}
                     for lab, m in zip(cands, res)}}
    rows.append(row)
    wrong += sum(r["status"] == "wrong" for r in row["times"].values())
    print(f"== {name}: {b} x {t} over {s}, {h}/{kvh}, d {d}; tables chose {row['chosen']}",
          flush=True)
    xla = row["times"].get("xla", {}).get("us", math.nan)
    for lab, r in row["times"].items():
      if r["status"] != "ok":
        print(f"  {lab:<9} {r['status']}: {r['error']}", flush=True)
      elif timed:
        print(f"  {lab:<9} {r['us']:10.1f} us" + (f"  ({xla / r['us']:.2f}x XLA)"
                                                  if xla == xla else ""), flush=True)
      else:
        print(f"  {lab:<9} right", flush=True)
    del q, k, v, ref
  print(f"{len(rows)} problems, {wrong} wrong outputs", flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"device_kind": dev.device_kind, "jax": jax.__version__, "rows": rows}, f,
                indent=1)
  return 1 if wrong else 0


if __name__ == "__main__":
  raise SystemExit(main())
