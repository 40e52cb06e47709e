"""wt.autotune: what it replaces, what it keeps (and why), the numbers it
gives against the untransformed function, and how it composes with JAX's
transformations."""

import threading
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import wavetune_jax as wt

warnings.filterwarnings("ignore", message=".*no GPU.*")
warnings.filterwarnings("ignore", message=".*inside jax.shard_map on a CPU.*")

KEYS = jax.random.split(jax.random.key(7), 8)
X = jax.random.normal(KEYS[0], (2, 16, 64), jnp.bfloat16)
W = (jax.random.normal(KEYS[1], (64, 128), jnp.float32) / 8).astype(jnp.bfloat16)


def rnd(i, shape, scale=1.0, dtype=jnp.bfloat16):
  return (jax.random.normal(KEYS[i], shape, jnp.float32) * scale).astype(dtype)


SELECTOR_TESTS = {"test_decoder_block_replaced_and_within_tolerance"}


@pytest.fixture(autouse=True)
def _xla_backends(request):
  """XLA's paths of the ops, except where a test asks for the selector's
  choice (Pallas in interpret mode is slow; the kernels are checked in their
  own tests; here, that each call maps onto an op with its semantics)."""
  if request.node.name in SELECTOR_TESTS:
    yield
    return
  with wt.use_config("attention", wt.XlaAttentionConfig()), \
      wt.use_config("decode", wt.XlaDecodeConfig()), \
      wt.use_config("ragged_dot", wt.XlaRaggedDotConfig()), \
      wt.use_config("matmul", wt.XlaMatmulConfig()):
    yield


def err(a, b):
  return float(jnp.max(jnp.abs(jnp.asarray(a, jnp.float32) - jnp.asarray(b, jnp.float32))))


def assert_close(out, ref, tol=0.02):
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(ref)):
    assert a.shape == b.shape and a.dtype == b.dtype, (a.shape, a.dtype, b.shape, b.dtype)
    scale = max(1.0, float(jnp.max(jnp.abs(b.astype(jnp.float32)))))
    assert err(a, b) <= tol * scale, (err(a, b), scale)


def run(f, *args, jit=True, masks=False):
  t = wt.autotune(f, masks=masks)
  out = (jax.jit(t) if jit else t)(*args)
  return out, t.sites


def block(x, wq, wkv, wo, w13, w2, experts, sizes):
  """A small decoder block the way model code writes it."""
  b, t, d = x.shape
  q = jnp.einsum("btd,dnh->btnh", x, wq)
  kv = jnp.einsum("btd,dkh->btkh", x, wkv)
  a = jax.nn.dot_product_attention(q, kv[:, :, :2], kv[:, :, 2:], is_causal=True)
  h = x + jnp.einsum("btnh,nhd->btd", a, wo)
  g = jnp.dot(h, w13)
  h = h + jnp.dot(jax.nn.silu(g[..., :128]) * g[..., 128:], w2)
  moe = jax.lax.ragged_dot(h.reshape(b * t, d), experts, sizes)
  return h + moe.reshape(b, t, d)


def block_args():
  return (X, rnd(1, (64, 4, 16), 0.125), rnd(2, (64, 4, 16), 0.125), rnd(3, (4, 16, 64), 0.125),
          rnd(4, (64, 256), 0.125), rnd(5, (128, 64), 0.09), rnd(6, (4, 64, 64), 0.125),
          jnp.array([5, 11, 0, 16], jnp.int32))


def test_decoder_block_replaced_and_within_tolerance():
  args = block_args()
  out, sites = run(block, *args)
  ref = jax.jit(block)(*args)
  assert_close(out, ref)
  replaced = sorted(s.op for s in sites if s.replaced)
  assert replaced == ["attention", "matmul", "matmul", "matmul", "matmul", "matmul",
                      "ragged_dot"], sites
  assert all(s.backend for s in sites if s.replaced)
  assert not [s for s in sites if not s.replaced], sites


