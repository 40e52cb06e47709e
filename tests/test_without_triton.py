"""The package on a JAX without the Pallas Triton lowering (deprecated in JAX
0.11, its removal announced): each check runs in a subprocess that hides the
lowering's modules before anything imports them, as a JAX that removed them
would."""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: What JAX's removal would take away: the public module and the lowering
#: itself (``pallas_call`` imports ``jax._src.pallas.triton`` to lower on a
#: GPU; with it gone only Mosaic GPU remains).
_HIDE = """
import sys
for _name in ("jax.experimental.pallas.triton", "jax._src.pallas.triton",
              "jax._src.pallas.triton.core", "jax._src.pallas.triton.lowering",
              "jax._src.pallas.triton.primitives",
              "jax._src.pallas.triton.pallas_call_registration"):
  sys.modules[_name] = None
"""

#: A JAX that still has the lowering but deprecates it (JAX 0.11): its
#: import warns, and so does every lowering.
_DEPRECATE = """
import importlib.abc, importlib.util, sys, warnings
MESSAGE = "The Pallas Triton backend is deprecated and will be removed in a future JAX version."
LOWERING = "Lowering with the Pallas Triton backend, which is deprecated; use Mosaic GPU."

class _Warns(importlib.abc.MetaPathFinder, importlib.abc.Loader):
  def find_spec(self, name, path, target=None):
    if name != "jax.experimental.pallas.triton":
      return None
    sys.meta_path.remove(self)
    try:
      spec = importlib.util.find_spec(name)
    finally:
      sys.meta_path.insert(0, self)
    self.real = spec.loader
    spec.loader = self
    return spec

  def create_module(self, spec):
    return self.real.create_module(spec)

  def exec_module(self, module):
    self.real.exec_module(module)
    warnings.warn(MESSAGE, DeprecationWarning, stacklevel=2)

sys.meta_path.insert(0, _Warns())
"""


