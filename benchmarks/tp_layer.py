"""A Llama decoder layer with tensor-parallel weights, wt ops against XLA + cuDNN.

Weights as JAX LLM stacks shard them: q, k, v, gate and up column-parallel
(their N over the ``tp`` mesh axis), o and down row-parallel (their K over
``tp``: a sum across devices after the GEMM), heads over ``tp``; activations
data-parallel over ``dp``. Both versions run the same jitted layer (RMSNorm,
attention with GQA, SwiGLU MLP, residuals) with the same input shardings; only
the GEMM and attention ops differ: ``wt.matmul`` / ``wt.attention`` (each
partitioned like XLA's op and tuned for its per-device shapes) or ``jnp.dot``
/ ``jax.nn.dot_product_attention`` (cuDNN on a GPU). Prints, per batch x
sequence, both step times (CUPTI over the whole jitted step), the
ratio, and whether the compiled step all-gathers a weight. No L2 flush: the
layer's weights are several times the L2 cache.

    python3 benchmarks/tp_layer.py [--tp 2] [--dp 1] [--tokens 512 2048 8192]
    python3 benchmarks/tp_layer.py --small --tp 2 --dp 2   # CPU, 4 host devices
"""

from __future__ import annotations

import argparse
import functools
import os
import sys

# Llama-3-8B: hidden, intermediate, q heads, kv heads, head_dim.
LLAMA3_8B = (4096, 14336, 32, 8, 128)
SMALL = (128, 256, 8, 4, 32)


def init(key, dims, dtype):
  import jax
  import jax.numpy as jnp
  hidden, inter, hq, hkv, d = dims
  shapes = {"wq": (hidden, hq * d), "wk": (hidden, hkv * d), "wv": (hidden, hkv * d),
            "wo": (hq * d, hidden), "wg": (hidden, inter), "wu": (hidden, inter),
            "wd": (inter, hidden)}
  keys = jax.random.split(key, len(shapes))
  return {n: (jax.random.normal(k, s, jnp.float32) / s[0] ** 0.5).astype(dtype)
          for k, (n, s) in zip(keys, shapes.items())}


def specs():
  from jax.sharding import PartitionSpec as P
  col, row = P(None, "tp"), P("tp", None)
  return {"wq": col, "wk": col, "wv": col, "wo": row, "wg": col, "wu": col, "wd": row}


def layer(params, x, *, dims, matmul, attention):
  """``x [batch, seq, hidden]`` through one decoder layer."""
  import jax
  import jax.numpy as jnp
  hidden, _, hq, hkv, d = dims
  b, s, _ = x.shape

  def norm(h):
    h32 = h.astype(jnp.float32)
    return (h32 * jax.lax.rsqrt(jnp.mean(h32 * h32, -1, keepdims=True) + 1e-5)).astype(h.dtype)

  h = norm(x).reshape(b * s, hidden)
  q = matmul(h, params["wq"]).reshape(b, s, hq, d)
  k = matmul(h, params["wk"]).reshape(b, s, hkv, d)
  v = matmul(h, params["wv"]).reshape(b, s, hkv, d)
  a = attention(q, k, v).reshape(b * s, hq * d)
  x = x + matmul(a, params["wo"]).reshape(b, s, hidden)
  h = norm(x).reshape(b * s, hidden)
  g = matmul(h, params["wg"])
  u = matmul(h, params["wu"])
  m = (jax.nn.silu(g.astype(jnp.float32)) * u.astype(jnp.float32)).astype(x.dtype)
  return x + matmul(m, params["wd"]).reshape(b, s, hidden)


