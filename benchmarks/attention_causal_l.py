"""Causal attention: is L = mean or L = max KV blocks per program the better
wave-model coordinate? Fit error of both on a recorded sweep (CPU).

    python3 benchmarks/attention_causal_l.py data/sweeps/nvidia_h200/attention_bfloat16.jsonl.gz
"""

from __future__ import annotations

import contextlib
import sys

import wave_model_fit

from wavetune_jax import ATTENTION
from wavetune_jax.families.attention import problem as attention_problem


@contextlib.contextmanager
def causal_l(mode: str):
  """Every attention backend's ``(G, L)`` with ``L`` under a causal mask taken
  as ``mode`` (``"mean"`` or ``"max"``) KV blocks over the query blocks.

  The backends map a config with ``problem.coords(problem, block_q, block_k)``,
  whose ``causal_l`` defaults to ``CAUSAL_L``; this passes ``mode`` instead.
  The backend objects are shared by every copy of the family (also the one a
  sweep's dataset holds), so the fits, the tables and their predictions all
  see it.
  """
  def coords(problem, macro):
    return attention_problem.coords(problem, macro["block_q"], macro["block_k"],
                                    causal_l=mode)

  for b in ATTENTION.backends:
    b.coords = coords
  try:
    yield
  finally:
    for b in ATTENTION.backends:
      del b.coords


def main():
  for mode in ("mean", "max"):
    with causal_l(mode):
      print(f"=== L = {mode} KV blocks over the query blocks")
      wave_model_fit.main(sys.argv[1:])


if __name__ == "__main__":
  main()
