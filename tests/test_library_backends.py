"""cuDNN and XLA as attention backends (rows recorded as baselines), the
attention heuristic's choice of backend, and the grouped GEMM's split-K rule."""

import os

import pytest

from wavetune_jax import (ATTENTION, RAGGED_DOT, AttentionProblem, CudnnAttentionConfig,
                          XlaAttentionConfig, get_hardware)
from wavetune_jax.families.ragged_dot.problem import RaggedDotProblem
from wavetune_jax.tuning import report, sweep

H200_SWEEP = os.path.join(os.path.dirname(__file__), "..", "data", "sweeps", "nvidia_h200",
                          "attention_bfloat16.jsonl.gz")
H200 = get_hardware("h200")


def test_baseline_rows_become_config_rows_of_the_recorded_backends():
  header, rows = sweep.read_sweep(H200_SWEEP)
  hw = report.hardware_of(header)
  out = sweep.with_recorded_backends(ATTENTION, hw, rows)
  base = {(r["key"].split("|")[0], r["impl"]): r for r in rows
          if r["impl"] in ("baseline", "baseline_xla")}
  derived = [r for r in out[len(rows):]]
  assert derived and all(r["impl"] == "pallas" for r in derived)
  for r in derived:
    impl = "baseline" if r["config"] == {"backend": "cudnn"} else "baseline_xla"
    assert r["config"] in ({"backend": "cudnn"}, {"backend": "xla"})
    src = base[(r["key"].split("|")[0], impl)]
    assert (r["median_us"], r["status"]) == (src["median_us"], src["status"])
  assert len(derived) == len(base)
  # A problem with a row of its own for a backend gets no derived row for it.
  again = sweep.with_recorded_backends(ATTENTION, hw, out)
  assert len(again) == len(out)


def test_sweeps_do_not_time_recorded_backends_twice():
  p = AttentionProblem(batch=2, q_heads=32, kv_heads=8, q_len=3000, head_dim=128)
  space = ATTENTION.space(p, H200)
  assert CudnnAttentionConfig() in space and XlaAttentionConfig() in space
  configs = sweep.sweep_configs(ATTENTION, p, H200)
  assert configs and not any(isinstance(c, (CudnnAttentionConfig, XlaAttentionConfig))
                             for c in configs)


@pytest.mark.parametrize("batch,q_len,cudnn", [(1, 128, False), (1, 512, True),
                                               (8, 512, True), (1, 16384, True)])
def test_cudnn_where_its_tiles_make_more_than_one_wave(batch, q_len, cudnn):
  p = AttentionProblem(batch=batch, q_heads=32, kv_heads=8, q_len=q_len, head_dim=128)
  # 32 heads x ceil(q_len / 128) x batch query tiles against 132 SMs: cuDNN
  # from half of them (512 tokens: 128 tiles).
  assert isinstance(ATTENTION.heuristic(p, H200), CudnnAttentionConfig) == cudnn


@pytest.mark.parametrize("shape,backend", [
    # (batch, q_heads, kv_heads, q_len, head_dim): 132 SMs, 128-row tiles.
    ((1, 32, 32, 2048, 96), "mosaic"),   # above one wave, head_dim not a multiple of 64
    ((2, 16, 16, 1000, 160), "mosaic"),
    ((6, 32, 32, 200, 96), "cudnn"),     # ... from 1,000 tokens
    ((1, 16, 16, 2000, 192), "cudnn"),   # a multiple of 64: cuDNN above one wave
    ((4, 32, 32, 777, 96), "cudnn"),     # the Mosaic kernel would pad 777
    ((1, 16, 8, 777, 256), "cudnn"),     # 112 programs, in Mosaic's band, but padded
    ((1, 16, 8, 776, 128), "cudnn"),     # the same band, no padding (H200 sweep: cuDNN)
    ((1, 16, 8, 256, 128), "triton"),    # fewer programs than half the SMs
    ((1, 8, 1, 1000, 128), "triton"),    # ... recomputing 24 of 1,000 rows
    ((1, 28, 4, 200, 128), "mosaic"),    # ... recomputing 56 of 200 rows in Triton
    ((1, 16, 8, 200, 256), "triton"),    # ... 32-row Triton blocks: 24 of 200 rows
    ((1, 8, 8, 200, 128), "triton"),
    ((1, 16, 16, 4096, 224), "cudnn"),   # not a multiple of 64, but 128x128 does not fit
    ((1, 16, 16, 777, 72), "triton"),    # Mosaic does not run 72: no padding rule
])
def test_heuristic_backend_by_waves_head_dim_and_padding(shape, backend):
  b, h, hk, q, d = shape
  p = AttentionProblem(batch=b, q_heads=h, kv_heads=hk, q_len=q, head_dim=d)
  assert ATTENTION.backend_of(ATTENTION.heuristic(p, H200)).name == backend


