"""The on-disk cache of lowered Pallas kernels (``wavetune_jax.core.kernel_cache``)."""

import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wavetune_jax as wt
from wavetune_jax.core import kernel_cache
from wavetune_jax.families.matmul.triton import TritonMatmul

pytest.importorskip("flatbuffers")

CFG = {"backend": "triton", "block_m": 32, "block_n": 64, "block_k": 32, "split_k": 1,
       "group_m": 8, "num_warps": 4, "num_stages": 2}


@pytest.fixture
def cache(tmp_path):
  saved = dict(kernel_cache._state)
  kernel_cache.set_dir(tmp_path)
  kernel_cache.clear_memory()
  yield tmp_path
  kernel_cache._state.update(saved)
  kernel_cache.clear_memory()


def _files(path):
  return sorted(p for p in path.rglob("*.jaxexport"))


def _operands(m=64, k=256, n=128, seed=0):
  kx, kw = jax.random.split(jax.random.key(seed))
  return (jax.random.normal(kx, (m, k), jnp.float32).astype(jnp.bfloat16),
          jax.random.normal(kw, (k, n), jnp.float32).astype(jnp.bfloat16))


def _run(x, w, cfg=CFG):
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    return np.asarray(jax.jit(lambda a, b: wt.matmul(a, b, config=cfg))(x, w), np.float32)


def _forget():
  kernel_cache.clear_memory()
  jax.clear_caches()


def test_second_use_skips_the_kernel_trace(cache, monkeypatch):
  x, w = _operands()
  before = kernel_cache.stats()
  y = _run(x, w)
  assert kernel_cache.stats()["misses"] == before["misses"] + 1
  assert len(_files(cache)) == 1
  ref = np.asarray(jnp.dot(x, w, preferred_element_type=jnp.float32))
  np.testing.assert_allclose(y, ref, rtol=2e-2, atol=2e-2)

  _forget()

  def boom(*a, **k):
    raise AssertionError("the kernel was traced again")
  monkeypatch.setattr(TritonMatmul, "run", boom)
  y2 = _run(x, w)
  assert kernel_cache.stats()["loads"] == before["loads"] + 1
  np.testing.assert_array_equal(y2, y)


def test_keys_separate_configs_and_shapes(cache):
  x, w = _operands()
  _run(x, w)
  _run(x, w, dict(CFG, num_stages=3))
  _run(*_operands(m=48))
  assert len(_files(cache)) == 3
  _run(x, w)  # same call again: no new file
  assert len(_files(cache)) == 3


def test_corrupt_file_is_replaced_with_a_warning(cache):
  x, w = _operands()
  y = _run(x, w)
  (f,) = _files(cache)
  f.write_bytes(f.read_bytes()[:100])  # truncated
  _forget()
  errors = kernel_cache.stats()["errors"]
  kernel_cache._warned.discard("read")
  with pytest.warns(UserWarning, match="could not read"):
    y2 = jax.jit(lambda a, b: wt.matmul(a, b, config=CFG))(x, w)
  np.testing.assert_array_equal(np.asarray(y2, np.float32), y)
  assert kernel_cache.stats()["errors"] == errors + 1
  _forget()
  loads = kernel_cache.stats()["loads"]
  _run(x, w)  # the replaced file reads back
  assert kernel_cache.stats()["loads"] == loads + 1


def test_library_backends_are_not_cached(cache):
  x, w = _operands()
  _run(x, w, {"backend": "xla"})
  assert _files(cache) == []


def test_off_writes_nothing(cache):
  kernel_cache.set_dir(None)
  x, w = _operands()
  _run(x, w)
  assert _files(cache) == []


def test_where_it_lives(tmp_path, monkeypatch):
  saved = dict(kernel_cache._state)
  try:
    kernel_cache._state.update(dir=None, set=False)
    monkeypatch.setenv("WAVETUNE_KERNEL_CACHE", str(tmp_path / "k"))
    assert kernel_cache.cache_dir() == tmp_path / "k"
    monkeypatch.setenv("WAVETUNE_KERNEL_CACHE", "off")
    assert kernel_cache.cache_dir() is None
    monkeypatch.delenv("WAVETUNE_KERNEL_CACHE")
    old = jax.config.jax_compilation_cache_dir
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
    try:  # opt-in: JAX's cache alone does not turn it on (nothing compiles here)
      assert kernel_cache.cache_dir() is None
    finally:
      jax.config.update("jax_compilation_cache_dir", old)
  finally:
    kernel_cache._state.update(saved)


