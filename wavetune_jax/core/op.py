"""The one tuned-op path every family's public op goes through.

arguments -> ``family.bind`` (checks, problem) -> config (given, or the
selector's at trace time) -> its backend's ``validate`` on this hardware ->
``backend.run``. The kernel call is wrapped so that any derivative through
it (``jax.grad``, ``jax.jvp``, ``jax.jacfwd``, ...) raises a clear
``NotImplementedError``: the ops are forward only. A family with a
``batched_call(axis_size, in_batched, arrays, op)`` method gives its op that
``jax.vmap`` rule (the grouped GEMM: ``lax.ragged_dot`` cannot batch its group
sizes); the others batch as their kernels do (Pallas adds a grid axis).
"""

from __future__ import annotations

import functools
import warnings

import jax
import jax.custom_batching

from pallas_kernels._launch import match_varying
from wavetune_jax.core import hardware, kernel_cache, partition
from wavetune_jax.core.family import Call, Family

__all__ = ["tuned_call", "choose"]


def choose(family: Family, problem, config=None, hw: hardware.Hardware | None = None):
  """``(backend, config)`` for ``problem``: ``config`` as given (a config or a
  dict; a dict naming only its ``"backend"`` is that backend's rule for the
  problem, where it has one), else the selector's decision; validated for
  ``hw`` (default: the hardware the ops run on).

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
    rule = _rule_of(family, problem, config, hw)
    config = family.coerce_config(config) if rule is None else rule
  backend = family.backend_of(config)
  family.validate(problem, config, hw)
  if not backend.runs_on(hw):
    raise ValueError(f"a {backend.name} {family.name} config cannot run here: "
                     f"{hw.name if not hw.interpret else 'no GPU'} "
                     f"({'the backend has no interpret mode' if hw.interpret else 'unsupported GPU'})")
  return backend, config


def _rule_of(family: Family, problem, config, hw):
  """For ``config={"backend": name}`` (no fields), that backend's rule for
  ``problem`` (its defaults may not fit every problem or GPU); else None."""
  if not (isinstance(config, dict) and set(config) == {"backend"}):
    return None
  try:   # (an unknown backend: coerce_config says what is wrong)
    return family.backend(config["backend"]).heuristic(problem, hw)
  except ValueError:
    return None


def tuned_call(family: Family, *args, config=None, **kwargs) -> jax.Array:
  """Runs ``family``'s op on ``args`` with a chosen config (see module doc).

  With several devices, outside ``shard_map``, the call is partitioned like
  its XLA counterpart (:mod:`wavetune_jax.core.partition`): the config is
  then chosen for the per-shard shapes.
  """
  call = family.bind(*args, **kwargs)
  if not isinstance(call, Call):
    # Nothing to compute (empty arrays); a config that names no backend or
    # has wrong fields is still the error it is where there is work.
    if isinstance(config, dict) and set(config) == {"backend"}:
      family.backend(config["backend"])
    elif config is not None:
      family.coerce_config(config)
    return call
  if family.batched_call is not None:
    return _with_vmap_rule(family, call, config, kwargs)
  return _bound_call(family, call, config, kwargs)


def _bound_call(family: Family, call: Call, config, kwargs: dict):
  rule = family.partition_rule(call.problem)
  if rule is not None and partition.wants_partitioning(call.arrays):
    # Every array is an operand of the partitioned op (the ones passed as
    # keywords too); the other keywords are static.
    n = len(call.arrays) - len(call.kw_arrays)
    static = {k: v for k, v in kwargs.items() if k not in call.kw_arrays}

    def local(*xs, **kw):
      # Called from XLA's partitioner, inside its compile: no first-use
      # measurement there (the tables' answer, after the guard).
      from wavetune_jax.runtime import selector
      with selector.measuring_off():
        return _local_call(family, *xs[:n], config=config, **kw,
                           **dict(zip(call.kw_arrays, xs[n:])))
    return _forward_only(family.name, lambda *xs: partition.partitioned(
        rule, local, xs, static), *call.arrays)
  return _local_call(family, *call.arrays, config=config, _call=call, **kwargs)


def _with_vmap_rule(family: Family, call: Call, config, kwargs: dict):
  """The op with ``family.batched_call`` as its ``jax.vmap`` rule (a
  ``custom_vmap``; also under ``jax.vmap(jax.jit(f))``, where the op is
  traced unbatched and its jaxpr batched afterwards). ``batched_call(
  axis_size, in_batched, arrays, op)`` gets the arrays with the batch axis
  first where ``in_batched`` says, and ``op``, this op on arrays of a larger
  problem (the batch folded in), its config chosen for that problem."""
  n = len(call.arrays) - len(call.kw_arrays)
  static = {k: v for k, v in kwargs.items() if k not in call.kw_arrays}

  def op(*xs):
    return tuned_call(family, *xs[:n], config=config, **static,
                      **dict(zip(call.kw_arrays, xs[n:])))

  batchable = jax.custom_batching.custom_vmap(
      lambda *xs: _bound_call(family, call._replace(arrays=xs), config, kwargs))

  @batchable.def_vmap
  def _(axis_size, in_batched, *xs):
    return family.batched_call(axis_size, tuple(in_batched), xs, op), True

  # Outside the custom_vmap: a derivative still gets the forward-only error.
  return _forward_only(family.name, batchable, *call.arrays)


def _local_call(family: Family, *args, config=None, _call: Call | None = None, **kwargs):
  call = family.bind(*args, **kwargs) if _call is None else _call
  if not isinstance(call, Call):
    return call
  hw = hardware.current()
  varying = match_varying(*call.arrays)[1]
  if partition.explicit_mesh(call.arrays):
    config = _under_explicit_mesh(family, config, hw)
  elif hw.interpret and varying:
    config = _shard_map_on_cpu(family, call.problem, config, hw)
  backend, config = choose(family, call.problem, config, hw)
  fn = functools.partial(backend.run, call.problem, config, interpret=hw.interpret,
                         **call.options)
  if backend.kernel_cache and not varying:
    # A Pallas kernel: lowered once per machine, not once per process.
    parts = {"family": family.name, "backend": backend.name,
             "revision": backend.revision, "config": config, "problem": call.problem,
             "options": call.options, "interpret": hw.interpret}
    fn = functools.partial(kernel_cache.call, fn, parts=parts)
    return _forward_only(family.name, lambda *xs: fn(xs), *call.arrays)
  return _forward_only(family.name, fn, *call.arrays)


def _under_explicit_mesh(family: Family, config, hw):
  """The config under a mesh with explicit axes (sharding in types), where
  the ops take their inputs as they come (no partitioning rule runs there):
  XLA's op, the one that takes sharded types (the kernels' own wrappers, row
  grouping and work lists, and Pallas's interpret mode do not, and JAX's
  cuDNN attention gives its output no sharding outside ``shard_map``), with
  one warning. A library config given or pinned (XLA's, cuDNN's) runs as
  given; a kernel's is a clear error (run it inside ``jax.shard_map``)."""
  from wavetune_jax.runtime import selector
  given = config if config is not None else selector.pinned(family)
  if given is not None:
    _library_only(family, given, "under a mesh with explicit axes: the kernels take "
                  "unsharded arrays; run the op inside jax.shard_map, or leave the config "
                  "out (XLA's op runs)")
    return config
  xla = [b for b in family.available(hw) if b.name == "xla"]
  if not xla:
    raise ValueError(f"no {family.name} backend runs under a mesh with explicit axes here")
  key = ("explicit", family.name)
  if key not in _warned_explicit:
    _warned_explicit.add(key)
    warnings.warn(f"wavetune_jax.{family.name} under a mesh with explicit axes: running XLA's "
                  f"op{family.explicit_mesh_note} (the kernels take unsharded arrays; inside "
                  f"jax.shard_map they run per shard)", stacklevel=4)
  return xla[0].config_cls()


