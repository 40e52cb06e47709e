"""Weights quantized by qwix, fed to the quantized ops (``wt.from_qwix``), and
examples/qwix_weights.py: a decoder with qwix weights through the wavetune ops."""

import importlib.util
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wavetune_jax as wt

ROOT = os.path.join(os.path.dirname(__file__), "..")


def _qarray(qvalue, scale, zero_point=None):
  """The three attributes from_qwix reads, without qwix."""
  return types.SimpleNamespace(qvalue=qvalue, scale=scale, zero_point=zero_point)


def test_layouts_shapes_and_a_per_tensor_scale():
  q = jnp.arange(-6, 6, dtype=jnp.int8).reshape(3, 4)
  w, s = wt.from_qwix(_qarray(q, jnp.full((1, 4), 0.5, jnp.bfloat16)))
  assert w.dtype == jnp.int8 and w.shape == (3, 4) and s.dtype == jnp.float32 and s.shape == (4,)
  w, s = wt.from_qwix(_qarray(q, jnp.array([[2.0]])), layout="nk")  # one scale per tensor
  _, one = wt.from_qwix(_qarray(jnp.zeros((5, 3, 4), jnp.int8), jnp.ones((1, 1, 1))))
  assert one.shape == (5, 4)  # one scale for all experts
  np.testing.assert_array_equal(w, q.T)
  np.testing.assert_array_equal(s, [2.0] * 4)
  e = jnp.zeros((5, 3, 4), jnp.float8_e4m3fn)
  w, s = wt.from_qwix(_qarray(e, jnp.ones((5, 1, 4))), layout="nk")
  assert w.shape == (5, 4, 3) and s.shape == (5, 4)


@pytest.mark.parametrize("arg,match", [
    (jnp.ones((4, 4)), "expected a qwix.QArray"),
    (_qarray(jnp.ones((4, 4), jnp.int8), jnp.ones((1, 4)), jnp.ones((1, 4))), "zero point"),
    (_qarray(jnp.ones((4, 4), jnp.int4), jnp.ones((1, 4))), "int4 weights are \\[N, K\\]"),
    (_qarray(jnp.ones((2, 4, 4), jnp.int4), jnp.ones((2, 1, 4))), "int4 expert weights"),
    (_qarray(jnp.ones((4, 4), jnp.uint8), jnp.ones((1, 4))), "holds uint8 values"),
    (_qarray(jnp.ones((4,), jnp.int8), jnp.ones((1,))), r"must be \[K, N\]"),
    (_qarray(jnp.ones((128, 4), jnp.int8), jnp.ones((2, 4))),
     r"shape \(2, 4\).*shape \(1, 4\): quantize with channelwise_axes=\[1\] and no tiled_axes"),
    (_qarray(jnp.ones((2, 8, 4), jnp.int8), jnp.ones((1, 1, 4))), r"channelwise_axes=\[0, 2\]"),
    (_qarray(jnp.ones((8, 4), jnp.int8), jnp.ones((1, 4), jnp.int32)), "must be floating"),
])
def test_what_it_refuses_is_one_line(arg, match):
  with pytest.raises(ValueError, match=match) as e:
    wt.from_qwix(arg)
  assert "\n" not in str(e.value)
  with pytest.raises(ValueError, match="layout='kk'"):
    wt.from_qwix(_qarray(jnp.ones((8, 4), jnp.int8), jnp.ones((1, 4))), layout="kk")


@pytest.mark.parametrize("dtype", ["int8", "float8_e4m3fn"])
def test_qwix_weights_in_the_quantized_ops(dtype):
  qwix = pytest.importorskip("qwix")
  kx, kw, ke = jax.random.split(jax.random.PRNGKey(0), 3)
  x = jax.random.normal(kx, (24, 64), jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(kw, (64, 48), jnp.float32)
  qa = qwix.quantize(w, jnp.dtype(dtype), channelwise_axes=[1])
  wq, s = wt.from_qwix(qa)
  deq = wq.astype(jnp.float32) * s
  # The same weight as qwix's (its product rounded to the scale's dtype, float32 here).
  np.testing.assert_allclose(deq, qwix.dequantize(qa), rtol=1e-6, atol=1e-6)
  y = wt.quantized_matmul(x, wq, s)
  ref = x.astype(jnp.float32) @ deq
  assert float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref))) < 2e-2
  # Expert weights [G, K, N], a scale per expert and channel.
  e = jax.random.normal(ke, (3, 64, 48), jnp.float32)
  eq, es = wt.from_qwix(qwix.quantize(e, jnp.dtype(dtype), channelwise_axes=[0, 2]))
  sizes = jnp.array([10, 0, 14], jnp.int32)
  y = wt.quantized_ragged_dot(x, eq, es, sizes)
  ref = jax.lax.ragged_dot(x.astype(jnp.float32), eq.astype(jnp.float32) * es[:, None, :], sizes)
  assert float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref))) < 2e-2


