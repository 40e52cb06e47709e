"""Multi-device checks run by tests/test_sharding.py in a subprocess with 4
CPU devices (XLA_FLAGS must be set before JAX starts). Prints one line per
check: ``OK <name>`` or ``FAIL <name>: <why>``."""

import contextlib
import os
import sys
import traceback
import warnings

# Four CPU devices; compiled as in the rest of the suite (the XLA flags of
# tests/conftest.py, which the test that starts this process passes on).
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=4")
os.environ.setdefault("JAX_PLATFORMS", "cpu")
warnings.simplefilter("ignore")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import wavetune_jax as wt  # noqa: E402

MESH = jax.make_mesh((2, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Auto,) * 2)
SEEN = []  # problems the ops bound: the per-shard shapes
for fam in (wt.MATMUL, wt.ATTENTION, wt.RAGGED_DOT):
  bind = fam.bind

  def recording(*a, _bind=bind, **k):
    call = _bind(*a, **k)
    SEEN.append(getattr(call, "problem", None))
    return call
  fam.bind = recording


def put(x, spec):
  return jax.device_put(x, NamedSharding(MESH, spec))


def rnd(i, shape, dtype=jnp.float32):
  return jax.random.normal(jax.random.PRNGKey(i), shape, jnp.float32).astype(dtype)


TRITON_MM = wt.TritonMatmulConfig(block_m=16, block_n=32, block_k=32, split_k=1, group_m=8,
                                  num_warps=4, num_stages=3)
TRITON_RD = {"backend": "triton", "block_m": 16, "block_n": 32, "block_k": 32,
             "num_warps": 4, "num_stages": 3}
X, W = rnd(0, (64, 128)), rnd(1, (128, 96))
Q, K = rnd(2, (4, 32, 8, 64), jnp.bfloat16), rnd(3, (4, 32, 2, 64), jnp.bfloat16)
LHS, RHS, GS = rnd(4, (64, 128)), rnd(5, (4, 128, 96)), jnp.array([10, 20, 0, 30], jnp.int32)
CHECKS = []


def check(fn):
  CHECKS.append(fn)
  return fn


def close(a, b, tol):
  a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
  err = np.abs(a - b).max() / (np.abs(b).max() + 1e-9)
  assert err <= tol, f"relative error {err:.3g} > {tol}"


def hlo(f, *args):
  return f.lower(*args).compile().as_text()


