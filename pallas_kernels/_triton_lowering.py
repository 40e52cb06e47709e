"""The Pallas Triton lowering, imported in this one place.

JAX 0.11 deprecates ``jax.experimental.pallas.triton`` (a
``DeprecationWarning`` on import and at lowerings) and has announced its
removal. The Triton kernels, their backends and the profiler's L2 flush take
the lowering from here:

* :data:`plgpu` is the module, or None where this JAX has none; then
  :data:`IMPORT_ERROR` keeps the ``ImportError`` and :data:`REASON` says it in
  one line, with the JAX version. The Triton backends report themselves
  unavailable with that reason and the selector passes them over.
* :func:`compiler_params` builds a kernel's ``CompilerParams`` through
  :func:`require`, so a Triton kernel called without the lowering fails
  there, before its body is traced, with :class:`TritonUnavailableError` (a
  ``ValueError``) naming the reason.
* JAX's deprecation of the lowering reaches the user at most once per
  process: a deprecation warning of the import is passed on once, and later
  ones of the lowering (JAX's message says "Pallas Triton" and "deprecated")
  are filtered.
"""

from __future__ import annotations

import re
import types
import warnings

import jax

__all__ = ["plgpu", "IMPORT_ERROR", "REASON", "DEPRECATION_MESSAGE",
           "TritonUnavailableError", "available", "require", "compiler_params"]

#: JAX's deprecation warnings of the lowering, as a ``warnings`` filter
#: message (matched from the start, ignoring case).
DEPRECATION_MESSAGE = r".*pallas triton\b.*deprecated"


class TritonUnavailableError(ValueError):
  """A Pallas Triton kernel was asked for where this JAX has no Triton lowering."""


def _import() -> tuple[types.ModuleType | None, ImportError | None, list]:
  """The lowering (or the ``ImportError``), and the warnings its import gave."""
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
      from jax.experimental.pallas import triton as module
    except ImportError as e:
      return None, e, list(caught)
  return module, None, list(caught)


def _pass_on(caught: list) -> None:
  """Re-issues the import's warnings (each deprecation once per process) and
  filters the lowering's later deprecation warnings."""
  texts = []
  for w in caught:
    if issubclass(w.category, DeprecationWarning):
      text = str(w.message)
      if text in texts:
        continue
      texts.append(text)
    warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
  for text in texts:
    warnings.filterwarnings("ignore", message=re.escape(text), category=DeprecationWarning)
  warnings.filterwarnings("ignore", message=DEPRECATION_MESSAGE, category=DeprecationWarning)


def _reason(e: ImportError | None) -> str | None:
  if e is None:
    return None
  what = " ".join(f"{type(e).__name__}: {e}".split())
  return f"Pallas Triton is not available in this JAX (jax {jax.__version__}): {what}"


plgpu, IMPORT_ERROR, _caught = _import()
_pass_on(_caught)
del _caught

#: Why the lowering cannot be used, in one line (None: it can).
REASON: str | None = _reason(IMPORT_ERROR)


def available() -> bool:
  """Whether this JAX has the Pallas Triton lowering."""
  return plgpu is not None


def require(what: str = "a Pallas Triton kernel") -> types.ModuleType:
  """The lowering's module.

  Raises:
    TritonUnavailableError: this JAX has no Pallas Triton lowering; the
      message names ``what`` and :data:`REASON`.
  """
  if plgpu is None:
    raise TritonUnavailableError(f"{what} cannot run: {REASON}; use another backend")
  return plgpu


def compiler_params(**fields):
  """``plgpu.CompilerParams(**fields)`` (:func:`require` first)."""
  return require().CompilerParams(**fields)
