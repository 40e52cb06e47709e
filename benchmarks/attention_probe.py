"""Checks and times a grid of attention configs on a few shapes, with cuDNN and XLA.

A quick look at the kernel before a sweep: every config is checked against the
float32 reference, then timed with the profiler's CUPTI method (L2 flushed,
median of 20). Prints one line per (shape, config) and the best per shape.

    python3 benchmarks/attention_probe.py [--quick]
"""

from __future__ import annotations

import argparse
import itertools
import math

import jax
import jax.numpy as jnp

from pallas_kernels.attention.reference import attention_reference
from pallas_kernels.attention.triton import TritonAttentionConfig, attention
from wavetune_jax.tuning import profiler

SHAPES = [  # batch, seq, q_heads, kv_heads, head_dim, causal
    (1, 1000, 32, 8, 128, True),
    (1, 4096, 32, 8, 128, True),
    (8, 2048, 32, 8, 128, True),
    (2, 8192, 32, 8, 128, True),
    (4, 2048, 8, 1, 128, True),
    (2, 4096, 32, 8, 128, False),
]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true")
  args = ap.parse_args()
  bqs, bks, nws, nss = (64, 128), (32, 64, 128), (4, 8), (2, 3)
  if args.quick:
    bqs, bks, nws, nss = (128,), (64,), (4, 8), (2,)
  print(jax.devices()[0].device_kind, jax.__version__)
  prof = profiler.Profiler(iterations=20)
  for b, s, hq, hkv, d, causal in SHAPES:
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(ks[0], (b, s, hq, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, s, hkv, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, s, hkv, d), jnp.float32).astype(jnp.bfloat16)
    ref = attention_reference(q, k, v, causal=causal, out_dtype=jnp.float32)
    cfgs = [TritonAttentionConfig(block_q=bq, block_k=bk, num_warps=nw, num_stages=ns)
            for bq, bk, nw, ns in itertools.product(bqs, bks, nws, nss)]
    fns = [lambda q, k, v, c=c: attention(q, k, v, config=c, causal=causal) for c in cfgs]
    for impl in ("cudnn", "xla"):
      fns.append(lambda q, k, v, impl=impl: jax.nn.dot_product_attention(
          q, k, v, is_causal=causal, implementation=impl))
    names = [f"{c.block_q}x{c.block_k} w{c.num_warps} s{c.num_stages}" for c in cfgs]
    names += ["cudnn", "xla"]
    res = prof.measure_many(fns, (q, k, v), reference=ref, tolerance=2e-2,
                            out_bytes=q.size * 4)
    flops = 4 * b * hq * s * s * d * (0.5 if causal else 1.0)
    print(f"--- b={b} s={s} hq={hq} hkv={hkv} d={d} causal={causal}")
    for n, m in zip(names, res):
      if m.status == "ok":
        print(f"  {n:<18} {m.median_us:9.1f} us  {flops / m.median_us / 1e6:6.0f} TFLOP/s"
              f"  err {m.rel_error:.1e}")
      else:
        print(f"  {n:<18} {m.status}: {m.error[:200]}")
    ok = [(m.median_us, n) for n, m in zip(names[:-2], res) if m.status == "ok"]
    cud = res[-2].median_us if res[-2].status == "ok" else math.nan
    if ok:
      best = min(ok)
      print(f"  best {best[1]} {best[0]:.1f} us = {cud / best[0]:.2f}x cuDNN speed")


if __name__ == "__main__":
  main()
