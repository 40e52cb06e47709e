"""How far is a warp-specialized Mosaic GPU kernel from cuDNN, next to ours?

The Triton kernel family's best config (the sweep's oracle) reaches 0.72-0.80x
cuDNN's speed on Hopper. This benchmark measures, on the same CUPTI timer, with
the same checks against the float32 reference:

* four configs of our kernel that are often the oracle in the sweeps;
* JAX's Mosaic GPU flash attention, q scaled by ``1/sqrt(head_dim)`` first (``jax.experimental.pallas.ops.gpu.
  attention_mgpu``: TMA loads, wgmma, a producer warpgroup and two consumer
  warpgroups, FlashAttention-3 style) over its block sizes;
* cuDNN (``jax.nn.dot_product_attention(implementation="cudnn")``).

It decides whether a Mosaic GPU kernel family is worth building. That kernel
needs ``q_len`` a multiple of ``2 * block_q`` and ``kv_len`` a multiple of
``block_kv``, so the shapes here are the training suite's aligned ones. Its
shared-memory buffers are float16 (bfloat16 inputs fail to compile: "src had
type bfloat16 and dst had type float16", JAX 0.11.2 on an H100), so every
implementation runs in float16 by default, which the tensor cores execute at
the bfloat16 rate (``--dtype bfloat16`` times ours and cuDNN in bfloat16 and
reports the Mosaic kernel's compile errors).

    python3 benchmarks/attention_mosaic.py [--quick] [--dtype float16|bfloat16]
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp

from pallas_kernels.attention import AttentionConfig
from wavetune_jax import evaluate, profiler
from wavetune_jax.attention_spec import ATTENTION, AttentionProblem

OURS = [AttentionConfig(block_q=128, block_k=128, num_warps=8, num_stages=3),
        AttentionConfig(block_q=64, block_k=64, num_warps=4, num_stages=3),
        AttentionConfig(block_q=128, block_k=64, num_warps=4, num_stages=2),
        AttentionConfig(block_q=64, block_k=32, num_warps=4, num_stages=3)]
# (block_q, block_kv, max_concurrent_steps)
MOSAIC = [(64, 64, 2), (64, 128, 2), (64, 128, 3), (64, 256, 2)]
SHAPES = [  # (batch, q_heads, kv_heads, seq, causal): Llama-3-8B, Llama-3-70B TP8
    (1, 32, 8, 4096, True), (4, 32, 8, 2048, True), (1, 32, 8, 16384, True),
    (8, 32, 8, 512, True), (4, 8, 1, 2048, True), (2, 32, 8, 4096, False)]


def mosaic_fn(causal: bool, block_q: int, block_kv: int, steps: int):
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
  ap.add_argument("--dtype", choices=("float16", "bfloat16"), default="float16")
  a = ap.parse_args()
  print(jax.devices()[0].device_kind, jax.__version__)
  prof = profiler.Profiler(iterations=20)
  shapes = SHAPES[:2] if a.quick else SHAPES
  names = ([f"ours {c.block_q}/{c.block_k}/{c.num_warps}/{c.num_stages}" for c in OURS]
           + [f"mosaic {bq}/{bk}/{s}" for bq, bk, s in MOSAIC] + ["cudnn"])
  ratios = {"ours": [], "mosaic": []}
  print(f"{'problem':<44}{'best ours':>10}{'best mosaic':>12}{'cudnn':>9}"
        f"{'ours/cudnn':>11}{'mosaic/cudnn':>13}   (us; x = speed relative to cuDNN)")
  for b, hq, hkv, s, causal in shapes:
    p = AttentionProblem(batch=b, q_heads=hq, kv_heads=hkv, q_len=s, kv_len=s,
                         head_dim=128, causal=causal, dtype=a.dtype)
    args = ATTENTION.inputs(p, jax.random.PRNGKey(0))
    ref = ATTENTION.reference(p, *args)
    fns = ([ATTENTION.build(p, c) for c in OURS]
           + [mosaic_fn(causal, *m) for m in MOSAIC] + [ATTENTION.baseline(p)])
    res = prof.measure_many(fns, args, reference=ref, tolerance=ATTENTION.tolerance(p),
                            out_bytes=ref.size * 4)
    t = {n: m.median_us for n, m in zip(names, res) if m.status == "ok"}
    for n, m in zip(names, res):
      if m.status != "ok":
        print(f"  {n}: {m.status}: {m.error[:160]}")
    best = {k: min((v for n, v in t.items() if n.startswith(k)), default=None)
            for k in ("ours", "mosaic")}
    cud = t.get("cudnn")
    cells = []
    for k in ("ours", "mosaic"):
      if best[k] is not None and cud is not None:
        ratios[k].append(cud / best[k])
        cells.append(f"{cud / best[k]:.3f}x")
      else:
        cells.append("-")
    fmt = lambda x: "-" if x is None else f"{x:.1f}"  # noqa: E731
    print(f"{ATTENTION.problem_key(p):<44}{fmt(best['ours']):>10}{fmt(best['mosaic']):>12}{fmt(cud):>9}"
          f"{cells[0]:>11}{cells[1]:>13}")
    print("  " + "  ".join(f"{n}={t[n]:.1f}" for n in names if n in t))
  for k, r in ratios.items():
    if r:
      print(f"geomean {k} vs cuDNN: {evaluate._geomean(r):.3f}x over {len(r)} problems")


if __name__ == "__main__":
  main()
