"""Attention speed at ragged lengths: q_len and kv_len on and off the block grid.

Checks and times a few configs for (q_len, kv_len) pairs around a multiple of
the blocks, causal and not, with cuDNN on the same timer; prints TFLOP/s.

    python3 benchmarks/attention_lengths.py [--batch 8] [--base 2048]
"""

from __future__ import annotations

import argparse

import jax

from wavetune_jax import ATTENTION, AttentionProblem, TritonAttentionConfig
from wavetune_jax.tuning import profiler

CONFIGS = [TritonAttentionConfig(block_q=128, block_k=64, num_warps=4, num_stages=2),
           TritonAttentionConfig(block_q=128, block_k=128, num_warps=8, num_stages=3),
           TritonAttentionConfig(block_q=64, block_k=64, num_warps=4, num_stages=3)]


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--batch", type=int, default=8)
  ap.add_argument("--base", type=int, default=2048)
  a = ap.parse_args()
  print(jax.devices()[0].device_kind, jax.__version__)
  prof = profiler.Profiler(iterations=20)
  s = a.base
  pairs = [(s, s), (s - 48, s), (s, s - 48), (s - 48, s - 48), (s - 1, s - 1), (s + 1, s + 1)]
  print(f"{'causal':<7}{'q_len':>6}{'kv_len':>7} " + " ".join(
      f"{c.block_q}/{c.block_k}/{c.num_warps}/{c.num_stages}".rjust(12) for c in CONFIGS)
        + "       cudnn   (TFLOP/s)")
  for causal in (True, False):
    for ql, kl in pairs:
      p = AttentionProblem(batch=a.batch, q_heads=32, kv_heads=8, q_len=ql, kv_len=kl,
                           head_dim=128, causal=causal)
      args = ATTENTION.inputs(p, jax.random.PRNGKey(0))
      ref = ATTENTION.reference(p, *args)
      fns = [ATTENTION.build(p, c) for c in CONFIGS] + [ATTENTION.baseline(p)]
      res = prof.measure_many(fns, args, reference=ref, tolerance=ATTENTION.tolerance(p),
                              out_bytes=ref.size * 4)
      cells = [f"{p.flops / m.median_us / 1e6:12.0f}" if m.status == "ok"
               else f"{m.status:>12}" for m in res]
      print(f"{str(causal):<7}{ql:>6}{kl:>7} " + " ".join(cells))


if __name__ == "__main__":
  main()
