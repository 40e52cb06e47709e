"""GEMM backends: each backend's tests subclass one shared base (numerics in
Pallas interpret mode against the float32 reference, space, validation, mapping)."""

import random

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.matmul.reference import matmul_reference
from pallas_kernels.matmul.triton import TritonMatmulConfig as MatmulConfig
from pallas_kernels.matmul.triton import matmul
from wavetune_jax import MATMUL, MatmulProblem, get_hardware
from wavetune_jax.tuning.profiler import rel_error

H100 = get_hardware("h100")


class MatmulBackendTests:
  """Shared tests of a GEMM backend; subclasses set ``name`` and ``small``
  (a config valid for the small test shapes)."""

  name: str
  small: dict

  @property
  def backend(self):
    return MATMUL.backend(self.name)

  def run(self, problem, config, seed=0):
    x, w = MATMUL.inputs(problem, jax.random.PRNGKey(seed))
    MATMUL.validate(problem, config)
    out = self.backend.run(problem, config, x, w, interpret=True)
    assert out.shape == (problem.m, problem.n) and out.dtype == jnp.dtype(problem.out_dtype)
    return out, MATMUL.reference(problem, x, w)

  def test_random_configs_from_the_space_match_the_reference(self):
    if not self.backend.interpret:
      pytest.skip(f"the {self.name} kernel has no CPU interpret mode")
    problem = MatmulProblem(m=48, n=96, k=200)
    space = self.backend.space(problem, H100)
    assert space
    rng = random.Random(1234)
    for cfg in rng.sample(space, min(8, len(space))):
      out, ref = self.run(problem, cfg, seed=rng.randrange(100))
      _check(out, ref, MATMUL.tolerance(problem))

  @pytest.mark.parametrize("dtype,out_dtype", [
      ("bfloat16", "float32"), ("float16", "float16"), ("float16", "float32"),
      ("float32", "float32")])
  def test_dtypes(self, dtype, out_dtype):
    if not self.backend.interpret:
      pytest.skip(f"the {self.name} kernel has no CPU interpret mode")
    p = MatmulProblem(m=45, n=70, k=99, dtype=dtype, out_dtype=out_dtype)
    out, ref = self.run(p, self.backend.config_cls(**self.small))
    _check(out, ref, MATMUL.tolerance(p))

  def test_every_config_of_the_space_validates_and_maps(self):
    p = MatmulProblem(m=1000, n=4096, k=4096)
    space = self.backend.space(p, H100)
    assert space and len(set(space)) == len(space)
    for c in space:
      self.backend.validate(p, c, H100)
      assert self.backend.occupancy_bound(p, c, H100) >= 1
      g, l = self.backend.coords(p, self.backend.macro(c))
      assert g >= 1 and l >= 1
      assert MATMUL.config_from_dict(MATMUL.config_to_dict(c)) == c
    h = MATMUL.heuristic(p, H100)
    MATMUL.validate(p, h, H100)


class TestTritonMatmul(MatmulBackendTests):
  name = "triton"
  small = dict(block_m=32, block_n=32, block_k=32, split_k=2)

  @pytest.mark.parametrize("m,n,k,fields", [
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
      (70, 90, 130, dict(block_m=32, block_n=32, block_k=32, split_k=5, group_m=2)),
  ])
  def test_awkward_shapes(self, m, n, k, fields):
    out, ref = self.run(MatmulProblem(m=m, n=n, k=k), MatmulConfig(**fields))
    _check(out, ref, 1e-2)


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
