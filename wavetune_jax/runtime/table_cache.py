"""Parsed tables kept on disk, so a new process skips parsing them.

Loading a GEMM table (a thousand records: problems, configs, model entries,
checked one by one) and preparing its per-variant arrays is most of a
process's first wavetune decision (``benchmarks/decision_time.py
--processes 3``: 31-36 ms parsing, 14-18 ms from this cache, on a 2-core
CPU). The result depends only on the table file's bytes and on this
package's code, so :func:`tables.load <wavetune_jax.runtime.tables.load>`
keeps it here, pickled, with the decisions the selector makes from it.

Where: :func:`set_dir`, else ``$WAVETUNE_TABLE_CACHE`` (a folder; ``off``
turns it off), else ``wavetune_tables`` in JAX's persistent compilation
cache folder (``jax_compilation_cache_dir``) when the program set one; off
otherwise. An entry's key holds a hash of the table
file's bytes, the family, the GPU's description, the Python and NumPy
versions and this package's source files (names, sizes and modification
times), so an edited table or an upgrade gets new entries (old ones are never
read again; delete the folder to reclaim the space). An entry that cannot be
read (truncated, corrupt, written by other code) is rebuilt from the table
file, with one warning; a folder that cannot be written leaves loads as they
were, with one warning. Writes are atomic: a crash leaves no partial file.

Entries are Python pickles, so the folder must be as trusted as the code
(like JAX's compilation cache, whose entries are executables): that is why it
is off unless the program names a cache folder.
"""

from __future__ import annotations

import functools
import hashlib
import os
import pathlib
import pickle
import sys
import tempfile
import warnings

import numpy as np

from wavetune_jax.core.cache_folder import CacheFolder

__all__ = ["set_dir", "cache_dir", "stats", "key", "get", "put"]

#: Bumped when the stored state changes shape.
_FORMAT = 1
_SUFFIX = ".table.pickle"

_stats = {"hits": 0, "writes": 0, "errors": 0}
_folder = CacheFolder("WAVETUNE_TABLE_CACHE", default=lambda: _in_jax_cache())
_state = _folder.state
_warned: set = set()


def set_dir(path: str | os.PathLike | None) -> None:
  """Keeps parsed tables in ``path`` (created when first written); ``None``
  turns the cache off. Overrides ``$WAVETUNE_TABLE_CACHE``."""
  _folder.set(path)


def cache_dir() -> pathlib.Path | None:
  """The folder in use, or None (cache off): see the module doc."""
  return _folder.get()


def _in_jax_cache() -> pathlib.Path | None:
  import jax
  jax_dir = jax.config.jax_compilation_cache_dir
  return pathlib.Path(jax_dir) / "wavetune_tables" if jax_dir else None


def stats() -> dict:
  """Counts since the process started: ``hits`` (tables read from the
  cache), ``writes`` (entries written: a table parsed, or its decisions
  added at exit), ``errors`` (entries rebuilt or not written)."""
  return dict(_stats)


@functools.cache
def _code_fingerprint() -> str:
  """Names, sizes and modification times of this package's source files:
  the classes a pickled table holds are defined there (a stat per file,
  well under a millisecond, where hashing the contents takes several)."""
  root = pathlib.Path(__file__).resolve().parents[2]
  seen = []
  for pkg in ("pallas_kernels", "wavetune_jax"):
    stack = [str(root / pkg)]
    while stack:
      with os.scandir(stack.pop()) as it:
        for e in it:
          if e.is_dir(follow_symlinks=False):
            if e.name != "__pycache__":
              stack.append(e.path)
          elif e.name.endswith(".py"):
            st = e.stat()
            seen.append(f"{os.path.relpath(e.path, root)}:{st.st_size}:{st.st_mtime_ns}")
  return hashlib.sha256(";".join(sorted(seen)).encode()).hexdigest()


def key(data: bytes, family_name: str, hw) -> str:
  """The entry of a table file's bytes loaded for ``family_name`` on ``hw``
  (a Hardware, or None for a load without one)."""
  h = hashlib.sha256(data)
  h.update(repr((_FORMAT, family_name, repr(hw), sys.version, np.__version__,
                 _code_fingerprint())).encode())
  return h.hexdigest()


def _warn_once(what: str, msg: str) -> None:
  if what not in _warned:
    _warned.add(what)
    warnings.warn(msg, stacklevel=4)


def get(k: str, *, count: bool = True) -> dict | None:
  """The stored state of entry ``k``, or None (a miss, or an unreadable
  entry: warned once, and rewritten by the caller's :func:`put`).
  ``count=False``: not counted in :func:`stats` (a read before a rewrite)."""
  d = cache_dir()
  if d is None:
    return None
  path = d / (k + _SUFFIX)
  try:
    with open(path, "rb") as f:
      data = f.read()
  except (FileNotFoundError, NotADirectoryError):
    return None
  except OSError as e:
    _stats["errors"] += 1
    _warn_once("read", f"wavetune_jax: table cache entry {path} is unreadable ({e}); "
                       f"parsing the table instead")
    return None
  try:
    fmt, state = pickle.loads(data)
    if fmt != _FORMAT or not isinstance(state, dict):
      raise ValueError(f"format {fmt!r}")
  except Exception as e:  # noqa: BLE001 - any unpickling failure means a bad entry
    _stats["errors"] += 1
    _warn_once("corrupt", f"wavetune_jax: table cache entry {path} is corrupt "
                          f"({type(e).__name__}: {e}); rebuilding it from the table file")
    return None
  if count:
    _stats["hits"] += 1
  return state


def put(k: str, state: dict) -> None:
  """Writes entry ``k`` atomically; a failure warns once and is otherwise
  ignored (the table was loaded; only the next process's head start is lost)."""
  d = cache_dir()
  if d is None:
    return
  _stats["writes"] += 1
  tmp = None
  try:
    d.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=d, suffix=".tmp")
    with os.fdopen(fd, "wb") as f:
      pickle.dump((_FORMAT, state), f, protocol=pickle.HIGHEST_PROTOCOL)
    os.replace(tmp, d / (k + _SUFFIX))
    tmp = None
  except (OSError, pickle.PicklingError, TypeError, AttributeError) as e:
    _stats["errors"] += 1
    _warn_once("write", f"wavetune_jax: cannot write the table cache in {d} "
                        f"({type(e).__name__}: {e}); tables are parsed in every process "
                        f"(WAVETUNE_TABLE_CACHE=off silences this)")
  finally:
    if tmp is not None and os.path.exists(tmp):
      os.unlink(tmp)
