"""The weight-only quantized GEMM family: ``y = (x @ w) * scales`` with 8-bit ``w``."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from wavetune_jax.core.family import Call, Family
from wavetune_jax.core.partition import PartitionRule
from wavetune_jax.families.matmul.family import (_out_dtype, check_operands, gemm_weights,
                                                 operand)
from wavetune_jax.families.qmatmul.problem import DTYPES, WEIGHT_DTYPES, QMatmulProblem

__all__ = ["QMatmulFamily"]


class QMatmulFamily(Family):
  """Weight-only 8-bit GEMM (int8 or float8_e4m3fn weights, a float32 scale
  per output channel, bfloat16 / float16 activations, fp32 accumulation);
  XLA's dot on the converted weight is the baseline and the platform op."""

  name = "qmatmul"
  problem_cls = QMatmulProblem
  size_field = "m"
  baseline_name = "XLA"
  heuristic_margin = 1.0
  guard_rule = {"weight_radius": 1.0, "size_radius": 0.5, "win": 0.97}
  # No sweep or table yet: the guard and first-use refinement decide.
  tables_shipped = False

  # --- the call ------------------------------------------------------------------------
  def bind(self, x, w, scales, *, out_dtype=None):
    """Checks ``x [M, K]``, ``w [K, N]`` and ``scales [N]``; the problem."""
    x, w, scales = operand("x", x), operand("w", w), operand("scales", scales)
    check_operands(x, w)
    if x.dtype.name not in DTYPES:
      raise ValueError(f"x.dtype={x.dtype} must be one of {DTYPES}")
    if w.dtype.name not in WEIGHT_DTYPES:
      raise ValueError(f"w.dtype={w.dtype} must be one of {WEIGHT_DTYPES} (a quantized "
                       f"weight; use wavetune_jax.matmul for 16-bit weights)")
    if scales.shape != (w.shape[1],):
      raise ValueError(f"scales must have shape [N] = ({w.shape[1]},), one per output "
                       f"channel; got {scales.shape}")
    if not jnp.issubdtype(scales.dtype, jnp.floating):
      raise ValueError(f"scales must be floating point (float32); got {scales.dtype}")
    out = _out_dtype(x.dtype, out_dtype)
    (m, k), n = x.shape, w.shape[1]
    if m == 0 or n == 0 or k == 0:
      return jnp.zeros((m, n), out)
    problem = QMatmulProblem(m=m, n=n, k=k, dtype=x.dtype.name, w_dtype=w.dtype.name,
                             out_dtype=out.name)
    return Call(problem, (x, w, scales.astype(jnp.float32)), {}, ("scales",))

  def partition_rule(self, problem):
    """Rows, columns and K split like XLA's dot (a channel's scale is
    linear over the K partials); the scales split with the columns."""
    return PartitionRule("m k, k n, n -> m n", reduction=("k",))

  def trusted_without_evidence(self, problem: QMatmulProblem, config, platform) -> bool:
    """The Mosaic kernel over XLA's GEMM at one row (a decode step of one
    sequence): on an H100 it ran 1.17-1.81x XLA's on all ten problems
    measured (five weights, int8 and e4m3; ``benchmarks/weight_only.py``).
    At 16 rows XLA's own fused GEMM ran at 0.96-1.06x of it, so other row
    counts need a table's evidence or first-use measurement."""
    from pallas_kernels.matmul.mosaic import MosaicMatmulConfig
    from wavetune_jax.families.qmatmul.backends import XlaQMatmulConfig
    return (problem.m == 1 and isinstance(config, MosaicMatmulConfig)
            and isinstance(platform, XlaQMatmulConfig))

  # --- problems ------------------------------------------------------------------------
  def problems_from_suite(self, suite, *, weights=None, sizes=None, dtype="bfloat16"):
    """``suite["gemm"]``'s weights in int8 and float8_e4m3fn at every M."""
    ws = gemm_weights(suite, weights)
    ms = suite["gemm"]["M"] if sizes is None else sizes
    return [QMatmulProblem(m=m, n=n, k=k, dtype=dtype, w_dtype=wd)
            for n, k in ws.values() for wd in WEIGHT_DTYPES for m in ms]

  def problem_key(self, problem: QMatmulProblem) -> str:
    p = problem
    return f"{p.m}x{p.n}x{p.k}:{p.dtype}:w{p.w_dtype}:{p.out_dtype}"

  def inputs(self, problem: QMatmulProblem, key: jax.Array):
    """``(x, w, scales)``: int8 weights uniform in [-127, 127], e4m3 ones a
    normal times 64 (most of e4m3's range); scales about ``1 / (127 sqrt(K))``."""
    p = problem
    kx, kw, ks = jax.random.split(key, 3)
    x = jax.random.normal(kx, (p.m, p.k), jnp.float32).astype(jnp.dtype(p.dtype))
    if p.w_dtype == "int8":
      w = jax.random.randint(kw, (p.k, p.n), -127, 128, jnp.int32).astype(jnp.int8)
    else:
      w = (jax.random.normal(kw, (p.k, p.n), jnp.float32) * 64).astype(jnp.float8_e4m3fn)
    s = jax.random.uniform(ks, (p.n,), jnp.float32, 0.5, 1.5) / (127 * math.sqrt(p.k))
    return x, w, s

  def reference(self, problem: QMatmulProblem, x, w, scales):
    """``x @ (w * scales)`` in float32 at highest precision."""
    return jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32) * scales.astype(jnp.float32),
                   precision=jax.lax.Precision.HIGHEST)

  def baseline(self, problem: QMatmulProblem):
    from wavetune_jax.families.qmatmul.backends import xla_qmatmul
    out = jnp.dtype(problem.out_dtype)
    return lambda x, w, s: xla_qmatmul(x, w, s, out)

  def extra_baselines(self, problem: QMatmulProblem) -> dict:
    from wavetune_jax.families.qmatmul.backends import xla_dequantize_dot
    out = jnp.dtype(problem.out_dtype)
    return {"xla_dequantize": lambda x, w, s: xla_dequantize_dot(x, w, s, out)}

  def tolerance(self, problem: QMatmulProblem) -> float:
    return 1e-2

  def default(self, problem: QMatmulProblem):
    from wavetune_jax.families.qmatmul.backends import XlaQMatmulConfig
    return XlaQMatmulConfig()
