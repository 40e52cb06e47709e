"""The quantized GEMM family: ``y = (x @ w) * scales`` with 8-bit ``w``
(weight-only), ``(x @ w) * x_scales[:, None] * scales`` with e4m3 ``x``
too (W8A8-FP8), and ``x @ dequant(w).T`` with an int4 ``w [N, K]`` and a
scale per group of K values (W4A16)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from wavetune_jax.core.family import Call, Family
from wavetune_jax.core.partition import PartitionRule
from wavetune_jax.families.matmul.family import (_out_dtype, check_operands, gemm_weights,
                                                 operand)
from wavetune_jax.families.qmatmul.problem import (DTYPES, INT4, W_LAYOUTS, WEIGHT_DTYPES,
                                                   QMatmulProblem)

__all__ = ["QMatmulFamily", "check_activation_scales"]

#: K from which the swapped weight-only kernel (``w [N, K]``) is trusted over
#: XLA's GEMM at one row (:meth:`QMatmulFamily.trusted_without_evidence`).
NK_TRUSTED_MIN_K = 4096
#: N from which the int4 kernel on chunks of 64 rows (65-128 rows) is trusted
#: over XLA's GEMM on the dequantized weight.
INT4_CHUNKED_MIN_N = 4096
#: The FP8 kernel's 128 x 192 tiles are trusted over XLA's FP8 dot where
#: their CTAs fill their waves at least this far (the share of the waves' SM
#: slots they take): 1.00-1.70x XLA's on all 24 such problems measured on an
#: H200 (0.91-1.00), 0.97-0.98x on the three below it (0.73-0.86) ...
WIDE_TRUSTED_FILL = 0.9
#: ... or where they fit one wave at least this full: 1.06-1.68x on all 7
#: such problems measured (0.73-1.00 of the SMs) ...
WIDE_TRUSTED_ONE_WAVE = 0.7
#: ... and where the rows fill their 128-row tiles at least this far (the
#: fewest measured, 200 rows in two tiles, 0.78, ran 1.003x; short M, where
#: a tile is mostly empty, was not measured).
WIDE_TRUSTED_ROWS = 0.75


def check_activation_scales(x, w, x_scales, out_dtype, weight: str):
  """``(x_scales, out dtype)`` of a quantized GEMM's call: e4m3 ``x`` (W8A8)
  takes ``weight`` in e4m3 and floating ``x_scales [M]`` (returned as an
  array), 16-bit ``x`` none (None); the output defaults to bfloat16 for W8A8,
  else ``x``'s dtype. One-line ``ValueError`` otherwise."""
  m = x.shape[0]
  fp8 = x.dtype.name == "float8_e4m3fn"
  if fp8:
    if w.dtype.name != "float8_e4m3fn":
      raise ValueError(f"e4m3 activations take {weight} (W8A8-FP8); got w.dtype={w.dtype}")
    if x_scales is None:
      raise ValueError("e4m3 activations need x_scales [M], one float32 scale per row "
                       "(wavetune_jax.quantize_rows makes both)")
    x_scales = operand("x_scales", x_scales)
    if x_scales.shape != (m,) or not jnp.issubdtype(x_scales.dtype, jnp.floating):
      raise ValueError(f"x_scales must be a floating [M] = ({m},) array, one per row; got "
                       f"{x_scales.shape} {x_scales.dtype}")
  elif x_scales is not None:
    raise ValueError(f"x_scales is for e4m3 activations (W8A8); x is {x.dtype}")
  return x_scales, _out_dtype(jnp.bfloat16 if fp8 else x.dtype, out_dtype)


