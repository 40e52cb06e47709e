"""What every Pallas Triton backend shares: the occupancy bound with
Triton's own reserves."""

from __future__ import annotations

from wavetune_jax.core.hardware import Hardware, resident_ctas

__all__ = ["SMEM_RESERVE", "EXTRA_REGS", "occupancy_bound"]

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
