"""Shapes outside the suites, as a new model brings them.

For seeded random problems of every family (realistic sizes: weight dims
multiples of 16 to 128, any token count, GQA ratios, head dims 64 to 256,
sliding windows, soft caps, sinks, paged caches, float16 inputs and float32
outputs), the config the selector picks for an H100 and for an H200, under
the shipped tables, the families' rules alone and their fixed defaults, is valid for the
problem, and its kernel lowers for CUDA (Mosaic, Triton, cuDNN or XLA, as
picked). A pick that failed here would raise in the op on that GPU. The
decoder steps of ``wavetune bench model`` are lowered the same way.

The kernels ask the device for its SM count, the grouped GEMM's guard asks for
cuDNN's version (it trusts the kernel over XLA's dense ragged dot before cuDNN
9.22), and JAX's cuDNN attention asks for cuDNN and the GPU as it lowers: all
are answered as on the GPUs measured (cuDNN 9.19, compute capability 9.0).
"""

import math
import sys
import types
import warnings

import jax
import numpy as np
import pytest

import wavetune_jax as wt
from wavetune_jax.core import versions
from wavetune_jax.core.hardware import get_hardware
from wavetune_jax.runtime.selector import clear

pytestmark = pytest.mark.filterwarnings("ignore:wavetune_jax. no GPU")

GPUS = ("nvidia_h100_80gb_hbm3", "nvidia_h200")
FAMILIES = ("matmul", "attention", "decode", "ragged_dot", "qmatmul", "qragged_dot")
PER_FAMILY = 20
_CUDNN_LOWERS = True


