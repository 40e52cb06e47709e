"""What the tuner needs to know about a GPU.

On a GPU the description is read from ``jax.devices()``; elsewhere (CPU tests,
offline table building, ``wavetune select --device h100``) it comes from a named
preset. JAX reports the SM count (``core_count``) and compute capability but not
the shared-memory limits, so those come from the CUDA limits of the compute
capability.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import warnings

import jax

__all__ = ["Hardware", "PRESETS", "device_key", "get_hardware", "detect", "current",
           "resident_ctas", "CPU_PRESET"]

#: The preset the selector answers for on a machine without a GPU.
CPU_PRESET = "h100"


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Hardware:
  """Static facts about one GPU model.

  Attributes:
    name: human-readable name (``device_kind``).
    device_key: normalised ``device_kind``; names the table folder.
    num_sms: streaming multiprocessors.
    smem_per_block: opt-in shared memory per thread block, bytes.
    smem_per_sm: shared memory per SM, bytes.
    max_threads_per_sm: resident threads per SM.
    regs_per_sm: 32-bit registers per SM.
    compute_capability: e.g. ``"9.0"``.
    interpret: no GPU runs the kernels: they run in Pallas interpret mode, so
      only backends with an interpret mode can be chosen.
  """

  name: str
  device_key: str
  num_sms: int
  smem_per_block: int
  smem_per_sm: int
  max_threads_per_sm: int = 2048
  regs_per_sm: int = 65536
  compute_capability: str = "9.0"
  interpret: bool = False


# CUDA limits per compute capability: (smem per block opt-in, smem per SM,
# max threads per SM). From the CUDA C++ Programming Guide's table of
# technical specifications.
_CC_LIMITS = {
    "8.0": (163 * 1024, 164 * 1024, 2048),
    "8.6": (99 * 1024, 100 * 1024, 1536),
    "8.9": (99 * 1024, 100 * 1024, 1536),
    "9.0": (227 * 1024, 228 * 1024, 2048),
    "10.0": (227 * 1024, 228 * 1024, 2048),
}


def device_key(device_kind: str) -> str:
  """Normalises a ``device_kind`` string: ``"NVIDIA H100 80GB HBM3"`` ->
  ``"nvidia_h100_80gb_hbm3"``."""
  key = re.sub(r"[^0-9a-z]+", "_", device_kind.lower()).strip("_")
  if not key:
    raise ValueError(f"device_kind={device_kind!r} gives an empty device key")
  return key


def _preset(name: str, num_sms: int, cc: str) -> Hardware:
  smem_block, smem_sm, threads = _CC_LIMITS[cc]
  return Hardware(name=name, device_key=device_key(name), num_sms=num_sms,
                  smem_per_block=smem_block, smem_per_sm=smem_sm,
                  max_threads_per_sm=threads, compute_capability=cc)


#: Named presets for machines without the GPU (tests, offline work).
PRESETS = {
    "h100": _preset("NVIDIA H100 80GB HBM3", 132, "9.0"),
    "h200": _preset("NVIDIA H200", 132, "9.0"),
    "a100": _preset("NVIDIA A100-SXM4-80GB", 108, "8.0"),
}


def detect(device: jax.Device | None = None) -> Hardware:
  """Describes a GPU device (default: ``jax.devices()[0]``).

  Raises:
    RuntimeError: the device is not a CUDA GPU.
  """
  dev = jax.devices()[0] if device is None else device
  if dev.platform != "gpu":
    raise RuntimeError(
        f"no GPU: jax.devices()[0].platform={dev.platform!r}; name a preset "
        f"instead (one of {sorted(PRESETS)})")
  cc = str(getattr(dev, "compute_capability", "9.0"))
  if cc not in _CC_LIMITS:
    major = cc.split(".")[0]
    cc = max((c for c in _CC_LIMITS if c.split(".")[0] == major),
             default="8.0")
  smem_block, smem_sm, threads = _CC_LIMITS[cc]
  return Hardware(name=dev.device_kind, device_key=device_key(dev.device_kind),
                  num_sms=int(dev.core_count), smem_per_block=smem_block,
                  smem_per_sm=smem_sm, max_threads_per_sm=threads,
                  compute_capability=cc)


@functools.lru_cache(maxsize=1)
def current() -> Hardware:
  """The hardware the ops run on: the default GPU, or on a machine without
  one the :data:`CPU_PRESET` preset with ``interpret=True`` (one warning).

  With no GPU the ops run the backends that have an interpret mode: the
  Pallas Triton kernels in Pallas interpret mode, or where this JAX has no
  Triton lowering (:mod:`pallas_kernels._triton_lowering`) the XLA ops; the
  one warning says which."""
  try:
    return detect()
  except RuntimeError:
    from pallas_kernels import _triton_lowering
    if _triton_lowering.REASON is None:
      how = "kernels run in Pallas interpret mode (slow, for tests)"
    else:
      how = f"{_triton_lowering.REASON}; the ops run their XLA backends"
    warnings.warn(
        f"wavetune_jax: no GPU ({jax.default_backend()} backend): {how}, and configs are "
        f"chosen for the {CPU_PRESET!r} preset among backends with an interpret mode",
        stacklevel=3)
    return dataclasses.replace(PRESETS[CPU_PRESET], interpret=True)


def get_hardware(name: str | Hardware | None = None) -> Hardware:
  """Returns a preset by name, the hardware given, or the current hardware.

  Args:
    name: a preset name (``"h100"``, ``"h200"``, ...), a device key of a
      preset, a :class:`Hardware`, or ``None`` for :func:`current` (on a
      machine without a GPU: the ``h100`` preset in interpret mode).

  Raises:
    ValueError: an unknown name.
  """
  if isinstance(name, Hardware):
    return name
  if name is None:
    return current()
  if not isinstance(name, str):
    raise ValueError(f"hardware must be a preset name or a Hardware; got {name!r}")
  key = name.lower()
  if key in PRESETS:
    return PRESETS[key]
  for hw in PRESETS.values():
    if hw.device_key == key:
      return hw
  raise ValueError(f"unknown hardware {name=}; presets are {sorted(PRESETS)}")


def resident_ctas(hw: Hardware, *, smem_bytes: int, threads: int,
                  regs_per_thread: int, limit: int = 8) -> int:
  """CTAs that fit on one SM by shared memory, threads and registers (at
  least 1, at most ``limit``): the analytic occupancy bound backends refine
  with their own reserves."""
  by_smem = hw.smem_per_sm // max(1, smem_bytes)
  by_threads = hw.max_threads_per_sm // max(1, threads)
  by_regs = hw.regs_per_sm // max(1, regs_per_thread * threads)
  return int(max(1, min(by_smem, by_threads, by_regs, limit)))
