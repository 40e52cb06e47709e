"""`wt.autotune` on windowed `jax.nn.dot_product_attention` calls: right, and how fast.

Each problem is a function as a user writes it, one
``jax.nn.dot_product_attention`` call with ``local_window_size`` (and
``is_causal``, ``key_value_seq_lengths`` or ``implementation`` where named),
compiled as written and under ``wt.autotune``. Both outputs are checked
against the float32 reference of the same window (JAX's top-left
alignment), then timed (CUPTI, L2 flushed). The table says what the drop-in
did with the call: replaced, by which backend, or kept and why.

    python3 benchmarks/dropin_attention.py [--only NAME] [--iterations 10] [--json out.json]
    python3 benchmarks/dropin_attention.py --dry-run    # what autotune does with each call; times nothing
"""

from __future__ import annotations

import argparse
import json
import math

import jax
import jax.numpy as jnp

import wavetune_jax as wt
from pallas_kernels.attention.reference import attention_reference

# (name, batch, seq, q_heads, kv_heads, head_dim, keyword arguments of the call)
PROBLEMS = [
    ("mistral w4096 causal", 1, 8192, 32, 8, 128, dict(is_causal=True, local_window_size=(4096, 0))),
    ("llama-like w1024 causal", 1, 16384, 32, 8, 128,
     dict(is_causal=True, local_window_size=(1024, 0))),
    ("gemma-3 w1024 causal d256", 1, 8192, 8, 4, 256,
     dict(is_causal=True, local_window_size=(1024, 0))),
    ("w128 causal b4", 4, 4096, 16, 4, 128, dict(is_causal=True, local_window_size=(128, 0))),
    ("window past the sequence", 2, 2048, 32, 8, 128,
     dict(is_causal=True, local_window_size=(4096, 0))),
    ("int window 256 (both sides)", 1, 4096, 16, 16, 64, dict(local_window_size=256)),
    ("w512 causal, cudnn named", 1, 8192, 32, 8, 128,
     dict(is_causal=True, local_window_size=(512, 0), implementation="cudnn")),
    ("w1024 causal, key lengths", 2, 4096, 32, 8, 128,
     dict(is_causal=True, local_window_size=(1024, 0), key_value_seq_lengths=(4096, 3000))),
    # Every query sees a key (3,500 >= 4,096 - 1,024): the run-time check passes.
    ("w1024 causal, key lengths all seen", 2, 4096, 32, 8, 128,
     dict(is_causal=True, local_window_size=(1024, 0), key_value_seq_lengths=(4096, 3500))),
]


def _call_kwargs(kw: dict, batch: int) -> dict:
  kw = dict(kw)
  if "key_value_seq_lengths" in kw:
    kw["key_value_seq_lengths"] = jnp.asarray(kw["key_value_seq_lengths"][:batch], jnp.int32)
  return kw


def reference(q, k, v, kw: dict):
  """The float32 reference of the call (a query with no key gets zeros)."""
  return attention_reference(q, k, v, causal=bool(kw.get("is_causal", False)),
                             kv_lengths=kw.get("key_value_seq_lengths"),
                             local_window_size=kw["local_window_size"], out_dtype=jnp.float32)


def build(kw: dict):
  """The user's function, and the same under ``wt.autotune``."""
  def attend(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, **kw)
  return attend, wt.autotune(attend)


