"""Router agreement in a quantized MoE decoder's decode step.

``wavetune bench model`` reports each setting's logits against the xla
setting's as one relative RMS difference. In an MoE model one token whose
router scores are nearly tied can pick another expert in one setting than in
the other, and that token's whole MLP output changes: at one sequence the
difference is then large although every kernel is right. This script runs
the decode step of ``wavetune bench model`` (the same weights, caches,
lengths and tokens) through XLA and through the wavetune ops, records every
layer's top-k experts per token in both, and prints:

- the share of (token, layer) routings that agree between the two settings;
- each setting's logits against the bfloat16 model through XLA (the
  quantization's own error, so the two can be compared on the same scale),
  and against each other.

    python3 benchmarks/moe_router_agreement.py --model mixtral_8x7b --weights w8a8 --batch 1 8 --cache 4096

On a CPU, ``--model small_moe`` runs (the kernels in interpret mode).
"""

from __future__ import annotations

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np

from wavetune_jax import models as M
from wavetune_jax.models import decoder


def routed_step(cfg, ops_name, params, kc, vc, lengths, tokens):
  """Logits of one decode step and each layer's ``[tokens, top_k]`` experts."""
  chosen = []
  real = decoder.moe_mlp

  def recording(p, x, *, top_k, gemm):
    logits = x.astype(jnp.float32) @ p["router"]
    jax.debug.callback(lambda c: chosen.append(np.asarray(c)),
                       jax.lax.top_k(logits, top_k)[1], ordered=True)
    return real(p, x, top_k=top_k, gemm=gemm)

  decoder.moe_mlp = recording
  try:
    step = functools.partial(M.decode_step, cfg=cfg, ops=M.make_ops(ops_name),
                             write_cache=False)
    out = jax.jit(step)(params, kc, vc, lengths, tokens)[0]
    out = np.asarray(out.astype(jnp.float32))
    jax.effects_barrier()
  finally:
    decoder.moe_mlp = real
  return out, chosen


def agreement(a, b) -> float:
  """The share of (token, layer) pairs routed to the same set of experts."""
  return float(np.mean([np.all(np.sort(x, axis=-1) == np.sort(y, axis=-1), axis=-1)
                        for x, y in zip(a, b)]))


def rel(a, b) -> float:
  return float(np.sqrt(np.mean((a - b) ** 2) / (np.mean(b ** 2) + 1e-12)))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  ap.add_argument("--model", default="mixtral_8x7b",
                  choices=[n for n, c in M.MODELS.items() if c.experts])
  ap.add_argument("--layers", type=int, default=0, help="default: 4, or the model's if small")
  ap.add_argument("--weights", default="w8a8", choices=["bf16", "int8", "fp8", "w8a8"])
  ap.add_argument("--quantize-experts", action="store_true",
                  help="int8/fp8: the experts too (w8a8 quantizes them always)")
  ap.add_argument("--ops", default="tables", help="the wavetune setting (default: tables)")
  ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
  ap.add_argument("--cache", type=int, nargs="+", default=[4096])
  a = ap.parse_args(argv)
  if a.quantize_experts and a.weights not in ("int8", "fp8"):
    ap.error("--quantize-experts needs --weights int8 or fp8")
  if min(a.batch + a.cache) < 1:
    ap.error("--batch and --cache take positive integers")
  cfg = M.MODELS[a.model]
  small = a.model.startswith("small")
  cfg = cfg.with_layers(a.layers or (cfg.layers if small else 4))
  if not small and jax.devices()[0].platform != "gpu":
    ap.error(f"--model {a.model} needs a GPU; on a CPU use --model small_moe")
  raw = M.init(jax.random.PRNGKey(0), cfg)  # the weights of `wavetune bench model`
  params = M.quantize_params(raw, cfg, a.weights, experts=a.quantize_experts)
  experts = " (experts too)" if a.quantize_experts else ""
  print(f"{jax.devices()[0].device_kind}: {cfg.name}, {cfg.layers} layers, {a.weights} "
        f"weights{experts}, top-{cfg.top_k} of {cfg.experts} experts; xla against {a.ops}")
  w = max(14, len(a.ops) + 8)
  cols = f"{'xla vs bf16':>14} {a.ops + ' vs bf16':>{w}} {a.ops + ' vs xla':>{w}}"
  print(f"{'':13} {'routings the same':^{len(cols)}} | logits, relative RMS difference")
  print(f"{'batch':>5} {'cache':>6} {cols} | {cols}")
  for batch in a.batch:
    for length in a.cache:
      shape = (batch, length + 1, cfg.kv_heads, cfg.head_dim)
      kc, vc = M.random_kv_caches(cfg, shape)  # the bench's
      lengths = jnp.full((batch,), length, jnp.int32)
      tokens = jax.random.randint(jax.random.PRNGKey(2), (batch,), 0, cfg.vocab)
      ref, rr = routed_step(cfg, "xla", raw, kc, vc, lengths, tokens)
      xo, xr = routed_step(cfg, "xla", params, kc, vc, lengths, tokens)
      wo, wr = routed_step(cfg, a.ops, params, kc, vc, lengths, tokens)
      print(f"{batch:>5} {length:>6} {agreement(xr, rr):>14.1%} {agreement(wr, rr):>{w}.1%} "
            f"{agreement(wr, xr):>{w}.1%} | {rel(xo, ref):>14.3f} {rel(wo, ref):>{w}.3f} "
            f"{rel(wo, xo):>{w}.3f}", flush=True)


if __name__ == "__main__":
  main()
