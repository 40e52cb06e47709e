"""A measuring function for sweep tests without a GPU: deterministic fake
times; the worker of a multi-device sweep dies once, mid-problem, on the
problem named by WAVETUNE_TEST_DIE_ON (a marker file makes it once)."""

import os
import zlib

from wavetune_jax.tuning.profiler import Measurement


def factory(family, args):
  die_on = os.environ.get("WAVETUNE_TEST_DIE_ON")
  marker = os.environ.get("WAVETUNE_TEST_MARKER")

  def measure(problem, configs, with_baseline):
    pk = family.problem_key(problem)
    for i, c in enumerate(configs):
      if die_on == pk and i == 3 and marker and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(3)  # the worker dies with 3 rows of this problem sent (or batched)
      t = 10.0 + zlib.crc32(repr((pk, c)).encode()) % 1000 / 10
      yield "pallas", c, Measurement(status="ok", median_us=t, spread_us=0.1, samples=5)
    if with_baseline:
      yield "baseline", None, Measurement(status="ok", median_us=50.0, samples=5)
  return measure
