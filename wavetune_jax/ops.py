"""Public tuned ops: thin wrappers over :func:`wavetune_jax.core.op.tuned_call`."""

from __future__ import annotations

import jax

from wavetune_jax.core.op import tuned_call
from wavetune_jax.families import ATTENTION, DECODE, MATMUL, QMATMUL, QRAGGED_DOT, RAGGED_DOT

__all__ = ["matmul", "quantized_matmul", "quantized_ragged_dot", "attention", "decode_attention",
           "ragged_dot"]


def matmul(x: jax.Array, w: jax.Array, *, out_dtype=None, config=None) -> jax.Array:
  """``x @ w`` with a tuned kernel and launch config, chosen at trace time.

  Works inside ``jax.jit``: shapes are static there, so the choice is made
  once per shape, in microseconds, and baked into the kernel.

  Args:
    x: ``[M, K]`` bfloat16, float16 or float32 array.
    w: ``[K, N]`` array of the same dtype.
    out_dtype: output dtype, bfloat16, float16 or float32 (default
      ``x.dtype``); accumulation is float32.
    config: a backend's config (e.g. ``TritonMatmulConfig``) or a dict
      ``{"backend": name, **fields}`` to use as given. ``None`` lets the
      selector choose: a config pinned with ``use_config``, else the active
      policy (by default the shipped table of this GPU, then the heuristic).

  Returns:
    ``[M, N]`` array of ``out_dtype``.

  Raises:
    ValueError: rank != 2, mismatched inner dimensions or dtypes, an
      unsupported dtype or out_dtype, or a config that cannot run this problem
      here (unknown field, block not a power of two, split_k larger than the
      number of K blocks, beyond the GPU's shared memory, ...).
  """
  return tuned_call(MATMUL, x, w, out_dtype=out_dtype, config=config)


def quantized_matmul(x: jax.Array, w: jax.Array, scales: jax.Array, *, x_scales=None,
                     w_layout: str = "kn", out_dtype=None, config=None) -> jax.Array:
  """A GEMM on 8-bit (or int4) weights, tuned like :func:`matmul`: ``(x @ w) * scales``
  (weight-only, W8A16), or with e4m3 activations and their per-row scales
  ``(x @ w) * x_scales[:, None] * scales`` (W8A8-FP8).

  The dequantized weight is ``w * scales`` (``w`` int8 or float8_e4m3fn,
  one float32 scale per output channel, as ``qwix`` and most checkpoints
  quantize a linear layer); W8A8's dequantized activations are ``x *
  x_scales[:, None]`` (one scale per token: :func:`quantize_rows`). The
  scales leave the dot product, so the kernels multiply the 8-bit values
  with fp32 accumulation and scale the result once: a decode step reads half
  the bytes of a 16-bit weight, and W8A8 runs on the FP8 tensor cores (twice
  bfloat16's rate). Tolerance against the float32 product of the
  dequantized operands: that of a bfloat16 GEMM (1e-2 relative), 2e-2 for
  W8A8 (FP8 MMA keeps fewer accumulator bits). The W8A8 bound is for inputs
  whose products cancel, as in a model's layers; where an output sums
  thousands of products of one sign, Hopper's FP8 accumulation loses more,
  growing with K per K split, in XLA's FP8 dot as in the kernel (an H200:
  0.15 at 14,336 K unsplit for both; docs/results.md, "W8A8-FP8 on an H200").

  W4A16: an int4 ``w [N, K]`` (``w_layout="nk"``) with ``scales [K //
  group, N]``, a scale per ``group`` values of K of each channel
  (``quantize_weight(w, "int4", layout="nk", group_size=128)``): the
  result is ``x @ dequant(w).T``; the Mosaic kernel converts and scales each
  group in registers (groups of 64 or 128, K a multiple of 256, up to 64
  rows, and to 128 in chunks of 64; M a multiple of 8 or below 8), XLA dequantizes the weight first. Same
  tolerance as W8A16. The group's scale multiplies the values in ``x``'s
  dtype: with float16 ``x`` the dequantized weights must lie in float16's
  range (about 6e-5 to 65,504 in magnitude for full precision; bfloat16
  has float32's range).

  Args:
    x: ``[M, K]`` bfloat16 or float16 activations, or float8_e4m3fn with
      ``x_scales``.
    w: ``[K, N]`` int8 or float8_e4m3fn weight (``[N, K]`` with
      ``w_layout="nk"``; W8A8 takes e4m3), or an int4 ``[N, K]`` one.
    scales: ``[N]`` floating point (used as float32), one per output channel;
      ``[K // group, N]`` for int4 ``w``.
    x_scales: ``[M]`` floating point, one per row; only with e4m3 ``x``.
    w_layout: ``"kn"`` (default) or ``"nk"``: the weight transposed, K
      contiguous, the layout FP8 tensor cores read; the Mosaic FP8 kernel
      needs it (``quantize_weight(w, "float8_e4m3fn", layout="nk")``), with
      ``"kn"`` W8A8 runs on XLA.
    out_dtype: bfloat16, float16 or float32 (default ``x.dtype``;
      bfloat16 for e4m3 ``x``).
    config: ``XlaQMatmulConfig()`` (XLA's dot with the scales after),
      ``MosaicMatmulConfig`` (the Mosaic kernels: weight-only up to 64 rows, int4 128;
      W8A8 at any size; every one with M a multiple of 8 or below 8), a dict ``{"backend": name, **fields}``, or ``None`` to
      let the selector choose.

  Returns:
    ``[M, N]`` array of ``out_dtype``.

  Raises:
    ValueError: ranks, inner dimensions, dtypes, the scales' shapes or the
      layout wrong, or a config that cannot run this problem here.
  """
  return tuned_call(QMATMUL, x, w, scales, x_scales=x_scales, w_layout=w_layout,
                    out_dtype=out_dtype, config=config)


