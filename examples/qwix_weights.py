"""A decoder whose weights were quantized by qwix, run through the wavetune ops.

qwix (Google's JAX quantization library) quantizes each GEMM weight of the
decoder in ``wavetune_jax.models`` per output channel; ``wt.from_qwix``
turns each ``qwix.QArray`` into the ``(w_q, scales)`` pair that
``wt.quantized_matmul`` and ``wt.quantized_ragged_dot`` take
(``models.quantize_params(..., quantize=...)`` places them). The script then
runs a prefill of the quantized model with the wavetune ops and with XLA's
ops, and the same model in bfloat16 with XLA, and prints how far apart the
logits are (relative RMS). On a CPU the wavetune ops run XLA's op (one
warning); on an H100 or H200 they run the shipped tables' kernels.

    pip install qwix
    python3 examples/qwix_weights.py                           # small dense model, int8
    python3 examples/qwix_weights.py --model small_moe --weights w8a8  # FP8 experts too
    python3 examples/qwix_weights.py --model llama3_8b --layers 2 --tokens 512   # GPU

``--weights``: ``int8`` or ``fp8`` (weight-only, bf16 activations),
``int4`` (weight-only, ``[N, K]``, a scale per 128 values of K: qwix's
``tiled_axes``) or ``w8a8`` (e4m3 weights ``[N, K]`` and e4m3 activations
quantized per token).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import wavetune_jax as wt
from wavetune_jax import models


def qwix_quantize(w, dtype: str, layout: str, group_size: int | None = None):
  """``w [K, N]`` (or experts ``[G, K, N]``) quantized by qwix per output
  channel (int4: per ``group_size`` values of K of each channel), as
  ``(w_q, scales)``: ``models.quantize_params``'s ``quantize``."""
  import qwix
  axes = list(range(w.ndim - 2)) + [w.ndim - 1]  # each expert and output channel
  tiles = {w.ndim - 2: group_size} if group_size else None
  return wt.from_qwix(qwix.quantize(w, jnp.dtype(dtype), channelwise_axes=axes,
                                    tiled_axes=tiles), layout=layout)


def rel_rms(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))


def main(argv=None) -> dict:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--model", default="small", choices=sorted(models.MODELS))
  ap.add_argument("--layers", type=int, default=None, help="default: the model's")
  ap.add_argument("--weights", default="int8", choices=("int8", "fp8", "int4", "w8a8"))
  ap.add_argument("--tokens", type=int, default=16, help="prompt length (batch 1)")
  a = ap.parse_args(argv)
  try:
    import qwix  # noqa: F401
  except ImportError:
    sys.exit("qwix_weights.py needs qwix: pip install qwix (or the package's [clients] extra)")
  cfg = models.MODELS[a.model]
  if a.layers:
    cfg = cfg.with_layers(a.layers)
  params = models.init(jax.random.PRNGKey(0), cfg)
  toks = jax.random.randint(jax.random.PRNGKey(1), (1, a.tokens), 0, cfg.vocab)
  q = models.quantize_params(params, cfg, a.weights, quantize=qwix_quantize)

  def logits(p, ops):
    run = jax.jit(lambda p, t: models.prefill(p, t, cfg=cfg, ops=models.make_ops(ops),
                                              max_len=a.tokens)[0])
    return run(p, toks)

  wt_q, xla_q, xla_bf16 = logits(q, "tables"), logits(q, "xla"), logits(params, "xla")
  out = {"wavetune_vs_xla": rel_rms(wt_q, xla_q), "quantized_vs_bf16": rel_rms(xla_q, xla_bf16)}
  print(f"{a.model}, {cfg.layers} layers, {a.weights} weights quantized by qwix, "
        f"{jax.devices()[0].device_kind}")
  print(f"logits, relative RMS: wavetune ops vs XLA (same qwix weights) "
        f"{out['wavetune_vs_xla']:.1e}; quantized vs bfloat16 {out['quantized_vs_bf16']:.1e}")
  return out


if __name__ == "__main__":
  main()
