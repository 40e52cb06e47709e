"""The grouped-GEMM family: ``lax.ragged_dot`` for mixture-of-experts layers."""

from __future__ import annotations

import copy
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels._integers import clipped_int32, shape_and_dtype
from pallas_kernels.ragged_dot.reference import ragged_dot_reference
from pallas_kernels.ragged_dot import worklist
from pallas_kernels.ragged_dot.worklist import clip_sizes
from wavetune_jax.core.family import Call, Family
from wavetune_jax.core.partition import PartitionRule
from wavetune_jax.families.matmul.family import _out_dtype, operand, quantized_hint
from wavetune_jax.families.ragged_dot import routing
from wavetune_jax.families.ragged_dot import xla as xla_backend
from wavetune_jax.families.ragged_dot.problem import DTYPES, RaggedDotProblem
from wavetune_jax.shapes import suite_entries

__all__ = ["RaggedDotFamily", "batched_reference", "expert_weights"]


def expert_weights(suite: dict, names=None) -> dict[str, dict]:
  """``{weight name: {"E", "top_k", "K", "N"}}`` of a suite's ``grouped_gemm``
  section, optionally filtered."""
  found = suite_entries(suite, "grouped_gemm", "weights", names)
  return found


def batched_reference(p: RaggedDotProblem, rows: int | None = None,
                      experts: int | None = None):
  """``(fn, (lhs, rhs) shapes)`` of the batched GEMM that bounds ``p``
  (:meth:`RaggedDotFamily.speed_references`); ``rows`` per expert overrides
  the uniform ``ceil(m / g)`` (e.g. the largest group under skew), and
  ``experts`` the ``min(g, m)`` experts that rows reach."""
  experts = min(p.g, p.m) if experts is None else int(experts)
  per = -(-p.m // experts) if rows is None else int(rows)
  dt, out = jnp.dtype(p.dtype), jnp.dtype(p.out_dtype)

  def batched(x, w):
    return jnp.einsum("gmk,gkn->gmn", x, w, preferred_element_type=out)
  return batched, (jax.ShapeDtypeStruct((experts, per, p.k), dt),
                   jax.ShapeDtypeStruct((experts, p.k, p.n), dt))


def fold_batch(axis_size: int, rows: tuple, rows_b: tuple, sizes, sizes_b: bool,
               experts: tuple, experts_b: tuple, run):
  """``jax.vmap`` of a grouped GEMM as one of ``B * M`` rows (the grouped
  GEMM families' ``batched_call``): ``rows`` are per-row arrays (``[M, ...]``:
  the activations, their scales), ``experts`` per-expert ones (``[G, ...]``:
  the weights, their scales), each with the batch axis first where its flag
  says. With no batched expert array the rows are ordered by group (one set
  of experts), else by batch and group (the experts flattened to ``B * G``),
  with a gather before and after
  (:func:`~pallas_kernels.ragged_dot.worklist.batch_rows`). ``run(rows,
  experts, sizes)`` computes the one GEMM, ``[B * M, N]``.

  Returns:
    ``[B, M, N]``.
  """
  lead = lambda a, b: a if b else jnp.broadcast_to(a, (axis_size,) + a.shape)
  rows = [lead(r, b) for r, b in zip(rows, rows_b)]
  m = rows[0].shape[1]
  sizes = lead(sizes, sizes_b)
  shared = not any(experts_b)
  if not shared:
    # (an unbatched expert array next to a batched one is copied B times)
    experts = [lead(e, b) for e, b in zip(experts, experts_b)]
    experts = [e.reshape((-1,) + e.shape[2:]) for e in experts]
  dest, flat = worklist.batch_rows(sizes, m, shared_groups=shared)
  dest = dest.reshape(-1)
  src = jnp.zeros_like(dest).at[dest].set(jnp.arange(dest.shape[0], dtype=dest.dtype),
                                          unique_indices=True)
  y = run([r.reshape((-1,) + r.shape[2:])[src] for r in rows], list(experts), flat)
  # (the last dimension named: a batch of none has no -1 to infer)
  return y[dest].reshape(axis_size, m, y.shape[-1])


class RaggedDotFamily(Family):
  """Grouped GEMM with fp32 accumulation, rows grouped contiguously by
  expert; XLA's ``lax.ragged_dot`` is the baseline.

  ``skew`` is the routing that :meth:`inputs` draws group sizes from
  (:mod:`~wavetune_jax.families.ragged_dot.routing`; balanced by default):
  sweeps and tables are measured with it.
  """

  name = "ragged_dot"
  problem_cls = RaggedDotProblem
  size_field = "m"
  aux_names = ("split_k_launch", "split_k_partial_mb")
  # The heuristic is the Mosaic kernel's rule on Hopper (XLA's ragged dot
  # elsewhere); the model replaces it only when it predicts more than a 2.5x
  # gain, which on the H100 and H200 sweeps it never does: with two anchors
  # per variant over six models' weights the models are over-optimistic far
  # from their anchors (the 128 x 256 model predicted 2.2-2.6x the measured
  # time on Mixtral's w13). On the 145-problem H100 sweep
  # (benchmarks/table_vs_sweep.py, shipped table) a margin of 0.3 ran at
  # 0.958 of the oracle, 1.0 at 0.967 (six model answers, each slower than
  # the rule's config), 1.5 at 0.975; held out (wavetune eval, seeds 0-4) 1.0
  # and 1.5 are equal on the H100 and within 0.001 on the H200. The table's
  # measured entries (exact answers) still apply.
  heuristic_margin = 1.5
  baseline_name = "XLA"
  explicit_mesh_note = (" with the rows, K and the group sizes gathered on every device "
                        "(JAX's ragged dot has no rule for them sharded there)")
  # The guard's rule: held-out replays of both GPUs' sweeps (5 splits;
  # benchmarks/guard_radius.py, docs/design.md "The guard").
  guard_rule = {"weight_radius": math.inf, "size_radius": 1.0, "win": 0.97}
  skew = routing.BALANCED
  #: Rows per expert from which the Mosaic kernel replaces XLA's ragged dot
  #: without table evidence (:meth:`trusted_without_evidence`; also at most
  #: one row for two experts).
  TRUSTED_ROWS_PER_EXPERT = 64
  #: Experts from which any Mosaic config replaces XLA's dense ragged dot
  #: without table evidence, at any rows (:meth:`trusted_without_evidence`).
  TRUSTED_EXPERTS = 64
  #: Experts below which nothing is trusted without evidence: the sweeps
  #: hold 8 experts or more, and with 2 or 4 the dense form does only 2-4x
  #: the work.
  TRUSTED_MIN_EXPERTS = 8
  #: The cuDNN from which XLA lowers ``lax.ragged_dot`` to cuDNN's grouped
  #: GEMM instead of its dense form (openxla/xla PR 42313).
  CUDNN_GROUPED_GEMM = xla_backend.CUDNN_GROUPED_GEMM
  #: First use measures the wave model's top 2, not 3: its candidates are
  #: Mosaic kernels, each about 2 s of a first use on an H200 (6.0 s of a
  #: new problem's 6.5 s of measuring was compiling), and in the held-out
  #: replay of both GPUs' sweeps (``benchmarks/guard_radius.py --top-k 2``,
  #: seeds 0-4) k = 2 measures 3.2 configs against 4.0-4.1 and keeps 0.997-0.998
  #: of the oracle against 0.998-0.999, none below the platform op.
  refine_top_k = 2

  def trusted_without_evidence(self, problem: RaggedDotProblem, config, platform, hw=None,
                               versions: dict | None = None) -> bool:
    """A Mosaic config over XLA's ragged dot where XLA runs its dense form,
    which multiplies every row by every expert's weight (cuDNN older than
    9.22; ``versions``: the platform's, default this process's), and the
    problem has 64 rows or more per expert (``m >= 64 * g``: the dense form
    does ``g`` times the FLOPs) or at most one row for two experts (``2 * m
    <= g``: the kernel reads the weights of at most ``m`` experts, the dense
    form all ``g``), or 64 experts or more (``g >= 64``: the dense form
    reads or multiplies every row with 64 weights or more), or the rule's
    own config at one row per expert or fewer (``m <= g``; given ``hw``).
    Past the sizes a table measured the guard would
    otherwise keep XLA's op there: up to 88x slower at OLMoE's w13 with
    131,072 rows, and 12x at one row of 16 experts, held out. In the sweeps
    of both GPUs every Mosaic config measured there beat XLA's op: from 64
    rows per expert 1,660 configs over 100 problems on the H100 (the slowest
    1.26x) and 1,603 over 97 on the H200 (1.89x); at most one row for two
    experts 93 configs over 20 problems (1.80x) and 85 over 18 (1.40x); at
    one row per expert or fewer the rule's config on 28 and 26 problems
    (1.40x and 1.20x; other configs there lost, down to 0.94x); with 64
    experts or more 521 configs over 53 problems (1.22x) and 485 over 48
    (1.13x), where with 8 or 16 experts and 2 to 8 rows each some configs
    and the rule lost (0.86-0.99x); every region needs
    :attr:`TRUSTED_MIN_EXPERTS` (the sweeps hold 8 experts or more);
    docs/results.md, "The guard past the sweeps' sizes" (``python3
    benchmarks/table_vs_sweep.py <sweep> <table> --trusted`` counts them on
    the sweeps as they are now). A cuDNN that cannot
    be read, or 9.22 and newer, needs evidence.
    """
    from wavetune_jax.core import versions as versions_lib
    from wavetune_jax.families.ragged_dot.mosaic import MosaicRaggedDotConfig
    from wavetune_jax.families.ragged_dot.xla import XlaRaggedDotConfig
    if not (isinstance(config, MosaicRaggedDotConfig) and isinstance(platform, XlaRaggedDotConfig)
            and problem.g >= self.TRUSTED_MIN_EXPERTS
            and (problem.m >= self.TRUSTED_ROWS_PER_EXPERT * problem.g
                 or problem.g >= self.TRUSTED_EXPERTS
                 or 2 * problem.m <= problem.g
                 or (problem.m <= problem.g and hw is not None
                     and config == self.heuristic(problem, hw)))):
      return False
    return versions_lib.cudnn_below(self.CUDNN_GROUPED_GEMM, versions) is True

  def work(self, p) -> tuple[float, float]:
    """FLOPs, and the bytes of the rows, of the experts that at least one
    row can reach (at most ``m`` of them) and of the output."""
    return (2.0 * p.m * p.n * p.k,
            float((p.m * p.k + min(p.g, p.m) * p.k * p.n) * p.itemsize
                  + p.m * p.n * jnp.dtype(p.out_dtype).itemsize))

  def with_routing(self, skew: float) -> "RaggedDotFamily":
    """A copy of this family whose inputs use router skew ``skew``."""
    new = copy.copy(self)
    new.skew = float(skew)
    return new

  # --- the call ------------------------------------------------------------------------
  def bind(self, lhs, rhs, group_sizes, *, out_dtype=None):
    """Checks ``lhs [M, K]``, ``rhs [G, K, N]`` and ``group_sizes [G]``."""
    lhs, rhs = operand("lhs", lhs), operand("rhs", rhs)
    # group_sizes stays as given (NumPy's 64-bit integers included) until
    # clipped_int32 clips it in its own dtype: jnp.asarray would wrap them
    # to 32 bits.
    gs_shape, gs_dtype = shape_and_dtype(group_sizes, name="group_sizes")
    if lhs.ndim != 2:
      raise ValueError(f"lhs must have rank 2 ([M, K]); got lhs.shape={lhs.shape}")
    if rhs.ndim != 3:
      raise ValueError(f"rhs must have rank 3 ([G, K, N]); got rhs.shape={rhs.shape}")
    if lhs.shape[1] != rhs.shape[1]:
      raise ValueError(f"contracting dimensions differ: lhs.shape={lhs.shape} and "
                       f"rhs.shape={rhs.shape} (lhs.shape[1] must equal rhs.shape[1])")
    if gs_shape != (rhs.shape[0],):
      raise ValueError(f"group_sizes must have shape [G] = ({rhs.shape[0]},) (G = "
                       f"rhs.shape[0]); got group_sizes.shape={gs_shape}")
    if gs_dtype == np.bool_ or not jnp.issubdtype(gs_dtype, jnp.integer):
      raise ValueError(f"group_sizes must be integers; got {gs_dtype}")
    hint = quantized_hint("wt.quantized_ragged_dot", lhs.dtype, rhs.dtype)
    if lhs.dtype != rhs.dtype:
      raise ValueError(f"lhs.dtype={lhs.dtype} and rhs.dtype={rhs.dtype} must be the "
                       f"same{hint}")
    if lhs.dtype.name not in DTYPES:
      raise ValueError(f"lhs.dtype={lhs.dtype} is not supported; use one of {DTYPES}{hint}")
    out = _out_dtype(lhs.dtype, out_dtype)
    (m, k), (g, _, n) = lhs.shape, rhs.shape
    if m == 0 or n == 0 or k == 0 or g == 0:
      # What lax.ragged_dot gives: an empty result, or zeros.
      return jnp.zeros((m, n), out)
    problem = RaggedDotProblem(m=m, g=g, k=k, n=n, dtype=lhs.dtype.name, out_dtype=out.name)
    # Every backend gets int32 sizes in [0, M] (an elementwise clip, which
    # XLA fuses into its consumer) and computes with them as summing to at
    # most M (the documented contract; lax.ragged_dot leaves other sizes
    # undefined): the kernels' work lists saturate the running sum
    # themselves, XLA's dense ragged dot needs nothing more
    # (XlaRaggedDot.run), so the op adds no kernel in front of XLA's.
    return Call(problem, (lhs, rhs, clipped_int32(group_sizes, m, name="group_sizes")), {})

  def batched_call(self, axis_size: int, in_batched, arrays, op):
    """``jax.vmap`` of the op (``lax.ragged_dot`` has no batching rule for
    batched group sizes): the ``B`` grouped GEMMs run as one of ``B * M``
    rows, ordered by group (one ``rhs``) or by batch and group (a batched
    ``rhs``, flattened to ``[B * G, K, N]``), with a gather of the rows
    before and after (:func:`~pallas_kernels.ragged_dot.worklist.batch_rows`);
    ``op`` runs it, its config chosen for the ``B * M`` rows.

    Returns:
      ``[B, M, N]``.
    """
    lhs, rhs, sizes = arrays
    lhs_b, rhs_b, sizes_b = in_batched
    m = lhs.shape[-2]
    # batch_rows takes sizes summing to at most M (bind clips each only)
    sizes = (jax.vmap if sizes_b else lambda f: f)(lambda s: clip_sizes(s, m))(sizes)
    return fold_batch(axis_size, (lhs,), (lhs_b,), sizes, sizes_b, (rhs,), (rhs_b,),
                      lambda rows, experts, flat: op(rows[0], experts[0], flat))

  def partition_rule(self, problem):
    """N (the experts' columns) and K split, K partials summed in the
    output's dtype (as XLA's partitioned dot);
    rows and experts are gathered: a shard of rows would need its own group
    sizes, a shard of experts the rows routed to them (expert parallelism
    is an all-to-all around the op, left to the model)."""
    return PartitionRule("m k, g k n, g -> m n", reduction=("k",), replicated=("m", "g"))

  # --- problems ------------------------------------------------------------------------
  def problems_from_suite(self, suite, *, weights=None, sizes=None, dtype="bfloat16"):
    """``suite["grouped_gemm"]``: every expert weight at every token count;
    a problem's rows are tokens x top_k (``sizes``, if given, are rows)."""
    ws = expert_weights(suite, weights)
    out = []
    for w in ws.values():
      rows = sizes if sizes is not None else [t * w["top_k"]
                                              for t in suite["grouped_gemm"]["tokens"]]
      out += [RaggedDotProblem(m=int(m), g=w["E"], k=w["K"], n=w["N"], dtype=dtype)
              for m in rows]
    return out

  def problem_key(self, p: RaggedDotProblem) -> str:
    return f"{p.m}x{p.g}x{p.k}x{p.n}:{p.dtype}:{p.out_dtype}"

  def weight_of(self, p: RaggedDotProblem) -> tuple:
    return (("dtype", p.dtype), ("g", p.g), ("k", p.k), ("n", p.n),
            ("out_dtype", p.out_dtype))

  def inputs(self, p: RaggedDotProblem, key: jax.Array):
    kx, kw, kg = jax.random.split(key, 3)
    dt = jnp.dtype(p.dtype)
    lhs = jax.random.normal(kx, (p.m, p.k), jnp.float32).astype(dt)
    rhs = (jax.random.normal(kw, (p.g, p.k, p.n), jnp.float32) / math.sqrt(p.k)).astype(dt)
    return lhs, rhs, routing.group_sizes(kg, p.m, p.g, self.skew)

  def reference(self, p: RaggedDotProblem, lhs, rhs, group_sizes):
    return ragged_dot_reference(lhs, rhs, group_sizes, jnp.float32)

  def baseline(self, p: RaggedDotProblem):
    out_dtype = jnp.dtype(p.out_dtype)

    def f(lhs, rhs, group_sizes):
      return jax.lax.ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype)
    return f

  def speed_references(self, p: RaggedDotProblem) -> dict:
    """``"batched"``: cuBLAS's batched GEMM (``jnp.einsum("gmk,gkn->gmn")``
    through XLA) on the same rows per expert under uniform routing,
    ``ceil(m / g)`` rows for each of the ``g`` experts (each of ``m`` experts
    one row when ``m < g``): what a well-built grouped GEMM on these rows
    gets. Padded to at most ``g - 1`` rows more than ``m`` in all.
    The sweeps' balanced router gives the experts unequal rows, which a
    batched GEMM must pad: ``"batched_padded"`` is the batched GEMM over all
    ``g`` experts at the largest group of the sweep's inputs (what it would
    run on those very rows)."""
    big = int(np.max(np.asarray(self.input_group_sizes(p))))
    return {"batched": batched_reference(p),
            "batched_padded": batched_reference(p, rows=max(1, big), experts=p.g)}

  def input_group_sizes(self, p: RaggedDotProblem, seed: int = 0) -> jax.Array:
    """The group sizes of :meth:`inputs` with ``PRNGKey(seed)`` (a sweep's)."""
    return routing.group_sizes(jax.random.split(jax.random.PRNGKey(seed), 3)[2], p.m, p.g,
                               self.skew)

  def tolerance(self, p: RaggedDotProblem) -> float:
    return 1e-3 if p.dtype == "float32" and p.out_dtype == "float32" else 1e-2

  def default(self, p: RaggedDotProblem):
    """The fixed config an untuned library would use."""
    from wavetune_jax.families.ragged_dot.triton import TritonRaggedDotConfig
    return TritonRaggedDotConfig()
