"""Lowered Pallas kernels kept on disk, so a new process skips their lowering.

JAX's persistent compilation cache keys a compile by the lowered module, so
every process still traces and lowers each Pallas kernel (Python, before
the key exists): a grouped GEMM's Mosaic GPU lowering is most of a second.
This cache stores each kernel call the ops make, exported with
``jax.export`` (StableHLO with the Mosaic GPU or Triton kernel inside), keyed
by everything the lowering depends on; a later process deserializes it
(about a millisecond) and calls it, so it neither traces the kernel's body
nor lowers it, and the module XLA sees is the same in every process (the
compilation cache then hits).

Opt-in: :func:`set_dir`, else ``$WAVETUNE_KERNEL_CACHE`` (a folder; ``off``
turns it off); none otherwise (the kernels are lowered as usual). Known
problem: on an H200, and later on an H100, a second process that loaded
grouped-GEMM (Mosaic GPU) kernels from it failed with "Failed to lookup host
symbol ... kernel_mosaic_gpu"; so it is not on by default. The likely cause,
read in JAX's source: such a process never imported
``jax.experimental.mosaic.gpu``, whose import tells the custom call where
Mosaic GPU's host runtime library is; a loaded Mosaic kernel now imports it
first (:func:`_mosaic_runtime`; since then the H200 runs that had failed
pass; the H100 is not rerun yet). The key holds the family,
backend, config, problem, options, operand types, platform, GPU, the JAX and
jaxlib versions and a hash of this package's source, so an upgrade or an
edited kernel gets new entries (old ones are never read again; delete the
folder to reclaim the space). A file that cannot be read (truncated,
corrupt, another JAX's format) is replaced, with one warning. Writes are
atomic: a crash leaves no partial file.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import pathlib
import tempfile
import threading
import warnings

import jax

from wavetune_jax.core.cache_folder import CacheFolder

__all__ = ["set_dir", "cache_dir", "call", "stats", "clear_memory"]

#: Custom calls of the kernels that ``jax.export`` does not list as stable
#: (Triton kernels; Mosaic GPU's ``mosaic_gpu_v2`` is listed). The entries
#: are keyed by the exact JAX and jaxlib versions, so this is safe here.
_CUSTOM_CALLS = ("__gpu$xla.gpu.triton",)
_SUFFIX = ".jaxexport"

_lock = threading.Lock()
_folder = CacheFolder("WAVETUNE_KERNEL_CACHE")
_state = _folder.state
_memory: dict = {}       # key -> jax.export.Exported
_stats = {"hits": 0, "misses": 0, "loads": 0, "errors": 0}
_warned: set = set()


def set_dir(path: str | os.PathLike | None) -> None:
  """Keeps lowered kernels in ``path`` (created if missing); ``None`` turns
  the cache off. Overrides the environment and JAX's cache folder."""
  _folder.set(path)


def cache_dir() -> pathlib.Path | None:
  """The folder in use, or None (cache off): see the module doc."""
  return _folder.get()


def stats() -> dict:
  """Counts since the process started: ``hits`` (served from memory or a
  file), ``loads`` (of those, read from a file), ``misses`` (exported and
  written), ``errors`` (files replaced or not written)."""
  return dict(_stats)


def clear_memory() -> None:
  """Forgets the entries read in this process (the files stay)."""
  with _lock:
    _memory.clear()


@functools.cache
def _source_hash() -> str:
  """A hash of the package's Python source (the kernels and the backends
  that build their calls)."""
  h = hashlib.sha256()
  root = pathlib.Path(__file__).resolve().parents[2]
  for pkg in ("pallas_kernels", "wavetune_jax"):
    for f in sorted((root / pkg).rglob("*.py")):
      h.update(str(f.relative_to(root)).encode())
      h.update(f.read_bytes())
  return h.hexdigest()[:16]


@functools.cache
def _versions() -> tuple:
  import jaxlib
  return (jax.__version__, getattr(jaxlib, "__version__", "?"))


def _describe(v):
  if dataclasses.is_dataclass(v) and not isinstance(v, type):
    # Private fields are caches (a problem's hash varies per process).
    return [type(v).__name__, {f.name: _describe(getattr(v, f.name))
                               for f in dataclasses.fields(v) if not f.name.startswith("_")}]
  if isinstance(v, dict):
    return {str(k): _describe(x) for k, x in sorted(v.items(), key=lambda kv: str(kv[0]))}
  if isinstance(v, (list, tuple)):
    return [_describe(x) for x in v]
  if isinstance(v, (str, int, float, bool)) or v is None:
    return v
  return repr(v)


def _key(parts: dict, avals, platform: str, device_kind: str) -> str:
  doc = {"parts": _describe(parts),
         "avals": [[list(a.shape), str(a.dtype), bool(getattr(a, "weak_type", False))]
                   for a in avals],
         "platform": platform, "device": device_kind, "versions": list(_versions()),
         "source": _source_hash()}
  return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()


