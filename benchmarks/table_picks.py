"""What a GPU's shipped tables change: the training suite's problems whose
pick (``wt.select`` under the ``tables`` policy) differs with and without the
family's table. CPU only: nothing is timed.

    python3 benchmarks/table_picks.py --device-key nvidia_h200 --families qmatmul,qragged_dot
"""

from __future__ import annotations

import argparse
import warnings

import wavetune_jax as wt
from wavetune_jax.core.registry import registered
from wavetune_jax.runtime.selector import active_table
from wavetune_jax.shapes import load_suite


def changed_picks(family: str, device_key: str) -> tuple[list[tuple], int]:
  """``([(problem key, pick without the table, pick with it), ...], problems)``
  over the training suite's problems of ``family`` on ``device_key``."""
  spec = wt.get_family(family)
  problems = spec.problems_from_suite(load_suite("train"))
  out = []
  with wt.policy("tables"), warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    with_table = [wt.select(family, p, device_key) for p in problems]
    with wt.use_tables(None, family):
      without = [wt.select(family, p, device_key) for p in problems]
  for p, a, b in zip(problems, without, with_table):
    if a.config != b.config:
      out.append((spec.problem_key(p), f"{a.config!r} [{a.source}]",
                  f"{b.config!r} [{b.source}]"))
  return out, len(problems)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--device-key", required=True, help="e.g. nvidia_h200")
  ap.add_argument("--families", default="qmatmul,qragged_dot",
                  help="comma-separated family names (default: qmatmul,qragged_dot)")
  a = ap.parse_args(argv)
  fams = [f.strip() for f in a.families.split(",") if f.strip()]
  bad = sorted(set(fams) - set(registered()))
  if bad or not fams:
    ap.error(f"--families: unknown {bad}; choose from {','.join(registered())}")
  missing = [f for f in fams if active_table(f, a.device_key) is None]
  if missing:
    ap.error(f"no table of {','.join(missing)} for {a.device_key!r}")
  for fam in fams:
    rows, n = changed_picks(fam, a.device_key)
    for key, before, after in rows:
      print(f"{fam:<12}{key}\n    without: {before}\n    with:    {after}")
    print(f"{fam}: {len(rows)} of {n} picks changed by the table")
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