def _run(code: str, *argv: str, options: tuple = (), prelude: str = _HIDE,
         timeout: int = 120):
  """``python <options> -c <prelude + code> <argv>`` on the CPU."""
  env = dict(os.environ, JAX_PLATFORMS="cpu", WAVETUNE_TABLE_CACHE="off",
             PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
  env.pop("WAVETUNE_DEBUG", None)
  return subprocess.run([sys.executable, *options, "-c", prelude + textwrap.dedent(code),
                         *argv], cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=timeout)


def _ok(r) -> str:
  assert r.returncode == 0, r.stdout + r.stderr
  return r.stdout


def test_import_and_backends_report_the_reason():
  out = _ok(_run("""
    import wavetune_jax as wt
    from pallas_kernels import _triton_lowering
    assert _triton_lowering.plgpu is None
    assert isinstance(_triton_lowering.IMPORT_ERROR, ImportError)
    # The config classes still construct (tables and user code name them).
    wt.TritonMatmulConfig(block_m=64); wt.TritonAttentionConfig()
    wt.TritonDecodeConfig(); wt.TritonRaggedDotConfig()
    h100 = wt.get_hardware("h100")
    for fam in (wt.MATMUL, wt.ATTENTION, wt.DECODE, wt.RAGGED_DOT):
      b = fam.backend("triton")
      assert not b.supported_on(h100) and not b.runs_on(h100), fam.name
      assert b.unavailable_reason(h100) == _triton_lowering.REASON
      assert b not in fam.available(h100)
      assert fam.backend("xla").runs_on(h100)
    print(_triton_lowering.REASON)
  """))
  assert out.startswith("Pallas Triton is not available in this JAX (jax ")
  assert "jax.experimental.pallas.triton" in out and len(out.strip().splitlines()) == 1


def test_ops_fall_back_to_xla_on_cpu_with_one_warning():
  out = _ok(_run("""
    import warnings
    warnings.simplefilter("always")
    import jax, jax.numpy as jnp, numpy as np
    import wavetune_jax as wt
    from pallas_kernels.attention.reference import attention_reference
    ks = jax.random.split(jax.random.PRNGKey(0), 8)
    f32 = jnp.float32
    with warnings.catch_warnings(record=True) as caught:
      x = jax.random.normal(ks[0], (24, 32), f32)
      w = jax.random.normal(ks[1], (32, 40), f32)
      y = jax.jit(wt.matmul)(x, w)
      np.testing.assert_allclose(y, x @ w, rtol=2e-2, atol=2e-2)

      q = jax.random.normal(ks[2], (1, 16, 2, 32), jnp.bfloat16)
      k = jax.random.normal(ks[3], (1, 16, 2, 32), jnp.bfloat16)
      v = jax.random.normal(ks[4], (1, 16, 2, 32), jnp.bfloat16)
      o = jax.jit(wt.attention)(q, k, v)
      ref = jax.nn.dot_product_attention(q.astype(f32), k.astype(f32), v.astype(f32),
                                         is_causal=True)
      np.testing.assert_allclose(o.astype(f32), ref, rtol=3e-2, atol=3e-2)

      qd = q[:, -1:]
      od = jax.jit(wt.decode_attention)(qd, k, v)
      refd = jax.nn.dot_product_attention(qd.astype(f32), k.astype(f32), v.astype(f32))
      np.testing.assert_allclose(od.astype(f32), refd, rtol=3e-2, atol=3e-2)

      lhs = jax.random.normal(ks[5], (20, 16), f32)
      rhs = jax.random.normal(ks[6], (3, 16, 24), f32)
      gs = jnp.array([7, 0, 13], jnp.int32)
      r = jax.jit(wt.ragged_dot)(lhs, rhs, gs)
      np.testing.assert_allclose(r, jax.lax.ragged_dot(lhs, rhs, gs), rtol=2e-2, atol=2e-2)
    hw = wt.get_hardware(None)
    assert hw.interpret
    for fam, args in ((wt.MATMUL, (x, w)), (wt.ATTENTION, (q, k, v)),
                      (wt.DECODE, (qd, k, v)), (wt.RAGGED_DOT, (lhs, rhs, gs))):
      sel = wt.select(fam, fam.bind(*args).problem)
      assert fam.backend_of(sel.config).name == "xla", (fam.name, sel)
    ours = [str(c.message) for c in caught if "wavetune_jax" in str(c.message)]
    assert len(ours) == 1, ours
    assert "Pallas Triton is not available" in ours[0] and "XLA" in ours[0], ours[0]
    print("ok")
  """, timeout=240))
  assert out.strip() == "ok"


def test_select_on_h100_passes_triton_over():
  out = _ok(_run("""
    import wavetune_jax as wt
    from wavetune_jax.runtime import selector
    from wavetune_jax.families.matmul import MatmulProblem
    from wavetune_jax.families.attention import AttentionProblem
    from wavetune_jax.families.decode import DecodeProblem
    from wavetune_jax.families.ragged_dot import RaggedDotProblem
    problems = {
        wt.MATMUL: [MatmulProblem(m=m, n=4096, k=4096, dtype="bfloat16")
                    for m in (1, 16, 100, 256, 4096)],
        wt.ATTENTION: [AttentionProblem(batch=1, q_len=s, kv_len=s, q_heads=32, kv_heads=8,
                                        head_dim=128, dtype="bfloat16") for s in (128, 3000)],
        wt.DECODE: [DecodeProblem(batch=b, q_len=1, kv_len=4096, q_heads=32, kv_heads=8,
                                  head_dim=128, dtype="bfloat16") for b in (1, 16)],
        wt.RAGGED_DOT: [RaggedDotProblem(m=512, g=8, k=2048, n=1024, dtype="bfloat16")],
    }
    for fam, ps in problems.items():
      for pol in ("tables", "heuristic", "fixed"):
        with selector.policy(pol):
          for p in ps:
            sel = wt.select(fam, p, "h100")
            assert fam.backend_of(sel.config).name != "triton", (fam.name, pol, p, sel)
            if pol == "fixed":
              assert "Pallas Triton is not available" in sel.note, sel
    print("ok")
  """))
  assert out.strip() == "ok"


def test_exact_table_entry_of_triton_is_passed_over():
  _ok(_run("""
    import wavetune_jax as wt
    from wavetune_jax.runtime import selector, tables
    hw = wt.get_hardware("h100")
    table = tables.load(tables.default_path("matmul", hw.device_key), wt.MATMUL, hw)
    hits = [(p, c) for p, (c, _) in table.exact.items()
            if wt.MATMUL.backend_of(c).name == "triton"]
    assert hits, "the shipped H100 table has exact Triton entries"
    p, c = hits[0]
    sel = wt.select(wt.MATMUL, p, hw)
    assert wt.MATMUL.backend_of(sel.config).name != "triton", sel
    assert sel.source != "exact"
  """))


def test_pinned_triton_config_raises_with_the_reason():
  out = _ok(_run("""
    import jax.numpy as jnp
    import wavetune_jax as wt
    x = jnp.ones((16, 32), jnp.float32)
    w = jnp.ones((32, 32), jnp.float32)
    msgs = []
    for call in (lambda: wt.matmul(x, w, config=wt.TritonMatmulConfig(block_m=16, block_n=32,
                                                                      block_k=32)),
                 lambda: wt.matmul(x, w, config={"backend": "triton"})):
      try:
        call()
      except ValueError as e:
        msgs.append(str(e))
    with wt.use_config("matmul", wt.TritonMatmulConfig()):
      try:
        wt.matmul(x, w)
      except ValueError as e:
        msgs.append(str(e))
    # The kernel itself, called directly, names the reason too.
    from pallas_kernels.matmul.triton import matmul as triton_matmul
    try:
      triton_matmul(x, w, config=wt.TritonMatmulConfig(block_m=16, block_n=32, block_k=32),
                    interpret=True)
    except ValueError as e:
      msgs.append(str(e))
    assert len(msgs) == 4, msgs
    for m in msgs:
      assert "\\n" not in m and "Pallas Triton is not available in this JAX" in m, m
    print(msgs[0])
  """))
  assert "triton backend of matmul does not run" in out


_CLI = """
from wavetune_jax.cli import main
sys.exit(main(sys.argv[1:]))
"""


def test_cli_select_names_the_reason_and_help_works():
  r = _run(_CLI, "select", "matmul", "--m", "100", "--n", "4096", "--k", "4096",
           "--device", "h100")
  assert r.returncode == 0, r.stdout + r.stderr
  assert "skipped     triton: Pallas Triton is not available in this JAX" in r.stdout
  assert "'backend': 'triton'" not in r.stdout
  assert "no usable" not in r.stderr, r.stderr  # the shipped table still loads
  r = _run(_CLI, "--help")
  assert r.returncode == 0 and "select" in r.stdout, r.stdout + r.stderr


def test_deprecated_lowering_still_runs_and_warns_once():
  """JAX 0.11: the lowering imports with a DeprecationWarning (and warns again
  at lowerings); the Triton kernels still run and the user sees it once."""
  r = _run("""
    import jax, jax.numpy as jnp, numpy as np
    import wavetune_jax as wt
    from pallas_kernels import _triton_lowering
    assert _triton_lowering.plgpu is not None and _triton_lowering.REASON is None
    x = jnp.ones((16, 32), jnp.float32)
    w = jnp.ones((32, 32), jnp.float32)
    cfg = wt.TritonMatmulConfig(block_m=16, block_n=32, block_k=32)
    np.testing.assert_allclose(jax.jit(lambda a, b: wt.matmul(a, b, config=cfg))(x, w), x @ w)
    for _ in range(3):  # what JAX may do at each lowering
      warnings.warn(MESSAGE, DeprecationWarning)
      warnings.warn(LOWERING, DeprecationWarning)
    print("ok")
  """, options=("-W", "always::DeprecationWarning"), prelude=_DEPRECATE)
  assert r.returncode == 0 and r.stdout.strip() == "ok", r.stdout + r.stderr
  assert r.stderr.count("Pallas Triton backend is deprecated") == 1, r.stderr
  assert "Lowering with the Pallas Triton" not in r.stderr, r.stderr


def test_one_place_imports_the_lowering():
  """Only ``pallas_kernels._triton_lowering`` imports the Triton lowering."""
  hits = []
  for base in ("pallas_kernels", "wavetune_jax"):
    for dirpath, _, files in os.walk(os.path.join(ROOT, base)):
      for f in files:
        if f.endswith(".py"):
          path = os.path.join(dirpath, f)
          with open(path) as fh:
            text = fh.read()
          if "pallas import triton" in text or "import jax.experimental.pallas.triton" in text:
            hits.append(os.path.relpath(path, ROOT))
  assert hits == [os.path.join("pallas_kernels", "_triton_lowering.py")]