@check
def sharded_jit_matmul():
  for cfg in (None, TRITON_MM):
    for xs, ws, out, red in [(P("a", None), P(None, "b"), P("a", "b"), False),
                             (P(None, "a"), P("a", None), P(), True),
                             (P("a", "b"), P("b", None), P("a"), True)]:
      f = jax.jit(lambda x, w, c=cfg: wt.matmul(x, w, config=c))
      args = (put(X, xs), put(W, ws))
      SEEN.clear()
      y = f(*args)
      close(y, X @ W, 1e-5)
      assert y.sharding.spec == out, (xs, ws, y.sharding.spec)
      text = hlo(f, *args)
      assert "all-gather" not in text, (xs, ws, "gathers")
      assert ("all-reduce" in text) == red, (xs, ws, "all-reduce")
      want = (64 // (2 if xs[0] else 1), 96 // (2 if len(ws) > 1 and ws[1] else 1),
              128 // (2 if len(xs) > 1 and xs[1] else 1))
      seen = [(p.m, p.n, p.k) for p in SEEN if p is not None]
      assert want in seen, ("selected on", seen, "want", want)


@check
def sharded_jit_disagreeing_layouts():
  """Operands whose shardings disagree (or name one axis twice) are resharded
  to one consistent split: never a wrong result."""
  f = jax.jit(lambda x, w: wt.matmul(x, w))
  for xs, ws in [(P(None, "a"), P("b", None)), (P("a", "b"), P("a", None)), (P(), P("a", None)),
                 (P(None, ("a", "b")), P("a", None)), (P(None, "a"), P(None, "a"))]:
    try:
      close(f(put(X, xs), put(W, ws)), X @ W, 1e-5)
    except Exception as e:  # noqa: BLE001
      raise AssertionError(f"matmul {xs} {ws}: {type(e).__name__}: {str(e)[:200]}") from None
  g = jax.jit(lambda x, w: wt.matmul(x, w), out_shardings=NamedSharding(MESH, P("a", None)))
  close(g(put(X, P(None, "a")), put(W, P("a", None))), X @ W, 1e-5)
  r = jax.jit(lambda a, b, c: wt.ragged_dot(a, b, c))
  for ls, rs in [(P(None, "a"), P(None, "b", None)), (P(), P(None, "a", None))]:
    close(r(put(LHS, ls), put(RHS, rs), GS), jax.lax.ragged_dot(LHS, RHS, GS), 1e-5)
  at = jax.jit(lambda q, k, v: wt.attention(q, k, v))
  close(at(put(Q, P(None, None, "a")), K, K),
        jax.nn.dot_product_attention(Q, K, K, is_causal=True), 2e-2)


@check
def vmap_on_several_devices():
  y = jax.vmap(lambda x: wt.matmul(x, W))(X.reshape(4, 16, 128))
  close(y.reshape(64, 96), X @ W, 1e-5)


@check
def sharded_jit_attention_batch_and_heads():
  f = jax.jit(lambda q, k, v: wt.attention(q, k, v))
  spec = P("a", None, "b")
  args = (put(Q, spec), put(K, spec), put(K, spec))
  SEEN.clear()
  y = f(*args)
  close(y, jax.nn.dot_product_attention(Q, K, K, is_causal=True), 2e-2)
  assert y.sharding.spec == P("a", None, "b"), y.sharding.spec
  assert "all-gather" not in hlo(f, *args)
  seen = [(p.batch, p.q_heads, p.kv_heads) for p in SEEN if p is not None]
  assert (2, 4, 1) in seen, seen
  # A KV cache: per-sequence lengths split with the batch.
  lens = jnp.array([5, 32, 1, 17], jnp.int32)
  g = jax.jit(lambda q, k, v, l: wt.attention(q, k, v, kv_lengths=l,
                                              causal_align="bottom_right"))
  args = (put(Q[:, :4], spec), put(K, spec), put(K, spec), put(lens, P("a")))
  y = g(*args)
  from pallas_kernels.attention.reference import attention_reference
  close(y, attention_reference(Q[:, :4], K, K, kv_lengths=lens, causal_align="bottom_right",
                               out_dtype=jnp.float32), 2e-2)
  assert "all-gather" not in hlo(g, *args)
  # The sequence sharded: the documented fallback gathers it.
  spec = P(None, "a")
  y = f(put(Q, spec), put(K, spec), put(K, spec))
  close(y, jax.nn.dot_product_attention(Q, K, K, is_causal=True), 2e-2)


@check
def sharded_jit_multi_head_attention():
  # One query head per KV head, or one KV head: the rule's heads are one
  # factor (a compound with a factor of size 1 failed Shardy's verifier,
  # even on replicated inputs).
  mha = rnd(6, (4, 32, 4, 64), jnp.bfloat16)
  ref = wt.attention(mha, mha, mha)
  ref_d = wt.decode_attention(mha[:, :1], mha, mha)
  mqa = rnd(7, (4, 32, 1, 64), jnp.bfloat16)
  ref_q = wt.attention(mha, mqa, mqa)
  ref_qd = wt.decode_attention(mha[:, :1], mqa, mqa)
  for spec in (P("a"), P(None, None, "b"), P()):
    m = put(mha, spec)
    close(jax.jit(lambda a: wt.attention(a, a, a))(m), ref, 1e-6)
    close(jax.jit(lambda a: wt.decode_attention(a[:, :1], a, a))(m), ref_d, 1e-6)
    kv = put(mqa, P("a") if spec == P("a") else P())
    close(jax.jit(lambda a, b: wt.attention(a, b, b))(m, kv), ref_q, 1e-6)
    close(jax.jit(lambda a, b: wt.decode_attention(a[:, :1], b, b))(m, kv), ref_qd, 1e-6)
  sinks = jnp.zeros((4,), jnp.float32)
  m = put(mha, P(None, None, "b"))
  close(jax.jit(lambda a: wt.attention(a, a, a, sinks=sinks))(m),
        wt.attention(mha, mha, mha, sinks=sinks), 1e-6)


@check
def explicit_mesh_runs_xlas_op():
  # Sharding in types: the kernels' wrappers take unsharded arrays, so the
  # op runs XLA's there, with one warning per family; a pin runs as given.
  import warnings
  mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  ref, ref_d = wt.attention(Q, K, K), wt.decode_attention(Q[:, :1], K, K)
  with warnings.catch_warnings(record=True) as rec, jax.set_mesh(mesh):
    warnings.simplefilter("always")
    for spec in (P("a"), P()):
      q, k = (jax.device_put(a, NamedSharding(mesh, spec)) for a in (Q, K))
      close(jax.jit(wt.attention)(q, k, k), ref, 2e-2)
      close(jax.jit(wt.decode_attention)(q[:, :1], k, k), ref_d, 2e-2)
    close(jax.jit(lambda a: wt.matmul(a, W))(jax.device_put(X, NamedSharding(mesh, P("a")))),
          X @ W, 2e-2)
  said = {str(r.message).split()[0] for r in rec if "explicit axes" in str(r.message)}
  assert said == {"wavetune_jax.attention", "wavetune_jax.decode", "wavetune_jax.matmul"}, said
  # A kernel's config, given or pinned: a clear error; XLA's pinned runs.
  with jax.set_mesh(mesh):
    x = jax.device_put(X, P())
    for ctx, kw in ((contextlib.nullcontext(), {"config": TRITON_MM}),
                    (wt.use_config("matmul", TRITON_MM), {})):
      with ctx:
        try:
          jax.jit(lambda a: wt.matmul(a, W, **kw))(x)
          raise AssertionError("a Triton config ran under explicit axes")
        except ValueError as e:
          assert "cannot run under a mesh with explicit axes" in str(e), e
    with wt.use_config("matmul", {"backend": "xla"}):
      close(jax.jit(lambda a: wt.matmul(a, W))(x), X @ W, 2e-2)


@check
def explicit_mesh_ragged_dot():
  # JAX's ragged dot has no rule for explicit axes (lax.ragged_dot raises
  # there): the op runs it on rows, K and sizes gathered, the weights' expert
  # and N axes kept (the output keeps N's), with a warning that says so.
  ref = jax.lax.ragged_dot(LHS, RHS, GS)
  mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  with warnings.catch_warnings(record=True) as rec, jax.set_mesh(mesh):
    warnings.simplefilter("always")
    for xs, ws in ((P("a"), P()), (P(None, "b"), P(None, "b")), (P(), P(None, None, "b")),
                   (P(("a", "b")), P("a", None, "b"))):
      x, w = (jax.device_put(a, NamedSharding(mesh, s)) for a, s in ((LHS, xs), (RHS, ws)))
      out = jax.jit(wt.ragged_dot)(x, w, jax.device_put(GS, NamedSharding(mesh, P("a"))))
      close(out, ref, 1e-5)
      n_axis = ws[2] if len(ws) > 2 else None
      assert tuple(jax.typeof(out).sharding.spec) + (None,) * 2 == (None, n_axis, None, None), \
          jax.typeof(out).sharding.spec
  said = [str(r.message) for r in rec if "explicit axes" in str(r.message)]
  assert said and all("gathered" in m for m in said), said
  # Placed on the mesh, the mesh not set.
  x = jax.device_put(LHS, NamedSharding(mesh, P("a")))
  close(jax.jit(wt.ragged_dot)(x, RHS, GS), ref, 1e-5)
  with warnings.catch_warnings(record=True) as rec:
    warnings.simplefilter("always")
    # The quantized grouped GEMM: both weight layouts, N kept where it is N.
    w8 = jnp.round(RHS * 40).astype(jnp.int8)
    sc = jnp.full((4, 96), 0.025, jnp.float32)
    for layout, w in (("kn", w8), ("nk", jnp.swapaxes(w8, 1, 2))):
      q_ref = wt.quantized_ragged_dot(LHS.astype(jnp.bfloat16), w, sc, GS, w_layout=layout)
      for xs, ws, n_axis in ((P("a"), P(None, None, "b"), "b" if layout == "kn" else None),
                             (P(None, "b"), P("a", "b"), None if layout == "kn" else "b")):
        with jax.set_mesh(mesh):
          args = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in (
              (LHS.astype(jnp.bfloat16), xs), (w, ws), (sc, P(None, "b")), (GS, P("a")))]
          out = jax.jit(lambda a, b, c, d: wt.quantized_ragged_dot(a, b, c, d, w_layout=layout))(
              *args)
        close(out, q_ref, 1e-6)
        assert tuple(jax.typeof(out).sharding.spec) + (None,) == (None, n_axis, None), \
            (layout, jax.typeof(out).sharding.spec)
    # NumPy int64 sizes past int32 under the mesh: clipped as elsewhere (not
    # wrapped by JAX's narrowing first); the scales alone placed on the mesh,
    # the mesh not set, name it.
    big = np.array([10, 2**32 + 4, 0, 30], np.int64)
    x16 = LHS.astype(jnp.bfloat16)
    want = wt.quantized_ragged_dot(x16, w8, sc, big)
    with jax.set_mesh(mesh):
      close(jax.jit(lambda a: wt.quantized_ragged_dot(a, w8, sc, big))(x16), want, 1e-6)
    placed = jax.device_put(sc, NamedSharding(mesh, P(None, "b")))
    close(jax.jit(lambda c: wt.quantized_ragged_dot(x16, w8, c, GS))(placed),
          wt.quantized_ragged_dot(x16, w8, sc, GS), 1e-6)
  said = [str(r.message) for r in rec if "qragged_dot under a mesh" in str(r.message)]
  assert said and "gathered" in said[0], said


