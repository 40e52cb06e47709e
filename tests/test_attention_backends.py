"""Attention backends: each backend's tests subclass one shared base.

Numerics run in Pallas interpret mode against the float32 reference for the
backends that have one (Triton); the Mosaic GPU kernel has no CPU interpret
mode, so its numerics run on the GPU in every sweep measurement and here its
configs, space rules and errors are tested.
"""

import dataclasses

import jax
import jax.numpy as jnp
import pytest

from pallas_kernels.attention.reference import attention_reference
from wavetune_jax import ATTENTION, AttentionProblem, get_hardware
from wavetune_jax.tuning.profiler import rel_error

H100 = get_hardware("h100")
A100 = get_hardware("a100")


def qkv(b, sq, skv, hq, hkv, d, dtype=jnp.bfloat16, seed=0):
  ks = jax.random.split(jax.random.PRNGKey(seed), 3)
  q = jax.random.normal(ks[0], (b, sq, hq, d), jnp.float32).astype(dtype)
  k = jax.random.normal(ks[1], (b, skv, hkv, d), jnp.float32).astype(dtype)
  v = jax.random.normal(ks[2], (b, skv, hkv, d), jnp.float32).astype(dtype)
  return q, k, v


def problem_of(q, k, causal):
  return AttentionProblem(batch=q.shape[0], q_heads=q.shape[2], kv_heads=k.shape[2],
                          q_len=q.shape[1], kv_len=k.shape[1], head_dim=q.shape[3],
                          causal=causal, dtype=q.dtype.name)


class AttentionBackendTests:
  """Shared tests of an attention backend. Subclasses set ``name`` and
  ``small`` (a config for short test shapes) and ``big`` (for length 1000)."""

  name: str
  small: dict
  big: dict

  @property
  def backend(self):
    return ATTENTION.backend(self.name)

  def check(self, q, k, v, config, causal, scale=None):
    if not self.backend.interpret:
      pytest.skip(f"the {self.name} kernel has no CPU interpret mode (checked on the GPU)")
    p = problem_of(q, k, causal)
    ATTENTION.validate(p, config)
    out = self.backend.run(p, config, q, k, v, interpret=True, scale=scale)
    assert out.shape == q.shape and out.dtype == q.dtype
    # Interpret mode fills outputs with NaN first: unwritten rows show up here.
    assert not bool(jnp.isnan(out.astype(jnp.float32)).any()), "unwritten output rows"
    ref = attention_reference(q, k, v, causal=causal, scale=scale, out_dtype=jnp.float32)
    assert rel_error(out, ref) < 1e-2

  def cfg(self, d):
    return self.backend.config_cls(**d)

  @pytest.mark.parametrize("causal", [True, False])
  @pytest.mark.parametrize("ratio", [1, 4])
  def test_short_lengths_gqa(self, causal, ratio):
    q, k, v = qkv(2, 7, 7, 2 * ratio, 2, self.head_dim)
    self.check(q, k, v, self.cfg(self.small), causal)

  @pytest.mark.parametrize("causal", [True, False])
  def test_ragged_length_1000(self, causal):
    # 1000 is not a multiple of any block: ragged last query and KV blocks.
    q, k, v = qkv(1, 1000, 1000, 4, 1, self.head_dim)
    self.check(q, k, v, self.cfg(self.big), causal)

  def test_cross_lengths_scale_and_float16(self):
    q, k, v = qkv(1, 40, 104, 4, 1, 64, dtype=jnp.float16)
    self.check(q, k, v, self.cfg(self.small), True, scale=0.3)

  def test_every_config_of_the_space_validates(self):
    p = AttentionProblem(batch=1, q_heads=32, kv_heads=8, q_len=4096)
    space = self.backend.space(p, H100)
    assert space
    for c in space:
      assert isinstance(c, self.backend.config_cls)
      self.backend.validate(p, c, H100)
      assert self.backend.occupancy_bound(p, c, H100) >= 1
      g, l = self.backend.coords(p, self.backend.macro(c))
      assert g >= 1 and l >= 1
    assert ATTENTION.config_from_dict(ATTENTION.config_to_dict(space[0])) == space[0]

  def test_bad_config_fields_name_the_field(self):
    with pytest.raises(ValueError, match="block_q"):
      self.backend.config_cls(**{**self.small, "block_q": 48})
    with pytest.raises(ValueError, match="unknown"):
      ATTENTION.config_from_dict({"backend": self.name, "block_m": 64})


class TestTritonAttention(AttentionBackendTests):
  name = "triton"
  head_dim = 96  # padded to 128 inside the kernel
  small = dict(block_q=16, block_k=16)
  big = dict(block_q=128, block_k=64)

  @pytest.mark.parametrize("d", [64, 256])
  def test_head_dims(self, d):
    q, k, v = qkv(1, 100, 100, 4, 2, d)
    self.check(q, k, v, self.cfg(dict(block_q=32, block_k=32)), True)

  def test_space_rules(self):
    p = AttentionProblem(batch=2, q_heads=32, kv_heads=8, q_len=3000, head_dim=128)
    space = self.backend.space(p, H100)
    assert all(c.num_warps == 4 or c.block_q >= 128 for c in space)  # A3
    assert all(self.backend.smem_bytes(p, c) <= H100.smem_per_block for c in space)  # A2
    assert self.backend.runs_on(H100) and self.backend.runs_on(A100)


