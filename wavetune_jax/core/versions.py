"""The software versions a measurement depends on: JAX, jaxlib, CUDA, cuDNN.

The platform ops change under the library (XLA's GEMM autotuner, cuDNN's
attention, from cuDNN 9.22 a cuDNN grouped GEMM behind ``lax.ragged_dot``),
and so do the Pallas lowerings. Sweep headers, tables and first-use decisions
record these versions; evidence measured with others is stale.
"""

from __future__ import annotations

import functools

__all__ = ["current", "differ", "cudnn_below", "KEYS"]

KEYS = ("jax", "jaxlib", "cuda", "cudnn")


@functools.cache
def current() -> dict:
  """``{"jax", "jaxlib", and where a GPU backend is loaded "cuda", "cudnn"}``
  as strings (a version that cannot be read is left out)."""
  import jax
  out = {"jax": jax.__version__}
  try:
    import jaxlib
    out["jaxlib"] = str(getattr(jaxlib, "__version__", ""))
  except ImportError:  # pragma: no cover - jax always ships jaxlib
    pass
  try:
    if jax.default_backend() == "gpu":
      from jax._src.lib import cuda_versions
      if cuda_versions is not None:
        v = int(cuda_versions.cuda_runtime_get_version())   # 12080: 12.8
        out["cuda"] = f"{v // 1000}.{(v % 1000) // 10}"
        v = int(cuda_versions.cudnn_get_version())          # 91900: 9.19.0
        out["cudnn"] = f"{v // 10000}.{(v % 10000) // 100}.{v % 100}"
  except Exception:  # noqa: BLE001 - a version we cannot read is not recorded
    pass
  return {k: v for k, v in out.items() if v}


def differ(recorded: dict, now: dict) -> bool:
  """Whether a version recorded with a measurement differs from ``now``
  (only the keys both hold are compared: old files record JAX's alone)."""
  return any(k in recorded and k in now and str(recorded[k]) != str(now[k]) for k in KEYS)


def cudnn_below(bound: tuple[int, int], recorded: dict | None = None) -> bool | None:
  """Whether the cuDNN of ``recorded`` (``current()``'s form; default: this
  process's) is older than ``bound`` (major, minor); None where it cannot be
  read (no cuDNN recorded, as on a CPU, or no ``major.minor``)."""
  cudnn = (current() if recorded is None else recorded).get("cudnn")
  parts = str(cudnn).split(".")[:2] if cudnn is not None else []
  try:
    major_minor = tuple(int(x) for x in parts)
  except ValueError:
    return None
  return major_minor < tuple(bound) if len(major_minor) == 2 else None