def test_report_prints_every_site(capsys):
  t = wt.autotune(block, report=True)
  jax.jit(t)(*block_args())
  text = capsys.readouterr().out
  assert "wt.autotune: 7 of 7 calls replaced" in text
  assert "test_autotune.py" in text and "ragged_dot" in text and "attention" in text
  assert str(t.sites).splitlines()[0] == "wt.autotune: 7 of 7 calls replaced"


@pytest.mark.parametrize("name, f, reason", [
    ("float32", lambda x, w: x.astype(jnp.float32) @ w.astype(jnp.float32), "dtype float32"),
    ("precision", lambda x, w: jnp.dot(x, w, precision="highest"), "precision"),
    ("batched", lambda x, w: jnp.einsum("btd,bsd->bts", x, x), "batch dimensions"),
    ("transposed", lambda x, w: x @ w.T.T, "transposed"),
    ("weight first", lambda x, w: jax.lax.dot_general(w, x, (((0,), (2,)), ((), ()))),
     "left operand"),
    ("lax transposed", lambda x, w: jax.lax.dot_general(x, w.T, (((2,), (1,)), ((), ()))),
     "first ones"),
    ("int8", lambda x, w: jax.lax.dot_general(x.astype(jnp.int8), w.astype(jnp.int8),
                                              (((2,), (0,)), ((), ())),
                                              preferred_element_type=jnp.int32), "dtype int8"),
])
def test_gemms_kept_with_their_reason(name, f, reason):
  out, sites = run(f, X, W)
  assert_close(out, jax.jit(f)(X, W), tol=0)
  kept = [s for s in sites if not s.replaced]
  assert kept and reason in kept[0].reason, sites


def test_gemm_forms_replaced():
  forms = {
      "matmul": lambda x, w: x @ w,
      "dot": lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.float32),
      "einsum split N": lambda x, w: jnp.einsum("btd,dnh->btnh", x, w.reshape(64, 4, 32)),
      "einsum split K": lambda x, w: jnp.einsum("btnh,nhd->btd", x.reshape(2, 16, 4, 16),
                                                w.reshape(4, 16, 128)),
      "dot_general": lambda x, w: jax.lax.dot_general(x, w, (((2,), (0,)), ((), ()))),
      "contracted in reverse order": lambda x, w: jax.lax.dot_general(
          x.reshape(2, 16, 4, 16), w.reshape(4, 16, 128), (((3, 2), (1, 0)), ((), ()))),
  }
  for name, f in forms.items():
    out, sites = run(f, X, W)
    assert_close(out, jax.jit(f)(X, W))
    assert [s.op for s in sites if s.replaced] == ["matmul"], (name, sites)


@pytest.mark.parametrize("kind", ["vmap", "scan", "cond", "while", "remat", "inner jit",
                                  "custom_jvp", "closure", "eager"])
def test_composes_with_transformations(kind):
  def gemm(x, w):
    return jnp.tanh(x @ w)

  cases = {
      "vmap": lambda x, w: jax.vmap(gemm, in_axes=(0, None))(x, w),
      "scan": lambda x, w: jax.lax.scan(lambda c, _: (gemm(c, w[:, :64]), None), x,
                                        length=2)[0],
      "cond": lambda x, w: jax.lax.cond(x[0, 0, 0] > 0, gemm, lambda a, b: -gemm(a, b), x, w),
      "while": lambda x, w: jax.lax.fori_loop(0, 2, lambda i, c: gemm(c, w[:, :64]), x),
      "remat": jax.checkpoint(gemm),
      "inner jit": lambda x, w: jax.jit(gemm)(x, w),
      "custom_jvp": lambda x, w: jax.nn.gelu(x @ w),  # gelu/relu carry custom rules
      "closure": lambda x, w: gemm(x, W),
      "eager": gemm,
  }
  f = cases[kind]
  out, sites = run(f, X, W, jit=kind != "eager")
  assert_close(out, jax.jit(f)(X, W))
  assert sites and all(s.replaced for s in sites), sites