@check
def explicit_types_without_the_mesh_set():
  # Arrays placed on a mesh of explicit axes, the mesh not set: their types
  # carry the sharding all the same, so the op runs XLA's (a kernel's
  # wrapper failed deep in JAX on a sharded ref) and a kernel's config is
  # the clear error.
  # (The warning is once per family: explicit_mesh_runs_xlas_op has it.)
  mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  x = jax.device_put(X, NamedSharding(mesh, P("a")))
  close(jax.jit(lambda a: wt.matmul(a, W))(x), X @ W, 2e-2)
  try:
    jax.jit(lambda a: wt.matmul(a, W, config=TRITON_MM))(x)
    raise AssertionError("a Triton config ran on explicitly sharded arrays")
  except ValueError as e:
    assert "cannot run under a mesh with explicit axes" in str(e), e


@check
def autotune_keeps_a_dot_with_out_sharding():
  # jnp.dot(..., out_sharding=...) under explicit axes: the call as written
  # (the ops take their output's sharding from their operands: the result
  # came back sharded otherwise, and a K-sharded product failed).
  mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  with jax.set_mesh(mesh):
    xb, wb = X.astype(jnp.bfloat16), W.astype(jnp.bfloat16)
    x = jax.device_put(xb, NamedSharding(mesh, P("a")))
    f = wt.autotune(lambda a, b: jnp.dot(a, b, out_sharding=P()))
    y = f(x, wb)
    assert tuple(y.sharding.spec) in ((), (None, None)), y.sharding.spec
    assert [s.replaced for s in f.sites] == [False] and "out_sharding" in f.sites[0].reason, \
        f.sites
    close(y.astype(jnp.float32), X @ W, 5e-2)


