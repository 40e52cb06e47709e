"""The GEMM family: ``y[M, N] = x[M, K] @ w[K, N]``."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from pallas_kernels.matmul.reference import matmul_reference
from pallas_kernels.matmul.triton import SUPPORTED_DTYPES
from wavetune_jax.core.family import Call, Family
from wavetune_jax.core.partition import PartitionRule
from wavetune_jax.families.matmul.problem import OUT_DTYPES, MatmulProblem
from wavetune_jax.shapes import suite_entries

__all__ = ["MatmulFamily", "gemm_weights", "operand"]


def gemm_weights(suite: dict, names=None) -> dict[str, tuple[int, int]]:
  """``{weight name: (N, K)}`` of a suite's GEMM section, optionally filtered."""
  found = suite_entries(suite, "gemm", "weights", names)
  return {k: (v["N"], v["K"]) for k, v in found.items()}


def operand(name: str, value) -> jax.Array:
  """``value`` (an array, a NumPy array, nested lists, a scalar) as a JAX
  array; the op arguments' one conversion.

  Raises:
    ValueError: ``value`` is not array-like (None, a string, a ragged list, a
      ``ShapeDtypeStruct``); the message names the argument ``name``.
  """
  if isinstance(value, jax.Array):  # arrays and tracers: the trace-time path
    return value
  try:
    return jnp.asarray(value)
  except (TypeError, ValueError) as e:
    why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    raise ValueError(f"{name} must be an array; got {type(value).__name__} {value!r:.80} "
                     f"({why})") from None


def quantized_hint(op: str, *dtypes) -> str:
  """``" (... : op)"`` where any of ``dtypes`` is an 8- or 4-bit type (a
  quantized weight or FP8 activations; not bool), else ``""``: an error's
  pointer to the quantized ops."""
  if any((jnp.dtype(d).itemsize == 1 and jnp.dtype(d) != jnp.bool_)
         or jnp.dtype(d).name in ("int4", "uint4") for d in dtypes):
    return f" (8- and 4-bit weights and FP8 activations, with their scales: {op})"
  return ""


def check_operands(x, w) -> None:
  """Ranks and inner dimensions of ``x [M, K] @ w [K, N]`` (one-line errors)."""
  if x.ndim != 2:
    raise ValueError(f"x must have rank 2 ([M, K]); got x.shape={x.shape}")
  if w.ndim != 2:
    raise ValueError(f"w must have rank 2 ([K, N]); got w.shape={w.shape}")
  if x.shape[1] != w.shape[0]:
    raise ValueError(f"inner dimensions differ: x.shape={x.shape} and w.shape={w.shape} "
                     f"(x.shape[1] must equal w.shape[0])")


def _out_dtype(x_dtype, out_dtype) -> jnp.dtype:
  if out_dtype is None:
    return jnp.dtype(x_dtype)
  try:
    dt = jnp.dtype(out_dtype)
  except TypeError:
    dt = None
  if dt is None or dt.name not in OUT_DTYPES:
    raise ValueError(f"out_dtype={dt.name if dt is not None else repr(out_dtype)} must be "
                     f"one of {OUT_DTYPES}")
  return dt


