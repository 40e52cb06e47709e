"""The parsed-table cache (``wavetune_jax.runtime.table_cache``)."""

import json
import os
import shutil
import subprocess
import sys
import textwrap
import warnings

import numpy as np
import pytest

from wavetune_jax import MATMUL, MatmulProblem, get_hardware
from wavetune_jax.runtime import selector, table_cache, tables

HW = get_hardware("h200")
SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                       "tables", "nvidia_h200", "matmul.json")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def cache(tmp_path):
  saved = dict(table_cache._state)
  table_cache.set_dir(tmp_path / "cache")
  table_cache._warned.clear()
  yield tmp_path / "cache"
  table_cache._state.update(saved)
  table_cache._warned.clear()


def _entries(d):
  return sorted(d.glob("*.table.pickle"))


def _problems():
  rng = np.random.default_rng(0)
  weights = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (1280, 8192)]
  return [MatmulProblem(m=int(rng.integers(1, 9000)), n=n, k=k)
          for n, k in weights for _ in range(8)]


def _decisions(table):
  d = selector.Decider(table, HW)
  return [d.decide(p) for p in _problems()]


def test_a_cached_table_is_the_table(tmp_path, cache):
  path = tmp_path / "matmul.json"
  shutil.copy(SHIPPED, path)
  before = table_cache.stats()
  parsed = tables.load(str(path), MATMUL, HW)
  assert len(_entries(cache)) == 1
  cached = tables.load(str(path), MATMUL, HW)
  after = table_cache.stats()
  assert (after["writes"] - before["writes"], after["hits"] - before["hits"]) == (1, 1)
  assert cached is not parsed and cached.family is MATMUL
  assert cached.entries == parsed.entries and cached.anchors == parsed.anchors
  assert cached.exact == parsed.exact and cached.exact
  # Exact entries answer fresh problem objects (their hashes are this process's).
  for p, hit in parsed.exact.items():
    fresh = MatmulProblem(m=p.m, n=p.n, k=p.k, dtype=p.dtype, out_dtype=p.out_dtype)
    assert cached.exact[fresh] == hit
  assert _decisions(cached) == _decisions(parsed)
  # An edited file is another entry; a load for another GPU too.
  d = json.loads(path.read_text())
  d["provenance"] = {**d["provenance"], "note": "edited"}
  path.write_text(json.dumps(d))
  tables.load(str(path), MATMUL, HW)
  assert len(_entries(cache)) == 2


def test_an_entry_read_in_another_process_keeps_exact_lookups(tmp_path, cache):
  # A str's hash differs between processes (PYTHONHASHSEED): a problem read
  # back from the cache must hash as this process hashes it.
  path = tmp_path / "matmul.json"
  shutil.copy(SHIPPED, path)
  tables.load(str(path), MATMUL, HW)
  script = textwrap.dedent(f"""
      from wavetune_jax import MATMUL, MatmulProblem, get_hardware
      from wavetune_jax.runtime import table_cache, tables
      table_cache.set_dir({str(cache)!r})
      t = tables.load({str(path)!r}, MATMUL, get_hardware("h200"))
      found = all(t.exact.get(MatmulProblem(m=p.m, n=p.n, k=p.k)) == hit
                  for p, hit in t.exact.items())
      print(table_cache.stats()["hits"], len(t.exact), found)
  """)
  env = dict(os.environ, PYTHONHASHSEED="12345", JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                     timeout=300)
  assert r.returncode == 0, r.stderr[-2000:]
  hits, n_exact, found = r.stdout.split()
  assert hits == "1" and int(n_exact) > 0 and found == "True"


def test_a_corrupt_entry_is_rebuilt_with_one_warning(tmp_path, cache):
  path = tmp_path / "matmul.json"
  shutil.copy(SHIPPED, path)
  parsed = tables.load(str(path), MATMUL, HW)
  (entry,) = _entries(cache)
  for bad in (b"", b"not a pickle", entry.read_bytes()[:100]):
    entry.write_bytes(bad)
    table_cache._warned.clear()
    with pytest.warns(UserWarning, match="table cache entry .* is corrupt"):
      again = tables.load(str(path), MATMUL, HW)
    assert again.exact == parsed.exact
    assert len(entry.read_bytes()) > 100  # rewritten
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert tables.load(str(path), MATMUL, HW).entries == parsed.entries


