"""A script of ``benchmarks/`` imported as a module, for tests."""

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_benchmark(name: str):
  """``benchmarks/<name>.py`` as a module (its ``main`` not run)."""
  spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "benchmarks" / f"{name}.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod
