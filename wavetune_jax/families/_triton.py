"""What every Pallas Triton backend shares: the base class that knows
whether this JAX has the lowering, and the occupancy bound with Triton's own
reserves."""

from __future__ import annotations

from pallas_kernels import _triton_lowering
from wavetune_jax.core.family import Backend
from wavetune_jax.core.hardware import Hardware, resident_ctas

__all__ = ["TritonBackend", "SMEM_RESERVE", "EXTRA_REGS", "occupancy_bound"]


class TritonBackend(Backend):
  """A Pallas Triton kernel: it runs on any CUDA GPU and in interpret mode on
  a CPU, where this JAX has the Triton lowering
  (:mod:`pallas_kernels._triton_lowering`). Where it has none,
  :meth:`supported_on` is False and :meth:`unsupported_reason` says why, so
  the selector passes the backend over and a config pinned to it raises
  ``ValueError`` with that reason."""

  interpret = True
  kernel_cache = True

  def supported_on(self, hw: Hardware) -> bool:
    return _triton_lowering.plgpu is not None

  def unsupported_reason(self, hw: Hardware) -> str | None:
    return _triton_lowering.REASON

#: Shared memory Triton reserves per CTA beyond the kernel's buffers, bytes.
SMEM_RESERVE = 1024
#: Registers per thread for operands and addresses on top of the accumulator
#: (Triton's usual overhead); a thread holds at most 255.
EXTRA_REGS = 64


def occupancy_bound(hw: Hardware, *, smem_bytes: int, threads: int,
                    acc_per_thread: int) -> int:
  """Analytic upper bound on resident CTAs per SM of a Triton kernel: shared
  memory (with Triton's reserve), threads and registers (the fp32 values live
  per thread plus :data:`EXTRA_REGS`), at most 8."""
  return resident_ctas(hw, smem_bytes=smem_bytes + SMEM_RESERVE, threads=threads,
                       regs_per_thread=min(255, acc_per_thread + EXTRA_REGS))
