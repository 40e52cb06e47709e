"""Shape suites shipped with the package (from public LLM configurations)."""

from __future__ import annotations

import json
import os
from importlib import resources

__all__ = ["load_suite", "gemm_weights", "attention_models"]


def load_suite(name_or_path: str = "train") -> dict:
  """Loads a shape suite: a built-in name (``"train"``) or a JSON file path."""
  if os.path.exists(name_or_path):
    with open(name_or_path) as f:
      return json.load(f)
  try:
    text = resources.files(__package__).joinpath(f"{name_or_path}.json").read_text()
  except FileNotFoundError:
    raise ValueError(f"no shape suite {name_or_path!r}: not a file and not a "
                     f"built-in suite (built-in: 'train')") from None
  return json.loads(text)


def gemm_weights(suite: dict, names=None) -> dict[str, tuple[int, int]]:
  """``{weight name: (N, K)}`` of a suite's GEMM section, optionally filtered."""
  weights = suite["gemm"]["weights"]
  if names:
    unknown = sorted(set(names) - set(weights))
    if unknown:
      raise ValueError(f"unknown weight(s) {unknown}; the suite has {sorted(weights)}")
    weights = {k: weights[k] for k in names}
  return {k: (v["N"], v["K"]) for k, v in weights.items()}


def attention_models(suite: dict, names=None) -> dict[str, dict]:
  """``{model name: {"q_heads", "kv_heads", "head_dim"}}`` of a suite's attention
  section, optionally filtered."""
  models = suite["attention"]["models"]
  if names:
    unknown = sorted(set(names) - set(models))
    if unknown:
      raise ValueError(f"unknown attention model(s) {unknown}; the suite has "
                       f"{sorted(models)}")
    models = {k: models[k] for k in names}
  return dict(models)
