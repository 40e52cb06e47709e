"""Per config field and value: speed of the best config with that value over the best
config overall, from a matmul_space.py result file (CPU). Reproduces the numbers
behind pruning rules R5-R7 in wavetune_jax/families/matmul/triton.py:

  python3 benchmarks/pruning_evidence.py data/probes/space_gate_up_h200_r1r4.json
"""

import argparse
import json


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("result")
  a = ap.parse_args(argv)
  with open(a.result) as f:
    d = json.load(f)
  for r in d["results"]:
    ok = [x for x in r["rows"] if x["status"] == "ok"]
    best = min(x["median_us"] for x in ok)
    cells = []
    # Every field but the backend (files written since configs name it hold
    # "backend": "triton" on every row).
    for field in (f for f in ok[0]["config"] if f != "backend"):
      for v in sorted({x["config"][field] for x in ok}):
        t = min(x["median_us"] for x in ok if x["config"][field] == v)
        cells.append(f"{field}={v}: {best / t:.2f}")
    print(f"M={r['problem']['m']} ({d['device']}): " + ", ".join(cells))


if __name__ == "__main__":
  main()