def inputs(batch, seq, h, kvh, d, seed=0):
  kq, kk, kv = jax.random.split(jax.random.PRNGKey(seed), 3)
  shape = lambda n: (batch, seq, n, d)
  return tuple(jax.random.normal(key, shape(n), jnp.float32).astype(jnp.bfloat16)
               for key, n in ((kq, h), (kk, kvh), (kv, kvh)))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--only", default=None, metavar="NAME",
                  help="only the problems whose name contains NAME")
  ap.add_argument("--iterations", type=int, default=10)
  ap.add_argument("--dry-run", action="store_true",
                  help="trace each call under wt.autotune and print what it does; time nothing")
  ap.add_argument("--json", default=None, metavar="PATH")
  a = ap.parse_args(argv)
  if a.iterations < 1:
    ap.error("--iterations must be >= 1")
  probs = [p for p in PROBLEMS if a.only is None or a.only in p[0]]
  if not probs:
    ap.error(f"--only {a.only!r} matches no problem")
  dev = jax.devices()[0]
  print(f"{dev.device_kind}, JAX {jax.__version__}, policy {wt.get_policy()}", flush=True)
  prof = None
  if not a.dry_run:
    from wavetune_jax.tuning import profiler
    prof = profiler.Profiler(iterations=a.iterations)
  rows = []
  for name, b, t, h, kvh, d, kw0 in probs:
    kw = _call_kwargs(kw0, b)
    attend, tuned = build(kw)
    shapes = [jax.ShapeDtypeStruct((b, t, n, d), jnp.bfloat16) for n in (h, kvh, kvh)]
    try:
      jax.jit(tuned).lower(*shapes)  # trace: what autotune does with the call
    except Exception as e:  # noqa: BLE001 -- e.g. implementation="cudnn" off a GPU
      print(f"{name:<30} does not lower here: {type(e).__name__}: {str(e).splitlines()[0]}",
            flush=True)
      rows.append({"name": name, "autotune": f"does not lower: {str(e).splitlines()[0]}"})
      continue
    site = tuned.sites[0] if tuned.sites else None
    what = ("-" if site is None else
            f"replaced -> {site.backend}" if site.replaced else f"kept: {site.reason}")
    row = {"name": name, "batch": b, "seq": t, "q_heads": h, "kv_heads": kvh, "head_dim": d,
           "call": {k_: (list(v_) if isinstance(v_, tuple) else
                         [int(x) for x in v_] if hasattr(v_, "shape") else v_)
                    for k_, v_ in kw.items()},
           "autotune": what}
    if not a.dry_run:
      q, k, v = inputs(b, t, h, kvh, d)
      ref = reference(q, k, v, kw)
      res = prof.measure_many([attend, tuned], (q, k, v), reference=ref, tolerance=2e-2,
                              out_bytes=q.size * 4)
      for label, m in zip(("as_written", "autotune"), res):
        row[label] = {"status": m.status, "us": m.median_us if m.status == "ok" else math.nan,
                      "error": (m.error or "")[:300]}
      del q, k, v, ref
    rows.append(row)
    line = f"{name:<30} {b} x {t:>5}, {h}/{kvh}, d {d}: {what}"
    if not a.dry_run:
      w, t_ = row["as_written"], row["autotune"]
      speed = w["us"] / t_["us"] if t_["us"] == t_["us"] and t_["us"] > 0 else math.nan
      line += (f"\n    as written {w['us']:9.1f} us ({w['status']})   autotune {t_['us']:9.1f} us "
               f"({t_['status']})   speed-up {speed:.3f}x")
      for r in (w, t_):
        if r["status"] != "ok":
          line += f"\n    {r['status']}: {r['error']}"
    print(line, flush=True)
  if not a.dry_run:
    timed = [r for r in rows if "as_written" in r]
    sp = [r["as_written"]["us"] / r["autotune"]["us"] for r in timed
          if r["as_written"]["status"] == r["autotune"]["status"] == "ok"]
    if sp:
      gm = math.exp(sum(math.log(s) for s in sp) / len(sp))
      print(f"autotune over as written: geomean {gm:.3f}x, min {min(sp):.3f}x over {len(sp)} "
            f"problems; {sum(r['autotune']['status'] == 'ok' for r in timed)} of {len(rows)} "
            "right under autotune", flush=True)
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"device_kind": dev.device_kind, "jax": jax.__version__, "rows": rows}, f,
                indent=1)
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
