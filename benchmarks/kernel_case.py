"""One kernel call, for a profiler to wrap (``ncu``) or a compiler dump to catch.

Builds the operands of one named case on the host, runs the call once to
compile and warm up, then ``--calls`` more times, and exits. Nothing is
timed here: wrap it, for example

    ncu --clock-control none --section SpeedOfLight --section WarpStateStats \\
        python3 benchmarks/kernel_case.py nk_int8 --k 4096 --n 14336 --m 16
    MOSAIC_GPU_DUMP_SASS=1 MOSAIC_GPU_DUMP_TO=/tmp/dump \\
        python3 benchmarks/kernel_case.py nk_int8 --k 4096 --n 14336 --m 16

``--time`` instead times each ``--m`` and ``--k-chunks`` given (CUPTI, L2
flushed, median of ``--iterations``) and prints one line each, with the
weight's bytes over the time.

Cases: ``nk_int8`` / ``nk_e4m3`` (the swapped weight-only kernel on an
``[N, K]`` 8-bit weight at its rule's config, or ``--config bn,stages,split``),
``nk_int4`` (the same on int4 with groups of 128), ``dot_bf16`` (``x @ w.T``
in bfloat16, XLA), ``dot_int8`` (XLA's dot on the converted int8 weight).
The result is checked against the float32 product (relative 2e-2).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

CASES = ("nk_int8", "nk_e4m3", "nk_int4", "dot_bf16", "dot_int8")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("case", choices=CASES)
  ap.add_argument("--k", type=int, default=4096)
  ap.add_argument("--n", type=int, default=14336)
  ap.add_argument("--m", type=int, nargs="+", default=[16])
  ap.add_argument("--k-chunks", type=int, nargs="+", default=[1],
                  help="the nk cases' k_chunks (1 or 2)")
  ap.add_argument("--time", action="store_true", help="time every --m and --k-chunks")
  ap.add_argument("--iterations", type=int, default=20)
  ap.add_argument("--config", default=None,
                  help="block_n,num_stages,split_k for the nk cases (default: the rule's)")
  ap.add_argument("--calls", type=int, default=1, help="calls after the warm-up (default 1)")
  a = ap.parse_args(argv)

  if not a.time and (len(a.m) > 1 or len(a.k_chunks) > 1):
    ap.error("one --m and one --k-chunks unless --time")
  rc = 0
  for m in a.m:
    for kc in (a.k_chunks if a.case.startswith("nk_") else [1]):
      rc |= run(a, m, kc)
  return rc


def run(a, m: int, kc: int) -> int:
  import jax
  import jax.numpy as jnp
  from pallas_kernels.matmul import weight_only_nk as nk
  from pallas_kernels.matmul.mosaic import MosaicMatmulConfig

  rng = np.random.default_rng(0)
  x32 = rng.standard_normal((m, a.k), dtype=np.float32)
  q = rng.integers(-127, 128, size=(a.n, a.k)).astype(np.float32)
  s = (rng.random(a.n, dtype=np.float32) + 0.5) / 127.0
  x = jnp.asarray(x32, jnp.bfloat16)
  ref = np.asarray(x, np.float32) @ (q * s[:, None]).T

  if a.case.startswith("nk_"):
    if a.case == "nk_int4":
      q = np.clip(np.round(q / 16), -8, 7)
      group = 128
      gs = np.broadcast_to(s[None, :] * 16, (a.k // group, a.n)).astype(np.float32)
      w, scales = jnp.asarray(q, jnp.int4), jnp.asarray(gs)
      ref = np.asarray(x, np.float32) @ (q * s[:, None] * 16).T
    else:
      group = 0
      wd = jnp.int8 if a.case == "nk_int8" else jnp.float8_e4m3fn
      w, scales = jnp.asarray(q, wd), jnp.asarray(s)
      ref = np.asarray(x, np.float32) @ (np.asarray(w, np.float32) * s[:, None]).T
    if a.config:
      bn, st, sk = (int(v) for v in a.config.split(","))
      config = MosaicMatmulConfig(block_m=64, block_n=bn, num_stages=st, split_k=sk)
    else:
      config = nk.decode_config(m, a.k, a.n, jax.devices()[0].core_count, group=group)
    print(f"{a.case}: M={m} K={a.k} N={a.n} {config} k_chunks={kc}", file=sys.stderr)
    f = jax.jit(lambda x, w, s: nk.weight_only_matmul_nk(x, w, s, config=config,
                                                                  k_chunks=kc))
    args = (x, w, scales)
  elif a.case == "dot_bf16":
    wb = jnp.asarray(q * s[:, None], jnp.bfloat16)
    ref = np.asarray(x, np.float32) @ np.asarray(wb, np.float32).T
    f = jax.jit(lambda x, w: jnp.dot(x, w.T))
    args = (x, wb)
  else:
    f = jax.jit(lambda x, w, s: (jnp.dot(x, w.T.astype(jnp.bfloat16),
                                         preferred_element_type=jnp.float32)
                                 * s).astype(jnp.bfloat16))
    args = (x, jnp.asarray(q, jnp.int8), jnp.asarray(s))
  out = np.asarray(f(*args), np.float32)
  err = np.abs(out - ref).max() / np.abs(ref).max()
  print(f"relative error {err:.2e}", file=sys.stderr)
  if not err < 2e-2:
    print("WRONG RESULT", file=sys.stderr)
    return 1
  if a.time:
    from wavetune_jax.tuning import profiler
    (t,) = profiler.Profiler(iterations=a.iterations).measure_many([f], args)
    bits = 4 if args[1].dtype == jnp.int4 else 8 * args[1].dtype.itemsize
    wbytes = args[1].size * bits // 8
    print(f"{a.case:9s} M={m:3d} K={a.k:6d} N={a.n:6d} k_chunks={kc} {t.status:4s} "
          f"{t.median_us or float('nan'):8.1f} us  {wbytes / (t.median_us or 1) / 1e6:6.2f} TB/s {t.error[:200]}",
          flush=True)
    return 0
  for _ in range(a.calls):
    out = f(*args)
  out.block_until_ready()
  return 0


if __name__ == "__main__":
  sys.exit(main())