@check
def autotune_custom_functions_keep_their_types():
  # A custom_vjp around a GEMM: rewritten inside shard_map (the body traced on
  # the operands, whose varying axes it keeps) and on explicitly sharded
  # arrays (the output keeps the original's sharding).
  @jax.custom_vjp
  def g(x, w):
    return x @ w
  g.defvjp(lambda x, w: (x @ w, (x, w)), lambda r, c: (c @ r[1].T, r[0].T @ c))
  xb, wb = X.astype(jnp.bfloat16), rnd(3, (128, 128), jnp.bfloat16)
  t = wt.autotune(g)
  y = jax.jit(jax.shard_map(t, mesh=MESH, in_specs=(P("a"), P()), out_specs=P("a")))(xb, wb)
  assert [s.replaced for s in t.sites] == [True], t.sites
  close(y, xb.astype(jnp.float32) @ wb.astype(jnp.float32), 5e-2)
  mesh = jax.make_mesh((2, 2), ("a", "b"), axis_types=(jax.sharding.AxisType.Explicit,) * 2)
  x = jax.device_put(xb, NamedSharding(mesh, P("a")))
  w = jax.device_put(wb, NamedSharding(mesh, P(None, "b")))
  f = lambda a, b: g(a, b) + a  # noqa: E731
  assert jax.typeof(jax.jit(wt.autotune(f))(x, w)) == jax.typeof(jax.jit(f)(x, w))


