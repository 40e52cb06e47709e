"""The ops with their shipped tables against XLA and cuDNN on models outside
the training suites (CUPTI, L2 flushed, same process, one GPU).

The training suites hold Llama-3 GEMMs and attention, and six MoE models'
expert GEMMs. This script builds the same kinds of calls from public configs
of other models (head_dim 96 and 256, 28/4, 16/8 and 32/32 heads, widths
3072-6144, 60 and 128 experts) at token counts that are not powers of two,
and times, per problem:

* ``wt``: the public op (``wt.matmul``, ``wt.attention``,
  ``wt.decode_attention``, ``wt.ragged_dot``) under ``jax.jit`` with the
  shipped table of this GPU (the default policy), exactly what a user calls;
* ``base``: what a JAX user writes instead: ``jnp.dot``,
  ``jax.nn.dot_product_attention(implementation="cudnn")`` (decode: the
  faster of cuDNN and XLA, with ``key_value_seq_lengths``),
  ``lax.ragged_dot``.

Each is checked against the float32 reference first. The summary gives
``base / wt`` per family (geomean, minimum, problems below 0.95x).
``--dry-run`` prints the problems and the configs the selector picks for
``--device-key`` without a GPU (what the CPU test runs).

    python3 benchmarks/unseen_models.py [--families matmul,attention,decode,ragged_dot]
        [--models NAMES] [--quick] [--json out.json]
    python3 benchmarks/unseen_models.py --dry-run --device-key nvidia_h100_80gb_hbm3
    python3 benchmarks/unseen_models.py --report out.json [more.json ...]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import jax

import wavetune_jax as wt
from wavetune_jax import (DECODE, AttentionProblem, DecodeProblem, MatmulProblem,
                          RaggedDotProblem)

# Public configs (Hugging Face config.json): hidden, heads, head_dim, MLP width.
DENSE = {
    "qwen2_5_7b": dict(hidden=3584, q_heads=28, kv_heads=4, head_dim=128, ffn=18944),
    "gemma_2_9b": dict(hidden=3584, q_heads=16, kv_heads=8, head_dim=256, ffn=14336),
    "phi_3_mini": dict(hidden=3072, q_heads=32, kv_heads=32, head_dim=96, ffn=8192),
    "mistral_nemo_12b": dict(hidden=5120, q_heads=32, kv_heads=8, head_dim=128, ffn=14336),
}
# Experts, top-k, hidden, expert MLP width.
MOE = {
    "qwen1_5_moe_a2_7b": dict(E=60, top_k=4, hidden=2048, ffn=1408),
    "qwen3_30b_a3b": dict(E=128, top_k=8, hidden=2048, ffn=768),
    "mixtral_8x22b": dict(E=8, top_k=2, hidden=6144, ffn=16384),
}
GEMM_M = (1, 40, 200, 777, 3000, 12000)
ATTN_BATCH = (1, 6)
ATTN_SEQ = (200, 777, 2500, 6000)
DECODE_BATCH = (8, 32)
DECODE_CACHE = (3000, 20000)
MOE_TOKENS = (40, 300, 2000, 6000)
FAMILIES = ("matmul", "attention", "decode", "ragged_dot")


def gemm_weights(c: dict) -> dict:
  h, d = c["hidden"], c["head_dim"]
  q, kv = c["q_heads"] * d, c["kv_heads"] * d
  return {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * c["ffn"]),
          "down": (c["ffn"], h)}


def problems(families, quick: bool, models=None) -> list[tuple[str, str, object]]:
  """``(family, label, problem)`` for every problem of the selected families
  (and models, if given)."""
  pick = (lambda v: v[::2]) if quick else (lambda v: v)
  out = []
  for name, c in DENSE.items():
    if models and name not in models:
      continue
    if "matmul" in families:
      for w, (k, n) in gemm_weights(c).items():
        out += [("matmul", f"{name}.{w} M={m}", MatmulProblem(m=m, n=n, k=k))
                for m in pick(GEMM_M)]
    if "attention" in families:
      out += [("attention", f"{name} b={b} L={s}",
               AttentionProblem(batch=b, q_heads=c["q_heads"], kv_heads=c["kv_heads"],
                                q_len=s, kv_len=s, head_dim=c["head_dim"], causal=True))
              for b in ATTN_BATCH for s in pick(ATTN_SEQ)]
    if "decode" in families:
      out += [("decode", f"{name} b={b} cache={L}",
               DecodeProblem(batch=b, q_heads=c["q_heads"], kv_heads=c["kv_heads"],
                             kv_len=L, head_dim=c["head_dim"]))
              for b in DECODE_BATCH for L in pick(DECODE_CACHE)]
  if "ragged_dot" in families:
    for name, c in MOE.items():
      if models and name not in models:
        continue
      for w, (k, n) in {"w13": (c["hidden"], 2 * c["ffn"]),
                        "w2": (c["ffn"], c["hidden"])}.items():
        out += [("ragged_dot", f"{name}.{w} tokens={t}",
                 RaggedDotProblem(m=t * c["top_k"], g=c["E"], k=k, n=n))
                for t in pick(MOE_TOKENS)]
  return out




def op_fn(family: str, p):
  """The public op on the family's inputs, as a user calls it."""
  if family == "matmul":
    return lambda x, w: wt.matmul(x, w)
  if family == "attention":
    return lambda q, k, v, *lens: wt.attention(q, k, v, causal=p.causal,
                                               kv_lengths=lens[0] if lens else None)
  if family == "decode":
    return lambda q, k, v, *lens: wt.decode_attention(q, k, v, causal=p.causal,
                                                      kv_lengths=lens[0] if lens else None)
  return lambda lhs, rhs, gs: wt.ragged_dot(lhs, rhs, gs)


