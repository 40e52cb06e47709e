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
  return sorted(d.glob("*.table.json"))


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


# --- poisoned entries ---------------------------------------------------------------------

_ASKED = [MatmulProblem(m=m, n=n, k=k) for m in (1, 64, 300, 777, 4096)
          for n, k in ((6144, 4096), (4096, 14336), (1280, 8192))]


def _answers(table):
  """What the selector answers from ``table`` for ``_ASKED`` (its record included)."""
  selector.clear()
  with selector.use_tables(table, MATMUL):
    out = [selector.select(MATMUL, p, HW) for p in _ASKED]
  selector._dirty.clear()  # (the tests store what they mean to)
  return out


_ENTRY = {}   # the entry built once: (answers without a cache, entry name, its bytes)


@pytest.fixture
def entry(tmp_path, cache):
  """``(table file, entry file, answers without a cache)``: an entry whose
  table has decided ``_ASKED`` (its record stored). Built by the first test
  that asks; the others get a copy of its file (the entry's name is a hash
  of the table's bytes, so it is the same in every folder)."""
  path = tmp_path / "matmul.json"
  shutil.copy(SHIPPED, path)
  if not _ENTRY:
    table_cache.set_dir(None)
    plain = _answers(tables.load(str(path), MATMUL, HW))
    table_cache.set_dir(cache)
    t = tables.load(str(path), MATMUL, HW)
    assert _answers(t) == plain
    tables.store_in_cache(t)
    (f,) = _entries(cache)
    state = json.loads(f.read_text())
    assert len(state["decided"]["problem"]) == len(_ASKED)
    assert set(state["decided"]["source"]) >= {"exact", "heuristic"}
    _ENTRY.update(plain=plain, name=f.name, data=f.read_bytes())
  cache.mkdir(parents=True, exist_ok=True)
  for old in _entries(cache):
    old.unlink()
  f = cache / _ENTRY["name"]
  f.write_bytes(_ENTRY["data"])
  yield path, f, _ENTRY["plain"]
  selector.clear()


def _poison(edit):
  def write(f):
    state = json.loads(f.read_text())
    edit(state)
    f.write_text(json.dumps(state))
  return write


def _raw(data):
  return lambda f: f.write_bytes(data)


def _first(state, backend):
  return next(i for i, c in enumerate(state["configs"]) if c["backend"] == backend)


