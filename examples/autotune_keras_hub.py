"""Keras-Hub causal LMs, unedited, under ``wt.autotune``: prefill and one
cached decode step, the model as Keras-Hub runs it against the same step
transformed, logits compared, and on a GPU both timed (CUPTI).

The models are built from Keras-Hub's own backbone classes with public
configs and random weights (nothing is downloaded), with ``--layers`` of
their layers. Needs ``pip install "wavetune-jax[clients]"`` (keras and
the rest) and then ``pip install --no-deps keras-hub`` (its own
dependencies pull in TensorFlow), and ``KERAS_BACKEND=jax`` (set here if
unset).

    python3 examples/autotune_keras_hub.py --models llama3_8b,mixtral_8x7b --layers 4
    python3 examples/autotune_keras_hub.py --tiny                 # CPU: tiny configs
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import wavetune_jax as wt  # noqa: E402

# Backbone class, CausalLM class, public config (layers set by --layers).
MODELS = {
    "llama3_8b": ("Llama3Backbone", "Llama3CausalLM", dict(
        vocabulary_size=128256, num_query_heads=32, num_key_value_heads=8, hidden_dim=4096,
        intermediate_dim=14336, rope_max_wavelength=500000)),
    "qwen2_7b": ("QwenBackbone", "QwenCausalLM", dict(
        vocabulary_size=152064, num_query_heads=28, num_key_value_heads=4, hidden_dim=3584,
        intermediate_dim=18944, rope_max_wavelength=1000000)),
    "mixtral_8x7b": ("MixtralBackbone", "MixtralCausalLM", dict(
        vocabulary_size=32000, num_query_heads=32, num_key_value_heads=8, hidden_dim=4096,
        intermediate_dim=14336, num_experts=8, top_k=2, rope_max_wavelength=1000000)),
    "qwen3_moe_30b": ("Qwen3MoeBackbone", "Qwen3MoeCausalLM", dict(
        vocabulary_size=151936, num_query_heads=32, num_key_value_heads=4, head_dim=128,
        hidden_dim=2048, intermediate_dim=6144, moe_intermediate_dim=768, num_experts=128,
        top_k=8)),
}
TINY = {
    "llama3": ("Llama3Backbone", "Llama3CausalLM", dict(
        vocabulary_size=256, num_query_heads=4, num_key_value_heads=2, hidden_dim=64,
        intermediate_dim=128)),
    "mixtral": ("MixtralBackbone", "MixtralCausalLM", dict(
        vocabulary_size=256, num_query_heads=4, num_key_value_heads=2, hidden_dim=64,
        intermediate_dim=128, num_experts=4, top_k=2)),
}


def build(spec, layers: int, dtype: str):
  import keras_hub
  backbone_cls, lm_cls, cfg = spec
  backbone = getattr(keras_hub.models, backbone_cls)(num_layers=layers, dtype=dtype, **cfg)
  return getattr(keras_hub.models, lm_cls)(backbone=backbone, preprocessor=None)


def steps(lm):
  """``prefill(weights, tokens)`` and ``decode(weights, token, cache, index)``,
  the model's own functions with its weights as inputs (Keras's stateless
  call, as Keras-Hub's own JAX ``generate`` runs them)."""
  import keras
  variables = lm.trainable_variables + lm.non_trainable_variables

  def prefill(weights, tokens):
    with keras.StatelessScope(state_mapping=list(zip(variables, weights))):
      return lm(tokens)

  def decode(weights, token, cache, index):
    with keras.StatelessScope(state_mapping=list(zip(variables, weights))):
      logits, _, _ = lm.call_with_cache(token, cache, index)
    return logits

  return [v.value for v in variables], prefill, decode


def empty_cache(lm, batch: int, length: int):
  bb = lm.backbone
  head_dim = getattr(bb, "head_dim", None) or bb.hidden_dim // bb.num_query_heads
  return jnp.zeros((batch, bb.num_layers, 2, length, bb.num_key_value_heads, head_dim),
                   lm.compute_dtype)


def rel_rms(a, b) -> float:
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  return float(np.sqrt(np.mean((a - b) ** 2) / (np.mean(b ** 2) + 1e-12)))


