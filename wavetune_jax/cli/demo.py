"""``wavetune demo``: both ops on real LLM shapes, chosen, run and checked."""

from __future__ import annotations

import argparse
import time

__all__ = ["add_commands"]

# Real llama3_8b GEMMs (weights of the shape suite) and attention shapes.
_WEIGHTS = ("llama3_8b.qkv", "llama3_8b.o", "llama3_8b.gate_up", "llama3_8b.down")
_M_GPU = (16, 1000, 4096)
_M_CPU = (1, 37)
_CPU_SCALE = 32  # N and K divided by this in interpret mode
# (batch, q_len, q_heads, kv_heads, head_dim): llama3_8b prefill on a GPU; on a
# CPU a few heads of it at short lengths (one ragged).
_ATT_GPU = ((1, 1000, 32, 8, 128), (1, 4096, 32, 8, 128), (4, 2048, 32, 8, 128))
_ATT_CPU = ((1, 64, 4, 1, 128), (1, 100, 4, 1, 128))


def _demo(args) -> int:
  import jax
  import jax.numpy as jnp

  import wavetune_jax as wt
  from wavetune_jax.core import hardware
  from wavetune_jax.families import ATTENTION, MATMUL, matmul
  from wavetune_jax.runtime import selector
  from wavetune_jax.shapes import load_suite

  t_start = time.perf_counter()
  hw = hardware.current()
  on_gpu = not hw.interpret
  if on_gpu:
    print(f"GPU: {hw.name} ({hw.num_sms} SMs); times are CUPTI medians, L2 flushed.")
    from wavetune_jax.tuning import profiler
    prof = profiler.Profiler(iterations=20)
  else:
    print(f"No GPU ({jax.default_backend()} backend): Pallas interpret mode on small "
          f"shapes (N and K of real weights divided by {_CPU_SCALE}; a few heads), "
          f"configs chosen for the {hw.name} preset among backends with an interpret "
          f"mode; no timings.")
    prof = None
  weights = matmul.gemm_weights(load_suite("train"), list(_WEIGHTS))
  rows = []
  for name, (n, k) in weights.items():
    if not on_gpu:
      n, k = max(1, n // _CPU_SCALE), max(1, k // _CPU_SCALE)
    for m in (args.m or (_M_GPU if on_gpu else _M_CPU)):
      p = MATMUL.problem_cls(m=m, n=n, k=k, dtype=args.dtype)
      rows.append((MATMUL, f"{name} {m}x{n}x{k}", p, wt.matmul, {}))
  for b, s, hq, hkv, d in (_ATT_GPU if on_gpu else _ATT_CPU):
    p = ATTENTION.problem_cls(batch=b, q_heads=hq, kv_heads=hkv, q_len=s, head_dim=d,
                              causal=True, dtype=args.dtype)
    rows.append((ATTENTION, f"attention b{b} s{s} h{hq}/{hkv} d{d}", p, wt.attention,
                 {"causal": True}))
  head = f"{'op and shape':<38} {'backend':<8} {'config':<44} {'rel err':>8}"
  if on_gpu:
    head += f" {'wt us':>8} {'lib us':>8} {'lib/wt':>7}"
  print(head)
  worst = 0.0
  for fam, label, p, op, kw in rows:
    inputs = fam.inputs(p, jax.random.PRNGKey(0))
    sel = selector.select(fam, p, hw)
    cfg = fam.config_to_dict(sel.config)
    backend = cfg.pop("backend")
    y = jax.jit(lambda *a, op=op, kw=kw: op(*a, **kw))(*inputs)
    ref = fam.reference(p, *inputs)
    err = float(jnp.linalg.norm((y.astype(jnp.float32) - ref).ravel())
                / jnp.linalg.norm(ref.ravel()))
    err = err if err == err else float("inf")
    worst = max(worst, err / fam.tolerance(p))
    line = (f"{label:<38} {backend:<8} "
            f"{','.join(str(v) for v in cfg.values()) + ' (' + sel.source + ')':<44} "
            f"{err:>8.1e}")
    if on_gpu:
      ours, lib = prof.measure_many([lambda *a, op=op, kw=kw: op(*a, **kw),
                                     fam.baseline(p)], inputs)
      if ours.status == "ok" and lib.status == "ok":
        line += (f" {ours.median_us:>8.1f} {lib.median_us:>8.1f} "
                 f"{lib.median_us / ours.median_us:>7.2f}")
      else:
        line += f" failed: {ours.error or lib.error}"
    print(line, flush=True)
  ok = worst <= 1.0
  legend = "; lib = XLA's jnp.dot for GEMMs, cuDNN for attention" if on_gpu else ""
  print(f"\nall results match the float32 reference: {ok} (worst error "
        f"{worst:.2f} of the tolerance){legend}; {time.perf_counter() - t_start:.0f} s")
  return 0 if ok else 1


def add_commands(sub: argparse._SubParsersAction) -> None:
  from wavetune_jax.cli.common import positive_int
  demo = sub.add_parser(
      "demo", help="choose configs for real LLM shapes, run and check them",
      description="For llama3_8b GEMMs and attention: choose a backend and config, run "
      "the op under jax.jit, check it against the float32 reference and (on a GPU) "
      "time it against XLA / cuDNN. Without a GPU: small shapes in Pallas interpret "
      "mode, under a minute.")
  demo.add_argument("--m", type=positive_int, nargs="+", metavar="M",
                    help="GEMM token counts (default: 16 1000 4096 on a GPU, 1 37 on a CPU)")
  demo.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"),
                    help="input dtype (default: bfloat16)")
  demo.set_defaults(func=_demo)
