import gc
import os
import sys
import tempfile

import pytest

# Tests run on the CPU: Pallas kernels in interpret mode.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's CPU code generation without LLVM's optimizations, and with its older
# loop emitters for fusions: the tests compile hundreds of small programs
# (Pallas kernels in interpret mode among them) and run each a few times on
# tiny shapes, so compiling is most of their time (a module of paged-decode
# tests: 62 s -> 39 s without LLVM's optimizations; the decode-options
# checks 9.3 s -> 6.5 s without the fusion emitters).
# (XLA stops at a flag it does not know, so the second is given only to the
# jaxlib it was checked with.)


def _jaxlib_minor() -> tuple[int, ...]:
  from importlib import metadata
  try:
    return tuple(int(x) for x in metadata.version("jaxlib").split(".")[:2])
  except (metadata.PackageNotFoundError, ValueError):
    return ()


TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0",) + (
    ("--xla_cpu_use_fusion_emitters=false",) if _jaxlib_minor() == (0, 10) else ())
for _flag in TEST_XLA_FLAGS:
  if _flag.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _flag).strip()
# The parsed-table cache is off unless a test turns it on (tests/test_table_cache.py):
# tests load tables they edit and check what parsing does.
os.environ.setdefault("WAVETUNE_TABLE_CACHE", "off")
# The ops read tables from the user's table folder (what `wavetune tune` writes)
# before the shipped ones: tests see the shipped tables only, whatever this
# machine's user has tuned.
os.environ["XDG_DATA_HOME"] = tempfile.mkdtemp(prefix="wavetune-tests-")
os.environ.pop("WAVETUNE_TABLES", None)


def _free():
  jax = sys.modules.get("jax")
  if jax is not None:
    jax.clear_caches()
  gc.collect()
  try:  # hand freed heap pages back to the system (glibc)
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)
  except (OSError, AttributeError):
    pass


def _rss_bytes() -> int:
  try:
    with open("/proc/self/statm") as f:
      return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
  except (OSError, ValueError, IndexError):
    return 0


#: A test that leaves the process above this much resident memory frees
#: JAX's compiled executables after it (the suite runs in two processes on
#: two cores; each stays near this bound).
RSS_LIMIT = 1536 << 20
#: After a module, the process frees compiled executables above this much.
MODULE_RSS_LIMIT = 1024 << 20


#: The longest modules (seconds on a 2-core CPU), run first: with the
#: suite spread over two processes by module (``-n 2 --dist loadfile``), a
#: long module handed out last would leave one core idle at the end.
LONG_MODULES = ("test_bad_inputs", "test_ragged_dot", "test_op_edge_cases",
                "test_quantized_matmul", "test_decode_options", "test_tuning",
                "test_table_cache", "test_decode_paged", "test_models", "test_autotune",
                "test_tune_safety", "test_readme", "test_matmul_backends", "test_sharding",
                "test_fp8_ragged_dot", "test_models_paged", "test_attention_kv_cache")


def pytest_collection_modifyitems(items):
  rank = {name: i for i, name in enumerate(LONG_MODULES)}

  def key(item):
    mod = item.nodeid.split("::", 1)[0].rsplit("/", 1)[-1].removesuffix(".py")
    return rank.get(mod, len(rank))
  items.sort(key=key)  # stable: the order within a module is kept


@pytest.fixture(autouse=True, scope="module")
def _free_compiled_code():
  """Drops JAX's compiled executables after a test module that leaves the
  process above :data:`MODULE_RSS_LIMIT`: kept, they add up to gigabytes
  over the suite (each module compiles its own shapes). Below it the
  collection is skipped (0.3-2 s a module)."""
  yield
  if _rss_bytes() > MODULE_RSS_LIMIT:
    _free()


@pytest.fixture(autouse=True)
def _bound_memory():
  """Frees compiled executables after a test that leaves the process above
  :data:`RSS_LIMIT` (one module's shapes can pass it)."""
  yield
  if _rss_bytes() > RSS_LIMIT:
    _free()
