"""Our two attention backends next to JAX's Mosaic GPU kernel and cuDNN.

Measures, on the same CUPTI timer, with the same checks against the float32
reference, on six aligned Llama shapes (head_dim 128), with ``--ragged`` on
shapes whose lengths are not multiples of the blocks (the suite's 1000 and
3000, and small odd ones that check the masking of ragged ends), or with
``--coverage`` on head_dim 80-256 and lengths that are not multiples of 8, or
with ``--short`` on one sequence of 200-500 tokens (below one wave), or with
``--few-long`` on 500-2,000 tokens with few heads (Mosaic's 128-row programs
fill a quarter to half of the SMs):

* "triton": four configs of the Triton kernel that are often the sweep's oracle
  (nine with ``--short`` and ``--few-long``);
* "mosaic": the Mosaic GPU backend (``pallas_kernels.attention.mosaic``,
  ``MosaicAttentionConfig``), over the configs its space holds for the shape;
* "jax-mgpu": JAX's own ``jax.experimental.pallas.ops.gpu.attention_mgpu``,
  the kernel ours derives from, with ``q`` scaled by ``1/sqrt(head_dim)``
  first (it applies no scale). Its shared-memory buffers are float16, so in
  bfloat16 it fails to compile ("src had type bfloat16 and dst had type
  float16", JAX 0.11.2) and is left out; ``--dtype float16`` times it;
* cuDNN (``jax.nn.dot_product_attention(implementation="cudnn")``).

Each problem also prints the family heuristic's choice and its speed over
cuDNN ("heuristic: ..."); where that config is not among the above it is
timed on its own and left out of the columns.

    python3 benchmarks/attention_mosaic.py [--quick] [--ragged | --coverage | --short | --few-long] [--dtype bfloat16|float16]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from wavetune_jax import (ATTENTION, AttentionProblem, MosaicAttentionConfig,
                          TritonAttentionConfig)
from wavetune_jax.core import hardware
from wavetune_jax.tuning import evaluate, profiler

TRITON = [TritonAttentionConfig(block_q=128, block_k=128, num_warps=8, num_stages=3),
          TritonAttentionConfig(block_q=64, block_k=64, num_warps=4, num_stages=3),
          TritonAttentionConfig(block_q=128, block_k=64, num_warps=4, num_stages=2),
          TritonAttentionConfig(block_q=64, block_k=32, num_warps=4, num_stages=3)]
# The Triton heuristic's choices below one wave (--short).
SHORT_TRITON = [TritonAttentionConfig(block_q=32, block_k=128, num_warps=4, num_stages=2),
                TritonAttentionConfig(block_q=32, block_k=64, num_warps=4, num_stages=3),
                TritonAttentionConfig(block_q=32, block_k=128, num_warps=4, num_stages=3),
                TritonAttentionConfig(block_q=64, block_k=128, num_warps=4, num_stages=2),
                TritonAttentionConfig(block_q=64, block_k=128, num_warps=4, num_stages=3)]
# JAX's kernel: (block_q per warpgroup, block_kv, max_concurrent_steps)
JAX_MGPU = [(64, 64, 2), (64, 128, 2), (64, 128, 3)]
KINDS = ("triton", "mosaic", "jax-mgpu")
# (batch, q_heads, kv_heads, q_len, kv_len, causal, head_dim): Llama-3-8B, Llama-3-70B TP8
SHAPES = [
    (1, 32, 8, 4096, 4096, True, 128), (4, 32, 8, 2048, 2048, True, 128),
    (1, 32, 8, 16384, 16384, True, 128), (8, 32, 8, 512, 512, True, 128),
    (4, 8, 1, 2048, 2048, True, 128), (2, 32, 8, 4096, 4096, False, 128)]
RAGGED = [
    (1, 32, 8, 1000, 1000, True, 128), (4, 32, 8, 1000, 1000, True, 128),
    (1, 32, 8, 3000, 3000, True, 128), (2, 8, 1, 3000, 3000, True, 128),
    (2, 32, 8, 1000, 1000, False, 128), (2, 16, 2, 1000, 1000, True, 64),
    (1, 8, 8, 24, 1000, False, 128), (1, 8, 2, 200, 520, True, 128),
    (1, 8, 2, 72, 72, True, 256), (1, 4, 4, 8, 8, True, 128)]
# One sequence of a few hundred tokens (programs below one wave): where the
# Triton heuristic answers, at lengths that are and are not multiples of its
# 64-row blocks.
SHORT = [(1, h, hk, L, L, True, d) for L in (200, 256, 333, 500)
         for h, hk, d in ((28, 4, 128), (32, 32, 96), (16, 8, 256))]
# Few programs, long sequences: batch 1-2 with 4-16 query heads at 500-2,000
# tokens, where the Mosaic kernel's 128-row programs fill a quarter to half
# of an H100's SMs (the suite's minimum: 8/1 heads at 1,000 tokens).
FEW_LONG = ([(1, 8, 1, L, L, True, 128) for L in (768, 1000, 1024)]
            + [(1, 4, 4, L, L, True, 128) for L in (1000, 1536, 2048)]
            + [(1, 8, 8, 1000, 1000, True, 128), (2, 4, 1, 1000, 1000, True, 128),
               (1, 16, 8, 512, 512, True, 128), (1, 8, 2, 1000, 1000, True, 64),
               (1, 8, 1, 1000, 1000, False, 128), (1, 12, 4, 640, 640, True, 128)])
# head_dim other than 64/128 and lengths that are not multiples of 8 (the
# Mosaic kernel pads those on the device): Phi-3-mini (32/32, 96), Gemma-2
# (16/8, 256), and 80 / 160 / 192 / 224 for the narrower swizzles.
COVERAGE = [
    (1, 32, 32, 2048, 2048, True, 96), (4, 32, 32, 777, 777, True, 96),
    (2, 32, 32, 4096, 4096, False, 96), (1, 16, 8, 4096, 4096, True, 256),
    (6, 16, 8, 777, 777, True, 256), (2, 28, 4, 777, 777, True, 128),
    (1, 28, 4, 2500, 2500, True, 128), (2, 28, 4, 1001, 1501, False, 128),
    (1, 32, 8, 13, 13, True, 128), (2, 16, 16, 1000, 1000, True, 80),
    (2, 16, 16, 1000, 1000, True, 160), (1, 16, 16, 2000, 2000, True, 192),
    (1, 8, 8, 515, 515, False, 224)]


def jax_mgpu_fn(causal: bool, block_q: int, block_kv: int, steps: int):
  from jax.experimental.pallas.ops.gpu import attention_mgpu as mgpu
  cfg = mgpu.TuningConfig(block_q=block_q, block_kv=block_kv,
                          max_concurrent_steps=steps, causal=causal)
  attn = functools.partial(mgpu.attention, config=cfg)

  def f(q, k, v):
    # The Mosaic kernel applies no softmax scale; scaling q first adds one
    # elementwise kernel, counted in its time.
    return attn(q * jnp.asarray(q.shape[-1] ** -0.5, q.dtype), k, v)
  return f


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true", help="first two shapes only")
  which = ap.add_mutually_exclusive_group()
  which.add_argument("--ragged", action="store_true",
                     help="lengths that are not multiples of the blocks")
  which.add_argument("--coverage", action="store_true",
                     help="head_dim 80-256 and lengths that are not multiples of 8")
  which.add_argument("--short", action="store_true",
                     help="one sequence of 200-500 tokens, more Triton configs")
  which.add_argument("--few-long", action="store_true",
                     help="500-2,000 tokens with few heads (a quarter to half of the SMs)")
  ap.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
  a = ap.parse_args()
  print(jax.devices()[0].device_kind, jax.__version__, a.dtype)
  hw = hardware.detect()
  prof = profiler.Profiler(iterations=20)
  shapes = (COVERAGE if a.coverage else SHORT if a.short else FEW_LONG if a.few_long
            else RAGGED if a.ragged else SHAPES)
  aligned = shapes is SHAPES
  triton_configs = TRITON + (SHORT_TRITON if a.short or a.few_long else [])
  shapes = shapes[:2] if a.quick else shapes
  ratios = {k: [] for k in KINDS}
  print(f"{'problem':<46}" + "".join(f"{k:>10}" for k in KINDS) + f"{'cudnn':>9}   "
        + "  ".join(f"{k}/cuDNN" for k in KINDS) + "   (best us; x = speed vs cuDNN)")
  for b, hq, hkv, sq, skv, causal, d in shapes:
    p = AttentionProblem(batch=b, q_heads=hq, kv_heads=hkv, q_len=sq, kv_len=skv,
                         head_dim=d, causal=causal, dtype=a.dtype)
    args = ATTENTION.inputs(p, jax.random.PRNGKey(0))
    ref = ATTENTION.reference(p, *args)
    mosaic = [c for c in ATTENTION.space(p, hw, prune=False)
              if isinstance(c, MosaicAttentionConfig)]
    triton = [c for c in triton_configs if c in ATTENTION.backend("triton").space(p, hw, prune=False)]
    heur = ATTENTION.heuristic(p, hw)
    names = ([f"triton {c.block_q}/{c.block_k}/{c.num_warps}/{c.num_stages}" for c in triton]
             + [f"mosaic {c.block_q}/{c.block_k}/{c.num_stages}" for c in mosaic])
    fns = [ATTENTION.build(p, c) for c in triton + mosaic]
    # The family heuristic's own choice, timed under its backend's name
    # unless it is one of the configs above (not counted in the columns).
    if heur in triton + mosaic:
      heur_name = names[(triton + mosaic).index(heur)]
    else:
      heur_name = f"heuristic ({ATTENTION.backend_of(heur).name})"
      names.append(heur_name)
      fns.append(ATTENTION.build(p, heur))
    if a.dtype == "float16" and aligned:  # JAX's kernel needs aligned lengths
      names += [f"jax-mgpu {bq}/{bk}/{st}" for bq, bk, st in JAX_MGPU]
      fns += [jax_mgpu_fn(causal, *m) for m in JAX_MGPU]
    names.append("cudnn")
    fns.append(ATTENTION.baseline(p))
    res = prof.measure_many(fns, args, reference=ref, tolerance=ATTENTION.tolerance(p),
                            out_bytes=ref.size * 4)
    t = {n: m.median_us for n, m in zip(names, res) if m.status == "ok"}
    for n, m in zip(names, res):
      if m.status != "ok":
        print(f"  {n}: {m.status}: {m.error[:160]}")
    best = {k: min((v for n, v in t.items() if n.split()[0] == k), default=None)
            for k in KINDS}
    cud = t.get("cudnn")
    cells = []
    for k in KINDS:
      if best[k] is not None and cud is not None:
        ratios[k].append(cud / best[k])
        cells.append(f"{cud / best[k]:.3f}x")
      else:
        cells.append("-")
    fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    print(f"{ATTENTION.problem_key(p):<46}" + "".join(f"{fmt(best[k]):>10}" for k in KINDS)
          + f"{fmt(cud):>9}   " + "  ".join(f"{c:>13}" for c in cells))
    print("  " + "  ".join(f"{n}={t[n]:.1f}" for n in names if n in t))
    if heur_name in t and cud is not None:
      print(f"  heuristic: {heur_name} {cud / t[heur_name]:.3f}x")
  for k, r in ratios.items():
    if r:
      print(f"geomean {k} vs cuDNN: {evaluate._geomean(r):.3f}x over {len(r)} problems")
  both = [max(x, y) for x, y in zip(ratios["triton"], ratios["mosaic"])]
  if both and len(both) == len(shapes):
    print(f"geomean best of our two backends vs cuDNN: {evaluate._geomean(both):.3f}x")


if __name__ == "__main__":
  main()
