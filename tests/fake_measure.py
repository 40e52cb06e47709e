"""A measuring function for sweep tests without a GPU: deterministic fake
times. Worker failures on demand (environment):

* WAVETUNE_TEST_DIE_ON=<problem key>: die once, mid-problem (a marker file,
  WAVETUNE_TEST_MARKER, makes it once);
* WAVETUNE_TEST_POISON=<problem key>: die on that problem's first config,
  every time;
* WAVETUNE_TEST_BROKEN=1: the worker cannot start.
"""

import os
import zlib

from wavetune_jax import get_hardware
from wavetune_jax.tuning.profiler import Measurement

HW = get_hardware("h100")


def factory(family, args):
  if os.environ.get("WAVETUNE_TEST_BROKEN"):
    raise RuntimeError("this worker cannot start")
  die_on = os.environ.get("WAVETUNE_TEST_DIE_ON")
  poison = os.environ.get("WAVETUNE_TEST_POISON")
  marker = os.environ.get("WAVETUNE_TEST_MARKER")

  def measure(problem, configs, with_baseline):
    pk = family.problem_key(problem)
    for i, c in enumerate(configs):
      if poison == pk and c == family.space(problem, HW)[0]:
        os._exit(4)
      if die_on == pk and i == 3 and marker and not os.path.exists(marker):
        open(marker, "w").close()
        os._exit(3)  # the worker dies with 3 rows of this problem sent (or batched)
      t = 10.0 + zlib.crc32(repr((pk, c)).encode()) % 1000 / 10
      yield "pallas", c, Measurement(status="ok", median_us=t, spread_us=0.1, samples=5)
    # with_baseline: True, or the baseline impls the sweep lacks
    for impl in (("baseline",) if with_baseline is True else with_baseline or ()):
      yield impl, None, Measurement(status="ok", median_us=50.0, samples=5)
  return measure
