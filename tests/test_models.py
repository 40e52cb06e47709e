"""The decoders of ``wavetune_jax.models`` and ``wavetune bench model`` on a CPU.

Each setting of the op switch runs the same model (the wavetune ops in Pallas
interpret mode); the bench command checks every setting's logits against the
xla setting's and fails above 5%, so a wrong op or a wrong cache update fails
it. A decode step after prefill must equal the prefill of the longer prompt.
"""

import dataclasses
import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wavetune_jax as wt
from wavetune_jax import models as M
from wavetune_jax.cli.main import main


def test_bench_model_runs_and_checks_every_setting(tmp_path, capsys):
  out = tmp_path / "bench.json"
  rc = main(["bench", "model", "--model", "small_moe", "--layers", "1", "--prompt", "12",
             "--decode-batch", "2", "--cache", "20", "--ops", "heuristic,default",
             "--json", str(out), "--compile-cache", str(tmp_path / "cache")])
  assert rc == 0
  assert os.listdir(tmp_path / "cache"), "the persistent compilation cache stayed empty"
  text = capsys.readouterr().out
  assert "[6/6] TPOT default" in text
  data = json.loads(out.read_text())
  rows = data["rows"]
  assert data["kv_arrays"] == "separate"
  assert {(r["setting"], r["kind"]) for r in rows} == {
      (s, k) for s in ("xla", "heuristic", "default") for k in ("prefill", "decode")}
  assert all(r["rel_diff_vs_xla"] < 5e-2 and r["compile_s"] > 0 for r in rows)
  for r in rows:  # the phases add up; only the wavetune settings decide
    parts = r["trace_s"] + r["lower_s"] + r["xla_compile_s"]
    assert abs(parts - r["compile_s"]) < 1e-6 and 0 <= r["select_s"] <= r["trace_s"]
    if r["setting"] == "xla":
      assert r["decisions"] == 0 and r["select_s"] == 0
  # Each wavetune setting decides in its first step of each kind (new problems).
  assert all(r["decisions"] > 0 for r in rows if r["setting"] != "xla")


def test_bench_model_cache_fill():
  from wavetune_jax.cli.bench import _filled
  from wavetune_jax.families.decode.family import DecodeFamily
  from wavetune_jax.families.decode.problem import DecodeProblem
  cfg = M.MODELS["small"]
  assert np.asarray(_filled("full", cfg, 4, 100)).tolist() == [100] * 4
  got = np.sort(np.asarray(_filled("spread", cfg, 8, 100)))
  # The attended lengths (filled + 1) are the decode sweeps' lengths for a
  # cache of 101 positions: spread evenly over [1, 101], within the cache.
  p = DecodeProblem(batch=8, q_heads=cfg.q_heads, kv_heads=cfg.kv_heads, kv_len=101,
                    head_dim=cfg.head_dim)
  want = np.sort(np.asarray(DecodeFamily.lengths(p, jax.random.PRNGKey(0))))
  np.testing.assert_array_equal(got + 1, want)
  assert got.min() >= 0 and got.max() <= 100 and len(set(got.tolist())) == 8


@pytest.mark.parametrize("argv,msg", [
    (["--ops", "xla,fast"], "choose from"),
    (["--model", "llama3_8b"], "needs a GPU"),
])
def test_bench_model_bad_arguments(argv, msg, capsys):
  assert main(["bench", "model", "--prompt", "8", "--cache", "8"] + argv) == 2
  assert msg in capsys.readouterr().err


def test_bench_model_autotune_level_needs_a_fresh_backend(capsys):
  jax.devices()  # the backend has started: XLA_FLAGS can no longer take effect
  assert main(["bench", "model", "--model", "small", "--xla-autotune", "0"]) == 2
  assert "already started" in capsys.readouterr().err