def quantized_ragged_dot(x: jax.Array, w: jax.Array, scales: jax.Array, group_sizes, *,
                         x_scales=None, w_layout: str = "kn", out_dtype=None,
                         config=None) -> jax.Array:
  """A grouped GEMM on 8-bit expert weights (``lax.ragged_dot`` semantics),
  tuned like :func:`ragged_dot`: row ``r`` of expert ``g`` is ``(x[r] @
  w[g]) * scales[g]`` (weight-only), or ``(x[r] @ w[g]) * x_scales[r] *
  scales[g]`` with e4m3 activations (W8A8-FP8).

  The dequantized weights are ``w[g] * scales[g]`` (``w`` int8 or
  float8_e4m3fn, one float32 scale per expert and output channel); W8A8's
  dequantized activations ``x * x_scales[:, None]`` (:func:`quantize_rows`).
  The kernels multiply the 8-bit values with fp32 accumulation and scale
  the result once. Rows past ``sum(group_sizes)`` are zeros; the sizes are
  clipped as :func:`ragged_dot`'s. NaN or Inf in one expert's e4m3 weights
  (or scales) reaches that expert's rows on the Mosaic kernels; on the XLA
  config it may reach every row below the sum, as :func:`ragged_dot`'s XLA
  backend (int8 has no NaN). Tolerance against the float32 grouped
  product of the dequantized operands: 1e-2 relative (that of a bfloat16
  grouped GEMM), 2e-2 for W8A8, for inputs whose products cancel; the FP8
  kernel runs the same FP8 wgmma as :func:`quantized_matmul`'s, whose
  accumulation loses more where an output sums thousands of products of
  one sign (measured there, not on this op).

  The Mosaic kernels need (else the XLA config runs, or a pinned Mosaic
  config is an error): weight-only, ``w_layout="kn"``, N a multiple of 128
  and K of 64 (tiles 64 x 256 or 128 x 128); W8A8, ``w_layout="nk"``, K a
  multiple of 128 and N of 64; two K steps or more a split (K >= 128
  weight-only, 256 W8A8, unsplit); a Hopper GPU.

  Args:
    x: ``[M, K]`` bfloat16 or float16 activations, or float8_e4m3fn with
      ``x_scales``; rows grouped by expert.
    w: ``[G, K, N]`` int8 or float8_e4m3fn expert weights (``[G, N, K]``
      with ``w_layout="nk"``; W8A8 takes e4m3).
    scales: ``[G, N]`` floating point (used as float32).
    group_sizes: ``[G]`` integers (a traced array is fine), as
      :func:`ragged_dot`'s.
    x_scales: ``[M]`` floating point, one per row; only with e4m3 ``x``.
    w_layout: ``"kn"`` (default) or ``"nk"``: each expert's weight
      transposed, K contiguous, the layout FP8 tensor cores read; the Mosaic
      FP8 kernel needs it (``quantize_weight(w, "float8_e4m3fn",
      layout="nk")`` on the ``[G, K, N]`` weights); with ``"kn"`` W8A8 runs
      on XLA. The Mosaic weight-only kernel reads ``"kn"``; with ``"nk"``
      weight-only runs on XLA.
    out_dtype: bfloat16, float16 or float32 (default ``x.dtype``;
      bfloat16 for e4m3 ``x``).
    config: ``XlaQRaggedDotConfig()`` (XLA's ragged dot with the scales
      after), ``MosaicRaggedDotConfig`` (the Mosaic kernels: W8A8 with
      ``w_layout="nk"`` on FP8 tensor cores, weight-only with ``"kn"``, each
      8-bit block converted before a 16-bit wgmma), a dict ``{"backend":
      name, **fields}``, or ``None`` to let the selector choose.

  ``jax.vmap`` over any of the arrays runs one grouped GEMM of
  ``batch * M`` rows (rows and their scales reordered by group, and back)
  over ``batch * G`` experts: on the XLA config NaN or Inf in one example's
  e4m3 experts may reach the other examples' rows too.

  Returns:
    ``[M, N]`` array of ``out_dtype``.

  Raises:
    ValueError: ranks, contracting dimensions, dtypes, the scales' or group
      sizes' shapes or the layout wrong, or a config that cannot run this
      problem here.
  """
  return tuned_call(QRAGGED_DOT, x, w, scales, group_sizes, x_scales=x_scales,
                    w_layout=w_layout, out_dtype=out_dtype, config=config)


