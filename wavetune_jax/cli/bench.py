"""``wavetune bench model``: a decoder end to end with each setting of the op switch."""

from __future__ import annotations

import argparse
import functools
import json
import os
import time

from wavetune_jax.cli.common import CliError, output_file, positive_int, pyplot

__all__ = ["add_commands"]


def add_commands(sub: argparse._SubParsersAction) -> None:
  from wavetune_jax.models import MODELS, OPS
  from wavetune_jax.runtime.selector import POLICIES
  bench = sub.add_parser("bench", help="end-to-end benchmarks (bench model)")
  bsub = bench.add_subparsers(dest="bench_command", required=True, metavar="WHAT",
                              help="what to benchmark: model")
  m = bsub.add_parser(
      "model", help="TTFT and TPOT of a decoder with XLA + cuDNN or the wavetune ops",
      description="Runs a decoder (random weights, real shapes) with each setting of the "
      "op switch: xla (jnp.dot, cuDNN attention, lax.ragged_dot) and the wavetune ops "
      "under a selection policy (tables, heuristic, default for fixed, or any other of "
      "wavetune_jax.POLICIES: auto, refine, ...). Per setting: the first "
      "trace + compile of a new prompt length (wall clock), TTFT (prefill) per prompt "
      "length and TPOT (one decode step, every sequence at the cache length, or spread "
      "over it with --cache-fill spread; the new token's keys and values are not "
      "written, as a serving loop writes them in place; the KV cache contiguous or, "
      "with --cache-layout paged, in shuffled pages named by a block table) "
      "per batch and cache length, both CUPTI over the whole jitted step. Every "
      "setting's logits are checked against the xla setting's. Run twice with "
      "--compile-cache for a second process's compile times. Without a GPU: compile "
      "times and checks only (small models).")
  m.add_argument("--model", choices=sorted(MODELS), default="llama3_8b",
                 help="decoder shapes (default: llama3_8b; llama3_2_1b, qwen2_5_1_5b and "
                 "gemma_2_2b are outside the training suites; small, small_moe, small_local run on a CPU)")
  m.add_argument("--layers", type=positive_int, default=None,
                 help="decoder layers (default: 4, or the model's for small models)")
  m.add_argument("--window", type=int, default=None, metavar="N",
                 help="local layers attend to the last N positions (default: the model's; "
                 "gemma_3_4b 1024, gpt_oss_20b 128; 0: every layer global)")
  m.add_argument("--global-every", type=int, default=None, metavar="K",
                 help="with --window, every K-th layer is global (6: five local to one "
                 "global; 0: every layer local; default: the model's)")
  m.add_argument("--soft-cap", type=float, default=None, metavar="C",
                 help="attention logit soft-capping, C * tanh(s / C) (Gemma-2: 50; 0: "
                 "none; default: the model's)")
  m.add_argument("--sinks", choices=("on", "off"), default=None,
                 help="a learned sink logit per query head (default: the model's; "
                 "gpt_oss_20b has them)")
  m.add_argument("--ops", default=",".join(OPS),
                 help=f"comma-separated settings: xla, default (the fixed policy) or a "
                 f"selection policy of the wavetune ops ({','.join(POLICIES)}; default: "
                 f"{','.join(OPS)})")
  m.add_argument("--prompt", type=positive_int, nargs="+", metavar="LEN",
                 default=[128, 512, 1000, 2048, 3000, 4096, 8192, 16384],
                 help="prompt lengths of the TTFT rows (default: 128 512 1000 2048 3000 "
                 "4096 8192 16384)")
  m.add_argument("--batch", type=positive_int, default=1, help="prefill batch (default: 1)")
  m.add_argument("--decode-batch", type=positive_int, nargs="+", default=[1, 8, 32],
                 metavar="B", help="batch sizes of the TPOT rows (default: 1 8 32)")
  m.add_argument("--cache", type=positive_int, nargs="+", default=[1024, 4096, 16384],
                 metavar="LEN", help="cache lengths of the TPOT rows (default: 1024 4096 "
                 "16384)")
  m.add_argument("--cache-fill", choices=("full", "spread"), default="full",
                 help="TPOT rows: every sequence at the cache length (full, the default), "
                 "or lengths spread evenly over [1, cache length] as the decode sweeps "
                 "and tables measure them (spread: a serving batch of mixed lengths)")
  m.add_argument("--cache-layout", choices=("contiguous", "paged"), default="contiguous",
                 help="the KV cache: one [batch, length] cache per layer (contiguous, the "
                 "default), or pages in a pool named by a block table (paged: each "
                 "sequence's pages a random permutation of the pool; the xla setting "
                 "gathers them into a contiguous cache for cuDNN, the wavetune ops read "
                 "the pages)")
  m.add_argument("--weights", choices=("bf16", "int8", "fp8", "int4", "w8a8"), default="bf16",
                 help="the dense GEMMs' weights: bf16 (default), or int8 / fp8 (e4m3) with a "
                 "scale per output channel, run by every setting (xla: XLA's GEMM on the "
                 "converted weight; the wavetune ops: wt.quantized_matmul); w8a8: e4m3 "
                 "weights and activations (quantized per token at each GEMM, experts "
                 "too: wt.quantized_ragged_dot; xla: XLA's FP8 dot and ragged dot); int4: "
                 "[N, K] weights with a scale per 128 values of K (xla: the weight "
                 "dequantized, then XLA's GEMM); under int8 / fp8 / int4 expert weights "
                 "stay bf16 unless --quantize-experts (int8 / fp8)")
  m.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16",
                 help="the model's activations, 16-bit weights and KV cache (default: "
                 "bfloat16; --weights bf16 then means the model's float16 weights)")
  m.add_argument("--vs-bf16", action="store_true",
                 help="with --weights other than bf16, also run XLA + cuDNN on the model's "
                 "bf16 weights (setting xla-bf16: the same random weights before "
                 "quantization, float16 under --dtype float16) and report every setting "
                 "against it too")
  m.add_argument("--quantize-lm-head", action="store_true",
                 help="with --weights int8 / fp8 / int4 / w8a8, the LM head's weight too "
                 "(weight-only, in the format's weight dtype; by default it stays bf16)")
  m.add_argument("--quantize-experts", action="store_true",
                 help="with --weights int8 / fp8, a mixture-of-experts model's expert "
                 "weights too (weight-only, a scale per expert and channel: "
                 "wt.quantized_ragged_dot; by default they stay bf16)")
  m.add_argument("--weight-layout", choices=("kn", "nk"), default=None,
                 help="with --weights int8 / fp8, the dense weights (and a quantized LM "
                 "head) as [K, N] (kn, the default) or [N, K] (nk: the layout of most "
                 "checkpoints, run at decode sizes by the swapped weight-only kernel); "
                 "w8a8 and int4 are always nk")
  m.add_argument("--cache-multiple", type=positive_int, default=1, metavar="N",
                 help="a contiguous cache holds the cache length + 1 positions rounded up "
                 "to a multiple of N, as a serving stack allocates it (the Mosaic decode "
                 "kernel needs a multiple of 8; default: 1, no rounding)")
  m.add_argument("--page-size", type=int, default=None, metavar="N",
                 help="positions per page of --cache-layout paged, in [8, 1024], dividing "
                 "every --cache length (default: 64)")
  m.add_argument("--iterations", type=positive_int, default=10,
                 help="timed calls per step, median reported (default: 10)")
  m.add_argument("--json", metavar="PATH", type=output_file,
                 help="write every row here as it is measured")
  m.add_argument("--compile-cache", metavar="DIR",
                 help="JAX's persistent compilation cache (and XLA's autotune results, "
                 "wavetune's lowered kernels and parsed tables) in DIR; run the command "
                 "twice to time the second process (default: off)")
  m.add_argument("--xla-autotune", type=int, choices=range(0, 5), metavar="LEVEL",
                 help="XLA's GPU autotune level, 0 (off) to 4 (default: XLA's own, 4)")
  m.add_argument("--breakdown", type=positive_int, default=0, metavar="N",
                 help="on a GPU, also print each step's N longest kernels (CUPTI; default: none)")
  m.add_argument("--plot", metavar="PNG", type=output_file,
                 help="TTFT against prompt length (matplotlib)")
  m.set_defaults(func=_bench_model)


