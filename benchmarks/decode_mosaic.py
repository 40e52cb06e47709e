"""The Mosaic GPU decode kernel on a Hopper GPU: checks, times, bandwidth.

For each problem (``q_heads/kv_heads``, batch, cache length, new queries,
head_dim) and each cache layout (contiguous; paged with pages shuffled in
the pool), with per-sequence lengths spread over ``[q_len, kv_len]`` and with
every sequence at the full cache, checks every candidate against the
float32 reference and times it with CUPTI (L2 flushed):

* Mosaic configs of ``pallas_kernels.decode.mosaic`` (``block_k``, stages,
  splits around the problem's programs);
* cuDNN and XLA through ``jax.nn.dot_product_attention``; on a paged cache
  the family's platform backends (XLA on the gathered pages, the gather
  timed; cuDNN's paged attention for one query);
* the Triton kernel's heuristic config (contiguous cache only).

Prints the best Mosaic config, the faster platform op, their ratio, and the
share of the GPU's HBM bandwidth the best Mosaic config reaches: bytes read
(K and V of the valid keys, the queries, the output) per second against the
device copy bandwidth measured here (a 2 GiB ``x + 1``) and the data-sheet
peak. A NaN check runs the best config with NaN in K and Inf in V past every
length.

    python3 benchmarks/decode_mosaic.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.attention.reference import attention_reference
from pallas_kernels.decode import mosaic as km
from pallas_kernels.decode import paging
from wavetune_jax.core import hardware
from wavetune_jax import DECODE, CudnnDecodeConfig, XlaDecodeConfig
from wavetune_jax.families.decode.library import library_attention
from wavetune_jax.families.decode.problem import DecodeProblem
from wavetune_jax.tuning import evaluate, profiler

#: Data-sheet HBM bandwidth, bytes/s (H100 SXM 80 GB HBM3; H200 141 GB HBM3e).
PEAK_HBM = {"nvidia_h100_80gb_hbm3": 3.35e12, "nvidia_h200": 4.8e12}

# (q_heads, kv_heads, batch, kv_len, q_len, head_dim)
PROBLEMS = [(32, 8, 8, 4096, 1, 128), (32, 8, 32, 8192, 1, 128), (32, 8, 8, 32768, 1, 128),
            (32, 8, 64, 4096, 1, 128), (8, 1, 16, 16384, 1, 128), (16, 8, 16, 8192, 1, 256),
            (32, 32, 8, 8192, 1, 96), (64, 8, 8, 8192, 1, 128), (32, 8, 8, 8192, 4, 128),
            (32, 8, 1, 32768, 1, 128), (32, 8, 16, 4096, 16, 128)]
QUICK = [PROBLEMS[0], PROBLEMS[1], PROBLEMS[5], PROBLEMS[8]]
# Small problems that exercise the edges (lengths 0 and 1, rows above one
# tile, MHA, head_dim 64/256, non-causal, pages smaller than a block).
EDGES = [(8, 2, 3, 1024, 1, 64), (4, 4, 2, 2048, 3, 256), (32, 2, 2, 1024, 8, 128),
         (16, 2, 3, 1000, 1, 128)]


def lengths(batch, kv_len, q_len, mix, key):
  if mix == "full":
    return jnp.full((batch,), kv_len, jnp.int32)
  lo = min(q_len, kv_len)
  lens = lo + ((kv_len - lo) * (2 * np.arange(batch) + 1)) // (2 * batch)
  return jax.random.permutation(key, jnp.asarray(lens, jnp.int32))


def make_pages(k, v, page, key):
  """Pages of a contiguous cache, shuffled in the pool, and the block table."""
  b, s = k.shape[:2]
  table = paging.shuffled_tables(key, b, s // page)
  return (paging.to_pages(k, table, b * (s // page)), paging.to_pages(v, table, b * (s // page)),
          table)


def mosaic_configs(p, hw, quick):
  """Candidates: block_k x stages x splits that fit shared memory; splits
  from 1 to about four waves of CTAs."""
  ctas = p.batch * p.kv_heads * -(-p.q_len * (p.q_heads // p.kv_heads) // km.BLOCK_H)
  out = []
  splits = sorted({s for s in (1, 2, 4, 8, 16, 32, 64)
                   if s == 1 or ctas * s <= 4 * hw.num_sms or ctas * s <= 2 * 132})
  stages = (2, 3, 4) if not quick else (2, 3)
  for bk, st, ns in itertools.product(km.BLOCK_K, stages, splits):
    if p.head_dim > 128 and bk > 64 or bk > p.kv_len:
      continue
    sm = km.smem_bytes(block_k=bk, num_stages=st, head_dim=p.head_dim, itemsize=2,
                       split=ns > 1)
    if sm > hw.smem_per_block:
      continue
    c = km.MosaicDecodeConfig(block_k=bk, num_stages=st,
                              num_splits=km.splits_of(p.kv_len, ns, bk))
    if c not in out:
      out.append(c)
  return out


def copy_bandwidth(prof) -> float:
  x = jnp.ones((1 << 30,), jnp.bfloat16)
  (m,) = prof.measure_many([lambda x: x + 1], (x,))
  return 2 * x.size * 2 / (m.median_us * 1e-6)


def summarize(paths) -> str:
  """The figures of docs/results.md from saved runs (no GPU): over the rows
  at batch >= 8 and cache >= 4,096 (a later file's row replaces an earlier
  one's), the best Mosaic config against the faster platform op per layout,
  the full caches' share of the data-sheet bandwidth, the Triton heuristic
  against the best Mosaic config, and (within each file) the Mosaic
  kernel's paged speed against its contiguous speed per page size."""
  g = evaluate._geomean
  rows, paged_vs = {}, {}
  for path in paths:
    with open(path) as f:
      run = json.load(f)
    mine = {}
    for r in run["rows"]:
      hq, hkv, b, s, t, d = r["problem"]
      if r.get("best") and r.get("ratio") and b >= 8 and s >= 4096:
        key = (tuple(r["problem"]), r["mix"], r["page"])
        rows[key] = mine[key] = r
    for (prob, mix, page), r in mine.items():
      c = mine.get((prob, mix, 0))
      if page and c:
        paged_vs.setdefault(page, []).append(c["times"][c["best"]] / r["times"][r["best"]])
  lines = []
  for page in sorted({k[2] for k in rows}):
    rs = [r["ratio"] for k, r in rows.items() if k[2] == page]
    what = f"pages of {page}" if page else "contiguous"
    lines.append(f"{what}: best Mosaic config / faster platform op {g(rs):.3f}x geomean, "
                 f"{min(rs):.3f}x min, {max(rs):.3f}x max over {len(rs)} rows")
  full = [r for k, r in rows.items() if k[1] == "full" and k[2] == 0]
  peak = {hardware.device_key(r["device"]): PEAK_HBM.get(hardware.device_key(r["device"]))
          for r in full}
  shares = sorted(r["bw"] / PEAK_HBM[hardware.device_key(r["device"])] for r in full
                  if PEAK_HBM.get(hardware.device_key(r["device"])))
  if shares:
    lines.append(f"full caches, contiguous: {', '.join(f'{x:.0%}' for x in shares)} of the "
                 f"data-sheet HBM bandwidth ({', '.join(f'{k} {v / 1e12:.2f} TB/s' for k, v in peak.items() if v)})")
  tri = [r["times"][r["best"]] / r["times"]["triton"] for k, r in rows.items()
         if k[2] == 0 and "triton" in r["times"]]
  if tri:
    lines.append(f"Triton heuristic config / best Mosaic config (speed), contiguous: "
                 f"{min(tri):.3f}-{max(tri):.3f}x")
  for page, v in sorted(paged_vs.items()):
    lines.append(f"Mosaic paged / contiguous speed, pages of {page}: worst {min(v):.3f}x, "
                 f"mean {sum(v) / len(v):.3f}x over {len(v)} rows")
  return "\n".join(lines)


def main():
  ap = argparse.ArgumentParser()
  ap.add_argument("--quick", action="store_true")
  ap.add_argument("--edges-only", action="store_true")
  ap.add_argument("--pages", default="64", help="comma-separated page sizes (0: none)")
  ap.add_argument("--max-configs", type=int, default=0,
                  help="time at most this many Mosaic configs per problem (evenly spaced)")
  ap.add_argument("--problems", help="a slice i:j of the problem list")
  ap.add_argument("--mixes", default="spread,full")
  ap.add_argument("--problem", action="append", metavar="HQ,HKV,B,S,Q,D",
                  help="time this problem (repeatable) instead of the list's")
  ap.add_argument("--persistent", action="store_true",
                  help="also time every Mosaic config with the persistent grid (label 'p')")
  ap.add_argument("--json")
  ap.add_argument("--summarize", nargs="+", metavar="JSON",
                  help="print the docs' figures from saved --json runs (no GPU) and exit")
  a = ap.parse_args()
  if a.summarize:
    print(summarize(a.summarize))
    return 0
  rows = []
  problems = EDGES if a.edges_only else EDGES + (QUICK if a.quick else PROBLEMS)
  ratios = []
  if a.problems:
    lo_, hi_ = (int(x) for x in a.problems.split(":"))
    problems = problems[lo_:hi_]
  if a.problem:
    try:
      problems = EDGES + [tuple(int(x) for x in spec.split(",")) for spec in a.problem]
    except ValueError:
      ap.error(f"--problem takes HQ,HKV,B,S,Q,D integers; got {a.problem}")
    if any(len(p) != 6 for p in problems):
      ap.error(f"--problem takes six integers HQ,HKV,B,S,Q,D; got {a.problem}")
  dev = jax.devices()[0]
  hw = hardware.detect()
  print(dev.device_kind, jax.__version__, flush=True)
  prof = profiler.Profiler(iterations=20)
  bw_copy = copy_bandwidth(prof)
  peak = PEAK_HBM.get(hw.device_key)
  print(f"device copy bandwidth {bw_copy / 1e12:.2f} TB/s; data sheet "
        f"{peak / 1e12 if peak else float('nan'):.2f} TB/s", flush=True)
  pages = [int(x) for x in a.pages.split(",") if x]
  for (hq, hkv, b, s, t, d), mix, page in itertools.product(problems, a.mixes.split(","),
                                                            [0] + pages):
    edge = (hq, hkv, b, s, t, d) in EDGES
    if edge and mix == "full" or page and s % page:
      continue
    p = DecodeProblem(batch=b, q_heads=hq, kv_heads=hkv, kv_len=s, q_len=t, head_dim=d)
    key = jax.random.PRNGKey(0)
    kq, kk, kv, kl, kp = jax.random.split(key, 5)
    q = jax.random.normal(kq, (b, t, hq, d), jnp.float32).astype(jnp.bfloat16)
    k = jax.random.normal(kk, (b, s, hkv, d), jnp.float32).astype(jnp.bfloat16)
    v = jax.random.normal(kv, (b, s, hkv, d), jnp.float32).astype(jnp.bfloat16)
    lens = lengths(b, s, t, mix, kl)
    if edge:
      lens = lens.at[0].set(0).at[-1].set(1 if t == 1 else t) if b > 2 else lens
    ref = attention_reference(q, k, v, causal=True, out_dtype=jnp.float32, kv_lengths=lens,
                              causal_align="bottom_right", q_chunk=t)
    cands = mosaic_configs(p, hw, a.quick or edge)
    cap = 4 if edge else a.max_configs
    if cap and len(cands) > cap:
      cands = [cands[round(i * (len(cands) - 1) / (cap - 1))] for i in range(cap)]
    heur = DECODE.backend("mosaic").heuristic(dataclasses.replace(p, page_size=page), hw)
    if heur is not None and heur not in cands:
      cands.append(heur)
    # (config, persistent grid's CTAs: 0 one per item, None the SMs; on the
    # edge problems also 3, so that every CTA walks several items)
    modes = (0, None, 3) if edge else (0, None)
    runs = [(c, n) for c in cands for n in (modes if a.persistent else (0,))]
    names = [f"mosaic {c.block_k}/{c.num_stages}/{c.num_splits}"
             + ("" if n == 0 else " p" if n is None else f" p{n}") for c, n in runs]
    if page:
      kpg, vpg, table = make_pages(k, v, page, kp)
      args = (q, kpg, vpg, lens, table)
      fns = [lambda q, kp_, vp_, l, bt, c=c, n=n: km.decode_attention(
          q, kp_, vp_, config=c, kv_lengths=l, block_tables=bt, persistent=n != 0, num_sms=n)
             for c, n in runs]

      # The family's platform backends on the pages: XLA on the gathered
      # pages, cuDNN's paged attention (JAX's wrapper; one query).
      pp = dataclasses.replace(p, page_size=page)
      names += ["xla", "cudnn"]
      fns += [DECODE.build(pp, XlaDecodeConfig()),
              DECODE.build(pp, CudnnDecodeConfig() if t == 1 else XlaDecodeConfig())]
    else:
      args = (q, k, v, lens)
      fns = [lambda q, k_, v_, l, c=c, n=n: km.decode_attention(
          q, k_, v_, config=c, kv_lengths=l, persistent=n != 0, num_sms=n) for c, n in runs]
      names += ["xla", "cudnn"]
      fns += [lambda q, k_, v_, l: library_attention(p, "xla", q, k_, v_, l, safe=True),
              lambda q, k_, v_, l: library_attention(p, "cudnn" if t == 1 else "xla",
                                                     q, k_, v_, l)]
      try:
        from wavetune_jax.families.decode.triton import TritonDecode
        tc = TritonDecode().heuristic(p, hw)
        from pallas_kernels.decode.triton import decode_attention as tdec
        names.append("triton")
        fns.append(lambda q, k_, v_, l, tc=tc: tdec(q, k_, v_, config=tc, kv_lengths=l))
      except Exception as e:  # noqa: BLE001 (Triton may be gone)
        print(f"  triton: {e}")
    res = prof.measure_many(fns, args, reference=ref, tolerance=1e-2, out_bytes=ref.size * 4)
    tm = {}
    for n, m in zip(names, res):
      if m.status == "ok":
        tm[n] = m.median_us
      else:
        print(f"  {n}: {m.status}: {(m.error or '')[:300]}", flush=True)
    mos = {n: x for n, x in tm.items() if n.startswith("mosaic")}
    plat = min((tm[n] for n in ("xla", "cudnn") if n in tm), default=None)
    best_n = min(mos, key=mos.get) if mos else None
    nbytes = float(2 * int(jnp.sum(jnp.clip(lens, 0, s))) * hkv * d * 2 + 2 * q.size * 2)
    row = dict(problem=[hq, hkv, b, s, t, d], mix=mix, page=page, times=tm, best=best_n,
               platform_us=plat, bytes=nbytes, device=dev.device_kind)
    if best_n and plat:
      r = plat / mos[best_n]
      bw = nbytes / (mos[best_n] * 1e-6)
      row.update(ratio=r, bw=bw)
      if not edge:
        ratios.append(r)
      print(f"h{hq}/{hkv} b{b} kv{s} q{t} d{d} {mix:<6} page {page:<3} best {best_n} "
            f"{mos[best_n]:.1f} us  platform {plat:.1f} (xla {tm.get('xla', 0):.1f} cudnn "
            f"{tm.get('cudnn', 0):.1f} triton {tm.get('triton', 0):.1f})  {r:.3f}x  "
            f"{bw / 1e12:.2f} TB/s = {bw / bw_copy:.0%} of copy"
            + (f", {bw / peak:.0%} of peak" if peak else ""), flush=True)
      if not edge:
        print("  " + " ".join(f"{n[len('mosaic '):]}={x:.1f}" for n, x in sorted(mos.items())))
    rows.append(row)
    if a.json:  # after every row: a run cut short keeps what it measured
      with open(a.json, "w") as f:
        json.dump({"device": dev.device_kind, "jax": jax.__version__, "copy_bw": bw_copy,
                   "rows": rows}, f, indent=1)
    if best_n and mix == "spread" and page in (0, pages[0] if pages else 0):
      # NaN in K and Inf in V past every length must not reach the output.
      c, n = runs[names.index(best_n)]
      past = jnp.arange(s)[None, :, None, None] >= lens[:, None, None, None]
      kn = jnp.where(past, jnp.nan, k).astype(k.dtype)
      vn = jnp.where(past, jnp.inf, v).astype(v.dtype)
      if page:
        kn, vn, table = make_pages(kn, vn, page, kp)
        out = km.decode_attention(q, kn, vn, config=c, kv_lengths=lens, block_tables=table,
                                  persistent=n != 0, num_sms=n)
      else:
        out = km.decode_attention(q, kn, vn, config=c, kv_lengths=lens, persistent=n != 0,
                                  num_sms=n)
      err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref)))
      row["nan_check_err"] = err
      print(f"  NaN/Inf past lengths: max |out - ref| = {err:.4f}", flush=True)
  if ratios:
    print(f"geomean best Mosaic vs faster platform op: {evaluate._geomean(ratios):.3f}x "
          f"over {len(ratios)}; min {min(ratios):.3f}x")


if __name__ == "__main__":
  sys.exit(main())
