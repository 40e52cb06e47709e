"""The quantized grouped-GEMM family: ``lax.ragged_dot`` with 8-bit expert
weights (weight-only), or with e4m3 activations too (W8A8-FP8)."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._integers import shape_and_dtype
from pallas_kernels.ragged_dot.worklist import clip_sizes
from wavetune_jax.core.family import Call, Family
from wavetune_jax.core import partition
from wavetune_jax.core.partition import PartitionRule
from wavetune_jax.families.matmul.family import operand
from wavetune_jax.families.qmatmul.family import check_activation_scales
from wavetune_jax.families.qragged_dot.problem import (DTYPES, W_LAYOUTS, WEIGHT_DTYPES,
                                                       QRaggedDotProblem)
from wavetune_jax.families.ragged_dot import routing
from wavetune_jax.families.ragged_dot.family import RaggedDotFamily, expert_weights, fold_batch

__all__ = ["QRaggedDotFamily", "WEIGHT_ONLY_BUSY", "WEIGHT_ONLY_BUSY_TRUSTED_GPUS",
           "WEIGHT_ONLY_DENSE_ROWS"]

#: XLA's ragged dot on this JAX runs its dense form, every expert's GEMM on
#: every row: below ``m * g`` = this many rows, with nearly every expert busy
#: (more than :data:`WEIGHT_ONLY_BUSY` of them expected to get rows), its time
#: is the weight read the weight-only kernel also does, and the kernel is not
#: trusted over it without evidence
#: (:meth:`QRaggedDotFamily.trusted_without_evidence`).
WEIGHT_ONLY_DENSE_ROWS = 512
WEIGHT_ONLY_BUSY = 0.8
#: GPUs where the kernel is trusted there all the same: on an H100 the rule
#: ran 1.09-1.15x XLA's at 32 rows of Mixtral-8x7B's 8 experts (int8 and
#: e4m3), where an H200 ran it 0.98-1.12x.
WEIGHT_ONLY_BUSY_TRUSTED_GPUS = ("nvidia_h100_80gb_hbm3",)


class QRaggedDotFamily(Family):
  """Grouped GEMM on 8-bit expert weights with a float32 scale per expert and
  output channel: weight-only (int8 or float8_e4m3fn weights, bfloat16 /
  float16 activations) or W8A8-FP8 (e4m3 activations with a float32 scale
  per row too); fp32 accumulation, rows grouped contiguously by expert. XLA's
  ragged dot (on the converted weights, or on the e4m3 operands) is the
  baseline and the platform op."""

  name = "qragged_dot"
  problem_cls = QRaggedDotProblem
  size_field = "m"
  baseline_name = "XLA"
  explicit_mesh_note = RaggedDotFamily.explicit_mesh_note   # (the same XLA op there)
  heuristic_margin = 1.0
  guard_rule = {"weight_radius": math.inf, "size_radius": 1.0, "win": 0.97}
  # Tables for the H100 and H200 only (GPU tunes, no sweep): no warning where
  # none ships; the guard and first-use refinement decide there.
  tables_shipped = False
  skew = routing.BALANCED

  def work(self, p) -> tuple[float, float]:
    """FLOPs, and the bytes of the rows, of the experts at least one row can
    reach and of the output."""
    return (2.0 * p.m * p.n * p.k,
            float(p.m * p.k * p.itemsize + min(p.g, p.m) * p.k * p.n
                  + p.m * p.n * jnp.dtype(p.out_dtype).itemsize))

  # --- the call ------------------------------------------------------------------------
  def bind(self, x, w, scales, group_sizes, *, x_scales=None, w_layout="kn", out_dtype=None):
    """Checks ``x [M, K]``, ``w [G, K, N]`` (``[G, N, K]`` with
    ``w_layout="nk"``), ``scales [G, N]``, ``group_sizes [G]`` and, for e4m3
    ``x``, ``x_scales [M]``; the problem."""
    if w_layout not in W_LAYOUTS:
      raise ValueError(f"w_layout={w_layout!r} must be one of {W_LAYOUTS} (w as [G, K, N] "
                       f"or [G, N, K])")
    given = getattr(x, "dtype", None)  # before the conversion (float64 -> float32)
    x, w, scales = operand("x", x), operand("w", w), operand("scales", scales)
    gs_shape, gs_dtype = shape_and_dtype(group_sizes, name="group_sizes")
    if x.ndim != 2:
      raise ValueError(f"x must have rank 2 ([M, K]); got x.shape={x.shape}")
    if w.ndim != 3:
      raise ValueError(f"w must have rank 3 ([G, K, N], or [G, N, K] with w_layout='nk'); "
                       f"got w.shape={w.shape}")
    kdim = 1 if w_layout == "kn" else 2
    if x.shape[1] != w.shape[kdim]:
      other = 3 - kdim
      hint = (f"; w looks {'[G, N, K]' if kdim == 1 else '[G, K, N]'}: pass "
              f"w_layout={'nk' if kdim == 1 else 'kn'!r}" if x.shape[1] == w.shape[other]
              else "")
      raise ValueError(f"contracting dimensions differ: x.shape={x.shape} and w.shape="
                       f"{w.shape} (w_layout={w_layout!r}: x.shape[1] must equal "
                       f"w.shape[{kdim}]){hint}")
    if x.dtype.name not in DTYPES:
      raise ValueError(f"x.dtype={given if given is not None else x.dtype} must be one of "
                       f"{DTYPES}")
    if w.dtype.name not in WEIGHT_DTYPES:
      raise ValueError(f"w.dtype={w.dtype} must be one of {WEIGHT_DTYPES} (quantized expert "
                       f"weights; use wavetune_jax.ragged_dot for 16-bit weights)")
    (m, k), g = x.shape, w.shape[0]
    n = w.shape[3 - kdim]
    if gs_shape != (g,):
      raise ValueError(f"group_sizes must have shape [G] = ({g},) (G = w.shape[0]); got "
                       f"group_sizes.shape={gs_shape}")
    if gs_dtype == np.bool_ or not jnp.issubdtype(gs_dtype, jnp.integer):
      raise ValueError(f"group_sizes must be integers; got {gs_dtype}")
    if scales.shape != (g, n):
      raise ValueError(f"scales must have shape [G, N] = ({g}, {n}), one per expert and "
                       f"output channel; got {scales.shape}")
    if not jnp.issubdtype(scales.dtype, jnp.floating):
      raise ValueError(f"scales must be floating point (float32); got {scales.dtype}")
    fp8 = x.dtype.name == "float8_e4m3fn"
    x_scales, out = check_activation_scales(x, w, x_scales, out_dtype, "e4m3 weights")
    if m == 0 or n == 0 or k == 0 or g == 0:
      return jnp.zeros((m, n), out)
    problem = QRaggedDotProblem(m=m, g=g, k=k, n=n, dtype=x.dtype.name, w_dtype=w.dtype.name,
                                out_dtype=out.name, w_layout=w_layout)
    arrays = (x, w, scales.astype(jnp.float32),
              clip_sizes(partition.replicated(group_sizes), m))
    if fp8:
      return Call(problem, arrays + (x_scales.astype(jnp.float32),), {},
                  ("scales", "group_sizes", "x_scales"))
    return Call(problem, arrays, {}, ("scales", "group_sizes"))

  def batched_call(self, axis_size: int, in_batched, arrays, op):
    """``jax.vmap`` of the op (``lax.ragged_dot`` has no rule for batched
    group sizes): as the grouped GEMM's
    (:func:`wavetune_jax.families.ragged_dot.family.fold_batch`), the
    activations' row scales going with their rows and the weights' channel
    scales with their experts."""
    x, w, scales, sizes, *x_scales = arrays
    xb, wb, sb, gb, *xsb = in_batched
    return fold_batch(axis_size, (x, *x_scales), (xb, *xsb), sizes, gb, (w, scales), (wb, sb),
                      lambda rows, experts, flat: op(rows[0], *experts, flat, *rows[1:]))

  def partition_rule(self, problem: QRaggedDotProblem):
    """N (the experts' columns) and K split, K partials summed (a channel's
    scale is linear over them); rows and experts gathered, as the 16-bit
    grouped GEMM's."""
    w = "g k n" if problem.w_layout == "kn" else "g n k"
    return PartitionRule(f"m k, {w}, g n, g{', m' if problem.w8a8 else ''} -> m n",
                         reduction=("k",), replicated=("m", "g"))

  def trusted_without_evidence(self, problem: QRaggedDotProblem, config, platform, hw=None,
                               versions: dict | None = None) -> bool:
    """The FP8 kernel over XLA's ragged dot on the e4m3 operands wherever its
    rule runs (``benchmarks/fp8_ragged_dot.py``). The weight-only kernel
    over XLA's ragged dot on the converted weights with its rule's config
    (64 x 256 tiles): on an H100 (``benchmarks/weight_only_ragged_dot.py``) it ran
    1.09-5.63x XLA's (geomean 2.38x) on all 24 decode-size problems
    measured (Mixtral-8x7B's and OLMoE's experts, int8 and e4m3, 1-64
    tokens) and 3.9x at 512 and 2,048 tokens (Mixtral's w13, int8), where
    XLA's ragged dot on this JAX is its dense form, every expert's GEMM on
    every row. With a cuDNN of 9.22 or later, where XLA lowers its ragged
    dot to cuDNN's grouped GEMM, neither is trusted: evidence decides
    (``versions``: the platform's, default this process's; a cuDNN that
    cannot be read, as on a CPU choosing for a named GPU, is taken as the
    measured one, unlike the 16-bit family's, whose sweeps hold the
    evidence this family's tables lack).

    Not the weight-only kernel where nearly every expert is busy (more than
    :data:`WEIGHT_ONLY_BUSY` of them expected to get rows,
    ``pallas_kernels.ragged_dot.weight_only.busy_share``) and XLA's dense
    form is light (``m * g`` below :data:`WEIGHT_ONLY_DENSE_ROWS`): both
    then read every expert's 8-bit weight once, XLA converting it in its
    GEMM about as fast as the kernel does. On an H200
    (``benchmarks/weight_only_ragged_dot.py``, 8 experts of Mixtral-8x7B,
    Mixtral-8x22B and JetMoE-8B at 16 and 32 rows) the rule's config ran
    0.86-1.19x XLA's there (0.80x on Mixtral-8x22B's w2 before its K split
    past one wave); at 64 rows (512 dense rows) 1.10-1.47x, and at 8 rows
    of 8 experts (about 5 busy) 1.40x. The GPUs of
    :data:`WEIGHT_ONLY_BUSY_TRUSTED_GPUS` keep the trust there."""
    from pallas_kernels.ragged_dot.mosaic import MosaicRaggedDotConfig
    from wavetune_jax.core import versions as versions_lib
    from wavetune_jax.families.qragged_dot.backends import XlaQRaggedDotConfig
    if not (isinstance(config, MosaicRaggedDotConfig)
            and isinstance(platform, XlaQRaggedDotConfig)):
      return False
    if versions_lib.cudnn_below(RaggedDotFamily.CUDNN_GROUPED_GEMM, versions) is False:
      return False
    if problem.w8a8:
      return True
    from pallas_kernels.ragged_dot.weight_only import busy_share
    if (busy_share(problem.m, problem.g) > WEIGHT_ONLY_BUSY
        and problem.m * problem.g < WEIGHT_ONLY_DENSE_ROWS
        and (hw is None or hw.device_key not in WEIGHT_ONLY_BUSY_TRUSTED_GPUS)):
      return False
    # The rule's config, as measured (not any 64 x 256 config: the rule ran
    # only 1.09-1.15x XLA's at 16 tokens on Mixtral's experts).
    return hw is not None and config == self.backend("mosaic").heuristic(problem, hw)

  # --- problems ------------------------------------------------------------------------
  def problems_from_suite(self, suite, *, weights=None, sizes=None, dtype="bfloat16"):
    """``suite["grouped_gemm"]``'s expert weights at every token count (rows
    are tokens x top_k; ``sizes``, if given, are rows): W8A8-FP8 with the
    weights ``[G, N, K]``, and with ``dtype`` bfloat16 or float16 the
    weight-only problems (int8 and float8_e4m3fn weights ``[G, K, N]``) too."""
    name = jnp.dtype(dtype).name
    if name not in DTYPES:
      raise ValueError(f"dtype={dtype!r} must be one of {DTYPES} for the qragged_dot suite")
    out = []
    for w in expert_weights(suite, weights).values():
      rows = sizes if sizes is not None else [t * w["top_k"]
                                              for t in suite["grouped_gemm"]["tokens"]]
      for m in rows:
        if name != "float8_e4m3fn":
          out += [QRaggedDotProblem(m=int(m), g=w["E"], k=w["K"], n=w["N"], dtype=name,
                                    w_dtype=wd) for wd in WEIGHT_DTYPES]
        out.append(QRaggedDotProblem(m=int(m), g=w["E"], k=w["K"], n=w["N"],
                                     dtype="float8_e4m3fn", w_dtype="float8_e4m3fn",
                                     w_layout="nk"))
    return out

  def problem_key(self, p: QRaggedDotProblem) -> str:
    nk = ":nk" if p.w_layout == "nk" else ""
    return f"{p.m}x{p.g}x{p.k}x{p.n}:{p.dtype}:w{p.w_dtype}:{p.out_dtype}{nk}"

  def weight_of(self, p: QRaggedDotProblem) -> tuple:
    return (("dtype", p.dtype), ("g", p.g), ("k", p.k), ("n", p.n),
            ("out_dtype", p.out_dtype), ("w_dtype", p.w_dtype), ("w_layout", p.w_layout))

  def inputs(self, p: QRaggedDotProblem, key: jax.Array):
    """``(x, w, scales, group_sizes[, x_scales])``: int8 weights uniform in
    [-127, 127], e4m3 ones a normal times 64; scales about ``1 / (127
    sqrt(K))``; e4m3 activations a normal times 64 with scales about 1 / 64;
    group sizes from the family's router."""
    kx, kw, ks, kr, kg = jax.random.split(key, 5)
    x = jax.random.normal(kx, (p.m, p.k), jnp.float32)
    # e4m3 has no infinity: past 448 a cast gives NaN.
    x = (jnp.clip(x * 64, -448, 448) if p.w8a8 else x).astype(jnp.dtype(p.dtype))
    wshape = (p.g, p.k, p.n) if p.w_layout == "kn" else (p.g, p.n, p.k)
    if p.w_dtype == "int8":
      w = jax.random.randint(kw, wshape, -127, 128, jnp.int32).astype(jnp.int8)
    else:
      w = jnp.clip(jax.random.normal(kw, wshape, jnp.float32) * 64, -448,
                   448).astype(jnp.float8_e4m3fn)
    s = jax.random.uniform(ks, (p.g, p.n), jnp.float32, 0.5, 1.5) / (127 * math.sqrt(p.k))
    gs = routing.group_sizes(kg, p.m, p.g, self.skew)
    if p.w8a8:
      return x, w, s, gs, jax.random.uniform(kr, (p.m,), jnp.float32, 0.5, 1.5) / 64
    return x, w, s, gs

  def reference(self, p: QRaggedDotProblem, x, w, scales, group_sizes, x_scales=None):
    """The float32 grouped product of the dequantized operands, at highest precision."""
    from wavetune_jax.families.qragged_dot.backends import dequantized_ragged_product
    return dequantized_ragged_product(x, w, scales, group_sizes, x_scales, p.w_layout)

  def baseline(self, p: QRaggedDotProblem):
    from wavetune_jax.families.qragged_dot.backends import xla_qragged_dot
    out, layout = jnp.dtype(p.out_dtype), p.w_layout
    return lambda x, w, s, gs, xs=None: xla_qragged_dot(x, w, s, gs, out, x_scales=xs,
                                                         w_layout=layout)

  def tolerance(self, p: QRaggedDotProblem) -> float:
    """1e-2 (that of a bfloat16 grouped GEMM); 2e-2 for W8A8, whose FP8 MMA
    keeps fewer accumulator bits."""
    return 2e-2 if p.w8a8 else 1e-2

  def default(self, p: QRaggedDotProblem):
    from wavetune_jax.families.qragged_dot.backends import XlaQRaggedDotConfig
    return XlaQRaggedDotConfig()
