"""Windowed prefill with the Mosaic kernel's persistent grid, on a GPU.

Per problem (causal prefill with a sliding window, bfloat16; CUPTI, L2
flushed, each output checked against the float32 reference first): cuDNN's
sliding window (the platform op), and the Mosaic attention kernel at each
config of ``--configs`` with one CTA per program and with the persistent
grid (``persistent=True``: one CTA per SM walking its share of the
programs). Prints a table and the best persistent config over cuDNN.

    python3 benchmarks/attention_persistent.py [--only NAME ...] [--edges] [--json out.json]
    python3 benchmarks/attention_persistent.py --summarize out.json   # CPU
"""

from __future__ import annotations

import argparse
import json
import math

#: (name, batch, q_heads, kv_heads, head_dim, tokens, window): a window of
#: ``w`` keys a row (query ``i`` sees keys ``i - w + 1 .. i``, the suites'
#: convention); the first three are the windows of ``attention_options.py``
#: (which gives one key more), the others held out of every sweep.
PROBLEMS = [
    ("w1024 8k", 1, 32, 8, 128, 8192, 1024),
    ("w1024 16k", 1, 32, 8, 128, 16384, 1024),
    ("w4096 16k", 1, 32, 8, 128, 16384, 4096),
    ("w512 b2 8k 16/8", 2, 16, 8, 128, 8192, 512),
    ("w1024 32k 64/8", 1, 64, 8, 128, 32768, 1024),
    ("w1024 b4 4k", 4, 32, 8, 128, 4096, 1024),
    ("w128 8k 64/8 d64", 1, 64, 8, 64, 8192, 128),
    ("w2048 8k 40/8", 1, 40, 8, 128, 8192, 2048),
    ("w256 4k 24/8 d128", 1, 24, 8, 128, 4096, 256),
    ("w768 6k b2 28/4", 2, 28, 4, 128, 6144, 768),
]
#: Edge cases, checked (and timed) with ``--edges``: lengths that are not a
#: multiple of the blocks or of 8, soft-capping and sinks, a window of one
#: key, 64-key blocks (the warpgroups' step counts differ, so each item
#: ends with a drain step), more programs than one CTA's share divides
#: evenly; (name, batch, q_heads, kv_heads, head_dim, tokens, window, options).
EDGES = [
    ("edge ragged 3000", 2, 32, 8, 128, 3000, 1024, {}),
    ("edge 777 w100 cap sinks", 4, 32, 8, 128, 777, 100,
     dict(logit_soft_cap=20.0, sinks=True)),
    ("edge w1 2000", 1, 32, 8, 128, 2000, 1, {}),
    ("edge d64 cap sinks 4000", 1, 64, 8, 64, 4000, 128, dict(logit_soft_cap=30.0, sinks=True)),
    ("edge d96 w300 1536", 2, 24, 8, 96, 1536, 300, {}),
]
#: ``--modes``: (name, batch, q_heads, kv_heads, head_dim, tokens, causal,
#: window (-1: none), "BQxBKxSTAGES", CTAs of the persistent grid).
MODES = [
    ("causal 7 CTAs", 2, 8, 2, 128, 1000, True, -1, "128x128x2", 7),
    ("causal 64-key blocks 132 CTAs", 1, 32, 8, 128, 4096, True, -1, "128x64x2", 132),
    ("non-causal ragged 5 CTAs", 2, 8, 4, 64, 777, False, -1, "128x128x3", 5),
    ("256-row programs window 7 CTAs", 1, 16, 4, 128, 3000, True, 512, "256x64x2", 7),
    ("window 1 CTA", 1, 4, 1, 128, 1536, True, 255, "128x128x2", 1),
]
#: block_q x block_k x stages, as "128x128x2".
CONFIGS = ("128x128x2", "128x64x2", "128x64x3")


def _config(text: str):
  from pallas_kernels.attention.mosaic import MosaicAttentionConfig
  try:
    bq, bk, st = (int(x) for x in text.split("x"))
    return MosaicAttentionConfig(block_q=bq, block_k=bk, num_stages=st)
  except ValueError as e:
    raise argparse.ArgumentTypeError(f"bad config {text!r} (want BQxBKxSTAGES, e.g. "
                                     f"128x128x2): {e}") from None


def summarize(rows: list) -> None:
  print(f"{'problem':<18} {'cuDNN':>9} {'plain best':>11} {'pers. best':>11} "
        f"{'pers/plain':>10} {'cuDNN/pers':>10}  best persistent config")
  for r in rows:
    t = r["times"]
    plain = {c: v for c, v in t.items() if c.startswith("plain ") and v == v}
    pers = {c: v for c, v in t.items() if c.startswith("persistent ") and v == v}
    cud = t.get("cudnn", math.nan)
    bp = min(plain.values(), default=math.nan)
    bc = min(pers, key=pers.get) if pers else None
    bpv = pers[bc] if bc else math.nan
    print(f"{r['name']:<18} {cud:9.1f} {bp:11.1f} {bpv:11.1f} {bp / bpv:10.3f} "
          f"{cud / bpv:10.3f}  {bc}")


