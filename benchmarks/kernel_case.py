"""One kernel call, for a profiler to wrap (``ncu``) or a compiler dump to catch.

Builds the operands of one named case on the host, runs the call once to
compile and warm up, then ``--calls`` more times, and exits. Nothing is
timed unless ``--time``: wrap it, for example

    ncu --clock-control none -k regex:mosaic --launch-skip 1 --launch-count 1 \\
        --section SpeedOfLight --section WarpStateStats \\
        python3 benchmarks/kernel_case.py nk_int8 --k 4096 --n 14336 --m 16
    mkdir -p /tmp/dump && MOSAIC_GPU_DUMP_PTX=1 MOSAIC_GPU_DUMP_PTXAS=1 \\
        MOSAIC_GPU_DUMP_TO=/tmp/dump python3 benchmarks/kernel_case.py nk_int8 --m 16

(``-k regex:mosaic --launch-skip 1``: the Mosaic kernel's call after the
warm-up; the Mosaic GPU kernels are named ``kernel_mosaic_gpu_kernel``.)

``--time`` instead times each ``--m`` given (CUPTI, L2
flushed, median of ``--iterations``) and prints one line each, with the
weight's bytes over the time.

``--sass-summary CSV[.gz]`` (no GPU) reads what ``ncu --section SourceCounters
--page source --print-source sass --csv`` wrote for one kernel and prints,
per SASS opcode of the consumers' step loop (the instructions executed as
often as the first wgmma, ``HGMMA``), the instructions and ncu's warp
samples there: all of them, and those where the warp was not issued; then
the most sampled instructions outside that loop.

Cases: ``nk_int8`` / ``nk_e4m3`` (the swapped weight-only kernel on an
``[N, K]`` 8-bit weight at its rule's config, or ``--config bn,stages,split``),
``nk_int4`` (the same on int4 with groups of 128), ``kn_int8`` / ``kn_e4m3``
(the ``[K, N]`` weight-only kernel at its rule's config or ``--config``),
``rdq_int8`` (the weight-only grouped GEMM, int8 experts, ``--m`` rows over
``--groups`` experts, its rule's config), ``dot_bf16`` (``x @ w.T``
in bfloat16, XLA), ``dot_int8`` (XLA's dot on the converted int8 weight);
``rd_mosaic`` (the Mosaic grouped GEMM on ``--groups`` experts of ``--rows``
rows each, uniform routing, at ``--config block_m,block_n,stages,order``, or
the family rule's config) and ``rd_batched`` (cuBLAS's batched GEMM on the
same rows, ``jnp.einsum("gmk,gkn->gmn")``). The result is checked against
the float32 product (relative 2e-2, 2e-3 with float16 ``x``).
``--x-dtype float16`` runs the ``nk_`` and ``dot_bf16`` cases on float16
``x`` (int8 weights then convert two values at a time,
``weight_only.FAST_INT8_F16``; ``--generic-convert``: Mosaic's own cast).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

CASES = ("nk_int8", "nk_e4m3", "nk_int4", "kn_int8", "kn_e4m3", "rdq_int8", "dot_bf16", "dot_int8",
         "rd_mosaic", "rd_batched")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  if argv is None:
    argv = sys.argv[1:]
  if argv[:1] == ["--sass-summary"]:
    if len(argv) != 2:
      print("usage: kernel_case.py --sass-summary NCU_SOURCE.csv", file=sys.stderr)
      return 2
    return sass_summary(argv[1])
  ap.add_argument("case", choices=CASES)
  ap.add_argument("--k", type=int, default=4096)
  ap.add_argument("--n", type=int, default=14336)
  ap.add_argument("--m", type=int, nargs="+", default=[16])
  ap.add_argument("--time", action="store_true", help="time every --m")
  ap.add_argument("--iterations", type=int, default=20)
  ap.add_argument("--config", default=None,
                  help="block_n,num_stages,split_k for the nk and kn cases, "
                       "block_m,block_n,num_stages,order for the rd cases (default: the "
                       "rule's; rdq_int8 runs its rule's)")
  ap.add_argument("--x-dtype", choices=("bfloat16", "float16"), default="bfloat16",
                  help="dtype of x in the nk_, kn_, rdq_int8 and dot_bf16 cases (default "
                       "bfloat16)")
  ap.add_argument("--generic-convert", action="store_true",
                  help="int8 / int4 weights under float16 x (nk_int8, nk_int4, kn_int8, "
                       "rdq_int8): Mosaic's own conversion to float16")
  ap.add_argument("--calls", type=int, default=1, help="calls after the warm-up (default 1)")
  ap.add_argument("--groups", type=int, default=64, help="experts of the rd_ cases")
  ap.add_argument("--rows", type=int, default=512, help="rows per expert of the rd_ cases")
  a = ap.parse_args(argv)

  if not a.time and len(a.m) > 1:
    ap.error("one --m unless --time")
  if a.x_dtype != "bfloat16" and (a.case.startswith("rd_") or a.case == "dot_int8"):
    ap.error(f"--x-dtype {a.x_dtype} is for the nk_, kn_, rdq_int8 and dot_bf16 cases")
  if a.generic_convert and (a.x_dtype != "float16" or a.case not in (
      "nk_int8", "nk_int4", "kn_int8", "rdq_int8")):
    ap.error("--generic-convert needs --x-dtype float16 and an int8 or int4 case")
  if a.config and a.case == "rdq_int8":
    ap.error("rdq_int8 runs its rule's config (no --config)")
  if a.case.startswith("kn_") and max(a.m) > 64:
    ap.error("the kn_ cases run at most 64 rows (the kernel's rule; XLA's GEMM above)")
  rc = 0
  for m in a.m:
    rc |= run(a, m)
  return rc


def run(a, m: int) -> int:
  import jax
  import jax.numpy as jnp
  from pallas_kernels.matmul import weight_only_nk as nk
  from pallas_kernels.matmul.mosaic import MosaicMatmulConfig

  rng = np.random.default_rng(0)
  x32 = rng.standard_normal((m, a.k), dtype=np.float32)
  q = rng.integers(-127, 128, size=(a.n, a.k)).astype(np.float32)
  s = (rng.random(a.n, dtype=np.float32) + 0.5) / 127.0
  x = jnp.asarray(x32, a.x_dtype)
  from pallas_kernels.matmul import weight_only
  weight_only.FAST_INT8_F16 = not a.generic_convert
  ref = np.asarray(x, np.float32) @ (q * s[:, None]).T

  if a.case.startswith("rd_"):
    f, args, ref = grouped_case(a)
  elif a.case.startswith("kn_"):
    from pallas_kernels.matmul import weight_only as kn
    wd = jnp.int8 if a.case == "kn_int8" else jnp.float8_e4m3fn
    w, scales = jnp.asarray(q.T, wd), jnp.asarray(s)
    ref = np.asarray(x, np.float32) @ (np.asarray(w, np.float32) * s[None, :])
    if a.config:
      bn, st, sk = (int(v) for v in a.config.split(","))
      config = MosaicMatmulConfig(block_m=64, block_n=bn, num_stages=st, split_k=sk)
    else:
      config = kn.decode_config(m, a.k, a.n, jax.devices()[0].core_count)
    print(f"{a.case}: M={m} K={a.k} N={a.n} {config}", file=sys.stderr)
    f = jax.jit(lambda x, w, s: kn.weight_only_matmul(x, w, s, config=config))
    args = (x, w, scales)
  elif a.case == "rdq_int8":
    f, args, ref = quantized_grouped_case(a, x)
  elif a.case.startswith("nk_"):
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
      from wavetune_jax.core.hardware import device_key
      dev = jax.devices()[0]
      key = device_key(dev.device_kind)
      config = nk.decode_config(m, a.k, a.n, dev.core_count, group=group,
                                wide_step=nk.WIDE_STEP.get(key),
                                any_split=key in nk.ANY_SPLIT_GPUS)
    print(f"{a.case}: M={m} K={a.k} N={a.n} {config}", file=sys.stderr)
    f = jax.jit(lambda x, w, s: nk.weight_only_matmul_nk(x, w, s, config=config))
    args = (x, w, scales)
  elif a.case == "dot_bf16":
    wb = jnp.asarray(q * s[:, None], x.dtype)
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
  # A bfloat16 x rounds to 8 bits; float16 keeps 11.
  if not err < (2e-2 if a.x_dtype == "bfloat16" else 2e-3):
    print("WRONG RESULT", file=sys.stderr)
    return 1
  if a.time:
    from wavetune_jax.tuning import profiler
    (t,) = profiler.Profiler(iterations=a.iterations).measure_many([f], args)
    bits = 4 if args[1].dtype == jnp.int4 else 8 * args[1].dtype.itemsize  # w is args[1]
    wbytes = args[1].size * bits // 8
    if a.case == "rdq_int8":  # the experts with rows only
      wbytes = wbytes * min(m, a.groups) // a.groups
    print(f"{a.case:9s} M={m:3d} K={a.k:6d} N={a.n:6d} {t.status:4s} "
          f"{t.median_us or float('nan'):8.1f} us  {wbytes / (t.median_us or 1) / 1e6:6.2f} TB/s {t.error[:200]}",
          flush=True)
    return 0
  for _ in range(a.calls):
    out = f(*args)
  out.block_until_ready()
  return 0


def grouped_case(a):
  """``(function, args, float32 reference)`` of an ``rd_`` case."""
  import jax
  import jax.numpy as jnp
  from pallas_kernels.ragged_dot import mosaic as rd

  g, r, k, n = a.groups, a.rows, a.k, a.n
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.standard_normal((g * r, k), dtype=np.float32), jnp.bfloat16)
  w = jnp.asarray(rng.standard_normal((g, k, n), dtype=np.float32) / np.sqrt(k), jnp.bfloat16)
  sizes = jnp.full((g,), r, jnp.int32)
  # On the host: a profiler wrapping the case sees only the case's kernels.
  ref = np.matmul(np.asarray(x, np.float32).reshape(g, r, k),
                  np.asarray(w, np.float32)).reshape(g * r, n)
  if a.case == "rd_batched":
    f = jax.jit(lambda x, w, s: jnp.einsum("gmk,gkn->gmn", x.reshape(g, r, k), w)
                .reshape(g * r, n))
  else:
    if a.config:
      bm, bn, st, order = (int(v) for v in a.config.split(","))
      config = rd.MosaicRaggedDotConfig(block_m=bm, block_n=bn, num_stages=st, grid_minor=order)
    else:
      import wavetune_jax as wt
      config = wt.RAGGED_DOT.backend("mosaic").heuristic(
          wt.RaggedDotProblem(m=g * r, g=g, k=k, n=n), wt.detect())
      if config is None:
        raise SystemExit(f"rd_mosaic: the rule runs no Mosaic config at G={g} r={r} K={k} "
                         f"N={n} on this GPU (give --config)")
    print(f"{a.case}: G={g} r={r} K={k} N={n} {config}", file=sys.stderr)
    f = jax.jit(lambda x, w, s: rd.ragged_dot(x, w, s, config=config))
  return f, (x, w, sizes), ref


def quantized_grouped_case(a, x):
  """``rdq_int8``: the weight-only grouped GEMM, int8 ``[G, K, N]`` experts,
  ``x``'s rows spread evenly over ``--groups`` experts, the rule's config."""
  import jax
  import jax.numpy as jnp
  from pallas_kernels.ragged_dot import weight_only as rq

  g, (m, k), n = a.groups, x.shape, a.n
  rng = np.random.default_rng(1)
  q = rng.integers(-127, 128, size=(g, k, n)).astype(np.float32)
  s = ((rng.random((g, n), dtype=np.float32) + 0.5) / 127.0)
  sizes = np.full(g, m // g)
  sizes[: m % g] += 1
  xs = np.asarray(x, np.float32)
  ends = np.cumsum(sizes)
  ref = np.concatenate([xs[e - z:e] @ (q[i] * s[i][None, :]) for i, (z, e) in enumerate(zip(sizes, ends))])
  from wavetune_jax.core.hardware import device_key
  dev = jax.devices()[0]
  n_sms = dev.core_count
  past = device_key(dev.device_kind) in rq.SPLIT_PAST_WAVE_GPUS
  config = (rq.decode_config(m, g, n, k, n_sms, past_one_wave=past)
            or rq.prefill_config(m, g, n, k, n_sms))
  print(f"{a.case}: M={m} G={g} K={k} N={n} {config}", file=sys.stderr)
  f = jax.jit(lambda x, w, s, z: rq.weight_only_ragged_dot(x, w, s, z, config=config))
  return f, (x, jnp.asarray(q, jnp.int8), jnp.asarray(s), jnp.asarray(sizes, jnp.int32)), ref


def sass_summary(path: str) -> int:
  """Prints the step loop's opcodes, instructions and stall samples (module doc)."""
  import csv
  import gzip
  try:
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
      lines = f.read().splitlines()
  except OSError as e:
    print(f"--sass-summary: cannot read {path}: {e.strerror}", file=sys.stderr)
    return 2
  start = next((i for i, l in enumerate(lines) if l.startswith('"Address","Source"')), None)
  if start is None:
    print(f"--sass-summary: {path} holds no ncu source page (--page source --csv)",
          file=sys.stderr)
    return 2
  rows = list(csv.reader(lines[start:]))
  hdr, data = rows[0], [r for r in rows[1:] if len(r) == len(rows[0])]
  samples = hdr.index("Warp Stall Sampling (All Samples)")
  not_issued = hdr.index("Warp Stall Sampling (Not-issued Samples)")
  executed = hdr.index("Instructions Executed")
  mma = [int(r[executed]) for r in data if "GMMA" in r[1]]
  most = mma[0] if mma else max(int(r[executed]) for r in data)
  loop = [r for r in data if int(r[executed]) == most]
  ops: dict[str, list[int]] = {}
  for r in loop:
    words = r[1].split()
    op = (words[1] if words[0].startswith("@") else words[0]).split(".")[0]
    ops.setdefault(op, [0, 0, 0])
    ops[op][0] += 1
    ops[op][1] += int(r[samples])
    ops[op][2] += int(r[not_issued])
  total = sum(int(r[samples]) for r in data)
  print(f"{len(data)} SASS instructions, {total} warp samples; the step loop (executed "
        f"{most} times each): {len(loop)} instructions, "
        f"{sum(v[1] for v in ops.values())} samples, {sum(v[2] for v in ops.values())} "
        f"of them not issued")
  for op, (n, smp, ni) in sorted(ops.items(), key=lambda kv: -kv[1][1]):
    print(f"  {op:14s} {n:4d} instructions {smp:6d} samples {ni:6d} not issued")
  # Where the rest of the samples fell: the instructions outside the step
  # loop with the most samples (the epilogue, the producer, the prologue).
  rest = sorted((r for r in data if int(r[executed]) != most), key=lambda r: -int(r[samples]))
  print(f"outside the step loop: {total - sum(v[1] for v in ops.values())} samples; the "
        f"most sampled instructions:")
  for r in rest[:12]:
    print(f"  {r[1][:60]:60s} executed {int(r[executed]):9d} samples {int(r[samples]):6d} "
          f"not issued {int(r[not_issued]):6d}")
  return 0


if __name__ == "__main__":
  sys.exit(main())