def test_static_argnums_and_donation():
  f = jax.jit(wt.autotune(lambda x, w, scale, act: act(x @ w) * scale), static_argnums=(2, 3),
              donate_argnums=0)
  out = f(X + 0, W, 3.0, jax.nn.relu)
  assert_close(out, jax.nn.relu(X @ W) * 3.0)
  # The README's `step.sites` on the jitted function: the last trace's calls.
  assert [s.op for s in f.sites] == ["matmul"] and f.sites[0].replaced


def test_kwargs_and_pytrees():
  def f(params, x, *, bias):
    return {"y": x @ params["w"] + bias, "n": params["n"]}

  params = {"w": W, "n": 3}
  out = jax.jit(wt.autotune(f))(params, X, bias=jnp.ones((128,), jnp.bfloat16))
  assert_close(out["y"], X @ W + 1)
  assert int(out["n"]) == 3


def test_shard_map_both_ways():
  mesh = jax.make_mesh((1,), ("a",), axis_types=(jax.sharding.AxisType.Auto,))

  def gemm(x, w):
    return x @ w

  inner = jax.jit(jax.shard_map(wt.autotune(gemm), mesh=mesh, in_specs=(P("a"), P()),
                                out_specs=P("a")))
  assert_close(inner(X, W), X @ W)
  outer = wt.autotune(lambda x, w: jax.shard_map(gemm, mesh=mesh, in_specs=(P("a"), P()),
                                                 out_specs=P("a"))(x, w))
  assert_close(jax.jit(outer)(X, W), X @ W)
  assert [s.replaced for s in outer.sites] == [True]


def test_gradients_are_the_original_ones():
  args = block_args()

  def loss(x, *rest):
    return block(x, *rest).astype(jnp.float32).sum()

  g = jax.jit(jax.grad(wt.autotune(loss)))(*args)
  g0 = jax.jit(jax.grad(loss))(*args)
  assert err(g, g0) == 0.0  # nothing is replaced under differentiation
  # A closure over the differentiated value: the replaced calls carry the
  # original derivative rule.
  gw = jax.grad(lambda w: wt.autotune(lambda x: (x @ w).astype(jnp.float32).sum())(X))(W)
  gw0 = jax.grad(lambda w: (X @ w).astype(jnp.float32).sum())(W)
  assert_close(gw, gw0)
  # A training step (the gradient inside): its GEMMs are plain GEMMs.
  step = wt.autotune(jax.grad(lambda w, x: (x @ w).astype(jnp.float32).sum()))
  assert_close(jax.jit(step)(W, X), jax.grad(lambda w, x: (x @ w).astype(jnp.float32).sum())(W, X))


def attn_case(q_len, kv_len, q_heads=4, kv_heads=2, head_dim=64):
  q = rnd(0, (2, q_len, q_heads, head_dim))
  k = rnd(1, (2, kv_len, kv_heads, head_dim))
  v = rnd(2, (2, kv_len, kv_heads, head_dim))
  return q, k, v


@pytest.mark.parametrize("form", ["causal", "decode", "long noncausal", "rank3", "cudnn name",
                                  "positional"])
def test_attention_forms_replaced(form):
  lengths = jnp.array([70, 13], jnp.int32)

  def dpa(*a, **kw):  # looked up at call time, as model code does
    return jax.nn.dot_product_attention(*a, **kw)
  if form == "causal":
    args, f = attn_case(32, 32), lambda q, k, v: dpa(q, k, v, is_causal=True)
    op = "attention"
  elif form == "decode":
    args = attn_case(2, 96)
    f = lambda q, k, v: dpa(q, k, v, key_value_seq_lengths=lengths, scale=0.1)
    op = "decode_attention"
  elif form == "long noncausal":
    args, f = attn_case(80, 80), lambda q, k, v: dpa(q, k, v, key_value_seq_lengths=lengths)
    op = "attention"
  elif form == "rank3":
    args, f = attn_case(32, 32), lambda q, k, v: dpa(q[0], k[0], v[0], is_causal=True)
    op = "attention"
  elif form == "cudnn name":
    args = attn_case(32, 32)
    f = lambda q, k, v: dpa(q, k, v, is_causal=True, implementation=None)
    op = "attention"
  else:
    args, f = attn_case(32, 32), lambda q, k, v: dpa(q, k, v, None, None, is_causal=True)
    op = "attention"
  out, sites = run(f, *args)
  assert_close(out, jax.jit(f)(*args))
  assert [(s.op, s.replaced) for s in sites] == [(op, True)], sites


