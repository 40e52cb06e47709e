"""The Mosaic GPU and XLA backends of the GEMM family on a CPU.

The Mosaic kernel has no interpret mode; its lowering to a CUDA module does
run here, and that is where Mosaic raises its layout, tiling and shared-memory
errors: every config of the space must lower. Its numerics are checked on a
Hopper GPU (benchmarks/matmul_mosaic.py and every sweep row).
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wavetune_jax as wt
from pallas_kernels.matmul import mosaic as kernel
from wavetune_jax import MATMUL, MatmulProblem, get_hardware

H100 = get_hardware("h100")
MOSAIC = MATMUL.backend("mosaic")
XLA = MATMUL.backend("xla")


def _lower(p, c):
  x = jax.ShapeDtypeStruct((p.m, p.k), jnp.dtype(p.dtype))
  w = jax.ShapeDtypeStruct((p.k, p.n), jnp.dtype(p.dtype))
  f = functools.partial(kernel.matmul, config=c, out_dtype=jnp.dtype(p.out_dtype),
                        num_sms=H100.num_sms)
  return jax.jit(f).trace(x, w).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("m,n,k,out", [(8, 1280, 8192, "bfloat16"), (1000, 4096, 4096, "float32"),
                                       (4096, 6144, 4096, "bfloat16")])
def test_every_config_of_the_space_lowers(m, n, k, out):
  p = MatmulProblem(m=m, n=n, k=k, out_dtype=out)
  space = MOSAIC.space(p, H100)
  assert space
  for c in space[:: max(1, len(space) // 6)]:
    MOSAIC.validate(p, c, H100)
    _lower(p, c)  # raises on a layout, tiling or shared-memory error


def test_smem_estimate_is_an_upper_bound():
  # 128x192 with 5 stages needs 237,648 bytes by Mosaic's count: over the
  # H100's 232,448, so the estimate must reject it too.
  p = MatmulProblem(m=1000, n=7168, k=4096)
  c = kernel.MosaicMatmulConfig(block_m=128, block_n=192, num_stages=5)
  assert MOSAIC.smem_bytes(p, c) > H100.smem_per_block
  with pytest.raises(ValueError, match="shared"):
    MOSAIC.validate(p, c, H100)


@pytest.mark.parametrize("m,n,k,match", [(777, 4096, 4096, "M a multiple of 8"),
                                         (1024, 2080, 4096, "N and K multiples of 64"),
                                         (1024, 2048, 4000, "N and K multiples of 64")])
def test_shapes_tma_cannot_tile_are_refused(m, n, k, match):
  p = MatmulProblem(m=m, n=n, k=k)
  assert MOSAIC.space(p, H100) == ()
  assert MOSAIC.size_quantum(p) is None
  with pytest.raises(ValueError, match=match):
    MOSAIC.validate(p, kernel.MosaicMatmulConfig(), H100)


def test_config_checks():
  with pytest.raises(ValueError, match="block_n"):
    kernel.MosaicMatmulConfig(block_m=64, block_n=64)
  with pytest.raises(ValueError, match="registers"):
    kernel.MosaicMatmulConfig(block_m=256, block_n=256)
  with pytest.raises(ValueError, match="split_k"):
    kernel.MosaicMatmulConfig(split_k=0)
  with pytest.raises(ValueError, match="float32"):
    MOSAIC.validate(MatmulProblem(m=64, n=64, k=64, dtype="float32"),
                    kernel.MosaicMatmulConfig(), H100)


def test_split_k_only_below_one_wave_and_coords():
  small = MOSAIC.space(MatmulProblem(m=16, n=4096, k=4096), H100)
  large = MOSAIC.space(MatmulProblem(m=4096, n=4096, k=4096), H100)
  assert any(c.split_k > 1 for c in small)
  assert all(c.split_k == 1 for c in large)
  p = MatmulProblem(m=100, n=4096, k=4096)
  c = kernel.MosaicMatmulConfig(block_m=64, block_n=128, split_k=3)
  # tiles (2 x 32) x 3 splits; ceil(64 K blocks / 3) steps per split
  assert MATMUL.coords(p, c) == (2 * 32 * 3, 22)


def test_mosaic_is_not_a_candidate_where_it_cannot_run():
  for m in (777, 1001):
    p = MatmulProblem(m=m, n=4096, k=4096)
    names = [b.name for b in MATMUL.decision_backends(p, H100)]
    assert "mosaic" not in names and "xla" in names
  p = MatmulProblem(m=776, n=4096, k=4096)
  assert "mosaic" in [b.name for b in MATMUL.decision_backends(p, H100)]
  assert MATMUL.size_quantum(p) == 8


def test_xla_backend_is_jnp_dot_and_the_cpu_default():
  kx, kw = jax.random.split(jax.random.PRNGKey(1))
  x = jax.random.normal(kx, (37, 96), jnp.float32).astype(jnp.bfloat16)
  w = jax.random.normal(kw, (96, 80), jnp.float32).astype(jnp.bfloat16)
  want = jnp.dot(x, w, preferred_element_type=jnp.float32)
  got = wt.matmul(x, w, config=wt.XlaMatmulConfig(), out_dtype=jnp.float32)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
  p = MatmulProblem(m=37, n=80, k=96)
  assert MATMUL.heuristic(p, H100) == wt.XlaMatmulConfig()
  assert MATMUL.config_from_dict({"backend": "xla"}) == wt.XlaMatmulConfig()
  assert MATMUL.variant(wt.XlaMatmulConfig()) == (("backend", "xla"),)


@pytest.mark.parametrize("m", [1, 16, 64, 128, 1000, 8192])
def test_every_suite_weight_has_mosaic_tiles(m):
  # A wide weight (lm_head) at small M once had no tile: the small-M rule
  # (no tile taller than M) and the wide-grid rule (big tiles only) conflicted.
  for n, k in [(128256, 4096), (1280, 8192), (28672, 4096)]:
    assert MOSAIC.space(MatmulProblem(m=m, n=n, k=k), H100)


def test_backends_vs_xla_reproduces_the_published_h100_numbers(capsys):
  import sys
  sys.path.insert(0, "benchmarks")
  import backends_vs_xla
  backends_vs_xla.main(["data/sweeps/nvidia_h100_80gb_hbm3/matmul_bfloat16.jsonl.gz"])
  out = capsys.readouterr().out
  assert "best pallas vs XLA: 1.017x (min 0.760) over 216" in out
  assert "best of the three (XLA included) vs XLA: 1.033x" in out
