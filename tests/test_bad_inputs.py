"""Bad input, as a hostile user writes it, to every public entry point.

Each case ends in the reference answer (``jnp.dot``, ``lax.ragged_dot`` or a
float32 NumPy reference) or in an exception of a documented type
(``ValueError``, ``TypeError``, ``NotImplementedError``, ``wt.TableError``)
whose message names the argument: never an error from deep inside JAX, never
a silently wrong result.
"""

import copy
import dataclasses
import json
import math
import os
import subprocess
import sys
import textwrap
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wavetune_jax as wt
from wavetune_jax.cli import main as cli_main
from wavetune_jax.core import kernel_cache
from wavetune_jax.runtime import selector
from wavetune_jax.runtime import tables as tables_lib

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

ROOT = os.path.join(os.path.dirname(__file__), "..")
H100 = "nvidia_h100_80gb_hbm3"
TABLE = os.path.join(ROOT, "tables", H100, "matmul.json")
ATT_TABLE = os.path.join(ROOT, "tables", H100, "attention.json")
H200_TABLE = os.path.join(ROOT, "tables", "nvidia_h200", "matmul.json")

BF16, F16, F32 = jnp.bfloat16, jnp.float16, jnp.float32
#: Dtypes no op takes (fp8, 4-bit and unsigned integers, bool, complex).
FOREIGN_DTYPES = [jnp.int8, jnp.int32, jnp.uint8, jnp.uint32, jnp.int4, jnp.bool_,
                  jnp.complex64, jnp.float8_e4m3fn, jnp.float8_e5m2]

# Small blocks: the Triton kernels run in interpret mode on tiny shapes.
MM_TRITON = {"backend": "triton", "block_m": 16, "block_n": 16, "block_k": 16, "split_k": 1,
             "group_m": 8, "num_warps": 4, "num_stages": 2}
MM_SPLIT = dict(MM_TRITON, split_k=2)
MM_CONFIGS = {"selected": None, "xla": {"backend": "xla"}, "triton": MM_TRITON,
              "triton_split_k": MM_SPLIT}
ATT_TRITON = {"backend": "triton", "block_q": 16, "block_k": 16, "num_warps": 4,
              "num_stages": 2}
ATT_CONFIGS = {"selected": None, "xla": {"backend": "xla"}, "triton": ATT_TRITON}
DEC_TRITON = {"backend": "triton", "block_h": 16, "block_k": 16, "num_splits": 2,
              "num_warps": 4, "num_stages": 2}
RD_TRITON = {"backend": "triton", "block_m": 16, "block_n": 16, "block_k": 16,
             "num_warps": 4, "num_stages": 2}
RD_CONFIGS = {"selected": None, "xla": {"backend": "xla"}, "triton": RD_TRITON}


def _rng(seed=0):
  return np.random.default_rng(seed)


def _normal(shape, dtype=F32, seed=0, scale=1.0):
  return jnp.asarray(_rng(seed).standard_normal(shape).astype(np.float32) * scale, dtype)


def _f32(a):
  return np.asarray(jnp.asarray(a).astype(F32))


# --- float32 references ------------------------------------------------------------------


def ref_matmul(x, w):
  return _f32(x) @ _f32(w)


def ref_attention(q, k, v, *, causal=True, scale=None, lengths=None, align="top_left"):
  """Float32 NumPy attention: GQA, per-sequence valid lengths (clipped to
  ``[0, kv_len]``; keys past them are never seen), top-left or bottom-right
  causal diagonal; a query that sees no key gives zeros."""
  q, k, v = _f32(q), _f32(k).copy(), _f32(v).copy()
  b, t, h, d = q.shape
  s = k.shape[1]
  lens = np.full(b, s) if lengths is None else np.clip(np.asarray(lengths, np.int64), 0, s)
  for i in range(b):  # what a kernel never reads
    k[i, lens[i]:] = 0
    v[i, lens[i]:] = 0
  r = h // k.shape[2]
  k, v = np.repeat(k, r, axis=2), np.repeat(v, r, axis=2)
  scale = 1 / math.sqrt(d) if scale is None else scale
  logits = np.einsum("bthd,bshd->bhts", q, k) * np.float32(scale)
  cols, rows = np.arange(s)[None, None, :], np.arange(t)[None, :, None]
  ok = cols < lens[:, None, None]
  if causal:
    shift = lens - t if align == "bottom_right" else np.zeros(b, np.int64)
    ok = ok & (cols <= rows + shift[:, None, None])
  ok = ok[:, None]
  logits = np.where(ok, logits, -np.inf)
  top = logits.max(-1, keepdims=True)
  p = np.where(ok, np.exp(logits - np.where(np.isfinite(top), top, 0)), 0)
  den = p.sum(-1, keepdims=True)
  return np.einsum("bhts,bshd->bthd", p / np.where(den == 0, 1, den), v)


def ref_ragged_dot(lhs, rhs, sizes):
  """Row ``i`` of group ``g`` is ``lhs[i] @ rhs[g]``; rows past the sum are zeros."""
  lhs, rhs = _f32(lhs), _f32(rhs)
  out = np.zeros((lhs.shape[0], rhs.shape[2]), np.float32)
  start = 0
  for g, n in enumerate(np.asarray(sizes)):
    out[start:start + n] = lhs[start:start + n] @ rhs[g]
    start += n
  return out


def assert_same_specials(out, ref):
  """Same NaN and same signed-infinity positions."""
  out, ref = _f32(out), np.asarray(ref, np.float32)
  np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
  np.testing.assert_array_equal(np.isposinf(out), np.isposinf(ref))
  np.testing.assert_array_equal(np.isneginf(out), np.isneginf(ref))


def assert_close(out, ref, tol=2e-2):
  out, ref = _f32(out), np.asarray(ref, np.float32)
  assert out.shape == ref.shape
  assert_same_specials(out, ref)
  fin = np.isfinite(ref)
  scale = max(1.0, float(np.abs(ref[fin]).max())) if fin.any() else 1.0
  np.testing.assert_allclose(out[fin], ref[fin], atol=tol * scale, rtol=tol)


# --- operands of each op -------------------------------------------------------------------


def _mm(dtype=F32):
  return _normal((20, 40), dtype, 1), _normal((40, 24), dtype, 2)


def _att(dtype=BF16, q_len=8, kv_len=24):
  return (_normal((2, q_len, 4, 16), dtype, 3), _normal((2, kv_len, 2, 16), dtype, 4),
          _normal((2, kv_len, 2, 16), dtype, 5))


def _rd(dtype=F32):
  return _normal((20, 24), dtype, 6), _normal((3, 24, 17), dtype, 7), jnp.array([5, 0, 9])


OPS = {
    "matmul": (wt.matmul, lambda dt: _mm(dt)),
    "attention": (wt.attention, lambda dt: _att(dt)),
    "decode_attention": (wt.decode_attention, lambda dt: _att(dt, q_len=2)),
    "ragged_dot": (lambda a, b, *r, **kw: wt.ragged_dot(a, b, jnp.array([5, 0, 9]), **kw),
                   lambda dt: _rd(dt)[:2]),
}
#: What the dtype error names, per op.
DTYPE_NAME = {"matmul": r"x\.dtype", "attention": "dtype", "decode_attention": "dtype",
              "ragged_dot": r"lhs\.dtype"}
OPERAND_NAMES = {"matmul": ("x", "w"), "attention": ("q", "k", "v"),
                 "decode_attention": ("q", "k", "v"), "ragged_dot": ("lhs", "rhs")}


# === dtypes ================================================================================


@pytest.mark.parametrize("dtype", FOREIGN_DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("op", list(OPS))
def test_foreign_dtypes_are_refused_by_name(op, dtype):
  fn, make = OPS[op]
  args = [jnp.zeros(a.shape, dtype) for a in make(F32)]
  with pytest.raises(ValueError, match=DTYPE_NAME[op]):
    fn(*args)


@pytest.mark.parametrize("op", ["attention", "decode_attention"])
def test_attention_refuses_float32(op):
  fn, make = OPS[op]
  with pytest.raises(ValueError, match="dtype float32 is not supported"):
    fn(*make(F32))


@pytest.mark.parametrize("op", list(OPS))
def test_mixed_dtypes_are_refused(op):
  fn, make = OPS[op]
  good = BF16
  args = list(make(good))
  args[-1] = args[-1].astype(F16)
  with pytest.raises(ValueError, match="dtype"):
    fn(*args)


@pytest.mark.parametrize("op", ["matmul", "ragged_dot"])
def test_numpy_float64_runs_as_float32(op):
  # Without x64, JAX takes NumPy float64 as float32: the float32 answer.
  if op == "matmul":
    x, w = _mm()
    out = wt.matmul(np.asarray(x, np.float64), np.asarray(w, np.float64))
    ref = ref_matmul(x, w)
  else:
    lhs, rhs, sizes = _rd()
    out = wt.ragged_dot(np.asarray(lhs, np.float64), np.asarray(rhs, np.float64), sizes)
    ref = ref_ragged_dot(lhs, rhs, sizes)
  assert out.dtype == jnp.float32
  assert_close(out, ref, 1e-4)


@pytest.mark.parametrize("sizes_dtype", [jnp.int8, jnp.int16, jnp.uint8, jnp.int32])
def test_group_sizes_of_small_integer_types(sizes_dtype):
  lhs, rhs, sizes = _rd()
  out = wt.ragged_dot(lhs, rhs, sizes.astype(sizes_dtype))
  assert_close(out, ref_ragged_dot(lhs, rhs, sizes), 1e-4)


@pytest.mark.parametrize("bad", [jnp.float32, jnp.bool_, jnp.complex64],
                         ids=lambda d: jnp.dtype(d).name)
def test_group_sizes_that_are_not_integers(bad):
  lhs, rhs, sizes = _rd()
  with pytest.raises(ValueError, match="group_sizes must be integers"):
    wt.ragged_dot(lhs, rhs, sizes.astype(bad))


@pytest.mark.parametrize("bad", [jnp.float32, jnp.bool_], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("op", ["attention", "decode_attention"])
def test_kv_lengths_that_are_not_integers(op, bad):
  fn, make = OPS[op]
  with pytest.raises(ValueError, match="kv_lengths"):
    fn(*make(BF16), kv_lengths=jnp.array([3, 4]).astype(bad))


@pytest.mark.parametrize("dtype", [jnp.int8, jnp.int16, jnp.uint8, jnp.int32],
                         ids=lambda d: jnp.dtype(d).name)
def test_kv_lengths_of_small_integer_types(dtype):
  q, k, v = _att()
  lens = np.array([5, 17])
  out = wt.attention(q, k, v, kv_lengths=jnp.asarray(lens, dtype))
  assert_close(out, ref_attention(q, k, v, lengths=lens))


# === non-arrays and wrong ranks ===============================================================


NOT_ARRAYS = {"None": None, "str": "abc", "dict": {"a": 1}, "ragged_list": [[1.0], [1.0, 2.0]],
              "object_array": np.array([[1, "a"]], dtype=object),
              "shape_dtype_struct": jax.ShapeDtypeStruct((8, 16), jnp.float32)}


@pytest.mark.parametrize("value", list(NOT_ARRAYS))
@pytest.mark.parametrize("op,position", [(op, i) for op in OPS
                                         for i in range(len(OPERAND_NAMES[op]))])
def test_operands_that_are_not_arrays_are_named(op, position, value):
  fn, make = OPS[op]
  args = list(make(BF16))
  args[position] = NOT_ARRAYS[value]
  name = OPERAND_NAMES[op][position]
  with pytest.raises(ValueError, match=rf"^{name} must be an array"):
    fn(*args)


@pytest.mark.parametrize("value", [None, "ab", [[1, 2]], 3])
def test_group_sizes_that_are_not_an_array_of_g(value):
  lhs, rhs, _ = _rd()
  with pytest.raises(ValueError, match="group_sizes"):
    wt.ragged_dot(lhs, rhs, value)


@pytest.mark.parametrize("value", ["3", [3], [[3, 4]], 3, [3, 4, 5]])
@pytest.mark.parametrize("op", ["attention", "decode_attention"])
def test_kv_lengths_of_the_wrong_shape(op, value):
  fn, make = OPS[op]
  with pytest.raises(ValueError, match="kv_lengths"):
    fn(*make(BF16), kv_lengths=value)


def _reshaped(a, rank):
  """``a`` with ``rank`` dimensions (leading ones added, or trailing ones merged)."""
  if rank > a.ndim:
    return a.reshape((1,) * (rank - a.ndim) + a.shape)
  return a.reshape(a.shape[:rank - 1] + (-1,)) if rank else a.reshape(-1)[0]


@pytest.mark.parametrize("rank_delta", [-2, -1, 1])
@pytest.mark.parametrize("op,position", [(op, i) for op in OPS
                                         for i in range(len(OPERAND_NAMES[op]))])
def test_wrong_ranks_are_named(op, position, rank_delta):
  fn, make = OPS[op]
  args = list(make(BF16))
  a = args[position]
  args[position] = _reshaped(a, a.ndim + rank_delta)
  name = OPERAND_NAMES[op][position]
  with pytest.raises(ValueError, match=rf"{name} must have rank|{name}\.shape"):
    fn(*args)


@pytest.mark.parametrize("case,match", [
    ("inner", r"x\.shape\[1\] must equal w\.shape\[0\]"),
    ("kv_mismatch", "k and v must have the same shape"),
    ("batch", "batch differs"),
    ("head_dim", "head_dim differs"),
    ("gqa", "kv_heads=3 must divide q_heads=4"),
    ("head_dim_512", "head_dim=512"),
    ("decode_q_len_65", "q_len=65"),
    ("rd_k", r"lhs\.shape\[1\] must equal rhs\.shape\[1\]"),
    ("rd_g", r"group_sizes must have shape \[G\] = \(3,\)"),
])
def test_mismatched_shapes(case, match):
  q, k, v = _att()
  lhs, rhs, sizes = _rd()
  x, w = _mm()
  calls = {
      "inner": lambda: wt.matmul(x, w[:-1]),
      "kv_mismatch": lambda: wt.attention(q, k, v[:, :5]),
      "batch": lambda: wt.attention(q, k[:1], v[:1]),
      "head_dim": lambda: wt.attention(q, k[..., :8], v[..., :8]),
      "gqa": lambda: wt.attention(q, *(_normal((2, 24, 3, 16), BF16),) * 2),
      "head_dim_512": lambda: wt.attention(*(_normal((1, 4, 1, 512), BF16),) * 3),
      "decode_q_len_65": lambda: wt.decode_attention(_normal((2, 65, 4, 16), BF16), k, v),
      "rd_k": lambda: wt.ragged_dot(lhs[:, :-1], rhs, sizes),
      "rd_g": lambda: wt.ragged_dot(lhs, rhs, sizes[:2]),
  }
  with pytest.raises(ValueError, match=match):
    calls[case]()


# === zero sizes ==============================================================================


@pytest.mark.parametrize("m,k,n", [(0, 16, 8), (8, 0, 8), (8, 16, 0), (0, 0, 0)])
@pytest.mark.parametrize("out_dtype", [None, F16])
def test_matmul_of_empty_arrays_is_what_jnp_dot_gives(m, k, n, out_dtype):
  x, w = jnp.ones((m, k), F32), jnp.ones((k, n), F32)
  out = wt.matmul(x, w, out_dtype=out_dtype)
  ref = jnp.dot(x, w, preferred_element_type=out_dtype or F32)
  assert out.shape == ref.shape and out.dtype == ref.dtype
  np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))