@pytest.mark.parametrize("kw, reason", [
    ({"mask": jnp.ones((2, 4, 32, 32), bool)}, "masks=True"),
    ({"bias": jnp.zeros((2, 4, 32, 32), jnp.bfloat16)}, "bias given"),
    ({"local_window_size": 8, "mask": jnp.ones((2, 4, 32, 32), bool)},
     "mask given with local_window_size"),
    ({"local_window_size": (2.5, 0)}, "is not an int or a pair of ints"),
    ({"local_window_size": (-1, 0), "is_causal": True}, "has a negative side"),
    # where the selector answers XLA's attention (on a CPU, always)
    ({"local_window_size": (4, 0), "is_causal": True}, "the selector answers XLA's attention"),
    ({"query_seq_lengths": jnp.array([3, 32], jnp.int32)}, "query_seq_lengths given"),
])
def test_attention_kept_with_reason(kw, reason):
  q, k, v = attn_case(32, 32)
  f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kw)
  out, sites = run(f, q, k, v)
  assert_close(out, jax.jit(f)(q, k, v), tol=0)
  assert len(sites) == 1, sites  # XLA's attention equations are not looked at again
  assert not sites[0].replaced and reason in sites[0].reason, sites


@pytest.fixture
def kernel_chosen(monkeypatch):
  """The selector's answer as on a GPU that runs a window kernel (on a CPU
  it answers XLA's attention, and a windowed call is kept): the op itself
  still runs here (on XLA's backend), so its result is checked."""
  from wavetune_jax import dropin
  monkeypatch.setattr(dropin, "_backend_of", lambda *a, **k: "mosaic")


@pytest.mark.parametrize("case", ["causal", "causal int", "two-sided", "lengths", "decode",
                                  "np ints", "rank3"])
def test_attention_windows_replaced(case, kernel_chosen):
  """``local_window_size`` goes to ``wt.attention`` with the window, aligned
  top-left as JAX aligns it, at any query count."""
  lengths = jnp.array([30, 9], jnp.int32)
  q, k, v = attn_case(32, 32)
  kw = {"causal": dict(local_window_size=(5, 0), is_causal=True),
        "causal int": dict(local_window_size=6, is_causal=True),
        "two-sided": dict(local_window_size=(4, 3)),
        "lengths": dict(local_window_size=(40, 0), is_causal=True,
                        key_value_seq_lengths=lengths),
        "decode": dict(local_window_size=(8, 8), key_value_seq_lengths=lengths),
        "np ints": dict(local_window_size=(np.int64(5), np.int32(1))),  # JAX unpacks a pair
        "rank3": dict(local_window_size=(7, 0), is_causal=True)}[case]
  if case == "decode":
    q = q[:, :2]
  if case == "rank3":
    f = lambda q, k, v: jax.nn.dot_product_attention(q[0], k[0], v[0], **kw)
  else:
    f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kw)
  out, sites = run(f, q, k, v)
  assert_close(out, jax.jit(f)(q, k, v))
  assert [(s.op, s.replaced) for s in sites] == [("attention", True)], sites
  checked = "checked at run time" in sites[0].backend
  assert checked == ("key_value_seq_lengths" in kw), sites


@pytest.mark.parametrize("lengths, replaced_result", [([30, 9], True), ([30, 2], False),
                                                      ([0, 32], False), ([99, -4], False)])
