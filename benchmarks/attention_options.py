"""Sliding windows, soft-capping and sinks on a GPU: right, and how fast.

Per problem (batch 1, causal prefill; CUPTI, L2 flushed, each output checked
against the float32 reference first): ``wt.attention`` with the option (the
backend the selector picks), the other backends that run it (cuDNN's
sliding window, XLA's attention, the Mosaic kernel at 128 x 128 and 128 x 64
tiles), and cuDNN's full causal attention without the option (what a model runs when its attention library has no window).
Where a problem has soft-capping or sinks, each Mosaic config is also timed
without them (the window kept): what the options cost the same kernel.

    python3 benchmarks/attention_options.py [--quick] [--only NAME] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp

import wavetune_jax as wt
from pallas_kernels.attention.reference import attention_reference
from wavetune_jax.tuning import profiler

# (name, q_heads, kv_heads, head_dim, seq, options)
PROBLEMS = [
    ("llama-like w1024", 32, 8, 128, 8192, dict(local_window_size=(1024, 0))),
    ("llama-like w1024", 32, 8, 128, 16384, dict(local_window_size=(1024, 0))),
    ("mistral w4096", 32, 8, 128, 16384, dict(local_window_size=(4096, 0))),
    ("gemma-2 cap 50", 8, 4, 256, 4096, dict(logit_soft_cap=50.0)),
    ("gemma-2 cap 50 w4096", 8, 4, 256, 8192,
     dict(logit_soft_cap=50.0, local_window_size=(4096, 0))),
    ("sinks w128", 64, 8, 64, 4096, dict(local_window_size=(128, 0), sinks=True)),
    ("gemma-2 cap 50", 8, 4, 256, 8192, dict(logit_soft_cap=50.0)),
    ("sinks", 64, 8, 64, 8192, dict(sinks=True)),
]
#: Edge cases, checked only: windows of 0 and below a block, lengths that
#: are not multiples of 8, all options at once.
EDGES = [
    ("edge w0", 8, 2, 64, 1000, dict(local_window_size=(0, 0))),
    ("edge w100 cap sinks", 8, 8, 128, 777, dict(local_window_size=(100, 0),
                                                 logit_soft_cap=20.0, sinks=True)),
    ("edge w300 d96", 4, 2, 96, 1536, dict(local_window_size=300)),
]


#: The Mosaic configs timed (label -> config).
_MOSAIC = {"mosaic": wt.MosaicAttentionConfig(block_q=128, block_k=128, num_stages=2),
           "mosaic64": wt.MosaicAttentionConfig(block_q=128, block_k=64, num_stages=2)}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="the first two problems")
  ap.add_argument("--edges", action="store_true", help="also the edge cases (checked, timed)")
  ap.add_argument("--only", default=None, metavar="NAME",
                  help="only the problems whose name contains NAME")
  ap.add_argument("--iterations", type=int, default=10)
  ap.add_argument("--json", default=None)
  a = ap.parse_args(argv)
  prof = profiler.Profiler(iterations=a.iterations)
  dev = jax.devices()[0]
  print(dev.device_kind, jax.__version__, flush=True)
  rows = []
  probs = (PROBLEMS[:2] if a.quick else PROBLEMS) + (EDGES if a.edges else [])
  if a.only is not None:
    probs = [pr for pr in probs if a.only in pr[0]]
    if not probs:
      ap.error(f"--only {a.only!r} matches no problem")
  for name, h, kvh, d, t, opts in probs:
    kq, kk, kv, ks = jax.random.split(jax.random.PRNGKey(0), 4)
    q = jax.random.normal(kq, (1, t, h, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(kk, (1, t, kvh, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (1, t, kvh, d), jnp.float32).astype(jnp.bfloat16)
    kw = dict(opts)
    if kw.pop("sinks", False):
      kw["sinks"] = jax.random.normal(ks, (h,), jnp.float32)
    ref = attention_reference(q, k, v, out_dtype=jnp.float32, **kw)
    problem, _ = wt.ATTENTION.bind(q, k, v, **kw)[:2]
    with wt.policy("tables"):
      chosen = wt.select("attention", problem, wt.detect()).config
    cands = {"wt": lambda q, k, v, s=None: wt.attention(q, k, v, **kw)}
    for label, cfg in (("cudnn", wt.CudnnAttentionConfig()), ("xla", wt.XlaAttentionConfig()),
                       *_MOSAIC.items()):
      try:
        wt.ATTENTION.backend_of(cfg).validate(problem, cfg, wt.detect())
      except ValueError:
        continue
      if label == "xla" and t > 8192:
        continue  # its score matrix alone is 34 GB at 16k (measured: 40-116x slower)
      cands[label] = (lambda cfg: lambda q, k, v: wt.attention(q, k, v, config=cfg, **kw))(cfg)
    res = prof.measure_many(list(cands.values()), (q, k, v), reference=ref, tolerance=2e-2,
                            out_bytes=q.size * 4)
    full = prof.measure_many([lambda q, k, v: jax.nn.dot_product_attention(
        q, k, v, is_causal=True, implementation="cudnn")], (q, k, v))[0]
    # The same Mosaic configs without soft-capping and sinks (another
    # function, so unchecked): what those options cost the kernel.
    plain_kw = {k_: v_ for k_, v_ in kw.items() if k_ not in ("logit_soft_cap", "sinks")}
    no_option = {}
    if plain_kw != kw:
      labels = [lab for lab in cands if lab.startswith("mosaic")]
      plain = prof.measure_many(
          [(lambda cfg: lambda q, k, v: wt.attention(q, k, v, config=cfg, **plain_kw))(cfg)
           for cfg in (_MOSAIC[lab] for lab in labels)], (q, k, v))
      no_option = {lab: m.median_us if m.status == "ok" else math.nan
                   for lab, m in zip(labels, plain)}
    row = {"name": name, "seq": t, "q_heads": h, "kv_heads": kvh, "head_dim": d,
           "options": {k_: (v_ if not hasattr(v_, "shape") else "array")
                       for k_, v_ in kw.items()},
           "chosen": type(chosen).__name__, "chosen_config": repr(chosen),
           "full_causal_cudnn_us": full.median_us,
           "mosaic_without_cap_or_sinks_us": no_option,
           "times": {lab: {"status": m.status, "us": m.median_us if m.status == "ok"
                           else math.nan, "error": (m.error or "")[:200]}
                     for lab, m in zip(cands, res)}}
    rows.append(row)
    print(f"== {name}, {t} tokens, {h}/{kvh} heads, d {d}: wt chose {row['chosen_config']}; "
          f"cuDNN full causal {full.median_us:.1f} us", flush=True)
    for lab, r in row["times"].items():
      extra = (f" ({full.median_us / r['us']:.2f}x the full causal)" if r["us"] == r["us"]
               else f" {r['status']}: {r['error']}")
      print(f"  {lab:<6} {r['us']:10.1f} us{extra}", flush=True)
    for lab, us in no_option.items():
      print(f"  {lab} without soft cap / sinks {us:10.1f} us: the options cost "
            f"{row['times'][lab]['us'] / us - 1:+.1%}", flush=True)
    del q, k, v, ref
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"device_kind": dev.device_kind, "jax": jax.__version__, "rows": rows}, f,
                indent=1)


if __name__ == "__main__":
  main()
