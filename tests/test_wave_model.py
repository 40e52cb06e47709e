"""The wave model on synthetic data with known coefficients and occupancy."""

import numpy as np
import pytest

from wavetune_jax.runtime import wave_model
from wavetune_jax.core.hardware import get_hardware

SMS = 132


def _points(rng, n):
  g = rng.integers(1, 6 * SMS, size=n)
  l = rng.choice([4, 8, 16, 32, 64, 128], size=n)
  return g, l


@pytest.mark.parametrize("form", wave_model.FORMS)
def test_fit_recovers_known_coefficients_batched(form):
  rng = np.random.default_rng(0)
  batch, n = 5, 60
  true = rng.uniform(0.5, 3.0, size=(batch, wave_model.N_COEF[form]))
  occ = np.array([1, 2, 1, 3, 2])
  g = np.zeros((batch, n)); l = np.zeros((batch, n)); t = np.zeros((batch, n))
  for i in range(batch):
    g[i], l[i] = _points(rng, n)
    t[i] = np.asarray(wave_model.predict(true[i], g[i], l[i], occ[i] * SMS, form))
  res = wave_model.fit(g, l, t, occ * SMS, form=form)
  np.testing.assert_allclose(np.asarray(res.coef), true, rtol=2e-3, atol=2e-3)
  assert float(np.max(res.max_err)) < 1e-3


def test_padding_is_ignored():
  rng = np.random.default_rng(1)
  true = np.array([2.0, 0.1, 1.0, 0.2, 0.5, 0.05])
  g, l = _points(rng, 40)
  t = np.asarray(wave_model.predict(true, g, l, SMS))
  mask = np.arange(40) < 30
  t_bad = np.where(mask, t, 1e6)  # garbage in the padded rows
  res = wave_model.fit(g[None], l[None], t_bad[None], [SMS], mask=mask[None])
  np.testing.assert_allclose(np.asarray(res.coef[0]), true, rtol=2e-3, atol=2e-3)


def test_occupancy_found_from_the_steps():
  rng = np.random.default_rng(2)
  true = np.array([3.0, 0.2, 2.0, 0.5, 0.3, 0.1])
  for occ in (1, 2, 3):
    g, l = _points(rng, 80)
    t = np.asarray(wave_model.predict(true, g, l, occ * SMS))
    found, res = wave_model.fit_occupancy(g, l, t, num_sms=SMS, bound=4)
    assert found == occ
    assert float(res.max_err) < 1e-3


def test_extrapolates_to_unseen_waves():
  rng = np.random.default_rng(3)
  true = np.array([3.0, 0.2, 2.0, 0.5, 0.3, 0.1])
  g = rng.integers(1, 2 * SMS, size=50)  # waves 1 and 2 only
  l = rng.choice([8, 16, 64], size=50)
  t = np.asarray(wave_model.predict(true, g, l, SMS))
  res = wave_model.fit(g[None], l[None], t[None], [SMS])
  g_far = np.array([5 * SMS + 7, 9 * SMS])
  l_far = np.array([32, 128])
  np.testing.assert_allclose(np.asarray(wave_model.predict(res.coef[0], g_far, l_far, SMS)),
                             np.asarray(wave_model.predict(true, g_far, l_far, SMS)),
                             rtol=1e-3)


def test_waves_and_bad_form():
  w, r = wave_model.waves(np.array([1, 132, 133, 264]), 132)
  assert np.asarray(w).tolist() == [1, 1, 2, 2]
  assert np.asarray(r).tolist() == [1, 132, 1, 132]
  with pytest.raises(ValueError, match="unknown model form 'cubic'"):
    wave_model.features(1, 1, 1, "cubic")


def test_occupancy_bound():
  hw = get_hardware("h100")
  # 128x256x64, 3 stages, bf16: 147 KB of shared memory -> one CTA per SM.
  from wavetune_jax.families import _triton
  assert _triton.occupancy_bound(hw, smem_bytes=3 * (128 * 64 + 64 * 256) * 2, threads=256,
                                 acc_per_thread=128) == 1
  assert _triton.occupancy_bound(hw, smem_bytes=3 * (64 * 64 + 64 * 64) * 2, threads=128,
                                 acc_per_thread=32) >= 3


def test_tied_form_full_last_wave_costs_a_full_wave():
  # T = a + b*L*(1 - r/C) + (W - 1 + r/C)*(c + d*L): a full last wave adds what
  # every full wave adds, and the first wave's L-slope runs from b (one CTA) to d.
  a, b, c, d = 2.0, 0.05, 1.0, 0.3
  coef = np.array([d, a, c, b], np.float32)
  cap = 4 * SMS
  t = lambda g, l: float(wave_model.predict(coef, g, l, cap, "tied", xp=np))  # noqa: E731
  for l in (8.0, 64.0):
    full = t(2 * cap, l) - t(cap, l)
    assert full == pytest.approx(c + d * l, rel=1e-5)
    assert t(cap, l) == pytest.approx(a + c + d * l, rel=1e-5)
    assert t(1, l) == pytest.approx(a + b * l * (1 - 1 / cap) + (c + d * l) / cap, rel=1e-5)


def test_point_weights_act_like_repeated_points():
  rng = np.random.default_rng(5)
  g, l = _points(rng, 12)
  t = np.asarray(wave_model.predict(np.array([2.0, 0.1, 1.0, 0.2, 0.5, 0.05]), g, l, SMS))
  t = t * rng.uniform(0.8, 1.2, size=t.shape)  # noise, so that weights matter
  w = np.ones(12); w[3] = 3.0
  weighted = wave_model.fit(g[None], l[None], t[None], [SMS], mask=w[None], nonneg=False)
  rep = np.r_[np.arange(12), 3, 3]
  repeated = wave_model.fit(g[rep][None], l[rep][None], t[rep][None], [SMS], nonneg=False)
  np.testing.assert_allclose(np.asarray(weighted.coef), np.asarray(repeated.coef),
                             rtol=1e-3, atol=1e-4)
