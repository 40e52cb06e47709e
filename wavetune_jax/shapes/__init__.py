"""Shape suites shipped with the package (from public LLM configurations).

Each family parses its own section of a suite (``Family.problems_from_suite``)."""

from __future__ import annotations

import json
import os
from importlib import resources

__all__ = ["BUILT_IN", "load_suite", "suite_entries"]


#: The built-in suites' names; a name among them is the built-in suite even
#: where a file or folder of that name is in the working directory.
BUILT_IN = ("train",)


def load_suite(name_or_path: str = "train") -> dict:
  """Loads a shape suite: a built-in name (:data:`BUILT_IN`, which wins
  over a file of that name in the working directory: name it ``./train``)
  or a JSON file path."""
  if name_or_path not in BUILT_IN and os.path.exists(name_or_path):
    try:
      with open(name_or_path) as f:
        suite = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
      raise ValueError(f"shape suite {name_or_path} is not readable JSON ({e})") from None
    if not isinstance(suite, dict):
      raise ValueError(f"shape suite {name_or_path} is not a JSON object")
    return suite
  try:
    text = resources.files(__package__).joinpath(f"{name_or_path}.json").read_text()
  except FileNotFoundError:
    raise ValueError(f"no shape suite {name_or_path!r}: not a file and not a "
                     f"built-in suite (built-in: {', '.join(map(repr, BUILT_IN))})") from None
  return json.loads(text)


def suite_entries(suite: dict, section: str, entries: str, names=None) -> dict:
  """``suite[section][entries]`` (a dict by name), only ``names`` if given;
  ``ValueError`` naming what is missing or unknown."""
  try:
    found = suite[section][entries]
  except (KeyError, TypeError):
    raise ValueError(f"the shape suite has no {section!r} section with {entries!r}") from None
  if names:
    unknown = sorted(set(names) - set(found))
    if unknown:
      raise ValueError(f"unknown {section} {entries} {unknown}; the suite has {sorted(found)}")
    found = {k: found[k] for k in names}
  return dict(found)
