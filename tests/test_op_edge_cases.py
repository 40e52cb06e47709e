"""The public ops at their edges, on every backend that runs on a CPU.

Invalid group sizes (negative, summing past M, near int32's limit), integer
arguments of every width (uint32, int64, uint64 clipped, not wrapped to
int32), NaN and Inf in the inputs (propagated as the float32 reference
does, except past a sequence's length), ``jax_enable_x64`` and ``jax.vmap``.
Kernels run in Pallas interpret mode; references are float32 NumPy or
:func:`attention_reference`.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wavetune_jax as wt
from pallas_kernels.attention.reference import attention_reference
from pallas_kernels.decode.triton import TritonDecodeConfig
from pallas_kernels.ragged_dot.reference import ragged_dot_reference
from pallas_kernels.ragged_dot.worklist import batch_rows, clip_sizes

pytestmark = pytest.mark.filterwarnings("ignore:wavetune_jax. no GPU")

BACKENDS = ("xla", "triton")
I32_MAX = 2**31 - 1


def _rng(seed=0):
  return np.random.default_rng(seed)


def _ragged_ref(lhs, rhs, sizes):
  """The documented contract in NumPy: negative sizes count as 0, groups
  end at row M, rows past the groups are 0."""
  lhs, rhs = np.asarray(lhs, np.float32), np.asarray(rhs, np.float32)
  m = lhs.shape[0]
  out = np.zeros((m, rhs.shape[2]), np.float32)
  start = 0
  for g, s in enumerate(np.asarray(sizes).tolist()):
    s = min(max(int(s), 0), m - start)
    out[start:start + s] = lhs[start:start + s] @ rhs[g]
    start += s
  return out


def _ragged_operands(m=21, g=3, k=16, n=8, seed=0):
  rng = _rng(seed)
  return (rng.standard_normal((m, k)).astype(np.float32),
          rng.standard_normal((g, k, n)).astype(np.float32))


def _close(y, want, tol=1e-4):
  y, want = np.asarray(y, np.float32), np.asarray(want, np.float32)
  np.testing.assert_allclose(y, want, rtol=tol, atol=tol * max(1.0, np.abs(want).max()))


# --- ragged_dot group sizes --------------------------------------------------------

SIZES = [
    [-4, 10, 3],                 # a negative size counts as 0
    [5, -1, 30],                 # past M: clipped
    [I32_MAX, I32_MAX, 5],       # the running sum would overflow int32
    [10, I32_MAX - 5, 7],
    [-I32_MAX - 1, 4, -7],
    [0, 0, 0],                   # every row is past the groups: zeros
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sizes", SIZES)
def test_ragged_dot_invalid_sizes_follow_the_contract(backend, sizes):
  lhs, rhs = _ragged_operands()
  y = wt.ragged_dot(lhs, rhs, jnp.asarray(sizes, jnp.int32), config={"backend": backend})
  _close(y, _ragged_ref(lhs, rhs, sizes))


@pytest.mark.parametrize("sizes", SIZES)
def test_ragged_dot_reference_follows_the_contract(sizes):
  lhs, rhs = _ragged_operands()
  gs = jnp.asarray(sizes, jnp.int32)
  want = _ragged_ref(lhs, rhs, sizes)
  _close(ragged_dot_reference(lhs, rhs, gs, jnp.float32), want)
  _close(ragged_dot_reference(lhs, rhs, gs, jnp.float32, block_rows=8), want)


@pytest.mark.parametrize("sizes", SIZES)
def test_xla_on_a_gpu_takes_each_size_clipped_and_nothing_more(sizes, monkeypatch):
  """Where XLA's ragged dot is its dense form (a GPU with a cuDNN older than
  9.22), the op hands it the sizes each clipped to ``[0, M]`` (an
  elementwise op XLA fuses into its consumer), no running sum in front:
  sizes summing past M are the groups cut at row M all the same (the CPU's
  lax.ragged_dot stands in for the GPU's dense form here; the GPU's own on
  the same sizes: ``benchmarks/ragged_dot_xla_sizes.py``). Elsewhere the
  running sum is saturated first."""
  from wavetune_jax.families.ragged_dot import xla as xla_backend
  from wavetune_jax.families.ragged_dot.problem import RaggedDotProblem
  lhs, rhs = _ragged_operands()
  p = RaggedDotProblem(m=lhs.shape[0], g=rhs.shape[0], k=lhs.shape[1], n=rhs.shape[2],
                       dtype="float32")
  gs = jnp.asarray(sizes, jnp.int32)
  bound = wt.get_family("ragged_dot").bind(lhs, rhs, gs)
  clipped = bound.arrays[2]
  np.testing.assert_array_equal(clipped, np.clip(np.asarray(sizes, np.int64), 0, p.m))
  backend = xla_backend.XlaRaggedDot()
  for below, cumsums in ((True, False), (False, True), (None, True)):
    monkeypatch.setattr(xla_backend, "cudnn_below", lambda bound, below=below: below)
    run = functools.partial(backend.run, p, xla_backend.XlaRaggedDotConfig(), interpret=False)
    _close(run(lhs, rhs, clipped), _ragged_ref(lhs, rhs, sizes))
    text = str(jax.make_jaxpr(run)(lhs, rhs, clipped))
    assert ("cumsum" in text or "reduce_sum" in text or "min" in text) == cumsums, text


def test_clip_sizes_saturates_without_overflow():
  m = 2**30 + 3  # partial sums of sizes <= m still pass int32 as a + b
  got = np.asarray(clip_sizes(jnp.asarray([m, m, -1, m], jnp.int32), m))
  np.testing.assert_array_equal(got, [m, 0, 0, 0])
  got = np.asarray(clip_sizes(jnp.asarray([3, 2**30, 2**30, 5], jnp.int32), m))
  np.testing.assert_array_equal(got, [3, 2**30, 0, 0])
  assert got.dtype == np.int32


WIDE_SIZES = [
    np.array([4294967295, 3, 2], np.uint32),   # -1 as int32
    np.array([2**32 + 4, 3, 2], np.int64),     # 4 as int32
    np.array([2**64 - 1, 3, 2], np.uint64),
    np.array([7, 2**33, 1], np.int64),
    np.array([-128, 100, 127], np.int8),
    np.array([255, 3, 2], np.uint8),
    np.array([-32768, 9, 4], np.int16),
    [2**40, 1, 2],                             # a Python list
    [2**63, 1, 2],                             # past int64 (NumPy: floats)
    [2**64, -(2**70), 5],                      # (NumPy: objects)
    (7, 2**100, 1),                            # a tuple
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sizes", WIDE_SIZES, ids=lambda s: str(getattr(s, "dtype", "list")))
def test_ragged_dot_sizes_of_every_integer_width_are_clipped(backend, sizes):
  lhs, rhs = _ragged_operands()
  y = wt.ragged_dot(lhs, rhs, sizes, config={"backend": backend})
  _close(y, _ragged_ref(lhs, rhs, sizes))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["int4", "uint4", "int2"])
def test_ragged_dot_sizes_of_sub_byte_integers(backend, dtype):
  """JAX's 4- and 2-bit integers are integers too (NumPy's iinfo knows none)."""
  lhs, rhs = _ragged_operands()
  info = jnp.iinfo(dtype)
  sizes = [info.max, info.min, 1]
  y = wt.ragged_dot(lhs, rhs, jnp.asarray(sizes, dtype), config={"backend": backend})
  _close(y, _ragged_ref(lhs, rhs, sizes))


def test_sequences_of_sizes_with_booleans_or_traced_values_are_clear_errors():
  lhs, rhs = _ragged_operands()
  with pytest.raises(ValueError, match="boolean"):
    wt.ragged_dot(lhs, rhs, [True, 2, 3])
  with pytest.raises(ValueError, match="sequence of traced values.*jnp.stack"):
    jax.jit(lambda a, b, c: wt.ragged_dot(lhs, rhs, [a, b, c]))(3, 1, 2)
  # one array of traced values is fine
  _close(jax.jit(lambda a, b, c: wt.ragged_dot(lhs, rhs, jnp.stack([a, b, c])))(3, 1, 2),
         _ragged_ref(lhs, rhs, [3, 1, 2]))


@pytest.mark.parametrize("backend", BACKENDS)
def test_ragged_dot_sizes_as_jax_uint32_and_x64_arrays(backend):
  lhs, rhs = _ragged_operands()
  cfg = {"backend": backend}
  sizes = [4294967295, 3, 2]
  _close(wt.ragged_dot(lhs, rhs, jnp.asarray(sizes, jnp.uint32), config=cfg),
         _ragged_ref(lhs, rhs, sizes))
  _close(jax.jit(lambda a, b, s: wt.ragged_dot(a, b, s, config=cfg))(
      lhs, rhs, jnp.asarray(sizes, jnp.uint32)), _ragged_ref(lhs, rhs, sizes))
  with jax.enable_x64(True):
    for sizes, dt in [([2**32 + 4, 3, 2], jnp.int64), ([2**64 - 1, 1, 2], jnp.uint64),
                      ([3, -2**40, 9], jnp.int64)]:
      gs = jnp.asarray(np.asarray(sizes, dt))
      assert gs.dtype == dt
      _close(wt.ragged_dot(lhs, rhs, gs, config=cfg), _ragged_ref(lhs, rhs, sizes))


@pytest.mark.parametrize("bad", [np.array([True, False, True]), jnp.array([1.0, 2.0, 3.0])])
def test_ragged_dot_rejects_non_integer_sizes(bad):
  lhs, rhs = _ragged_operands()
  with pytest.raises(ValueError, match="group_sizes must be integers"):
    wt.ragged_dot(lhs, rhs, bad)


# --- kv_lengths of every integer width -----------------------------------------------

def _qkv(b=2, q_len=5, hq=4, hkv=2, s=37, d=32, seed=0, dtype=jnp.bfloat16):
  rng = _rng(seed)
  return tuple(jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype)
               for shape in ((b, q_len, hq, d), (b, s, hkv, d), (b, s, hkv, d)))


WIDE_LENGTHS = [  # as given, and what they mean for kv_len 37
    (np.array([4294967295, 20], np.uint32), [37, 20]),
    (np.array([2**32 + 4, 20], np.int64), [37, 20]),
    (np.array([2**64 - 1, 2], np.uint64), [37, 2]),
    (np.array([-5, 100], np.int8), [0, 37]),
    (np.array([-2**40, 2**40], np.int64), [0, 37]),
    ([2**35, 9], [37, 9]),
]


def _attention_ref(q, k, v, lengths, *, align="bottom_right"):
  return attention_reference(q, k, v, causal=True, kv_lengths=jnp.asarray(lengths, jnp.int32),
                             causal_align=align, out_dtype=jnp.float32)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("lengths,means", WIDE_LENGTHS,
                         ids=lambda x: str(getattr(x, "dtype", "")))
def test_kv_lengths_of_every_integer_width_are_clipped(backend, lengths, means):
  q, k, v = _qkv()
  cfg = {"backend": backend}
  y = wt.attention(q, k, v, kv_lengths=lengths, causal_align="bottom_right", config=cfg)
  _close(y, _attention_ref(q, k, v, means), 2e-2)
  y = wt.decode_attention(q[:, :2], k, v, kv_lengths=lengths, config=cfg)
  _close(y, _attention_ref(q[:, :2], k, v, means), 2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_kv_lengths_as_jax_uint32_and_x64_arrays(backend):
  q, k, v = _qkv()
  cfg = {"backend": backend}
  want = _attention_ref(q[:, :1], k, v, [37, 20])
  y = wt.decode_attention(q[:, :1], k, v, kv_lengths=jnp.asarray([4294967295, 20], jnp.uint32),
                          config=cfg)
  _close(y, want, 2e-2)
  with jax.enable_x64(True):
    for lens, dt in [([2**32 + 4, 20], jnp.int64), ([2**64 - 1, 20], jnp.uint64)]:
      lens = jnp.asarray(np.asarray(lens, dt))
      assert lens.dtype == dt
      _close(wt.decode_attention(q[:, :1], k, v, kv_lengths=lens, config=cfg), want, 2e-2)
      _close(wt.attention(q[:, :1], k, v, kv_lengths=lens, causal_align="bottom_right",
                          config=cfg), want, 2e-2)


def test_kv_lengths_reject_booleans():
  q, k, v = _qkv()
  for op in (wt.attention, wt.decode_attention):
    with pytest.raises(ValueError, match="kv_lengths must be integers"):
      op(q[:, :1], k, v, kv_lengths=np.array([True, False]))


# --- NaN and Inf -----------------------------------------------------------------------

def _nan_cases(b, q_len, hq, hkv, s, d, lengths):
  """(name, q, k, v, kv_lengths): NaN or Inf where the reference sees it."""
  q, k, v = (np.asarray(a, np.float32) for a in _qkv(b, q_len, hq, hkv, s, d, seed=3))
  out = []
  qn = q.copy()
  qn[0, -1, 1, 3] = np.nan  # one query
  out.append(("nan_query", qn, k, v, lengths))
  kn = k.copy()
  kn[1, 4, 0, 5] = np.nan   # one valid key, seen by every query
  out.append(("nan_key", q, kn, v, lengths))
  ki = k.copy()
  ki[1, 4, 1, :] = np.inf   # +-inf scores: NaN where a query sees it
  out.append(("inf_key", q, ki, v, lengths))
  vn = v.copy()
  vn[0, 2, 1, 7] = np.nan
  out.append(("nan_value", q, k, vn, lengths))
  out.append(("nan_cache", q, np.full_like(k, np.nan), v, None))  # no lengths: all NaN
  return [(name, *(jnp.asarray(a, jnp.bfloat16) for a in (qq, kk, vv)), lens)
          for name, qq, kk, vv, lens in out]


def _same_nans(y, ref, what: str, tol=2e-2):
  y, ref = np.asarray(y, np.float32), np.asarray(ref, np.float32)
  assert np.isnan(ref).any(), what
  np.testing.assert_array_equal(np.isnan(y), np.isnan(ref), err_msg=what)
  ok = np.isfinite(ref)
  np.testing.assert_allclose(y[ok], ref[ok], rtol=tol, atol=tol, err_msg=what)


@pytest.mark.parametrize("splits,q_len", [(1, 1), (3, 3), (3, 1)])
def test_decode_nan_propagates_as_in_the_reference(splits, q_len):
  lengths = np.array([60, 41], np.int32)
  cfg = TritonDecodeConfig(block_h=16, block_k=16, num_splits=splits)
  for name, q, k, v, lens in _nan_cases(2, q_len, 8, 2, 64, 32, lengths):
    ref = attention_reference(q, k, v, causal=True, kv_lengths=lens,
                              causal_align="bottom_right", out_dtype=jnp.float32)
    for config in (cfg, {"backend": "xla"}):
      y = wt.decode_attention(q, k, v, kv_lengths=lens, config=config)
      _same_nans(y, ref, f"{name} {config}")


@pytest.mark.parametrize("splits", [1, 3])
def test_decode_nan_past_the_lengths_never_reaches_the_output(splits):
  q, k, v = _qkv(2, 2, 8, 2, 64, 32, seed=5)
  lengths = jnp.asarray([30, 47], jnp.int32)
  past = jnp.arange(64)[None, :, None, None] >= lengths[:, None, None, None]
  k = jnp.where(past, jnp.nan, k).astype(k.dtype)
  v = jnp.where(past, jnp.inf, v).astype(v.dtype)
  cfg = TritonDecodeConfig(block_h=16, block_k=16, num_splits=splits)
  y = np.asarray(wt.decode_attention(q, k, v, kv_lengths=lengths, config=cfg), np.float32)
  assert np.all(np.isfinite(y))
  _close(y, _attention_ref(q, k, v, lengths), 2e-2)


@pytest.mark.parametrize("causal_align", ["top_left", "bottom_right"])
def test_attention_nan_propagates_as_in_the_reference(causal_align):
  lengths = np.array([70, 41], np.int32)
  cfg = {"backend": "triton", "block_q": 16, "block_k": 16}
  for name, q, k, v, lens in _nan_cases(2, 24, 4, 2, 70, 32, lengths):
    ref = attention_reference(q, k, v, causal=True, kv_lengths=lens,
                              causal_align=causal_align, out_dtype=jnp.float32)
    y = wt.attention(q, k, v, kv_lengths=lens, causal_align=causal_align, config=cfg)
    _same_nans(y, ref, name)


# --- jax_enable_x64 --------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_every_op_runs_with_x64(backend):
  cfg = {"backend": backend}
  with jax.enable_x64(True):
    rng = _rng(7)
    x = rng.standard_normal((20, 48)).astype(np.float32)
    w = rng.standard_normal((48, 24)).astype(np.float32)
    _close(wt.matmul(x, w, config=cfg), x @ w)
    lhs, rhs = _ragged_operands()
    sizes = jnp.asarray([5, 9, 4])  # int64 here
    assert sizes.dtype == jnp.int64
    _close(wt.ragged_dot(lhs, rhs, sizes, config=cfg), _ragged_ref(lhs, rhs, [5, 9, 4]))
    q, k, v = _qkv(s=45)
    lens = jnp.asarray([45, 17])
    for align, lengths in [("top_left", None), ("bottom_right", lens)]:
      ref = attention_reference(q, k, v, causal=True, kv_lengths=lengths, causal_align=align,
                                out_dtype=jnp.float32)
      y = wt.attention(q, k, v, kv_lengths=lengths, causal_align=align, config=cfg)
      assert y.dtype == q.dtype
      _close(y, ref, 2e-2)
    configs = [cfg] if backend == "xla" else [
        TritonDecodeConfig(block_k=16, num_splits=1), TritonDecodeConfig(block_k=16, num_splits=3)]
    for c in configs:
      for lengths in (None, lens):
        ref = attention_reference(q[:, :2], k, v, causal=True, kv_lengths=lengths,
                                  causal_align="bottom_right", out_dtype=jnp.float32)
        _close(wt.decode_attention(q[:, :2], k, v, kv_lengths=lengths, config=c), ref, 2e-2)


# --- jax.vmap --------------------------------------------------------------------------

def test_batch_rows_is_a_permutation_in_group_order():
  sizes = jnp.asarray([[2, 0, 3], [1, 4, 0]], jnp.int32)
  dest, flat = batch_rows(sizes, 6, shared_groups=True)
  # group 0: rows 0, 1 of batch 0 then row 0 of batch 1; group 1: batch 1's
  # rows 1-4; group 2: batch 0's rows 2-4; the tails (row 5 of each) last.
  np.testing.assert_array_equal(dest, [[0, 1, 7, 8, 9, 10], [2, 3, 4, 5, 6, 11]])
  np.testing.assert_array_equal(flat, [3, 4, 3])
  dest, flat = batch_rows(sizes, 6, shared_groups=False)
  np.testing.assert_array_equal(dest, [[0, 1, 2, 3, 4, 10], [5, 6, 7, 8, 9, 11]])
  np.testing.assert_array_equal(flat, [2, 0, 3, 1, 4, 0])


@pytest.mark.parametrize("backend,in_axes", [
    (b, ax) for ax in [(0, None, 0), (0, 0, 0), (None, 0, 0), (None, None, 0), (0, 0, None),
                       (1, None, 0)]
    for b in BACKENDS if b == "xla" or ax in ((0, None, 0), (None, 0, 0), (1, None, 0))])
def test_ragged_dot_vmap(backend, in_axes):
  b, (m, k, n, g) = 3, (13, 16, 8, 4)
  rng = _rng(11)
  lhs = rng.standard_normal((b, m, k)).astype(np.float32)
  rhs = rng.standard_normal((b, g, k, n)).astype(np.float32)
  sizes = np.array([[3, -2, 4, 20], [0, 0, 0, 0], [5, 5, 1, 1]], np.int32)
  args = [a if ax is not None else a[0] for a, ax in zip((lhs, rhs, sizes), in_axes)]
  want = np.stack([_ragged_ref(*(a[i] if ax is not None else a
                                 for a, ax in zip(args, in_axes))) for i in range(b)])
  if in_axes[0] == 1:
    args[0] = np.swapaxes(args[0], 0, 1)
  f = functools.partial(wt.ragged_dot, config={"backend": backend})
  _close(jax.vmap(f, in_axes=in_axes)(*args), want)
  _close(jax.jit(jax.vmap(f, in_axes=in_axes))(*args), want)
  _close(jax.vmap(jax.jit(f), in_axes=in_axes)(*args), want)  # the jaxpr batched later


def test_ragged_dot_nested_vmap_and_gradient_error():
  lhs, rhs = _ragged_operands(m=9, g=3)
  sizes = np.array([[[2, 3, 4], [9, 0, 0]], [[0, 0, 1], [-1, 20, 1]]], np.int32)
  lhss = np.stack([np.stack([lhs, lhs[::-1]])] * 2)
  y = jax.vmap(jax.vmap(lambda a, s: wt.ragged_dot(a, rhs, s)))(lhss, sizes)
  want = np.stack([np.stack([_ragged_ref(lhss[i, j], rhs, sizes[i, j]) for j in range(2)])
                   for i in range(2)])
  _close(y, want)
  with pytest.raises(NotImplementedError, match="forward only"):
    jax.grad(lambda a: wt.ragged_dot(a, rhs, sizes[0, 0]).sum())(lhs)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_of_matmul_attention_and_decode(backend):
  cfg = {"backend": backend}
  rng = _rng(13)
  x = rng.standard_normal((2, 20, 32)).astype(np.float32)
  w = rng.standard_normal((2, 32, 24)).astype(np.float32)
  _close(jax.vmap(lambda a: wt.matmul(a, w[0], config=cfg))(x), x @ w[0])
  _close(jax.vmap(lambda a, b: wt.matmul(a, b, config=cfg))(x, w), x @ w)
  q, k, v = _qkv(2, 6, 4, 2, 33, 32, seed=2)
  lens = jnp.asarray([[33], [9]], jnp.int32)
  qs, ks, vs = q[:, None], k[:, None], v[:, None]  # the vmapped axis outside the batch
  y = jax.vmap(lambda a, b, c: wt.attention(a, b, c, config=cfg))(qs, ks, vs)[:, 0]
  _close(y, attention_reference(q, k, v, causal=True, out_dtype=jnp.float32), 2e-2)
  y = jax.vmap(lambda a, b, c, n: wt.attention(a, b, c, kv_lengths=n, causal_align="bottom_right",
                                               config=cfg))(qs, ks, vs, lens)[:, 0]
  _close(y, _attention_ref(q, k, v, lens[:, 0]), 2e-2)
  y = jax.vmap(lambda a, b, c, n: wt.decode_attention(a, b, c, kv_lengths=n, config=cfg))(
      qs[:, :, :2], ks, vs, lens)[:, 0]
  _close(y, _attention_ref(q[:, :2], k, v, lens[:, 0]), 2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_vmap_folds_into_the_batch(backend):
  """``jax.vmap`` of attention and decode runs one call of ``V * B``
  sequences (JAX's cuDNN attention cannot batch sequence lengths): the same
  as each instance on its own, with lengths, a paged cache (one pool shared,
  or a pool per instance, with -1 entries), unbatched operands broadcast,
  and per-instance sinks (one call each)."""
  from wavetune_jax.families.decode.problem import DecodeProblem  # noqa: F401
  cfg = {"backend": backend}
  rng = _rng(21)
  V, B, hq, hk, d, L = 3, 2, 4, 2, 32, 40
  q = jnp.asarray(rng.standard_normal((V, B, 1, hq, d)), jnp.bfloat16)
  k = jnp.asarray(rng.standard_normal((V, B, L, hk, d)), jnp.bfloat16)
  v = jnp.asarray(rng.standard_normal((V, B, L, hk, d)), jnp.bfloat16)
  lens = jnp.asarray(rng.integers(1, L + 1, (V, B)), jnp.int32)
  sinks = jnp.asarray(rng.standard_normal((V, hq)), jnp.float32)

  def each(f, *xs):
    return jnp.stack([f(*(x[i] for x in xs)) for i in range(V)])

  dec = lambda a, b, c, n: wt.decode_attention(a, b, c, kv_lengths=n, config=cfg)  # noqa: E731
  _close(jax.vmap(dec)(q, k, v, lens), each(dec, q, k, v, lens), 1e-2)
  # An unbatched cache, broadcast.
  _close(jax.vmap(dec, in_axes=(0, None, None, 0))(q, k[0], v[0], lens),
         each(lambda a, n: dec(a, k[0], v[0], n), q, lens), 1e-2)
  att = lambda a, b, c, n: wt.attention(a, b, c, kv_lengths=n, config=cfg)  # noqa: E731
  qa = jnp.asarray(rng.standard_normal((V, B, 5, hq, d)), jnp.bfloat16)
  _close(jax.vmap(att)(qa, k, v, lens), each(att, qa, k, v, lens), 1e-2)
  if backend == "xla":   # sinks: the xla backend runs them (Triton has none)
    sk = lambda a, b, c, n, s: wt.decode_attention(a, b, c, kv_lengths=n, sinks=s,  # noqa: E731
                                                   config=cfg)
    _close(jax.vmap(sk)(q, k, v, lens, sinks), each(sk, q, k, v, lens, sinks), 1e-2)
  # Paged: pages of 8, a pool per instance and one shared pool.
  page, pages = 8, L // 8
  kp = k.reshape(V, B * pages, page, hk, d)
  vp = v.reshape(V, B * pages, page, hk, d)
  table = jnp.broadcast_to(jnp.arange(B * pages, dtype=jnp.int32).reshape(B, pages),
                           (V, B, pages))
  table = table.at[:, 0, 0].set(jnp.where(lens[:, 0] > 8, -1, 0))  # a freed page left of a window
  pg = lambda a, b, c, n, t: wt.decode_attention(  # noqa: E731
      a, b, c, kv_lengths=n, block_tables=t, local_window_size=(7, 0), config=cfg)
  if backend == "xla":   # the window: xla (and Mosaic on a GPU) run it
    _close(jax.vmap(pg)(q, kp, vp, lens, table), each(pg, q, kp, vp, lens, table), 1e-2)
    _close(jax.vmap(pg, in_axes=(0, None, None, 0, 0))(q, kp[1], vp[1], lens, table),
           each(lambda a, n, t: pg(a, kp[1], vp[1], n, t), q, lens, table), 1e-2)


@pytest.mark.parametrize("config", [{"backend": "nope"}, {"backend": "triton", "block_z": 4},
                                    "not a config"])
def test_a_bad_config_is_an_error_on_empty_arrays_too(config):
  """Empty operands compute nothing, but a config naming no backend or with
  wrong fields is the same error as where there is work."""
  with pytest.raises(ValueError):
    wt.ragged_dot(jnp.ones((0, 4)), jnp.ones((2, 4, 8)), jnp.zeros((2,), jnp.int32),
                  config=config)
  with pytest.raises(ValueError):
    wt.matmul(jnp.ones((0, 4)), jnp.ones((4, 8)), config=config)
  # a good one, or the backend's name alone, still gives the empty result
  assert wt.matmul(jnp.ones((0, 4)), jnp.ones((4, 8)), config={"backend": "xla"}).shape == (0, 8)
