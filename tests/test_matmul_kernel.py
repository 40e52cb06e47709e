"""GEMM kernel correctness in Pallas interpret mode (CPU)."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matmul import MatmulConfig, matmul, matmul_reference
from wavetune_jax import MATMUL, MatmulProblem, get_hardware
from wavetune_jax.profiler import rel_error

H100 = get_hardware("h100")


def _run(m, n, k, config, dtype=jnp.bfloat16, out_dtype=None, seed=0):
  kx, kw = jax.random.split(jax.random.PRNGKey(seed))
  x = jax.random.normal(kx, (m, k), jnp.float32).astype(dtype)
  w = jax.random.normal(kw, (k, n), jnp.float32).astype(dtype)
  out = matmul(x, w, config=config, out_dtype=out_dtype, interpret=True)
  ref = matmul_reference(x, w, jnp.float32)
  return out, ref


def _check(out, ref, tol):
  # Interpret mode fills outputs with NaN before the kernel runs, so an element
  # the kernel never wrote shows up here as NaN.
  assert not bool(jnp.isnan(out).any()), "unwritten (NaN) output elements"
  err = rel_error(out, ref)
  assert err < tol, f"relative error {err:.3g} >= {tol}"


def test_interpret_outputs_start_as_nan_poison():
  # The poison check above relies on this: a kernel that writes nothing
  # leaves NaN behind in interpret mode.
  from jax.experimental import pallas as pl
  out = pl.pallas_call(lambda o_ref: None,
                       out_shape=jax.ShapeDtypeStruct((4, 4), jnp.float32),
                       interpret=True)()
  assert bool(jnp.isnan(out).all())


AWKWARD = [
    # (m, n, k, config fields)
    (1, 1, 1, dict(block_m=16, block_n=16, block_k=16)),
    (37, 53, 71, dict(block_m=16, block_n=32, block_k=16)),
    (127, 131, 97, dict(block_m=32, block_n=64, block_k=32, group_m=3)),
    (1, 300, 257, dict(block_m=16, block_n=64, block_k=64)),
    (64, 64, 100, dict(block_m=32, block_n=32, block_k=64)),   # K % block_k != 0
    (33, 40, 200, dict(block_m=16, block_n=32, block_k=32, split_k=3)),
    (16, 64, 512, dict(block_m=16, block_n=64, block_k=32, split_k=16)),
    (5, 7, 300, dict(block_m=16, block_n=128, block_k=64, split_k=2)),  # N < block_n
    (200, 24, 64, dict(block_m=64, block_n=32, block_k=32, group_m=2)),
    (70, 90, 130, dict(block_m=32, block_n=32, block_k=32, split_k=5, group_m=2)),  # empty split
]


@pytest.mark.parametrize("m,n,k,fields", AWKWARD)
def test_awkward_shapes(m, n, k, fields):
  out, ref = _run(m, n, k, MatmulConfig(**fields))
  assert out.shape == (m, n) and out.dtype == jnp.bfloat16
  _check(out, ref, 1e-2)


@pytest.mark.parametrize("dtype,out_dtype,tol", [
    (jnp.bfloat16, jnp.float32, 1e-2),
    (jnp.float16, None, 1e-2),
    (jnp.float16, jnp.float32, 1e-2),
    (jnp.float32, None, 1e-3),
])
def test_dtypes(dtype, out_dtype, tol):
  cfg = MatmulConfig(block_m=32, block_n=32, block_k=32, split_k=2)
  out, ref = _run(45, 70, 99, cfg, dtype=dtype, out_dtype=out_dtype)
  assert out.dtype == jnp.dtype(out_dtype or dtype)
  _check(out, ref, tol)


def test_random_configs_from_space():
  problem = MatmulProblem(m=48, n=96, k=200)
  space = MATMUL.space(problem, H100)
  assert len(space) > 20
  rng = random.Random(1234)
  for cfg in rng.sample(space, 8):
    out, ref = _run(problem.m, problem.n, problem.k, cfg, seed=rng.randrange(100))
    _check(out, ref, 1e-2)


def test_split_k_matches_unsplit():
  base = MatmulConfig(block_m=16, block_n=32, block_k=16)
  out1, ref = _run(20, 40, 160, base)
  for sk in (2, 4, 10):
    out, _ = _run(20, 40, 160, MatmulConfig(block_m=16, block_n=32, block_k=16, split_k=sk))
    _check(out, ref, 1e-2)
    np.testing.assert_allclose(np.asarray(out, np.float32), np.asarray(out1, np.float32),
                               rtol=2e-2, atol=2e-2)


def test_grouping_covers_every_tile():
  # Many tile rows, a group size that does not divide them.
  out, ref = _run(16 * 7, 32 * 5, 32, MatmulConfig(block_m=16, block_n=32, block_k=32,
                                                   group_m=3))
  _check(out, ref, 1e-2)
