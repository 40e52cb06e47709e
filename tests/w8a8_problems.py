"""The W8A8-FP8 problems the docs count picks over: the training suite's and
those of the unseen-model sets v1 and v2 (``benchmarks/unseen_models.py``;
the docs' counts predate v3)."""

import importlib.util
import pathlib

import wavetune_jax as wt
from wavetune_jax.shapes import load_suite

ROOT = pathlib.Path(__file__).resolve().parents[1]


def w8a8_problems(family: str) -> list:
  """``family``'s (``qmatmul`` or ``qragged_dot``) W8A8 problems, suite first."""
  spec = importlib.util.spec_from_file_location("unseen_models",
                                                ROOT / "benchmarks" / "unseen_models.py")
  um = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(um)
  probs = [p for p in wt.get_family(family).problems_from_suite(load_suite("train")) if p.w8a8]
  for s in ("v1", "v2"):
    probs += [p for _, _, p in um.problems([family], quick=False, model_set=s) if p.w8a8]
  return probs
