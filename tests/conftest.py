import gc
import os
import sys
import tempfile

import pytest

# Tests run on the CPU: Pallas kernels in interpret mode.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The parsed-table cache is off unless a test turns it on (tests/test_table_cache.py):
# tests load tables they edit and check what parsing does.
os.environ.setdefault("WAVETUNE_TABLE_CACHE", "off")
# The ops read tables from the user's table folder (what `wavetune tune` writes)
# before the shipped ones: tests see the shipped tables only, whatever this
# machine's user has tuned.
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="wavetune-tests-")
os.environ.pop("WAVETUNE_TABLES", None)


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_code():
  """Drops JAX's compiled executables after each test module: kept, they
  add up to gigabytes over the suite (each module compiles its own shapes)."""
  yield
  jax = sys.modules.get("jax")
  if jax is not None:
    jax.clear_caches()
    gc.collect()