class QMatmulFamily(Family):
  """Quantized GEMM: weight-only (int8 or float8_e4m3fn weights, a float32
  scale per output channel, bfloat16 / float16 activations), W8A8-FP8 (e4m3
  activations with a float32 scale per row too) or W4A16 (int4 ``[N, K]``
  weights, a float32 scale per group of K values); fp32 accumulation. XLA's
  dot (on the converted or dequantized weight, or on the e4m3 operands) is
  the baseline and the platform op."""

  name = "qmatmul"
  problem_cls = QMatmulProblem
  size_field = "m"
  baseline_name = "XLA"
  heuristic_margin = 1.0
  guard_rule = {"weight_radius": 1.0, "size_radius": 0.5, "win": 0.97}
  # Tables for the H100 and H200 only (GPU tunes over part of the suite): no
  # warning where none ships; the guard and first-use refinement decide there.
  tables_shipped = False

  # --- the call ------------------------------------------------------------------------
  def bind(self, x, w, scales, *, x_scales=None, w_layout="kn", out_dtype=None):
    """Checks ``x [M, K]``, ``w [K, N]`` (``[N, K]`` with ``w_layout="nk"``),
    ``scales [N]`` (``[K // group, N]`` for an int4 ``w``, which is ``[N,
    K]``) and, for e4m3 ``x``, ``x_scales [M]``; the problem."""
    if w_layout not in W_LAYOUTS:
      raise ValueError(f"w_layout={w_layout!r} must be one of {W_LAYOUTS} (w as [K, N] or "
                       f"[N, K])")
    given = getattr(x, "dtype", None)  # before the conversion (float64 -> float32)
    x, w, scales = operand("x", x), operand("w", w), operand("scales", scales)
    if w_layout == "kn":
      if (x.ndim == 2 and w.ndim == 2 and x.shape[1] != w.shape[0]
          and x.shape[1] == w.shape[1]):
        raise ValueError(f"inner dimensions differ: x.shape={x.shape} and w.shape={w.shape}; "
                         f"w looks [N, K] (from quantize_weight(..., layout='nk')?): pass "
                         f"w_layout='nk'")
      check_operands(x, w)
    elif x.ndim != 2 or w.ndim != 2 or x.shape[1] != w.shape[1]:
      raise ValueError(f"need x [M, K] and w [N, K] (w_layout='nk'); got x.shape={x.shape}, "
                       f"w.shape={w.shape}")
    if x.dtype.name not in DTYPES:
      raise ValueError(f"x.dtype={given if given is not None else x.dtype} must be one of "
                       f"{DTYPES}")
    if w.dtype.name not in WEIGHT_DTYPES + (INT4,):
      raise ValueError(f"w.dtype={w.dtype} must be one of {WEIGHT_DTYPES + (INT4,)} (a "
                       f"quantized weight; use wavetune_jax.matmul for 16-bit weights)")
    (m, k), n = x.shape, w.shape[1] if w_layout == "kn" else w.shape[0]
    group = 0
    if w.dtype.name == INT4:
      if w_layout != "nk":
        raise ValueError("int4 weights are [N, K]: pass w_layout='nk' (quantize_weight(w, "
                         "'int4', layout='nk') gives that layout)")
      if k and (scales.ndim != 2 or scales.shape[1] != n or not scales.shape[0]
                or k % scales.shape[0]):
        raise ValueError(f"an int4 w [N, K] = {w.shape} takes scales [K // group, N], one per "
                         f"group of K values of each channel; got {scales.shape}")
      group = k // scales.shape[0] if k else 0
    elif scales.shape != (n,):
      raise ValueError(f"scales must have shape [N] = ({n},), one per output channel; got "
                       f"{scales.shape}")
    if not jnp.issubdtype(scales.dtype, jnp.floating):
      raise ValueError(f"scales must be floating point (float32); got {scales.dtype}")
    fp8 = x.dtype.name == "float8_e4m3fn"
    x_scales, out = check_activation_scales(x, w, x_scales, out_dtype, "an e4m3 weight")
    if m == 0 or n == 0 or k == 0:
      return jnp.zeros((m, n), out)
    problem = QMatmulProblem(m=m, n=n, k=k, dtype=x.dtype.name, w_dtype=w.dtype.name,
                             out_dtype=out.name, w_layout=w_layout, group_size=group)
    if fp8:
      return Call(problem, (x, w, scales.astype(jnp.float32), x_scales.astype(jnp.float32)),
                  {}, ("scales", "x_scales"))
    return Call(problem, (x, w, scales.astype(jnp.float32)), {}, ("scales",))

  def partition_rule(self, problem: QMatmulProblem):
    """Rows, columns and K split like XLA's dot (a channel's scale is
    linear over the K partials); the scales split with the columns, the
    rows' scales with the rows, an int4 weight's group scales with the
    columns and K's groups."""
    if problem.group_size:  # int4: K is (groups, values of a group); scales [groups, N]
      return PartitionRule("m (k r), n (k r), k n -> m n",
                           factor_sizes={"r": problem.group_size}, reduction=("k",))
    w = "k n" if problem.w_layout == "kn" else "n k"
    return PartitionRule(f"m k, {w}, n{', m' if problem.w8a8 else ''} -> m n",
                         reduction=("k",))

  def trusted_without_evidence(self, problem: QMatmulProblem, config, platform,
                               hw=None) -> bool:
    """The Mosaic kernel over XLA's GEMM at one row (a decode step of one
    sequence) where its CTAs (column tiles times K splits) fit one wave of
    ``hw``'s SMs: on an H100 it ran 1.17-1.81x XLA's on all ten problems
    measured (five weights, int8 and e4m3; ``benchmarks/weight_only.py``)
    and 1.10-2.33x on seven of the unseen models' int8 weights
    (``benchmarks/unseen_models.py --families qmatmul``); the eighth,
    Qwen2.5-7B's gate/up (148 column tiles of 256: two waves, the second of
    16), ran 0.95x. At 16 rows XLA's own fused GEMM ran at 0.96-1.06x of it,
    so other row counts need a table's evidence or first-use measurement.

    Weight-only ``[N, K]`` (the swapped kernel): at one row where K >=
    :data:`NK_TRUSTED_MIN_K`, 1.09-1.66x XLA's best on all eight such
    problems measured on an H100 (four weights, int8 and e4m3;
    ``benchmarks/weight_only.py --layout nk``); with K = 1,536 it ran
    0.89-0.92x, and at 16 rows 0.98-1.25x, left to evidence.

    W8A8-FP8: the FP8 kernel over XLA's FP8 dot where its rule gives more
    than a wave of 128 x 256 tiles (bands of 8; 3 stages, no K split): 1.10-1.72x
    on all 12 such problems measured on an H100 (``benchmarks/fp8_gemm.py``);
    with fewer tiles its margin was 0.97-1.22x, left to evidence. Where the rule gives
    128 x 192 tiles (an H200's rule, ``fp8.WIDE_TILES``): where their CTAs
    fill their waves at least :data:`WIDE_TRUSTED_FILL`, or fit one wave at
    least :data:`WIDE_TRUSTED_ONE_WAVE` full, and the rows fill their tiles
    at least :data:`WIDE_TRUSTED_ROWS`, 1.00-1.70x on all 31 such problems
    measured on an H200 (``benchmarks/fp8_gemm.py --rule-set`` and
    ``--rule-only --vs-xla``); over several waves filled less (0.73-0.86 of
    their SM slots) 0.97-0.98x on the three measured, left to evidence. Only
    the measured config is trusted: 4 stages, no K split, bfloat16 output,
    on :data:`pallas_kernels.matmul.fp8.WIDE_TILE_GPUS`. (As every trust
    here, it is asked where the tables' evidence refuses a config.)

    W4A16 (int4 ``[N, K]``, scales per group): the kernel up to 64 rows,
    where XLA's GEMM on the weight dequantized first ran 1.97-6.89x slower
    on all 18 problems measured on an H100 (five weights at 1 / 16 / 64 rows
    in groups of 128, one weight at three row counts in groups of 64;
    ``benchmarks/weight_only.py --weights int4``); from 65 to 128 rows (two
    chunks of 64, each reading the weight) where N >=
    :data:`INT4_CHUNKED_MIN_N`: 1.68-2.66x on those four of five weights at
    128 rows, the fifth (N = 1,536) 1.03x, left to evidence.

    Except int4 (whose margins are 1.7-6.9x), only the rule's config
    (``heuristic``) is trusted, on the GPU given, as measured: the wave model
    ranks other configs of the same tiles too (a banded 128 x 256 config at
    a few hundred rows, where the H200 table's evidence had the kernel at
    0.83x XLA's on a near shape; a K split that leaves most SMs idle at
    one row)."""
    from pallas_kernels.matmul.mosaic import MosaicMatmulConfig
    from wavetune_jax.families.qmatmul.backends import XlaQMatmulConfig
    if not (isinstance(config, MosaicMatmulConfig) and isinstance(platform, XlaQMatmulConfig)):
      return False
    if problem.w_dtype != INT4 and (hw is None or config != self.backend("mosaic").heuristic(
        problem, hw)):
      return False  # only the rule's config was measured against XLA's
    if problem.w8a8:
      tile = (config.block_m, config.block_n)
      if tile == (128, 192):
        from pallas_kernels.matmul.fp8 import WIDE_TILE_GPUS
        if (hw.device_key not in WIDE_TILE_GPUS or config.split_k != 1
            or config.num_stages != 4 or problem.out_dtype != "bfloat16"):
          return False  # only what was measured
        row_tiles = -(-problem.m // 128)
        if problem.m < WIDE_TRUSTED_ROWS * row_tiles * 128:
          return False
        ctas = row_tiles * -(-problem.n // 192)
        fill = ctas / (-(-ctas // hw.num_sms) * hw.num_sms)
        return fill >= (WIDE_TRUSTED_ONE_WAVE if ctas <= hw.num_sms else WIDE_TRUSTED_FILL)
      if tile != (128, 256) or config.split_k != 1 or problem.out_dtype != "bfloat16":
        return False
      # Past a wave of tiles (bands of 8), as measured.
      return -(-problem.m // 128) * -(-problem.n // 256) > hw.num_sms
    if problem.w_dtype == INT4:
      return problem.m <= 64 or problem.n >= INT4_CHUNKED_MIN_N
    if problem.w_layout == "nk":
      return problem.m == 1 and problem.k >= NK_TRUSTED_MIN_K
    ctas = -(-problem.n // config.block_n) * config.split_k
    return problem.m == 1 and ctas <= hw.num_sms

  # --- problems ------------------------------------------------------------------------
  def problems_from_suite(self, suite, *, weights=None, sizes=None, dtype="bfloat16"):
    """``suite["gemm"]``'s weights at every M: with ``dtype`` bfloat16 or
    float16, in int8 and float8_e4m3fn under those activations (weight-only)
    and W8A8-FP8 (e4m3 activations, the weight ``[N, K]``); with
    ``dtype="float8_e4m3fn"`` the W8A8 problems only."""
    ws = gemm_weights(suite, weights)
    ms = suite["gemm"]["M"] if sizes is None else sizes
    name = jnp.dtype(dtype).name
    if name not in DTYPES:
      raise ValueError(f"dtype={dtype!r} must be one of {DTYPES} for the qmatmul suite")
    w8a8 = [QMatmulProblem(m=m, n=n, k=k, dtype="float8_e4m3fn", w_dtype="float8_e4m3fn",
                           w_layout="nk") for n, k in ws.values() for m in ms]
    if name == "float8_e4m3fn":
      return w8a8
    return [QMatmulProblem(m=m, n=n, k=k, dtype=dtype, w_dtype=wd)
            for n, k in ws.values() for wd in WEIGHT_DTYPES for m in ms] + w8a8

  def problem_key(self, problem: QMatmulProblem) -> str:
    p = problem
    nk = ":nk" if p.w_layout == "nk" else ""
    group = f":g{p.group_size}" if p.group_size else ""
    return f"{p.m}x{p.n}x{p.k}:{p.dtype}:w{p.w_dtype}:{p.out_dtype}{nk}{group}"

  def inputs(self, problem: QMatmulProblem, key: jax.Array):
    """``(x, w, scales[, x_scales])``: int8 weights uniform in [-127, 127],
    e4m3 ones a normal times 64 (most of e4m3's range); scales about ``1 /
    (127 sqrt(K))``; e4m3 activations a normal times 64 with scales about
    1 / 64."""
    p = problem
    kx, kw, ks, kr = jax.random.split(key, 4)
    x = jax.random.normal(kx, (p.m, p.k), jnp.float32)
    # e4m3 has no infinity: past 448 a cast gives NaN.
    x = (jnp.clip(x * 64, -448, 448) if p.w8a8 else x).astype(jnp.dtype(p.dtype))
    wshape = (p.k, p.n) if p.w_layout == "kn" else (p.n, p.k)
    if p.w_dtype == INT4:
      w = jax.random.randint(kw, wshape, -8, 8, jnp.int32).astype(jnp.int4)
      s = jax.random.uniform(ks, (p.k // p.group_size, p.n), jnp.float32, 0.5,
                             1.5) / (7 * math.sqrt(p.k))
      return x, w, s
    if p.w_dtype == "int8":
      w = jax.random.randint(kw, wshape, -127, 128, jnp.int32).astype(jnp.int8)
    else:
      w = jnp.clip(jax.random.normal(kw, wshape, jnp.float32) * 64, -448,
                   448).astype(jnp.float8_e4m3fn)
    s = jax.random.uniform(ks, (p.n,), jnp.float32, 0.5, 1.5) / (127 * math.sqrt(p.k))
    if p.w8a8:
      return x, w, s, jax.random.uniform(kr, (p.m,), jnp.float32, 0.5, 1.5) / 64
    return x, w, s

  def reference(self, problem: QMatmulProblem, x, w, scales, x_scales=None):
    """The float32 product of the dequantized operands, at highest precision."""
    from wavetune_jax.families.qmatmul.backends import dequantized_product
    return dequantized_product(x, w, scales, x_scales, problem.w_layout)

  def baseline(self, problem: QMatmulProblem):
    from wavetune_jax.families.qmatmul.backends import xla_qmatmul
    out, layout = jnp.dtype(problem.out_dtype), problem.w_layout
    return lambda x, w, s, xs=None: xla_qmatmul(x, w, s, out, x_scales=xs, w_layout=layout)

  def extra_baselines(self, problem: QMatmulProblem) -> dict:
    from wavetune_jax.families.qmatmul.backends import xla_dequantize_dot
    if problem.w8a8 or problem.w_layout != "kn":
      return {}
    out = jnp.dtype(problem.out_dtype)
    return {"xla_dequantize": lambda x, w, s: xla_dequantize_dot(x, w, s, out)}

  def tolerance(self, problem: QMatmulProblem) -> float:
    """1e-2 (that of a bfloat16 GEMM); 2e-2 for W8A8, whose FP8 MMA keeps
    fewer accumulator bits between K blocks."""
    return 2e-2 if problem.w8a8 else 1e-2

  def default(self, problem: QMatmulProblem):
    from wavetune_jax.families.qmatmul.backends import XlaQMatmulConfig
    return XlaQMatmulConfig()