#: The setting ``--vs-bf16`` adds: XLA + cuDNN on the unquantized weights.
BF16_SETTING = "xla-bf16"


def _settings(text: str):
  from wavetune_jax.models.decoder import ops_names
  names = [s.strip() for s in text.split(",") if s.strip()]
  bad = [s for s in names if s not in ops_names()]
  if bad or not names:
    raise CliError(f"--ops {text!r}: choose from {','.join(ops_names())}")
  return list(dict.fromkeys(["xla"] + names))  # xla first: the reference


def _attention_summary(cfg) -> str:
  """``", layers local (window 1024), global, ...; soft cap 50; sinks"`` or ""."""
  parts = []
  if cfg.window:
    kinds = ["local" if cfg.layer_window(i) else "global" for i in range(cfg.layers)]
    parts.append(f"attention {'/'.join(kinds)} (window {cfg.window})")
  if cfg.soft_cap:
    parts.append(f"soft cap {cfg.soft_cap:g}")
  if cfg.sinks:
    parts.append("sinks")
  return "".join(f", {p}" for p in parts)


def _with_attention_options(cfg, a):
  """The model's config with the attention options given on the command line."""
  import dataclasses
  import math
  change = {}
  for flag, name in (("window", "window"), ("global_every", "global_every")):
    v = getattr(a, flag)
    if v is not None:
      if v < 0:
        raise CliError(f"--{flag.replace('_', '-')} {v}: must be >= 0")
      change[name] = v
  if a.soft_cap is not None:
    if not math.isfinite(a.soft_cap) or a.soft_cap < 0:
      raise CliError(f"--soft-cap {a.soft_cap}: must be a finite number >= 0")
    change["soft_cap"] = a.soft_cap
  if a.sinks is not None:
    change["sinks"] = a.sinks == "on"
  return dataclasses.replace(cfg, **change) if change else cfg