class TestMosaicAttention(AttentionBackendTests):
  name = "mosaic"
  head_dim = 128
  small = dict(block_q=128, block_k=64)
  big = dict(block_q=128, block_k=128)

  def test_config_validation(self):
    for bad, match in [({"block_q": 64}, "block_q=64"), ({"block_k": 32}, "block_k=32"),
                       ({"num_stages": 1}, "num_stages=1")]:
      with pytest.raises(ValueError, match=match):
        self.cfg({**self.big, **bad})
    # Files recorded when both kernels shared one config class.
    c = ATTENTION.config_from_dict({"block_q": 128, "block_k": 128, "num_warps": 12,
                                    "num_stages": 2, "backend": 1})
    assert c == self.cfg(dict(block_q=128, block_k=128, num_stages=2))
    with pytest.raises(ValueError, match="num_warps"):
      ATTENTION.config_from_dict({"block_q": 128, "block_k": 128, "num_warps": 8,
                                  "num_stages": 2, "backend": 1})

  @pytest.mark.parametrize("shape,kv,causal,match", [
      ((1, 256, 4, 104), 256, True, r"head_dim a multiple of 16 in \[64, 256\]; got 104"),
      ((1, 256, 4, 48), 256, True, "got 48"),
      ((1, 256, 4, 128), 128, True, "q_len <= kv_len"),
  ])
  def test_a_call_it_cannot_run_is_a_value_error(self, shape, kv, causal, match):
    q = jnp.ones(shape, jnp.bfloat16)
    k = jnp.ones(shape[:1] + (kv,) + shape[2:], jnp.bfloat16)
    with pytest.raises(ValueError, match=match):
      ATTENTION.validate(problem_of(q, k, causal), self.cfg(self.big))

  def test_tiles_take_the_widest_swizzle_and_lengths_pad_to_8(self):
    from pallas_kernels.attention import mosaic as kernel
    assert [kernel.swizzle_bytes(d, 2) for d in (64, 80, 96, 128, 160, 192, 224, 256)] == [
        128, 32, 64, 128, 64, 128, 64, 128]
    x = jnp.ones((2, 777, 3, 96), jnp.bfloat16)
    padded = kernel._pad_seq(x, kernel.SEQ_MULTIPLE)
    assert padded.shape == (2, 784, 3, 96)
    assert float(padded[:, 777:].astype(jnp.float32).sum()) == 0.0
    assert kernel._pad_seq(padded, kernel.SEQ_MULTIPLE) is padded

  def test_needs_hopper_and_a_gpu(self):
    p = AttentionProblem(batch=1, q_heads=4, kv_heads=4, q_len=256)
    with pytest.raises(ValueError, match="does not run on"):
      ATTENTION.validate(p, self.cfg(self.big), A100)
    assert not self.backend.runs_on(A100)
    assert self.backend.supported_on(H100)
    assert not self.backend.runs_on(dataclasses.replace(H100, interpret=True))
    q = jnp.ones((1, 256, 4, 128), jnp.bfloat16)
    with pytest.raises(NotImplementedError, match="no CPU interpret mode"):
      self.backend.run(p, self.cfg(self.big), q, q, q, interpret=True)

  def test_space_rules(self):
    p = AttentionProblem(batch=1, q_heads=32, kv_heads=8, q_len=4096)
    space = self.backend.space(p, H100)
    assert self.cfg(self.big) in space
    for c in space:  # M1-M3
      assert (c.block_q // 2) * (p.head_dim + c.block_k) // 128 <= 160
    assert not ATTENTION.with_backends(["mosaic"]).space(p, A100)  # Hopper only
    # Ragged lengths have the same configs; those the kernel would pad on the
    # device (not multiples of 8) only unpruned (rule M4).
    for q in (1000, 3000):
      assert self.backend.space(ATTENTION.with_size(p, q), H100) == space
    for q in (1001, 2044):
      assert not self.backend.space(ATTENTION.with_size(p, q), H100)
      assert self.backend.space(ATTENTION.with_size(p, q), H100, prune=False) == space
    # head_dim: multiples of 16 in [64, 256] (the swizzle of its tiles).
    for d in (80, 96, 160, 192, 256):
      assert self.backend.space(dataclasses.replace(p, head_dim=d), H100), d
    for d in (48, 104, 248):
      assert not self.backend.space(dataclasses.replace(p, head_dim=d), H100), d
    assert self.backend.size_quantum(dataclasses.replace(p, head_dim=48)) is None
    short = self.backend.space(ATTENTION.with_size(p, 72), H100)
    assert short and all(c.block_q == 128 and c.block_k <= 128 for c in short)
    assert self.backend.size_quantum(p) == 1 and ATTENTION.size_quantum(p) == 1
    assert self.backend.occupancy_bound(p, space[0], H100) == 1