def test_a_second_process_loads_instead_of_lowering(tmp_path):
  script = textwrap.dedent("""
      import warnings; warnings.simplefilter("ignore")
      import jax, jax.numpy as jnp, numpy as np
      import wavetune_jax as wt
      from wavetune_jax.core import kernel_cache
      x = jnp.arange(64 * 128, dtype=jnp.float32).reshape(64, 128).astype(jnp.bfloat16) / 997
      w = jnp.ones((128, 64), jnp.bfloat16)
      cfg = {"backend": "triton", "block_m": 32, "block_n": 32, "block_k": 32,
             "split_k": 1, "group_m": 8, "num_warps": 4, "num_stages": 2}
      y = jax.jit(lambda a, b: wt.matmul(a, b, config=cfg))(x, w)
      s = kernel_cache.stats()
      print(s["misses"], s["loads"], float(np.asarray(y, np.float32).sum()))
  """)
  env = dict(os.environ, WAVETUNE_KERNEL_CACHE=str(tmp_path), JAX_PLATFORMS="cpu")
  outs = [subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, check=True).stdout.split() for _ in range(2)]
  assert outs[0][:2] == ["1", "0"]
  assert outs[1][:2] == ["0", "1"]
  assert outs[0][2] == outs[1][2]


@pytest.mark.parametrize("outer_jit", [False, True])
def test_vmap_of_a_cached_kernel(cache, outer_jit):
  # jax.vmap has no rule for a call of an exported module: the cache batches
  # the kernel itself (a batched Pallas grid) instead of failing.
  x, w = _operands(m=32, k=128, n=64)
  xs = jnp.stack([x, 2 * x, -x])
  f = jax.vmap(lambda a: wt.matmul(a, w, config=CFG))
  f = jax.jit(f) if outer_jit else f
  wt.matmul(x, w, config=CFG)  # exported and kept in memory first
  errors = kernel_cache.stats()["errors"]
  out = f(xs)
  ref = jnp.einsum("bmk,kn->bmn", xs.astype(jnp.float32), w.astype(jnp.float32))
  np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(ref), rtol=2e-2, atol=2e-2)
  assert kernel_cache.stats()["errors"] == errors


def test_a_loaded_mosaic_kernel_imports_mosaic_gpus_runtime_first(tmp_path):
  """A process that only loads a Mosaic kernel from the cache imports
  ``jax.experimental.mosaic.gpu`` before calling it (the import tells
  Mosaic GPU's custom call where its host runtime library is; without it a
  second process on a GPU failed with "Failed to lookup host symbol");
  other backends' kernels do not. Here a stand-in function is cached under
  each backend's name, in a fresh process each time."""
  script = textwrap.dedent("""
      import sys, warnings; warnings.simplefilter("ignore")
      import jax, jax.numpy as jnp
      from wavetune_jax.core import kernel_cache
      backend = sys.argv[1]
      x = jnp.arange(8.0)
      before = "jax.experimental.mosaic.gpu" in sys.modules
      y = kernel_cache.call(lambda a: a * 2, [x], parts={"family": "t", "backend": backend})
      after = "jax.experimental.mosaic.gpu" in sys.modules
      print(before, after, float(y.sum()), kernel_cache.stats()["loads"])
  """)
  env = dict(os.environ, WAVETUNE_KERNEL_CACHE=str(tmp_path), JAX_PLATFORMS="cpu")
  out = {}
  for backend in ("mosaic", "triton"):
    out[backend] = [subprocess.run([sys.executable, "-c", script, backend], env=env,
                                   capture_output=True, text=True, check=True).stdout.split()
                    for _ in range(2)]
  # First process: exported (nothing loaded); second: loaded from the file.
  assert [o[3] for o in out["mosaic"]] == ["0", "1"] == [o[3] for o in out["triton"]]
  assert all(o[0] == "False" and o[2] == "56.0" for b in out for o in out[b])
  assert [o[1] for o in out["mosaic"]] == ["True", "True"]
  assert [o[1] for o in out["triton"]] == ["False", "False"]