def check_modes() -> int:
  """Each case of MODES with the persistent grid against the float32
  reference; returns the number of wrong ones (also the exit status)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels.attention import mosaic
  from pallas_kernels.attention.reference import attention_reference
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  wrong = 0
  for name, b, h, kvh, d, t, causal, w, cfg, ctas in MODES:
    kq, kk, kv = jax.random.split(jax.random.PRNGKey(1), 3)
    q = jax.random.normal(kq, (b, t, h, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(kk, (b, t, kvh, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (b, t, kvh, d), jnp.float32).astype(jnp.bfloat16)
    window = (w, 0) if w >= 0 else None
    ref = attention_reference(q, k, v, causal=causal, out_dtype=jnp.float32,
                              local_window_size=window)
    out = mosaic.attention(q, k, v, config=_config(cfg), causal=causal, window_left=w,
                           persistent=True, num_sms=ctas)
    err = float(jnp.linalg.norm(out.astype(jnp.float32) - ref) / jnp.linalg.norm(ref))
    ok = bool(np.isfinite(err)) and err < 2e-2
    wrong += not ok
    print(f"{name:<34} {cfg:<10} {ctas:4d} CTAs  rel. error {err:.2e}  "
          f"{'ok' if ok else 'WRONG'}", flush=True)
  return wrong


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--only", nargs="+", default=None, metavar="NAME",
                  help="only these problems (names of PROBLEMS)")
  ap.add_argument("--configs", nargs="+", type=_config, default=None,
                  help=f"Mosaic configs BQxBKxSTAGES (default {' '.join(CONFIGS)})")
  ap.add_argument("--edges", action="store_true",
                  help="the edge cases of EDGES instead of PROBLEMS")
  ap.add_argument("--modes", action="store_true",
                  help="only check (no timing) the persistent grid where no rule runs it: "
                  "plain causal, non-causal, 256-row programs, a few CTAs each walking "
                  "many programs (MODES)")
  ap.add_argument("--iterations", type=int, default=10)
  ap.add_argument("--json", default=None)
  ap.add_argument("--summarize", default=None, metavar="JSON",
                  help="print the table of a run's JSON (CPU) and exit")
  a = ap.parse_args(argv)
  if a.summarize:
    with open(a.summarize) as f:
      summarize(json.load(f)["rows"])
    return
  if a.modes:
    return check_modes()
  table = [(*p, {}) for p in PROBLEMS] if not a.edges else EDGES
  names = [p[0] for p in table]
  if a.only:
    bad = [n for n in a.only if n not in names]
    if bad:
      ap.error(f"--only: unknown problems {bad}; known: {names}")
  configs = a.configs or [_config(c) for c in CONFIGS]

  import jax
  import jax.numpy as jnp

  from pallas_kernels.attention import mosaic
  from pallas_kernels.attention.reference import attention_reference
  from wavetune_jax.tuning import profiler

  prof = profiler.Profiler(iterations=a.iterations)
  dev = jax.devices()[0]
  print(dev.device_kind, jax.__version__, f"{dev.core_count} SMs", flush=True)
  rows = []
  for name, b, h, kvh, d, t, w, opts in table:
    if a.only and name not in a.only:
      continue
    kq, kk, kv, ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(kq, (b, t, h, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(kk, (b, t, kvh, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (b, t, kvh, d), jnp.float32).astype(jnp.bfloat16)
    cap = opts.get("logit_soft_cap", 0.0)
    sinks = jax.random.normal(ks, (h,), jnp.float32) if opts.get("sinks") else None
    ref = attention_reference(q, k, v, out_dtype=jnp.float32, local_window_size=(w - 1, 0),
                              logit_soft_cap=cap or None, sinks=sinks)
    cands = {}
    if not opts:
      cands["cudnn"] = lambda q, k, v: jax.nn.dot_product_attention(
          q, k, v, is_causal=True, local_window_size=(w - 1, 0), implementation="cudnn")
    for cfg in configs:
      label = f"{cfg.block_q}x{cfg.block_k}x{cfg.num_stages}"
      for pers in (False, True):
        need = mosaic.smem_bytes(block_q=cfg.block_q, block_k=cfg.block_k,
                                 num_stages=cfg.num_stages, head_dim=d, itemsize=2,
                                 persistent=pers)
        if need > mosaic.SMEM_LIMIT:
          continue
        cands[("persistent " if pers else "plain ") + label] = (
            lambda cfg, pers: lambda q, k, v: mosaic.attention(
                q, k, v, config=cfg, causal=True, window_left=w - 1, persistent=pers,
                soft_cap=cap, sinks=sinks))(cfg, pers)
    res = prof.measure_many(list(cands.values()), (q, k, v), reference=ref, tolerance=2e-2,
                            out_bytes=q.size * 4)
    times = {lab: (m.median_us if m.status == "ok" else math.nan) for lab, m in zip(cands, res)}
    errors = {lab: f"{m.status}: {(m.error or '')[:200]}" for lab, m in zip(cands, res)
              if m.status != "ok"}
    rows.append({"name": name, "batch": b, "q_heads": h, "kv_heads": kvh, "head_dim": d,
                 "tokens": t, "window": w, "times": times, "errors": errors,
                 "rel_error": {lab: m.rel_error for lab, m in zip(cands, res)}})
    print(f"== {name}: " + ", ".join(f"{lab} {us:.1f}" for lab, us in times.items()), flush=True)
    for lab, e in errors.items():
      print(f"   {lab}: {e}", flush=True)
    del q, k, v, ref
    if a.json:  # after every problem: a run cut short keeps what it measured
      with open(a.json, "w") as f:
        json.dump({"device_kind": dev.device_kind, "jax": jax.__version__,
                   "sms": dev.core_count, "rows": rows}, f, indent=1)
  summarize(rows)


if __name__ == "__main__":
  raise SystemExit(main())
