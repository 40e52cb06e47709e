"""The wave latency model, as pure JAX functions over arrays.

A config launches ``G`` CTAs that each run ``L`` inner-loop trips. With an
occupancy of ``o`` CTAs per SM the GPU runs ``C = num_SMs * o`` at once, so the
launch takes ``W = ceil(G / C)`` waves, the last holding ``r = G - (W-1)*C``.

Model forms (``FORMS``), each linear in its coefficients:

* ``"bilinear"``: the project's piecewise bilinear model with extrapolation
  built in. Inside wave ``W`` latency is bilinear in ``(r, L)``, and every full
  wave before the last adds the cost of one full wave at that ``L``::

      T = a + b*L + (W-1)*(c + d*L) + (r/C)*(e + f*L)

  This is ``a_W + b_W*L + c_W*r + d_W*r*L`` with ``a_W, b_W`` growing linearly
  in ``W``, which is what lets it predict waves it never saw.
* ``"step"``: a pure staircase, every wave costs the same whatever its fill::

      T = a + b*L + W*(c + d*L)

Fits minimise *relative* error (rows scaled by 1/T), by ``jnp.linalg.lstsq``,
batched over configs with ``jax.vmap`` (padded rows carry weight 0).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["FORMS", "waves", "features", "fit", "predict", "FitResult",
           "occupancy_bound", "fit_occupancy", "rel_errors"]

FORMS = ("bilinear", "step")
N_COEF = {"bilinear": 6, "step": 4}


def waves(g, c):
  """``(W, r)``: waves of ``g`` CTAs at capacity ``c``, CTAs in the last one."""
  g = jnp.asarray(g, jnp.float32)
  c = jnp.asarray(c, jnp.float32)
  w = jnp.ceil(g / c)
  return w, g - (w - 1.0) * c


def features(g, l, c, form: str = "bilinear"):
  """Design matrix ``[..., n_coef]`` of a model form at points ``(g, l)``."""
  if form not in FORMS:
    raise ValueError(f"unknown model form {form!r}; forms are {FORMS}")
  l = jnp.asarray(l, jnp.float32)
  w, r = waves(g, c)
  one = jnp.ones_like(l)
  if form == "bilinear":
    x = r / jnp.asarray(c, jnp.float32)
    cols = [one, l, w - 1.0, (w - 1.0) * l, x, x * l]
  else:
    cols = [one, l, w, w * l]
  return jnp.stack(cols, axis=-1)


class FitResult(NamedTuple):
  coef: jax.Array      # [..., n_coef]
  med_err: jax.Array   # [...] median |relative error| on the fitted points
  max_err: jax.Array   # [...]


def _fit_one(x, t, mask):
  """Relative least squares of one config: rows ``x [n, p]``, targets ``t [n]``."""
  scale = jnp.where(mask, 1.0 / jnp.where(mask, t, 1.0), 0.0)
  coef, *_ = jnp.linalg.lstsq(x * scale[:, None], mask.astype(x.dtype))
  pred = x @ coef
  err = jnp.where(mask, jnp.abs(pred / jnp.where(mask, t, 1.0) - 1.0), jnp.nan)
  return coef, jnp.nanmedian(err), jnp.nanmax(err)


@jax.jit
def _fit_batch(x, t, mask):
  return jax.vmap(_fit_one)(x, t, mask)


def fit(g, l, t, c, *, mask=None, form: str = "bilinear") -> FitResult:
  """Fits one model per row of a batch.

  Args:
    g, l, t: ``[B, n]`` CTAs, inner trips and measured latency (us) per point.
    c: ``[B]`` or ``[B, 1]`` wave capacity per config.
    mask: ``[B, n]`` bool, False for padding (default: all True).
    form: model form (``FORMS``).

  Returns:
    :class:`FitResult` with ``coef [B, n_coef]`` and in-sample errors.
  """
  t = jnp.asarray(t, jnp.float32)
  mask = jnp.ones(t.shape, bool) if mask is None else jnp.asarray(mask, bool)
  c = jnp.asarray(c, jnp.float32).reshape(t.shape[0], 1)
  x = features(g, l, c, form)
  return FitResult(*_fit_batch(x, t, mask))


def predict(coef, g, l, c, form: str = "bilinear"):
  """Predicted latency at ``(g, l)`` for coefficients ``coef [..., n_coef]``."""
  return jnp.sum(features(g, l, c, form) * coef, axis=-1)


def rel_errors(pred, t):
  """``|pred / t - 1|`` as a NumPy array."""
  return np.abs(np.asarray(pred) / np.asarray(t) - 1.0)


def occupancy_bound(*, smem_bytes: int, threads: int, acc_per_thread: int, hw) -> int:
  """Analytic upper bound on CTAs per SM: shared memory, threads, registers.

  Registers are estimated as the fp32 accumulator plus 64 per thread for
  operands and addresses (Triton's usual overhead), capped at 255.
  """
  by_smem = hw.smem_per_sm // max(1, smem_bytes + 1024)  # + Triton's reserve
  by_threads = hw.max_threads_per_sm // threads
  regs = min(255, acc_per_thread + 64)
  by_regs = hw.regs_per_sm // (regs * threads)
  return int(max(1, min(by_smem, by_threads, by_regs, 8)))


def fit_occupancy(g, l, t, *, num_sms: int, bound: int, form: str = "bilinear",
                  mask=None) -> tuple[int, FitResult]:
  """Occupancy (1..bound) whose wave capacity fits one config's points best.

  The data decides where the wave steps are; the analytic bound limits the
  candidates. Ties go to the smaller occupancy.

  Args:
    g, l, t: ``[n]`` points of one config.
  """
  cands = jnp.arange(1, bound + 1, dtype=jnp.float32)
  b = len(cands)
  # Pad the points to a power of two (masked out) so that configs with
  # different point counts share a few compiled fits.
  n = len(t)
  n_pad = 1 << max(3, (n - 1).bit_length())
  valid = np.ones(n, bool) if mask is None else np.asarray(mask, bool)

  def pad(v, fill):
    return np.concatenate([np.asarray(v, np.float32), np.full(n_pad - n, fill, np.float32)])

  gg = jnp.broadcast_to(pad(g, 1.0), (b, n_pad))
  ll = jnp.broadcast_to(pad(l, 1.0), (b, n_pad))
  tt = jnp.broadcast_to(pad(t, 1.0), (b, n_pad))
  mm = jnp.broadcast_to(np.concatenate([valid, np.zeros(n_pad - n, bool)]), (b, n_pad))
  res = fit(gg, ll, tt, cands * num_sms, mask=mm, form=form)
  # Score: mean squared relative error (the fit's own objective).
  pred = predict(res.coef[:, None, :], gg, ll, (cands * num_sms)[:, None], form)
  err = jnp.where(mm, (pred / tt - 1.0) ** 2, 0.0)
  score = np.asarray(jnp.sum(err, axis=1))
  best = int(np.argmin(np.round(score, 8)))
  return best + 1, FitResult(res.coef[best], res.med_err[best], res.max_err[best])
