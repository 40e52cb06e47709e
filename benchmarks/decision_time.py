"""Decision time of the selector on this CPU.

Medians (and p90) over many problems, in microseconds:
  * new weight: the first decision for a weight (N, K) it has not seen (its
    first size is decided alone; the second size of a block of 64 M buckets
    evaluates the block at once, NumPy);
  * cold: a new M of a weight already seen, no per-problem memo (what
    ``wavetune eval`` reports as cold);
  * memoized: ``wavetune_jax.select`` for a problem decided before (mean
    per call over batches of 100 calls; median and p90 over batches);
  * attention, new shape: the first decision for attention shapes outside
    the suite (heads, batch, head_dim, length), the same GPU's table;
  * with ``--processes N``, in milliseconds: the first GEMM and attention
    decisions of N fresh processes (after ``import wavetune_jax``), table
    loading included, as the first wavetune call of a program pays them
    (the shipped tables of ``--device``, not ``--table``), and how many
    tables each read from the parsed-table cache (``WAVETUNE_TABLE_CACHE=off``
    times parsing).

  python3 benchmarks/decision_time.py [--table tables/nvidia_h200/matmul.json] [--processes 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time

from wavetune_jax import ATTENTION, MATMUL, AttentionProblem, MatmulProblem, get_hardware, shapes
from wavetune_jax.families.matmul import gemm_weights
from wavetune_jax.runtime import selector, tables


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--table", default="tables/nvidia_h200/matmul.json")
  ap.add_argument("--device", default="h200")
  ap.add_argument("--n", type=int, default=2000,
                  help="problems per measurement (at least 100)")
  ap.add_argument("--processes", type=int, default=0,
                  help="also time the first decisions of this many fresh processes "
                       "(with the shipped tables of --device)")
  a = ap.parse_args(argv)
  if a.n < 100:
    ap.error(f"--n {a.n}: the memoized time is a mean over batches of 100; give at least 100")
  hw = get_hardware(a.device)
  table = tables.load(a.table, MATMUL, hw)
  weights = list(gemm_weights(shapes.load_suite("train")).values())
  rng = random.Random(0)
  paused = tables.gc_paused
  ns = lambda: time.perf_counter_ns()  # noqa: E731

  new_w = []
  for i in range(40):  # unseen weights: perturbed suite weights
    n, k = weights[i % len(weights)]
    d = selector.Decider(table, hw)
    p = MatmulProblem(m=rng.randint(1, 1024), n=n + 64 * (i + 1), k=k)
    with paused():  # as select() decides
      t0 = ns(); d.decide(p); new_w.append((ns() - t0) / 1e3)

  d = selector.Decider(table, hw)
  for n, k in weights:  # warm the blocks of M <= 1024 (16 x 64)
    d.decide(MatmulProblem(m=1, n=n, k=k))
  probs = [MatmulProblem(m=rng.randint(1, 1024), n=n, k=k)
           for n, k in (rng.choice(weights) for _ in range(a.n))]
  cold = []
  for p in probs:
    with paused():
      t0 = ns(); d.decide(p); cold.append((ns() - t0) / 1e3)

  selector.clear()
  with selector.use_tables(table, MATMUL):
    for p in probs:
      selector.select(MATMUL, p, hw)
    # Batches of 100 calls: a per-call clock read costs about as much as a
    # memoized decision, so each sample is a batch's mean.
    # Equal problems built anew, as a trace builds one per call.
    fresh = [MatmulProblem(m=p.m, n=p.n, k=p.k) for p in probs]
    memo, sel = [], selector.select
    for i in range(0, len(fresh) - 99, 100):
      batch = fresh[i:i + 100]
      t0 = ns()
      for p in batch:
        sel(MATMUL, p, hw)
      memo.append((ns() - t0) / 1e3 / len(batch))
  # Attention: first decisions for head counts, batches, head_dims and
  # lengths outside the suite (the attention table of the same GPU).
  att_table = tables.load(a.table.replace("matmul.json", "attention.json"), ATTENTION, hw)
  att_new = []
  for _ in range(200):
    p = AttentionProblem(batch=rng.choice([1, 3, 5, 6, 12]), q_heads=rng.choice([12, 24, 28, 40]),
                         kv_heads=4, q_len=rng.randint(64, 16384),
                         head_dim=rng.choice([64, 96, 128, 256]))
    d = selector.Decider(att_table, hw)
    with paused():
      t0 = ns(); d.decide(p); att_new.append((ns() - t0) / 1e3)
  print(f"table {a.table} ({hw.name}), {len(table.entries)} variant models")
  print(f"{'decision':<34} {'median us':>10} {'p90 us':>8}")
  for name, xs in (("new weight (first size)", new_w),
                   ("cold (new M, weight seen)", cold), ("memoized select()", memo),
                   ("attention: new shape", att_new)):
    xs = sorted(xs)
    print(f"{name:<34} {statistics.median(xs):>10.2f} {xs[int(0.9 * len(xs))]:>8.2f}")
  if a.processes > 0:
    runs = [first_decisions(a.device) for _ in range(a.processes)]
    print(f"first decisions of a process, ms, {a.processes} fresh processes "
          f"({hw.device_key} tables):")
    for key in runs[0]:
      if key != "table cache hits":
        print(f"  {key:<40} " + " / ".join(f"{r[key]:.1f}" for r in runs))
    from wavetune_jax.runtime import table_cache
    where = table_cache.cache_dir()
    print(f"  parsed-table cache: {'off' if where is None else where}; tables read from it "
          f"per process: " + " / ".join(str(r["table cache hits"]) for r in runs))


# Run in a fresh interpreter: what a program's first wavetune calls pay.
_FIRST = """
import json, sys, time
import wavetune_jax as wt
from wavetune_jax import AttentionProblem, MatmulProblem
from wavetune_jax.runtime import selector
dev = sys.argv[1]
out = {}
t = time.perf_counter()
selector.select("matmul", MatmulProblem(m=777, n=6144, k=4096), dev)
out["GEMM: table load + first weight"] = time.perf_counter() - t
t = time.perf_counter()
selector.select("matmul", MatmulProblem(m=777, n=4096, k=14336), dev)
out["GEMM: second weight"] = time.perf_counter() - t
t = time.perf_counter()
selector.select("attention", AttentionProblem(batch=1, q_heads=32, kv_heads=8, q_len=777,
                                              head_dim=128), dev)
out["attention: table load + first shape"] = time.perf_counter() - t
out = {k: v * 1e3 for k, v in out.items()}
from wavetune_jax.runtime import table_cache
out["table cache hits"] = table_cache.stats()["hits"]
print(json.dumps(out))
"""


def first_decisions(device: str) -> dict:
  env = dict(os.environ)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  r = subprocess.run([sys.executable, "-c", _FIRST, device], capture_output=True, text=True,
                     env=env)
  if r.returncode != 0:
    raise SystemExit(f"decision_time.py: the fresh process failed:\n{r.stderr[-2000:]}")
  return json.loads(r.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
  main()
