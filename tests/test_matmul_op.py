"""The public op: jit, default config, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wavetune_jax as wt
from wavetune_jax import TritonMatmulConfig as MatmulConfig
from wavetune_jax.tuning.profiler import rel_error


def _xw(m, n, k, dtype=jnp.bfloat16):
  kx, kw = jax.random.split(jax.random.PRNGKey(3))
  return (jax.random.normal(kx, (m, k), jnp.float32).astype(dtype),
          jax.random.normal(kw, (k, n), jnp.float32).astype(dtype))


def test_matmul_under_jit_default_config():
  x, w = _xw(24, 40, 72)
  y = jax.jit(wt.matmul)(x, w)
  ref = jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))
  assert y.shape == (24, 40) and y.dtype == jnp.bfloat16
  assert rel_error(y, ref) < 1e-2


def test_matmul_config_dict_and_out_dtype():
  x, w = _xw(8, 16, 40)
  y = wt.matmul(x, w, config=dict(backend="triton", block_m=16, block_n=16, block_k=16,
                                  split_k=2),
                out_dtype=jnp.float32)
  assert y.dtype == jnp.float32
  assert rel_error(y, jnp.dot(x.astype(jnp.float32), w.astype(jnp.float32))) < 1e-2


@pytest.mark.parametrize("m,n,k", [(0, 5, 3), (4, 0, 3), (4, 5, 0), (0, 0, 0)])
def test_zero_size_is_what_jnp_dot_gives(m, n, k):
  x = jnp.ones((m, k), jnp.bfloat16)
  w = jnp.ones((k, n), jnp.bfloat16)
  y = wt.matmul(x, w)
  expected = jnp.dot(x, w)
  assert y.shape == expected.shape and y.dtype == expected.dtype
  np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(expected, np.float32))


@pytest.mark.parametrize("xs,ws,match", [
    ((4,), (4, 8), "x must have rank 2"),
    ((2, 4, 4), (4, 8), "x must have rank 2"),
    ((4, 4), (4,), "w must have rank 2"),
    ((4, 5), (4, 8), "inner dimensions differ"),
])
def test_bad_shapes(xs, ws, match):
  with pytest.raises(ValueError, match=match):
    wt.matmul(jnp.ones(xs, jnp.bfloat16), jnp.ones(ws, jnp.bfloat16))


def test_bad_dtypes():
  with pytest.raises(ValueError, match="x.dtype=int8 is not supported"):
    wt.matmul(jnp.ones((4, 4), jnp.int8), jnp.ones((4, 4), jnp.int8))
  with pytest.raises(ValueError, match="must be the same$"):
    wt.matmul(jnp.ones((4, 4), jnp.bfloat16), jnp.ones((4, 4), jnp.float32))
  # Quantized operands: the error names the quantized op.
  for xd, wd in [("bfloat16", "int8"), ("bfloat16", "int4"), ("float8_e4m3fn", "float8_e4m3fn"),
                 ("int8", "int8")]:
    with pytest.raises(ValueError, match=r"with their scales: wt\.quantized_matmul\)$"):
      wt.matmul(jnp.ones((4, 4), xd), jnp.ones((4, 4), wd))
  with pytest.raises(ValueError, match=r"with their scales: wt\.quantized_ragged_dot\)$"):
    wt.ragged_dot(jnp.ones((4, 4), jnp.bfloat16), jnp.ones((2, 4, 4), jnp.int8),
                  jnp.array([2, 2], jnp.int32))


@pytest.mark.parametrize("fields,match", [
    (dict(block_m=48), "block_m=48 must be a power of two"),
    (dict(block_n=8), "block_n=8 must be a power of two >= 16"),
    (dict(split_k=0), "split_k=0 must be >= 1"),
    (dict(num_warps=3), "num_warps=3"),
    (dict(num_stages=0), "num_stages=0"),
    (dict(group_m=0), "group_m=0"),
    (dict(block_k=64.0), "block_k=64.0 must be an int"),
])
def test_invalid_config_fields(fields, match):
  with pytest.raises(ValueError, match=match):
    MatmulConfig(**fields)


def test_unknown_config_field():
  x, w = _xw(8, 16, 32)
  with pytest.raises(ValueError, match=r"unknown TritonMatmulConfig field\(s\) \['block_q'\]"):
    wt.matmul(x, w, config=dict(backend="triton", block_q=32))
  with pytest.raises(ValueError, match="has no backend 'cudnn'"):
    wt.matmul(x, w, config=dict(backend="cudnn"))


@pytest.mark.parametrize("out_dtype,match", [
    (jnp.int8, "out_dtype=int8 must be one of"),
    ("int32", "out_dtype=int32 must be one of"),
    ("not a dtype", "must be one of"),
])
def test_non_float_out_dtype_is_an_error(out_dtype, match):
  x, w = _xw(8, 16, 32)
  with pytest.raises(ValueError, match=match):
    wt.matmul(x, w, out_dtype=out_dtype)


def test_config_beyond_the_gpu_shared_memory_is_an_error():
  from wavetune_jax.core.op import choose
  p = wt.MatmulProblem(m=256, n=256, k=1024)
  big = MatmulConfig(block_m=256, block_n=256, block_k=128, num_stages=8)
  with pytest.raises(ValueError, match="bytes of shared memory"):
    choose(wt.MATMUL, p, big, wt.get_hardware("h100"))


def test_grad_is_a_clear_error():
  x, w = _xw(8, 16, 32)
  with pytest.raises(NotImplementedError, match="forward only"):
    jax.grad(lambda x: wt.matmul(x, w).astype(jnp.float32).sum())(x)


def test_split_k_larger_than_k_blocks():
  x, w = _xw(8, 16, 100)  # ceil(100 / 32) = 4 K blocks
  with pytest.raises(ValueError, match=r"split_k=8 is larger than the number of K blocks"):
    wt.matmul(x, w, config=MatmulConfig(block_k=32, split_k=8))


def test_config_must_be_a_config():
  x, w = _xw(8, 16, 32)
  with pytest.raises(ValueError, match="config"):
    wt.matmul(x, w, config=(16, 16, 16))
