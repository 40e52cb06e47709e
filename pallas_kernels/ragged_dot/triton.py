"""Pallas (Triton backend) grouped GEMM: ``lax.ragged_dot`` semantics.

Grid ``(T, tiles_n)``: program ``(t, j)`` runs row task ``t`` of the work
list (:mod:`pallas_kernels.ragged_dot.worklist`) against column tile ``j`` of
its group's weight. Rows of the block outside the group are masked at the load
and the store; tasks past the work list's count exit at once; tail tasks (rows
past ``sum(group_sizes)``) store zeros, selected after the K loop (not the
product of zero rows and a weight, which is NaN where the weight holds NaN or
Inf). Any ``M, N, K >= 1``.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from pallas_kernels._launch import check_launch, match_varying, out_struct
from pallas_kernels._triton_lowering import compiler_params, plgpu
from pallas_kernels.ragged_dot import worklist

__all__ = ["TritonRaggedDotConfig", "ragged_dot"]

MAX_ELEMENTS = 2**31 - 1


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TritonRaggedDotConfig:
  """Launch parameters of the Triton grouped GEMM.

  Attributes:
    block_m: rows per task; power of two >= 16.
    block_n: columns of the weight per program; power of two >= 16.
    block_k: step of the K loop; power of two >= 16.
    num_warps: warps per program; power of two in [1, 16].
    num_stages: software-pipelining depth of the K loop, in [1, 8].
  """

  block_m: int = 64
  block_n: int = 128
  block_k: int = 64
  num_warps: int = 4
  num_stages: int = 3

  def __post_init__(self):
    check_launch(self, ("block_m", "block_n", "block_k"))


def _kernel(tasks_ref, x_ref, w_ref, o_ref, *, groups, n, k, bm, bn, bk, acc_dtype):
  t = pl.program_id(0)
  j = pl.program_id(1)
  size = tasks_ref[worklist.SIZE, t]

  @pl.when(size > 0)
  def _():
    grp = tasks_ref[worklist.GROUP, t]
    row0 = tasks_ref[worklist.ROW0, t]
    start = tasks_ref[worklist.START, t]
    expert = jnp.minimum(grp, groups - 1)
    r = jnp.arange(bm, dtype=jnp.int32)
    mask_m = (r >= start) & (r < start + size)
    # Tail tasks (rows past the groups) load their lhs rows as zeros.
    load_m = mask_m & (grp < groups)
    cols = pl.ds(j * bn, bn)
    mask_n = j * bn + jnp.arange(bn, dtype=jnp.int32) < n
    rows = pl.ds(row0, bm)

    def body(i, acc):
      ks = pl.ds(i * bk, bk)
      mask_k = i * bk + jnp.arange(bk, dtype=jnp.int32) < k
      x = plgpu.load(x_ref.at[rows, ks], mask=load_m[:, None] & mask_k[None, :], other=0.0)
      w = plgpu.load(w_ref.at[expert, ks, cols], mask=mask_k[:, None] & mask_n[None, :],
                     other=0.0)
      return acc + jax.lax.dot(x, w, preferred_element_type=acc_dtype)

    acc = jax.lax.fori_loop(0, pl.cdiv(k, bk), body, jnp.zeros((bm, bn), acc_dtype))
    # Rows loaded as zeros still met the weight (0 * NaN is NaN): select
    # zeros for them, once, after the loop.
    acc = jnp.where(load_m[:, None], acc, 0.0)
    plgpu.store(o_ref.at[rows, cols], acc.astype(o_ref.dtype),
                mask=mask_m[:, None] & mask_n[None, :])


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *,
               config: TritonRaggedDotConfig, out_dtype=None,
               interpret: bool = False) -> jax.Array:
  """``lax.ragged_dot(lhs [M, K], rhs [G, K, N], group_sizes [G])`` with the
  Triton kernel (fp32 accumulation; ``out_dtype`` default ``lhs.dtype``).

  Raises:
    ValueError: wrong ranks, shapes or dtypes, or operands too large for
      32-bit offsets.
  """
  if not isinstance(config, TritonRaggedDotConfig):
    raise ValueError(f"config must be a TritonRaggedDotConfig; got {type(config).__name__}")
  worklist.check_operands(lhs, rhs, group_sizes)
  for name, size in (("lhs", lhs.size), ("rhs", rhs.size),
                     ("output", lhs.shape[0] * rhs.shape[2])):
    if size > MAX_ELEMENTS:
      raise ValueError(f"{name} holds {size} elements, more than the kernel's 32-bit "
                       f"offsets allow ({MAX_ELEMENTS})")
  out_dtype = jnp.dtype(lhs.dtype if out_dtype is None else out_dtype)
  return _ragged_dot(lhs, rhs, group_sizes, config=config, out_dtype=out_dtype,
                     interpret=interpret)


@functools.partial(jax.jit, static_argnames=("config", "out_dtype", "interpret"))
def _ragged_dot(lhs, rhs, group_sizes, *, config, out_dtype, interpret):
  (m, k), (g, _, n) = lhs.shape, rhs.shape
  c = config
  tasks, _ = worklist.row_tasks(group_sizes, m, c.block_m)
  grid = (tasks.shape[1], pl.cdiv(n, c.block_n))
  (tasks, lhs, rhs), axes = match_varying(tasks, lhs, rhs)
  kernel = functools.partial(_kernel, groups=g, n=n, k=k, bm=c.block_m, bn=c.block_n,
                             bk=c.block_k, acc_dtype=jnp.float32)
  with warnings.catch_warnings():
    # JAX 0.11 deprecates the Triton backend of Pallas; it still works.
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    return pl.pallas_call(
        kernel,
        out_shape=out_struct((m, n), out_dtype, axes),
        grid=grid,
        compiler_params=compiler_params(num_warps=c.num_warps,
                                        num_stages=c.num_stages),
        interpret=interpret,
        name=f"wavetune_ragged_dot_{c.block_m}x{c.block_n}x{c.block_k}",
    )(tasks, lhs, rhs)