def attention(q: jax.Array, k: jax.Array, v: jax.Array, *, causal: bool = True,
              scale: float | None = None, kv_lengths=None, causal_align: str = "top_left",
              local_window_size=None, logit_soft_cap: float | None = None, sinks=None,
              config=None) -> jax.Array:
  """Flash attention forward with a tuned kernel and launch config.

  Works inside ``jax.jit`` like :func:`matmul`.

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``, bfloat16 or float16.
    k, v: ``[batch, kv_len, kv_heads, head_dim]`` of the same dtype;
      ``kv_heads`` divides ``q_heads`` (grouped-query attention reads the
      shared K/V in place).
    causal: a Python bool: mask keys after the query.
    scale: softmax scale, a Python float (default ``1 / sqrt(head_dim)``).
    kv_lengths: ``[batch]`` integers, the valid KV length of each sequence (a
      KV cache): keys at or past it are neither seen nor read, as
      ``key_value_seq_lengths`` of ``jax.nn.dot_product_attention``; lengths
      of any integer width are clipped to ``[0, kv_len]`` in their own dtype
      (a uint32 ``4294967295`` is ``kv_len``; NumPy 64-bit lengths passed as
      an argument of ``jax.jit`` reach the op already narrowed to 32 bits by
      JAX, unless ``jax_enable_x64``: clip them first). None: every key is
      valid.
    causal_align: where the causal diagonal sits when the queries do not
      start at key 0. ``"top_left"`` (default): query ``i`` sees keys
      ``j <= i``, as ``jax.nn.dot_product_attention(is_causal=True)``.
      ``"bottom_right"``: the queries are the last ``q_len`` positions of
      each sequence, query ``i`` sees keys ``j <= i + L - q_len`` (``L`` its
      valid length), as FlashAttention 2.1+: decode (``q_len = 1`` sees the
      whole cache) and chunked prefill. A query that sees no key gives zeros.
    local_window_size: a sliding (local) window, as
      ``jax.nn.dot_product_attention`` takes it: an int ``w`` (``(w, w)``) or
      a ``(left, right)`` pair of Python ints; query position ``i`` (aligned as
      ``causal_align`` says) sees keys ``i - left <= j <= i + right`` (a side
      of at least ``q_len + kv_len`` bounds nothing: it is no bound). None:
      no window.
    logit_soft_cap: a Python float ``cap > 0``: the scaled scores ``s``
      become ``cap * tanh(s / cap)`` before the mask and softmax (Gemma-2).
    sinks: ``[q_heads]`` logits (float32), one per query head, added to each
      softmax's denominator as ``exp(sink)`` (attention sinks); None: none.
    config: a backend's config (``TritonAttentionConfig``,
      ``MosaicAttentionConfig``) or a dict ``{"backend": name, **fields}``;
      ``None`` lets the selector choose. With a window, soft-capping or
      sinks: cuDNN runs a window (causal, or a right side of 0) without the
      other two, KV lengths or the bottom-right alignment; the Mosaic kernel
      and XLA's attention any of them, with lengths and either alignment; the
      Triton kernel none.

  Returns:
    ``[batch, q_len, q_heads, head_dim]`` of ``q.dtype``.

  Raises:
    ValueError: wrong ranks; batch, head_dim or dtype mismatches; ``kv_heads``
      not dividing ``q_heads``; an unsupported dtype or head_dim (> 256); an
      empty KV sequence; ``causal`` or ``scale`` of the wrong type;
      ``kv_lengths`` not ``[batch]`` integers; an unknown ``causal_align``; a
      negative or non-int window, a cap that is not a finite float > 0,
      ``sinks`` not ``[q_heads]`` real numbers; or a config that cannot run
      this problem here (the cuDNN backend has no KV lengths, bottom-right
      alignment or two-sided window; the Triton backend has no window,
      soft-capping or sinks; the Mosaic backend needs a Hopper GPU).
  """
  return tuned_call(ATTENTION, q, k, v, causal=causal, scale=scale, kv_lengths=kv_lengths,
                    causal_align=causal_align, local_window_size=local_window_size,
                    logit_soft_cap=logit_soft_cap, sinks=sinks, config=config)