@pytest.mark.parametrize("name", ["small", "small_moe"])
def test_decode_step_continues_the_prompt(name):
  """Prefill of 9 tokens then one decode step = prefill of the 10 tokens."""
  cfg = M.MODELS[name].with_layers(1)
  ops = M.make_ops("xla")
  params = M.init(jax.random.PRNGKey(0), cfg, dtype=jnp.float32)
  toks = jax.random.randint(jax.random.PRNGKey(1), (2, 10), 0, cfg.vocab)
  full, _, _ = M.prefill(params, toks, cfg=cfg, ops=ops, max_len=10)
  _, kc, vc = M.prefill(params, toks[:, :9], cfg=cfg, ops=ops, max_len=12)
  step, kc2, _ = M.decode_step(params, kc, vc, jnp.array([9, 9]), toks[:, 9], cfg=cfg, ops=ops)
  np.testing.assert_allclose(np.asarray(step), np.asarray(full), rtol=2e-3, atol=2e-3)
  assert not np.allclose(np.asarray(kc2[0][:, 9]), 0)
  # Without the write: the same logits when the cache already holds the token.
  kc2, vc2 = M.decode_step(params, kc, vc, jnp.array([9, 9]), toks[:, 9], cfg=cfg, ops=ops)[1:]
  again, kc3, _ = M.decode_step(params, kc2, vc2, jnp.array([9, 9]), toks[:, 9], cfg=cfg,
                                ops=ops, write_cache=False)
  np.testing.assert_allclose(np.asarray(again), np.asarray(step), rtol=1e-5, atol=1e-5)
  assert kc3[0] is kc2[0]


@pytest.mark.parametrize("change,msg", [
    (lambda kc, n, t: (kc, n[:1], t), "must both be"),
    (lambda kc, n, t: (kc, n.astype(jnp.float32), t), "integers"),
    (lambda kc, n, t: (kc, n + 3, t), "cache's length"),
    (lambda kc, n, t: (kc, n - 10, t), "cache's length"),
    (lambda kc, n, t: (kc[:1], n, t), "caches"),
    (lambda kc, n, t: ([c[:, :, :1] for c in kc], n, t), "kv_heads"),
])
def test_decode_step_bad_input(change, msg):
  cfg = M.MODELS["small"].with_layers(2)
  params = M.init(jax.random.PRNGKey(0), cfg, dtype=jnp.float32)
  toks = jnp.zeros((2, 9), jnp.int32)
  _, kc, vc = M.prefill(params, toks, cfg=cfg, ops=M.make_ops("xla"), max_len=12)
  kc, n, t = change(kc, jnp.array([9, 9]), toks[:, 0])
  with pytest.raises(ValueError, match=msg):
    M.decode_step(params, kc, kc, n, t, cfg=cfg, ops=M.make_ops("xla"))


def test_unknown_setting():
  with pytest.raises(ValueError, match="unknown ops"):
    M.make_ops("fast")


def test_every_policy_is_a_setting():
  """``make_ops`` takes every policy of the library (read when called) and
  ``default`` for ``fixed``; its context is that policy."""
  from wavetune_jax.cli.bench import _settings
  from wavetune_jax.models.decoder import ops_names
  assert set(wt.POLICIES) | {"xla", "default"} == set(ops_names())
  for name in wt.POLICIES:
    assert M.make_ops(name).name == name
  p = wt.MatmulProblem(m=40, n=256, k=128)
  for name, source in (("default", "fixed"), ("fixed", "fixed"), ("heuristic", "heuristic")):
    with M.make_ops(name).context():
      assert wt.select("matmul", p).source == source, name
  assert _settings("auto,refine,default") == ["xla", "auto", "refine", "default"]
  with pytest.raises(Exception, match="choose from xla,tables,heuristic,default,auto"):
    _settings("auto,psychic")


@pytest.mark.parametrize("name,head_dim", [("llama3_2_1b", 64), ("qwen2_5_1_5b", 128),
                                          ("gemma_2_2b", 256)])
