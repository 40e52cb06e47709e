"""``wt.ragged_dot`` against tokamax's Mosaic GPU ragged dot and
``lax.ragged_dot`` on one GPU (CUPTI, L2 flushed, same process).

Per problem (grouped-GEMM weights of the suite's MoE models at several token
counts, plus Mixtral's unfused w1 at 4,096 tokens, the one Mixtral shape in
tokamax's H100 cache), each candidate is checked against the float32
reference, then timed:

* ``wt``: ``wt.ragged_dot`` with its shipped table (policy ``tables``);
* ``tokamax``: ``tokamax.ragged_dot(..., implementation="mosaic")``, which
  takes its shipped autotuning cache where the shape is in it (the H100) and
  its heuristic config otherwise (every shape on an H200);
* ``tokamax_c4`` / ``tokamax_c8``: tokamax's kernel pinned to the config
  that wins most of its H100 cache (128x64 tiles, block_k 128, 4 stages,
  persistent, grid_block_n 4 or 8): what it would get from tuning;
* ``xla``: ``lax.ragged_dot``.

Routing is balanced (random top-k), and skewed (a few hot experts) for a
subset. tokamax leaves rows past ``sum(group_sizes)`` unwritten; the routers
here fill every row.

``--weights int8`` runs the same problems with int8 expert weights
(weight-only, a scale per expert and output channel, bf16 activations):

* ``wt``: ``wt.quantized_ragged_dot`` with its shipped table;
* ``tokamax``: ``tokamax.ragged_dot`` on a ``qwix.QArray`` (values ``[G, K,
  N]``, scales ``[G, 1, N]`` in bfloat16, the dtype its sm90 kernel
  dequantizes to), ``implementation="mosaic"``: the weights converted in
  registers before a bf16 wgmma. It needs K a multiple of 256 and N of 128;
  where it declines, its row says so;
* ``xla``: XLA's ragged dot on the converted weights (the family's
  platform op).

The other problems, the checks against the float32 product of the
dequantized operands, and the timing are the same.

Needs tokamax (and its dependencies) importable; on a machine without
network, install its wheels with ``pip install --no-index --no-deps --target``.
tokamax 0.0.12 calls ``plgpu.kernel(out_shape=..., scratch_shapes=...)``,
which JAX 0.11 renamed to ``out_type`` / ``scratch_types``, and
``plgpu.untile_ref`` / ``unswizzle_ref``, which JAX 0.10.2 deleted;
:func:`jax_compat` adapts the installed JAX (and says so) so that its
kernels compile unchanged.

    python3 benchmarks/ragged_dot_tokamax.py [--quick] [--weights bf16|int8] [--json out.json]
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import sys
import time

import jax
import jax.numpy as jnp

import wavetune_jax as wt
from wavetune_jax import QRAGGED_DOT, RAGGED_DOT, QRaggedDotProblem, RaggedDotProblem
from wavetune_jax.families.ragged_dot import routing
from wavetune_jax.shapes import load_suite
from wavetune_jax.tuning import evaluate, profiler

PROBLEMS = [("mixtral_8x7b.w13", t) for t in (16, 200, 1024, 3000, 8192)] + \
           [("mixtral_8x7b.w2", t) for t in (16, 200, 1024, 3000, 8192)] + \
           [("mixtral_8x7b.w1", 4096), ("dbrx.w13", 1024), ("dbrx.w2", 4096),
            ("olmoe_1b_7b.w13", 4096), ("olmoe_1b_7b.w2", 1024),
            ("snowflake_arctic.w2", 1024), ("llama4_scout.w13", 2048),
            ("llama4_scout.w2", 777), ("phi_3_5_moe.w13", 1024), ("phi_3_5_moe.w2", 3000)]
QUICK = [("mixtral_8x7b.w13", 1024), ("mixtral_8x7b.w1", 4096), ("olmoe_1b_7b.w13", 4096)]
SKEW = [("mixtral_8x7b.w13", 1024), ("dbrx.w13", 1024), ("olmoe_1b_7b.w13", 4096)]
# Mixtral-8x7B's w1 alone (not fused with w3): the shape tokamax's H100 cache has.
EXTRA = {"mixtral_8x7b.w1": {"E": 8, "top_k": 2, "K": 4096, "N": 14336}}


def problem(weights: dict, name: str, tokens: int, fmt: str = "bf16"):
  """The grouped GEMM of ``tokens`` tokens on weight ``name``; ``fmt="int8"``:
  its weight-only int8 form (bf16 activations)."""
  w = EXTRA.get(name) or weights[name]
  if fmt == "int8":
    return QRaggedDotProblem(m=tokens * w["top_k"], g=w["E"], k=w["K"], n=w["N"],
                             dtype="bfloat16", w_dtype="int8")
  return RaggedDotProblem(m=tokens * w["top_k"], g=w["E"], k=w["K"], n=w["N"])


def tokamax_qarray(w, scales):
  """``qwix.QArray`` of int8 expert weights ``[G, K, N]`` and float32 scales
  ``[G, N]``: scales ``[G, 1, N]`` in bfloat16 (a scale per expert and output
  channel; tokamax's sm90 kernel dequantizes to the scales' dtype)."""
  import qwix
  return qwix.QArray(qvalue=w, scale=scales.astype(jnp.bfloat16)[:, None, :])


def jax_compat() -> bool:
  """Adapts this JAX to what tokamax 0.0.12's kernels call, where it differs;
  True if it changed anything: ``plgpu.kernel``'s ``out_shape`` /
  ``scratch_shapes`` arguments renamed to this JAX's ``out_type`` /
  ``scratch_types``, and ``plgpu.untile_ref`` / ``plgpu.unswizzle_ref``
  (deleted from Pallas in JAX 0.10.2: its quantized kernel's epilogue uses
  them) put back as the ``transform_ref`` calls they were."""
  import inspect

  from jax._src.pallas.mosaic_gpu import core as mgpu_core
  from jax.experimental.pallas import mosaic_gpu as plgpu

  changed = False
  for name, transform in (("untile_ref", "UntilingTransform"), ("unswizzle_ref", "UnswizzleRef")):
    if not hasattr(plgpu, name) and hasattr(mgpu_core, transform):
      cls = getattr(mgpu_core, transform)
      setattr(plgpu, name, lambda ref, arg, cls=cls: plgpu.transform_ref(ref, cls(arg)))
      changed = True
  params = inspect.signature(plgpu.kernel).parameters
  if (getattr(plgpu.kernel, "_renamed_for_tokamax", False) or "out_shape" in params
      or "out_type" not in params):
    return changed
  kernel = plgpu.kernel

  @functools.wraps(kernel)
  def renamed(*args, out_shape=None, scratch_shapes=None, **kw):
    if out_shape is not None:
      kw["out_type"] = out_shape
    if scratch_shapes is not None:
      kw["scratch_types"] = scratch_shapes
    return kernel(*args, **kw)

  renamed._renamed_for_tokamax = True
  plgpu.kernel = renamed
  return True


def candidates(p: RaggedDotProblem) -> dict:
  import tokamax
  from tokamax._src.ops.ragged_dot.pallas_mosaic_gpu import Config, PallasMosaicGpuRaggedDot

  def pinned(grid_block_n):
    op = PallasMosaicGpuRaggedDot(config=Config(
        block_m=128, block_n=64, block_k=128, num_stages=4, split_k=1,
        grid_block_n=grid_block_n, persistent=True))
    return lambda x, w, gs: tokamax.ragged_dot(x, w, gs, implementation=op)

  return {
      "wt": lambda x, w, gs: wt.ragged_dot(x, w, gs),
      "tokamax": lambda x, w, gs: tokamax.ragged_dot(x, w, gs, implementation="mosaic"),
      "tokamax_c4": pinned(4),
      "tokamax_c8": pinned(8),
      "xla": RAGGED_DOT.baseline(p),
  }


def quantized_candidates(p: QRaggedDotProblem) -> dict:
  """int8 weight-only: ``wt.quantized_ragged_dot``, tokamax's Mosaic kernel on
  the same values and scales, XLA's op; ``tokamax_c4`` and ``tokamax_c8`` stay
  empty (their pinned configs are bf16 ones)."""
  import tokamax
  return {
      "wt": lambda x, w, s, gs: wt.quantized_ragged_dot(x, w, s, gs),
      "tokamax": lambda x, w, s, gs: tokamax.ragged_dot(x, tokamax_qarray(w, s), gs,
                                                        implementation="mosaic"),
      "xla": QRAGGED_DOT.baseline(p),
  }


def run(fam, name, tokens, p, prof) -> dict:
  quantized = isinstance(p, QRaggedDotProblem)
  fns = quantized_candidates(p) if quantized else candidates(p)
  args = fam.inputs(p, jax.random.PRNGKey(0))
  ref = fam.reference(p, *args)
  res = prof.measure_many(list(fns.values()), args, reference=ref,
                          tolerance=fam.tolerance(p), out_bytes=ref.size * 4)
  sel = wt.select(fam.name, p)
  row = {"weight": name, "tokens": tokens, "problem": fam.problem_key(p),
         "skew": fam.skew, "wt_config": fam.config_to_dict(sel.config),
         "us": {}, "status": {}}
  for k, r in zip(fns, res):
    row["us"][k] = r.median_us if r.status == "ok" else None
    row["status"][k] = r.status if r.status == "ok" else f"{r.status}: {r.error[:200]}"
  return row


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quick", action="store_true", help="three problems, no skew")
  ap.add_argument("--weights", choices=("bf16", "int8"), default="bf16",
                  help="the experts' weights: bf16 (default) or int8 weight-only")
  ap.add_argument("--iterations", type=int, default=10)
  ap.add_argument("--json", default=None, help="write every row here (after each problem)")
  a = ap.parse_args(argv)
  try:
    from absl import flags
    flags.FLAGS.mark_as_parsed()  # tokamax reads absl flags; ours are not theirs
    import tokamax  # noqa: F401
  except ImportError as e:
    print(f"ragged_dot_tokamax: tokamax is not importable ({e}); install it first",
          file=sys.stderr)
    return 2
  dev = jax.devices()[0]
  import importlib.metadata
  print(dev.device_kind, "jax", jax.__version__, "tokamax",
        importlib.metadata.version("tokamax"), flush=True)
  if jax_compat():
    print("this JAX adapted to tokamax's kernels (plgpu.kernel's out_shape=, scratch_shapes= "
          "renamed to out_type=, scratch_types=; plgpu.untile_ref, unswizzle_ref put back "
          "where missing)", flush=True)
  weights = load_suite("train")["grouped_gemm"]["weights"]
  prof = profiler.Profiler(iterations=a.iterations)
  out = {"device_kind": dev.device_kind, "jax": jax.__version__, "weights": a.weights,
         "rows": []}
  fam0 = QRAGGED_DOT if a.weights == "int8" else RAGGED_DOT
  plan = [(fam0, n, t) for n, t in (QUICK if a.quick else PROBLEMS)]
  if not a.quick:
    skewed = copy.copy(fam0)  # the same family, its router skewed
    skewed.skew = float(routing.SKEWED)
    plan += [(skewed, n, t) for n, t in SKEW]
  print(f"{'weight':<22}{'tokens':>7}{'skew':>5}{'xla us':>10}{'wt us':>9}{'tokamax':>9}"
        f"{'tk c4':>9}{'tk c8':>9}{'wt/tk':>7}{'wt/tk*':>8}{'wt/xla':>8}  wt config", flush=True)
  t0 = time.time()
  for fam, name, tokens in plan:
    p = problem(weights, name, tokens, a.weights)
    row = run(fam, name, tokens, p, prof)
    out["rows"].append(row)
    us = {k: (v if v is not None else math.nan) for k, v in row["us"].items()}
    for k in ("tokamax_c4", "tokamax_c8"):
      us.setdefault(k, math.nan)
    best_tk = min((v for k, v in us.items() if k.startswith("tokamax") and not math.isnan(v)),
                  default=math.nan)
    c = row["wt_config"]
    cs = c["backend"] + ("" if c["backend"] == "xla" else
                         f" {c.get('block_m')}x{c.get('block_n')} k{c.get('split_k')}")
    print(f"{name:<22}{tokens:>7}{fam.skew:>5.0f}{us['xla']:10.1f}{us['wt']:9.1f}"
          f"{us['tokamax']:9.1f}{us['tokamax_c4']:9.1f}{us['tokamax_c8']:9.1f}"
          f"{us['tokamax'] / us['wt']:7.2f}{best_tk / us['wt']:8.2f}"
          f"{us['xla'] / us['wt']:8.2f}  {cs}", flush=True)
    for k, s in row["status"].items():
      if s != "ok":
        print(f"    {k}: {s}", flush=True)
    if a.json:
      with open(a.json, "w") as f:
        json.dump(out, f)
  summarize(out["rows"])
  print(f"elapsed {time.time() - t0:.0f} s", flush=True)
  return 0


def summarize(rows) -> None:
  """Geomeans of wt over tokamax (its own choice, and the best of its three)
  and over XLA, balanced routing, from 1,024 tokens and over all."""
  for label, keep in (("all balanced", lambda r: r["skew"] == 0),
                      (">= 1,024 tokens", lambda r: r["skew"] == 0 and r["tokens"] >= 1024),
                      ("skewed", lambda r: r["skew"] > 0)):
    sel = [r["us"] for r in rows if keep(r) and r["us"].get("wt")]
    tk = [u["tokamax"] / u["wt"] for u in sel if u.get("tokamax")]
    best = [min(v for k, v in u.items() if k.startswith("tokamax") and v) / u["wt"]
            for u in sel if any(u.get(k) for k in ("tokamax", "tokamax_c4", "tokamax_c8"))]
    xla = [u["xla"] / u["wt"] for u in sel if u.get("xla")]
    if sel:
      print(f"{label} ({len(sel)}): wt vs tokamax {_gm(tk)}, vs best tokamax config "
            f"{_gm(best)}, vs lax.ragged_dot {_gm(xla)}", flush=True)


def _gm(v) -> str:
  return f"{evaluate._geomean(v):.3f}x (min {min(v):.3f}, {len(v)})" if v else "-"


if __name__ == "__main__":
  sys.exit(main())
