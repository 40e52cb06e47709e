"""``wt.autotune(fn)``: tune a JAX function without editing it.

The function is traced once to a jaxpr (with its arguments' shapes, inside
whatever ``jax.jit`` or ``shard_map`` is tracing it) and the jaxpr is
evaluated again, equation by equation, with three kinds of call replaced by
the wavetune ops where the ops compute exactly the same thing:

- ``dot_general`` that is a GEMM: no batch dimensions, the contracted
  dimensions the trailing ones of the left operand and the leading ones of
  the right (``x @ w``, ``jnp.einsum("btd,dnh->btnh", x, w)``), so both
  reshape to ``[M, K] x [K, N]`` without a copy -> :func:`wavetune_jax.matmul`;
- ``ragged_dot_general`` in ``lax.ragged_dot``'s form -> :func:`wavetune_jax.ragged_dot`;
- ``jax.nn.dot_product_attention`` without a bias or a mask ->
  :func:`wavetune_jax.attention`, or :func:`wavetune_jax.decode_attention` for
  up to 64 queries that see every valid key (with a window:
  :func:`wavetune_jax.attention`, where the selector answers a kernel, not
  XLA's attention).

Attention is intercepted at the API (``jax.nn.dot_product_attention`` is
swapped while ``fn`` is traced, for this thread only): in a jaxpr, XLA's form
of it is 20-odd primitives (a mask built from ``iota``, a softmax, two
batched ``dot_general``), which no rewrite can recognise reliably. GEMMs and
grouped GEMMs are rewritten in the jaxpr, so they are found however the user
spelled them (``@``, ``jnp.dot``, ``jnp.einsum``, ``lax.dot_general``, a
Flax or Keras layer). docs/design.md gives the measurements behind the choice.

Everything else is evaluated as it was traced. A call is left alone, with
its reason in the report, when its dtype, precision or layout is not one the
ops reproduce, or when the op rejects its shape. Derivatives never reach
the ops: under ``jax.grad``/``jvp``/``vjp``/``linearize`` nothing is replaced,
and each replacement carries the original call's derivative rule besides.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["autotune", "Site"]

_SCOPE = "wavetune"          # named scope of every wavetune op (and of replacements)
_GEMM_DTYPES = (jnp.bfloat16, jnp.float16)
_ATTN_DTYPES = (jnp.bfloat16, jnp.float16)
_INLINED = {"pjit", "jit", "closed_call", "core_call"}
#: Functions with their own derivative rule: the primal body is rewritten in
#: place and the rule kept (evaluated inline, a derivative taken outside the
#: wrapper would differentiate the body and drop the rule).
_CUSTOM = {"custom_jvp_call", "custom_vjp_call", "custom_vjp_call_jaxpr"}
_REMAT = {"remat2", "checkpoint", "remat"}
_LOOPS = {"scan", "while", "cond"}
_MAPPED = {"shard_map"}


@dataclasses.dataclass(frozen=True)
class Site:
  """One call ``autotune`` looked at."""
  op: str                    # "matmul", "ragged_dot", "attention", "decode_attention"
  where: str                 # the user's source line, "file:line (function)"
  shapes: str                # operand shapes and dtypes
  replaced: bool
  reason: str = ""           # why it was left (empty when replaced)
  backend: str = ""          # the backend the selector chose (replaced calls)

  def line(self) -> str:
    what = f"-> {self.backend}" if self.replaced else f"left: {self.reason}"
    return f"{'replaced' if self.replaced else 'kept    '} {self.op:<16} {self.shapes:<44} {what}  [{self.where}]"


class _Sites(list):
  def __str__(self):
    n = sum(s.replaced for s in self)
    head = f"wt.autotune: {n} of {len(self)} calls replaced"
    return "\n".join([head] + ["  " + s.line() for s in self])


def autotune(fn=None, *, report: bool = False, masks: bool = False):
  """``fn`` with its GEMMs, grouped GEMMs and attention run by the wavetune ops.

  Composes with ``jax.jit`` (``jax.jit(wt.autotune(step))``, with
  ``static_argnums`` and donation), ``jax.vmap`` and ``jax.shard_map`` (wrap
  the per-shard function). The choice is made while tracing, once per shape
  under ``jax.jit``; the compiled function carries no overhead.

  Args:
    fn: any function of arrays (pytrees of arrays; other arguments, such as
      Python numbers, strings or modules, are passed through as constants).
    report: print, each time ``fn`` is traced, every call looked at:
      replaced (and by which backend) or kept, with the reason.
    masks: also replace attention given a boolean ``mask`` (Keras-Hub's
      models pass one), under a run-time check (``lax.cond``) that the mask
      is the causal mask with key lengths (a prefill) or the bottom-right
      band of a cache (a decode step); any other mask runs the original
      call. Off by default: the check is a conditional per call, whose cost
      on a GPU is not measured yet.

  Attention is seen as ``jax.nn.dot_product_attention`` called through
  ``jax.nn`` while ``fn`` is traced: a name bound before the trace (``from
  jax.nn import dot_product_attention``, a ``functools.partial`` of it) is
  not seen, and its calls run as written. A sequence with
  ``key_value_seq_lengths`` 0 gives zeros, where XLA's attention gives the
  mean of the masked values (docs/design.md, "Drop-in"). A call with
  ``local_window_size`` runs ``wt.attention`` with the window (JAX's
  top-left alignment) where the selector answers a kernel for it (else it
  is kept: XLA's attention is the call as written), under a run-time check
  that every query sees a key where ``key_value_seq_lengths`` are given.

  Returns:
    The transformed function. Its ``sites`` attribute holds the calls of its
    last trace (a list of :class:`Site`; ``print`` it for the table).
  """
  for name, flag in (("report", report), ("masks", masks)):
    if not (isinstance(flag, (bool, np.bool_)) or (isinstance(flag, int) and flag in (0, 1))):
      raise TypeError(f"wt.autotune: {name} must be True or False; got {flag!r}")
  if fn is None:
    return functools.partial(autotune, report=report, masks=masks)
  if not callable(fn):
    raise TypeError(f"wt.autotune takes a function, got {type(fn).__name__}")

  @functools.wraps(fn)
  def tuned(*args, **kwargs):
    leaves, tree = jax.tree_util.tree_flatten((args, kwargs))
    dynamic = [i for i, x in enumerate(leaves) if _is_array(x)]

    def flat_fn(*xs):
      full = list(leaves)
      for i, x in zip(dynamic, xs):
        full[i] = x
      a, kw = jax.tree_util.tree_unflatten(tree, full)
      objects = _nnx_objects((a, kw))
      before = [jax.tree_util.tree_leaves(o) for o in objects]
      out = fn(*a, **kw)
      _check_no_nnx_update(fn, objects, before, out)
      return out

    xs = [leaves[i] for i in dynamic]
    sites = _Sites()
    if _differentiated(xs):
      tuned.sites[:] = sites
      return fn(*args, **kwargs)
    with _intercept_attention(sites, masks):
      closed, out_shape = jax.make_jaxpr(flat_fn, return_shape=True)(*xs)
    with _work_memo_scope():
      out = _evaluate(closed, xs, sites)
    # In place: jax.jit(tuned) copied the attribute when it was made, so
    # `step.sites` is this very list.
    tuned.sites[:] = sites
    if report:
      print(sites, flush=True)
    return jax.tree_util.tree_unflatten(jax.tree_util.tree_structure(out_shape), out)

  tuned.sites = _Sites()
  return tuned


def _nnx_classes() -> tuple:
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return ()
  return tuple(c for c in (getattr(nnx, "Pytree", None), getattr(nnx, "Object", None),
                           getattr(nnx, "Module", None)) if isinstance(c, type))


def _nnx_objects(tree) -> list:
  """The Flax NNX objects (modules, ``nnx.Rngs``) in ``tree``, once each."""
  classes = _nnx_classes()
  if not classes:
    return []
  found = jax.tree_util.tree_leaves(tree, is_leaf=lambda x: isinstance(x, classes))
  return list({id(o): o for o in found if isinstance(o, classes)}.values())


def _check_no_nnx_update(fn, objects, before, out) -> None:
  """Raises ``ValueError`` where ``fn`` updated a Flax NNX object of its
  arguments in place (a KV cache's index, BatchNorm's statistics, an
  ``nnx.Rngs`` count) without returning it: ``fn`` runs on a traced copy of
  its arguments, and what it writes there never reaches the caller's object
  (``nnx.jit`` carries such updates out; a transformation of pytrees, as
  this one and ``jax.jit``, returns only what ``fn`` returns). Other
  arguments updated in place are lost as under ``jax.jit``."""
  returned = {id(o) for o in _nnx_objects(out)}
  for obj, leaves in zip(objects, before):
    if id(obj) in returned:
      continue
    after = jax.tree_util.tree_leaves(obj)
    if len(after) == len(leaves) and all(x is y for x, y in zip(after, leaves)):
      continue
    raise ValueError(
        f"wt.autotune: {getattr(fn, '__name__', 'the function')} updated the Flax NNX "
        f"{type(obj).__name__} it was given (a cache, batch statistics or RNG counts?) "
        f"without returning it; wt.autotune traces a copy of its arguments and would lose "
        f"the update. Return it with the outputs, or pass its state: graphdef, state = "
        f"nnx.split(obj); the function calls nnx.merge(graphdef, state) and returns "
        f"nnx.state(...)")


def _evaluate(closed, xs, sites):
  # A closure over a value being differentiated: nothing is replaced (the
  # replaced calls would carry the original rule, but nothing is gained).
  replace = not _differentiated(closed.consts)
  return _Evaluator(sites, replace=replace).eval(closed.jaxpr, closed.consts, xs)


def _is_array(x) -> bool:
  return isinstance(x, (jax.Array, np.ndarray, np.generic)) or isinstance(x, jax.core.Tracer)


def _differentiated(values) -> bool:
  """Whether any value is being differentiated (a JVP or linearize tracer,
  at any depth of nested tracing)."""
  for x in values:
    while isinstance(x, jax.core.Tracer):
      if type(x).__name__ in ("JVPTracer", "LinearizeTracer"):
        return True
      x = getattr(x, "primal", None)
  return False


# ------------------------------------------------------------------ the jaxpr walk

class _Evaluator:
  def __init__(self, sites, replace: bool = True):
    self.sites = sites
    self.replace = replace

  def eval(self, jaxpr, consts, args):
    from jax._src import source_info_util
    env = {}

    def read(v):
      return v.val if type(v).__name__ == "Literal" else env[v]

    for v, x in zip(jaxpr.constvars, consts):
      env[v] = x
    for v, x in zip(jaxpr.invars, args):
      env[v] = x
    self.producers = producers = getattr(self, "producers", {})
    for eqn in jaxpr.eqns:
      for v in eqn.outvars:
        producers[v] = eqn
      invals = [read(v) for v in eqn.invars]
      name_stack = source_info_util.current_name_stack() + eqn.source_info.name_stack
      with source_info_util.user_context(eqn.source_info.traceback, name_stack=name_stack):
        with eqn.ctx.manager:
          outs = self.apply(eqn, invals)
      if not eqn.primitive.multiple_results:
        outs = [outs]
      for v, x in zip(eqn.outvars, outs):
        env[v] = x
    return [read(v) for v in jaxpr.outvars]

  def apply(self, eqn, invals):
    name = eqn.primitive.name
    if not self.replace or _SCOPE in str(eqn.source_info.name_stack) or not _has_work(eqn):
      return _bind(eqn, eqn.params, invals)
    if name == "dot_general":
      return self.dot_general(eqn, invals)
    if name == "ragged_dot_general":
      return self.ragged_dot(eqn, invals)
    if name in _INLINED:
      sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
      if not (hasattr(sub, "jaxpr") and hasattr(sub, "consts")):  # another JAX's form
        return _bind(eqn, eqn.params, invals)
      outs = self.eval(sub.jaxpr, sub.consts, invals)
      return outs if eqn.primitive.multiple_results else outs[0]
    if name in _CUSTOM:
      return self.custom(eqn, invals)
    if name in _REMAT:
      sub = eqn.params["jaxpr"]
      body = lambda *xs: self.eval(sub, (), xs)
      return jax.checkpoint(body, prevent_cse=eqn.params.get("prevent_cse", True),
                            policy=eqn.params.get("policy"))(*invals)
    if name in _LOOPS:
      return self.loop(eqn, invals)
    if name in _MAPPED:
      return self.shard_map(eqn, invals)
    return _bind(eqn, eqn.params, invals)

  def shard_map(self, eqn, invals):
    """The body rewritten inside the same ``jax.shard_map``."""
    p = eqn.params
    body = p["jaxpr"]
    try:
      axes = p.get("newly_manual_axes", p.get("manual_axes", p.get("axis_names")))
      mapped = jax.shard_map(lambda *xs: tuple(self.eval(body, (), xs)), mesh=p["mesh"],
                             in_specs=tuple(p["in_specs"]), out_specs=tuple(p["out_specs"]),
                             check_vma=p.get("check_vma", True),
                             axis_names=frozenset(axes or ()))
    except (KeyError, TypeError, AttributeError):  # another JAX's parameters
      return _bind(eqn, p, invals)
    return list(mapped(*invals))

  def custom(self, eqn, invals):
    """A ``custom_jvp`` / ``custom_vjp`` function: its primal body retraced
    with the rewrite, its rule as it was; bound as it is where the body is
    not a closed jaxpr of this JAX or the rewrite changes its type."""
    p = dict(eqn.params)
    key = "call_jaxpr" if "call_jaxpr" in p else "fun_jaxpr"
    sub = p.get(key)
    if not (hasattr(sub, "jaxpr") and hasattr(sub, "consts")):
      return _bind(eqn, eqn.params, invals)
    seen = len(self.sites)
    try:
      # Traced on the operands themselves: their types (shardings, the axes
      # a value varies over in shard_map) are the body's, as written.
      new = jax.make_jaxpr(lambda *xs: self.eval(sub.jaxpr, sub.consts, xs))(*invals)
      if new.consts or list(new.out_avals) != list(sub.out_avals):
        raise _KeepAsIs
      p[key] = new
      return _bind(eqn, p, invals)
    except Exception as e:  # noqa: BLE001  (_KeepAsIs, or another JAX's parameters)
      # The call as written: the transformation never fails a forward pass.
      why = ("the rewrite would change its types" if isinstance(e, _KeepAsIs)
             else f"its body could not be rebound ({_one_line(e)})")
      inner = self.sites[seen:]
      del self.sites[seen:]
      self.sites.append(Site(inner[0].op if inner else "matmul", _where(eqn),
                             inner[0].shapes if inner else "", False,
                             reason=f"inside {eqn.primitive.name}: {why}"))
      return _bind(eqn, eqn.params, invals)

  # -- loops: the body retraced with the rewrite; left alone if that changes its type

  def loop(self, eqn, invals):
    p = dict(eqn.params)
    keys = ("branches",) if eqn.primitive.name == "cond" else (
        ("jaxpr",) if eqn.primitive.name == "scan" else ("cond_jaxpr", "body_jaxpr"))
    try:
      for key in keys:
        if key == "branches":
          p[key] = tuple(self.retrace(b) for b in p[key])
        else:
          p[key] = self.retrace(p[key])
    except _KeepAsIs:
      return _bind(eqn, eqn.params, invals)
    return _bind(eqn, p, invals)

  def retrace(self, closed):
    if not _jaxpr_has_work(closed.jaxpr):
      return closed
    specs = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=getattr(a, "weak_type", False))
             for a in closed.in_avals]
    new = jax.make_jaxpr(lambda *xs: self.eval(closed.jaxpr, closed.consts, xs))(*specs)
    same = [(a.shape, a.dtype) for a in new.out_avals] == [(a.shape, a.dtype)
                                                           for a in closed.out_avals]
    if new.consts or not same:
      raise _KeepAsIs
    return new

  # -- the replacements

  def dot_general(self, eqn, invals):
    x, w = invals
    p = eqn.params
    shapes = f"{_fmt(x)} x {_fmt(w)}"
    try:
      (lc, rc), (lb, rb) = p["dimension_numbers"]
    except (KeyError, TypeError, ValueError):
      return self.keep(eqn, invals, "matmul", shapes, "parameters not recognised")
    why = _guarded(_gemm_unsupported, x, w, lc, rc, lb, rb, p)
    made = self.producers.get(eqn.invars[1])
    if not why and made is not None and made.primitive.name == "transpose":
      # XLA folds a transpose of the weight into its GEMM; a kernel that
      # takes [K, N] would copy the whole weight at each call.
      why = "the weight is transposed in the function (XLA folds that into its GEMM)"
    if why:
      return self.keep(eqn, invals, "matmul", shapes, why)
    nk = len(lc)
    m_shape, n_shape = x.shape[:x.ndim - nk], w.shape[nk:]
    k = math.prod(x.shape[x.ndim - nk:])
    out_dtype = p.get("preferred_element_type") or x.dtype
    from wavetune_jax import ops
    x2 = x.reshape(math.prod(m_shape), k)
    w2 = w.reshape(k, math.prod(n_shape))

    def original(a, b):
      return _bind(eqn, p, [a.reshape(x.shape), b.reshape(w.shape)]).reshape(a.shape[0], -1)

    return self.replaced(eqn, invals, "matmul", shapes, original,
                         lambda a, b: ops.matmul(a, b, out_dtype=out_dtype),
                         (x2, w2), out_shape=m_shape + n_shape, out_dtype=out_dtype)

  def ragged_dot(self, eqn, invals):
    lhs, rhs, sizes = invals[:3]
    p = eqn.params
    shapes = f"{_fmt(lhs)} x {_fmt(rhs)}"
    why = _guarded(_ragged_unsupported, lhs, rhs, sizes, invals, p)
    if why:
      return self.keep(eqn, invals, "ragged_dot", shapes, why)
    out_dtype = p.get("preferred_element_type") or lhs.dtype
    from wavetune_jax import ops
    return self.replaced(eqn, invals, "ragged_dot", shapes,
                         lambda a, b, g: _bind(eqn, p, [a, b, g]),
                         lambda a, b, g: ops.ragged_dot(a, b, g, out_dtype=out_dtype),
                         (lhs, rhs, sizes), out_shape=None, out_dtype=out_dtype)

  def replaced(self, eqn, invals, op, shapes, original, replacement, args, out_shape,
               **op_kwargs):
    try:
      with jax.named_scope(f"{_SCOPE}.autotune"):
        out = _same_derivative(original, replacement, *args)
      backend = _backend_of(op, args, **op_kwargs)
    except (ValueError, TypeError, NotImplementedError) as e:
      return self.keep(eqn, invals, op, shapes, f"the op rejects it: {_one_line(e)}")
    self.sites.append(Site(op, _where(eqn), shapes, True, backend=backend))
    return out if out_shape is None else out.reshape(out_shape)

  def keep(self, eqn, invals, op, shapes, why):
    self.sites.append(Site(op, _where(eqn), shapes, False, reason=why))
    return _bind(eqn, eqn.params, invals)


class _KeepAsIs(Exception):
  pass


def _bind(eqn, params, invals):
  got = eqn.primitive.get_bind_params(params)
  # JAX >= 0.10 returns the parameters; older JAX (subfuns, parameters).
  subfuns, bind_params = got if isinstance(got, tuple) else ((), got)
  return eqn.primitive.bind(*subfuns, *invals, **bind_params)


def _same_derivative(original, replacement, *args):
  """``replacement(*args)``, differentiated as ``original``: the ops are
  forward only, so a derivative taken through the transformed function is
  the original call's own."""
  @jax.custom_jvp
  def f(*xs):
    return replacement(*xs)

  @f.defjvp
  def _(primals, tangents):
    return jax.jvp(original, primals, tangents)

  return f(*args)


# -- which jaxprs hold anything to replace (others are bound as they are)

_WORK = {"dot_general", "ragged_dot_general"}


def _has_work(eqn) -> bool:
  name = eqn.primitive.name
  if name in _WORK:
    return True
  if name in _INLINED or name in _CUSTOM or name in _REMAT or name in _LOOPS \
      or name in _MAPPED:
    return any(_jaxpr_has_work(j) for j in _sub_jaxprs(eqn.params))
  return False


def _sub_jaxprs(params):
  for v in params.values():
    for j in (v if isinstance(v, tuple) else (v,)):
      if hasattr(j, "eqns"):
        yield j
      elif hasattr(j, "jaxpr") and hasattr(j.jaxpr, "eqns"):
        yield j.jaxpr


_work_memo = threading.local()  # jaxpr id -> (jaxpr, answer), for one transformation


def _jaxpr_has_work(jaxpr) -> bool:
  memo = getattr(_work_memo, "d", None)
  hit = None if memo is None else memo.get(id(jaxpr))
  if hit is not None and hit[0] is jaxpr:
    return hit[1]
  found = any(_SCOPE not in str(e.source_info.name_stack) and _has_work(e) for e in jaxpr.eqns)
  if memo is not None:
    memo[id(jaxpr)] = (jaxpr, found)
  return found


@contextlib.contextmanager
def _work_memo_scope():
  """A memo of which (sub-)jaxprs hold work, kept for one transformation
  only (a model's layers share their sub-jaxprs; nothing outlives it)."""
  prev = getattr(_work_memo, "d", None)
  _work_memo.d = {}
  try:
    yield
  finally:
    _work_memo.d = prev


# -- what the ops reproduce

def _guarded(check, *args) -> str:
  """``check(*args)``; parameters it does not know (another JAX's) keep the
  call: the transformation never fails a forward pass."""
  try:
    return check(*args)
  except Exception as e:  # noqa: BLE001
    return f"parameters not recognised ({type(e).__name__}: {_one_line(e)})"


def _precision_ok(precision, dtype) -> bool:
  if precision is None:
    return True
  ps = precision if isinstance(precision, tuple) else (precision,)
  names = {getattr(p, "name", str(p)) for p in ps}
  want = {"DEFAULT", "BF16_BF16_F32" if dtype == jnp.bfloat16 else "F16_F16_F32"}
  return names <= want


def _gemm_unsupported(x, w, lc, rc, lb, rb, p) -> str:
  if lb or rb:
    return "batch dimensions (not a GEMM against a weight)"
  if x.dtype != w.dtype or x.dtype not in _GEMM_DTYPES:
    return f"dtype {x.dtype} x {w.dtype} (the ops take bfloat16 or float16 here)"
  nk = len(lc)
  if nk == 0:
    return "no contracted dimension (an outer product)"
  pairs = sorted(zip(lc, rc))  # the pairing, in the left operand's order
  if tuple(a for a, _ in pairs) != tuple(range(x.ndim - nk, x.ndim)):
    return "the left operand's contracted dimensions are not its last ones"
  if tuple(b for _, b in pairs) != tuple(range(nk)):
    return ("the right operand's contracted dimensions are not its first ones, in the "
            "same order (a transposed weight)")
  if x.ndim == nk or w.ndim == nk:
    return "a matrix-vector product"
  return _numerics_unsupported(p, x.dtype)


def _ragged_unsupported(lhs, rhs, sizes, invals, p) -> str:
  dn = p.get("ragged_dot_dimension_numbers")
  if len(invals) != 3 or p.get("group_offset") is not None:
    return "a group offset"
  if dn is not None:
    (lc, rc), (lb, rb) = dn.dot_dimension_numbers
    if (tuple(lc), tuple(rc), tuple(lb), tuple(rb)) != ((1,), (1,), (), ()) or \
        tuple(dn.lhs_ragged_dimensions) != (0,) or tuple(dn.rhs_group_dimensions) != (0,):
      return "not lax.ragged_dot's layout ([M, K] x [G, K, N], ragged rows)"
  if lhs.ndim != 2 or rhs.ndim != 3:
    return "not lax.ragged_dot's layout ([M, K] x [G, K, N], ragged rows)"
  if lhs.dtype != rhs.dtype or lhs.dtype not in _GEMM_DTYPES:
    return f"dtype {lhs.dtype} x {rhs.dtype} (the ops take bfloat16 or float16 here)"
  return _numerics_unsupported(p, lhs.dtype)


def _numerics_unsupported(p, dtype) -> str:
  """Precision and output type the ops reproduce: the default (or the
  matching bf16/f16-in, f32-accumulate algorithm), out in ``dtype`` or f32."""
  if not _precision_ok(p.get("precision"), dtype):
    return f"precision {p.get('precision')}"
  out = p.get("preferred_element_type")
  if out is not None and out not in (dtype, jnp.float32):
    return f"preferred_element_type {out}"
  if p.get("out_sharding") is not None:
    return "an out_sharding (the ops take their output's sharding from their operands)"
  return ""


def _backend_of(op: str, args, **kwargs) -> str:
  """The backend the selector picks for this call (for the report)."""
  from wavetune_jax.core import hardware
  from wavetune_jax.families import ATTENTION, DECODE, MATMUL, RAGGED_DOT
  from wavetune_jax.runtime import selector
  family = {"matmul": MATMUL, "ragged_dot": RAGGED_DOT, "attention": ATTENTION,
            "decode_attention": DECODE}[op]
  try:
    call = family.bind(*args, **kwargs)
    config = selector.select(family, call.problem, hardware.current()).config
    return family.backend_of(config).name
  except Exception:  # noqa: BLE001 - the report only; the op itself already ran
    return "?"


def _fmt(x) -> str:
  return f"{jnp.dtype(x.dtype).name}{list(x.shape)}"


def _where(eqn) -> str:
  try:
    from jax._src import source_info_util
    return source_info_util.summarize(eqn.source_info)
  except Exception:
    return "?"


def _one_line(e: Exception) -> str:
  s = str(e).strip().splitlines()
  return s[0] if s else type(e).__name__


# ------------------------------------------------------------------ attention

_local = threading.local()
_patch_lock = threading.Lock()
_patch_depth = 0
_original_dpa = None


@contextlib.contextmanager
def _intercept_attention(sites, masks: bool = False):
  """While tracing ``fn``: ``jax.nn.dot_product_attention`` calls from this
  thread go through :func:`_attention`; other threads see the original."""
  global _patch_depth, _original_dpa
  with _patch_lock:
    if _patch_depth == 0:
      _original_dpa = jax.nn.dot_product_attention
      jax.nn.dot_product_attention = _dispatch_dpa
    _patch_depth += 1
  prev = getattr(_local, "sites", None), getattr(_local, "masks", False)
  _local.sites, _local.masks = sites, masks
  try:
    yield
  finally:
    _local.sites, _local.masks = prev
    with _patch_lock:
      _patch_depth -= 1
      if _patch_depth == 0:
        jax.nn.dot_product_attention = _original_dpa


@functools.wraps(jax.nn.dot_product_attention)
def _dispatch_dpa(*args, **kwargs):
  sites = getattr(_local, "sites", None)
  original = _original_dpa
  if sites is None:
    return original(*args, **kwargs)
  _local.sites = None  # the op's own XLA backend may call the original
  try:
    return _attention(sites, original, *args, **kwargs)
  finally:
    _local.sites = sites


_DPA_KEYS = ("query", "key", "value", "bias", "mask")


def _attention(sites, original, *args, **kwargs):
  named = dict(zip(_DPA_KEYS, args))
  named.update(kwargs)
  q, k, v = named.get("query"), named.get("key"), named.get("value")
  where = _caller()
  shapes = " ".join(_fmt(a) for a in (q, k, v) if hasattr(a, "shape"))
  plan = _attention_plan(named, q, k, v, getattr(_local, "masks", False))
  if not isinstance(plan, str) and _differentiated([x for x in named.values()
                                                    if _is_array(x)]):
    # Differentiated inside ``fn`` (a training step): the ops are forward
    # only, so the call's primal and derivative would both be XLA's.
    plan = ("differentiated inside the function (a derivative of the ops is XLA's "
            "attention's, so the call runs as written)")
  if isinstance(plan, str):
    sites.append(Site("attention", where, shapes, False, reason=plan))
    return _kept(original, *args, **kwargs)
  op, causal, pattern, window = plan
  rank3 = q.ndim == 3
  if rank3:
    q, k, v = q[None], k[None], v[None]
  if window is not None:
    # A window the selector leaves to XLA's attention: the call as written
    # is that, without the op's masking and run-time check.
    chosen = _backend_of(op, (q, k, v), causal=causal, local_window_size=window,
                         kv_lengths=None if named.get("key_value_seq_lengths") is None
                         else jnp.zeros((q.shape[0],), jnp.int32))
    if chosen in ("xla", "?"):
      sites.append(Site(op, where, shapes, False, reason=(
          f"local_window_size {window}: the selector answers XLA's attention here (the "
          "call as written)" if chosen == "xla" else
          f"local_window_size {window}: no backend could be selected")))
      return _kept(original, *args, **kwargs)
  scale = named.get("scale")
  scale = None if scale is None else float(scale)
  lengths, mask = named.get("key_value_seq_lengths"), named.get("mask")
  from wavetune_jax import ops
  fn = ops.decode_attention if op == "decode_attention" else ops.attention
  opts = {} if window is None else {"local_window_size": window}

  def tuned(a, b, c, lens):
    return fn(a, b, c, causal=causal, scale=scale, kv_lengths=lens, **opts)

  def orig(a, b, c, *extra):  # the call as written, on these arrays
    kw = {key: x for key, x in kwargs.items() if key not in _DPA_KEYS}
    kw.update(zip(("bias", "mask"), args[3:]))
    if extra:
      kw["mask" if mask is not None else "key_value_seq_lengths"] = extra[0]
    return original(a, b, c, **kw)

  def run(a, b, c, *extra):
    if window is not None and extra:
      # Every query must see a key: XLA's attention gives a query with
      # none the mean of all values, the op zeros.
      ok = _window_rows_see_keys(extra[0], a.shape[1], b.shape[1], window[0])
      return jax.lax.cond(ok, lambda: tuned(a, b, c, extra[0]), lambda: orig(a, b, c, *extra))
    if mask is None:
      return tuned(a, b, c, extra[0] if extra else None)
    lens, ok = _mask_as_lengths(extra[0], a.shape[0], a.shape[1], b.shape[1], pattern)
    return jax.lax.cond(ok, lambda: tuned(a, b, c, lens), lambda: orig(a, b, c, *extra))

  extra = (mask,) if mask is not None else ((lengths,) if lengths is not None else ())
  try:
    with jax.named_scope(f"{_SCOPE}.autotune"):
      out = _same_derivative(orig, run, q, k, v, *extra)
    backend = _backend_of(op, (q, k, v), causal=causal,
                          kv_lengths=jnp.zeros((q.shape[0],), jnp.int32)
                          if mask is not None or lengths is not None else None, **opts)
  except (ValueError, TypeError, NotImplementedError) as e:
    sites.append(Site(op, where, shapes, False, reason=f"the op rejects it: {_one_line(e)}"))
    return _kept(original, *args, **kwargs)
  if mask is not None:
    backend += f" (when the mask is {pattern} with key lengths, checked at run time)"
  elif window is not None and lengths is not None:
    backend += " (when every query sees a key of its window, checked at run time)"
  sites.append(Site(op, where, shapes, True, backend=backend))
  return out[0] if rank3 else out


def _kept(original, *args, **kwargs):
  """The call as written; its equations (XLA's attention: batched
  ``dot_general``, a softmax) are not looked at again in the jaxpr."""
  with jax.named_scope(f"{_SCOPE}.kept"):
    return original(*args, **kwargs)


def _attention_plan(named, q, k, v, masks: bool):
  """``(op, causal, mask pattern, window)`` for a call the ops reproduce
  (``window``: ``(left, right)`` or None), else the reason it is kept."""
  for key in ("bias", "query_seq_lengths"):
    if named.get(key) is not None:
      return f"{key} given (the ops take causal masks, windows and key lengths)"
  if named.get("return_residual"):
    return "return_residual=True"
  known = set(_DPA_KEYS) | {"scale", "is_causal", "key_value_seq_lengths", "implementation",
                            "local_window_size", "query_seq_lengths", "return_residual"}
  extra = sorted(set(named) - known)
  if extra:
    return f"argument {extra[0]}"
  if not all(hasattr(a, "shape") and hasattr(a, "dtype") for a in (q, k, v)):
    return "operands are not arrays"
  if not q.ndim == k.ndim == v.ndim or q.ndim not in (3, 4):
    return "operands are not [batch, seq, heads, head_dim]"
  if not q.dtype == k.dtype == v.dtype or q.dtype not in _ATTN_DTYPES:
    return f"dtype {q.dtype} (the ops take bfloat16 or float16)"
  if k.shape != v.shape or q.shape[-1] != k.shape[-1]:
    return "K and V of different shapes (head_dim of V differs)"
  if isinstance(named.get("scale"), jax.core.Tracer):
    return "a traced scale"
  causal = named.get("is_causal", False)
  if isinstance(causal, jax.core.Tracer):
    return "a traced is_causal"
  causal = bool(causal)
  t, s = q.shape[-3], k.shape[-3]
  mask = named.get("mask")
  window = named.get("local_window_size")
  if window is not None:
    # wt.attention aligns a window top-left, as JAX does, at any query count.
    if mask is not None:
      return "mask given with local_window_size"
    window = _window_pair(window)
    if isinstance(window, str):
      return window
    impl = named.get("implementation")
    if (impl == "cudnn" and window[1] != 0
        and not (causal and named.get("key_value_seq_lengths") is None)):
      return ("implementation='cudnn' with a right window side (JAX's cuDNN path takes a "
              "left window only)")
    if t > s + window[0]:
      return (f"local_window_size {window} leaves queries past key {s} + {window[0]} with no "
              "key (XLA's attention gives them the mean of the values)")
    return "attention", causal, None, window
  if mask is None:
    if not causal and t <= 64:
      return "decode_attention", False, None, None
    return "attention", causal, None, None
  # A mask: replaced where it is, at run time, causal + key lengths (a
  # prefill) or the bottom-right causal band of a cache (a decode step);
  # any other mask runs the original call.
  if not masks:
    return "mask given (wt.autotune(fn, masks=True) checks masks at run time)"
  if causal or named.get("key_value_seq_lengths") is not None:
    return "mask given with is_causal or key_value_seq_lengths"
  if not hasattr(mask, "dtype") or mask.dtype != jnp.bool_ or mask.ndim != 4 or q.ndim != 4:
    return "mask given that is not a [batch, heads, q, kv] boolean array"
  if any(d not in (1, full) for d, full in zip(mask.shape, (q.shape[0], q.shape[2], t, s))):
    return "mask given of another shape"
  if t == s:
    return "attention", True, "causal", None
  if t <= 64:
    return "decode_attention", True, "the bottom-right causal band", None
  return "mask given, of more than 64 queries over a longer cache"


def _window_pair(window):
  """``(left, right)`` Python ints of a ``local_window_size`` as JAX reads
  it (a Python int ``w`` is ``(w, w)``; a pair of integers is unpacked),
  else the reason the call is kept (the call as written then raises JAX's
  own error where it has one)."""
  pair = (window, window) if isinstance(window, int) else window
  if (not isinstance(pair, (tuple, list)) or len(pair) != 2
      or not all(isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_))
                 for x in pair)):
    return f"local_window_size {window!r} is not an int or a pair of ints"
  if min(pair) < 0:
    return f"local_window_size {window!r} has a negative side (the ops take sides >= 0)"
  return int(pair[0]), int(pair[1])


