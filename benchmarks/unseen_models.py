"""The ops with their shipped tables against XLA and cuDNN on models outside
the training suites (CUPTI, L2 flushed, same process, one GPU).

The training suites hold Llama-3 GEMMs and attention, and six MoE models'
expert GEMMs. This script builds the same kinds of calls from public configs
of other models, in three sets (``--set``):

* ``v1`` (the default): head_dim 96, 128 and 256, 28/4, 16/8, 32/8 and 32/32
  heads, widths 3072-6144, 8, 60 and 128 experts;
* ``v2``: other models again: head_dim 64, 80, 96, 128 and 256, q/kv head
  ratios 1, 2, 3, 4, 6 and 8, widths 1536-6144 (a non-gated MLP among them),
  32, 40 and 64 experts with 4, 6 and 8 active,
* ``v3``: others again, with head layouts in none of the above: head_dim 64,
  128 and 256, q/kv head ratios 1, 2, 3, 4, 5 and 12, widths 1152-6144 (two
  non-gated MLPs), 8, 64 and 128 experts with 2, 6 and 8 active,
* ``v4``: other models again (head layouts may repeat): head_dim 64 and
  128, q/kv head ratios 1, 4, 6, 7 and 8, widths 896-8192 (a non-gated
  MLP), 32, 128 and 160 experts with 4, 6 and 8 active,

at token counts that are not powers of two (v2-v4: none of their token counts,
sequence lengths, decode batches or cache lengths is one), and times, per
problem:

* ``wt``: the public op (``wt.matmul``, ``wt.attention``,
  ``wt.decode_attention``, ``wt.ragged_dot``, and with ``--families`` the
  quantized ``wt.quantized_matmul`` / ``wt.quantized_ragged_dot``) under
  ``jax.jit`` with the
  shipped table of this GPU and the selection policy ``--policy`` (default
  ``auto``, the library's default), exactly what a user calls; each row
  also records ``first_use_s``, the wall seconds of its first use (lower,
  compile and the first call, with whatever the policy measures on first
  use): a cost, not a kernel time;
* ``base``: what a JAX user writes instead: ``jnp.dot``, for the quantized
  GEMM (``--families qmatmul``) XLA's dot on the 8-bit operands, for the
  quantized grouped GEMM (``qragged_dot``) XLA's ragged dot on them,
  ``jax.nn.dot_product_attention(implementation="cudnn")`` (decode: the
  faster of cuDNN and XLA, with ``key_value_seq_lengths``),
  ``lax.ragged_dot``.

``--dtype float16`` runs every problem with float16 operands and outputs
(the labels end in " float16"; the W8A8 problems, e4m3, are left out).

Each is checked against the float32 reference first. The summary gives
``base / wt`` per family (geomean, minimum, problems below 0.95x).
``--dry-run`` prints the problems and the configs the selector picks for
``--device-key`` under ``--policy`` without a GPU (what the CPU test runs).

    python3 benchmarks/unseen_models.py [--set v1|v2|v3|v4] [--policy NAME] [--lengths full]
        [--families matmul,attention,decode,ragged_dot,qmatmul,qragged_dot] [--models NAMES]
        [--quick] [--dtype float16] [--only TEXT] [--json out.json]
    python3 benchmarks/unseen_models.py --dry-run --device-key nvidia_h100_80gb_hbm3
    python3 benchmarks/unseen_models.py --report out.json [more.json ...]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from typing import NamedTuple

import jax

import wavetune_jax as wt
from wavetune_jax import (AttentionProblem, DecodeProblem, MatmulProblem,
                          QMatmulProblem, QRaggedDotProblem, RaggedDotProblem)

# Public configs (Hugging Face config.json): hidden, heads, head_dim, MLP width.
DENSE = {
    "qwen2_5_7b": dict(hidden=3584, q_heads=28, kv_heads=4, head_dim=128, ffn=18944),
    "gemma_2_9b": dict(hidden=3584, q_heads=16, kv_heads=8, head_dim=256, ffn=14336),
    "phi_3_mini": dict(hidden=3072, q_heads=32, kv_heads=32, head_dim=96, ffn=8192),
    "mistral_nemo_12b": dict(hidden=5120, q_heads=32, kv_heads=8, head_dim=128, ffn=14336),
}
# Experts, top-k, hidden, expert MLP width.
MOE = {
    "qwen1_5_moe_a2_7b": dict(E=60, top_k=4, hidden=2048, ffn=1408),
    "qwen3_30b_a3b": dict(E=128, top_k=8, hidden=2048, ffn=768),
    "mixtral_8x22b": dict(E=8, top_k=2, hidden=6144, ffn=16384),
}
GEMM_M = (1, 40, 200, 777, 3000, 12000)
ATTN_BATCH = (1, 6)
ATTN_SEQ = (200, 777, 2500, 6000)
DECODE_BATCH = (8, 32)
DECODE_CACHE = (3000, 20000)
MOE_TOKENS = (40, 300, 2000, 6000)
FAMILIES = ("matmul", "attention", "decode", "ragged_dot")
#: Families run only when named in ``--families``: the quantized GEMM
#: (``wt.quantized_matmul``) on the dense models' weights, W8A8-FP8 with the
#: weight ``[N, K]`` and int8 weight-only with the weight ``[K, N]`` and
#: ``[N, K]`` (label ``int8 nk``), and W4A16 (int4 ``[N, K]``, a scale per
#: 128 values of K, label ``int4 nk``), at the GEMM token counts; the
#: W8A8-FP8 grouped GEMM (``wt.quantized_ragged_dot``, experts ``[E, N, K]``)
#: and the int8 weight-only one (experts ``[E, K, N]``, label ``int8``) on the
#: MoE models' experts at the MoE token counts.
OPTIONAL = ("qmatmul", "qragged_dot")
ALL_FAMILIES = FAMILIES + OPTIONAL

# v2: other public configs (Hugging Face config.json of each), none in v1 or
# in the training suites, none with the shapes of one there. Dense: Qwen2.5-
# 1.5B, Llama-3.2-1B, StableLM-3B-4E1T, GPT-NeoX-20B (a GeLU MLP: one up
# projection, no gate), Gemma-2-2B, Falcon3-7B, Qwen3-32B, Phi-3-medium
# (14B). ``gated=False``: the MLP's first GEMM is ``ffn`` wide, not ``2 *
# ffn``.
DENSE_V2 = {
    "qwen2_5_1_5b": dict(hidden=1536, q_heads=12, kv_heads=2, head_dim=128, ffn=8960),
    "llama3_2_1b": dict(hidden=2048, q_heads=32, kv_heads=8, head_dim=64, ffn=8192),
    "stablelm_3b_4e1t": dict(hidden=2560, q_heads=32, kv_heads=32, head_dim=80, ffn=6912),
    "gpt_neox_20b": dict(hidden=6144, q_heads=64, kv_heads=64, head_dim=96, ffn=24576,
                         gated=False),
    "gemma_2_2b": dict(hidden=2304, q_heads=8, kv_heads=4, head_dim=256, ffn=9216),
    "falcon3_7b": dict(hidden=3072, q_heads=12, kv_heads=4, head_dim=256, ffn=23040),
    "qwen3_32b": dict(hidden=5120, q_heads=64, kv_heads=8, head_dim=128, ffn=25600),
    "phi_3_medium": dict(hidden=5120, q_heads=40, kv_heads=10, head_dim=128, ffn=17920),
}
# Routed experts only (shared experts are dense GEMMs): DeepSeek-V2-Lite
# (n_routed_experts, num_experts_per_tok, moe_intermediate_size), Qwen2-57B-
# A14B, Granite-3.0-3B-A800M, GPT-OSS-20B (num_local_experts, experts per
# token, intermediate_size).
MOE_V2 = {
    "deepseek_v2_lite": dict(E=64, top_k=6, hidden=2048, ffn=1408),
    "qwen2_57b_a14b": dict(E=64, top_k=8, hidden=3584, ffn=2560),
    "granite_3_0_3b_a800m": dict(E=40, top_k=8, hidden=1536, ffn=512),
    "gpt_oss_20b": dict(E=32, top_k=4, hidden=2880, ffn=2880),
}
GEMM_M_V2 = (3, 56, 333, 1100, 5000)
ATTN_BATCH_V2 = (1, 3)
ATTN_SEQ_V2 = (300, 1500, 5000)
DECODE_BATCH_V2 = (5, 48)
DECODE_CACHE_V2 = (2500, 12000)
MOE_TOKENS_V2 = (24, 700, 4500)


# v3: again other public configs (Hugging Face config.json of each), with
# head layouts in none of v1, v2 and the training suites: Gemma-3-27B (32/16
# heads), Gemma-3-1B (4/1, d 256), SmolLM3-3B (16/4), OLMo-2-13B (40/40, d
# 128), GPT-2 XL (25/25, d 64, no gate), Qwen3-14B (40/8: 5 query heads a KV
# head), Llama-3.2-3B (24/8), StarCoder2-15B (48/4, no gate); routed experts
# of Qwen3-235B-A22B (128 experts, top 8), ERNIE-4.5-21B-A3B (64, top 6),
# Hunyuan-A13B (64, top 8) and JetMoE-8B (8, top 2).
DENSE_V3 = {
    "gemma_3_27b": dict(hidden=5376, q_heads=32, kv_heads=16, head_dim=128, ffn=21504),
    "gemma_3_1b": dict(hidden=1152, q_heads=4, kv_heads=1, head_dim=256, ffn=6912),
    "smollm3_3b": dict(hidden=2048, q_heads=16, kv_heads=4, head_dim=128, ffn=11008),
    "olmo_2_13b": dict(hidden=5120, q_heads=40, kv_heads=40, head_dim=128, ffn=13824),
    "gpt2_xl": dict(hidden=1600, q_heads=25, kv_heads=25, head_dim=64, ffn=6400, gated=False),
    "qwen3_14b": dict(hidden=5120, q_heads=40, kv_heads=8, head_dim=128, ffn=17408),
    "llama3_2_3b": dict(hidden=3072, q_heads=24, kv_heads=8, head_dim=128, ffn=8192),
    "starcoder2_15b": dict(hidden=6144, q_heads=48, kv_heads=4, head_dim=128, ffn=24576,
                           gated=False),
}
MOE_V3 = {
    "qwen3_235b_a22b": dict(E=128, top_k=8, hidden=4096, ffn=1536),
    "ernie_4_5_21b_a3b": dict(E=64, top_k=6, hidden=2560, ffn=1536),
    "hunyuan_a13b": dict(E=64, top_k=8, hidden=4096, ffn=3072),
    "jetmoe_8b": dict(E=8, top_k=2, hidden=2048, ffn=5632),
}
GEMM_M_V3 = (5, 72, 450, 1700, 7000)
ATTN_BATCH_V3 = (1, 5)
ATTN_SEQ_V3 = (700, 2300, 7000)
DECODE_BATCH_V3 = (3, 40)
DECODE_CACHE_V3 = (1800, 9000)
MOE_TOKENS_V3 = (12, 450, 3300)


# v4: again other public configs (Hugging Face config.json of each), none in
# v1-v3 or the training suites: Mistral-Small-24B-2501 (32/8, MLP 32,768),
# Qwen2.5-0.5B (14/2: 7 query heads a KV head, d 64), Command-R-v01 (64/64,
# width 8,192), Yi-1.5-9B (32/4), SmolLM2-1.7B (32/32, d 64), InternLM2.5-20B
# (48/8: 6 a KV head), Granite-3.1-8B (32/8, MLP 12,800), MPT-7B (32/32, no
# gate); routed experts of Granite-3.1-1B-A400M (32 experts, top 8),
# gpt-oss-120b (128, top 4), GLM-4.5-Air (128, top 8) and DeepSeek-V2 (160,
# top 6). Head layouts may repeat those of other sets.
DENSE_V4 = {
    "mistral_small_24b": dict(hidden=5120, q_heads=32, kv_heads=8, head_dim=128, ffn=32768),
    "qwen2_5_0_5b": dict(hidden=896, q_heads=14, kv_heads=2, head_dim=64, ffn=4864),
    "command_r_35b": dict(hidden=8192, q_heads=64, kv_heads=64, head_dim=128, ffn=22528),
    "yi_1_5_9b": dict(hidden=4096, q_heads=32, kv_heads=4, head_dim=128, ffn=11008),
    "smollm2_1_7b": dict(hidden=2048, q_heads=32, kv_heads=32, head_dim=64, ffn=8192),
    "internlm2_5_20b": dict(hidden=6144, q_heads=48, kv_heads=8, head_dim=128, ffn=16384),
    "granite_3_1_8b": dict(hidden=4096, q_heads=32, kv_heads=8, head_dim=128, ffn=12800),
    "mpt_7b": dict(hidden=4096, q_heads=32, kv_heads=32, head_dim=128, ffn=16384, gated=False),
}
MOE_V4 = {
    "granite_3_1_1b_a400m": dict(E=32, top_k=8, hidden=1024, ffn=512),
    "gpt_oss_120b": dict(E=128, top_k=4, hidden=2880, ffn=2880),
    "glm_4_5_air": dict(E=128, top_k=8, hidden=4096, ffn=1408),
    "deepseek_v2": dict(E=160, top_k=6, hidden=5120, ffn=1536),
}
GEMM_M_V4 = (9, 120, 600, 2600, 9000)
ATTN_BATCH_V4 = (1, 7)
ATTN_SEQ_V4 = (450, 1900, 8200)
DECODE_BATCH_V4 = (6, 24, 72)
DECODE_CACHE_V4 = (1300, 5000, 14000)
MOE_TOKENS_V4 = (20, 900, 5200)

class ModelSet(NamedTuple):
  """Models and the sizes their calls are built at."""

  dense: dict
  moe: dict
  gemm_m: tuple
  attn_batch: tuple
  attn_seq: tuple
  decode_batch: tuple
  decode_cache: tuple
  moe_tokens: tuple

  @property
  def names(self) -> tuple:
    return (*self.dense, *self.moe)


SETS = {
    "v1": ModelSet(DENSE, MOE, GEMM_M, ATTN_BATCH, ATTN_SEQ, DECODE_BATCH, DECODE_CACHE,
                   MOE_TOKENS),
    "v2": ModelSet(DENSE_V2, MOE_V2, GEMM_M_V2, ATTN_BATCH_V2, ATTN_SEQ_V2, DECODE_BATCH_V2,
                   DECODE_CACHE_V2, MOE_TOKENS_V2),
    "v3": ModelSet(DENSE_V3, MOE_V3, GEMM_M_V3, ATTN_BATCH_V3, ATTN_SEQ_V3, DECODE_BATCH_V3,
                   DECODE_CACHE_V3, MOE_TOKENS_V3),
    "v4": ModelSet(DENSE_V4, MOE_V4, GEMM_M_V4, ATTN_BATCH_V4, ATTN_SEQ_V4, DECODE_BATCH_V4,
                   DECODE_CACHE_V4, MOE_TOKENS_V4),
}
# A label names its model, so labels are unique across the sets (a file may
# hold rows of both; --report reads them all).
assert len({n for m in SETS.values() for n in m.names}) == sum(len(m.names)
                                                              for m in SETS.values())
ALL_NAMES = tuple(n for m in SETS.values() for n in m.names)
#: The policy a file without one was measured under: the library default
#: before this script took --policy.
RECORDED_DEFAULT = "tables"


def gemm_weights(c: dict) -> dict:
  h, d = c["hidden"], c["head_dim"]
  q, kv = c["q_heads"] * d, c["kv_heads"] * d
  if not c.get("gated", True):
    return {"qkv": (h, q + 2 * kv), "o": (q, h), "up": (h, c["ffn"]), "down": (c["ffn"], h)}
  return {"qkv": (h, q + 2 * kv), "o": (q, h), "gate_up": (h, 2 * c["ffn"]),
          "down": (c["ffn"], h)}


def problems(families, quick: bool, models=None, model_set: str = "v1",
             dtype: str = "bfloat16") -> list[tuple[str, str, object]]:
  """``(family, label, problem)`` for every problem of the selected families
  (and models, if given) of one set of ``SETS``; with ``dtype`` float16 the
  16-bit operands and outputs are float16, each label ends in " float16",
  and the W8A8 problems (e4m3 operands, no 16-bit one) are left out."""
  out = _problems(families, quick, models, model_set)
  if dtype == "bfloat16":
    return out
  def cast(p):
    outs = {"out_dtype": dtype} if getattr(p, "out_dtype", None) == p.dtype else {}
    return dataclasses.replace(p, dtype=dtype, **outs)
  return [(f, f"{label} {dtype}", cast(p)) for f, label, p in out
          if p.dtype != "float8_e4m3fn"]


def _problems(families, quick: bool, models, model_set: str):
  ms = SETS[model_set]
  pick = (lambda v: v[::2]) if quick else (lambda v: v)
  out = []
  for name, c in ms.dense.items():
    if models and name not in models:
      continue
    if "matmul" in families:
      for w, (k, n) in gemm_weights(c).items():
        out += [("matmul", f"{name}.{w} M={m}", MatmulProblem(m=m, n=n, k=k))
                for m in pick(ms.gemm_m)]
    if "qmatmul" in families:
      for w, (k, n) in gemm_weights(c).items():
        for m in pick(ms.gemm_m):
          out += [("qmatmul", f"{name}.{w} M={m} w8a8",
                   QMatmulProblem(m=m, n=n, k=k, dtype="float8_e4m3fn",
                                  w_dtype="float8_e4m3fn", w_layout="nk")),
                  ("qmatmul", f"{name}.{w} M={m} int8", QMatmulProblem(m=m, n=n, k=k)),
                  ("qmatmul", f"{name}.{w} M={m} int8 nk",
                   QMatmulProblem(m=m, n=n, k=k, w_layout="nk")),
                  ("qmatmul", f"{name}.{w} M={m} int4 nk",
                   QMatmulProblem(m=m, n=n, k=k, w_dtype="int4", w_layout="nk",
                                  group_size=math.gcd(128, k)))]
    if "attention" in families:
      out += [("attention", f"{name} b={b} L={s}",
               AttentionProblem(batch=b, q_heads=c["q_heads"], kv_heads=c["kv_heads"],
                                q_len=s, kv_len=s, head_dim=c["head_dim"], causal=True))
              for b in ms.attn_batch for s in pick(ms.attn_seq)]
    if "decode" in families:
      out += [("decode", f"{name} b={b} cache={L}",
               DecodeProblem(batch=b, q_heads=c["q_heads"], kv_heads=c["kv_heads"],
                             kv_len=L, head_dim=c["head_dim"]))
              for b in ms.decode_batch for L in pick(ms.decode_cache)]
  for name, c in ms.moe.items():
    if models and name not in models:
      continue
    for w, (k, n) in {"w13": (c["hidden"], 2 * c["ffn"]),
                      "w2": (c["ffn"], c["hidden"])}.items():
      if "ragged_dot" in families:
        out += [("ragged_dot", f"{name}.{w} tokens={t}",
                 RaggedDotProblem(m=t * c["top_k"], g=c["E"], k=k, n=n))
                for t in pick(ms.moe_tokens)]
      if "qragged_dot" in families:
        for t in pick(ms.moe_tokens):
          out += [("qragged_dot", f"{name}.{w} tokens={t} w8a8",
                   QRaggedDotProblem(m=t * c["top_k"], g=c["E"], k=k, n=n,
                                     dtype="float8_e4m3fn", w_dtype="float8_e4m3fn",
                                     w_layout="nk")),
                  ("qragged_dot", f"{name}.{w} tokens={t} int8",
                   QRaggedDotProblem(m=t * c["top_k"], g=c["E"], k=k, n=n, w_dtype="int8"))]
  return out


def op_fn(family: str, p, policy: str | None = None):
  """The public op on the family's inputs, as a user calls it, under
  selection policy ``policy`` if given. The policy is entered inside the
  function, around the call: the profiler traces in worker threads, and a
  policy context holds in its own thread only."""
  if family == "matmul":
    op = lambda x, w: wt.matmul(x, w)
  elif family == "attention":
    op = lambda q, k, v, *lens: wt.attention(q, k, v, causal=p.causal,
                                             kv_lengths=lens[0] if lens else None)
  elif family == "decode":
    op = lambda q, k, v, *lens: wt.decode_attention(q, k, v, causal=p.causal,
                                                    kv_lengths=lens[0] if lens else None)
  elif family == "qmatmul":
    op = lambda x, w, s, *xs: wt.quantized_matmul(x, w, s, x_scales=xs[0] if xs else None,
                                                  w_layout=p.w_layout)
  elif family == "qragged_dot":
    op = lambda x, w, s, gs, *xs: wt.quantized_ragged_dot(
        x, w, s, gs, x_scales=xs[0] if xs else None, w_layout=p.w_layout)
  else:
    op = lambda lhs, rhs, gs: wt.ragged_dot(lhs, rhs, gs)
  if policy is None:
    return op

  def under_policy(*args):
    with wt.policy(policy):
      return op(*args)
  return under_policy


def first_use(fn, args) -> float:
  """Wall seconds of ``fn``'s first use under ``jax.jit``: lower and compile
  (the selection, and whatever the policy measures on first use, happen
  while tracing) and the first call, to its result."""
  t0 = time.perf_counter()
  exe = jax.jit(fn).lower(*args).compile()
  jax.block_until_ready(exe(*args))
  return time.perf_counter() - t0


def baselines(spec, p) -> dict:
  """What a user writes instead; decode takes the faster of cuDNN and XLA."""
  out = {"base": spec.baseline(p)}
  if spec.name == "decode":
    out.update({f"base_{k}": f for k, f in spec.extra_baselines(p).items()})
  return out


def describe(spec, config) -> str:
  d = spec.config_to_dict(config)
  rest = ",".join(f"{k}={v}" for k, v in d.items() if k != "backend")
  return d["backend"] + (f"({rest})" if rest else "")


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--set", default="v1", choices=sorted(SETS),
                  help="the models: v1 (default), v2, v3 or v4, other sets (see the module doc)")
  ap.add_argument("--policy", default="auto",
                  help=f"selection policy of the wt column, one of wavetune_jax.POLICIES "
                       f"({','.join(wt.POLICIES)}; default: auto, the library's default)")
  ap.add_argument("--families", default=",".join(FAMILIES),
                  help=f"comma-separated, of {','.join(ALL_FAMILIES)} (default: "
                       f"{','.join(FAMILIES)})")
  ap.add_argument("--quick", action="store_true", help="every other size")
  ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16"),
                  help="the 16-bit operands (default bfloat16; float16 labels end in "
                       "\" float16\", so a file may hold both)")
  ap.add_argument("--lengths", default="spread", choices=("spread", "full"),
                  help="decode: the sequences' valid lengths, spread over the cache "
                       "(default, as the sweeps) or every sequence at the full cache")
  ap.add_argument("--only", default=None, metavar="TEXT",
                  help="only the problems whose label (as --dry-run prints it) contains TEXT")
  ap.add_argument("--models", default="",
                  help="comma-separated, of the set's models (default: all): "
                       + "; ".join(f"{k}: {','.join(m.names)}" for k, m in SETS.items()))
  ap.add_argument("--iterations", type=int, default=10)
  ap.add_argument("--json", default=None,
                  help="write every row here (after each problem); problems already in "
                       "the file are skipped, so a cut-off run resumes")
  ap.add_argument("--compile-threads", type=int, default=1,
                  help="parallel compiles (default 1: XLA autotunes jnp.dot on the GPU "
                       "while compiling, and concurrent autotuning picks noisier kernels)")
  ap.add_argument("--report", nargs="+", metavar="JSON", default=None,
                  help="summarize files this script wrote (a later file's row replaces "
                       "an earlier one of the same problem); times nothing")
  ap.add_argument("--dry-run", action="store_true",
                  help="print the problems and the selected configs; time nothing")
  ap.add_argument("--device-key", default=None,
                  help="the tables to select from in --dry-run (default: this device)")
  a = ap.parse_args(argv)
  fams = tuple(f.strip() for f in a.families.split(",") if f.strip())
  bad = sorted(set(fams) - set(ALL_FAMILIES))
  if bad or not fams:
    ap.error(f"--families: unknown {bad}; choose from {','.join(ALL_FAMILIES)}")
  if a.iterations < 1:
    ap.error("--iterations must be >= 1")
  if a.compile_threads < 1:
    ap.error("--compile-threads must be >= 1")
  if a.lengths != "spread" and "decode" not in fams:
    ap.error("--lengths is decode's: add decode to --families")
  if a.report:
    if a.lengths != "spread":
      ap.error("--lengths selects the mix to run; --report reads each file's own")
    if a.only is not None:
      ap.error("--only selects problems to run; --report reads every row of its files")
    return report(a.report, fams, a.models)
  # Checked here, not by argparse: the library's policies are read when run.
  policy = a.policy
  if policy not in wt.POLICIES:
    ap.error(f"--policy: unknown {policy!r}; choose from {','.join(wt.POLICIES)}")
  ms = SETS[a.set]
  models = tuple(m.strip() for m in a.models.split(",") if m.strip())
  bad = sorted(set(models) - set(ms.names))
  if bad:
    ap.error(f"--models: unknown {bad} in --set {a.set}; choose from {','.join(ms.names)}")
  plan = problems(fams, a.quick, models, a.set, a.dtype)
  if a.only is not None:
    plan = [row for row in plan if a.only in row[1]]
    if not plan:
      ap.error(f"--only {a.only!r} matches no problem")
  if a.dry_run:
    with wt.policy(policy):
      for fam, label, p in plan:
        spec = wt.get_family(fam)
        sel = wt.select(fam, p, a.device_key)
        print(f"{fam:<12}{label:<40}{describe(spec, sel.config)}  [{sel.source}]")
    print(f"{len(plan)} problems")
    return 0
  if a.device_key:
    ap.error("--device-key is for --dry-run; timing uses this device's tables")
  if jax.default_backend() != "gpu":
    print("unseen_models: needs a GPU (CUPTI timing); use --dry-run on a CPU", file=sys.stderr)
    return 2
  from wavetune_jax.tuning import evaluate, profiler
  dev = jax.devices()[0]
  print(dev.device_kind, "jax", jax.__version__, f"set {a.set}, policy {policy}, decode lengths "
        f"{a.lengths}", flush=True)
  prof = profiler.Profiler(iterations=a.iterations, threads=a.compile_threads)
  out = {"device_kind": dev.device_kind, "jax": jax.__version__, "set": a.set,
         "policy": policy, "lengths": a.lengths, "rows": []}
  if a.json and os.path.exists(a.json):
    out = resume(a.json, dev.device_kind, a.set, policy, a.lengths)
    done = {(r["family"], r["label"]) for r in out["rows"]}
    plan = [t for t in plan if (t[0], t[1]) not in done]
    print(f"{a.json}: {len(done)} problems on file, {len(plan)} to run", flush=True)
  print(f"{'family':<12}{'problem':<40}{'base us':>10}{'wt us':>10}{'base/wt':>8}"
        f"{'1st s':>8}  wt config", flush=True)
  t0 = time.time()
  # The whole loop under the policy: the selection recorded per row (and its
  # source) is the one the wt column runs.
  with wt.policy(policy):
    for fam, label, p in plan:
      spec = wt.get_family(fam)
      if fam == "decode":
        spec = spec.with_lengths(a.lengths)
      args = spec.inputs(p, jax.random.PRNGKey(0))
      fns = {"wt": op_fn(fam, p, policy)}
      if policy != "tables":
        # The same op on the tables alone (no measurement), in the same row.
        fns["wt_tables"] = op_fn(fam, p, "tables")
      fns.update(baselines(spec, p))
      # First use before anything else selects for this problem: it pays
      # the selection as a user's first call does.
      first_s, first_err = None, None
      try:
        first_s = first_use(fns["wt"], args)
      except Exception as e:  # noqa: BLE001 - recorded; the timing below says more
        first_err = f"{type(e).__name__}: {str(e)[:200]}"
      sel = wt.select(fam, p)
      with wt.policy("tables"):
        sel_tables = wt.select(fam, p)
      ref = spec.reference(p, *args)
      res = prof.measure_many(list(fns.values()), args, reference=ref,
                              tolerance=spec.tolerance(p), out_bytes=ref.size * 4)
      del args, ref
      row = {"family": fam, "label": label, "problem": spec.problem_key(p),
             "config": spec.config_to_dict(sel.config), "source": sel.source,
             "us": {}, "status": {}, "first_use_s": first_s,
             "tables_config": spec.config_to_dict(sel_tables.config),
             "tables_source": sel_tables.source}
      for k, r in zip(fns, res):
        row["us"][k] = r.median_us if r.status == "ok" else None
        if r.status != "ok":
          row["status"][k] = f"{r.status}: {r.error[:200]}"
      if first_err:
        row["status"]["wt_first_use"] = first_err
      out["rows"].append(row)
      print(_line(row, describe(spec, sel.config)), flush=True)
      for k, s in row["status"].items():
        print(f"    {k}: {s}", flush=True)
      if a.json:
        tmp = a.json + ".tmp"
        with open(tmp, "w") as f:
          json.dump(out, f)
        os.replace(tmp, a.json)
  summarize(out["rows"], evaluate._geomean)
  print(f"elapsed {time.time() - t0:.0f} s", flush=True)
  return 0


def _line(row: dict, config: str) -> str:
  """A row as the timing loop and --report print it."""
  base = min((v for k, v in row["us"].items() if not k.startswith("wt") and v),
             default=math.nan)
  w = row["us"].get("wt") or math.nan
  first = row.get("first_use_s")
  first = f"{first:8.2f}" if isinstance(first, (int, float)) else f"{'-':>8}"
  return (f"{row['family']:<12}{row['label']:<40}{base:10.1f}{w:10.1f}{base / w:8.3f}{first}"
          f"  {config}")


ROW_KEYS = ("family", "label", "problem", "config", "us", "status")


def _read(path: str) -> dict:
  """A file this script wrote; ``ValueError`` naming what is wrong."""
  try:
    with open(path) as f:
      out = json.load(f)
  except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
    raise ValueError(f"{path} is not readable JSON ({type(e).__name__})") from None
  rows = out.get("rows") if isinstance(out, dict) else None
  if (not isinstance(rows, list) or not isinstance(out.get("device_kind"), str)
      or not all(isinstance(r, dict) and all(k in r for k in ROW_KEYS)
                 and r["family"] in ALL_FAMILIES and isinstance(r["us"], dict)
                 for r in rows)):
    raise ValueError(f"{path} is not a file this script wrote (no device_kind, or rows "
                     f"without {', '.join(ROW_KEYS)})")
  if out.get("set", "v1") not in SETS or not isinstance(out.get("policy", ""), str):
    raise ValueError(f"{path} is not a file this script wrote (set {out.get('set')!r}, "
                     f"policy {out.get('policy')!r})")
  return out


def resume(path: str, device_kind: str, model_set: str, policy: str,
           lengths: str = "spread") -> dict:
  """The rows of an earlier run of this GPU kind, model set, policy and
  decode length mix (``SystemExit`` otherwise)."""
  try:
    out = _read(path)
  except ValueError as e:
    raise SystemExit(f"unseen_models: {e}; move it away or pass another --json") from None
  if out.get("device_kind") != device_kind:
    raise SystemExit(f"unseen_models: {path} holds rows of {out.get('device_kind')!r}, "
                     f"this GPU is {device_kind!r}; pass another --json")
  checks = [("--set", out.get("set", "v1"), model_set),
            ("--policy", out.get("policy", RECORDED_DEFAULT), policy)]
  if any(r.get("family") == "decode" for r in out.get("rows", ())):
    checks.append(("--lengths", out.get("lengths", "spread"), lengths))
  for what, theirs, ours in checks:
    if theirs != ours:
      raise SystemExit(f"unseen_models: {path} holds rows of {what} {theirs}, this run is "
                       f"{what} {ours}; pass another --json")
  return {**out, "set": model_set, "policy": policy, "lengths": lengths}


def _selected(row: dict):
  """The config of ``row`` that today's selection, made without measuring,
  can be compared with: a refined row's tables answer, else its config."""
  if row.get("source") == "measured" and row.get("tables_config") is not None:
    return row["tables_config"]
  return row["config"]


