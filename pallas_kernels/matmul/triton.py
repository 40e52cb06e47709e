"""Pallas (Triton backend) GEMM: ``y = x @ w``.

The kernel is a pure function of its inputs and a :class:`TritonMatmulConfig`; it never
chooses its own launch parameters. Edges are handled with masked loads and stores
inside the kernel, so any ``M, N, K >= 1`` works without padded copies in HBM.

Grid: ``(tiles_m * tiles_n, split_k)``. Axis 0 enumerates output tiles in
*grouped* order (``group_m`` tile rows share their column tiles, so consecutive
programs reuse the same slices of ``w`` from L2). Axis 1 splits the K loop: with
``split_k > 1`` every split writes an fp32 partial sum to a ``[split_k, M, N]``
buffer that a single fused XLA reduction adds up and casts.
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

__all__ = ["TritonMatmulConfig", "matmul", "check_operands", "SUPPORTED_DTYPES",
           "MAX_ELEMENTS"]

#: Input dtypes the kernel accepts (both operands must share one).
SUPPORTED_DTYPES = (jnp.bfloat16, jnp.float16, jnp.float32)

#: Triton addresses operands with 32-bit offsets: no operand (nor the split-K
#: partial buffer) may hold more elements than this.
MAX_ELEMENTS = 2**31 - 1
#: The largest ``group_m`` (a group of more tile rows than this buys no L2
#: reuse; a group taller than the tile grid runs as the grid's height).
MAX_GROUP_M = 1024

@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class TritonMatmulConfig:
  """Launch parameters of the GEMM kernel.

  Attributes:
    block_m: rows of ``x`` (and of the output) per program; power of two >= 16.
    block_n: columns of ``w`` per program; power of two >= 16.
    block_k: step of the K loop; power of two >= 16.
    split_k: number of programs sharing one output tile along K (>= 1).
    group_m: tile rows per L2 group of the program-id swizzle, in [1,
      ``MAX_GROUP_M``] (a group taller than the tile grid is the grid).
    num_warps: warps per program; power of two in [1, 16].
    num_stages: software-pipelining depth of the K loop, in [1, 8].
  """

  block_m: int = 128
  block_n: int = 128
  block_k: int = 64
  split_k: int = 1
  group_m: int = 8
  num_warps: int = 4
  num_stages: int = 3

  def __post_init__(self):
    check_launch(self, ("block_m", "block_n", "block_k"))
    if self.split_k < 1:
      raise ValueError(f"TritonMatmulConfig.split_k={self.split_k} must be >= 1")
    if not 1 <= self.group_m <= MAX_GROUP_M:
      raise ValueError(f"TritonMatmulConfig.group_m={self.group_m} must be in "
                       f"[1, {MAX_GROUP_M}]")


def _matmul_kernel(x_ref, w_ref, o_ref, *, m, n, k, bm, bn, bk, group_m,
                   k_steps, split_k, acc_dtype):
  """One program: an output tile (bm, bn) over ``k_steps`` K blocks."""
  pid = pl.program_id(0)
  pid_k = pl.program_id(1)
  tiles_m = pl.cdiv(m, bm)
  tiles_n = pl.cdiv(n, bn)
  # Grouped ordering: walk group_m tile rows down a column before moving right.
  width = group_m * tiles_n
  group_id = pid // width
  first_m = group_id * group_m
  group_rows = jnp.minimum(tiles_m - first_m, group_m)
  pid_m = first_m + (pid % width) % group_rows
  pid_n = (pid % width) // group_rows

  rows = pl.ds(pid_m * bm, bm)
  cols = pl.ds(pid_n * bn, bn)
  # Static facts decide which masks are needed at all: the common aligned case
  # compiles to unmasked loads.
  mask_m = (pid_m * bm + jnp.arange(bm, dtype=jnp.int32) < m) if m % bm else None
  mask_n = (pid_n * bn + jnp.arange(bn, dtype=jnp.int32) < n) if n % bn else None
  k_exact = (k % bk == 0) and (k // bk == split_k * k_steps)
  k0 = pid_k * k_steps

  def body(i, acc):
    kb = k0 + i
    ks = pl.ds(kb * bk, bk)
    mask_k = None if k_exact else (kb * bk + jnp.arange(bk, dtype=jnp.int32) < k)
    x_mask = _outer_and(mask_m, mask_k)
    w_mask = _outer_and(mask_k, mask_n)
    x = plgpu.load(x_ref.at[rows, ks], mask=x_mask,
                   other=None if x_mask is None else 0.0)
    w = plgpu.load(w_ref.at[ks, cols], mask=w_mask,
                   other=None if w_mask is None else 0.0)
    # fp32 inputs use tf32 (Triton's default, like XLA's default precision).
    return acc + jax.lax.dot(x, w, preferred_element_type=acc_dtype)

  acc = jax.lax.fori_loop(0, k_steps, body, jnp.zeros((bm, bn), acc_dtype))
  o_mask = _outer_and(mask_m, mask_n)
  if split_k > 1:
    plgpu.store(o_ref.at[pid_k, rows, cols], acc.astype(o_ref.dtype),
                mask=o_mask)
  else:
    plgpu.store(o_ref.at[rows, cols], acc.astype(o_ref.dtype), mask=o_mask)


def _outer_and(a, b):
  if a is None and b is None:
    return None
  if a is None:
    return b[None, :]
  if b is None:
    return a[:, None]
  return a[:, None] & b[None, :]


def check_operands(x: jax.Array, w: jax.Array):
  if x.ndim != 2:
    raise ValueError(f"x must have rank 2 ([M, K]); got x.shape={x.shape}")
  if w.ndim != 2:
    raise ValueError(f"w must have rank 2 ([K, N]); got w.shape={w.shape}")
  if x.shape[1] != w.shape[0]:
    raise ValueError(
        f"inner dimensions differ: x.shape={x.shape} and w.shape={w.shape} "
        f"(x.shape[1] must equal w.shape[0])")
  if x.dtype != w.dtype:
    raise ValueError(
        f"x.dtype={x.dtype} and w.dtype={w.dtype} must be the same")
  if x.dtype not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
    raise ValueError(
        f"x.dtype={x.dtype} is not supported; use one of "
        f"{[jnp.dtype(d).name for d in SUPPORTED_DTYPES]}")


def matmul(x: jax.Array, w: jax.Array, *, config: TritonMatmulConfig,
           out_dtype=None, interpret: bool = False) -> jax.Array:
  """Computes ``x @ w`` with the Pallas Triton GEMM kernel.

  Args:
    x: ``[M, K]`` array, bfloat16, float16 or float32.
    w: ``[K, N]`` array of the same dtype.
    config: launch parameters; used as given, never changed.
    out_dtype: output dtype (default: ``x.dtype``). Accumulation is fp32.
    interpret: run in Pallas interpret mode (CPU; for tests).

  Returns:
    ``[M, N]`` array of ``out_dtype``.

  Raises:
    ValueError: wrong ranks, mismatched inner dimensions or dtypes, an
      unsupported dtype, ``split_k`` larger than the number of K blocks, or an
      operand too large for 32-bit offsets.
  """
  if not isinstance(config, TritonMatmulConfig):
    raise ValueError(f"config must be a TritonMatmulConfig; got {type(config).__name__}")
  check_operands(x, w)
  m, k = x.shape
  n = w.shape[1]
  out_dtype = jnp.dtype(x.dtype if out_dtype is None else out_dtype)
  if m == 0 or n == 0 or k == 0:
    # What jnp.dot gives: an empty result, or zeros when only K is empty.
    return jnp.zeros((m, n), out_dtype)
  k_blocks = pl.cdiv(k, config.block_k)
  if config.split_k > k_blocks:
    raise ValueError(
        f"config.split_k={config.split_k} is larger than the number of K "
        f"blocks ceil(K / block_k) = ceil({k} / {config.block_k}) = {k_blocks}")
  for name, size in (("x", m * k), ("w", k * n),
                     ("output", m * n * config.split_k)):
    if size > MAX_ELEMENTS:
      raise ValueError(
          f"{name} would hold {size} elements (split_k={config.split_k}), more "
          f"than the kernel's 32-bit offsets allow ({MAX_ELEMENTS})")
  return _matmul(x, w, config=config, out_dtype=out_dtype, interpret=interpret)


@functools.partial(jax.jit, static_argnames=("config", "out_dtype", "interpret"))
def _matmul(x, w, *, config: TritonMatmulConfig, out_dtype, interpret: bool):
  m, k = x.shape
  n = w.shape[1]
  c = config
  k_steps = pl.cdiv(pl.cdiv(k, c.block_k), c.split_k)
  grid = (pl.cdiv(m, c.block_m) * pl.cdiv(n, c.block_n), c.split_k)
  (x, w), axes = match_varying(x, w)
  if c.split_k > 1:
    out_shape = out_struct((c.split_k, m, n), jnp.float32, axes)
  else:
    out_shape = out_struct((m, n), out_dtype, axes)
  kernel = functools.partial(
      _matmul_kernel, m=m, n=n, k=k, bm=c.block_m, bn=c.block_n, bk=c.block_k,
      # A group of more tile rows than the grid has is the whole grid (the
      # same order), and keeps group_m * tiles_n within the program count.
      group_m=min(c.group_m, pl.cdiv(m, c.block_m)), k_steps=k_steps, split_k=c.split_k,
      acc_dtype=jnp.float32)
  with warnings.catch_warnings():
    # JAX 0.11 deprecates the Triton backend of Pallas; it still works.
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    out = pl.pallas_call(
        kernel,
        out_shape=out_shape,
        grid=grid,
        compiler_params=compiler_params(
            num_warps=c.num_warps, num_stages=c.num_stages),
        interpret=interpret,
        name=f"wavetune_matmul_{c.block_m}x{c.block_n}x{c.block_k}",
    )(x, w)
  if c.split_k > 1:
    out = out.sum(axis=0).astype(out_dtype)
  return out
