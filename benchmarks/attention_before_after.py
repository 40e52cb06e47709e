"""The Mosaic attention kernel now against an earlier version of it, on a GPU.

Times the plain (one CTA per program) kernel of ``pallas_kernels.attention.mosaic``
against the same module at an earlier commit, on causal prefill with and
without a window (CUPTI, L2 flushed, median of ``--iterations``; each pair
timed twice, alternating). The earlier module is a file:

    git show <commit>:pallas_kernels/attention/mosaic.py > /tmp/attention_before.py
    python3 benchmarks/attention_before_after.py --before /tmp/attention_before.py
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

#: (batch, tokens, q_heads, kv_heads, block_k, window_left; -1: none).
PROBLEMS = [
    (1, 128, 8, 1, 128, -1), (4, 128, 32, 8, 128, -1), (1, 256, 32, 8, 128, -1),
    (1, 512, 8, 1, 128, -1), (2, 2048, 8, 1, 128, -1), (16, 1000, 32, 8, 128, -1),
    (1, 4096, 8, 1, 128, -1), (1, 4096, 32, 8, 128, -1), (1, 8192, 32, 8, 64, -1),
    (1, 8192, 32, 8, 128, 1023), (1, 16384, 32, 8, 128, 4095),
]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--before", required=True, metavar="FILE",
                  help="pallas_kernels/attention/mosaic.py at an earlier commit")
  ap.add_argument("--iterations", type=int, default=20)
  a = ap.parse_args(argv)
  if not os.path.isfile(a.before):
    ap.error(f"--before {a.before}: no such file")

  import jax
  import jax.numpy as jnp

  from pallas_kernels.attention import mosaic as now
  from wavetune_jax.tuning import profiler

  spec = importlib.util.spec_from_file_location("attention_before", a.before)
  before = importlib.util.module_from_spec(spec)
  sys.modules[spec.name] = before  # (its dataclasses look their module up)
  spec.loader.exec_module(before)
  prof = profiler.Profiler(iterations=a.iterations)
  print(jax.devices()[0].device_kind, jax.__version__, flush=True)
  print(f"{'batch x tokens, heads, block_k, window':<40} {'before us':>10} {'now us':>10} "
        f"{'before/now':>10}")
  for b, t, h, kvh, bk, w in PROBLEMS:
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(ks[0], (b, t, h, 128), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, t, kvh, 128), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, t, kvh, 128), jnp.float32).astype(jnp.bfloat16)
    old_cfg = before.MosaicAttentionConfig(block_q=128, block_k=bk, num_stages=2)
    new_cfg = now.MosaicAttentionConfig(block_q=128, block_k=bk, num_stages=2)
    fns = [lambda q, k, v: before.attention(q, k, v, config=old_cfg, window_left=w),
           lambda q, k, v: now.attention(q, k, v, config=new_cfg, window_left=w)] * 2
    r = prof.measure_many(fns, (q, k, v))
    if any(m.status != "ok" for m in r):
      print(f"b{b} x {t}: " + "; ".join(f"{m.status}: {(m.error or '')[:200]}" for m in r))
      continue
    old_us = min(r[0].median_us, r[2].median_us)
    new_us = min(r[1].median_us, r[3].median_us)
    label = f"{b} x {t}, {h}/{kvh}, {bk}, {'-' if w < 0 else w + 1}"
    print(f"{label:<40} {old_us:10.1f} {new_us:10.1f} {old_us / new_us:10.3f}", flush=True)


if __name__ == "__main__":
  main()