@check
def sharded_jit_ragged_dot():
  f = jax.jit(lambda a, b, c: wt.ragged_dot(a, b, c))
  ref = jax.lax.ragged_dot(LHS, RHS, GS)
  for ls, rs, out, red in [(P(), P(None, None, "a"), P(None, "a"), False),
                           (P(None, "a"), P(None, "a", None), P(), True)]:
    args = (put(LHS, ls), put(RHS, rs), GS)
    y = f(*args)
    try:
      close(y, ref, 1e-5)
    except AssertionError as e:
      raise AssertionError(f"{ls} {rs}: {e}") from None
    assert y.sharding.spec == out, y.sharding.spec
    text = hlo(f, *args)
    assert "all-gather" not in text and ("all-reduce" in text) == red, (ls, rs)
  # Rows sharded: the documented fallback gathers them.
  y = f(put(LHS, P("a")), put(RHS, P()), GS)
  close(y, ref, 1e-5)


def check_quantized_layouts(f, sharded, rest, cases):
  """``f(x, w, scales, *rest)`` with ``(x, w, scales)`` put as each case's
  ``(x spec, w spec, scales spec)``: the result matches the unsharded one
  (1e-2), has the case's output spec, gathers nothing and all-reduces iff
  the case says so (a K split)."""
  ref = f(*sharded, *rest)
  for ls, rs, ss, out, red in cases:
    args = tuple(put(a, spec) for a, spec in zip(sharded, (ls, rs, ss))) + tuple(rest)
    y = f(*args)
    try:
      close(y, ref, 1e-2)
    except AssertionError as e:
      raise AssertionError(f"{ls} {rs}: {e}") from None
    assert y.sharding.spec == out, y.sharding.spec
    text = hlo(f, *args)
    assert "all-gather" not in text and ("all-reduce" in text) == red, (ls, rs)


@check
def sharded_jit_quantized_ragged_dot():
  # W8A8 experts [G, N, K]: N sharded with its scales (no collective), or K
  # with the rows' K (fp32 partials, one all-reduce).
  x8, xs = wt.quantize_rows(LHS)
  w8, s = wt.quantize_weight(RHS, "float8_e4m3fn", layout="nk")
  f = jax.jit(lambda a, b, c, d: wt.quantized_ragged_dot(a, b, c, GS, x_scales=d,
                                                         w_layout="nk"))
  cases = [(P(), P(None, "a", None), P(None, "a"), P(None, "a"), False),
           (P(None, "a"), P(None, None, "a"), P(), P(), True)]
  check_quantized_layouts(f, (x8, w8, s), (xs,), cases)


@check
def sharded_jit_int4_matmul():
  # W4A16 [N, K] with scales [K // group, N]: N sharded with the scales' N
  # (no collective), or K by whole groups with the scales' groups (fp32
  # partials, one all-reduce).
  w4, s = wt.quantize_weight(rnd(6, (512, 96)), "int4", layout="nk", group_size=64)
  x = rnd(7, (16, 512), jnp.bfloat16)
  f = jax.jit(lambda a, b, c: wt.quantized_matmul(a, b, c, w_layout="nk"))
  cases = [(P(), P("a", None), P(None, "a"), P(None, "a"), False),
           (P(None, "a"), P(None, "a"), P("a", None), P(), True)]
  check_quantized_layouts(f, (x, w4, s), (), cases)


@check
def shard_map_default_check_vma():
  mm = jax.shard_map(lambda x, w: wt.matmul(x, w), mesh=MESH, in_specs=(P("a"), P(None, "b")),
                     out_specs=P("a", "b"))
  close(jax.jit(mm)(put(X, P("a")), put(W, P(None, "b"))), X @ W, 1e-5)
  at = jax.shard_map(lambda q, k, v: wt.attention(q, k, v), mesh=MESH,
                     in_specs=(P("a", None, "b"),) * 3, out_specs=P("a", None, "b"))
  spec = P("a", None, "b")
  close(jax.jit(at)(put(Q, spec), put(K, spec), put(K, spec)),
        jax.nn.dot_product_attention(Q, K, K, is_causal=True), 2e-2)
  rd = jax.shard_map(lambda a, b, c: wt.ragged_dot(a, b, c), mesh=MESH,
                     in_specs=(P(), P(None, None, "a"), P()), out_specs=P(None, "a"))
  close(jax.jit(rd)(LHS, put(RHS, P(None, None, "a")), GS), jax.lax.ragged_dot(LHS, RHS, GS),
        1e-5)