def test_qwix_int4_weights_with_group_scales():
  qwix = pytest.importorskip("qwix")
  kx, kw = jax.random.split(jax.random.PRNGKey(2))
  x = jax.random.normal(kx, (24, 512), jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(kw, (512, 96), jnp.float32)
  qa = qwix.quantize(w, jnp.int4, channelwise_axes=[1], tiled_axes={0: 128})
  wq, s = wt.from_qwix(qa, layout="nk")
  assert wq.dtype == jnp.int4 and wq.shape == (96, 512) and s.shape == (4, 96)
  from wavetune_jax.families.qmatmul.backends import dequantize_int4
  np.testing.assert_allclose(dequantize_int4(wq, s).T, qwix.dequantize(qa), rtol=1e-6,
                             atol=1e-6)
  y = wt.quantized_matmul(x, wq, s, w_layout="nk")
  ref = x.astype(jnp.float32) @ qwix.dequantize(qa)
  assert float(jnp.max(jnp.abs(y.astype(jnp.float32) - ref)) / jnp.max(jnp.abs(ref))) < 2e-2
  with pytest.raises(ValueError, match="pass layout='nk'"):
    wt.from_qwix(qa)
  with pytest.raises(ValueError, match=r"tiled_axes=\{0: group\}"):
    wt.from_qwix(_qarray(qa.qvalue, jnp.ones((3, 96))), layout="nk")


def test_qwix_e4m3_weights_as_w8a8():
  """qwix's e4m3 weights, transposed by from_qwix, in the W8A8 ops."""
  qwix = pytest.importorskip("qwix")
  kx, kw, ke = jax.random.split(jax.random.PRNGKey(1), 3)
  x8, xs = wt.quantize_rows(jax.random.normal(kx, (24, 128), jnp.float32))
  x = x8.astype(jnp.float32) * xs[:, None]
  w = jax.random.normal(kw, (128, 64), jnp.float32)
  wq, s = wt.from_qwix(qwix.quantize(w, jnp.float8_e4m3fn, channelwise_axes=[1]), layout="nk")
  assert wq.shape == (64, 128)
  ref = x @ (wq.astype(jnp.float32).T * s)
  y = wt.quantized_matmul(x8, wq, s, x_scales=xs, w_layout="nk", out_dtype=jnp.float32)
  assert float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref))) < 1e-2
  e = jax.random.normal(ke, (3, 128, 64), jnp.float32)
  eq, es = wt.from_qwix(qwix.quantize(e, jnp.float8_e4m3fn, channelwise_axes=[0, 2]),
                        layout="nk")
  sizes = jnp.array([10, 0, 14], jnp.int32)
  y = wt.quantized_ragged_dot(x8, eq, es, sizes, x_scales=xs, w_layout="nk",
                              out_dtype=jnp.float32)
  ref = jax.lax.ragged_dot(x, jnp.swapaxes(eq.astype(jnp.float32) * es[:, :, None], 1, 2), sizes)
  assert float(jnp.max(jnp.abs(y - ref)) / jnp.max(jnp.abs(ref))) < 1e-2


def test_the_example_runs_a_decoder_with_qwix_weights(capsys):
  pytest.importorskip("qwix")
  spec = importlib.util.spec_from_file_location(
      "qwix_weights", os.path.join(ROOT, "examples", "qwix_weights.py"))
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  out = mod.main(["--model", "small", "--layers", "1", "--tokens", "8"])
  assert "int8 weights quantized by qwix" in capsys.readouterr().out
  assert out["wavetune_vs_xla"] < 5e-2  # the same quantized model, two sets of ops
  assert 0 < out["quantized_vs_bf16"] < 5e-2  # quantized, and close to the 16-bit model
  # --weights int4: the example's quantize takes the decoder's group size.
  w = jax.random.normal(jax.random.PRNGKey(3), (256, 32), jnp.float32)
  wq, gs = mod.qwix_quantize(w, "int4", layout="nk", group_size=128)
  assert wq.dtype == jnp.int4 and wq.shape == (32, 256) and gs.shape == (2, 32)