class _Gen:
  def __init__(self, seed: int):
    self.rng = np.random.default_rng(seed)

  def pick(self, *xs):
    return xs[int(self.rng.integers(len(xs)))]

  def size(self, lo: int, hi: int) -> int:
    """Log-uniform in [lo, hi]."""
    return int(round(math.exp(self.rng.uniform(math.log(lo), math.log(hi)))))

  def dim(self, lo: int, hi: int) -> int:
    """A weight dimension: a multiple of 64 mostly, of 128 or 16 at times."""
    q = self.pick(64, 64, 128, 16)
    return max(q, self.size(lo, hi) // q * q)


def _problem_fields(family: str, r: _Gen) -> dict:
  out16 = dict(dtype=r.pick("bfloat16", "bfloat16", "float16"),
               out_dtype=r.pick("", "", "float32"))
  if family == "matmul":
    return dict(m=r.size(1, 20000), n=r.dim(64, 60000), k=r.dim(64, 30000), **out16)
  if family == "ragged_dot":
    return dict(m=r.size(1, 40000), g=r.size(2, 160), k=r.dim(128, 8000),
                n=r.dim(128, 30000), **out16)
  if family == "qmatmul":
    kind = r.pick("w8a8", "w8a16", "int4")
    if kind == "w8a8":
      return dict(m=r.size(1, 20000), n=r.dim(64, 60000), k=r.dim(128, 30000),
                  dtype="float8_e4m3fn", w_dtype="float8_e4m3fn", w_layout="nk",
                  out_dtype=r.pick("", "float32"))
    if kind == "int4":
      gs = r.pick(64, 128)
      return dict(m=r.size(1, 300), n=r.dim(64, 30000), k=gs * r.size(2, 200),
                  dtype="bfloat16", w_dtype="int4", w_layout="nk", group_size=gs)
    return dict(m=r.size(1, 20000), n=r.dim(64, 60000), k=r.dim(64, 30000),
                dtype="bfloat16", w_dtype=r.pick("int8", "float8_e4m3fn"),
                w_layout=r.pick("kn", "nk"))
  if family == "qragged_dot":
    if r.pick(True, False):
      return dict(m=r.size(1, 40000), g=r.size(2, 160), k=r.dim(128, 8000),
                  n=r.dim(128, 30000), dtype="float8_e4m3fn", w_dtype="float8_e4m3fn",
                  w_layout="nk")
    return dict(m=r.size(1, 40000), g=r.size(2, 160), k=r.dim(128, 8000),
                n=r.dim(128, 30000), dtype="bfloat16", w_dtype=r.pick("int8", "float8_e4m3fn"),
                w_layout="kn")
  kv_heads = r.pick(1, 2, 4, 8, 16)
  heads = dict(q_heads=kv_heads * r.pick(1, 2, 4, 5, 6, 8), kv_heads=kv_heads,
               head_dim=r.pick(64, 80, 96, 128, 128, 192, 256),
               dtype=r.pick("bfloat16", "bfloat16", "float16"))
  if r.pick(True, False, False):
    heads.update(window_left=r.size(16, 8192), window_right=0)
  if r.pick(True, False, False, False):
    heads["soft_cap"] = r.pick(30.0, 50.0)
  if r.pick(True, False, False, False):
    heads["sinks"] = True
  if family == "attention":
    q_len = r.size(1, 20000)
    return dict(batch=r.size(1, 8), q_len=q_len, kv_len=r.pick(0, 0, q_len + r.size(1, 8000)),
                lengths=r.pick(False, False, True), causal=r.pick(True, True, False),
                causal_align=r.pick("top_left", "bottom_right"), **heads)
  page = r.pick(0, 0, 16, 64, 256)
  kv_len = r.size(16, 60000)
  kv_len = max(page, kv_len // page * page) if page else kv_len
  return dict(batch=r.size(1, 128), kv_len=kv_len, q_len=r.pick(1, 1, 1, 2, 4), page_size=page,
              lengths=r.pick(True, True, False), **heads)


def _problems(family: str, n: int, seed: int) -> list:
  spec, r, out = wt.get_family(family), _Gen(seed), []
  while len(out) < n:
    try:
      out.append(spec.problem_cls(**_problem_fields(family, r)))
    except ValueError:
      continue  # an invalid combination (a window past a non-causal problem, ...)
  return out


@pytest.fixture
def as_on_the_gpus(monkeypatch):
  gpu = types.SimpleNamespace(core_count=132, platform="gpu", compute_capability="9.0",
                              device_kind="NVIDIA H100 80GB HBM3")
  for name, mod in list(sys.modules.items()):
    if name.startswith(("pallas_kernels", "wavetune_jax")) and hasattr(
        mod, "require_compute_capability"):
      monkeypatch.setattr(mod, "require_compute_capability", lambda *a: gpu)
  real = versions.current
  monkeypatch.setattr(versions, "current", lambda: dict(real(), cuda="13.0", cudnn="9.19.0"))
  # JAX's cuDNN attention checks the installed cuDNN and the GPU while it
  # lowers (head dims, layouts): answered as cuDNN 9.19 on a Hopper GPU.
  try:
    import jax._src.cudnn.fused_attention_stablehlo as fa
    monkeypatch.setattr(fa, "check_cudnn_version", lambda: 91900)
    monkeypatch.setattr(fa, "check_compute_capability",
                        lambda c: tuple(map(int, c.split("."))) <= (9, 0))
    monkeypatch.setattr(fa, "is_cuda_compute_capability_equal", lambda c: c == "9.0")
  except (ImportError, AttributeError):  # another JAX: cuDNN configs are validated only
    monkeypatch.setattr(sys.modules[__name__], "_CUDNN_LOWERS", False)
  clear()
  yield
  clear()


def _lower(spec, problem, config) -> None:
  backend = spec.backend_of(config)
  args = jax.eval_shape(lambda: spec.inputs(problem, jax.random.PRNGKey(0)))
  f = lambda *a: backend.run(problem, config, *a)  # noqa: E731
  jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("policy", ["tables", "heuristic", "fixed"])
@pytest.mark.parametrize("family", FAMILIES)
def test_every_pick_on_new_shapes_runs(family, policy, as_on_the_gpus):
  spec = wt.get_family(family)
  seed = FAMILIES.index(family) + 100 * ("tables", "heuristic", "fixed").index(policy)
  backends = set()
  for problem in _problems(family, PER_FAMILY if policy == "tables" else 8, seed):
    for gpu in GPUS:
      clear()
      with wt.policy(policy), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sel = wt.select(family, problem, gpu)
      spec.validate(problem, sel.config, get_hardware(gpu))
      name = spec.backend_of(sel.config).name
      backends.add(name)
      if name != "cudnn" or _CUDNN_LOWERS:
        _lower(spec, problem, sel.config)
  # The sample reaches the kernels, not only the platform op: Triton is the
  # rules' pick for attention and decode, and the fixed default of the four
  # 16-bit families.
  if family not in ("matmul", "qmatmul") and policy != "fixed":
    assert backends - {"xla", "cudnn"}, backends
  if (policy == "heuristic" and family in ("attention", "decode")) or (
      policy == "fixed" and family in ("attention", "decode", "matmul", "ragged_dot")):
    assert "triton" in backends, backends


def test_decode_window_on_a_cache_the_kernel_cannot_tile(as_on_the_gpus):
  """The Mosaic decode kernel needs the cache a multiple of 8 rows. The
  tables' answer for a windowed problem is read at its size bucket's top (a
  multiple of 128, which the kernel runs), so at 5,397 keys it named the
  kernel and the op raised; the selector now checks a table's answer
  against the problem and falls back to the family's rule at this size."""
  spec = wt.get_family("decode")
  for kv_len, runs_mosaic in ((5397, False), (5400, True)):
    p = spec.problem_cls(batch=34, q_heads=8, kv_heads=2, kv_len=kv_len, head_dim=256,
                         window_left=220, window_right=0)
    for gpu in GPUS:
      clear()
      with wt.policy("tables"), warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        sel = wt.select("decode", p, gpu)
      assert (spec.backend_of(sel.config).name == "mosaic") == runs_mosaic, (kv_len, sel)
      said = [str(w.message) for w in said if "cannot run" in str(w.message)]
      if runs_mosaic:
        assert not said
      else:
        assert "cannot run this problem" in sel.note and "multiple of 8" in sel.note
        # The slower fallback is said once, with what to change.
        assert len(said) == 1 and "got 5397" in said[0], said
        assert "the xla backend runs it instead" in said[0]
      _lower(spec, p, sel.config)


@pytest.mark.parametrize("gpu", GPUS)
@pytest.mark.parametrize("model,weights", [("gemma_3_4b", "bf16"), ("gpt_oss_20b", "w8a8"),
                                           ("qwen2_5_1_5b", "int8"), ("mixtral_8x7b", "bf16")])
def test_decoders_lower_for_cuda(model, weights, gpu, as_on_the_gpus, monkeypatch):
  """``wavetune bench model``'s decoders with the tables' ops, lowered for
  CUDA as a GPU would run them: prefill of 333 tokens, a decode step of 5
  sequences on contiguous caches of 1,037 and 2,500 keys (not multiples of
  8: the windowed layers' Mosaic decode kernel cannot tile them) and on pages
  of 16. Real layer shapes, two layers (Gemma-3: six, for one global layer),
  nothing allocated."""
  import functools
  import re
  import jax.numpy as jnp
  from wavetune_jax.core import hardware
  import wavetune_jax.models.decoder as M
  monkeypatch.setattr(hardware, "current", lambda: get_hardware(gpu))
  cfg = M.MODELS[model]
  cfg = cfg.with_layers(cfg.global_every if cfg.global_every > 2 else 2)
  ops = M.make_ops("tables")

  def init():
    p = M.init(jax.random.PRNGKey(0), cfg)
    return p if weights == "bf16" else M.quantize_params(p, cfg, weights)

  params = jax.eval_shape(init)
  kernels = set()

  def lower(fn, *args):
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    kernels.update(re.findall(r'custom_call @([\w$.]+)', text))

  sds = jax.ShapeDtypeStruct
  lower(functools.partial(M.prefill, cfg=cfg, ops=ops, max_len=2500), params,
        sds((1, 333), jnp.int32))
  batch = (sds((5,), jnp.int32),) * 2
  for cache in (1037, 2500):
    kc = [sds((5, cache, cfg.kv_heads, cfg.head_dim), jnp.bfloat16)] * cfg.layers
    lower(functools.partial(M.decode_step, cfg=cfg, ops=ops, write_cache=False), params, kc,
          kc, *batch)
  pages = [sds((5 * 160, 16, cfg.kv_heads, cfg.head_dim), jnp.bfloat16)] * cfg.layers
  lower(functools.partial(M.paged_decode_step, cfg=cfg, ops=ops, write_cache=False), params,
        pages, pages, sds((5, 160), jnp.int32), *batch)
  assert kernels & {"mosaic_gpu_v2", "__gpu$xla.gpu.triton", "__cudnn$fmhaSoftmax"}, kernels


def test_the_fallback_is_said_when_read_back_from_the_table_cache(tmp_path, as_on_the_gpus):
  """A decision kept with a cached table (a later process) says the same."""
  from wavetune_jax.runtime import selector, table_cache
  spec = wt.get_family("decode")
  p = spec.problem_cls(batch=5, q_heads=8, kv_heads=4, kv_len=2500, head_dim=256,
                       window_left=1023, window_right=0)
  saved = dict(table_cache._state)
  table_cache.set_dir(tmp_path / "cache")
  try:
    said = []
    for _ in range(2):   # decided, then read back from the cache's entry
      selector.clear()
      with wt.policy("tables"), warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        sel = wt.select("decode", p, "nvidia_h200")
      selector._persist_decisions()
      said.append([str(x.message) for x in w if "runs it instead" in str(x.message)])
      assert spec.backend_of(sel.config).name == "xla" and "multiple of 8" in sel.note
    assert [len(x) for x in said] == [1, 1], said
    assert table_cache.stats()["hits"] >= 1
  finally:
    table_cache._state.update(saved)
    selector.clear()


@pytest.mark.parametrize("gpu", GPUS)
def test_vmapped_ops_lower_for_cuda(gpu, as_on_the_gpus, monkeypatch):
  """``jax.vmap`` of attention and decode with sequence lengths, as a GPU
  runs it: the vmapped axis is folded into the batch (JAX's cuDNN attention
  cannot batch sequence lengths: it raised a reshape error here)."""
  import re
  import jax.numpy as jnp
  from wavetune_jax.core import hardware
  monkeypatch.setattr(hardware, "current", lambda: get_hardware(gpu))
  sds, bf, i32 = jax.ShapeDtypeStruct, jnp.bfloat16, jnp.int32
  q1, q5 = sds((3, 4, 1, 32, 128), bf), sds((3, 2, 2048, 32, 128), bf)
  kv, kv2 = sds((3, 4, 4096, 8, 128), bf), sds((3, 2, 2048, 8, 128), bf)
  pool, table = sds((256, 64, 8, 128), bf), sds((3, 4, 64), i32)
  cases = [
      (lambda q, k, v, n: wt.decode_attention(q, k, v, kv_lengths=n), (q1, kv, kv, sds((3, 4), i32))),
      (lambda q, k, v, n: wt.decode_attention(q, k, v, kv_lengths=n, local_window_size=(1023, 0)),
       (q1, kv, kv, sds((3, 4), i32))),
      (lambda q, k, v, n: wt.attention(q, k, v, kv_lengths=n), (q5, kv2, kv2, sds((3, 2), i32))),
  ]
  kernels = set()
  for f, args in cases:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      text = jax.jit(jax.vmap(f)).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    kernels.update(re.findall(r'custom_call @([\w$.]+)', text))
  paged = lambda q, n, t, k, v: wt.decode_attention(q, k, v, kv_lengths=n, block_tables=t)  # noqa: E731
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    jax.jit(jax.vmap(paged, in_axes=(0, 0, 0, None, None))).trace(
        q1, sds((3, 4), i32), table, pool, pool).lower(lowering_platforms=("cuda",))
  assert "mosaic_gpu_v2" in kernels, kernels
