"""The wheel carries every module and shipped table (``setup.py`` discovers
them; ``.ci/run`` builds the wheel and runs it from outside the checkout)."""

import os
import pathlib

from setuptools import find_namespace_packages, find_packages

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _python_dirs(top: str) -> set[str]:
  return {str(p.parent.relative_to(ROOT)).replace(os.sep, ".")
          for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts}


def test_every_folder_with_python_code_is_a_discovered_package():
  found = set(find_packages(where=str(ROOT), include=["wavetune_jax", "wavetune_jax.*",
                                                      "pallas_kernels", "pallas_kernels.*"]))
  for top in ("wavetune_jax", "pallas_kernels"):
    missing = _python_dirs(top) - found
    assert not missing, f"folders with Python code but no __init__.py (left out of the wheel): {missing}"


def test_setup_discovers_the_shipped_tables():
  gpus = set(find_namespace_packages(where=str(ROOT / "tables")))
  assert {"nvidia_h100_80gb_hbm3", "nvidia_h200"} <= gpus
  for gpu in gpus:
    assert sorted(p.name for p in (ROOT / "tables" / gpu).glob("*.json")), gpu
  setup_py = (ROOT / "setup.py").read_text()
  assert 'package_dir={"wavetune_jax.shipped_tables": "tables"}' in setup_py
