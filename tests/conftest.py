import os

# Tests run on the CPU: Pallas kernels in interpret mode.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The parsed-table cache is off unless a test turns it on (tests/test_table_cache.py):
# tests load tables they edit and check what parsing does.
os.environ.setdefault("WAVETUNE_TABLE_CACHE", "off")
