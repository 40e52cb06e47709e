"""Causal attention: is L = mean or L = max KV blocks per program the better
wave-model coordinate? Fit error of both on a recorded sweep (CPU).

    python3 benchmarks/attention_causal_l.py data/sweeps/nvidia_h200/attention_bfloat16.jsonl.gz
"""

from __future__ import annotations

import sys

import wave_model_fit

from wavetune_jax import ATTENTION


def main():
  for mode in ("mean", "max"):
    ATTENTION.causal_l = mode
    print(f"=== L = {mode} KV blocks over the query blocks")
    wave_model_fit.main(sys.argv[1:])
  ATTENTION.causal_l = "mean"


if __name__ == "__main__":
  main()
