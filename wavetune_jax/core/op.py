"""The one tuned-op path every family's public op goes through.

arguments -> ``family.bind`` (checks, problem) -> config (given, or the
selector's at trace time) -> its backend's ``validate`` on this hardware ->
``backend.run``. The kernel call is wrapped so that ``jax.grad`` through it
raises a clear error: the ops are forward only.
"""

from __future__ import annotations

import functools

import jax

from wavetune_jax.core import hardware
from wavetune_jax.core.family import Call, Family

__all__ = ["tuned_call", "choose"]


def choose(family: Family, problem, config=None, hw: hardware.Hardware | None = None):
  """``(backend, config)`` for ``problem``: ``config`` as given (a config or a
  dict), else the selector's decision; validated for ``hw`` (default: the
  hardware the ops run on).

  Raises:
    ValueError: a config of another family, invalid for the problem, beyond
      the GPU's limits, or of a backend that cannot run here (a Mosaic GPU
      config on a machine without a Hopper GPU).
  """
  from wavetune_jax.runtime import selector
  hw = hardware.current() if hw is None else hw
  if config is None:
    config = selector.select(family, problem, hw).config
  else:
    config = family.coerce_config(config)
  backend = family.backend_of(config)
  family.validate(problem, config, hw)
  if not backend.runs_on(hw):
    raise ValueError(f"a {backend.name} {family.name} config cannot run here: "
                     f"{hw.name if not hw.interpret else 'no GPU'} "
                     f"({'the backend has no interpret mode' if hw.interpret else 'unsupported GPU'})")
  return backend, config


def tuned_call(family: Family, *args, config=None, **kwargs) -> jax.Array:
  """Runs ``family``'s op on ``args`` with a chosen config (see module doc)."""
  call = family.bind(*args, **kwargs)
  if not isinstance(call, Call):
    return call  # nothing to compute (empty arrays)
  hw = hardware.current()
  backend, config = choose(family, call.problem, config, hw)
  fn = functools.partial(backend.run, call.problem, config, interpret=hw.interpret,
                         **call.options)
  return _forward_only(family.name, fn, *call.arrays)


def _forward_only(name: str, fn, *arrays):
  @jax.custom_vjp
  def f(*xs):
    return fn(*xs)

  def fwd(*xs):
    return fn(*xs), None

  def bwd(_, g):
    raise NotImplementedError(
        f"wavetune_jax.{name} is forward only: it has no gradient. Differentiate "
        f"through the XLA op (jnp.dot, jax.nn.dot_product_attention) instead.")

  f.defvjp(fwd, bwd)
  return f(*arrays)