def report(paths, families, models: str) -> int:
  """Prints, per problem of the selected families and models (of either
  set), the last row of ``paths`` that ran the config the selector picks
  today under the files' policy (else its last row, marked ``older
  selection``), and the per-family summary. A row first-use refinement
  decided (source ``measured``) is compared by the tables' answer it
  recorded: what a selection without a GPU can tell."""
  found: dict = {}
  kinds, policies, mixes = set(), set(), set()
  for path in paths:
    try:
      out = _read(path)
    except ValueError as e:
      print(f"unseen_models: {e}", file=sys.stderr)
      return 2
    kinds.add(out["device_kind"])
    policies.add(out.get("policy", RECORDED_DEFAULT))
    if any(r["family"] == "decode" for r in out["rows"]):
      mixes.add(out.get("lengths", "spread"))
    for r in out["rows"]:
      found.setdefault((r["family"], r["label"]), []).append(r)
  if len(kinds) > 1:
    print(f"unseen_models: the files hold rows of several GPUs {sorted(kinds)}", file=sys.stderr)
    return 2
  if len(policies) > 1:
    print(f"unseen_models: the files hold rows of several policies {sorted(policies)}",
          file=sys.stderr)
    return 2
  if len(mixes) > 1:
    print(f"unseen_models: the files hold decode rows of several length mixes "
          f"{sorted(mixes)}; report each mix on its own", file=sys.stderr)
    return 2
  pol = next(iter(policies), RECORDED_DEFAULT)
  if pol not in wt.POLICIES:
    print(f"unseen_models: the files' policy {pol!r} is not one of this library's "
          f"({','.join(wt.POLICIES)})", file=sys.stderr)
    return 2
  names = tuple(m.strip() for m in models.split(",") if m.strip())
  bad = sorted(set(names) - set(ALL_NAMES))
  if bad:
    print(f"unseen_models: --models: unknown {bad}", file=sys.stderr)
    return 2
  hw = wt.device_key(next(iter(kinds))) if kinds else None
  plan = {(f, label): p for k in SETS for dt in ("bfloat16", "float16")
          for f, label, p in problems(ALL_FAMILIES, False, None, k, dt)}
  keep, older = [], []
  with wt.policy(pol):
    for key, rs in found.items():
      if key[0] not in families or (names and key[1].split(" ")[0].split(".")[0] not in names):
        continue
      p = plan.get(key)
      today = (wt.get_family(key[0]).config_to_dict(wt.select(key[0], p, hw).config)
               if p is not None else None)
      now = [r for r in rs if _selected(r) == today]
      keep.append(now[-1] if now else rs[-1])
      if not now:
        older.append(key[1])
  print(*kinds, f"(policy {pol}): {len(keep)} problems, {len(older)} measured with an "
        f"older selection")
  for r in keep:
    print(_line(r, r["config"]["backend"]
                + ("  (older selection)" if r["label"] in older else "")))
  from wavetune_jax.tuning import evaluate
  summarize(keep, evaluate._geomean)
  return 0