def test_models_outside_the_training_suites_run(name, head_dim):
  """The heads of each (Gemma-2-2B: q_heads * head_dim != hidden) through
  prefill and a decode step with the wavetune ops, against the xla setting;
  hidden, MLP and vocabulary shrunk to run on a CPU."""
  cfg = M.MODELS[name]
  assert cfg.head_dim == head_dim and cfg.q_heads % cfg.kv_heads == 0
  cfg = dataclasses.replace(cfg, hidden=64, inter=64, layers=1, vocab=256)
  params = M.init(jax.random.PRNGKey(0), cfg)
  toks = jax.random.randint(jax.random.PRNGKey(1), (2, 10), 0, cfg.vocab)
  got = {}
  for ops in (M.make_ops("xla"), M.make_ops("heuristic")):
    logits, kc, vc = jax.jit(functools.partial(M.prefill, cfg=cfg, ops=ops, max_len=12))(
        params, toks)
    assert kc[0].shape == (2, 12, cfg.kv_heads, head_dim)
    step = jax.jit(functools.partial(M.decode_step, cfg=cfg, ops=ops))(
        params, kc, vc, jnp.array([10, 7]), toks[:, 9])[0]
    got[ops.name] = [np.asarray(x, np.float32) for x in (logits, step)]
  for ref, out in zip(got["xla"], got["heuristic"]):
    err = np.sqrt(np.mean((out - ref) ** 2) / np.mean(ref ** 2))
    assert err < 5e-2 and np.isfinite(out).all()


E2E = os.path.join(os.path.dirname(__file__), "..", "data", "e2e")


def _step_us(name):
  rows = json.load(open(os.path.join(E2E, name)))["rows"]
  return {(r["setting"], r["kind"], r["batch"], r["length"]): r["us"] for r in rows}


def test_mixtral_w8a8_h200_numbers_of_the_docs():
  # docs/results.md, "Mixtral-8x7B with W8A8 weights on an H200".
  bf16 = _step_us("mixtral_8x7b_bf16_kv2_h200.json")
  w8 = _step_us("mixtral_8x7b_w8a8_kv2_h200.json")
  i8 = _step_us("mixtral_8x7b_int8_experts_kv2_h200.json")
  pts = [("prefill", 1, 128), ("decode", 1, 4096), ("decode", 8, 4096), ("decode", 32, 4096)]
  got = [round(bf16[("xla",) + p] / w8[("tables",) + p], 3) for p in pts]
  assert got == [2.130, 3.636, 1.722, 1.564]
  assert [round(bf16[("xla",) + p] / i8[("tables",) + p], 3) for p in pts] == [
      1.509, 3.122, 1.284, 1.233]
  assert [round(i8[("xla",) + p] / i8[("tables",) + p], 3) for p in pts[1:]] == [
      2.247, 0.986, 1.248]
  for name in ("kv2", "p2048"):
    for model in ("bf16", "w8a8"):
      assert json.load(open(os.path.join(E2E, f"mixtral_8x7b_{model}_{name}_h200.json"))
                       )["kv_arrays"] == "separate"
  b, w = _step_us("mixtral_8x7b_bf16_p2048_h200.json"), _step_us(
      "mixtral_8x7b_w8a8_p2048_h200.json")
  assert round(b[("xla", "prefill", 1, 2048)] / w[("tables", "prefill", 1, 2048)], 3) == 7.378
  assert round(b[("tables", "prefill", 1, 2048)] / w[("tables", "prefill", 1, 2048)], 3) == 1.560
  assert round(b[("xla", "decode", 16, 4096)] / w[("tables", "decode", 16, 4096)], 3) == 1.660
  b1, w1 = _step_us("mixtral_8x7b_bf16_for_w8a8_kv1_h200.json"), _step_us(
      "mixtral_8x7b_w8a8_kv1_h200.json")
  assert [round(b1[("xla",) + p] / w1[("tables",) + p], 3) for p in pts] == [
      2.098, 3.697, 1.773, 1.584]


def test_decode_kernels_with_one_and_two_kv_arrays():
  # docs/results.md and docs/design.md: the W8A8 Mixtral step at batch 32,
  # the four layers' decode kernel against cuDNN in the XLA setting.
  def kernels(name):
    rows = json.load(open(os.path.join(E2E, name)))["rows"]
    out = {}
    for r in rows:
      if r["kind"] == "decode" and r["batch"] == 32:
        out[r["setting"]] = dict(r["kernels"])
    return out
  ratios = []
  for name in ("mixtral_8x7b_w8a8_kv1_h200.json", "mixtral_8x7b_w8a8_kv2_h200.json"):
    k = kernels(name)
    ours = k["tables"]["wavetune_decode_16x128s2"]
    cudnn = next(us for n, us in k["xla"].items() if n.startswith("cudnn"))
    ratios.append((round(ours, 1), round(cudnn, 1), round(cudnn / ours, 2)))
  assert ratios == [(354.9, 295.4, 0.83), (523.6, 511.9, 0.98)]


