"""Decode attention on a GPU: the flash-decoding kernel against cuDNN and XLA.

For a few decode problems of the training models (one new query per sequence,
or four under a causal mask), checks and times with CUPTI (L2 flushed): the
Triton kernel's heuristic config and its neighbours in ``num_splits``, the
op's XLA backend (NaN-safe), and the two baselines a JAX user would write
(``jax.nn.dot_product_attention`` with ``key_value_seq_lengths``, cuDNN and
XLA). Each problem runs with random per-sequence lengths and with a full
cache. A NaN/Inf check runs the heuristic config with NaN in K and Inf in V
past every sequence's length. Prints microseconds and the speedup of the
best Triton config and of the heuristic over the faster baseline.

With ``--mha`` the problems are one KV head per query head (Phi-3-mini's 32/32
heads, head_dim 96, and the same heads at head_dim 128), batch 1-32, caches
of 1,000-20,000, and the Triton candidates also flip ``block_k``.

With ``--problem HQ,HKV,B,S,Q`` (repeatable) only those problems run, and
``--length-mix full`` gives every sequence of the ragged runs the whole
cache (``kv_lengths`` passed, all equal: a batch of equal prompts), where the
default ``spread`` draws them evenly (the sweeps' mix). ``--grid`` times,
instead of the split neighbours, the Triton and Mosaic backends' pruned
spaces (at most ``--max-configs`` of each, the heuristic's config first)
and ``--json`` writes every candidate's time.

    python3 benchmarks/decode.py [--quick | --mha | --problem 32,8,16,4160,1 ...]
        [--length-mix spread|full] [--grid [--max-configs N]] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np

from wavetune_jax import DECODE, DecodeProblem, get_hardware
from wavetune_jax.families.decode.triton import splits_of
from wavetune_jax.tuning import profiler

# (q_heads, kv_heads, batch, kv_len, q_len)
PROBLEMS = [(32, 8, 8, 4096, 1), (32, 8, 8, 16384, 1), (32, 8, 32, 4096, 1),
            (32, 8, 32, 16384, 1), (32, 8, 1, 32768, 1), (32, 8, 128, 2048, 1),
            (8, 1, 8, 32768, 1), (48, 8, 8, 8192, 1), (16, 16, 32, 4096, 1),
            (32, 8, 8, 8192, 4)]
# --mha: (q_heads, kv_heads, batch, kv_len, q_len, head_dim)
MHA = ([(32, 32, b, s, 1, 96) for b in (1, 8, 32) for s in (1000, 3000, 8000, 20000)]
       + [(32, 32, b, 3000, 1, 128) for b in (8, 32)])


def nan_check(p: DecodeProblem, config) -> float:
  """Largest |out - ref| with NaN in K and Inf in V past every length."""
  q, k, v, lens = DECODE.inputs(p, jax.random.PRNGKey(1))
  past = jnp.arange(p.kv_len)[None, :, None, None] >= lens[:, None, None, None]
  k = jnp.where(past, jnp.nan, k)
  v = jnp.where(past, jnp.inf, v)
  out = jax.jit(DECODE.build(p, config))(q, k, v, lens)
  ref = DECODE.reference(p, q, k, v, lens)
  return float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))


def main():
  ap = argparse.ArgumentParser()
  which = ap.add_mutually_exclusive_group()
  which.add_argument("--quick", action="store_true", help="the first 4 problems only")
  which.add_argument("--mha", action="store_true",
                     help="one KV head per query head, head_dim 96 and 128")
  which.add_argument("--problem", action="append", metavar="HQ,HKV,B,S,Q",
                     help="q heads, kv heads, batch, cache length, queries (head_dim 128)")
  ap.add_argument("--length-mix", choices=("spread", "full"), default="spread",
                  help="valid lengths of the ragged runs (default: spread)")
  ap.add_argument("--ragged-only", action="store_true",
                  help="only the runs with kv_lengths (skip the cache without lengths)")
  ap.add_argument("--iterations", type=int, default=20)
  ap.add_argument("--grid", action="store_true",
                  help="time the Triton and Mosaic pruned spaces, not the split neighbours")
  ap.add_argument("--max-configs", type=int, default=None,
                  help="--grid: at most this many configs of each backend (default 24)")
  ap.add_argument("--json", default=None, help="write every candidate's time here")
  a = ap.parse_args()
  if a.max_configs is not None and not a.grid:
    ap.error("--max-configs is for --grid")
  a.max_configs = 24 if a.max_configs is None else a.max_configs
  if a.max_configs < 1:
    ap.error("--max-configs must be >= 1")
  if a.json and not os.path.isdir(os.path.dirname(os.path.abspath(a.json))):
    ap.error(f"--json {a.json}: no such folder")
  family = DECODE.with_lengths(a.length_mix)
  dev = jax.devices()[0]
  print(dev.device_kind, jax.__version__)
  hw = get_hardware()
  prof = profiler.Profiler(iterations=a.iterations)
  tri = DECODE.backend("triton")
  xla = DECODE.backend("xla")
  print(f"{'problem':<44}{'cache':>6}{'heur':>9}{'best':>9}{'(splits/bk)':>11}{'xla-be':>9}"
        f"{'cudnn':>9}{'xla':>9}{'best/base':>10}{'heur/base':>10}  nan-err")
  rows, out_rows = [], []
  problems = MHA if a.mha else PROBLEMS[:4] if a.quick else PROBLEMS
  if a.problem:
    try:
      problems = [tuple(int(v) for v in s.split(",")) for s in a.problem]
      assert all(len(x) == 5 for x in problems)
    except (ValueError, AssertionError):
      ap.error(f"--problem takes HQ,HKV,B,S,Q (five integers); got {a.problem}")
  for hq, hkv, b, s, t, *hd in problems:
    for lengths in (True,) if a.ragged_only else (True, False):
      p = DecodeProblem(batch=b, q_heads=hq, kv_heads=hkv, kv_len=s, q_len=t, lengths=lengths,
                        head_dim=hd[0] if hd else 128)
      h = tri.heuristic(p, hw)
      cands = [h]
      for c in (grid(p, hw, a.max_configs) if a.grid else ()):
        if c not in cands:
          cands.append(c)
      for bk in () if a.grid else ((h.block_k, {64: 128, 128: 64}[h.block_k]) if a.mha else (h.block_k,)):
        for ns in (1, h.num_splits // 2, h.num_splits, h.num_splits * 2, h.num_splits * 4):
          if ns >= 1 and splits_of(s, ns, bk) == ns:
            c = dataclasses.replace(h, num_splits=ns, block_k=bk)
            if c not in cands and tri.smem_bytes(p, c) <= hw.smem_per_block:
              cands.append(c)
      args = family.inputs(p, jax.random.PRNGKey(0))
      ref = DECODE.reference(p, *args)
      fns = ([DECODE.build(p, c) for c in cands] + [DECODE.build(p, xla.config_cls())]
             + [DECODE.baseline(p), DECODE.extra_baselines(p)["xla"]])
      res = prof.measure_many(fns, args, reference=ref, tolerance=DECODE.tolerance(p),
                              out_bytes=ref.size * 4)
      us = [m.median_us if m.status == "ok" else np.inf for m in res]
      n = len(cands)
      best = int(np.argmin(us[:n]))
      out_rows.append({"problem": DECODE.problem_key(p), "length_mix": a.length_mix
                       if lengths else "none", "cudnn_us": _num(us[n + 1]),
                       "xla_us": _num(us[n + 2]), "xla_backend_us": _num(us[n]),
                       "configs": [{"config": DECODE.config_to_dict(c), "us": _num(u)}
                                   for c, u in zip(cands, us[:n])]})
      base = min(us[n + 1], us[n + 2])
      bad = [f"{i}:{m.status}" for i, m in enumerate(res) if m.status != "ok"]
      err = nan_check(p, h) if lengths else float("nan")
      name = f"b{b} h{hq}/{hkv} kv{s} q{t}" + (f" d{hd[0]}" if hd else "")
      print(f"{name:<44}{(a.length_mix if lengths else 'none'):>6}{us[0]:9.1f}{us[best]:9.1f}"
            f"{_splits(cands[best]):>7}/{cands[best].block_k:<3}{us[n]:9.1f}{us[n + 1]:9.1f}{us[n + 2]:9.1f}"
            f"{base / us[best]:10.3f}{base / us[0]:10.3f}  {err:.2e} {' '.join(bad)}",
            flush=True)
      if a.mha or a.problem:  # every candidate: splits/block_k=us
        print("    " + "  ".join(f"{_short(c)}={u:.1f}" for c, u in zip(cands, us[:n])),
              flush=True)
      rows.append((b, s, lengths, base / us[best], base / us[0]))
  for lengths in (True, False):
    sel = [r for r in rows if r[2] == lengths]
    if not sel:
      continue
    big = [r for r in sel if r[0] >= 8 and r[1] >= 4096]
    g = lambda xs, i: float(np.exp(np.mean(np.log([x[i] for x in xs])))) if xs else float("nan")  # noqa: E731
    print(f"{'ragged' if lengths else 'full'} caches: best/base geomean {g(sel, 3):.3f} "
          f"(min {min(r[3] for r in sel):.3f}), heuristic {g(sel, 4):.3f}; batch >= 8 and "
          f"kv >= 4096: best {g(big, 3):.3f}, heuristic {g(big, 4):.3f}")
  if a.json:
    with open(a.json, "w") as f:
      json.dump({"device_kind": dev.device_kind, "jax": jax.__version__, "rows": out_rows}, f)


def grid(p: DecodeProblem, hw, limit: int) -> list:
  """The Triton and Mosaic backends' pruned spaces for ``p``, at most
  ``limit`` configs of each (evenly through the space)."""
  out = []
  for name in ("triton", "mosaic"):
    backend = DECODE.backend(name)
    space = list(backend.space(p, hw)) if backend.runs_on(hw) else []
    step = max(1, -(-len(space) // limit))
    out += space[::step][:limit]
  return out


def _splits(c) -> int:
  return getattr(c, "num_splits", getattr(c, "splits", 0))


def _short(c) -> str:
  """The backend and its fields' values, comma-separated."""
  return ",".join(str(v) for v in DECODE.config_to_dict(c).values())


def _num(x: float):
  return None if not np.isfinite(x) else float(x)


if __name__ == "__main__":
  main()