def test_an_unwritable_folder_warns_once_and_loads(tmp_path, cache):
  blocker = tmp_path / "file"
  blocker.write_text("")
  table_cache.set_dir(blocker / "cache")  # a folder under a file: cannot be made
  with pytest.warns(UserWarning, match="cannot write the table cache"):
    t = tables.load(SHIPPED, MATMUL, HW)
  assert t.exact
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    tables.load(SHIPPED, MATMUL, HW)  # warned once


def test_the_cache_can_be_turned_off(tmp_path, cache, monkeypatch):
  table_cache.set_dir(None)
  tables.load(SHIPPED, MATMUL, HW)
  assert not cache.exists()
  table_cache._state["set"] = False
  for off in ("off", "0", ""):
    monkeypatch.setenv("WAVETUNE_TABLE_CACHE", off)
    assert table_cache.cache_dir() is None
  monkeypatch.setenv("WAVETUNE_TABLE_CACHE", str(tmp_path / "x"))
  assert table_cache.cache_dir() == tmp_path / "x"
  monkeypatch.delenv("WAVETUNE_TABLE_CACHE")
  # Otherwise: inside JAX's compilation cache folder, if the program set one.
  import jax
  saved = jax.config.jax_compilation_cache_dir
  try:
    jax.config.update("jax_compilation_cache_dir", None)
    assert table_cache.cache_dir() is None
    jax.config.update("jax_compilation_cache_dir", str(tmp_path / "jax"))
    assert table_cache.cache_dir() == tmp_path / "jax" / "wavetune_tables"
  finally:
    jax.config.update("jax_compilation_cache_dir", saved)


def test_load_errors_are_the_same_with_the_cache(tmp_path, cache):
  bad = tmp_path / "t.json"
  bad.write_text("{not json")
  with pytest.raises(tables.TableError, match="not readable JSON"):
    tables.load(str(bad), MATMUL, HW)
  with pytest.raises(tables.TableError, match="no table at"):
    tables.load(str(tmp_path / "missing.json"), MATMUL, HW)
  d = json.loads(open(SHIPPED).read())
  bad.write_text(json.dumps({**d, "device_key": "nvidia_a100"}))
  with pytest.raises(tables.TableError, match="is for 'nvidia_a100"):
    tables.load(str(bad), MATMUL, HW)
  assert not _entries(cache)  # nothing stored for a table that failed


def test_decisions_are_kept_for_the_next_process(tmp_path, cache):
  # A process's decisions go into the table's entry at exit; the next process
  # answers them from there without deciding (its Decider would raise).
  path = tmp_path / "matmul.json"
  shutil.copy(SHIPPED, path)
  common = f"""
import json
from wavetune_jax import MATMUL, MatmulProblem, get_hardware
from wavetune_jax.runtime import selector, table_cache, tables
table_cache.set_dir({str(cache)!r})
hw = get_hardware("h200")
selector.load_tables({str(path)!r}, "matmul", hw=hw)
problems = [MatmulProblem(m=m, n=n, k=k) for m in (1, 300, 777, 5000)
            for n, k in ((6144, 4096), (4096, 14336), (1280, 8192))]
"""
  first = common + """
print(json.dumps([repr(selector.select("matmul", p, hw)) for p in problems]))
"""
  second = common + """
def refuse(self, problem):
  raise AssertionError("decided again")
selector.Decider.decide = refuse
print(json.dumps([repr(selector.select("matmul", p, hw)) for p in problems]))
try:
  selector.select("matmul", MatmulProblem(m=123, n=6144, k=4096), hw)
except AssertionError:
  print("new problems are decided")
"""
  outs = []
  for script in (first, second):
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    outs.append(r.stdout.splitlines())
  assert json.loads(outs[0][0]) == json.loads(outs[1][0])
  assert outs[1][1] == "new problems are decided"