@check
def shard_map_pinned_pallas_on_cpu():
  mm = jax.shard_map(lambda x, w: wt.matmul(x, w, config=TRITON_MM), mesh=MESH,
                     in_specs=(P("a"), P()), out_specs=P("a"))
  try:
    jax.jit(mm)(put(X, P("a")), W)
    raise AssertionError("no error")
  except ValueError as e:
    assert "cannot run inside jax.shard_map on a CPU" in str(e), e
  mm = jax.shard_map(lambda x, w: wt.matmul(x, w, config=TRITON_MM), mesh=MESH,
                     in_specs=(P("a"), P()), out_specs=P("a"), check_vma=False)
  close(jax.jit(mm)(put(X, P("a")), W), X @ W, 1e-5)


@check
def shard_map_kernels_lower_for_cuda():
  """The GPU path: every Pallas kernel inside shard_map (check_vma) declares
  how its output varies; lowering for CUDA runs Mosaic's and Triton's checks."""
  from pallas_kernels.attention import mosaic as am, triton as at
  from pallas_kernels.matmul import mosaic as mm, triton as mt
  from pallas_kernels.ragged_dot import mosaic as rm, triton as rt
  sds = lambda shape, spec: jax.ShapeDtypeStruct(  # noqa: E731
      shape, jnp.bfloat16, sharding=NamedSharding(MESH, spec))
  cases = [
      (lambda x, w: mm.matmul(x, w, config=mm.MosaicMatmulConfig(), num_sms=132),
       (sds((512, 256), P("a")), sds((256, 512), P(None, "b"))), (P("a"), P(None, "b")),
       P("a", "b")),
      (lambda x, w: mt.matmul(x, w, config=TRITON_MM),
       (sds((512, 256), P("a")), sds((256, 512), P())), (P("a"), P()), P("a")),
      (lambda q, k, v: am._attention(q, k, v, block_q=128, block_k=128, num_stages=2,
                                     causal=True, scale=0.1),
       (sds((2, 256, 8, 128), P("a")),) + (sds((2, 256, 2, 128), P("a")),) * 2,
       (P("a"),) * 3, P("a")),
      (lambda q, k, v: at.attention(q, k, v, config=at.TritonAttentionConfig(), causal=True),
       (sds((2, 256, 8, 128), P("a")),) + (sds((2, 256, 2, 128), P("a")),) * 2,
       (P("a"),) * 3, P("a")),
      (lambda a, b, c: rm.ragged_dot(a, b, c, config=rm.MosaicRaggedDotConfig(), num_sms=132),
       (sds((512, 256), P()), sds((4, 256, 512), P(None, None, "a")),
        jax.ShapeDtypeStruct((4,), jnp.int32, sharding=NamedSharding(MESH, P()))),
       (P(), P(None, None, "a"), P()), P(None, "a")),
      (lambda a, b, c: rt.ragged_dot(a, b, c, config=rt.TritonRaggedDotConfig()),
       (sds((512, 256), P()), sds((4, 256, 512), P(None, None, "a")),
        jax.ShapeDtypeStruct((4,), jnp.int32, sharding=NamedSharding(MESH, P()))),
       (P(), P(None, None, "a"), P()), P(None, "a")),
  ]
  for fn, shapes, in_specs, out_spec in cases:
    g = jax.shard_map(fn, mesh=MESH, in_specs=in_specs, out_specs=out_spec)
    jax.jit(g).trace(*shapes).lower(lowering_platforms=("cuda",))


if __name__ == "__main__":
  assert jax.device_count() == 4, jax.device_count()
  for fn in CHECKS:
    try:
      fn()
      print(f"OK {fn.__name__}", flush=True)
    except Exception as e:  # noqa: BLE001
      print(f"FAIL {fn.__name__}: {type(e).__name__}: {str(e)[:500]}", flush=True)
      traceback.print_exc(file=sys.stderr)
