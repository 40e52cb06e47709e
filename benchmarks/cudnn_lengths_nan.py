"""Does cuDNN's attention keep NaN and Inf past a sequence's length out of
the output? ``jax.nn.dot_product_attention(..., key_value_seq_lengths=...,
implementation="cudnn")`` on caches whose rows past each length hold NaN (K)
and Inf (V), against the float32 reference on the valid rows; lengths 1, the
full cache and values off every block boundary.

    python3 benchmarks/cudnn_lengths_nan.py      # GPU
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention.reference import attention_reference

CASES = [  # (batch, q_len, kv_len, q_heads, kv_heads, head_dim, causal)
    (4, 1, 1000, 32, 8, 128, False), (4, 1, 4097, 32, 8, 128, False),
    (8, 1, 16384, 64, 8, 128, False), (3, 1, 777, 28, 4, 64, False),
    (2, 1, 2048, 16, 16, 256, False), (2, 300, 300, 32, 8, 128, False),
    (2, 1000, 1000, 32, 8, 128, True),
]


def main():
  print(jax.devices()[0].device_kind)
  bad = 0
  for i, (b, s, t, hq, hkv, d, causal) in enumerate(CASES):
    ks = jax.random.split(jax.random.PRNGKey(i), 4)
    q = jax.random.normal(ks[0], (b, s, hq, d), jnp.bfloat16)
    k = jax.random.normal(ks[1], (b, t, hkv, d), jnp.bfloat16)
    v = jax.random.normal(ks[2], (b, t, hkv, d), jnp.bfloat16)
    rand = [int(x) for x in jax.random.randint(ks[3], (b,), 1, t)]
    lengths = jnp.asarray(([1, t] + rand)[:b], jnp.int32)
    past = jnp.arange(t)[None, :, None, None] >= lengths[:, None, None, None]
    kn = jnp.where(past, jnp.nan, k).astype(k.dtype)
    vn = jnp.where(past, jnp.inf, v).astype(v.dtype)
    out = jax.jit(lambda q, k, v, n: jax.nn.dot_product_attention(
        q, k, v, key_value_seq_lengths=n, is_causal=causal, implementation="cudnn"))(
            q, kn, vn, lengths)
    ref = attention_reference(q, k, v, causal=causal, out_dtype=jnp.float32,
                              kv_lengths=lengths)
    out = np.asarray(out, np.float32)
    ref = np.asarray(ref)
    finite = bool(np.isfinite(out).all())
    err = float(np.nanmax(np.abs(out - ref)) / np.max(np.abs(ref))) if finite else float("nan")
    ok = finite and err < 2e-2
    bad += not ok
    print(f"batch {b} q_len {s} kv_len {t} heads {hq}/{hkv} d {d} causal {causal} lengths "
          f"{np.asarray(lengths).tolist()}: finite {finite}, max err {err:.2e} "
          f"{'OK' if ok else 'FAIL'}", flush=True)
  print(f"{len(CASES) - bad} of {len(CASES)} cases clean")


if __name__ == "__main__":
  main()
