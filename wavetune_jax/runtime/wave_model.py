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

Both forms take optional *auxiliary* columns ``aux [..., n_aux]`` that a spec
supplies for costs outside the wave structure (GEMM: the split-K reduction).

Fits minimise *relative* error (rows scaled by 1/T), by ``jnp.linalg.lstsq``,
batched over configs with ``jax.vmap`` (padded rows carry weight 0). With
``nonneg=True`` (the default) the coefficients are constrained to be >= 0:
every term is a cost (launch, per-trip, per-wave, fill of the last wave), and
on sparse data an unconstrained fit trades a negative slope for a better
in-sample error and then extrapolates to impossible, too-fast latencies (on the
H200 sweep, held-out selection with unconstrained fits fell to 0.83-0.90
geomean efficiency on two of three splits; non-negative fits kept 0.95). The
constrained problem is solved exactly by enumerating active sets (2**p
least-squares solves of p <= 8 columns, vmapped), which stays pure JAX.

Every function takes ``xp=`` (``jax.numpy`` or ``numpy``): the selector
evaluates the same formulas in NumPy at trace time, where a JAX dispatch would
cost more than the whole decision.
"""

from __future__ import annotations

from typing import NamedTuple

import itertools

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["FORMS", "n_coef", "waves", "features", "fit", "predict", "predict_np", "FitResult",
           "fit_occupancy", "fit_occupancy_batch", "rel_errors"]

FORMS = ("bilinear", "step", "tied")
N_COEF = {"bilinear": 6, "step": 4, "tied": 4}


def waves(g, c, xp=jnp):
  """``(W, r)``: waves of ``g`` CTAs at capacity ``c``, CTAs in the last one."""
  g = xp.asarray(g, xp.float32)
  c = xp.asarray(c, xp.float32)
  w = xp.ceil(g / c)
  return w, g - (w - 1.0) * c


def n_coef(form: str, n_aux: int = 0) -> int:
  return N_COEF[form] + n_aux


def features(g, l, c, form: str = "bilinear", aux=None, xp=jnp):
  """Design matrix ``[..., n_coef]`` of a model form at points ``(g, l)``.

  ``aux [..., n_aux]`` columns, if given, are appended as they are.
  """
  if form not in FORMS:
    raise ValueError(f"unknown model form {form!r}; forms are {FORMS}")
  l = xp.asarray(l, xp.float32)
  w, r = waves(g, c, xp)
  w, r = xp.broadcast_arrays(w, r)
  l = xp.broadcast_to(l, w.shape)
  one = xp.ones_like(l)
  if form == "bilinear":
    # Waves done, counting the last one by its fill: W - 1 + r/C.
    we = w - 1.0 + r / xp.asarray(c, xp.float32)
    cols = [we * l, one, we, l, (w - 1.0) * l, w - 1.0]
  elif form == "tied":
    # The bilinear form with a full last wave costing what any full wave
    # costs (e = c, f = d - b): T = a + b*L*(1 - r/C) + (W - 1 + r/C)*(c + d*L).
    frac = r / xp.asarray(c, xp.float32)
    we = w - 1.0 + frac
    cols = [we * l, one, we, l * (1.0 - frac)]
  else:
    cols = [w * l, one, w, l]
  out = xp.stack(cols, axis=-1)
  if aux is not None:
    aux = xp.asarray(aux, xp.float32)
    out = xp.concatenate([out, xp.broadcast_to(aux, out.shape[:-1] + aux.shape[-1:])],
                         axis=-1)
  return out


class FitResult(NamedTuple):
  coef: jax.Array      # [..., n_coef]
  med_err: jax.Array   # [...] median |relative error| on the fitted points
  max_err: jax.Array   # [...]


def _lstsq(a, y):
  return jnp.linalg.lstsq(a, y)[0]


def _subsets(p: int) -> np.ndarray:
  """Every column subset: fewest columns first, then those holding the
  earlier (more basic) columns."""
  s = np.array(list(itertools.product((0.0, 1.0), repeat=p)), np.float32)
  rank = s @ (2.0 ** np.arange(p))  # low when the early columns are in
  return s[np.lexsort((rank, s.sum(axis=1)))]


def _nnls(a, y):
  """Non-negative least squares by enumerating active sets (exact for small p).

  Among subsets whose residual is within 1e-4 of the best feasible one, the
  one with the fewest columns wins: with fewer points than coefficients
  (sparse anchors) many subsets fit exactly, and the sparsest extrapolates
  most conservatively.
  """
  subsets = jnp.asarray(_subsets(a.shape[-1]), a.dtype)
  # Zeroed columns get a zero coefficient from the minimum-norm solution.
  coefs = jax.vmap(lambda s: _lstsq(a * s, y) * s)(subsets)
  resid = jnp.sum((coefs @ a.T - y) ** 2, axis=-1)
  feasible = jnp.all(coefs >= -1e-6 * jnp.max(jnp.abs(coefs), axis=-1, keepdims=True),
                     axis=-1)
  score = jnp.where(feasible, resid, jnp.inf)
  near = score <= jnp.min(score) * (1.0 + 1e-4) + 1e-7
  return jnp.maximum(coefs[jnp.argmax(near)], 0.0)


def _fit_one(x, t, mask, nonneg):
  """Relative least squares of one config: rows ``x [n, p]``, targets ``t [n]``."""
  # ``mask`` may carry weights (0 = padding): rows scaled by sqrt(weight).
  wt = jnp.sqrt(jnp.maximum(mask.astype(x.dtype), 0.0))
  own = mask >= 1.0  # errors are reported on full-weight points
  mask = mask > 0
  scale = jnp.where(mask, wt / jnp.where(mask, t, 1.0), 0.0)
  a, y = x * scale[:, None], wt
  coef = _nnls(a, y) if nonneg else _lstsq(a, y)
  pred = x @ coef
  err = jnp.where(own, jnp.abs(pred / jnp.where(mask, t, 1.0) - 1.0), jnp.nan)
  return coef, jnp.nanmedian(err), jnp.nanmax(err)


@jax.jit
def _fit_batch(x, t, mask):
  return jax.vmap(lambda *a: _fit_one(*a, False))(x, t, mask)


@jax.jit
def _fit_batch_nonneg(x, t, mask):
  return jax.vmap(lambda *a: _fit_one(*a, True))(x, t, mask)


#: Most design-matrix floats one compiled fit call holds (16 MiB): a
#: non-negative fit of ``n`` points and ``p`` coefficients solves ``2**p``
#: least squares of ``n x p`` at once, so one call over all of a GEMM tune's
#: configs (2048 x 256 subsets x 256 points) took 8.6 GB; in chunks the tune
#: peaks below 1 GB, and runs faster (the chunks stay in cache).
_CHUNK_FLOATS = 1 << 22


def _chunk_size(b: int, n: int, p: int, nonneg: bool) -> int:
  """Configs per compiled fit call: a power of two that keeps the call
  within ``_CHUNK_FLOATS`` (at least 8: a batch of one compiles to other
  arithmetic, whose last bits differ), and no larger than ``b`` rounded up
  to a power of two."""
  per_config = n * p * (2 ** p if nonneg else 1)
  size = 1 << (max(8, _CHUNK_FLOATS // per_config).bit_length() - 1)
  return min(size, 1 << max(0, (b - 1).bit_length()))


def fit(g, l, t, c, *, mask=None, aux=None, form: str = "bilinear",
        nonneg: bool = True) -> FitResult:
  """Fits one model per row of a batch.

  Args:
    g, l, t: ``[B, n]`` CTAs, inner trips and measured latency (us) per point.
    c: ``[B]`` or ``[B, 1]`` wave capacity per config.
    mask: ``[B, n]`` point weights, 0 (False) for padding (default: all 1).
    aux: ``[B, n, n_aux]`` auxiliary columns (default: none).
    form: model form (``FORMS``).
    nonneg: constrain every coefficient to be >= 0.

  Returns:
    :class:`FitResult` with ``coef [B, n_coef]`` and in-sample errors.
  """
  t = jnp.asarray(t, jnp.float32)
  mask = jnp.ones(t.shape, jnp.float32) if mask is None else jnp.asarray(mask, jnp.float32)
  c = jnp.asarray(c, jnp.float32).reshape(t.shape[0], 1)
  x = features(g, l, c, form, aux)
  # Fixed-size chunks of configs (the last padded with all-masked rows) bound
  # the memory and compile one shape per (points, coefficients).
  b, n, p = x.shape
  size = _chunk_size(b, n, p, nonneg)
  pad = -b % size
  if pad:
    x = jnp.concatenate([x, jnp.zeros((pad, n, p), x.dtype)])
    t = jnp.concatenate([t, jnp.ones((pad, n), t.dtype)])
    mask = jnp.concatenate([mask, jnp.zeros((pad, n), mask.dtype)])
  run = _fit_batch_nonneg if nonneg else _fit_batch
  parts = [run(x[i:i + size], t[i:i + size], mask[i:i + size]) for i in range(0, b + pad, size)]
  return FitResult(*(jnp.concatenate(col)[:b] for col in zip(*parts)))


def predict(coef, g, l, c, form: str = "bilinear", aux=None, xp=jnp):
  """Predicted latency at ``(g, l)`` for coefficients ``coef [..., n_coef]``."""
  return xp.sum(features(g, l, c, form, aux, xp) * coef, axis=-1)


def predict_np(coef, g, l, c, form: str = "bilinear", aux=None) -> np.ndarray:
  """:func:`predict` in NumPy without building the design matrix (trace-time
  selection evaluates thousands of points at once): ``coef [n, n_coef]``,
  ``g, l [S, n]``, ``c [n]``, ``aux [S, n, n_aux]``; float32 throughout."""
  coef = np.asarray(coef, np.float32)
  c = np.asarray(c, np.float32)
  g = np.asarray(g, np.float32)
  l = np.asarray(l, np.float32)
  w = np.ceil(g / c)
  r = g - (w - 1.0) * c
  w1 = w - 1.0
  if form == "bilinear":
    we = w1 + r / c
    cols = (we * l, None, we, l, w1 * l, w1)
  elif form == "tied":
    frac = r / c
    we = w1 + frac
    cols = (we * l, None, we, l * (1.0 - frac))
  elif form == "step":
    cols = (w * l, None, w, l)
  else:
    raise ValueError(f"unknown model form {form!r}; forms are {FORMS}")
  t = np.broadcast_to(coef[:, 1], w.shape).astype(np.float32)  # the constant column
  for k, col in enumerate(cols):
    if col is not None:
      t = t + coef[:, k] * col
  if aux is not None:
    aux = np.asarray(aux, np.float32)
    for k in range(aux.shape[-1]):
      t = t + coef[:, len(cols) + k] * aux[..., k]
  return t


def rel_errors(pred, t):
  """``|pred / t - 1|`` as a NumPy array."""
  return np.abs(np.asarray(pred) / np.asarray(t) - 1.0)


def fit_occupancy_batch(g, l, t, *, num_sms: int, bounds, mask=None, aux=None,
                        form: str = "bilinear", nonneg: bool = True):
  """:func:`fit_occupancy` for many configs in one vmapped fit.

  Args:
    g, l, t: ``[B, n]`` points (padding masked out by ``mask [B, n]``).
    bounds: ``[B]`` analytic occupancy bounds.
    aux: ``[B, n, n_aux]`` or None.

  Returns:
    ``(occupancy [B], FitResult with coef [B, n_coef])`` as NumPy arrays.
  """
  g = np.asarray(g, np.float32)
  bsz, n = g.shape
  bounds = np.asarray(bounds, np.int64).reshape(bsz)
  omax = int(bounds.max())
  mask = np.ones((bsz, n), np.float32) if mask is None else np.asarray(mask, np.float32)
  # Pad the points to a power of two so that few shapes get compiled (:func:`fit`
  # runs fixed-size chunks of configs), and the configs to at least 8.
  n_pad = 1 << max(3, (n - 1).bit_length())
  b_pad = max(8, bsz * omax)

  def rep(v, fill):
    v = np.asarray(v, np.float32)
    v = np.concatenate([v, np.full((bsz, n_pad - n) + v.shape[2:], fill, v.dtype)], axis=1)
    v = np.repeat(v, omax, axis=0)
    return np.concatenate([v, np.full((b_pad - bsz * omax,) + v.shape[1:], fill, v.dtype)])

  occ = np.tile(np.arange(1, omax + 1), bsz)
  cap = np.concatenate([occ, np.ones(b_pad - bsz * omax, np.int64)]) * float(num_sms)
  gg, ll, tt = rep(g, 1.0), rep(l, 1.0), rep(t, 1.0)
  mw = rep(mask, 0.0)
  aa = None if aux is None else rep(aux, 0.0)
  res = fit(gg, ll, tt, cap, mask=mw, aux=aa, form=form, nonneg=nonneg)
  pred = predict(res.coef[:, None, :], gg, ll, cap[:, None], form, aa)
  score = np.asarray(jnp.sum(mw * (pred / tt - 1.0) ** 2, axis=1))
  score = np.round(score[:bsz * omax].reshape(bsz, omax), 8)
  score[np.arange(1, omax + 1)[None, :] > bounds[:, None]] = np.inf
  best = np.argmin(score, axis=1)  # ties: the smaller occupancy
  idx = np.arange(bsz) * omax + best
  return best + 1, FitResult(np.asarray(res.coef)[idx], np.asarray(res.med_err)[idx],
                             np.asarray(res.max_err)[idx])


def fit_occupancy(g, l, t, *, num_sms: int, bound: int, form: str = "bilinear",
                  mask=None, aux=None, nonneg: bool = True) -> tuple[int, FitResult]:
  """Occupancy (1..bound) whose wave capacity fits one config's points best.

  The data decides where the wave steps are; the analytic bound limits the
  candidates. Ties go to the smaller occupancy.

  Args:
    g, l, t: ``[n]`` points of one config; ``aux [n, n_aux]`` optional.
  """
  n = len(np.asarray(t))
  occ, res = fit_occupancy_batch(
      np.asarray(g)[None], np.asarray(l)[None], np.asarray(t)[None], num_sms=num_sms,
      bounds=[bound], mask=None if mask is None else np.asarray(mask)[None],
      aux=None if aux is None else np.asarray(aux, np.float32).reshape(1, n, -1),
      form=form, nonneg=nonneg)
  return int(occ[0]), FitResult(res.coef[0], res.med_err[0], res.max_err[0])