def _window_rows_see_keys(lengths, t: int, s: int, left: int):
  """Whether, under a top-left window of ``left`` keys back, every query of
  every sequence sees a key: query ``t - 1`` sees none past ``length +
  left``, and a sequence of no key none."""
  n = jnp.clip(jnp.asarray(lengths).astype(jnp.int32), 0, s)
  return jnp.all(n >= max(1, t - left))


def _mask_as_lengths(mask, batch, t, s, pattern):
  """``(lengths [batch], ok)``: the key lengths ``mask`` encodes and whether
  it is exactly ``pattern`` for them (every head alike; every sequence with a
  key for every query)."""
  m = jnp.broadcast_to(mask, (mask.shape[0], mask.shape[1], t, s))
  lens = jnp.sum(m[:, 0, t - 1, :], axis=-1, dtype=jnp.int32)  # the last query sees them all
  i = jax.lax.broadcasted_iota(jnp.int32, (1, t, s), 1)
  j = jax.lax.broadcasted_iota(jnp.int32, (1, t, s), 2)
  n = lens[:, None, None]
  if pattern == "causal":
    want, enough = (j <= i) & (j < n), lens >= 1
  else:  # query i is position n - t + i of its sequence
    want, enough = j <= i + n - t, lens >= t
  ok = jnp.all(m == want[:, None]) & jnp.all(enough)
  return jnp.broadcast_to(lens, (batch,)), ok


def _caller() -> str:
  """The user's line that called ``jax.nn.dot_product_attention``."""
  import traceback
  try:
    stack = traceback.extract_stack()[:-3]
  except Exception:  # noqa: BLE001 - the report only
    return "?"
  for frame in reversed(stack):
    f = frame.filename
    if "/jax/" in f or f.endswith("dropin.py") or "contextlib" in f:
      continue
    return f"{f}:{frame.lineno} ({frame.name})"
  return "?"