POISONS = {
    "a list, not an object": _raw(b"[1, {}]"),
    "an object without the fields": _raw(b'{"format": "wavetune-table-cache", "version": 2}'),
    "another format version": _poison(lambda s: s.update(version=1)),
    "another format": _poison(lambda s: s.update(format="wavetune-table")),
    "an extra key": _poison(lambda s: s.update(extra=[])),
    "decisions are strings": _poison(lambda s: s.update(decided="XlaMatmulConfig()")),
    "decided configs are strings": _poison(lambda s: s["decided"].update(
        config=[repr(c) for c in s["configs"][:1]] * len(s["decided"]["config"]))),
    "a decided source unknown": _poison(lambda s: s["decided"]["source"].__setitem__(0, "x")),
    "an exact decision that is not the exact answer": _poison(
        lambda s: s["decided"]["source"].__setitem__(s["decided"]["source"].index("heuristic"),
                                                     "exact")),
    "waves of 0": _poison(lambda s: s["decided"]["waves"].__setitem__(0, 0)),
    "a decided note index out of range": _poison(
        lambda s: s["decided"]["note"].__setitem__(0, 99)),
    "a config with an unknown field": _poison(lambda s: s["configs"][0].update(bogus=1)),
    "a config without its backend": _poison(lambda s: s["configs"][0].pop("backend")),
    "a config of an unknown backend": _poison(lambda s: s["configs"][0].update(backend="cuda")),
    "a config field a string": _poison(
        lambda s: s["configs"][_first(s, "triton")].update(block_m="64")),
    "a problem field missing": _poison(lambda s: s["problems"][0].pop()),
    "a problem field a list": _poison(lambda s: s["problems"][0].__setitem__(0, [1])),
    "a problem that is invalid": _poison(lambda s: s["problems"][0].__setitem__(0, -5)),
    "an index out of range": _poison(lambda s: s["exact"]["config"].__setitem__(0, 10 ** 6)),
    "an index that is a bool": _poison(lambda s: s["exact"]["problem"].__setitem__(0, True)),
    "an anchor coordinate short": _poison(lambda s: s["anchors"]["log_g"].pop()),
    "a time column short": _poison(lambda s: s["anchors"]["us"].pop()),
    "a coefficient short": _poison(lambda s: s["model"]["coef"][0].pop()),
    "an aux flag an int": _poison(lambda s: s["model"]["aux_seen"][0].__setitem__(0, 1)),
    "a model column short": _poison(lambda s: s["model"]["min_g"].pop()),
    "a negative coefficient": _poison(lambda s: s["model"]["coef"][0].__setitem__(0, -1.0)),
    "a NaN bound": _poison(lambda s: s["model"]["min_l"].__setitem__(0, float("nan"))),
    "an infinite time": _poison(lambda s: s["exact"]["us"].__setitem__(0, float("inf"))),
    "a time of 0": _poison(lambda s: s["exact"]["us"].__setitem__(0, 0.0)),
    "trust below 1": _poison(lambda s: s["table"].update(trust=0.5)),
    "another family": _poison(lambda s: s.update(family="attention")),
    "another GPU": _poison(lambda s: s["table"].update(device_key="nvidia_a100")),
    "hardware with a string SM count": _poison(lambda s: s["hardware"][0].update(num_sms="132")),
    "an exact answer twice": _poison(lambda s: [s["exact"][c].append(s["exact"][c][0])
                                                for c in ("problem", "config", "us")]),
    "truncated": lambda f: f.write_bytes(f.read_bytes()[:len(f.read_bytes()) // 2]),
    "empty": _raw(b""),
}


@pytest.mark.parametrize("poison", sorted(POISONS))
def test_a_poisoned_entry_is_rebuilt_with_one_warning(entry, poison):
  path, f, plain = entry
  POISONS[poison](f)
  before = table_cache.stats()
  with warnings.catch_warnings(record=True) as seen:
    warnings.simplefilter("always")
    t = tables.load(str(path), MATMUL, HW)
    tables.load(str(path), MATMUL, HW)  # (a second bad read would not warn again)
  msgs = [str(w.message) for w in seen if "table cache" in str(w.message)]
  assert len(msgs) == 1 and "is corrupt" in msgs[0], msgs
  after = table_cache.stats()
  assert after["errors"] - before["errors"] == 1
  assert after["hits"] - before["hits"] == 1  # the second load: the rebuilt entry
  assert t.__dict__.get("_decided", {}) == {}  # rebuilt from the table file
  assert _answers(t) == plain
  # The entry was rewritten: it loads again, without a warning.
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    again = tables.load(str(path), MATMUL, HW)
  assert again.exact == t.exact and again.entries == t.entries


def test_a_big_number_is_not_taken_for_a_finite_one(entry):
  # JSON has no inf, but 1e999 reads as one.
  path, f, plain = entry
  state = json.loads(f.read_text())
  state["anchors"]["us"][3] = 123456.5
  f.write_text(json.dumps(state).replace("123456.5", "1e999"))
  with pytest.warns(UserWarning, match="is corrupt .*finite positive"):
    t = tables.load(str(path), MATMUL, HW)
  assert _answers(t) == plain


class _Payload:
  def __init__(self, marker):
    self.marker = marker

  def __reduce__(self):
    return os.makedirs, (self.marker,)


def test_a_pickle_is_never_loaded(entry, tmp_path):
  import pickle
  path, f, plain = entry
  marker = str(tmp_path / "ran")
  payload = pickle.dumps(_Payload(marker))
  # Under the name entries had when they were pickles: never read, no warning.
  old = f.with_name(f.name.replace(".table.json", ".table.pickle"))
  old.write_bytes(payload)
  f.unlink()
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    t = tables.load(str(path), MATMUL, HW)
  assert f.exists() and _answers(t) == plain
  # Under the new name: a corrupt entry, rebuilt.
  f.write_bytes(payload)
  with pytest.warns(UserWarning, match="is corrupt"):
    t = tables.load(str(path), MATMUL, HW)
  assert _answers(t) == plain
  assert not os.path.exists(marker)


def test_loading_an_entry_calls_no_unpickler(entry, monkeypatch):
  import pickle
  path, _, plain = entry

  def refuse(*args, **kwargs):
    raise AssertionError("unpickling")

  for name in ("load", "loads", "Unpickler"):
    monkeypatch.setattr(pickle, name, refuse)
  real_np_load = np.load

  def np_load(*args, allow_pickle=False, **kwargs):
    if allow_pickle:
      raise AssertionError("numpy.load with allow_pickle=True")
    return real_np_load(*args, allow_pickle=False, **kwargs)

  monkeypatch.setattr(np, "load", np_load)
  before = table_cache.stats()["hits"]
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    t = tables.load(str(path), MATMUL, HW)
  assert table_cache.stats()["hits"] == before + 1
  assert len(t._decided) == len(_ASKED)
  assert _answers(t) == plain


def test_a_kept_decision_that_cannot_run_its_problem_is_decided_again(entry):
  # The record holds problem fields, not problems: a config that does not
  # run its problem (M = 777 is not a multiple of 8: not for Mosaic) is
  # caught when used, warned once, decided again and replaced.
  path, f, plain = entry
  state = json.loads(f.read_text())
  d = state["decided"]
  i = next(i for i, row in enumerate(d["problem"]) if row[0] == 777)
  d["config"][i], d["source"][i] = _first(state, "mosaic"), "model"
  f.write_text(json.dumps(state))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    t = tables.load(str(path), MATMUL, HW)  # (well formed: loads)
  with pytest.warns(UserWarning, match="which it cannot run"):
    assert _answers(t) == plain
  tables.store_in_cache(t)
  again = tables.load(str(path), MATMUL, HW)
  assert len(again._decided) == len(_ASKED)
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    assert _answers(again) == plain


def test_an_entry_is_plain_json(entry):
  path, f, _ = entry
  r = subprocess.run([sys.executable, "-m", "json.tool", str(f)], capture_output=True,
                     text=True, timeout=60)
  assert r.returncode == 0 and '"wavetune-table-cache"' in r.stdout
  state = json.loads(f.read_text())
  t = tables.load(str(path), MATMUL, HW)
  assert len(state["anchors"]["log_g"]) == len(t.anchors)
  assert len(state["model"]["variant"]) == len(t.entries)


def test_two_processes_writing_one_entry_leave_a_loadable_one(entry, cache):
  path, _, plain = entry
  script = textwrap.dedent(f"""
      import sys, warnings
      warnings.simplefilter("error")
      from wavetune_jax import MATMUL, MatmulProblem, get_hardware
      from wavetune_jax.runtime import selector, table_cache, tables
      table_cache.set_dir({str(cache)!r})
      hw = get_hardware("h200")
      first = int(sys.argv[1])
      for i in range(40):
        t = tables.load({str(path)!r}, MATMUL, hw)
        with selector.use_tables(t, MATMUL):
          selector.select(MATMUL, MatmulProblem(m=first + 8 * i, n=6144, k=4096), hw)
        tables.store_in_cache(t, merge=True)
      selector._dirty.clear()
      print(table_cache.stats()["hits"], table_cache.stats()["errors"])
  """)
  env = dict(os.environ, JAX_PLATFORMS="cpu",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  procs = [subprocess.Popen([sys.executable, "-c", script, str(first)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
           for first in (8, 9)]
  for p in procs:
    out, err = p.communicate(timeout=600)
    assert p.returncode == 0, err[-2000:]
    hits, errors = out.split()
    assert int(hits) == 40 and errors == "0"
  assert not list(cache.glob("*.tmp"))
  with warnings.catch_warnings():
    warnings.simplefilter("error")
    t = tables.load(str(path), MATMUL, HW)
  assert len(t._decided) > len(_ASKED)
  assert _answers(t) == plain


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


def test_a_home_relative_cache_folder_is_expanded(monkeypatch, tmp_path):
  """``WAVETUNE_TABLE_CACHE='~/x'`` (quoted in a .env file or a container's
  ENV, so the shell did not expand it) is the folder in the home directory,
  not a folder named ``~``; so for ``WAVETUNE_TABLES``."""
  from wavetune_jax.core.cache_folder import CacheFolder
  from wavetune_jax.runtime import tables as tables_lib
  monkeypatch.setenv("HOME", str(tmp_path))
  monkeypatch.setenv("WAVETUNE_TEST_FOLDER", "~/wt_cache")
  assert CacheFolder("WAVETUNE_TEST_FOLDER").get() == tmp_path / "wt_cache"
  monkeypatch.setenv("WAVETUNE_TABLES", "~/mine")
  assert tables_lib.default_path("matmul", "nvidia_h200") == str(
      tmp_path / "mine" / "nvidia_h200" / "matmul.json")
  assert tables_lib.user_path("matmul", "nvidia_h200") == str(
      tmp_path / "mine" / "nvidia_h200" / "matmul.json")
