"""The attention spec: flash attention forward with the Pallas kernels.

Two backends share one space: the Triton kernel (``backend=0``, any shape) and,
on Hopper, the warp-specialized Mosaic GPU kernel (``backend=1``) where the
lengths are multiples of 8 and ``head_dim`` of 64. ``backend`` is a
micro field: a Mosaic config is another variant of the wave model, with the
same ``(G, L)`` mapping (``block_q`` is the query rows of one program in both).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import attention_mosaic as mosaic
from pallas_kernels.attention import MOSAIC, AttentionConfig, attention_reference
from pallas_kernels.attention import kv_blocks
from pallas_kernels.attention import attention as pallas_attention
from wavetune_jax.hardware import Hardware
from wavetune_jax.spec import KernelSpec, KeyedProblem, register

__all__ = ["AttentionProblem", "AttentionConfig", "AttentionSpec", "ATTENTION"]

_DTYPES = ("bfloat16", "float16")


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True, eq=False)
class AttentionProblem(KeyedProblem):
  """Static facts of one attention call (layout ``[batch, seq, heads, head_dim]``).

  Attributes:
    batch, q_heads, kv_heads, head_dim: as in the arrays; ``kv_heads`` divides
      ``q_heads``.
    q_len, kv_len: query and key/value lengths (``kv_len=0`` means ``q_len``:
      self-attention prefill).
    causal: causal mask (top-left aligned).
    dtype: ``"bfloat16"`` or ``"float16"``.
  """

  batch: int
  q_heads: int
  kv_heads: int
  q_len: int
  kv_len: int = 0
  head_dim: int = 128
  causal: bool = True
  dtype: str = "bfloat16"
  _key: tuple = dataclasses.field(init=False, repr=False, compare=False, default=())
  _hash: int = dataclasses.field(init=False, repr=False, compare=False, default=0)

  def __post_init__(self):
    if self.kv_len == 0:
      object.__setattr__(self, "kv_len", self.q_len)
    for name in ("batch", "q_heads", "kv_heads", "q_len", "kv_len", "head_dim"):
      v = getattr(self, name)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"AttentionProblem.{name}={v!r} must be an int >= 1")
    if self.q_heads % self.kv_heads:
      raise ValueError(f"kv_heads={self.kv_heads} must divide q_heads={self.q_heads}")
    if self.head_dim > 256:
      raise ValueError(f"head_dim={self.head_dim} must be <= 256")
    if not isinstance(self.causal, bool):
      raise ValueError(f"AttentionProblem.causal={self.causal!r} must be a bool")
    dtype = jnp.dtype(self.dtype).name
    if dtype not in _DTYPES:
      raise ValueError(f"AttentionProblem.dtype={self.dtype!r} must be one of {_DTYPES}")
    object.__setattr__(self, "dtype", dtype)
    self._freeze()

  @property
  def padded_head_dim(self) -> int:
    return max(16, 1 << math.ceil(math.log2(self.head_dim)))

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.dtype).itemsize

  @property
  def flops(self) -> float:
    """Useful FLOPs (two matmuls; half of the scores under a causal mask)."""
    q, kv = self.q_len, self.kv_len
    if not self.causal:
      pairs = q * kv
    elif q <= kv:
      pairs = q * (q + 1) // 2
    else:
      pairs = kv * (kv + 1) // 2 + (q - kv) * kv
    return 4.0 * self.batch * self.q_heads * self.head_dim * pairs


def _next_pow2(v: int) -> int:
  return 1 << max(0, math.ceil(math.log2(max(1, v))))


# Candidate values. All blocks are powers of two >= 32 (16-row tiles are never
# faster on Hopper's 64-row MMA).
BLOCK_Q = (32, 64, 128)
BLOCK_K = (32, 64, 128)
NUM_WARPS = (4, 8)
NUM_STAGES = (2, 3, 4)

# Pruning rules of the space (see AttentionSpec.space). Evidence: the grid
# probe of benchmarks/attention_probe.py on an H200 (6 shapes, 24 configs each).
#  A1 size:      no block larger than the next power of two of its length
#                (floor 32): larger blocks only mask.
#  A2 smem:      (num_stages * 2 * block_k + block_q) * head_dim_padded *
#                itemsize <= shared memory per block (pipelined K and V tiles
#                plus the Q tile).
#  A3 warps:     8 warps only with block_q >= 128. With block_q = 64, 8 warps
#                were 1.4x-2.2x slower than 4 warps on every probed shape
#                (too few rows per warp for the MMA).
#  A4 registers: fp32 output accumulator per thread,
#                block_q * head_dim_padded / (32 * num_warps), at most 128.
# Mosaic configs (backend=1), on compute capability 9.0 only:
#  M1 shape:     head_dim a multiple of 64, q_len and kv_len multiples of 8
#                (TMA tiling), q_len <= kv_len under a causal mask; as A1, no
#                block larger than the next power of two of its length
#                (floors: the smallest blocks, 128 and 64).
#  M2 smem:      (block_q + 2 * num_stages * block_k) * head_dim * itemsize
#                (+ barriers) <= shared memory per block.
#  M3 registers: fp32 accumulator and scores per consumer thread,
#                (block_q / 2) * (head_dim + block_k) / 128, at most 160 of
#                the 232 registers a consumer warpgroup gets.
MOSAIC_STAGES = (2, 3, 4)


class AttentionSpec(KernelSpec):
  """Flash-attention forward family (``pallas_kernels.attention``)."""

  name = "attention"
  problem_cls = AttentionProblem
  config_cls = AttentionConfig
  macro_fields = ("block_q", "block_k")
  micro_fields = ("num_warps", "num_stages", "backend")
  default_fields = ("backend",)
  size_field = "q_len"
  # The selector keeps the heuristic's config unless the model predicts a gain
  # above this margin. On the Triton-only H200 sweep (3% budget, seed 0) a
  # model fitted on 1-3 anchors per variant scored 0.896 of the oracle held
  # out without the guard and 0.953 with it (the heuristic alone: 0.960).
  # With both backends the guard keeps the heuristic on every held-out
  # problem (README, "Attention"). GEMM uses a 30% margin.
  #: L under a causal mask: "mean" (the default) or "max" KV blocks over the
  #: query blocks; benchmarks/attention_causal_l.py compares the two.
  causal_l = "mean"
  heuristic_margin = 0.1
  baseline_name = "cuDNN"
  revision = 2  # the shifted ragged query block

  def problems_from_suite(self, suite, *, weights=None, sizes=None, dtype="bfloat16"):
    """``suite["attention"]``: every model at every batch and sequence length
    (causal self-attention, ``kv_len = q_len``)."""
    from wavetune_jax import shapes
    models = shapes.attention_models(suite, weights)
    att = suite["attention"]
    seqs = att["seq"] if sizes is None else sizes
    return [AttentionProblem(batch=b, q_heads=m["q_heads"], kv_heads=m["kv_heads"],
                             q_len=s, head_dim=m["head_dim"], causal=True, dtype=dtype)
            for m in models.values() for b in att["batch"] for s in seqs]

  # --- size handling: prefill grows q_len and kv_len together ---------------------------
  def with_size(self, problem: AttentionProblem, size: int) -> AttentionProblem:
    kv = int(size) if problem.kv_len == problem.q_len else problem.kv_len
    return dataclasses.replace(problem, q_len=int(size), kv_len=kv)

  def weight_of(self, problem: AttentionProblem) -> tuple:
    """Every field but the lengths; self-attention (kv_len = q_len) is its own kind."""
    kv = "=q" if problem.kv_len == problem.q_len else problem.kv_len
    return (("batch", problem.batch), ("causal", problem.causal), ("dtype", problem.dtype),
            ("head_dim", problem.head_dim), ("kv_heads", problem.kv_heads),
            ("kv_len", kv), ("q_heads", problem.q_heads))

  def size_quantum(self, problem: AttentionProblem) -> int:
    """Every block is a multiple of 32: within (32(j-1), 32j] the block counts,
    and with them (G, L) and the space, are the same. Where Mosaic configs can
    be in the space, it changes at multiples of 8 (rule M1) and their speed with
    the ragged part of the last blocks, so each length is decided on its own."""
    return 1 if self._mosaic_possible(problem) else 32

  @staticmethod
  def _mosaic_possible(problem: AttentionProblem) -> bool:
    return problem.head_dim % 64 == 0

  # --- space -------------------------------------------------------------------------
  def smem_bytes(self, problem: AttentionProblem, c: AttentionConfig) -> int:
    if c.backend == MOSAIC:
      return mosaic.mosaic_smem_bytes(block_q=c.block_q, block_k=c.block_k,
                                      num_stages=c.num_stages, head_dim=problem.head_dim,
                                      itemsize=problem.itemsize)
    return ((c.num_stages * 2 * c.block_k + c.block_q) * problem.padded_head_dim
            * problem.itemsize)

  def space(self, problem: AttentionProblem, hw: Hardware, *,
            prune: bool = True) -> tuple[AttentionConfig, ...]:
    """Valid configs: Triton ones pruned by rules A1-A4 (``prune=False``: A2
    only), then on compute capability 9.0 the Mosaic ones of rules M1-M3."""
    p = problem
    mosaic_ok = (hw.compute_capability == mosaic.COMPUTE_CAPABILITY and self._mosaic_possible(p)
                 and not (p.causal and p.q_len > p.kv_len))
    return self._space(p.q_len, p.kv_len, p.padded_head_dim, p.dtype, hw, prune) + (
        self._mosaic_space(p.q_len, p.kv_len, p.head_dim, p.dtype, hw) if mosaic_ok else ())

  @functools.lru_cache(maxsize=1024)
  def _mosaic_space(self, q_len, kv_len, head_dim, dtype, hw):
    p = AttentionProblem(batch=1, q_heads=1, kv_heads=1, q_len=q_len, kv_len=kv_len,
                         head_dim=head_dim, dtype=dtype)
    out = []
    for bq, bk, ns in itertools.product(mosaic.BLOCK_Q, mosaic.BLOCK_K, MOSAIC_STAGES):
      if (q_len % mosaic.SEQ_MULTIPLE or kv_len % mosaic.SEQ_MULTIPLE
          or bq > max(mosaic.BLOCK_Q[0], _next_pow2(q_len))
          or bk > max(mosaic.BLOCK_K[0], _next_pow2(kv_len))):
        continue  # M1
      c = AttentionConfig(block_q=bq, block_k=bk, num_warps=mosaic.NUM_WARPS,
                          num_stages=ns, backend=MOSAIC)
      if self.smem_bytes(p, c) > hw.smem_per_block:
        continue  # M2
      if (bq // 2) * (head_dim + bk) // 128 > 160:
        continue  # M3
      out.append(c)
    return tuple(out)

  @functools.lru_cache(maxsize=1024)
  def _space(self, q_len, kv_len, dp, dtype, hw, prune):
    p = AttentionProblem(batch=1, q_heads=1, kv_heads=1, q_len=q_len, kv_len=kv_len,
                         head_dim=dp, dtype=dtype)
    out = []
    for bq, bk, nw, ns in itertools.product(BLOCK_Q, BLOCK_K, NUM_WARPS, NUM_STAGES):
      c = AttentionConfig(block_q=bq, block_k=bk, num_warps=nw, num_stages=ns)
      if self.smem_bytes(p, c) > hw.smem_per_block:
        continue  # A2
      if prune:
        if bq > max(32, _next_pow2(q_len)) or bk > max(32, _next_pow2(kv_len)):
          continue  # A1
        if nw > 4 and bq < 128:
          continue  # A3
        if bq * dp // (32 * nw) > 128:
          continue  # A4
      out.append(c)
    return tuple(out)

  def validate(self, problem: AttentionProblem, config: AttentionConfig,
               hw: Hardware | None = None) -> None:
    if not isinstance(config, AttentionConfig):
      raise ValueError(f"config must be an AttentionConfig; got {config!r}")
    if config.backend == MOSAIC:
      p = problem
      mosaic.check_mosaic((p.batch, p.q_len, p.q_heads, p.head_dim),
                          (p.batch, p.kv_len, p.kv_heads, p.head_dim), p.dtype,
                          block_q=config.block_q, block_k=config.block_k,
                          num_stages=config.num_stages, causal=p.causal)
      if hw is not None and hw.compute_capability != mosaic.COMPUTE_CAPABILITY:
        raise ValueError(f"Mosaic attention configs need compute capability "
                         f"{mosaic.COMPUTE_CAPABILITY}; "
                         f"{hw.name} has {hw.compute_capability}")
    if hw is not None and self.smem_bytes(problem, config) > hw.smem_per_block:
      raise ValueError(
          f"config {config} needs {self.smem_bytes(problem, config)} bytes of shared "
          f"memory; {hw.name} allows {hw.smem_per_block} per block")

  # --- rules of thumb --------------------------------------------------------------------
  def default(self, problem: AttentionProblem) -> AttentionConfig:
    """The fixed config of an untuned library: the defaults of JAX's own Pallas
    flash attention (128x128 blocks, 8 warps above head_dim 64, 2 stages)."""
    return AttentionConfig(block_q=128, block_k=128,
                           num_warps=4 if problem.head_dim <= 64 else 8, num_stages=2)

  def heuristic(self, problem: AttentionProblem, hw: Hardware) -> AttentionConfig:
    """On Hopper, the Mosaic kernel with 128x128 tiles and 2 stages where it
    runs the shape, ``q_len`` is at least its 128-row block and its programs
    fill half the SMs. That config is the oracle of 66 of the 90 problems
    of the H100 sweep and 67 of the H200's (``wavetune report`` lists each
    problem's oracle); this heuristic reaches 0.985 and 0.984 of the oracle
    (geomean) on them. Else Triton: 128x64 tiles with 4 warps when they fill
    two waves, else 64-row query blocks (32 rows when even those leave most
    SMs idle), 3 stages."""
    p = problem
    m = AttentionConfig(block_q=128, block_k=128, num_warps=mosaic.NUM_WARPS, num_stages=2,
                        backend=MOSAIC)
    if (p.q_len >= m.block_q and p.batch * p.q_heads * -(-p.q_len // 128) >= hw.num_sms // 2
        and m in self.space(p, hw)):
      return m
    ctas = lambda bq: p.batch * p.q_heads * -(-p.q_len // bq)  # noqa: E731
    bk = min(64, max(32, _next_pow2(p.kv_len)))
    if ctas(128) >= 2 * hw.num_sms and p.padded_head_dim <= 128:
      c = AttentionConfig(block_q=128, block_k=bk, num_warps=4, num_stages=2)
    elif ctas(64) >= hw.num_sms // 2:
      c = AttentionConfig(block_q=64, block_k=bk, num_warps=4, num_stages=3)
    else:
      c = AttentionConfig(block_q=32, block_k=bk, num_warps=4, num_stages=3)
    while self.smem_bytes(p, c) > hw.smem_per_block and c.num_stages > 1:
      c = dataclasses.replace(c, num_stages=c.num_stages - 1)
    return c

  def occupancy_bound(self, problem: AttentionProblem, config: AttentionConfig,
                      hw: Hardware) -> int:
    from wavetune_jax import wave_model
    if config.backend == MOSAIC:
      # 2 x 128 threads at 232 registers and 128 at 40 take the register file.
      return 1
    threads = 32 * config.num_warps
    live = (config.block_q * problem.padded_head_dim  # output accumulator
            + config.block_q * config.block_k) // threads  # scores
    return wave_model.occupancy_bound(smem_bytes=self.smem_bytes(problem, config),
                                      threads=threads, acc_per_thread=live, hw=hw)

  # --- mapping -----------------------------------------------------------------------------
  def coords(self, problem: AttentionProblem, macro: dict) -> tuple[int, float]:
    """``G = batch * q_heads * ceil(q_len / block_q)``; ``L`` = KV blocks per
    program, the mean over query blocks under a causal mask (the kernel runs
    the longest programs first, so the waves even out)."""
    bq, bk = macro["block_q"], macro["block_k"]
    p = problem
    n_q = -(-p.q_len // bq)
    g = p.batch * p.q_heads * n_q
    if not p.causal:
      return g, float(-(-p.kv_len // bk))
    _, total = kv_blocks(np.arange(n_q), q_len=p.q_len, kv_len=p.kv_len, block_q=bq,
                         block_k=bk, causal=True)
    return g, float(np.max(total) if self.causal_l == "max" else np.mean(total))

  # --- running ------------------------------------------------------------------------------
  def build(self, problem: AttentionProblem, config: AttentionConfig, *,
            interpret: bool = False):
    self.validate(problem, config)

    def f(q, k, v):
      return pallas_attention(q, k, v, config=config, causal=problem.causal,
                              interpret=interpret)
    return f

  def inputs(self, problem: AttentionProblem, key: jax.Array):
    p = problem
    kq, kk, kv = jax.random.split(key, 3)
    dt = jnp.dtype(p.dtype)
    q = jax.random.normal(kq, (p.batch, p.q_len, p.q_heads, p.head_dim), jnp.float32)
    k = jax.random.normal(kk, (p.batch, p.kv_len, p.kv_heads, p.head_dim), jnp.float32)
    v = jax.random.normal(kv, (p.batch, p.kv_len, p.kv_heads, p.head_dim), jnp.float32)
    return q.astype(dt), k.astype(dt), v.astype(dt)

  def reference(self, problem: AttentionProblem, q, k, v):
    return attention_reference(q, k, v, causal=problem.causal, out_dtype=jnp.float32)

  def baseline(self, problem: AttentionProblem):
    """cuDNN's fused attention through ``jax.nn.dot_product_attention``."""
    return self._jax_nn(problem, "cudnn")

  def extra_baselines(self, problem: AttentionProblem) -> dict:
    return {"xla": self._jax_nn(problem, "xla")}

  @staticmethod
  def _jax_nn(problem, implementation):
    def f(q, k, v):
      return jax.nn.dot_product_attention(q, k, v, is_causal=problem.causal,
                                          implementation=implementation)
    return f

  def tolerance(self, problem: AttentionProblem) -> float:
    return 1e-2

  def config_to_dict(self, config: AttentionConfig) -> dict:
    return config.to_dict()

  def problem_key(self, problem: AttentionProblem) -> str:
    p = problem
    return (f"b{p.batch}:h{p.q_heads}/{p.kv_heads}:q{p.q_len}:kv{p.kv_len}:d{p.head_dim}:"
            f"{'causal' if p.causal else 'full'}:{p.dtype}")


ATTENTION = register(AttentionSpec())