def decode_attention(q: jax.Array, k: jax.Array, v: jax.Array, *, kv_lengths=None,
                     block_tables=None, causal: bool = True, scale: float | None = None,
                     local_window_size=None, logit_soft_cap: float | None = None, sinks=None,
                     config=None) -> jax.Array:
  """Attention of a few new queries per sequence against a KV cache
  (flash-decoding: the cache split across programs), tuned like :func:`matmul`.

  The queries are the newest ``q_len`` positions of each sequence: query
  ``t`` sees keys ``j <= t + L - q_len`` (``L`` the sequence's valid length),
  the bottom-right causal alignment of FlashAttention 2.1+ and
  ``wavetune_jax.attention(..., causal_align="bottom_right")``. One query
  sees the whole valid cache. The grouped query heads of a KV head are
  computed together, so a shared KV head is read once per group.

  The cache is contiguous, or paged as serving stacks keep it (vLLM, JAX's
  paged attention): a pool of pages shared by the sequences and a block
  table naming each sequence's pages in order; position ``j`` of sequence
  ``b`` is row ``j % page_size`` of page ``block_tables[b, j // page_size]``.

  Args:
    q: ``[batch, q_len, q_heads, head_dim]``, bfloat16 or float16, ``q_len``
      from 1 to 64.
    k, v: ``[batch, kv_len, kv_heads, head_dim]``, the cache, same dtype;
      ``kv_heads`` divides ``q_heads``. With ``block_tables``: the pages,
      ``[num_pages, page_size, kv_heads, head_dim]``, and ``kv_len =
      max_pages * page_size``.
    kv_lengths: ``[batch]`` integers, the valid length of each sequence
      (any integer width, clipped to ``[0, kv_len]`` in its own dtype; NumPy
      64-bit lengths passed through ``jax.jit`` arrive narrowed to 32 bits
      by JAX, unless ``jax_enable_x64``: clip them first); keys
      at or past it are never read, so NaN or Inf there never reaches the
      output (NaN in the queries or the valid keys does, as in a float32
      softmax). None: every key is valid.
    block_tables: ``[batch, max_pages]`` integers, the page ids of each
      sequence, or None (a contiguous cache). Only the entries that hold a
      sequence's keys (``j < ceil(length / page_size)``) are read; the others
      may hold anything (``-1`` padding), and pages no sequence uses are
      never read. Where the table and the lengths are concrete (not traced
      under ``jax.jit``) the entries read are checked; traced page ids are
      clipped to ``[0, num_pages - 1]`` (and lengths to ``[0, kv_len]``).
    causal: a Python bool; False: every query sees every valid key.
    scale: softmax scale, a Python float (default ``1 / sqrt(head_dim)``).
    local_window_size: a sliding (local) window, an int ``w`` (``(w, w)``)
      or a ``(left, right)`` pair: query ``t``, at position ``i = t + L -
      q_len``, sees keys ``i - left <= j <= i + right`` (Mistral's 4,096
      window is ``(4095, 0)``). The Mosaic kernel reads only the window's
      keys (from the block that holds its first one); block-table entries
      of pages wholly left of a sequence's window are never read and may
      hold anything. None: no window.
    logit_soft_cap: a Python float ``cap > 0``: the scaled scores ``s``
      become ``cap * tanh(s / cap)`` before the mask and softmax (Gemma-2).
    sinks: ``[q_heads]`` logits (float32), one per query head, added to each
      softmax's denominator as ``exp(sink)`` (attention sinks); None: none.
    config: a backend's config (``MosaicDecodeConfig``,
      ``TritonDecodeConfig``, ``XlaDecodeConfig``, ``CudnnDecodeConfig``) or a
      dict ``{"backend": name, **fields}``; ``None`` lets the selector
      choose. With a window, soft-capping or sinks the Mosaic kernel (on
      Hopper) or XLA's attention runs the call; cuDNN and the Triton
      kernel run none of them.

  Returns:
    ``[batch, q_len, q_heads, head_dim]`` of ``q.dtype``; a query that sees
    no key (a sequence of length 0) gives zeros.

  Raises:
    ValueError: wrong ranks; batch, head_dim or dtype mismatches; ``kv_heads``
      not dividing ``q_heads``; ``q_len`` above 64; an unsupported dtype or
      head_dim (> 256); ``kv_lengths`` not ``[batch]`` integers;
      ``block_tables`` not ``[batch, max_pages]`` integers, k and v pages of
      different shapes or an empty pool; with concrete values, a length
      above ``max_pages * page_size`` or a page id read outside
      ``[0, num_pages)`` (the sequence and entry are named); or a config
      that cannot run here (cuDNN takes ``kv_lengths`` with one query only;
      a Triton ``block_k`` must divide ``page_size``); a negative or non-int
      window, a cap that is not a finite float > 0, ``sinks`` not
      ``[q_heads]`` real numbers.
  """
  return tuned_call(DECODE, q, k, v, kv_lengths=kv_lengths, block_tables=block_tables,
                    causal=causal, scale=scale, local_window_size=local_window_size,
                    logit_soft_cap=logit_soft_cap, sinks=sinks, config=config)