def _bench_model(a) -> int:
  import jax
  import numpy as np

  from wavetune_jax import models as M
  from wavetune_jax.runtime import selector
  cfg = M.MODELS[a.model]
  small = a.model.startswith("small")
  cfg = cfg.with_layers(a.layers or (cfg.layers if small else 4))
  cfg = _with_attention_options(cfg, a)
  settings = _settings(a.ops)
  page_size = _page_size(a)
  if a.quantize_lm_head and a.weights == "bf16":
    raise CliError("--quantize-lm-head needs --weights int8, fp8, int4 or w8a8")
  if a.quantize_experts and a.weights not in ("int8", "fp8"):
    raise CliError("--quantize-experts needs --weights int8 or fp8 (w8a8 quantizes the "
                   "experts already)")
  if a.vs_bf16 and a.weights == "bf16":
    raise CliError("--vs-bf16 needs --weights int8, fp8, int4 or w8a8 (the bf16 model is the "
                   "xla setting already)")
  if a.vs_bf16:
    settings = settings + [BF16_SETTING]
  if a.weight_layout and a.weights == "bf16":
    raise CliError("--weight-layout is for --weights int8, fp8, int4 or w8a8")
  if a.weight_layout == "kn" and a.weights in ("w8a8", "int4"):
    raise CliError(f"--weight-layout kn: --weights {a.weights} takes its weights [N, K] (nk)")
  if a.quantize_experts and not cfg.experts:
    raise CliError(f"--quantize-experts: --model {a.model} has no experts")
  if a.plot:
    pyplot()  # the error before the work
  _configure_xla(a)
  on_gpu = jax.devices()[0].platform == "gpu"
  if not on_gpu and not small:
    raise CliError(f"--model {a.model} needs a GPU; on a CPU use --model small, small_moe "
                   f"or small_local")
  prof = None
  if on_gpu:
    from wavetune_jax.tuning.profiler import Profiler
    prof = Profiler(iterations=a.iterations)
  layout = f"paged KV cache (pages of {page_size})" if page_size else "contiguous KV cache"
  attn = _attention_summary(cfg)
  wts = "" if a.dtype == "bfloat16" else f", {a.dtype}"
  wts += "" if a.weights == "bf16" else f", {a.weights} weights"
  wts += " (LM head too)" if a.quantize_lm_head else ""
  wts += " (experts too)" if a.quantize_experts else ""
  wts += ", dense weights [N, K]" if a.weight_layout == "nk" or a.weights == "int4" else ""
  print(f"{jax.devices()[0].device_kind}: {cfg.name}, {cfg.layers} layers{attn}{wts}, "
        f"{layout}, settings {','.join(settings)}", flush=True)
  raw = M.init(jax.random.PRNGKey(0), cfg, dtype=a.dtype)
  params = M.quantize_params(raw, cfg, a.weights, lm_head=a.quantize_lm_head,
                             experts=a.quantize_experts, layout=a.weight_layout)
  raw = raw if a.vs_bf16 else None  # (the bf16 weights held only where they run)
  rows = []
  work = ([("prefill", s, a.batch) for s in a.prompt]
          + [("decode", c, b) for b in a.decode_batch for c in a.cache])
  total = len(work) * len(settings)
  done = 0
  for kind, length, batch in work:
    if kind == "prefill":
      extra = (jax.random.randint(jax.random.PRNGKey(length), (batch, length), 0, cfg.vocab),)
      if page_size:  # the prompt's pages of a table as long as the prompt
        extra += (M.random_block_tables(jax.random.PRNGKey(4), batch,
                                        -(-length // page_size)),)
    else:  # each sequence at `filled`; the step attends over filled + 1 positions
      # Paged: the new token at position `length` opens one more page.
      cache_rows = -(-(length + 1) // a.cache_multiple) * a.cache_multiple
      shape = ((batch * (length // page_size + 1), page_size) if page_size
               else (batch, cache_rows)) + (cfg.kv_heads, cfg.head_dim)
      kc, vc = M.random_kv_caches(cfg, shape, dtype=a.dtype)
      tables = ((M.random_block_tables(jax.random.PRNGKey(4), batch, length // page_size + 1),)
                if page_size else ())
      extra = (kc, vc, *tables, _filled(a.cache_fill, cfg, batch, length),
               jax.random.randint(jax.random.PRNGKey(2), (batch,), 0, cfg.vocab))
    # One flat list of arrays: the profiler times f(*arrays).
    flat = {False: jax.tree_util.tree_flatten((params,) + extra)}
    if a.vs_bf16:
      flat[True] = jax.tree_util.tree_flatten((raw,) + extra)
    ref = None
    for name in settings:
      args, tree = flat[name == BF16_SETTING]
      ops = M.make_ops("xla" if name == BF16_SETTING else name)
      if kind == "prefill" and page_size:
        step = functools.partial(M.paged_prefill, cfg=cfg, ops=ops, page_size=page_size)
      elif kind == "prefill":
        step = functools.partial(M.prefill, cfg=cfg, ops=ops, max_len=length)
      elif page_size:
        step = functools.partial(M.paged_decode_step, cfg=cfg, ops=ops, write_cache=False)
      else:
        step = functools.partial(M.decode_step, cfg=cfg, ops=ops, write_cache=False)

      def fn(*xs, step=step, tree=tree):
        return step(*jax.tree_util.tree_unflatten(tree, xs))[0]

      n0, sel0 = selector.decision_stats()
      t0 = time.perf_counter()
      traced = jax.jit(fn).trace(*args)
      t1 = time.perf_counter()
      lowered = traced.lower()
      t2 = time.perf_counter()
      exe = lowered.compile()
      t3 = time.perf_counter()
      compile_s = t3 - t0
      n1, sel1 = selector.decision_stats()
      phases = {"trace_s": t1 - t0, "lower_s": t2 - t1, "xla_compile_s": t3 - t2,
                "select_s": sel1 - sel0, "decisions": n1 - n0}
      logits = np.asarray(exe(*args), np.float32)
      if ref is None:
        ref = logits
      # Relative RMS: a wrong op is off everywhere (about 1). A mixture-of-
      # experts router may flip a near tie under other rounding upstream, and
      # a flip at the last token moves its logits by some 10% (measured), so
      # MoE models are held to 25%, dense ones to 5%. Every op is also checked
      # alone against float32 references (tests, sweeps).
      err = float(np.sqrt(np.mean((logits - ref) ** 2) / (np.mean(ref ** 2) + 1e-12)))
      us = None
      if prof is not None:
        (meas,) = prof.measure_many([fn], args)
        us = meas.median_us if meas.status == "ok" else None
      kernels = []
      if prof is not None and a.breakdown:
        kernels = prof.kernel_breakdown(fn, args)[:a.breakdown]
      done += 1
      row = {"setting": name, "kind": kind, "length": length, "batch": batch,
             **({"cache_fill": a.cache_fill, "cache_multiple": a.cache_multiple}
                if kind == "decode" else {}),
             "cache_layout": a.cache_layout, "page_size": page_size,
             "us": us, "compile_s": compile_s, **phases, "rel_diff_vs_xla": err,
             "kernels": kernels}
      rows.append(row)
      if a.json:  # rewritten whole after every row (a crash keeps the rows so far)
        with open(a.json + ".tmp", "w") as f:
          json.dump({"device": jax.devices()[0].device_kind, "model": cfg.name,
                     "layers": cfg.layers, "window": cfg.window,
                     "global_every": cfg.global_every, "soft_cap": cfg.soft_cap,
                     "sinks": cfg.sinks, "dtype": a.dtype, "weights": a.weights,
                     "vs_bf16": a.vs_bf16,
                     "quantized_lm_head": a.quantize_lm_head,
                     "quantized_experts": a.quantize_experts,
                     "weight_layout": (None if a.weights == "bf16" else a.weight_layout
                                       or ("nk" if a.weights in ("w8a8", "int4") else "kn")),
                     "xla_autotune": a.xla_autotune,
                     "compile_cache": bool(a.compile_cache), "cache_fill": a.cache_fill,
                     "cache_layout": a.cache_layout, "page_size": page_size,
                     "kv_arrays": "separate", "rows": rows}, f, indent=1)
        os.replace(a.json + ".tmp", a.json)
      t = f"{us:10.1f} us" if us else f"{'-':>13}"
      what = "TTFT" if kind == "prefill" else "TPOT"
      fill = " spread" if kind == "decode" and a.cache_fill == "spread" else ""
      if kind == "decode" and page_size:
        fill += f" paged/{page_size}"
      print(f"[{done}/{total}] {what} {name:<9} batch {batch:<4} "
            f"{'prompt' if kind == 'prefill' else 'cache'} {length:<6}{fill} {t}  trace+compile "
            f"{compile_s:6.2f} s (trace {phases['trace_s']:.2f}, of it selecting "
            f"{phases['select_s']:.2f}; lower {phases['lower_s']:.2f}; compile "
            f"{phases['xla_compile_s']:.2f})  rel. RMS diff vs xla {err:.1e}", flush=True)
      for kname, kus in kernels:
        print(f"      {kus:10.1f} us  {kname[:90]}", flush=True)
      # An MoE's routing, and W8A8's per-token e4m3 rounding of every GEMM's
      # input, turn a 16-bit difference upstream (another attention kernel)
      # into steps of their own size.
      # (The bf16 model is XLA's own, not checked: it differs from the
      # quantized one by the quantization, 4-bit rounding alone by 20-38%
      # in the small model.)
      if name != BF16_SETTING and err > (25e-2 if cfg.experts else 15e-2
                                         if a.weights == "w8a8" else 5e-2):
        raise CliError(f"{name} differs from xla by {err:.3g} ({kind}, length {length})")
  _summary(rows, settings, layout)
  if a.plot:
    _plot(rows, settings, a.plot, cfg.name)
  return 0


def _page_size(a) -> int | None:
  """``--page-size`` under ``--cache-layout paged`` (default 64), checked
  against the cache lengths; None for a contiguous cache."""
  if a.cache_layout != "paged":
    if a.page_size is not None:
      raise CliError("--page-size applies to --cache-layout paged only")
    return None
  n = 64 if a.page_size is None else a.page_size
  bad = [c for c in a.cache if c % n] if 8 <= n <= 1024 else []
  if not 8 <= n <= 1024 or bad:
    raise CliError(f"--page-size {n}: must be in [8, 1024] and divide every --cache length"
                   + (f" (not {', '.join(map(str, bad))})" if bad else ""))
  return n


def _filled(fill: str, cfg, batch: int, length: int):
  """Filled cache positions per sequence, below ``length``: all ``length``
  (full), or spread evenly so that the attended lengths (filled + 1) cover
  [1, length + 1] as the decode family's sweeps draw them (spread)."""
  import jax
  import jax.numpy as jnp
  if fill == "full":
    return jnp.full((batch,), length, jnp.int32)
  from wavetune_jax.families.decode.family import DecodeFamily
  from wavetune_jax.families.decode.problem import DecodeProblem
  p = DecodeProblem(batch=batch, q_heads=cfg.q_heads, kv_heads=cfg.kv_heads,
                    kv_len=length + 1, head_dim=cfg.head_dim)
  return DecodeFamily.lengths(p, jax.random.PRNGKey(3)) - 1


def _configure_xla(a) -> None:
  """``--xla-autotune`` and ``--compile-cache``, set before JAX starts its backend."""
  from jax._src import xla_bridge
  if a.xla_autotune is not None:
    if xla_bridge.backends_are_initialized():
      raise CliError("--xla-autotune: JAX's backend already started; set "
                     "XLA_FLAGS=--xla_gpu_autotune_level=N in the environment instead")
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_gpu_autotune_level")]
    os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_gpu_autotune_level={a.xla_autotune}"])
  if a.compile_cache:
    from wavetune_jax.core import kernel_cache
    from wavetune_jax.tuning.profiler import enable_persistent_cache
    enable_persistent_cache(a.compile_cache)
    if "WAVETUNE_KERNEL_CACHE" not in os.environ:  # lowered Pallas kernels there too
      kernel_cache.set_dir(os.path.join(a.compile_cache, "wavetune_kernels"))
    # (parsed tables follow JAX's cache folder by themselves: table_cache)


def _summary(rows, settings, layout: str) -> None:
  """Each setting's speed over xla's (and over xla-bf16's, where it ran),
  per row kind: geomean, min and max."""
  import numpy as np
  for base_name in ("xla", BF16_SETTING):
    for kind in ("prefill", "decode"):
      base = {(r["length"], r["batch"]): r["us"] for r in rows
              if r["kind"] == kind and r["setting"] == base_name and r["us"]}
      if not base:
        continue
      for name in settings:
        if name in (base_name, BF16_SETTING):
          continue
        ratio = [base[(r["length"], r["batch"])] / r["us"] for r in rows
                 if r["kind"] == kind and r["setting"] == name and r["us"]
                 and (r["length"], r["batch"]) in base]
        if ratio:
          where = f" ({layout})" if kind == "decode" else ""
          print(f"{'TTFT' if kind == 'prefill' else 'TPOT'}{where} {name} vs {base_name}: "
                f"geomean {float(np.exp(np.mean(np.log(ratio)))):.3f}x, min "
                f"{min(ratio):.3f}x, max {max(ratio):.3f}x", flush=True)


def _plot(rows, settings, path: str, model: str) -> None:
  plt = pyplot()
  fig, ax = plt.subplots(figsize=(6, 4))
  for name in settings:
    pts = sorted((r["length"], r["us"] if r["us"] else r["compile_s"] * 1e6) for r in rows
                 if r["kind"] == "prefill" and r["setting"] == name)
    if pts:
      ax.plot([p[0] for p in pts], [p[1] / 1e3 for p in pts], marker="o", label=name)
  ax.set_xscale("log")
  ax.set_yscale("log")
  ax.set_xlabel("prompt length (tokens)")
  ax.set_ylabel("TTFT, ms (CUPTI; trace+compile on a CPU)")
  ax.set_title(model)
  ax.legend()
  fig.tight_layout()
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  fig.savefig(path, dpi=120)
  print(f"wrote {path}", flush=True)