def baselines(spec, p) -> dict:
  """What a user writes instead; decode takes the faster of cuDNN and XLA."""
  out = {"base": spec.baseline(p)}
  if spec is DECODE:
    out.update({f"base_{k}": f for k, f in spec.extra_baselines(p).items()})
  return out


def describe(spec, config) -> str:
  d = spec.config_to_dict(config)
  rest = ",".join(f"{k}={v}" for k, v in d.items() if k != "backend")
  return d["backend"] + (f"({rest})" if rest else "")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--families", default=",".join(FAMILIES),
                  help=f"comma-separated, of {','.join(FAMILIES)}")
  ap.add_argument("--quick", action="store_true", help="every other size")
  ap.add_argument("--models", default="",
                  help=f"comma-separated, of {','.join([*DENSE, *MOE])} (default: all)")
  ap.add_argument("--iterations", type=int, default=10)
  ap.add_argument("--json", default=None,
                  help="write every row here (after each problem); problems already in "
                       "the file are skipped, so a cut-off run resumes")
  ap.add_argument("--compile-threads", type=int, default=1,
                  help="parallel compiles (default 1: XLA autotunes jnp.dot on the GPU "
                       "while compiling, and concurrent autotuning picks noisier kernels)")
  ap.add_argument("--report", nargs="+", metavar="JSON", default=None,
                  help="summarize files this script wrote (a later file's row replaces "
                       "an earlier one of the same problem); times nothing")
  ap.add_argument("--dry-run", action="store_true",
                  help="print the problems and the selected configs; time nothing")
  ap.add_argument("--device-key", default=None,
                  help="the tables to select from in --dry-run (default: this device)")
  a = ap.parse_args(argv)
  fams = tuple(f.strip() for f in a.families.split(",") if f.strip())
  bad = sorted(set(fams) - set(FAMILIES))
  if bad or not fams:
    ap.error(f"--families: unknown {bad}; choose from {','.join(FAMILIES)}")
  if a.iterations < 1:
    ap.error("--iterations must be >= 1")
  if a.compile_threads < 1:
    ap.error("--compile-threads must be >= 1")
  if a.report:
    return report(a.report, fams, a.models)
  models = tuple(m.strip() for m in a.models.split(",") if m.strip())
  bad = sorted(set(models) - set(DENSE) - set(MOE))
  if bad:
    ap.error(f"--models: unknown {bad}; choose from {','.join([*DENSE, *MOE])}")
  plan = problems(fams, a.quick, models)
  if a.dry_run:
    for fam, label, p in plan:
      spec = wt.get_family(fam)
      sel = wt.select(fam, p, a.device_key)
      print(f"{fam:<11}{label:<40}{describe(spec, sel.config)}  [{sel.source}]")
    print(f"{len(plan)} problems")
    return 0
  if a.device_key:
    ap.error("--device-key is for --dry-run; timing uses this device's tables")
  if jax.default_backend() != "gpu":
    print("unseen_models: needs a GPU (CUPTI timing); use --dry-run on a CPU", file=sys.stderr)
    return 2
  from wavetune_jax.tuning import evaluate, profiler
  dev = jax.devices()[0]
  print(dev.device_kind, "jax", jax.__version__, flush=True)
  prof = profiler.Profiler(iterations=a.iterations, threads=a.compile_threads)
  out = {"device_kind": dev.device_kind, "jax": jax.__version__, "rows": []}
  if a.json and os.path.exists(a.json):
    out = resume(a.json, dev.device_kind)
    done = {(r["family"], r["label"]) for r in out["rows"]}
    plan = [t for t in plan if (t[0], t[1]) not in done]
    print(f"{a.json}: {len(done)} problems on file, {len(plan)} to run", flush=True)
  print(f"{'family':<11}{'problem':<40}{'base us':>10}{'wt us':>10}{'base/wt':>8}  wt config",
        flush=True)
  t0 = time.time()
  for fam, label, p in plan:
    spec = wt.get_family(fam)
    sel = wt.select(fam, p)
    fns = {"wt": op_fn(fam, p), **baselines(spec, p)}
    args = spec.inputs(p, jax.random.PRNGKey(0))
    ref = spec.reference(p, *args)
    res = prof.measure_many(list(fns.values()), args, reference=ref,
                            tolerance=spec.tolerance(p), out_bytes=ref.size * 4)
    del args, ref
    row = {"family": fam, "label": label, "problem": spec.problem_key(p),
           "config": spec.config_to_dict(sel.config), "source": sel.source,
           "us": {}, "status": {}}
    for k, r in zip(fns, res):
      row["us"][k] = r.median_us if r.status == "ok" else None
      if r.status != "ok":
        row["status"][k] = f"{r.status}: {r.error[:200]}"
    out["rows"].append(row)
    base = min((v for k, v in row["us"].items() if k != "wt" and v), default=math.nan)
    w = row["us"]["wt"] or math.nan
    print(f"{fam:<11}{label:<40}{base:10.1f}{w:10.1f}{base / w:8.3f}  "
          f"{describe(spec, sel.config)}", flush=True)
    for k, s in row["status"].items():
      print(f"    {k}: {s}", flush=True)
    if a.json:
      tmp = a.json + ".tmp"
      with open(tmp, "w") as f:
        json.dump(out, f)
      os.replace(tmp, a.json)
  summarize(out["rows"], evaluate._geomean)
  print(f"elapsed {time.time() - t0:.0f} s", flush=True)
  return 0