def choices(dims, *, tp: int, dp: int, batch: int, seq: int) -> str:
  """The backend each wt op picks for its per-device shapes, e.g.
  ``qkv:xla o:mosaic ... attn:cudnn``."""
  from wavetune_jax import ATTENTION, MATMUL, AttentionProblem, MatmulProblem
  from wavetune_jax.runtime import selector
  hidden, inter, hq, hkv, d = dims
  m = batch // dp * seq
  gemms = {"q": (hidden, hq * d // tp), "kv": (hidden, hkv * d // tp),
           "o": (hq * d // tp, hidden), "gate_up": (hidden, inter // tp),
           "down": (inter // tp, hidden)}
  out = [f"{name}:{MATMUL.backend_of(selector.select(MATMUL, MatmulProblem(m=m, n=n, k=k)).config).name}"
         for name, (k, n) in gemms.items()]
  att = AttentionProblem(batch=batch // dp, q_heads=hq // tp, kv_heads=hkv // tp, q_len=seq,
                         head_dim=d)
  out.append(f"attn:{ATTENTION.backend_of(selector.select(ATTENTION, att).config).name}")
  return " ".join(out)


def step_time(exe, args, n_devices: int, iterations: int = 10) -> tuple[float, str]:
  """Microseconds of one step: CUPTI's kernel time summed over the devices
  and divided by their number (median of ``iterations`` calls), or, where
  CUPTI fails on a multi-device step, wall time over back-to-back calls."""
  import time

  import jax
  import numpy as np
  for _ in range(3):
    jax.block_until_ready(exe(*args))
  try:
    from jax.experimental.mosaic.gpu import profiler as mgpu_profiler
    _, timings = mgpu_profiler.measure(exe, aggregate=False, iterations=iterations)(*args)
    per_call = [1e3 * sum(ms for _, ms in kernels) / n_devices for kernels in timings]
    return float(np.median(per_call)), "CUPTI kernel time per GPU"
  except Exception as e:  # noqa: BLE001 - reported next to the number
    t0 = time.perf_counter()
    for _ in range(4 * iterations):
      out = exe(*args)
    jax.block_until_ready(out)
    return ((time.perf_counter() - t0) / (4 * iterations) * 1e6,
            f"wall clock over {4 * iterations} calls; CUPTI: {str(e)[:80]}")


def versions(on_gpu: bool):
  import jax
  import jax.numpy as jnp

  import wavetune_jax as wt
  impl = "cudnn" if on_gpu else "xla"
  return {
      "wt": dict(matmul=wt.matmul, attention=functools.partial(wt.attention, causal=True)),
      "xla": dict(matmul=jnp.dot, attention=functools.partial(
          jax.nn.dot_product_attention, is_causal=True, implementation=impl)),
  }


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tp", type=int, default=2)
  ap.add_argument("--dp", type=int, default=1)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--tokens", type=int, nargs="+", default=[512, 2048, 8192],
                  help="sequence lengths")
  ap.add_argument("--small", action="store_true",
                  help="a tiny layer on CPU host devices: checks, no times")
  a = ap.parse_args(argv)
  if a.small:
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={a.tp * a.dp}")
  import jax
  import jax.numpy as jnp
  import numpy as np
  from jax.sharding import NamedSharding
  from jax.sharding import PartitionSpec as P

  on_gpu = jax.devices()[0].platform == "gpu"
  n = a.tp * a.dp
  if jax.device_count() < n:
    sys.exit(f"need {n} devices (tp={a.tp} x dp={a.dp}); this host has {jax.device_count()}")
  mesh = jax.make_mesh((a.dp, a.tp), ("dp", "tp"),
                       axis_types=(jax.sharding.AxisType.Auto,) * 2,
                       devices=jax.devices()[:n])
  dims = SMALL if a.small else LLAMA3_8B
  dtype = jnp.bfloat16
  params = init(jax.random.PRNGKey(0), dims, dtype)
  params = {k: jax.device_put(v, NamedSharding(mesh, specs()[k])) for k, v in params.items()}
  print(f"{jax.devices()[0].device_kind} x {n}: tp={a.tp} dp={a.dp}, "
        f"{'small' if a.small else 'Llama-3-8B'} layer, jax {jax.__version__}", flush=True)
  steps = {name: jax.jit(functools.partial(layer, dims=dims, **ops))
           for name, ops in versions(on_gpu).items()}
  for seq in ([16] if a.small else a.tokens):
    batch = max(a.batch, a.dp)
    x = jax.random.normal(jax.random.PRNGKey(seq), (batch, seq, dims[0]), jnp.float32)
    x = jax.device_put(x.astype(dtype), NamedSharding(mesh, P("dp")))
    outs = {name: f(params, x) for name, f in steps.items()}
    ref = np.asarray(outs["xla"], np.float32)
    err = float(np.abs(np.asarray(outs["wt"], np.float32) - ref).max() / np.abs(ref).max())
    gathers = "all-gather" in steps["wt"].lower(params, x).compile().as_text()
    line = (f"batch {batch} x seq {seq}: max |wt - xla| / max |xla| = {err:.1e}, "
            f"out sharding {outs['wt'].sharding.spec}, wt step all-gathers: {gathers}")
    if on_gpu:
      t, how = {}, set()
      for name, f in steps.items():
        t[name], h = step_time(f.lower(params, x).compile(), (params, x), n)
        how.add(h)
      line += (f"; step: wt {t['wt']:.1f} us, XLA + cuDNN {t['xla']:.1f} us, "
               f"{t['xla'] / t['wt']:.3f}x ({', '.join(sorted(how))}); wt picks "
               f"{choices(dims, tp=a.tp, dp=a.dp, batch=batch, seq=seq)}")
    print(line, flush=True)
    if err > 5e-2:
      sys.exit(f"wt and XLA differ: {err:.3g}")


if __name__ == "__main__":
  main()
