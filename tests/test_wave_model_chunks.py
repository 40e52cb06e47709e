"""Wave-model fits run in fixed-size chunks of configs, with the results of
one call over the whole batch."""

import numpy as np
import pytest

from wavetune_jax.runtime import wave_model

SMS = 132


def _batch(rng, b, n):
  g = rng.integers(1, 6 * SMS, size=(b, n)).astype(np.float64)
  l = rng.choice([4.0, 8.0, 16.0, 64.0], size=(b, n))
  coef = rng.uniform(0.1, 2.0, size=(b, 6))
  t = np.stack([np.asarray(wave_model.predict(coef[i], g[i], l[i], SMS)) for i in range(b)])
  t = t * rng.uniform(0.9, 1.1, size=t.shape)
  mask = (np.arange(n)[None, :] < rng.integers(2, n + 1, size=(b, 1))).astype(np.float32)
  return g, l, t, mask


def _spy(monkeypatch, name):
  """Records the batch size of every call of the compiled fit ``name``."""
  sizes, run = [], getattr(wave_model, name)

  def spy(x, t, mask):
    sizes.append(x.shape[0])
    return run(x, t, mask)
  monkeypatch.setattr(wave_model, name, spy)
  return sizes


@pytest.mark.parametrize("nonneg", [True, False])
def test_fit_runs_bounded_chunks_with_unchanged_results(monkeypatch, nonneg):
  rng = np.random.default_rng(0)
  g, l, t, mask = _batch(rng, 20, 16)
  caps = np.full(20, SMS)
  monkeypatch.setattr(wave_model, "_CHUNK_FLOATS", 1 << 30)
  whole = wave_model.fit(g, l, t, caps, mask=mask, nonneg=nonneg)
  per_config = 16 * 6 * (2 ** 6 if nonneg else 1)
  monkeypatch.setattr(wave_model, "_CHUNK_FLOATS", 8 * per_config)
  sizes = _spy(monkeypatch, "_fit_batch_nonneg" if nonneg else "_fit_batch")
  chunked = wave_model.fit(g, l, t, caps, mask=mask, nonneg=nonneg)
  assert sizes == [8, 8, 8]  # 20 configs, the last chunk padded
  for a, b in zip(whole, chunked):
    assert np.asarray(b).shape == np.asarray(a).shape
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))


def test_chunk_size_bounds_the_design_matrices():
  # 256 points, 8 coefficients, 2**8 active sets: 8 configs per call.
  assert wave_model._chunk_size(2048, 256, 8, True) == 8
  assert 8 * 256 * 8 * 2 ** 8 <= wave_model._CHUNK_FLOATS
  assert wave_model._chunk_size(2048, 64, 8, True) == 32
  # Never fewer than 8 configs (a batch of one computes other last bits),
  # never more than the batch rounded up to a power of two.
  assert wave_model._chunk_size(2048, 4096, 8, True) == 8
  assert wave_model._chunk_size(5, 16, 6, True) == 8
  assert wave_model._chunk_size(1, 16, 6, True) == 1


def test_occupancy_batch_is_chunked_with_unchanged_results(monkeypatch):
  rng = np.random.default_rng(1)
  g, l, t, mask = _batch(rng, 12, 24)
  bounds = rng.integers(1, 5, size=12)
  monkeypatch.setattr(wave_model, "_CHUNK_FLOATS", 1 << 30)
  occ, whole = wave_model.fit_occupancy_batch(g, l, t, num_sms=SMS, bounds=bounds, mask=mask)
  monkeypatch.setattr(wave_model, "_CHUNK_FLOATS", 8 * 32 * 6 * 2 ** 6)
  sizes = _spy(monkeypatch, "_fit_batch_nonneg")
  occ2, chunked = wave_model.fit_occupancy_batch(g, l, t, num_sms=SMS, bounds=bounds, mask=mask)
  assert len(sizes) > 1 and set(sizes) == {8}
  np.testing.assert_array_equal(occ2, occ)
  for a, b in zip(whole, chunked):
    np.testing.assert_array_equal(b, a)
