"""The wheel carries every module and shipped table (``setup.py`` discovers
them; ``.ci/run`` builds the wheel and runs it from outside the checkout)."""

import fnmatch
import os
import pathlib
import runpy

import pytest
import setuptools

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def setup_kwargs():
  """What ``setup.py`` passes to ``setuptools.setup`` (run with it captured)."""
  seen = {}
  real = setuptools.setup
  setuptools.setup = lambda **kw: seen.update(kw)
  cwd = os.getcwd()
  try:
    os.chdir(ROOT)  # setup.py discovers packages relative to its folder, as pip runs it
    runpy.run_path(str(ROOT / "setup.py"))
  finally:
    setuptools.setup = real
    os.chdir(cwd)
  return seen


def test_every_folder_with_python_code_is_a_package_of_the_wheel(setup_kwargs):
  packages = set(setup_kwargs["packages"])
  for top in ("wavetune_jax", "pallas_kernels"):
    dirs = {str(p.parent.relative_to(ROOT)).replace(os.sep, ".")
            for p in (ROOT / top).rglob("*.py") if "__pycache__" not in p.parts}
    missing = dirs - packages
    assert not missing, f"folders with Python code left out of the wheel: {missing}"


def test_every_shipped_table_is_package_data(setup_kwargs):
  pkg = "wavetune_jax.shipped_tables"
  src = ROOT / setup_kwargs["package_dir"][pkg]
  patterns = setup_kwargs["package_data"][pkg]
  files = sorted(src.glob("*/*.json"))
  assert {p.parent.name for p in files} >= {"nvidia_h100_80gb_hbm3", "nvidia_h200"}
  for path in files:
    rel = str(path.relative_to(src))
    assert any(fnmatch.fnmatch(rel, pat) for pat in patterns), rel
    assert f"{pkg}.{path.parent.name}" in setup_kwargs["packages"], path