@pytest.mark.parametrize("shape,block_k", [
    # (batch, q_heads, kv_heads, q_len, head_dim): 64-row programs vs 132 SMs.
    ((1, 8, 1, 1000, 128), 128),   # 128 programs of 1,000 keys: one wave
    ((1, 4, 4, 2048, 128), 128),
    ((1, 8, 1, 768, 128), 64),     # shorter than LONG_KV
    ((2, 8, 1, 1000, 128), 64),    # 256 programs: two waves
    ((1, 8, 2, 1000, 64), 64),     # head_dim 64: 64-key blocks measured faster
])
def test_triton_takes_128_key_blocks_for_one_wave_of_long_programs(shape, block_k):
  b, h, hk, q, d = shape
  p = AttentionProblem(batch=b, q_heads=h, kv_heads=hk, q_len=q, head_dim=d)
  c = ATTENTION.backend("triton").heuristic(p, H200)
  assert (c.block_q, c.block_k, c.num_stages) == (64, block_k, 3)


def test_selection_of_a_length_does_not_depend_on_the_lengths_before():
  # cuDNN's heuristic changes with the length (padding, waves), so the
  # selector may not copy one length's answer to its neighbours.
  from wavetune_jax.runtime import selector
  p = AttentionProblem(batch=1, q_heads=16, kv_heads=8, q_len=777, head_dim=128)

  # The table's decisions before the guard (a fresh Decider: no memo); with
  # the guard every one of them is cuDNN here (no sweep has 16/8 heads).
  hw = get_hardware("nvidia_h100_80gb_hbm3")
  table = selector.active_table("attention", hw)

  def backends(order):
    d = selector.Decider(table, hw)
    return {q: ATTENTION.backend_of(d.decide(ATTENTION.with_size(p, q)).config).name
            for q in order}
  # 512 tokens: 64 programs of 128 rows, under half the H100's SMs (a Pallas
  # kernel's rule); 513 and 520: more (cuDNN's).
  alone = backends((512,))[512]
  after = backends((513, 520, 512))
  assert alone == after[512] == "triton"
  assert after[513] == after[520] == "cudnn"
  assert selector.select("attention", ATTENTION.with_size(p, 512), hw).source == "guard"


def test_cudnn_refuses_what_it_does_not_run():
  for p in (AttentionProblem(batch=8, q_heads=32, kv_heads=8, q_len=4096, head_dim=100),
            AttentionProblem(batch=8, q_heads=32, kv_heads=8, q_len=4096, lengths=True),
            AttentionProblem(batch=8, q_heads=32, kv_heads=8, q_len=4096,
                             causal_align="bottom_right", kv_len=8192)):
    assert CudnnAttentionConfig() not in ATTENTION.space(p, H200)
    assert not isinstance(ATTENTION.heuristic(p, H200), CudnnAttentionConfig)
    with pytest.raises(ValueError):
      ATTENTION.validate(p, CudnnAttentionConfig(), H200)
  assert not ATTENTION.backend("cudnn").runs_on(get_hardware(None))  # no GPU here


def test_grouped_gemm_splits_k_only_where_tiles_leave_most_sms_idle():
  w2 = RaggedDotProblem(m=2, g=8, k=14336, n=4096)  # Mixtral w2, one token: 32 tiles
  w13 = RaggedDotProblem(m=2, g=8, k=4096, n=28672)  # 224 tiles
  assert RAGGED_DOT.heuristic(w2, H200).split_k == 4
  assert RAGGED_DOT.heuristic(w13, H200).split_k == 1
  for p in (w2, w13):
    assert RAGGED_DOT.heuristic(p, H200) in RAGGED_DOT.space(p, H200)


def test_cudnn_takes_the_half_to_one_wave_band_only_from_the_mosaic_rule():
  # 128 programs of 128 rows on 132 SMs: cuDNN where the Mosaic rule would
  # have answered (Hopper, head_dim 128); on an A100 (no Mosaic kernel) the
  # band stays with Triton's rule, and head_dims the Mosaic kernel wins at
  # above half the SMs (not multiples of 64) stay with it.
  a100 = get_hardware("a100")
  p = AttentionProblem(batch=1, q_heads=32, kv_heads=8, q_len=512, head_dim=128)
  assert isinstance(ATTENTION.heuristic(p, H200), CudnnAttentionConfig)
  p_a100 = AttentionProblem(batch=1, q_heads=24, kv_heads=8, q_len=512, head_dim=128)
  assert a100.num_sms // 2 <= 24 * 4 <= a100.num_sms  # the A100's band (108 SMs)
  assert ATTENTION.backend_of(ATTENTION.heuristic(p_a100, a100)).name == "triton"
  p96 = AttentionProblem(batch=1, q_heads=32, kv_heads=8, q_len=1024, head_dim=96)
  assert ATTENTION.backend_of(ATTENTION.heuristic(p96, H200)).name == "mosaic"