def test_a_window_whose_queries_see_no_key_runs_the_call_as_written(lengths, replaced_result,
                                                                   kernel_chosen):
  """With key lengths, a query past ``length + left`` sees no key: XLA's
  attention gives it the mean of all values, the op zeros, so the call runs
  as written there (a run-time check); without lengths the call is kept
  where more queries than ``kv + left`` are asked."""
  q, k, v = attn_case(32, 32)
  lens = jnp.array(lengths, jnp.int32)
  f = lambda q, k, v, n: jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                                      local_window_size=(24, 0),
                                                      key_value_seq_lengths=n)
  out, sites = run(f, q, k, v, lens)
  assert [s.replaced for s in sites] == [True], sites
  want = jax.jit(f)(q, k, v, lens)
  # The original call's own result where it runs (so exactly equal).
  assert_close(out, want, tol=0.02 if replaced_result else 0)
  from wavetune_jax import dropin
  ok = dropin._window_rows_see_keys(lens, 32, 32, 24)
  assert bool(ok) == replaced_result
  if replaced_result:
    assert_close(out, wt.attention(q, k, v, causal=True, local_window_size=(24, 0),
                                   kv_lengths=lens))
  # Static: 40 queries over 8 keys with 4 back leave queries 12-39 with none.
  q2, k2, v2 = attn_case(40, 8)
  g = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, local_window_size=(4, 4))
  out, sites = run(g, q2, k2, v2)
  assert not sites[0].replaced and "with no key" in sites[0].reason, sites
  assert_close(out, jax.jit(g)(q2, k2, v2), tol=0)


def test_windowed_calls_jax_rejects_are_kept(kernel_chosen):
  """A bare NumPy integer window (JAX unpacks it and fails) and a right side
  under ``implementation="cudnn"`` without a causal mask (JAX's cuDNN path
  refuses it) are left to the call as written, which raises as JAX does."""
  q, k, v = attn_case(32, 32)
  for kw, reason in (({"local_window_size": np.int64(3)}, "is not an int or a pair"),
                     ({"local_window_size": (4, 2), "implementation": "cudnn"},
                      "implementation='cudnn' with a right window side")):
    t = wt.autotune(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kw))
    with pytest.raises((TypeError, ValueError)):
      jax.jit(t)(q, k, v)
    with pytest.raises((TypeError, ValueError)):  # as the call as written does
      jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kw))(q, k, v)
    from wavetune_jax import dropin
    plan = dropin._attention_plan(dict(kw, query=q, key=k, value=v), q, k, v, False)
    assert isinstance(plan, str) and reason in plan, plan


def band_mask(lengths, t, s, heads=1, bottom_right=False):
  i = np.arange(t)[:, None]
  j = np.arange(s)[None, :]
  n = np.asarray(lengths)[:, None, None]
  m = (j <= i + n - t) if bottom_right else ((j <= i) & (j < n))
  return jnp.asarray(np.broadcast_to(m[:, None], (len(lengths), heads, t, s)))


@pytest.mark.parametrize("case", ["causal+lengths", "causal per head", "decode band",
                                  "two queries", "padding on the left", "full",
                                  "an empty sequence"])
def test_attention_masks_checked_at_run_time(case):
  """A mask is replaced by the op where, at run time, it is the causal
  mask with key lengths (prefill) or the bottom-right band of a cache
  (decode); any other mask runs the original call, with its own result."""
  lengths = [20, 7]
  if case in ("causal+lengths", "causal per head"):
    (q, k, v), m = attn_case(32, 32), band_mask(lengths, 32, 32, 4 if "head" in case else 1)
  elif case == "decode band":
    (q, k, v), m = attn_case(1, 48), band_mask(lengths, 1, 48, bottom_right=True)
  elif case == "two queries":
    (q, k, v), m = attn_case(2, 48), band_mask(lengths, 2, 48, bottom_right=True)
  elif case == "padding on the left":
    (q, k, v), m = attn_case(32, 32), band_mask(lengths, 32, 32)[..., ::-1]
  elif case == "full":
    (q, k, v), m = attn_case(16, 16), jnp.ones((2, 1, 16, 16), bool)
  else:
    (q, k, v), m = attn_case(32, 32), band_mask([20, 0], 32, 32)
  f = lambda q, k, v, m: jax.nn.dot_product_attention(q, k, v, mask=m)
  out, sites = run(f, q, k, v, m, masks=True)
  ref = jax.jit(f)(q, k, v, m)
  if case in ("padding on the left", "full", "an empty sequence"):
    assert_close(out, ref, tol=0)  # the original call ran
  else:
    # Rows of padded queries (past a length) see keys the op does not give
    # them in the same way: compare the rows of real tokens.
    rows = np.arange(q.shape[1])[None, :] < (np.asarray(lengths)[:, None] if q.shape[1] > 2
                                            else q.shape[1])
    assert_close(jnp.where(rows[..., None, None], out, 0), jnp.where(rows[..., None, None], ref, 0))
  assert len(sites) == 1 and sites[0].replaced and "checked at run time" in sites[0].backend