ROW_KEYS = ("family", "label", "problem", "config", "us", "status")


def _read(path: str) -> dict:
  """A file this script wrote; ``ValueError`` naming what is wrong."""
  try:
    with open(path) as f:
      out = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path} is not readable JSON ({type(e).__name__})") from None
  rows = out.get("rows") if isinstance(out, dict) else None
  if (not isinstance(rows, list) or not isinstance(out.get("device_kind"), str)
      or not all(isinstance(r, dict) and all(k in r for k in ROW_KEYS)
                 and r["family"] in FAMILIES and isinstance(r["us"], dict) for r in rows)):
    raise ValueError(f"{path} is not a file this script wrote (no device_kind, or rows "
                     f"without {', '.join(ROW_KEYS)})")
  return out


def resume(path: str, device_kind: str) -> dict:
  """The rows of an earlier run of this GPU kind (``SystemExit`` otherwise)."""
  try:
    out = _read(path)
  except ValueError as e:
    raise SystemExit(f"unseen_models: {e}; move it away or pass another --json") from None
  if out.get("device_kind") != device_kind:
    raise SystemExit(f"unseen_models: {path} holds rows of {out.get('device_kind')!r}, "
                     f"this GPU is {device_kind!r}; pass another --json")
  return out


def report(paths, families, models: str) -> int:
  """Prints, per problem of the selected families and models, the last row
  of ``paths`` that ran the config the selector picks today (else its last
  row, marked ``older selection``), and the per-family summary."""
  found: dict = {}
  kinds = set()
  for path in paths:
    try:
      out = _read(path)
    except ValueError as e:
      print(f"unseen_models: {e}", file=sys.stderr)
      return 2
    kinds.add(out["device_kind"])
    for r in out["rows"]:
      found.setdefault((r["family"], r["label"]), []).append(r)
  if len(kinds) > 1:
    print(f"unseen_models: the files hold rows of several GPUs {sorted(kinds)}", file=sys.stderr)
    return 2
  names = tuple(m.strip() for m in models.split(",") if m.strip())
  bad = sorted(set(names) - set(DENSE) - set(MOE))
  if bad:
    print(f"unseen_models: --models: unknown {bad}", file=sys.stderr)
    return 2
  hw = wt.device_key(next(iter(kinds))) if kinds else None
  plan = {(f, label): p for f, label, p in problems(FAMILIES, False)}
  keep, older = [], []
  for key, rs in found.items():
    if key[0] not in families or (names and key[1].split(" ")[0].split(".")[0] not in names):
      continue
    p = plan.get(key)
    today = (wt.get_family(key[0]).config_to_dict(wt.select(key[0], p, hw).config)
             if p is not None else None)
    now = [r for r in rs if r["config"] == today]
    keep.append(now[-1] if now else rs[-1])
    if not now:
      older.append(key[1])
  print(*kinds, f"{len(keep)} problems, {len(older)} measured with an older selection")
  for r in keep:
    base = min((v for k, v in r["us"].items() if k != "wt" and v), default=math.nan)
    w = r["us"].get("wt") or math.nan
    c = r["config"]
    print(f"{r['family']:<11}{r['label']:<40}{base:10.1f}{w:10.1f}{base / w:8.3f}  "
          f"{c['backend']}{'  (older selection)' if r['label'] in older else ''}")
  from wavetune_jax.tuning import evaluate
  summarize(keep, evaluate._geomean)
  return 0


def speedups(rows) -> dict[str, list[float]]:
  """``base / wt`` per family over the rows where both ran."""
  out: dict[str, list[float]] = {}
  for r in rows:
    base = [v for k, v in r["us"].items() if k != "wt" and v]
    if base and r["us"].get("wt"):
      out.setdefault(r["family"], []).append(min(base) / r["us"]["wt"])
  return out


def summarize(rows, geomean) -> None:
  for fam, v in speedups(rows).items():
    low = sum(x < 0.95 for x in v)
    print(f"{fam}: wt vs {'the faster of cuDNN and XLA' if fam == 'decode' else 'base'} "
          f"{geomean(v):.3f}x geomean, min {min(v):.3f}x, {low} of {len(v)} below 0.95x",
          flush=True)
  failed = [(r["label"], k) for r in rows for k in r["status"]]
  if failed:
    print(f"failed: {failed}", flush=True)


if __name__ == "__main__":
  sys.exit(main())