class MatmulFamily(Family):
  """GEMM with fp32 accumulation; XLA's ``jnp.dot`` is the baseline."""

  name = "matmul"
  problem_cls = MatmulProblem
  size_field = "m"
  aux_names = ("split_k_launch", "split_k_partial_mb")
  # The heuristic is XLA's dot. The model replaces it only when it predicts
  # more than a 2x gain. On the three-backend sweeps (78 suite problems with
  # every backend's rows; benchmarks/table_vs_sweep.py, shipped tables) a
  # margin of 0.3 ran at 0.985x / 0.983x XLA (H100 / H200: the sparse models
  # pick slower configs where they are over-optimistic), 1.0 at 1.004x /
  # 0.997x (XLA, or exact measured wins); the best of the three backends per
  # problem is 1.042x / 1.056x.
  heuristic_margin = 1.0
  baseline_name = "XLA"
  # The guard's rule: held-out replays of both GPUs' sweeps (5 splits;
  # benchmarks/guard_radius.py, docs/design.md "The guard").
  guard_rule = {"weight_radius": 1.0, "size_radius": 0.5, "win": 0.97}
  # Sweeps and anchor logs recorded before configs named their backend hold
  # Triton configs only.
  legacy_default_backend = "triton"

  def work(self, p: MatmulProblem) -> tuple[float, float]:
    """FLOPs, and the bytes of the operands read once and the output
    written once."""
    return (2.0 * p.m * p.n * p.k,
            float((p.m * p.k + p.k * p.n) * p.itemsize
                  + p.m * p.n * jnp.dtype(p.out_dtype).itemsize))

  # --- the call ------------------------------------------------------------------------
  def bind(self, x, w, *, out_dtype=None):
    """Checks ``x [M, K]`` and ``w [K, N]``; the problem of ``x @ w``."""
    x, w = operand("x", x), operand("w", w)
    check_operands(x, w)
    hint = quantized_hint("wt.quantized_matmul", x.dtype, w.dtype)
    if x.dtype != w.dtype:
      raise ValueError(f"x.dtype={x.dtype} and w.dtype={w.dtype} must be the same{hint}")
    if x.dtype not in [jnp.dtype(d) for d in SUPPORTED_DTYPES]:
      raise ValueError(f"x.dtype={x.dtype} is not supported; use one of "
                       f"{[jnp.dtype(d).name for d in SUPPORTED_DTYPES]}{hint}")
    out = _out_dtype(x.dtype, out_dtype)
    (m, k), n = x.shape, w.shape[1]
    if m == 0 or n == 0 or k == 0:
      # What jnp.dot gives: an empty result, or zeros when only K is empty.
      return jnp.zeros((m, n), out)
    problem = MatmulProblem(m=m, n=n, k=k, dtype=x.dtype.name, out_dtype=out.name)
    return Call(problem, (x, w), {})

  def partition_rule(self, problem):
    """Rows, columns and K split like XLA's dot; K partials summed in the
    output dtype, as XLA's partitioner sums a dot's (float32 partials
    doubled the all-reduce of a tensor-parallel layer's row-parallel GEMMs)."""
    return PartitionRule("m k, k n -> m n", reduction=("k",))

  # --- problems ------------------------------------------------------------------------
  def problems_from_suite(self, suite, *, weights=None, sizes=None, dtype="bfloat16"):
    """``suite["gemm"]``: every weight (N, K) at every token count M."""
    ws = gemm_weights(suite, weights)
    ms = suite["gemm"]["M"] if sizes is None else sizes
    return [MatmulProblem(m=m, n=n, k=k, dtype=dtype) for n, k in ws.values() for m in ms]

  def problem_key(self, problem: MatmulProblem) -> str:
    return f"{problem.m}x{problem.n}x{problem.k}:{problem.dtype}:{problem.out_dtype}"

  def weight_of(self, problem: MatmulProblem) -> tuple:
    """Every field but M (a fast path of the generic version: trace-time cost)."""
    return (("dtype", problem.dtype), ("k", problem.k), ("n", problem.n),
            ("out_dtype", problem.out_dtype))

  def inputs(self, problem: MatmulProblem, key: jax.Array):
    kx, kw = jax.random.split(key)
    dt = jnp.dtype(problem.dtype)
    x = jax.random.normal(kx, (problem.m, problem.k), jnp.float32).astype(dt)
    w = (jax.random.normal(kw, (problem.k, problem.n), jnp.float32)
         / math.sqrt(problem.k)).astype(dt)
    return x, w

  def reference(self, problem: MatmulProblem, x, w):
    return matmul_reference(x, w, jnp.float32)

  def baseline(self, problem: MatmulProblem):
    out_dtype = jnp.dtype(problem.out_dtype)

    def f(x, w):
      return jnp.dot(x, w, preferred_element_type=out_dtype)
    return f

  def tolerance(self, problem: MatmulProblem) -> float:
    return 1e-3 if problem.dtype == "float32" and problem.out_dtype == "float32" else 1e-2

  def default(self, problem: MatmulProblem):
    """The fixed config an untuned library would use (Triton tutorial style)."""
    from wavetune_jax.families.matmul.triton import TritonMatmulConfig
    bk = 64 if problem.k >= 64 else 32
    return TritonMatmulConfig(block_m=128, block_n=128, block_k=bk, split_k=1,
                              group_m=8, num_warps=4, num_stages=3)
