"""The registry of families: explicit, filled by ``wavetune_jax.families``."""

from __future__ import annotations

from typing import Sequence

from wavetune_jax.core.family import Family

__all__ = ["register", "get_family", "registered"]

_REGISTRY: dict[str, Family] = {}


def register(family: Family) -> Family:
  """Registers ``family`` under ``family.name`` and returns it."""
  if not isinstance(family, Family):
    raise TypeError(f"register takes a Family instance; got {family!r}")
  old = _REGISTRY.get(family.name)
  if old is not None and type(old) is not type(family):
    raise ValueError(f"a different family is already registered as {family.name!r}")
  _REGISTRY[family.name] = family
  return family


def _builtins() -> None:
  import wavetune_jax.families  # noqa: F401  (registers the built-in families)


def get_family(name: str | Family) -> Family:
  """The registered family called ``name`` (a Family is returned as given)."""
  if isinstance(name, Family):
    return name
  _builtins()
  try:
    return _REGISTRY[name]
  except (KeyError, TypeError):
    raise ValueError(f"unknown family {name!r}; families are {registered()}") from None


def registered() -> Sequence[str]:
  _builtins()
  return sorted(_REGISTRY)