def ragged_dot(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, *, out_dtype=None,
               config=None) -> jax.Array:
  """Grouped GEMM with ``jax.lax.ragged_dot`` semantics, tuned like :func:`matmul`.

  Rows of ``lhs`` are grouped contiguously: the first ``group_sizes[0]`` rows
  are multiplied by ``rhs[0]``, the next ``group_sizes[1]`` by ``rhs[1]``, and
  so on (the expert GEMMs of a mixture-of-experts layer, tokens sorted by
  expert). ``group_sizes`` may be a traced array: the config is chosen from
  the static shapes (rows, experts, K, N, dtypes), never from the sizes.

  Args:
    lhs: ``[M, K]`` bfloat16, float16 or float32.
    rhs: ``[G, K, N]`` of the same dtype.
    group_sizes: ``[G]`` integers of any width (booleans are not integers),
      an array or a sequence of Python integers (as an argument of
      ``jax.jit``, an array: each item of a list would be traced apart).
      Rows past ``sum(group_sizes)`` come out as zeros, as with
      ``lax.ragged_dot``; sizes that sum past ``M`` are clipped at ``M`` and
      negative sizes count as 0 (``lax.ragged_dot`` leaves both undefined):
      each size is clipped to ``[0, M]`` in its own dtype, so a uint32
      ``4294967295`` is ``M``, not -1. NumPy 64-bit sizes passed as an
      argument of ``jax.jit`` or ``jax.vmap`` reach the op already narrowed
      to 32 bits by JAX (unless ``jax_enable_x64``): give such sizes to the
      op itself, or clip them first. (The XLA backend on a GPU decides how
      to clip by the cuDNN of the process that traces: trace a program
      exported or compiled ahead of time on a machine of the cuDNN it will
      run with.) Rows past the sum are exactly zero,
      whatever ``lhs`` and ``rhs`` hold, on the Pallas backends and on the
      XLA backend on a CPU (on a GPU the XLA backend is ``lax.ragged_dot`` as
      XLA lowers it, with nothing added). NaN or Inf in one
      expert's weights reaches the rows of that expert on the Pallas
      backends; on the XLA backend it may reach every row below the sum (the
      rows of other experts, even from an expert with no rows), as with
      ``lax.ragged_dot``, whose dense form on a CPU multiplies each row by
      every expert's weight.
    out_dtype: bfloat16, float16 or float32 (default ``lhs.dtype``);
      accumulation is float32. (float16 out of bfloat16 inputs on the XLA
      backend rounds through bfloat16, as ``lax.ragged_dot`` does.)
    config: a backend's config (``MosaicRaggedDotConfig``,
      ``TritonRaggedDotConfig``, ``XlaRaggedDotConfig``) or a dict
      ``{"backend": name, **fields}``; ``None`` lets the selector choose.

  ``jax.vmap`` over any of the arrays runs one grouped GEMM of
  ``batch * M`` rows (rows reordered by group, and back) over ``batch * G``
  experts: on the XLA backend NaN or Inf in one example's experts may then
  reach the rows of the other examples too (the note on ``group_sizes``).
  The op is forward only: ``jax.grad`` and ``jax.jvp`` raise (differentiate
  through ``lax.ragged_dot``).

  Returns:
    ``[M, N]`` array of ``out_dtype``.

  Raises:
    ValueError: wrong ranks, mismatched K or G, non-integer ``group_sizes``,
      an unsupported dtype or out_dtype, or a config that cannot run here.
  """
  return tuned_call(RAGGED_DOT, lhs, rhs, group_sizes, out_dtype=out_dtype, config=config)