def test_a_shape_the_op_rejects_is_kept():
  q, k, v = attn_case(8, 8, head_dim=320)  # the ops take head_dim <= 256
  f = lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True)
  out, sites = run(f, q, k, v)
  assert_close(out, jax.jit(f)(q, k, v), tol=0)
  assert len(sites) == 1 and "the op rejects it" in sites[0].reason, sites


def test_attention_patch_is_local_and_restored():
  original = jax.nn.dot_product_attention
  seen = []

  def other_thread():  # sees the patch, which calls the original here (shapes only)
    seen.append(jax.eval_shape(lambda: jax.nn.dot_product_attention(
        *attn_case(4, 4), is_causal=True)).shape)

  def f(q, k, v):
    th = threading.Thread(target=other_thread)
    th.start()
    th.join()
    raise RuntimeError("boom")

  with pytest.raises(RuntimeError, match="boom"):
    wt.autotune(f)(*attn_case(4, 4))
  assert jax.nn.dot_product_attention is original
  assert seen == [(2, 4, 4, 64)]


def test_not_a_function():
  with pytest.raises(TypeError, match="takes a function"):
    wt.autotune(3)


def test_parameters_it_does_not_know_keep_the_call(monkeypatch):
  """Another JAX's parameters (here: a check that cannot read them) keep the
  call as written instead of failing the forward pass."""
  from wavetune_jax import dropin

  def unreadable(*args):
    raise KeyError("new_parameter")

  monkeypatch.setattr(dropin, "_gemm_unsupported", unreadable)
  out, sites = run(lambda x, w: x @ w, X, W)
  assert_close(out, X @ W, tol=0)
  assert len(sites) == 1 and "parameters not recognised" in sites[0].reason, sites


def test_an_nnx_module_updated_in_place_is_a_clear_error():
  # A KV cache's index, batch statistics or RNG counts written into a Flax
  # NNX module would be lost on the traced copy: a clear error, not stale
  # state. A module only read runs; the split / merge pattern keeps updates.
  nnx = pytest.importorskip("flax.nnx")

  class Counter(nnx.Module):
    def __init__(self, count):
      self.counts = count
      self.n = nnx.BatchStat(jnp.zeros(()))
      self.w = nnx.Param(jnp.ones((64, 64), jnp.bfloat16))

    def __call__(self, x):
      if self.counts:
        self.n.value = self.n.value + 1
      return x @ self.w.value

  x = jnp.ones((8, 64), jnp.bfloat16)
  call = lambda m, a: m(a)  # noqa: E731
  assert wt.autotune(call)(Counter(False), x).shape == (8, 64)
  for f in (wt.autotune(call), nnx.jit(wt.autotune(call))):
    with pytest.raises(ValueError, match="updated the Flax NNX Counter"):
      f(Counter(True), x)
  # Returned with the outputs, the update is kept (as under jax.jit).
  m = Counter(True)
  _, m2 = wt.autotune(lambda m, a: (m(a), m))(m, x)
  assert float(m2.n.value) == 1.0
  # Another argument changed in place is lost as under jax.jit: no error.
  batch = {"x": x.astype(jnp.float32)}

  def cast(m, b):
    b["x"] = b["x"].astype(jnp.bfloat16)
    return m(b["x"])
  assert wt.autotune(cast)(Counter(False), batch).shape == (8, 64)
  # An nnx.Rngs drawn from: its count would be lost.
  rngs = nnx.Rngs(0)
  with pytest.raises(ValueError, match="updated the Flax NNX Rngs"):
    wt.autotune(lambda r, a: a * jax.random.uniform(r(), ()).astype(a.dtype))(rngs, x)
  graph, state = nnx.split(Counter(True))

  def step(state, a):
    m = nnx.merge(graph, state)
    return m(a), nnx.state(m)
  for _ in range(2):
    _, state = jax.jit(wt.autotune(step))(state, x)
  assert float(nnx.merge(graph, state).n.value) == 2.0