def _warn(what: str, msg: str) -> None:
  if what not in _warned:
    _warned.add(what)
    warnings.warn(f"wavetune_jax kernel cache: {msg}", stacklevel=4)


def _platform() -> tuple[str, str]:
  dev = jax.devices()[0]
  # The ops' GPU kernels are CUDA's; jax.export names that platform "cuda".
  return {"gpu": "cuda"}.get(dev.platform, dev.platform), dev.device_kind


def _export(fn, avals, platform):
  from jax import export
  checks = [export.DisabledSafetyCheck.custom_call(t) for t in _CUSTOM_CALLS]
  return export.export(jax.jit(fn), platforms=(platform,), disabled_checks=checks)(*avals)


def _load(path: pathlib.Path):
  from jax import export
  return export.deserialize(bytearray(path.read_bytes()))


def _write(path: pathlib.Path, data: bytes) -> None:
  path.parent.mkdir(parents=True, exist_ok=True)
  fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-", suffix=_SUFFIX)
  try:
    with os.fdopen(fd, "wb") as f:
      f.write(data)
    os.replace(tmp, path)
  except BaseException:
    try:
      os.unlink(tmp)
    except OSError:
      pass
    raise


def call(fn, arrays, *, parts: dict):
  """``fn(*arrays)`` through the cache (see the module doc); plain
  ``fn(*arrays)`` when the cache is off.

  ``fn`` takes the arrays positionally and nothing else varies between two
  calls with equal ``parts`` and operand types: ``parts`` must name
  everything else the lowering depends on (family, backend, config,
  problem, static options).
  """
  folder = cache_dir()
  if folder is None:
    return fn(*arrays)
  try:
    from jax._src.export import serialization  # noqa: F401  (needs flatbuffers)
  except ImportError:
    _warn("flatbuffers", "jax.export serialization needs the flatbuffers package "
          "(pip install flatbuffers); kernels are lowered in every process")
    return fn(*arrays)
  avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in arrays]
  platform, kind = _platform()
  key = _key(parts, avals, platform, kind)
  exp = _memory.get(key)
  if exp is None:
    path = folder / key[:2] / (key + _SUFFIX)
    if path.exists():
      try:
        exp = _load(path)
        _stats["loads"] += 1
      except Exception as e:  # noqa: BLE001 - any unreadable file is replaced
        _stats["errors"] += 1
        _warn("read", f"could not read {path} ({type(e).__name__}: {e}); lowering the "
              f"kernel again and replacing the file")
        exp = None
    if exp is None:
      try:
        exp = _export(fn, avals, platform)
      except Exception as e:  # noqa: BLE001 - the op still runs, uncached
        _stats["errors"] += 1
        _warn(f"export:{type(e).__name__}", f"jax.export could not export a "
              f"{parts.get('backend', '')} kernel ({type(e).__name__}: "
              f"{str(e).splitlines()[0] if str(e) else ''}); it is lowered in every process")
        return fn(*arrays)
      _stats["misses"] += 1
      try:
        _write(path, bytes(exp.serialize()))
      except OSError as e:
        _stats["errors"] += 1
        _warn("write", f"could not write to {folder} ({e}); kernels are lowered again "
              f"in the next process")
    else:
      _stats["hits"] += 1
    with _lock:
      _memory[key] = exp
  else:
    _stats["hits"] += 1
  return _call_exported(exp, fn, arrays, str(parts.get("backend", "")))


#: Backends whose exported kernels are Mosaic GPU custom calls.
_MOSAIC_BACKENDS = ("mosaic",)


@functools.cache
def _mosaic_runtime() -> bool:
  """Makes Mosaic GPU's host runtime findable before a loaded kernel is
  compiled: importing ``jax.experimental.mosaic.gpu`` sets
  ``MOSAIC_GPU_RUNTIME_LIB_PATH``, which the custom call reads to link a
  kernel's host launcher (``mosaic_gpu_launch_kernel`` lives in
  ``libmosaic_gpu_runtime.so``). A process that lowers a Mosaic kernel
  imports it on the way; one that only loads kernels from this cache did
  not, and its first call could fail with "Failed to lookup host symbol ...
  kernel_mosaic_gpu". Whether the import is available (False on a JAX
  without Mosaic GPU)."""
  try:
    import jax.experimental.mosaic.gpu  # noqa: F401
  except ImportError:
    return False
  return True


def _call_exported(exp, fn, arrays, backend: str = ""):
  """``exp.call(*arrays)``; under ``jax.vmap`` (which has no rule for a call
  of an exported module) the kernel ``fn`` itself is batched instead. A
  Mosaic ``backend``'s runtime is made findable first (:func:`_mosaic_runtime`)."""
  if backend in _MOSAIC_BACKENDS:
    _mosaic_runtime()
  @jax.custom_batching.custom_vmap
  def call(*xs):
    return exp.call(*xs)

  @call.def_vmap
  def _rule(axis_size, in_batched, *xs):
    out = jax.vmap(fn, in_axes=[0 if b else None for b in in_batched])(*xs)
    return out, jax.tree.map(lambda _: True, out)
  return call(*arrays)
