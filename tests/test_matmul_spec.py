"""The GEMM spec and the hardware description."""

import dataclasses

import jax
import pytest

import wavetune_jax as wt

from wavetune_jax import MATMUL, MatmulProblem, get_hardware, get_family
from wavetune_jax.core.hardware import PRESETS, detect, device_key
from wavetune_jax.families.matmul.triton import ACC_PER_THREAD

TRITON = MATMUL.backend("triton")

H100 = get_hardware("h100")


def test_device_key():
  assert device_key("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3"
  assert device_key("NVIDIA H200") == "nvidia_h200"
  assert PRESETS["h200"].device_key == "nvidia_h200"
  assert get_hardware("nvidia_h200") is PRESETS["h200"]
  with pytest.raises(ValueError, match="unknown hardware"):
    get_hardware("tpu9000")


def test_detect_refuses_cpu():
  if jax.devices()[0].platform == "gpu":
    pytest.skip("runs on a GPU")
  with pytest.raises(RuntimeError, match="no GPU"):
    detect()


def test_registry():
  assert get_family("matmul") is MATMUL
  with pytest.raises(ValueError, match="unknown family 'nope'"):
    get_family("nope")


def test_problems_compare_and_hash_by_their_fields():
  import pickle
  from wavetune_jax import AttentionProblem
  p = MatmulProblem(m=300, n=4096, k=14336)
  q = MatmulProblem(m=300, n=4096, k=14336, dtype="bfloat16")
  assert p == q and hash(p) == hash(q) and {p: 1}[q] == 1
  r = dataclasses.replace(p, m=301)  # the key follows a replaced field
  assert r != p and r == MatmulProblem(m=301, n=4096, k=14336) and hash(r) == hash(
      MatmulProblem(m=301, n=4096, k=14336))
  assert p != MatmulProblem(m=300, n=4096, k=14336, out_dtype="float32")
  a = AttentionProblem(batch=1, q_heads=32, kv_heads=8, q_len=100)
  b = pickle.loads(pickle.dumps(a))
  assert a == b and hash(a) == hash(b) and a.kv_len == 100
  assert a != AttentionProblem(batch=1, q_heads=32, kv_heads=8, q_len=100, causal=False)
  assert a != p and MATMUL.problem_to_dict(p) == {
      "m": 300, "n": 4096, "k": 14336, "dtype": "bfloat16", "out_dtype": "bfloat16"}


def test_problem_validation():
  with pytest.raises(ValueError, match="m=0"):
    MatmulProblem(m=0, n=1, k=1)
  with pytest.raises(ValueError, match="dtype"):
    MatmulProblem(m=1, n=1, k=1, dtype="int8")
  p = MatmulProblem(m=3, n=4, k=5, dtype="bfloat16")
  assert p.out_dtype == "bfloat16"
  assert MATMUL.problem_from_dict(MATMUL.problem_to_dict(p)) == p


@pytest.mark.parametrize("m,n,k", [(1, 4096, 4096), (16, 28672, 4096), (300, 1280, 8192),
                                   (4096, 4096, 14336), (16384, 128256, 4096)])
def test_space_rules(m, n, k):
  p = MatmulProblem(m=m, n=n, k=k)
  space = TRITON.space(p, H100)
  assert 10 < len(space) <= 1000
  assert len(set(space)) == len(space)
  for c in space:
    MATMUL.validate(p, c, H100)  # every config of the space is valid
    assert MATMUL.backend_of(c).smem_bytes(p, c) <= H100.smem_per_block
    assert c.block_m * c.block_n // (32 * c.num_warps) <= ACC_PER_THREAD[1]
    tiles = -(-m // c.block_m) * -(-n // c.block_n)
    if c.split_k > 1:
      assert tiles < H100.num_sms
  # The rule-of-thumb configs are members of the space.
  assert TRITON.heuristic(p, H100) in space


def test_split_k_only_for_small_grids():
  small = TRITON.space(MatmulProblem(m=16, n=4096, k=4096), H100)
  large = TRITON.space(MatmulProblem(m=4096, n=4096, k=4096), H100)
  assert any(c.split_k > 1 for c in small)
  assert all(c.split_k == 1 for c in large)


def test_unpruned_space_is_a_superset():
  p = MatmulProblem(m=100, n=512, k=1024)
  assert set(MATMUL.space(p, H100)) <= set(MATMUL.space(p, H100, prune=False))


def test_macro_micro_split_covers_every_field():
  c = MATMUL.default(MatmulProblem(m=5, n=6, k=7))
  b = MATMUL.backend_of(c)
  macro, micro = MATMUL.macro(c), MATMUL.micro(c)
  assert set(macro).isdisjoint(micro)
  assert {"backend": b.name, **macro, **micro} == MATMUL.config_to_dict(c)
  # Macro fields are exactly those that move (G, L).
  p = MatmulProblem(m=1000, n=4096, k=4096)
  for field in b.micro_fields:
    other = dataclasses.replace(c, **{field: 2 * getattr(c, field)})
    assert MATMUL.coords(p, other) == MATMUL.coords(p, c)
  for field in b.macro_fields:
    other = dataclasses.replace(c, **{field: 2 * getattr(c, field)})
    assert MATMUL.coords(p, other) != MATMUL.coords(p, c)


def test_coords():
  p = MatmulProblem(m=1000, n=4096, k=4096)
  cfg = wt.TritonMatmulConfig
  g, l = MATMUL.coords(p, cfg(block_m=128, block_n=256, block_k=64, split_k=1))
  assert (g, l) == (8 * 16, 64)
  g, l = MATMUL.coords(p, cfg(block_m=16, block_n=64, block_k=64, split_k=4))
  assert (g, l) == (63 * 64 * 4, 16)


def test_heuristic_uses_split_k_for_small_m():
  c = TRITON.heuristic(MatmulProblem(m=16, n=4096, k=4096), H100)
  assert c.block_m == 16 and c.split_k > 1
  c = TRITON.heuristic(MatmulProblem(m=4096, n=4096, k=4096), H100)
  assert (c.block_m, c.block_n, c.split_k) == (128, 256, 1)


def test_validate_smem():
  p = MatmulProblem(m=512, n=512, k=512, dtype="float32")
  c = dataclasses.replace(MATMUL.default(p), block_m=256, block_n=256, block_k=128,
                          num_stages=4)
  with pytest.raises(ValueError, match="shared memory"):
    MATMUL.validate(p, c, H100)
