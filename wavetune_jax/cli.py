"""The ``wavetune`` command line."""

from __future__ import annotations

import argparse
import sys

__all__ = ["main"]

# (weight, M) pairs of the demo: real LLM GEMMs (llama3_8b) at decode and
# prefill token counts.
_DEMO_WEIGHTS = ("llama3_8b.qkv", "llama3_8b.o", "llama3_8b.gate_up", "llama3_8b.down")
_DEMO_M_GPU = (16, 1000, 4096)
_DEMO_M_CPU = (1, 37)
_CPU_SCALE = 32  # N and K divided by this in interpret mode


def _demo(args) -> int:
  import jax
  import jax.numpy as jnp

  import wavetune_jax as wt
  from wavetune_jax import hardware, profiler, shapes
  from wavetune_jax.matmul_spec import MATMUL, MatmulProblem

  on_gpu = jax.default_backend() == "gpu"
  weights = shapes.gemm_weights(shapes.load_suite("train"), list(_DEMO_WEIGHTS))
  if on_gpu:
    hw = hardware.detect()
    print(f"GPU: {hw.name} ({hw.num_sms} SMs); times are CUPTI medians, L2 flushed.")
    ms = args.m or _DEMO_M_GPU
  else:
    print(f"No GPU ({jax.default_backend()} backend): running small shapes (N and K "
          f"of real weights divided by {_CPU_SCALE}) in Pallas interpret mode; "
          f"no timings.")
    ms = args.m or _DEMO_M_CPU
  prof = profiler.Profiler(iterations=20) if on_gpu else None
  header = f"{'weight':<20} {'M x N x K':<20} {'config (bm x bn x bk, split, group, warps, stages)':<52} {'rel err':>8}"
  if on_gpu:
    header += f" {'pallas us':>10} {'XLA us':>8} {'XLA/pallas':>10}"
  print(header)
  worst = 0.0
  for name, (n, k) in weights.items():
    if not on_gpu:
      n, k = max(1, n // _CPU_SCALE), max(1, k // _CPU_SCALE)
    for m in ms:
      p = MatmulProblem(m=m, n=n, k=k, dtype=args.dtype)
      x, w = MATMUL.inputs(p, jax.random.PRNGKey(m))
      config = wt.ops._default_config(p)
      y = jax.jit(wt.matmul)(x, w)
      ref = jnp.dot(x, w, preferred_element_type=jnp.float32)
      err = profiler.rel_error(y, ref)
      worst = max(worst, err)
      c = config
      line = (f"{name:<20} {f'{m}x{n}x{k}':<20} "
              f"{f'{c.block_m}x{c.block_n}x{c.block_k}, {c.split_k}, {c.group_m}, {c.num_warps}, {c.num_stages}':<52} "
              f"{err:>8.1e}")
      if on_gpu:
        ours, xla = prof.measure_many([wt.matmul, MATMUL.baseline(p)], (x, w),
                                      out_bytes=m * n * 2)
        if ours.status == "ok" and xla.status == "ok":
          line += (f" {ours.median_us:>10.1f} {xla.median_us:>8.1f} "
                   f"{xla.median_us / ours.median_us:>10.2f}")
        else:
          line += f" failed: {ours.error or xla.error}"
      print(line, flush=True)
  tol = MATMUL.tolerance(MatmulProblem(m=1, n=1, k=1, dtype=args.dtype))
  ok = worst < tol
  print(f"\nall results match jnp.dot: {ok} (worst relative error {worst:.2e}, "
        f"tolerance {tol:.0e})")
  return 0 if ok else 1


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
      prog="wavetune",
      description="Near-optimal launch configs for Pallas GPU kernels.")
  sub = ap.add_subparsers(dest="command", required=True)
  demo = sub.add_parser(
      "demo", help="choose configs for real LLM GEMMs, run and check them",
      description="For a few llama3_8b GEMM shapes: choose a config, run the "
      "kernel under jax.jit, check it against jnp.dot and (on a GPU) time it "
      "against XLA.")
  demo.add_argument("--m", type=int, nargs="+", help="token counts (M)")
  demo.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"))
  demo.set_defaults(func=_demo)
  from wavetune_jax import eval_cli, sweep_cli, tune_cli
  sweep_cli.add_commands(sub)
  eval_cli.add_commands(sub)
  tune_cli.add_commands(sub)
  args = ap.parse_args(argv)
  return args.func(args)


if __name__ == "__main__":
  sys.exit(main())