@pytest.mark.parametrize("m,g,k,n", [(0, 2, 16, 8), (8, 0, 16, 8), (8, 2, 0, 8), (8, 2, 16, 0)])
def test_ragged_dot_of_empty_arrays_is_zeros(m, g, k, n):
  lhs, rhs = jnp.ones((m, k), F32), jnp.ones((g, k, n), F32)
  sizes = jnp.full((g,), m // max(g, 1), jnp.int32)
  out = wt.ragged_dot(lhs, rhs, sizes)
  assert out.shape == (m, n) and out.dtype == F32
  np.testing.assert_array_equal(np.asarray(out), ref_ragged_dot(lhs, rhs, sizes))


@pytest.mark.parametrize("config", list(RD_CONFIGS))
def test_ragged_dot_with_every_group_empty_is_zeros(config):
  lhs, rhs, _ = _rd()
  out = wt.ragged_dot(lhs, rhs, jnp.zeros(3, jnp.int32), config=RD_CONFIGS[config])
  np.testing.assert_array_equal(np.asarray(out), np.zeros((20, 17), np.float32))


@pytest.mark.parametrize("axis", ["batch", "q_len", "q_heads"])
@pytest.mark.parametrize("op", ["attention", "decode_attention"])
def test_attention_with_no_queries_is_empty(op, axis):
  fn, make = OPS[op]
  q, k, v = make(BF16)
  if axis == "batch":
    q, k, v = q[:0], k[:0], v[:0]
  elif axis == "q_len":
    q = q[:, :0]
  else:  # no query heads: any kv_heads divides 0
    q = q[:, :, :0]
  out = fn(q, k, v)
  assert out.shape == q.shape and out.dtype == q.dtype


@pytest.mark.parametrize("op", ["attention", "decode_attention"])
def test_attention_with_no_keys_names_kv_len(op):
  fn, make = OPS[op]
  q, k, v = make(BF16)
  with pytest.raises(ValueError, match="kv_len is 0"):
    fn(q, k[:, :0], v[:, :0])


@pytest.mark.parametrize("op", ["attention", "decode_attention"])
def test_attention_with_empty_head_dim_names_it(op):
  fn, make = OPS[op]
  with pytest.raises(ValueError, match="head_dim=0"):
    fn(*(a[..., :0] for a in make(BF16)))


# === NaN, Inf and huge values =================================================================


@pytest.mark.parametrize("dtype", [F32, BF16, F16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("config", list(MM_CONFIGS))
def test_matmul_nan_and_inf_land_where_the_reference_puts_them(config, dtype):
  x, w = (np.array(a, np.float32) for a in _mm())
  x[3, 5] = np.nan
  x[7, 1] = np.inf
  w[2, 9] = -np.inf
  x, w = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
  out = wt.matmul(x, w, config=MM_CONFIGS[config], out_dtype=F32)
  assert_close(out, ref_matmul(x, w), 1e-2 if dtype != F32 else 1e-4)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("config", list(MM_CONFIGS))
def test_matmul_overflow_is_inf_like_the_reference(config, dtype):
  # Products near the float32 limit, all positive: every sum overflows.
  x = jnp.asarray(_rng(1).uniform(1, 2, (20, 40)) * 1e37, dtype)
  w = jnp.asarray(_rng(2).uniform(1, 2, (40, 24)) * 10, dtype)
  out = wt.matmul(x, w, config=MM_CONFIGS[config])
  assert np.isposinf(_f32(out)).all()


@pytest.mark.parametrize("config", list(MM_CONFIGS))
def test_matmul_float16_output_overflow_is_inf(config):
  # float32 accumulation is finite; the float16 output is not.
  x = jnp.asarray(_rng(1).uniform(100, 200, (20, 40)), F16)
  w = jnp.asarray(_rng(2).uniform(100, 200, (40, 24)), F16)
  out = wt.matmul(x, w, config=MM_CONFIGS[config])
  assert out.dtype == F16
  assert np.isposinf(_f32(out)).all()
  out32 = wt.matmul(x, w, config=MM_CONFIGS[config], out_dtype=F32)
  assert_close(out32, ref_matmul(x, w), 1e-3)


@pytest.mark.parametrize("dtype", [F32, BF16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("config", list(MM_CONFIGS))
def test_matmul_huge_finite_values(config, dtype):
  x, w = _normal((20, 40), dtype, 1, 1e18), _normal((40, 24), dtype, 2, 1e18)
  out = wt.matmul(x, w, config=MM_CONFIGS[config], out_dtype=F32)
  ref = ref_matmul(x, w)
  assert np.isfinite(ref).all()
  np.testing.assert_allclose(_f32(out) / 1e36, ref / 1e36, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("case", ["lhs_nan_row", "lhs_inf", "nan_rows_past_the_sum"])
@pytest.mark.parametrize("config", list(RD_CONFIGS))
def test_ragged_dot_nan_and_inf(config, case):
  lhs, rhs, sizes = (np.array(a) for a in _rd())
  if case == "lhs_nan_row":
    lhs[7, 2] = np.nan
  elif case == "lhs_inf":
    lhs[2, 3] = np.inf
  else:  # rows past sum(group_sizes) = 14 come out as zeros, NaN or not
    lhs[14:] = np.nan
  out = wt.ragged_dot(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes),
                      config=RD_CONFIGS[config])
  assert_close(out, ref_ragged_dot(lhs, rhs, sizes), 1e-4)


@pytest.mark.parametrize("value", [np.nan, np.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("expert", [0, 1, 2], ids=["expert0", "empty_expert1", "expert2"])
@pytest.mark.parametrize("config", list(RD_CONFIGS))
def test_ragged_dot_nan_in_an_experts_weights(config, expert, value):
  lhs, rhs, sizes = (np.array(a) for a in _rd())  # sizes [5, 0, 9], M = 20
  rhs[expert, 3, 4] = value
  out = _f32(wt.ragged_dot(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes),
                           config=RD_CONFIGS[config]))
  np.testing.assert_array_equal(out[14:], 0)  # rows past the sum: zeros, always
  ref = ref_ragged_dot(lhs, rhs, sizes)
  if config == "triton":  # the expert's rows only
    assert_close(out, ref, 1e-4)
  else:  # XLA's op may spread it over the rows below the sum (documented)
    fin = np.isfinite(out)
    np.testing.assert_allclose(out[fin], ref[fin], atol=1e-3, rtol=1e-4)


@pytest.mark.parametrize("config", list(RD_CONFIGS))
def test_vmap_of_ragged_dot_with_nan_weights_keeps_rows_past_the_sum_zero(config):
  lhs, rhs, _ = (np.array(a) for a in _rd())
  rhs[2, 3, 4] = np.nan
  sizes = jnp.array([[5, 0, 9], [2, 3, 1]])
  out = _f32(jax.vmap(lambda a, s: wt.ragged_dot(a, jnp.asarray(rhs), s,
                                                 config=RD_CONFIGS[config]))(
      jnp.stack([jnp.asarray(lhs)] * 2), sizes))
  np.testing.assert_array_equal(out[0, 14:], 0)
  np.testing.assert_array_equal(out[1, 6:], 0)
  if config == "triton":
    for b in range(2):
      assert_close(out[b], ref_ragged_dot(lhs, rhs, np.asarray(sizes[b])), 1e-4)


def _poison_past(a, lens, value):
  a = np.array(a, np.float32)
  for i, n in enumerate(lens):
    a[i, n:] = value
  return a


@pytest.mark.parametrize("align", ["top_left", "bottom_right"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("config", list(ATT_CONFIGS))
def test_attention_never_sees_nan_or_inf_past_kv_lengths(config, causal, align):
  q, k, v = _att()
  lens = [5, 17]
  k = jnp.asarray(_poison_past(k, lens, np.nan), BF16)
  v = jnp.asarray(_poison_past(v, lens, np.inf), BF16)
  out = wt.attention(q, k, v, causal=causal, causal_align=align,
                     kv_lengths=jnp.array(lens), config=ATT_CONFIGS[config])
  assert np.isfinite(_f32(out)).all()
  assert_close(out, ref_attention(q, k, v, causal=causal, lengths=lens, align=align))


@pytest.mark.parametrize("causal", [True, False])
def test_decode_xla_never_sees_nan_past_kv_lengths(causal):
  q, k, v = _att(q_len=2)
  lens = [5, 17]
  k = jnp.asarray(_poison_past(k, lens, np.inf), BF16)
  v = jnp.asarray(_poison_past(v, lens, np.nan), BF16)
  out = wt.decode_attention(q, k, v, kv_lengths=jnp.array(lens), causal=causal,
                            config={"backend": "xla"})
  assert_close(out, ref_attention(q, k, v, causal=causal, lengths=lens, align="bottom_right"))


@pytest.mark.parametrize("config", list(ATT_CONFIGS))
def test_attention_nan_query_stays_in_its_row(config):
  q, k, v = _att()
  q = np.array(q, np.float32)
  q[0, 3, 1, 2] = np.nan
  q = jnp.asarray(q, BF16)
  out = _f32(wt.attention(q, k, v, config=ATT_CONFIGS[config]))
  bad = np.argwhere(np.isnan(out).any(-1)).tolist()
  assert bad == [[0, 3, 1]]
  assert_close(out, ref_attention(q, k, v))


@pytest.mark.parametrize("scale_by", [50.0, 200.0])
@pytest.mark.parametrize("config", list(ATT_CONFIGS))
def test_attention_huge_logits_stay_finite(config, scale_by):
  q, k, v = _att()
  q, k = _normal(q.shape, BF16, 8, scale_by), _normal(k.shape, BF16, 9, scale_by)
  out = wt.attention(q, k, v, causal=False, config=ATT_CONFIGS[config])
  assert np.isfinite(_f32(out)).all()
  assert_close(out, ref_attention(q, k, v, causal=False))


@pytest.mark.parametrize("lens", [[0, 24], [-5, 10**9], [0, 0], [1, 3]],
                         ids=["empty", "clipped", "all_empty", "short"])
@pytest.mark.parametrize("op,config", [("attention", None), ("attention", ATT_TRITON),
                                       ("attention", {"backend": "xla"}),
                                       ("decode_attention", None),
                                       ("decode_attention", DEC_TRITON),
                                       ("decode_attention", {"backend": "xla"})],
                         ids=["att", "att_triton", "att_xla", "dec", "dec_triton", "dec_xla"])
def test_kv_lengths_out_of_range_are_clipped(op, config, lens):
  fn, make = OPS[op]
  q, k, v = make(BF16)
  align = "bottom_right" if op == "decode_attention" else "top_left"
  out = fn(q, k, v, kv_lengths=jnp.array(lens, jnp.int32), config=config)
  assert_close(out, ref_attention(q, k, v, lengths=lens, align=align))


@pytest.mark.parametrize("scale", [0.0, -1.0, 1e-30, 1e3])
@pytest.mark.parametrize("config", list(ATT_CONFIGS))
def test_attention_odd_but_finite_scales(config, scale):
  q, k, v = _att()
  out = wt.attention(q, k, v, scale=scale, config=ATT_CONFIGS[config])
  assert_close(out, ref_attention(q, k, v, scale=scale), 3e-2)


# === wrong-typed static arguments ===============================================================


@pytest.mark.parametrize("causal", ["yes", 1, 0, None, 1.0, [True], jnp.array(True)],
                         ids=["str", "one", "zero", "None", "float", "list", "array"])
@pytest.mark.parametrize("op", ["attention", "decode_attention"])
def test_causal_must_be_a_python_bool(op, causal):
  fn, make = OPS[op]
  with pytest.raises(ValueError, match="causal="):
    fn(*make(BF16), causal=causal)


@pytest.mark.parametrize("op", ["attention", "decode_attention"])
def test_causal_numpy_bool_is_a_bool(op):
  fn, make = OPS[op]
  q, k, v = make(BF16)
  align = "bottom_right" if op == "decode_attention" else "top_left"
  assert_close(fn(q, k, v, causal=np.bool_(False)),
               ref_attention(q, k, v, causal=False, align=align))


@pytest.mark.parametrize("scale", ["x", float("nan"), float("inf"), -float("inf"), [0.5],
                                   np.float32(np.nan), jnp.float32(0.5), True, np.bool_(True),
                                   1 + 2j, 10**400, -10**400, 10**5000],
                         ids=["str", "nan", "inf", "-inf", "list", "np_float32_nan", "array",
                              "bool", "np_bool", "complex", "int_past_float",
                              "-int_past_float", "int_past_str"])
@pytest.mark.parametrize("op", ["attention", "decode_attention"])
def test_scale_must_be_a_finite_python_float(op, scale):
  fn, make = OPS[op]
  with pytest.raises(ValueError, match="scale="):
    fn(*make(BF16), scale=scale)


@pytest.mark.parametrize("align", ["foo", None, ["top_left"], "TOP_LEFT", 0, ""])
def test_causal_align_must_be_known(align):
  with pytest.raises(ValueError, match="causal_align="):
    wt.attention(*_att(), causal_align=align)


def test_decode_attention_takes_no_causal_align():
  with pytest.raises(TypeError, match="causal_align"):
    wt.decode_attention(*_att(q_len=1), causal_align="top_left")


@pytest.mark.parametrize("out_dtype", ["foo", jnp.int32, "float64", 3, [1], "float8_e4m3fn",
                                       object(), {"a": 1}, "bf16", ""],
                         ids=["str", "int32", "float64", "three", "list", "fp8", "object",
                              "dict", "bf16", "empty"])
@pytest.mark.parametrize("op", ["matmul", "ragged_dot"])
def test_out_dtype_must_be_a_float_dtype(op, out_dtype):
  fn, make = OPS[op]
  with pytest.raises(ValueError, match="out_dtype="):
    fn(*make(F32), out_dtype=out_dtype)


@pytest.mark.parametrize("out_dtype", [np.float16, np.dtype("bfloat16"), "float32", F16])
def test_out_dtype_spellings(out_dtype):
  x, w = _mm(BF16)
  out = wt.matmul(x, w, out_dtype=out_dtype)
  assert out.dtype == jnp.dtype(out_dtype)
  assert_close(out, ref_matmul(x, w))


BAD_CONFIGS = {
    "int": (3, "config must be one of"),
    "str": ("triton", "config must be one of"),
    "list": ([16, 16], "config must be one of"),
    "class": ("CLASS", "config must be one of"),
    "unknown_backend": ({"backend": "foo"}, "has no backend 'foo'"),
    "backend_number": ({"backend": 7}, "backend number 7"),
    "backend_list": ({"backend": ["triton"]}, "has no backend"),
    "unknown_field": ({"backend": "triton", "blocks": 16}, r"unknown \w+Config field"),
    "field_str": ({"backend": "triton", "num_warps": "4"}, r"\.num_warps='4' must be an int"),
    "field_float": ({"backend": "triton", "num_warps": 4.0}, r"\.num_warps=4.0 must be an int"),
    "field_bool": ({"backend": "triton", "num_stages": True}, r"\.num_stages=True"),
    "field_none": ({"backend": "triton", "num_warps": None}, r"\.num_warps=None"),
    "warps_3": ({"backend": "triton", "num_warps": 3}, r"num_warps=3 must be a power of two"),
    "stages_0": ({"backend": "triton", "num_stages": 0}, r"num_stages=0 must be in"),
    "other_family": ("OTHER", "config must be one of"),
}
OP_CONFIG_CLASSES = {"matmul": (wt.TritonMatmulConfig, wt.TritonAttentionConfig()),
                     "attention": (wt.TritonAttentionConfig, wt.TritonMatmulConfig()),
                     "decode_attention": (wt.TritonDecodeConfig, wt.TritonRaggedDotConfig()),
                     "ragged_dot": (wt.TritonRaggedDotConfig, wt.TritonDecodeConfig())}


@pytest.mark.parametrize("bad", list(BAD_CONFIGS))
@pytest.mark.parametrize("op", list(OPS))
def test_bad_configs_are_refused(op, bad):
  fn, make = OPS[op]
  config, match = BAD_CONFIGS[bad]
  cls, other = OP_CONFIG_CLASSES[op]
  config = {"CLASS": cls, "OTHER": other}.get(config, config) if isinstance(config, str) \
      else config
  with pytest.raises(ValueError, match=match):
    fn(*make(BF16), config=config)
  with pytest.raises(ValueError, match=match):  # pinned for a block: refused at once
    with wt.use_config({"matmul": "matmul", "attention": "attention",
                        "decode_attention": "decode", "ragged_dot": "ragged_dot"}[op], config):
      pass


@pytest.mark.parametrize("config", [{}, {"block_m": 16}, {"backend": None}],
                         ids=["empty", "fields_only", "backend_none"])
@pytest.mark.parametrize("op", list(OPS))
def test_config_dicts_must_name_their_backend(op, config):
  fn, make = OPS[op]
  family = {"decode_attention": "decode"}.get(op, op)
  match = rf"config=.*: a {family} config dict needs a 'backend' key, one of \["
  with pytest.raises(ValueError, match=match):
    fn(*make(BF16), config=config)
  with pytest.raises(ValueError, match=match):
    with wt.use_config(family, config):
      pass


@pytest.mark.parametrize("family,fields", [
    ("matmul", {"block_m": 16, "block_n": 32, "block_k": 32}),
    ("attention", {"block_q": 32, "block_k": 32, "num_warps": 4, "num_stages": 2}),
])
def test_files_recorded_before_backends_were_named_still_read(family, fields):
  spec = wt.get_family(family)
  assert spec.backend_of(spec.config_from_dict(fields)).name == "triton"


@pytest.mark.parametrize("case,config,match", [
    ("split_k_too_large", dict(MM_TRITON, split_k=8), "split_k=8 is larger than"),
    ("beyond_shared_memory", dict(MM_TRITON, block_k=4096), "bytes of shared memory"),
    ("mosaic_on_cpu", {"backend": "mosaic"}, "Mosaic GPU"),
    ("mosaic_float32", wt.MosaicMatmulConfig(), "Mosaic GPU"),
])
def test_configs_that_cannot_run_this_problem_here(case, config, match):
  with pytest.raises(ValueError, match=match):
    wt.matmul(*_mm(), config=config)


@pytest.mark.parametrize("op,config,match", [
    ("attention", {"backend": "cudnn"}, "cannot run here"),
    ("attention", {"backend": "mosaic"}, "Mosaic"),
    ("decode_attention", {"backend": "cudnn"}, "cuDNN"),
    ("ragged_dot", {"backend": "mosaic"}, "Mosaic"),
])
def test_gpu_only_backends_say_why(op, config, match):
  fn, make = OPS[op]
  with pytest.raises(ValueError, match=match):
    fn(*make(BF16), config=config)


# === under jit: traced versus static ============================================================


@pytest.mark.parametrize("op", ["attention", "decode_attention"])
def test_traced_scale_is_refused_by_name(op):
  fn, make = OPS[op]
  with pytest.raises(ValueError, match="scale=.*static"):
    jax.jit(lambda s: fn(*make(BF16), scale=s))(0.5)
  with pytest.raises(ValueError, match="scale=.*static"):
    jax.jit(fn)(*make(BF16), scale=0.5)  # a keyword of a jitted op is traced


@pytest.mark.parametrize("op", ["attention", "decode_attention"])
def test_traced_causal_is_refused_by_name(op):
  fn, make = OPS[op]
  with pytest.raises(ValueError, match="causal=.*static"):
    jax.jit(lambda c: fn(*make(BF16), causal=c))(True)


@pytest.mark.parametrize("op", ["attention", "decode_attention"])
def test_static_scale_and_causal_under_jit(op):
  fn, make = OPS[op]
  q, k, v = make(BF16)
  out = jax.jit(fn, static_argnames=("scale", "causal"))(q, k, v, scale=0.3, causal=False)
  assert_close(out, ref_attention(q, k, v, scale=0.3, causal=False))


def test_traced_config_field_is_refused_by_name():
  x, w = _mm()
  with pytest.raises(ValueError, match=r"TritonMatmulConfig\.block_m=.*must be an int"):
    jax.jit(lambda a, b, bm: wt.matmul(a, b, config=dict(MM_TRITON, block_m=bm)))(x, w, 16)


@pytest.mark.parametrize("op", ["attention", "decode_attention"])
def test_traced_kv_lengths_are_run_time_values(op):
  fn, make = OPS[op]
  q, k, v = make(BF16)
  f = jax.jit(lambda *a: fn(*a[:3], kv_lengths=a[3]))
  align = "bottom_right" if op == "decode_attention" else "top_left"
  for lens in ([3, 24], [24, 1]):  # one trace, two answers
    assert_close(f(q, k, v, jnp.array(lens)), ref_attention(q, k, v, lengths=lens, align=align))


def test_traced_group_sizes_are_run_time_values():
  lhs, rhs, _ = _rd()
  f = jax.jit(wt.ragged_dot)
  for sizes in ([5, 0, 9], [0, 20, 0], [1, 2, 3]):
    sizes = jnp.array(sizes)
    assert_close(f(lhs, rhs, sizes), ref_ragged_dot(lhs, rhs, sizes), 1e-4)


# === jax.vmap ====================================================================================


@pytest.mark.parametrize("case", ["x", "w", "both", "in_axes_1", "out_axes_1", "nested"])
@pytest.mark.parametrize("config", list(MM_CONFIGS))
def test_vmap_of_matmul(config, case):
  cfg = MM_CONFIGS[config]
  xs, ws = _normal((3, 8, 40), F32, 1), _normal((3, 40, 24), F32, 2)
  mm = lambda a, b: wt.matmul(a, b, config=cfg)  # noqa: E731
  ref = np.einsum("bmk,bkn->bmn", _f32(xs), _f32(ws))
  if case == "x":
    out, ref = jax.vmap(lambda a: mm(a, ws[0]))(xs), np.einsum("bmk,kn->bmn", _f32(xs), _f32(ws[0]))
  elif case == "w":
    out, ref = jax.vmap(lambda b: mm(xs[0], b))(ws), np.einsum("mk,bkn->bmn", _f32(xs[0]), _f32(ws))
  elif case == "both":
    out = jax.vmap(mm)(xs, ws)
  elif case == "in_axes_1":
    out = jax.vmap(mm, in_axes=(1, 0))(xs.transpose(1, 0, 2), ws)
  elif case == "out_axes_1":
    out, ref = jax.vmap(mm, out_axes=1)(xs, ws), ref.transpose(1, 0, 2)
  else:
    out = jax.vmap(jax.vmap(mm))(xs[:, None], ws[:, None])[:, 0]
  assert_close(out, ref, 1e-4)


@pytest.mark.parametrize("with_lengths", [False, True])
@pytest.mark.parametrize("config", list(ATT_CONFIGS))
def test_vmap_of_attention(config, with_lengths):
  qs, ks, vs = (_normal((2,) + a.shape, BF16, i) for i, a in enumerate(_att()))
  lens = np.array([[5, 24], [1, 17]])
  if with_lengths:
    out = jax.vmap(lambda q, k, v, l: wt.attention(q, k, v, kv_lengths=l,
                                                   config=ATT_CONFIGS[config]))(
        qs, ks, vs, jnp.asarray(lens))
  else:
    out = jax.vmap(lambda q, k, v: wt.attention(q, k, v, config=ATT_CONFIGS[config]))(qs, ks, vs)
  for i in range(2):
    assert_close(out[i], ref_attention(qs[i], ks[i], vs[i],
                                       lengths=lens[i] if with_lengths else None))


@pytest.mark.parametrize("config", [None, DEC_TRITON, {"backend": "xla"}],
                         ids=["selected", "triton", "xla"])
def test_vmap_of_decode_attention(config):
  qs, ks, vs = (_normal((2,) + a.shape, BF16, i) for i, a in enumerate(_att(q_len=2)))
  lens = np.array([[5, 24], [1, 17]])
  out = jax.vmap(lambda q, k, v, l: wt.decode_attention(q, k, v, kv_lengths=l, config=config))(
      qs, ks, vs, jnp.asarray(lens))
  for i in range(2):
    assert_close(out[i], ref_attention(qs[i], ks[i], vs[i], lengths=lens[i],
                                       align="bottom_right"))


@pytest.mark.parametrize("op", ["attention", "decode_attention"])
def test_vmap_over_scale_is_refused_by_name(op):
  fn, make = OPS[op]
  with pytest.raises(ValueError, match="scale="):
    jax.vmap(lambda s: fn(*make(BF16), scale=s))(jnp.array([0.1, 0.2]))


# === gradients: forward only =======================================================================


GRADS = {
    "grad": lambda f, a: jax.grad(lambda t: f(t).astype(F32).sum())(a),
    "grad_jit": lambda f, a: jax.jit(jax.grad(lambda t: f(t).astype(F32).sum()))(a),
    "vjp": lambda f, a: jax.vjp(f, a)[1](f(a)),
    "jacrev": lambda f, a: jax.jacrev(lambda t: f(t).astype(F32))(a),
    "checkpoint": lambda f, a: jax.grad(jax.checkpoint(lambda t: f(t).astype(F32).sum()))(a),
    "value_and_grad": lambda f, a: jax.value_and_grad(lambda t: f(t).astype(F32).sum())(a),
    # Forward mode, and what is built on it.
    "jvp": lambda f, a: jax.jvp(f, (a,), (a,)),
    "jvp_jit": lambda f, a: jax.jit(lambda t: jax.jvp(f, (t,), (t,)))(a),
    "jacfwd": lambda f, a: jax.jacfwd(lambda t: f(t).astype(F32))(a),
    "linearize": lambda f, a: jax.linearize(f, a),
    "hessian": lambda f, a: jax.hessian(lambda t: f(t).astype(F32).sum())(a),
    # Through jax.vmap (ragged_dot's own batching rule).
    "grad_of_vmap": lambda f, a: jax.grad(lambda t: jax.vmap(f)(t).astype(F32).sum())(a[None]),
    "jvp_of_vmap": lambda f, a: jax.jvp(jax.vmap(f), (a[None],), (a[None],)),
}


@pytest.mark.parametrize("how", list(GRADS))
@pytest.mark.parametrize("op,position", [(op, i) for op in OPS
                                         for i in range(len(OPERAND_NAMES[op]))])
def test_gradients_raise_not_implemented(op, position, how):
  fn, make = OPS[op]
  args = list(make(F32 if op in ("matmul", "ragged_dot") else BF16))

  def f(t):
    return fn(*args[:position], t, *args[position + 1:])
  name = {"decode_attention": "decode"}.get(op, op)
  with pytest.raises(NotImplementedError, match=rf"wavetune_jax\.{name} is forward only"):
    GRADS[how](f, args[position])


@pytest.mark.parametrize("op", list(OPS))
def test_derivatives_that_do_not_reach_the_op_still_work(op):
  fn, make = OPS[op]
  args = make(F32 if op in ("matmul", "ragged_dot") else BF16)

  def f(s):  # the op's operands do not depend on s: its tangents are zero
    return fn(*args).astype(F32).sum() * s + s * s
  value = float(fn(*args).astype(F32).sum())
  assert float(jax.grad(f)(3.0)) == pytest.approx(value + 6.0, rel=1e-5)
  assert float(jax.jvp(f, (3.0,), (1.0,))[1]) == pytest.approx(value + 6.0, rel=1e-5)


# === config classes ================================================================================


CONFIG_CLASSES = [getattr(wt, n) for n in wt.__all__ if n.endswith("Config")]
CONFIG_FIELDS = [(cls, f.name) for cls in CONFIG_CLASSES for f in dataclasses.fields(cls)]


@pytest.mark.parametrize("value", ["16", 16.0, True, None, [16], 2**0.5],
                         ids=["str", "float", "bool", "None", "list", "irrational"])
@pytest.mark.parametrize("cls,field", CONFIG_FIELDS,
                         ids=[f"{c.__name__}.{f}" for c, f in CONFIG_FIELDS])
def test_config_fields_of_the_wrong_type_are_named(cls, field, value):
  with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field}="):
    cls(**{field: value})


@pytest.mark.parametrize("cls", CONFIG_CLASSES, ids=lambda c: c.__name__)
def test_config_classes_are_frozen_hashable_and_keyword_only(cls):
  c = cls()
  assert hash(c) == hash(cls()) and c == cls()
  with pytest.raises(TypeError, match="foo"):
    cls(foo=1)
  fields = [f.name for f in dataclasses.fields(cls)]
  if fields:
    with pytest.raises(dataclasses.FrozenInstanceError):
      setattr(c, fields[0], 1)
    with pytest.raises(TypeError):
      cls(*[getattr(c, f) for f in fields])


@pytest.mark.parametrize("cls,field", [(c, f) for c, f in CONFIG_FIELDS
                                       if f.startswith("block") and "Triton" in c.__name__],
                         ids=lambda p: getattr(p, "__name__", p))
@pytest.mark.parametrize("value", [0, -16, 24, 8, 3])
def test_triton_blocks_must_be_powers_of_two_from_16(cls, field, value):
  with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field}={value} must be a power"):
    cls(**{field: value})


@pytest.mark.parametrize("value", [10**30, 2**31, -2**31 - 1, 10**5000],
                         ids=["1e30", "2^31", "-2^31-1", "5000_digits"])
@pytest.mark.parametrize("cls,field", CONFIG_FIELDS,
                         ids=[f"{c.__name__}.{f}" for c, f in CONFIG_FIELDS])
def test_config_fields_must_fit_int32(cls, field, value):
  with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field}=.* must fit int32"):
    cls(**{field: value})


@pytest.mark.parametrize("cls,field,value,match", [
    (wt.TritonMatmulConfig, "group_m", 1025, r"group_m=1025 must be in \[1, 1024\]"),
    (wt.TritonMatmulConfig, "block_n", 2**21, "block_n=2097152 must be at most 1048576"),
    (wt.TritonAttentionConfig, "block_q", 2**30, "block_q=1073741824 must be at most"),
    (wt.TritonDecodeConfig, "block_k", 2**21, "block_k=2097152 must be at most"),
    (wt.TritonRaggedDotConfig, "block_m", 2**21, "block_m=2097152 must be at most"),
])
def test_config_fields_have_upper_bounds(cls, field, value, match):
  with pytest.raises(ValueError, match=match):
    cls(**{field: value})


def test_the_largest_group_m_traces_for_the_widest_output():
  # group_m times the tile columns past int32 (a 16 x 2**26 output): the
  # kernel takes a group no taller than the tile grid.
  from pallas_kernels.matmul import triton as mm_triton
  c = wt.TritonMatmulConfig(block_m=16, block_n=16, block_k=16, group_m=1024, num_warps=4,
                            num_stages=2)
  jaxpr = jax.make_jaxpr(lambda x, w: mm_triton.matmul(x, w, config=c, interpret=True))(
      jax.ShapeDtypeStruct((16, 16), F32), jax.ShapeDtypeStruct((16, 2**26), F32))
  assert jaxpr.out_avals[0].shape == (16, 2**26)


@pytest.mark.parametrize("family,config", [
    ("matmul", wt.TritonAttentionConfig()), ("attention", wt.XlaMatmulConfig()),
    ("decode", wt.TritonAttentionConfig()), ("ragged_dot", wt.TritonMatmulConfig()),
    ("matmul", {"backend": "cudnn"}), ("decode", {"backend": "tensorrt"}),
])
def test_configs_of_another_family_are_refused(family, config):
  with pytest.raises(ValueError, match=rf"{family} config|has no backend"):
    with wt.use_config(family, config):
      pass


def test_a_pinned_backend_runs_its_rule_per_problem_as_config_does():
  # use_config with {"backend": name} pins that backend's rule for each
  # problem (the config's defaults do not fit every problem: a weight-only
  # GEMM's 128 x 256 at 4 stages is over the shared memory of a CTA).
  from wavetune_jax.core.op import choose
  from wavetune_jax.runtime import selector
  fam, hw = wt.get_family("qmatmul"), wt.get_hardware("h100")
  for m in (1, 16, 64, 2048):
    p = wt.QMatmulProblem(m=m, n=4096, k=4096, dtype="bfloat16", w_dtype="int8")
    rule = fam.backend("mosaic").heuristic(p, hw)
    assert (rule is None) == (m > 64)  # no rule: the defaults, refused when the call validates
    rule = rule or fam.coerce_config({"backend": "mosaic"})
    with wt.use_config("qmatmul", {"backend": "mosaic"}):
      assert selector.select(fam, p, hw).config == rule
    if m > 64:
      with pytest.raises(ValueError, match="runs up to 64 rows"):
        choose(fam, p, {"backend": "mosaic"}, hw)
    else:
      assert choose(fam, p, {"backend": "mosaic"}, hw)[1] == rule
  with pytest.raises(ValueError, match="has no backend"):
    with wt.use_config("qmatmul", {"backend": "cudnn"}):
      pass


# === problem classes ===============================================================================


PROBLEMS = {
    wt.MatmulProblem: dict(m=16, n=32, k=64),
    wt.RaggedDotProblem: dict(m=16, g=2, k=64, n=32),
    wt.AttentionProblem: dict(batch=1, q_heads=8, kv_heads=2, q_len=16, kv_len=32, head_dim=64),
    wt.DecodeProblem: dict(batch=1, q_heads=8, kv_heads=2, kv_len=32, q_len=2, head_dim=64),
}
PROBLEM_FIELDS = [(cls, f) for cls, d in PROBLEMS.items() for f in d]


BAD_SIZES = {"str": "3", "float": 3.0, "bool": True, "None": None, "zero": 0, "negative": -1,
             "np_int": np.int64(3)}
# (AttentionProblem's kv_len=0 means q_len, as documented.)
BAD_SIZE_CASES = [(cls, f, v) for cls, f in PROBLEM_FIELDS for v in BAD_SIZES
                  if (cls, f, v) != (wt.AttentionProblem, "kv_len", "zero")]


@pytest.mark.parametrize("cls,field,value", BAD_SIZE_CASES,
                         ids=[f"{c.__name__}.{f}-{v}" for c, f, v in BAD_SIZE_CASES])
def test_problem_sizes_must_be_ints_from_1(cls, field, value):
  value = BAD_SIZES[value]
  with pytest.raises(ValueError, match=rf"{cls.__name__}\.{field}="):
    cls(**dict(PROBLEMS[cls], **{field: value}))


@pytest.mark.parametrize("dtype", ["foo", "bf16", "", 3, [1], None, "int8", "float64",
                                   "float8_e4m3fn", {"a": 1}],
                         ids=["foo", "bf16", "empty", "three", "list", "None", "int8",
                              "float64", "fp8", "dict"])
@pytest.mark.parametrize("cls", list(PROBLEMS), ids=lambda c: c.__name__)
def test_problem_dtypes_are_named(cls, dtype):
  with pytest.raises(ValueError, match=rf"{cls.__name__}\.dtype="):
    cls(**PROBLEMS[cls], dtype=dtype)


@pytest.mark.parametrize("cls,field,value,match", [
    (wt.AttentionProblem, "kv_heads", 3, "kv_heads=3 must divide q_heads=8"),
    (wt.AttentionProblem, "head_dim", 512, "head_dim=512"),
    (wt.AttentionProblem, "causal", "yes", r"AttentionProblem\.causal="),
    (wt.AttentionProblem, "causal", np.bool_(True), r"AttentionProblem\.causal="),
    (wt.AttentionProblem, "lengths", 1, r"AttentionProblem\.lengths="),
    (wt.AttentionProblem, "causal_align", "middle", "causal_align='middle'"),
    (wt.AttentionProblem, "causal_align", ["top_left"], "causal_align="),
    (wt.DecodeProblem, "q_len", 65, r"DecodeProblem\.q_len=65"),
    (wt.DecodeProblem, "kv_heads", 3, "kv_heads=3 must divide"),
    (wt.DecodeProblem, "causal", "no", r"DecodeProblem\.causal="),
    (wt.DecodeProblem, "lengths", None, r"DecodeProblem\.lengths="),
    (wt.MatmulProblem, "out_dtype", "int32", r"MatmulProblem\.out_dtype="),
    (wt.RaggedDotProblem, "out_dtype", "foo", r"RaggedDotProblem\.out_dtype="),
])
def test_problem_rules(cls, field, value, match):
  with pytest.raises(ValueError, match=match):
    cls(**dict(PROBLEMS[cls], **{field: value}))


@pytest.mark.parametrize("cls", list(PROBLEMS), ids=lambda c: c.__name__)
def test_problems_take_keywords_only(cls):
  with pytest.raises(TypeError, match="positional"):
    cls(*PROBLEMS[cls].values())
  with pytest.raises(TypeError, match="foo"):
    cls(**PROBLEMS[cls], foo=1)


# === selection state: policies, pinned configs, tables ===========================================


@pytest.fixture
def fresh_state():
  selector.clear()
  yield
  selector.clear()


@pytest.mark.parametrize("name", ["foo", 3, None, "", ["tables"], "Tables", "exhaustive "],
                         ids=["foo", "int", "None", "empty", "list", "capital", "space"])
def test_unknown_policies_are_refused(name, fresh_state):
  with pytest.raises(ValueError, match="unknown policy"):
    wt.set_policy(name)
  with pytest.raises(ValueError, match="unknown policy"):
    with wt.policy(name):
      pass
  assert selector._global["policy"] == "auto"  # nothing changed


@pytest.mark.parametrize("pol", wt.POLICIES)
def test_every_policy_gives_the_reference_on_a_cpu(pol, fresh_state):
  x, w = _mm()
  with wt.policy(pol):
    out = jax.jit(wt.matmul)(x, w)
  assert_close(out, ref_matmul(x, w), 1e-4)


@pytest.mark.parametrize("family", ["foo", "Matmul", "", "decode_attention"])
def test_unknown_families_are_named(family, fresh_state):
  p = wt.MatmulProblem(m=16, n=64, k=64)
  for call in (lambda: wt.select(family, p, "h100"),
               lambda: wt.use_config(family, {"backend": "xla"}).__enter__(),
               lambda: wt.use_tables(None, family).__enter__(),
               lambda: wt.load_tables(TABLE, family, hw="h100")):
    with pytest.raises(ValueError, match=f"unknown family {family!r}"):
      call()


@pytest.mark.parametrize("hw", ["b300", "", "nvidia", 3, 1.5])
def test_unknown_hardware_is_named(hw, fresh_state):
  with pytest.raises(ValueError, match="hardware"):
    wt.select("matmul", wt.MatmulProblem(m=16, n=64, k=64), hw)
  with pytest.raises(ValueError, match="hardware"):
    wt.load_tables(TABLE, "matmul", hw=hw)


_MM_P = wt.MatmulProblem(m=16, n=64, k=64)
_RD_P = wt.RaggedDotProblem(m=16, g=2, k=64, n=64)
SELECT_CASES = {
    "family_int": (3, _MM_P, "family=3 must be a family name"),
    "family_none": (None, _MM_P, "family=None must be a family name"),
    "family_list": (["matmul"], _MM_P, r"family=\['matmul'\] must be a family name"),
    "family_problem": (_MM_P, _MM_P, "family=MatmulProblem"),
    "problem_of_attention": ("attention", _MM_P, r"problem=MatmulProblem\(.*AttentionProblem"),
    "problem_of_ragged_dot": ("matmul", _RD_P, r"problem=RaggedDotProblem\(.*MatmulProblem"),
    "problem_of_matmul": (wt.RAGGED_DOT, _MM_P, "RaggedDotProblem"),
    "problem_none": ("matmul", None, "problem=None must be an instance of MatmulProblem"),
    "problem_dict": ("matmul", {"m": 16, "n": 64, "k": 64}, "problem={'m': 16"),
    "problem_str": ("decode", "16x64x64", "problem='16x64x64'.*DecodeProblem"),
    "problem_tuple": ("matmul", (16, 64, 64), "problem=\\(16, 64, 64\\)"),
}


@pytest.mark.parametrize("case", list(SELECT_CASES))
def test_select_names_a_wrong_family_or_problem(case, fresh_state):
  family, problem, match = SELECT_CASES[case]
  for _ in range(2):  # nothing wrong is memoized
    with pytest.raises(TypeError, match=match):
      wt.select(family, problem, "h100")


def test_a_memoized_problem_is_still_refused_by_another_family(fresh_state):
  assert wt.select("matmul", _MM_P, "h100").config is not None
  with pytest.raises(TypeError, match="AttentionProblem"):
    wt.select("attention", _MM_P, "h100")
  assert wt.select(wt.MATMUL, _MM_P, "h100") is wt.select("matmul", _MM_P, "h100")


@pytest.mark.parametrize("table", ["path.json", 3, {"format": "wavetune-table"}, TABLE,
                                   wt.MATMUL, ["table"]],
                         ids=["str", "int", "dict", "path", "family", "list"])
def test_use_tables_takes_a_loaded_table(table, fresh_state):
  table = __import__("pathlib").Path(table) if table == TABLE else table
  with pytest.raises(TypeError, match=r"table=.* must be a table as wt\.load_tables"):
    with wt.use_tables(table, "matmul"):
      pass


@pytest.mark.parametrize("path", [None, 3.5, b"matmul.json", ["matmul.json"], {"p": 1}],
                         ids=["None", "float", "bytes", "list", "dict"])
def test_load_tables_takes_a_path(path, fresh_state):
  with pytest.raises(TypeError, match="path=.* must be a str or an os.PathLike"):
    wt.load_tables(path, "matmul", hw="h100")
  assert "matmul" not in selector._global["tables"]


def test_load_tables_never_reads_or_closes_a_file_descriptor(tmp_path, fresh_state):
  with open(tmp_path / "other.txt", "w") as f:
    fd = f.fileno()
    with pytest.raises(TypeError, match=f"path={fd} must be a str"):
      wt.load_tables(fd, "matmul", hw="h100")
    with pytest.raises(TypeError, match="path="):
      tables_lib.load(fd, wt.MATMUL)
    os.fstat(fd)  # still open
    f.write("still writable")
  assert (tmp_path / "other.txt").read_text() == "still writable"


def test_load_tables_takes_a_pathlib_path(fresh_state):
  table = wt.load_tables(__import__("pathlib").Path(TABLE), "matmul", hw="h100")
  assert selector._global["tables"]["matmul"] is table


def test_use_tables_refuses_another_familys_table(fresh_state):
  table = tables_lib.load(TABLE, wt.MATMUL, wt.get_hardware("h100"))
  with pytest.raises(ValueError, match="for family 'matmul', not 'attention'"):
    with wt.use_tables(table, "attention"):
      pass


def test_use_tables_none_is_the_heuristic(fresh_state):
  x, w = _mm()
  with wt.use_tables(None, "matmul"):
    assert wt.select("matmul", wt.MatmulProblem(m=20, n=24, k=40, dtype="float32")).source \
        == "heuristic"
    assert_close(wt.matmul(x, w), ref_matmul(x, w), 1e-4)


def test_a_pinned_config_is_used_and_validated_per_problem(fresh_state):
  x, w = _mm()
  with wt.use_config("matmul", dict(MM_TRITON, split_k=2)):
    assert_close(jax.jit(wt.matmul)(x, w), ref_matmul(x, w), 1e-4)
    with pytest.raises(ValueError, match="split_k=2 is larger than"):
      wt.matmul(x[:, :16], w[:16])  # one K block


# === table files ===================================================================================


def _set(path, value):
  def f(d):
    o = d
    for p in path[:-1]:
      o = o[p]
    if value is KeyError:
      del o[path[-1]]
    else:
      o[path[-1]] = value
  return f


_E0, _X0, _A0 = ["model", "entries", 0], ["exact", 0], ["anchors", 0]
TABLE_EDITS = {
    "format_missing": (_set(["format"], KeyError), "not a wavetune table"),
    "format_other": (_set(["format"], "tokamax"), "not a wavetune table"),
    "schema_1": (_set(["schema"], 1), "schema 1"),
    "schema_str": (_set(["schema"], "2"), "schema '2'"),
    "family_missing": (_set(["family"], KeyError), "is for family None"),
    "family_attention": (_set(["family"], "attention"), "is for family 'attention'"),
    "revisions_list": (_set(["revisions"], []), "'revisions' should be dict"),
    "revisions_missing": (_set(["revisions"], KeyError), "missing 'revisions'"),
    "revisions_unknown_backend": (_set(["revisions", "cutlass"], 1), "backend 'cutlass'"),
    "revision_stale": (_set(["revisions", "triton"], 0), "revision 0"),
    "device_key_int": (_set(["device_key"], 3), "'device_key' should be str"),
    "device_key_h200": (_set(["device_key"], "nvidia_h200"), "is for 'nvidia_h200'"),
    "num_sms_zero": (_set(["num_sms"], 0), "num_sms=0"),
    "num_sms_str": (_set(["num_sms"], "132"), "'num_sms' should be int"),
    "num_sms_bool": (_set(["num_sms"], True), "'num_sms' should be int"),
    "num_sms_float": (_set(["num_sms"], 132.0), "'num_sms' should be int"),
    "model_missing": (_set(["model"], KeyError), "missing 'model'"),
    "model_list": (_set(["model"], []), "'model' should be dict"),
    "form_unknown": (_set(["model", "form"], "cubic"), "unknown model form 'cubic'"),
    "form_int": (_set(["model", "form"], 3), "'form' should be str"),
    "aux_names_wrong": (_set(["model", "aux_names"], ["a"]), "auxiliary columns"),
    "aux_names_str": (_set(["model", "aux_names"], "ab"), "auxiliary columns"),
    "entries_dict": (_set(["model", "entries"], {}), "'entries' should be list"),
    "entries_missing": (_set(["model", "entries"], KeyError), "missing 'entries'"),
    "entry_int": (_set(_E0, 3), "model entry 3 is not an object"),
    "entry_no_coef": (_set(_E0 + ["coef"], KeyError), "KeyError: 'coef'"),
    "coef_nan": (_set(_E0 + ["coef", 0], float("nan")), "invalid coef"),
    "coef_negative": (_set(_E0 + ["coef", 0], -1.0), "invalid coef"),
    "coef_str": (_set(_E0 + ["coef", 0], "1"), "is not a number"),
    "coef_short": (_set(_E0 + ["coef"], [1.0]), "coefficients, the form needs"),
    "coef_int": (_set(_E0 + ["coef"], 3), "TypeError"),
    "occupancy_zero": (_set(_E0 + ["occupancy"], 0), "invalid occupancy"),
    "occupancy_float": (_set(_E0 + ["occupancy"], 1.5), "is not an integer"),
    "variant_backend": (_set(_E0 + ["variant", "backend"], "foo"), "no backend 'foo'"),
    "variant_missing_field": (_set(_E0 + ["variant", "block_m"], KeyError), "must have the fields"),
    "variant_float_field": (_set(_E0 + ["variant", "block_m"], 64.0), "must be an int"),
    "variant_int": (_set(_E0 + ["variant"], 3), "model entry 3"),
    "aux_seen_int": (_set(_E0 + ["aux_seen"], 5), "TypeError"),
    "min_g_above_max_g": (_set(_E0 + ["min_g"], 10**9), "min > max"),
    "min_l_inf": (_set(_E0 + ["min_l"], float("inf")), "invalid min_l"),
    "points_str": (_set(_E0 + ["points"], "2"), "is not an integer"),
    "fit_med_err_negative": (_set(_E0 + ["fit_med_err"], -1), "invalid fit_med_err"),
    "exact_dict": (_set(["exact"], {}), "'exact' should be list"),
    "exact_missing": (_set(["exact"], KeyError), "missing 'exact'"),
    "exact_int": (_set(_X0, 3), "exact entry 3 is not an object"),
    "exact_no_problem": (_set(_X0 + ["problem"], KeyError), "KeyError: 'problem'"),
    "exact_problem_list": (_set(_X0 + ["problem"], [1]), "must be a mapping"),
    "exact_m_zero": (_set(_X0 + ["problem", "m"], 0), r"MatmulProblem\.m=0"),
    "exact_m_float": (_set(_X0 + ["problem", "m"], 1.5), r"MatmulProblem\.m=1\.5"),
    "exact_dtype_int8": (_set(_X0 + ["problem", "dtype"], "int8"), r"MatmulProblem\.dtype"),
    "exact_dtype_list": (_set(_X0 + ["problem", "dtype"], [1]), r"MatmulProblem\.dtype"),
    "exact_problem_field": (_set(_X0 + ["problem", "foo"], 1), "unknown MatmulProblem field"),
    "exact_attention_problem": (_set(_X0 + ["problem"], {"batch": 1, "q_heads": 8,
                                                         "kv_heads": 8, "q_len": 128}),
                                "unknown MatmulProblem field"),
    "exact_config_invalid": (_set(_X0 + ["config"], {"backend": "triton", "block_m": 3}),
                             r"block_m=3"),
    "exact_config_list": (_set(_X0 + ["config"], [1]), "must be a mapping"),
    "exact_config_backend": (_set(_X0 + ["config"], {"backend": "foo"}), "no backend 'foo'"),
    "exact_config_attention": (_set(_X0 + ["config"], ATT_TRITON), "unknown TritonMatmulConfig"),
    "exact_config_backend_number": (_set(_X0 + ["config"], {"backend": 7}), "backend number 7"),
    "exact_config_unhashable": (_set(_X0 + ["config"], {"backend": "triton", "block_m": [64]}),
                                "block_m"),
    "exact_us_negative": (_set(_X0 + ["us"], -1), "must be finite and positive"),
    "exact_us_str": (_set(_X0 + ["us"], "1"), "is not a number"),
    "exact_us_inf": (_set(_X0 + ["us"], float("inf")), "must be finite and positive"),
    "exact_us_missing": (_set(_X0 + ["us"], KeyError), "KeyError: 'us'"),
    "anchor_us_negative": (_set(_A0 + ["us"], -5), "anchor entry"),
    "anchors_str": (_set(["anchors"], "ab"), "'anchors' should be list, got str"),
    "trust_half": (_set(["model", "trust"], 0.5), "trust 0.5 must be >= 1"),
    "trust_str": (_set(["model", "trust"], "x"), "trust 'x'"),
    "trust_nan": (_set(["model", "trust"], float("nan")), "trust nan"),
    "penalty_negative": (_set(["model", "distance_penalty"], -1), "distance_penalty -1"),
    "penalty_nan": (_set(["model", "distance_penalty"], float("nan")), "distance_penalty nan"),
    # Values that are not ValueError-shaped in Python: each is a TableError.
    "aux_names_int": (_set(["model", "aux_names"], 3), "auxiliary columns 3"),
    "aux_names_null": (_set(["model", "aux_names"], None), "auxiliary columns None"),
    "exact_us_huge_int": (_set(_X0 + ["us"], 10**400), "too large for a float"),
    "anchor_us_huge_int": (_set(_A0 + ["us"], -10**400), "anchor entry.*too large for a float"),
    "coef_huge_int": (_set(_E0 + ["coef", 0], 10**400), "too large for a float"),
    "coef_past_float32": (_set(_E0 + ["coef", 0], 1e300), "invalid coef"),
    "occupancy_huge_int": (_set(_E0 + ["occupancy"], 10**400), "does not fit 64 bits"),
    "min_g_2_63": (_set(_E0 + ["min_g"], 2**63), "does not fit 64 bits"),
    "num_sms_huge_int": (_set(["num_sms"], 10**400), r"num_sms=1000.*\.\.\. must be in"),
    "trust_huge_int": (_set(["model", "trust"], 10**400), "trust 1000.* must be >= 1"),
    "penalty_huge_int": (_set(["model", "distance_penalty"], 10**400),
                         "distance_penalty 1000"),
    "anchors_int": (_set(["anchors"], 3), "'anchors' should be list, got int"),
    "anchors_dict": (_set(["anchors"], {}), "'anchors' should be list, got dict"),
    "provenance_list": (_set(["provenance"], [1]), "'provenance' should be dict, got list"),
    "provenance_str": (_set(["provenance"], "abc"), "'provenance' should be dict, got str"),
    "device_kind_list": (_set(["device_kind"], [1]), "'device_kind' should be str"),
    "exact_problem_huge_int": (_set(_X0 + ["problem", "m"], 10**400),
                               r"MatmulProblem\.m=1000.* does not fit 64 bits"),
    "anchor_problem_2_31": (_set(_A0 + ["problem", "n"], 2**31),
                            "anchor entry.*a problem size is larger than 2147483647"),
    "exact_config_huge_int": (_set(_X0 + ["config"], dict(MM_TRITON, group_m=10**30)),
                              r"group_m=1000.* must fit int32"),
}
RAW_TABLES = {
    "empty": (lambda raw: b"", "not readable JSON"),
    "truncated": (lambda raw: raw[: len(raw) // 2], "not readable JSON"),
    "one_byte_short": (lambda raw: raw.rstrip()[:-1], "not readable JSON"),
    "binary": (lambda raw: bytes(range(256)) * 4, "not readable JSON"),
    "not_json": (lambda raw: b"{not json", "not readable JSON"),
    "nan_literal": (lambda raw: raw.replace(b'"us": ', b'"us": NaN, "x": ', 1),
                    "must be finite and positive"),
    "array": (lambda raw: b"[]", "not a wavetune table"),
    "null": (lambda raw: b"null", "not a wavetune table"),
    "string": (lambda raw: b'"wavetune-table"', "not a wavetune table"),
    "gzip": (lambda raw: __import__("gzip").compress(raw), "not readable JSON"),
    "deeply_nested": (lambda raw: b"[" * 100000 + b"]" * 100000, "RecursionError"),
    "deeply_nested_field": (lambda raw: raw.replace(
        b'"provenance": ', b'"provenance": ' + b"[" * 100000 + b"]" * 100000 + b', "x": ', 1),
                            "RecursionError"),
    "int_of_5000_digits": (lambda raw: raw.replace(b'"us": ', b'"us": ' + b"9" * 5000
                                                   + b', "x": ', 1), "not readable JSON"),
    "float_literal_past_range": (lambda raw: raw.replace(b'"us": ', b'"us": 1e400, "x": ', 1),
                                 "must be finite and positive"),
}


@pytest.fixture(scope="module")
def table_json():
  with open(TABLE, "rb") as f:
    raw = f.read()
  return raw, json.loads(raw)


def _write_table(tmp_path, table_json, kind):
  raw, base = table_json
  if kind in RAW_TABLES:
    data = RAW_TABLES[kind][0](raw)
    match = RAW_TABLES[kind][1]
  else:
    edit, match = TABLE_EDITS[kind]
    d = copy.deepcopy(base)
    edit(d)
    data = json.dumps(d).encode()
  path = tmp_path / "matmul.json"
  path.write_bytes(data)
  return str(path), match


@pytest.mark.parametrize("kind", list(RAW_TABLES) + list(TABLE_EDITS))
def test_bad_table_files_raise_table_error(kind, table_json, tmp_path, fresh_state):
  path, match = _write_table(tmp_path, table_json, kind)
  with pytest.raises(wt.TableError, match=match):
    wt.load_tables(path, "matmul", hw="h100")
  assert "matmul" not in selector._global["tables"]  # the active table is unchanged


#: What a hostile table puts in place of any one value.
HOSTILE_VALUES = [10**400, -10**400, 2**63, 2**31, -1, 0, 1e308, "x", None, [1], {"a": 1},
                  True, [[[]]]]


def _leaves(o, path=()):
  """Every path into ``o`` (the first two items of each list)."""
  if path:
    yield path
  items = o.items() if isinstance(o, dict) else enumerate(o[:2]) if isinstance(o, list) else ()
  for k, v in items:
    yield from _leaves(v, path + (k,))


@pytest.mark.parametrize("family", ["matmul", "attention", "decode", "ragged_dot"])
def test_every_value_of_a_table_replaced_by_a_hostile_one(family, tmp_path, fresh_state):
  """Each value of a (shortened) shipped table, replaced in turn by two of
  HOSTILE_VALUES (a different two at each next value): the file raises
  TableError, or loads and the selector decides with it (nothing else
  escapes)."""
  spec, hw = wt.get_family(family), wt.get_hardware("h100")
  with open(os.path.join(ROOT, "tables", H100, f"{family}.json")) as f:
    base = json.load(f)
  base["model"]["entries"] = base["model"]["entries"][:2]
  base["exact"], base["anchors"] = base["exact"][:2], base["anchors"][:3]
  problems = [spec.problem_from_dict(r["problem"]) for r in base["exact"]]
  path = tmp_path / "t.json"
  escaped = []
  n = len(HOSTILE_VALUES)
  for i, where in enumerate(_leaves(base)):
    # Two hostile values per value of the table, in turn: every hostile
    # value meets every kind of field over the table's many fields.
    for value in (HOSTILE_VALUES[(i + j * 6) % n] for j in range(2)):
      d = copy.deepcopy(base)
      _set(list(where), value)(d)
      path.write_text(json.dumps(d))
      try:
        table = tables_lib.load(str(path), spec, hw)
        decider = selector.Decider(table, hw)
        for p in problems:
          for size in (1, 300, 5000):
            decider.decide(spec.with_size(p, size))
      except wt.TableError:
        pass
      except Exception as e:  # noqa: BLE001 (what the test looks for)
        escaped.append((where, repr(value)[:20], f"{type(e).__name__}: {str(e)[:80]}"))
  assert not escaped, escaped[:10]


@pytest.mark.parametrize("path,family,hw,match", [
    (ATT_TABLE, "matmul", "h100", "is for family 'attention', not 'matmul'"),
    (TABLE, "ragged_dot", "h100", "is for family 'matmul', not 'ragged_dot'"),
    (TABLE, "matmul", "h200", "is for 'nvidia_h100_80gb_hbm3', not for 'nvidia_h200'"),
    (H200_TABLE, "matmul", "h100", "is for 'nvidia_h200'"),
    (H200_TABLE, "matmul", "a100", "is for 'nvidia_h200'"),
    ("/nonexistent/matmul.json", "matmul", "h100", "no table at"),
    (ROOT, "matmul", "h100", "is not readable"),
])
def test_foreign_and_missing_tables(path, family, hw, match, fresh_state):
  with pytest.raises(wt.TableError, match=match):
    wt.load_tables(path, family, hw=hw)


@pytest.mark.parametrize("kind", ["truncated", "binary", "family_attention", "device_key_h200",
                                  "revision_stale", "coef_nan", "exact_config_invalid",
                                  "deeply_nested", "int_of_5000_digits", "aux_names_int",
                                  "exact_us_huge_int", "anchors_int", "provenance_list",
                                  "provenance_str", "anchor_problem_2_31", "occupancy_huge_int",
                                  "trust_huge_int"])
def test_a_bad_shipped_table_warns_once_and_the_op_still_answers(kind, table_json, tmp_path,
                                                                fresh_state, monkeypatch):
  folder = tmp_path / "tables" / H100
  folder.mkdir(parents=True)
  _write_table(folder, table_json, kind)
  monkeypatch.setenv("WAVETUNE_TABLES", str(tmp_path / "tables"))
  x, w = _mm()
  with pytest.warns(UserWarning, match="no usable matmul table"):
    out = wt.matmul(x, w)
  assert_close(out, ref_matmul(x, w), 1e-4)
  with warnings.catch_warnings():
    warnings.simplefilter("error")  # once
    assert_close(wt.matmul(x[:7], w), ref_matmul(x[:7], w), 1e-4)


# === the kernel cache ==============================================================================


@pytest.fixture
def kcache(tmp_path):
  pytest.importorskip("flatbuffers")
  saved = dict(kernel_cache._state)
  kernel_cache.set_dir(tmp_path / "kernels")
  kernel_cache.clear_memory()
  yield tmp_path / "kernels"
  kernel_cache._state.update(saved)
  kernel_cache.clear_memory()


def _cached_matmul(x, w):
  kernel_cache.clear_memory()
  jax.clear_caches()
  return jax.jit(lambda a, b: wt.matmul(a, b, config=MM_TRITON))(x, w)


@pytest.mark.parametrize("damage", ["empty", "truncated", "garbage", "directory"])
def test_a_damaged_kernel_cache_entry_is_replaced(damage, kcache):
  x, w = _mm()
  _cached_matmul(x, w)
  (f,) = kcache.rglob("*.jaxexport")
  data = f.read_bytes()
  f.unlink()
  if damage == "directory":
    f.mkdir()
  else:
    f.write_bytes({"empty": b"", "truncated": data[: len(data) // 3],
                   "garbage": bytes(range(256)) * 8}[damage])
  kernel_cache._warned.clear()
  with pytest.warns(UserWarning, match="could not read"):
    out = _cached_matmul(x, w)
  assert_close(out, ref_matmul(x, w), 1e-4)


def test_a_kernel_cache_folder_that_is_a_file(kcache):
  kcache.parent.mkdir(exist_ok=True)
  kcache.write_text("not a folder")
  kernel_cache._warned.clear()
  x, w = _mm()
  with pytest.warns(UserWarning, match="could not write"):
    out = _cached_matmul(x, w)
  assert_close(out, ref_matmul(x, w), 1e-4)


_CACHE_SCRIPT = textwrap.dedent("""
    import sys, warnings; warnings.simplefilter("ignore")
    import jax, jax.numpy as jnp, numpy as np
    import wavetune_jax as wt
    from wavetune_jax.core import kernel_cache
    x = jnp.asarray(np.random.default_rng(1).standard_normal((20, 40)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(2).standard_normal((40, 24)), jnp.float32)
    cfg = dict(backend="triton", block_m=16, block_n=16, block_k=16, split_k=1, group_m=8,
               num_warps=4, num_stages=2)
    y = np.asarray(jax.jit(lambda a, b: wt.matmul(a, b, config=cfg))(x, w))
    ref = np.asarray(x) @ np.asarray(w)
    s = kernel_cache.stats()
    print(s["misses"], s["loads"], s["errors"], float(np.abs(y - ref).max()))
""")


def test_processes_sharing_a_kernel_cache_folder(tmp_path):
  pytest.importorskip("flatbuffers")
  env = dict(os.environ, WAVETUNE_KERNEL_CACHE=str(tmp_path), JAX_PLATFORMS="cpu")
  procs = [subprocess.Popen([sys.executable, "-c", _CACHE_SCRIPT], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
  outs = []
  for p in procs:
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    outs.append(out.split())
  for misses, loads, errors, diff in outs:  # at once: each lowered or loaded, none failed
    assert int(misses) + int(loads) == 1 and errors == "0"
    assert float(diff) < 1e-4
  files = list(tmp_path.rglob("*"))
  assert [f.suffix for f in files if f.is_file()] == [".jaxexport"]  # no temporary left
  third = subprocess.run([sys.executable, "-c", _CACHE_SCRIPT], env=env, text=True,
                         capture_output=True, timeout=120, check=True).stdout.split()
  assert third[:3] == ["0", "1", "0"] and float(third[3]) < 1e-4


# === the command line ==============================================================================


def _cli(argv, capsys):
  try:
    code = cli_main(argv)
  except SystemExit as e:  # argparse: usage + one error line
    code = e.code
  err = capsys.readouterr().err.strip().splitlines()
  return code, err


SWEEP = os.path.join(ROOT, "data", "sweeps", "nvidia_h200", "matmul_bfloat16.jsonl.gz")
_MM = ["select", "matmul", "--m", "16", "--n", "64", "--k", "64", "--device", "h100"]
_ATT = ["select", "attention", "--m", "16", "--set", "batch=1", "--set", "q_heads=8",
        "--set", "kv_heads=8", "--device", "h100"]
CLI_CASES = {
    "no_command": ([], "required: COMMAND"),
    "unknown_command": (["frobnicate"], "invalid choice"),
    "select_unknown_family": (["select", "conv"], "invalid choice: 'conv'"),
    "select_m_text": (["select", "matmul", "--m", "x"], "--m: 'x' is not an integer"),
    "select_m_zero": (["select", "matmul", "--m", "0"], "--m: 0 is not an integer >= 1"),
    "select_m_float": (["select", "matmul", "--m", "1.5"], "--m"),
    "select_n_negative": (["select", "matmul", "--m", "4", "--n", "-4"], "--n"),
    "select_device": (_MM[:-1] + ["b300"], "invalid choice: 'b300'"),
    "select_dtype": (_MM + ["--dtype", "int8"], "invalid choice: 'int8'"),
    "select_policy": (_MM + ["--policy", "exhaustive"], "invalid choice: 'exhaustive'"),
    "select_set_no_equals": (_MM + ["--set", "n"], "expected FIELD=VALUE"),
    "select_set_no_field": (_MM + ["--set", "=3"], "expected FIELD=VALUE"),
    "select_set_unknown_field": (_MM + ["--set", "foo=1"], "unknown MatmulProblem field"),
    "select_set_dtype": (_MM + ["--set", "dtype=int8"], r"MatmulProblem.dtype='int8'"),
    "select_set_out_dtype": (_MM + ["--set", "out_dtype=foo"], "MatmulProblem.out_dtype"),
    "select_missing_k": (_MM[:6] + ["--device", "h100"], "not a matmul problem"),
    "select_attention_dtype": (_ATT + ["--set", "dtype=foo"], "AttentionProblem.dtype='foo'"),
    "select_attention_gqa": (["select", "attention", "--m", "16", "--set", "batch=1", "--set",
                              "q_heads=8", "--set", "kv_heads=3", "--device", "h100"],
                             "kv_heads=3 must divide"),
    "select_attention_causal": (_ATT + ["--set", "causal=yes"], "causal takes true or false"),
    "select_set_text_int": (["select", "attention", "--set", "batch=two", "--device", "h100"],
                            "--set batch=two: batch takes an integer"),
    "select_set_float_int": (_ATT + ["--set", "head_dim=2.5"], "head_dim takes an integer"),
    "select_set_text_float": (_ATT + ["--set", "soft_cap=x"], "soft_cap takes a number"),
    "select_attention_align": (_ATT + ["--set", "causal_align=middle"], "causal_align"),
    "select_attention_head_dim": (_ATT + ["--set", "head_dim=512"], "head_dim=512"),
    "select_decode_q_len": (["select", "decode", "--m", "64", "--set", "batch=1", "--set",
                             "q_heads=8", "--set", "kv_heads=8", "--set", "q_len=65",
                             "--device", "h100"], "q_len=65"),
    "select_decode_dtype": (["select", "decode", "--m", "64", "--set", "batch=1", "--set",
                             "q_heads=8", "--set", "kv_heads=8", "--dtype", "float32",
                             "--device", "h100"], "DecodeProblem.dtype='float32'"),
    "select_ragged_g": (["select", "ragged_dot", "--m", "16", "--set", "g=0", "--set", "k=64",
                         "--set", "n=64", "--device", "h100"], "RaggedDotProblem.g=0"),
    "select_table_missing": (_MM + ["--table", "/nonexistent.json"], "no file"),
    "select_table_folder": (_MM + ["--table", ROOT], "no file"),
    "select_table_other_gpu": (_MM + ["--table", H200_TABLE], "is for 'nvidia_h200'"),
    "select_table_other_family": (_MM + ["--table", ATT_TABLE], "is for family 'attention'"),
    "select_table_truncated": (_MM + ["--table", "{truncated}"], "not readable JSON"),
    "select_table_stale": (_MM + ["--table", "{revision_stale}"], "revision 0"),
    "select_table_coef_nan": (_MM + ["--table", "{coef_nan}"], "invalid coef"),
    "report_table": (["report", TABLE], "not a sweep file"),
    "report_folder": (["report", ROOT], "no file"),
    "report_missing": (["report", "/nonexistent.jsonl.gz"], "no file"),
    "merge_missing": (["merge", "/nonexistent.jsonl.gz", "--into", "{out}"], "no file"),
    "eval_other_family": (["eval", "--family", "attention", "--sweep", SWEEP, "--policy",
                           "heuristic"], "holds 'matmul' measurements, not 'attention'"),
    "eval_policy": (["eval", "--family", "matmul", "--sweep", SWEEP, "--policy", "magic"],
                    "unknown policy"),
    "eval_seed": (["eval", "--family", "matmul", "--sweep", SWEEP, "--seed", "x"], "--seed"),
    "eval_budget": (["eval", "--family", "matmul", "--sweep", SWEEP, "--budget", "0"],
                    "--budget: 0"),
    "eval_trust": (["eval", "--family", "matmul", "--sweep", SWEEP, "--trust", "nan"],
                   "--trust: nan"),
    "eval_penalty": (["eval", "--family", "matmul", "--sweep", SWEEP, "--distance-penalty",
                      "-1"], "--distance-penalty: -1"),
    "eval_margin": (["eval", "--family", "matmul", "--sweep", SWEEP, "--heuristic-margin",
                     "x"], "--heuristic-margin: 'x'"),
    "eval_form": (["eval", "--family", "matmul", "--sweep", SWEEP, "--form", "cubic"],
                  "invalid choice: 'cubic'"),
    "eval_table_as_sweep": (["eval", "--family", "matmul", "--sweep", TABLE], "not a sweep"),
    "demo_m_zero": (["demo", "--m", "0"], "--m: 0 is not an integer >= 1"),
    "demo_m_text": (["demo", "--m", "x"], "--m: 'x' is not an integer"),
    "demo_dtype": (["demo", "--dtype", "float32"], "invalid choice: 'float32'"),
    "bench_model": (["bench", "model", "--model", "gpt5"], "invalid choice: 'gpt5'"),
    "bench_layers": (["bench", "model", "--model", "small", "--layers", "0"], "--layers: 0"),
    "bench_ops": (["bench", "model", "--model", "small", "--ops", "foo"], "--ops 'foo'"),
    "bench_prompt": (["bench", "model", "--model", "small", "--prompt", "-1"], "--prompt: -1"),
    "bench_batch": (["bench", "model", "--model", "small", "--decode-batch", "0"],
                    "--decode-batch: 0"),
    "bench_cache": (["bench", "model", "--model", "small", "--cache", "x"], "--cache: 'x'"),
    "bench_iterations": (["bench", "model", "--model", "small", "--iterations", "0"],
                         "--iterations: 0"),
    "bench_cache_fill": (["bench", "model", "--cache-fill", "half"], "invalid choice: 'half'"),
    "sweep_no_gpu": (["sweep", "--family", "matmul"], "no GPU"),
}


@pytest.mark.parametrize("case", list(CLI_CASES))
def test_cli_errors_are_one_line_naming_the_problem(case, capsys, tmp_path, table_json,
                                                    fresh_state):
  argv, match = CLI_CASES[case]
  files = {"out": str(tmp_path / "out.jsonl.gz")}
  for kind in ("truncated", "revision_stale", "coef_nan"):
    d = tmp_path / kind
    d.mkdir()
    files[kind] = _write_table(d, table_json, kind)[0]
  code, err = _cli([a.format(**files) for a in argv], capsys)
  assert code == 2, err
  assert err and not any("Traceback" in line for line in err)
  assert match in err[-1], err[-1]
  assert err[-1].startswith("wavetune") or err[-1].startswith("usage"), err[-1]
  assert not os.path.exists(files["out"])


# === inputs the public API must refuse or accept ===================================================


@pytest.mark.parametrize("case", ["x", "sizes", "experts", "scales", "w8a8"])
def test_vmap_of_quantized_ragged_dot(case):
  """``jax.vmap`` folds the batch into one grouped GEMM, as ``wt.ragged_dot``
  does (``lax.ragged_dot`` has no rule for batched group sizes): each batch
  element equals the unbatched op."""
  key = jax.random.PRNGKey(3)
  x = jax.random.normal(key, (2, 20, 64), F32)
  web = jax.random.normal(jax.random.PRNGKey(4), (2, 3, 64, 32), F32)
  qs = [wt.quantize_weight(web[i], "int8") for i in range(2)]
  qb, sb = jnp.stack([a for a, _ in qs]), jnp.stack([b for _, b in qs])
  gsb = jnp.array([[5, 0, 12], [1, 19, 0]])
  xb = x.astype(jnp.bfloat16)
  op, args, axes = wt.quantized_ragged_dot, (xb, qb[0], sb[0], gsb[0]), (0, None, None, None)
  if case == "sizes":
    args, axes = (xb, qb[0], sb[0], gsb), (0, None, None, 0)
  elif case == "experts":
    args, axes = (xb, qb, sb, gsb), (0, 0, 0, 0)
  elif case == "scales":
    args, axes = (xb[0], qb[0], sb, gsb[0]), (None, None, 0, None)
  elif case == "w8a8":
    rows = [wt.quantize_rows(x[i]) for i in range(2)]
    q8, s8 = wt.quantize_weight(web[0], "float8_e4m3fn")
    op = lambda a, b, c, d, e: wt.quantized_ragged_dot(a, b, c, d, x_scales=e)
    args = (jnp.stack([a for a, _ in rows]), q8, s8, gsb, jnp.stack([b for _, b in rows]))
    axes = (0, None, None, 0, 0)
  out = jax.jit(jax.vmap(op, in_axes=axes))(*args)
  each = [op(*(a if ax is None else a[i] for a, ax in zip(args, axes))) for i in range(2)]
  assert out.shape == (2, 20, 32)
  np.testing.assert_array_equal(_f32(out), _f32(jnp.stack(each)))


def test_vmap_over_an_empty_batch_of_grouped_gemms():
  rhs = jnp.ones((3, 32, 16), jnp.bfloat16)
  out = jax.vmap(wt.ragged_dot, in_axes=(0, None, None))(
      jnp.zeros((0, 8, 32), jnp.bfloat16), rhs, jnp.array([3, 0, 5]))
  assert out.shape == (0, 8, 16)
  out = jax.vmap(wt.ragged_dot, in_axes=(None, None, 0))(
      jnp.zeros((8, 32), jnp.bfloat16), rhs, jnp.zeros((0, 3), jnp.int32))
  assert out.shape == (0, 8, 16)
  q, s = wt.quantize_weight(jnp.ones((3, 64, 32)), "int8")
  out = jax.vmap(wt.quantized_ragged_dot, in_axes=(0, None, None, None))(
      jnp.zeros((0, 20, 64), jnp.bfloat16), q, s, jnp.array([5, 0, 12]))
  assert out.shape == (0, 20, 32)


@pytest.mark.parametrize("bad,why", [([[1], [2, 3]], "a ragged nested sequence"),
                                     (None, "a NoneType is not an array"),
                                     ({"a": 1}, "a dict is not an array")])
def test_sizes_and_lengths_that_are_not_arrays(bad, why):
  x = jnp.ones((8, 64), jnp.bfloat16)
  with pytest.raises(ValueError, match=f"group_sizes must be an integer array; got .*{why}"):
    wt.ragged_dot(x, jnp.ones((3, 64, 32), jnp.bfloat16), bad)
  q, s = wt.quantize_weight(jnp.ones((3, 64, 32)), "int8")
  with pytest.raises(ValueError, match=f"group_sizes must be an integer array; got .*{why}"):
    wt.quantized_ragged_dot(x, q, s, bad)
  if bad is not None:   # (kv_lengths=None: no lengths; block_tables=None: no pages)
    a = jnp.ones((2, 8, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=f"kv_lengths must be an integer array; got .*{why}"):
      wt.attention(a, a, a, kv_lengths=bad)
    pages = jnp.ones((4, 16, 2, 64), jnp.bfloat16)
    with pytest.raises(ValueError, match=f"block_tables must be an integer array; got .*{why}"):
      wt.decode_attention(a[:, :1], pages, pages, block_tables=bad)


def test_float16_windowed_attention_and_decode_on_a_cpu():
  """XLA's CPU dot rejects float16 operands with a float32 result inside a
  jit: XLA's attention (a window, or the xla backend) computes float32 there."""
  q = jax.random.normal(jax.random.PRNGKey(0), (1, 16, 2, 64), jnp.float16)
  k = jax.random.normal(jax.random.PRNGKey(1), (1, 16, 2, 64), jnp.float16)
  ref = jax.nn.dot_product_attention(*(_f32(a) for a in (q, k, k)), is_causal=True,
                                     local_window_size=(4, 0))
  for config in (None, {"backend": "xla"}):
    out = jax.jit(lambda a, b: wt.attention(a, b, b, local_window_size=(4, 0),
                                            config=config))(q, k)
    assert out.dtype == jnp.float16
    np.testing.assert_allclose(_f32(out), ref, atol=2e-3)
  cache = jax.random.normal(jax.random.PRNGKey(2), (2, 32, 2, 64), jnp.float16)
  q1 = jax.random.normal(jax.random.PRNGKey(3), (2, 1, 2, 64), jnp.float16)
  out = wt.decode_attention(q1, cache, cache, local_window_size=(4, 0))
  ref = jax.nn.dot_product_attention(_f32(q1), _f32(cache[:, 27:]), _f32(cache[:, 27:]))
  np.testing.assert_allclose(_f32(out), ref, atol=2e-3)
  # XLA's backend without a window too: plain causal prefill, decode with lengths.
  xla = {"backend": "xla"}
  out = jax.jit(lambda a, b: wt.attention(a, b, b, config=xla))(q, k)
  ref = jax.nn.dot_product_attention(*(_f32(a) for a in (q, k, k)), is_causal=True)
  np.testing.assert_allclose(_f32(out), ref, atol=2e-3)
  lens = jnp.array([5, 32])
  out = jax.jit(lambda a, c: wt.decode_attention(a, c, c, kv_lengths=lens, config=xla))(q1, cache)
  ref = jax.nn.dot_product_attention(_f32(q1), _f32(cache), _f32(cache),
                                     key_value_seq_lengths=lens)
  np.testing.assert_allclose(_f32(out), ref, atol=2e-3)


def test_autotune_flags_must_be_booleans():
  wt.autotune(lambda x: x, report=1, masks=0)   # (0 and 1 pass, as flags often are)
  for kw in ({"report": "yes"}, {"masks": 2}, {"report": None}):
    with pytest.raises(TypeError, match="must be True or False"):
      wt.autotune(lambda x: x, **kw)


def test_python_dash_m_runs_the_command():
  for mod in ("wavetune_jax", "wavetune_jax.cli"):
    r = subprocess.run([sys.executable, "-m", mod, "select", "--bogus"], capture_output=True,
                       text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 2 and "wavetune select: error:" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn", "int4"])
def test_a_non_finite_weight_makes_its_channel_nan_whatever_the_width(dtype):
  """NaN or an infinity in a column (an int4 group) gives that column a NaN
  scale, so its outputs are NaN and the other columns are untouched (XLA's
  max had dropped a NaN at 16 columns or more, clipping the column's finite
  values to the scale of 1)."""
  kw = {"layout": "nk", "group_size": 128} if dtype == "int4" else {}
  for n in (8, 32):
    w = jax.random.normal(jax.random.PRNGKey(0), (256, n)) * 1000
    w = w.at[0, 0].set(jnp.nan).at[3, 1].set(jnp.inf)
    q, scales = wt.quantize_weight(w, dtype, **kw)
    s = np.asarray(scales).reshape(-1, n)
    assert np.isnan(s[0, 0]) and np.isnan(s[0, 1]), s[:, :3]
    assert np.all(np.isfinite(s[:, 2:])) and np.all(s[:, 2:] > 1.0)
    y = _f32(wt.quantized_matmul(jnp.ones((4, 256), jnp.bfloat16), q, scales,
                                 w_layout=kw.get("layout", "kn")))
    assert np.all(np.isnan(y[:, :2])) and np.all(np.isfinite(y[:, 2:]))
  x = jax.random.normal(jax.random.PRNGKey(1), (3, 64)) * 1000
  _, xs = wt.quantize_rows(x.at[0, 5].set(jnp.nan))
  assert np.isnan(xs[0]) and np.all(np.isfinite(xs[1:]))


def test_quantizing_nothing():
  q, s = wt.quantize_weight(jnp.ones((0, 32)), "int8")
  assert q.shape == (0, 32) and np.all(np.asarray(s) == 1.0)
  q, s = wt.quantize_rows(jnp.ones((5, 0)))
  assert q.shape == (5, 0) and np.all(np.asarray(s) == 1.0)


def test_a_config_naming_only_its_backend_is_the_backends_rule():
  """``config={"backend": "mosaic"}``: the backend's own rule for the problem
  (its class defaults do not fit every problem's shared memory); on a
  machine where it cannot run, that is the error."""
  from wavetune_jax.core import op as op_lib
  from wavetune_jax.families.qmatmul.problem import QMatmulProblem
  fam = wt.get_family("qmatmul")
  p = QMatmulProblem(m=64, n=4096, k=4096, dtype="float8_e4m3fn",
                     w_dtype="float8_e4m3fn", w_layout="nk")
  h100 = wt.get_hardware("h100")
  backend, config = op_lib.choose(fam, p, {"backend": "mosaic"}, hw=h100)
  assert config == backend.heuristic(p, h100)
  x8, xs = wt.quantize_rows(jnp.ones((4, 256)))
  w8, s8 = wt.quantize_weight(jnp.ones((256, 128)), "float8_e4m3fn", layout="nk")
  with pytest.raises(ValueError, match="cannot run here: no GPU"):
    wt.quantized_matmul(x8, w8, s8, x_scales=xs, w_layout="nk",
                        config={"backend": "mosaic"})


def test_numpy_integers_are_config_fields():
  """Configs read from NumPy arrays or tables: NumPy integers are stored as
  Python ints; a 192-row Mosaic tile is named among the allowed rows."""
  import numpy as np
  import wavetune_jax as wt
  c = wt.TritonRaggedDotConfig(block_m=np.int32(16), block_n=np.int64(64))
  assert (c.block_m, c.block_n) == (16, 64) and type(c.block_m) is int
  assert c == wt.TritonRaggedDotConfig(block_m=16, block_n=64)
  assert type(wt.MosaicMatmulConfig(block_m=np.int64(64)).block_m) is int
  with pytest.raises(ValueError, match=r"must be an int"):
    wt.TritonRaggedDotConfig(block_m=np.float32(16))
  with pytest.raises(ValueError, match=r"must be an int"):
    wt.TritonRaggedDotConfig(block_m=np.bool_(True))
  with pytest.raises(ValueError, match=r"block_m=96 must be one of \(64, 128, 192, 256\)"):
    wt.MosaicRaggedDotConfig(block_m=96)
  spec = wt.get_family("ragged_dot")
  v = spec.variant_from_dict({"backend": "triton", "block_m": np.int64(16),
                              "block_n": np.int64(64), "block_k": np.int64(32),
                              "num_warps": np.int32(4), "num_stages": np.int32(3)})
  assert all(type(x) is int for _, x in v[1:])
