"""docs/extending.md's worked example runs as written.

The first ```python block after the heading containing "Worked example" is
executed as a module; the op it defines must match its family's reference on
random data, and the selector must choose the example's backend.
"""

import os
import re
import sys
import types

import jax
import numpy as np
import pytest

DOC = os.path.join(os.path.dirname(__file__), os.pardir, "docs", "extending.md")
MODULE = "wavetune_extending_example"


def example_code() -> str:
  """The block, preceded by blank lines so that tracebacks give doc line numbers."""
  with open(DOC) as f:
    text = f.read()
  heading = re.search(r"^#+ .*Worked example.*$", text, re.MULTILINE)
  assert heading, "docs/extending.md has no heading containing 'Worked example'"
  block = re.compile(r"^```python\n(.*?)^```", re.MULTILINE | re.DOTALL).search(
      text, heading.end())
  assert block, "no ```python block after the 'Worked example' heading"
  return "\n" * text.count("\n", 0, block.start(1)) + block.group(1)


@pytest.fixture(scope="module")
def example():
  from wavetune_jax.core import registry
  from wavetune_jax.runtime import selector
  mod = types.ModuleType(MODULE)
  sys.modules[MODULE] = mod
  try:
    exec(compile(example_code(), DOC, "exec"), mod.__dict__)
    yield mod
  finally:
    sys.modules.pop(MODULE, None)
    registry._REGISTRY.pop("rowsum", None)  # leave the built-in families only
    selector.clear()


def test_example_matches_reference(example):
  fam = example.ROWSUM
  for m, n, seed in ((37, 300, 1), (5, 129, 2), (64, 1000, 3)):
    p = example.RowsumProblem(m=m, n=n)
    (x,) = fam.inputs(p, jax.random.PRNGKey(seed))
    with example.wt.policy("heuristic"):
      y = jax.jit(example.rowsum)(x)
    ref = fam.reference(p, x)
    assert y.shape == (m,)
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-5, atol=1e-4)
  # what the example itself computed
  ref = np.asarray(example.x, np.float64).sum(axis=1)
  np.testing.assert_allclose(np.asarray(example.y), ref, rtol=1e-5, atol=1e-4)
  np.testing.assert_allclose(np.asarray(example.y64), ref, rtol=1e-5, atol=1e-4)


def test_selector_chose_example_backend(example):
  from wavetune_jax.core import op
  fam = example.ROWSUM
  assert example.sel.source == "heuristic"
  assert fam.backend_of(example.sel.config).name == "xla"
  p = example.RowsumProblem(m=100, n=4096)
  with example.wt.policy("heuristic"):
    backend, config = op.choose(fam, p)
  assert backend.name == "xla"
  assert isinstance(backend, example.XlaRowsum)
  assert config == example.XlaRowsumConfig(block_n=128)
  assert example.wt.get_family("rowsum") is fam