_warned_explicit: set = set()


def _library_only(family: Family, config, where: str) -> None:
  """Raises where ``config`` is a kernel's (not XLA's or cuDNN's op), which
  cannot run ``where`` (the message's end)."""
  backend = family.backend_of(family.coerce_config(config))
  if not backend.interpret_in_shard_map:
    raise ValueError(f"a {backend.name} {family.name} config cannot run {where}")


def _shard_map_on_cpu(family: Family, problem, config, hw):
  """The config inside ``shard_map`` on a CPU: Pallas interpret mode cannot
  run there, so the first backend that can (XLA's op) is used."""
  ok = [b for b in family.available(hw) if b.interpret_in_shard_map]
  if config is not None:
    _library_only(family, config, f"inside jax.shard_map on a CPU: Pallas interpret mode "
                  f"does not support values that vary over mesh axes; use "
                  f"{[b.name for b in ok] or 'a GPU'} or check_vma=False")
    return config
  if not ok:
    raise ValueError(f"no {family.name} backend runs inside jax.shard_map on a CPU")
  warnings.warn(f"wavetune_jax.{family.name} inside jax.shard_map on a CPU: running the "
                f"{ok[0].name} backend (Pallas interpret mode does not support values "
                f"that vary over mesh axes)", stacklevel=4)
  return ok[0].config_cls()


def _forward_only(name: str, fn, *arrays):
  """``fn(*arrays)`` with a ``custom_jvp`` rule that raises: every derivative
  (``jax.grad``, ``vjp``, ``jvp``, ``jacfwd``, ``jacrev``, ``linearize``,
  ``hessian``) starts from a JVP, so all of them get one clear error. A
  derivative whose tangents do not reach the op never calls the rule (JAX
  skips it for symbolic-zero tangents); ``jax.vmap`` batches ``fn``."""
  @jax.custom_jvp
  def f(*xs):
    return fn(*xs)

  @f.defjvp
  def _(primals, tangents):
    raise NotImplementedError(
        f"wavetune_jax.{name} is forward only: it has no derivative (jax.grad, jax.jvp, "
        f"jax.jacfwd, jax.linearize, ...). Differentiate through the XLA op (jnp.dot, "
        f"jax.lax.ragged_dot, jax.nn.dot_product_attention) instead.")

  return f(*arrays)