def test_mixtral_step_bytes():
  # docs/results.md: the bytes a four-layer Mixtral-8x7B decode step reads at
  # batch 32 over 4,097 positions, bf16 against W8A8 (e4m3 attention weights
  # and experts; router, embedding and LM head bf16), keys and values apart.
  cfg = M.MODELS["mixtral_8x7b"].with_layers(4)
  h, f, layers = cfg.hidden, cfg.inter, cfg.layers
  experts = layers * cfg.experts * (h * 2 * f + f * h)          # elements
  attn = layers * h * ((cfg.q_heads + 2 * cfg.kv_heads) * cfg.head_dim + cfg.q_heads * cfg.head_dim)
  kv = lambda b: layers * 2 * b * 4097 * cfg.kv_heads * cfg.head_dim * 2  # noqa: E731
  head = cfg.vocab * h * 2
  bf16 = 2 * (experts + attn) + kv(32) + head
  w8a8 = experts + attn + kv(32) + head
  assert round(experts / 1e9, 2) == 5.64 and round(kv(32) / 1e9, 2) == 2.15
  assert round(kv(16) / 1e9, 2) == 1.07
  assert round(bf16 / 1e9, 1) == 14.0 and round(w8a8 / 1e9, 1) == 8.2
  assert round(bf16 / w8a8, 2) == 1.71
  step = ("decode", 32, 4096)
  us = {w: _step_us(f"mixtral_8x7b_{w}_kv2_h200.json")[(s,) + step]
        for w, s in (("bf16", "xla"), ("w8a8", "tables"))}
  assert round(bf16 / us["bf16"] / 1e6, 2) == 3.95  # TB/s
  assert round(w8a8 / us["w8a8"] / 1e6, 2) == 3.62


def _router_rows(name):
  rows = {}
  for line in open(os.path.join(E2E, name)):
    parts = line.replace("%", "").replace("|", "").split()
    if len(parts) == 8 and parts[0].isdigit():
      rows[(int(parts[0]), int(parts[1]))] = [float(x) for x in parts[2:]]
  return rows


def test_router_agreement_numbers_of_the_docs():
  w8 = _router_rows("mixtral_8x7b_w8a8_router_h200.txt")
  assert w8[(1, 4096)] == [100.0, 75.0, 75.0, 0.057, 0.252, 0.245]
  assert w8[(1, 1024)] == [75.0, 100.0, 75.0, 0.264, 0.056, 0.267]
  big = [w8[(b, c)] for b in (8, 32) for c in (4096, 1024)]
  assert (min(r[4] for r in big), max(r[4] for r in big)) == (0.082, 0.132)
  assert (min(r[3] for r in big), max(r[3] for r in big)) == (0.089, 0.122)
  i8 = _router_rows("mixtral_8x7b_int8_experts_router_h200.txt")
  assert all(r[:3] == [100.0] * 3 and max(r[3:5]) <= 0.016 for r in i8.values())
  d = json.load(open(os.path.join(E2E, "mixtral_8x7b_w8a8_kv2_h200.json")))
  diffs = {(r["kind"], r["batch"]): r["rel_diff_vs_xla"] for r in d["rows"]
           if r["setting"] == "tables"}
  assert round(diffs.pop(("decode", 1)), 3) == 0.245
  assert (round(min(diffs.values()), 3), round(max(diffs.values()), 3)) == (0.038, 0.053)


def test_router_agreement_runs_on_a_cpu(capsys):
  import importlib.util
  path = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "moe_router_agreement.py")
  spec = importlib.util.spec_from_file_location("moe_router_agreement", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  mod.main(["--model", "small_moe", "--batch", "2", "--cache", "16"])
  out = capsys.readouterr().out
  row = [line for line in out.splitlines() if line.split()[:2] == ["2", "16"]]
  assert row, out
  parts = row[0].replace("%", "").replace("|", "").split()
  assert all(0 <= float(x) <= 100 for x in parts[2:5])
  assert float(parts[7]) < 0.1  # the same quantized model through two settings
  with pytest.raises(SystemExit):
    mod.main(["--model", "small_moe", "--weights", "w8a8", "--quantize-experts"])