def compile_time(fn, args):
  t0 = time.perf_counter()
  traced = jax.jit(fn).trace(*args)
  t1 = time.perf_counter()
  exe = traced.lower().compile()
  return exe, t1 - t0, time.perf_counter() - t0


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--models", default="llama3_8b,mixtral_8x7b")
  ap.add_argument("--layers", type=int, default=4)
  ap.add_argument("--prompt", type=int, nargs="+", default=[2048])
  ap.add_argument("--batch", type=int, default=1, help="prefill batch")
  ap.add_argument("--decode-batch", type=int, nargs="+", default=[8])
  ap.add_argument("--cache", type=int, nargs="+", default=[4096])
  ap.add_argument("--tiny", action="store_true", help="tiny configs (CPU)")
  ap.add_argument("--report", action="store_true", help="print every call autotune looked at")
  ap.add_argument("--masks", action="store_true",
                  help="wt.autotune(..., masks=True): Keras-Hub's attention masks checked at run time")
  ap.add_argument("--iterations", type=int, default=20)
  ap.add_argument("--json", help="write the rows here")
  a = ap.parse_args(argv)
  try:
    import keras_hub  # noqa: F401
  except ImportError:
    print("needs keras and keras-hub: pip install 'wavetune-jax[clients]' && "
          "pip install --no-deps keras-hub", file=sys.stderr)
    return 2
  table = TINY if a.tiny else MODELS
  names = list(TINY) if a.tiny else a.models.split(",")
  unknown = [n for n in names if n not in table]
  if unknown:
    ap.error(f"unknown model {unknown[0]!r}; one of {sorted(table)}")
  if a.tiny:
    a.layers, a.prompt, a.batch, a.decode_batch, a.cache = 2, [16], 2, [2], [32]
  on_gpu = jax.devices()[0].platform == "gpu"
  prof = None
  if on_gpu:
    from wavetune_jax.tuning.profiler import Profiler
    prof = Profiler(iterations=a.iterations)
  device = jax.devices()[0].device_kind
  rows = []
  for name in names:
    lm = build(table[name], a.layers, "bfloat16")
    weights, prefill, decode = steps(lm)
    print(f"{device}: keras-hub {name}, {a.layers} layers", flush=True)
    work = [("prefill", a.batch, t, None) for t in a.prompt] + [
        ("decode", b, None, c) for b in a.decode_batch for c in a.cache]
    for kind, batch, prompt, cache in work:
      key = jax.random.PRNGKey(len(rows))
      vocab = lm.backbone.vocabulary_size
      if kind == "prefill":
        tokens = {"token_ids": jax.random.randint(key, (batch, prompt), 1, vocab),
                  "padding_mask": jnp.ones((batch, prompt), jnp.int32)}
        fn, args = prefill, (weights, tokens)
      else:  # each sequence holds `cache` tokens; the step writes the next one
        kv = empty_cache(lm, batch, cache + 1)
        kv = jax.random.normal(key, kv.shape, kv.dtype)
        token = jax.random.randint(key, (batch, 1), 1, vocab)
        fn, args = decode, (weights, token, kv, jnp.int32(cache))
      tuned = wt.autotune(fn, report=a.report, masks=a.masks)
      exe0, trace0, total0 = compile_time(fn, args)
      exe1, trace1, total1 = compile_time(tuned, args)
      out0, out1 = exe0(*args), exe1(*args)
      err = rel_rms(out1, out0)
      us0 = us1 = None
      if prof is not None:
        # The profiler compiles each function again with its L2-flush
        # buffer; it takes the arguments as one flat list.
        flat, tree = jax.tree_util.tree_flatten(args)
        call = lambda f: (lambda *xs: f(*jax.tree_util.tree_unflatten(tree, xs)))
        m0, m1 = prof.measure_many([call(fn), call(tuned)], flat)
        for m in (m0, m1):
          if m.status != "ok":
            print(f"      timing failed: {m.status} {m.error}", flush=True)
        us0 = m0.median_us if m0.status == "ok" else None
        us1 = m1.median_us if m1.status == "ok" else None
      sites = tuned.sites
      kept = sorted({s.reason for s in sites if not s.replaced})
      row = {"library": "keras_hub", "model": name, "layers": a.layers, "kind": kind,
             "batch": batch, "prompt": prompt, "cache": cache, "device": device,
             "us_untransformed": us0, "us_autotune": us1,
             "speedup": us0 / us1 if us0 and us1 else None, "rel_rms_diff": err,
             "trace_compile_s": [total0, total1], "trace_s": [trace0, trace1],
             "replaced": sum(s.replaced for s in sites), "calls": len(sites),
             "backends": sorted({s.backend.split(" ")[0] for s in sites if s.replaced}),
             "kept_reasons": kept}
      rows.append(row)
      size = f"prompt {prompt}" if kind == "prefill" else f"cache {cache}"
      timing = (f"{us0:9.1f} -> {us1:9.1f} us ({us0 / us1:.3f}x)" if us0 and us1
                else "(times need a GPU)")
      print(f"  {kind:<7} batch {batch:<3} {size:<12} {timing}  rel. RMS diff {err:.1e}  "
            f"replaced {row['replaced']}/{row['calls']} {row['backends']}  trace+compile "
            f"{total0:.2f} -> {total1:.2f} s", flush=True)
      for reason in kept:
        print(f"      kept: {reason}")
      if err > (0.25 if "experts" in str(table[name][2]) else 0.05):
        print(f"error: autotune's logits differ by {err:.3g}", file=sys.stderr)
        return 1
      if a.json:
        with open(a.json + ".tmp", "w") as f:
          json.dump({"rows": rows}, f, indent=1)
        os.replace(a.json + ".tmp", a.json)
  return 0


if __name__ == "__main__":
  sys.exit(main())