def speedups(rows, column: str = "wt") -> dict[str, list[float]]:
  """``base / <column>`` per family over the rows where both ran (``wt``:
  the run's policy; ``wt_tables``: the tables alone, timed in the same row)."""
  out: dict[str, list[float]] = {}
  for r in rows:
    base = [v for k, v in r["us"].items() if not k.startswith("wt") and v]
    if base and r["us"].get(column):
      out.setdefault(r["family"], []).append(min(base) / r["us"][column])
  return out


def summarize(rows, geomean) -> None:
  for column in ("wt", "wt_tables"):
    for fam, v in speedups(rows, column).items():
      low = sum(x < 0.97 for x in v)
      print(f"{fam}: {column} vs "
            f"{'the faster of cuDNN and XLA' if fam == 'decode' else 'base'} "
            f"{geomean(v):.3f}x geomean, min {min(v):.3f}x, {low} of {len(v)} below 0.97x",
            flush=True)
  first = sorted(r["first_use_s"] for r in rows
                 if isinstance(r.get("first_use_s"), (int, float)))
  if first:
    print(f"first use of wt (trace, compile, first call): median "
          f"{statistics.median(first):.2f} s, max {first[-1]:.2f} s over {len(first)} problems",
          flush=True)
  failed = [(r["label"], k) for r in rows for k in r["status"]]
  if failed:
    print(f"failed: {failed}", flush=True)


if __name__ == "__main__":
  sys.exit(main())