def test_custom_derivative_rules_survive_and_their_bodies_are_rewritten():
  # A straight-through or frozen-weight rule around a GEMM: the forward is
  # replaced inside the custom function, and a derivative taken outside the
  # wrapper is still the user's rule (it was the body's own before).
  @jax.custom_vjp
  def frozen(x, w):
    return x @ w
  frozen.defvjp(lambda x, w: (x @ w, (x, w)),
                lambda r, g: (g @ r[1].T, jnp.zeros_like(r[1])))

  @jax.custom_jvp
  def no_tangent(x, w):
    return x @ w
  @no_tangent.defjvp
  def _(p, t):
    out = no_tangent(*p)
    return out, jnp.zeros_like(out)
  for fn in (frozen, no_tangent):
    loss = lambda w, x, fn=fn: jnp.sum(fn(x, w).astype(jnp.float32) ** 2)  # noqa: E731
    f = wt.autotune(loss)
    with wt.policy("fixed"):  # a kernel, not XLA's dot, on a CPU
      out = jax.jit(f)(W, X)
    assert_close(out, loss(W, X))
    assert [s.replaced for s in f.sites] == [True], f.sites
    g = wt.autotune(loss)
    assert float(jnp.abs(jax.grad(jax.jit(g))(W, X)).max()) == 0.0
    assert float(jnp.abs(jax.grad(g)(W, X)).max()) == 0.0


def test_attention_differentiated_inside_the_function_is_reported_kept():
  # Inside value_and_grad the forward would come from the original call's
  # derivative: the report says so instead of "replaced".
  q = jax.random.normal(KEYS[0], (1, 32, 4, 64), jnp.bfloat16)
  loss = lambda q: jax.nn.dot_product_attention(q, q, q, is_causal=True).astype(  # noqa: E731
      jnp.float32).sum()
  f = wt.autotune(jax.value_and_grad(loss))
  (val, grad), (want_val, want_grad) = f(q), jax.value_and_grad(loss)(q)
  assert_close(val, want_val)
  assert_close(grad, want_grad)
  att = [s for s in f.sites if s.op == "attention"]
  assert att and not any(s.replaced for s in att), f.sites
  assert "differentiated inside the function" in att[0].reason
  g = wt.autotune(loss)  # not differentiated inside: replaced
  g(q)
  assert [s.replaced for s in g.sites if s.op == "attention"] == [True], g.sites


def test_a_custom_function_that_cannot_be_rewritten_runs_as_written(monkeypatch):
  from wavetune_jax import dropin

  @jax.custom_vjp
  def lin(x, w):
    return x @ w
  lin.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, g: (g @ r[1].T, r[0].T @ g))

  bind = dropin._bind

  def broken(eqn, params, invals):
    if eqn.primitive.name.startswith("custom") and params is not eqn.params:
      raise RuntimeError("another JAX's parameters")
    return bind(eqn, params, invals)
  monkeypatch.setattr(dropin, "_bind", broken)
  f = wt.autotune(lambda x, w: lin(x, w))
  assert_close(f(X, W), X @ W)
  assert [s.replaced for s in f.sites] == [False], f.sites
  assert "could not be rebound" in f.sites[0].reason
