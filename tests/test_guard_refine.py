"""The guard (``runtime/guard.py``) and first-use refinement (``runtime/refine.py``).

Known answers on synthetic evidence; the selector's path with the shipped
tables of a GPU named on this CPU; refinement with the measurement replaced
by a recorded outcome (the GPU part is ``benchmarks/first_use_cost.py``)."""

import dataclasses
import json
import os
import shutil
import warnings

import pytest

import wavetune_jax as wt
from wavetune_jax import (DECODE, MATMUL, RAGGED_DOT, DecodeProblem, MatmulProblem,
                          RaggedDotProblem, get_hardware)
from wavetune_jax.core import versions
from wavetune_jax.families.decode.library import CudnnDecodeConfig, XlaDecodeConfig
from wavetune_jax.families.matmul.xla import XlaMatmulConfig
from wavetune_jax.runtime import guard, refine, selector, table_cache, tables
from wavetune_jax.tuning import evaluate

H100 = get_hardware("nvidia_h100_80gb_hbm3")
_ON_THIS_GPU = selector._on_this_gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRITON = wt.TritonMatmulConfig(block_m=64, block_n=128, block_k=64, split_k=1, group_m=8,
                               num_warps=4, num_stages=3)


def _shipped(family, key="nvidia_h100_80gb_hbm3"):
  return tables.load(os.path.join(ROOT, "tables", key, f"{family.name}.json"), family,
                     get_hardware(key))


# --- the guard on known evidence -----------------------------------------------------


def test_platform_configs():
  assert MATMUL.platform_config(MatmulProblem(m=8, n=64, k=64), H100) == XlaMatmulConfig()
  d = DecodeProblem(batch=4, q_heads=8, kv_heads=2, kv_len=100)
  assert DECODE.platform_config(d, H100) == CudnnDecodeConfig()
  # cuDNN does not run head_dim 100: XLA is the platform op there.
  d100 = dataclasses.replace(d, head_dim=100)
  assert DECODE.platform_config(d100, H100) == XlaDecodeConfig()
  # With no GPU, XLA (the only platform backend that runs here).
  assert DECODE.platform_config(d, get_hardware(None)) == XlaDecodeConfig()


def test_evidence_near_and_far():
  p = MatmulProblem(m=1000, n=4096, k=4096)
  rule = guard.Rule(weight_radius=1.0, size_radius=1.0, win=1.0)
  win = [(MatmulProblem(m=1500, n=4096, k=6000), {"triton": 9.0, "xla": 10.0})]
  ev = guard.Evidence(MATMUL, H100, win, rule=rule)
  assert ev.allows(p, TRITON) == (True, "")
  assert ev.allows(p, XlaMatmulConfig()) == (True, "")   # the platform: always
  # Mosaic never measured near: kept out, with the reason.
  mosaic = next(c for c in MATMUL.space(p, H100) if MATMUL.backend_of(c).name == "mosaic")
  ok, why = ev.allows(p, mosaic)
  assert not ok and "no mosaic measurement near" in why
  # Size out of the radius (m 4x), a weight field out of it (k 4x): no evidence.
  for far in (MatmulProblem(m=4000, n=4096, k=4096), MatmulProblem(m=1000, n=4096, k=16384)):
    assert not guard.Evidence(MATMUL, H100, [(far, {"triton": 9.0, "xla": 10.0})],
                              rule=rule).allows(p, TRITON)[0]
  # A near row where the backend lost vetoes it, whatever the others say.
  lost = win + [(MatmulProblem(m=700, n=4096, k=4096), {"triton": 12.0, "xla": 10.0})]
  ok, why = guard.Evidence(MATMUL, H100, lost, rule=rule).allows(p, TRITON)
  assert not ok and "0.83x" in why
  # float16 is judged on bfloat16 rows (one 16-bit class: the sweeps are
  # bfloat16); another dtype is another shape class.
  f16 = dataclasses.replace(p, dtype="float16", out_dtype="float16")
  assert ev.allows(f16, TRITON) == (True, "")
  assert not guard.Evidence(MATMUL, H100, lost, rule=rule).allows(f16, TRITON)[0]
  f32 = dataclasses.replace(p, dtype="float32", out_dtype="float32")
  assert not ev.allows(f32, TRITON)[0]


def test_stale_evidence_needs_a_larger_win(monkeypatch):
  p = MatmulProblem(m=1000, n=4096, k=4096)
  rows = [(p, {"triton": 9.5, "xla": 10.0})]   # 1.05x
  rule = guard.Rule(weight_radius=1.0, size_radius=1.0, win=1.0, stale_win=1.10)
  now = {**versions.current(), "cuda": "13.0", "cudnn": "9.19.0"}   # as on a GPU
  monkeypatch.setattr(versions, "current", lambda: now)
  assert guard.Evidence(MATMUL, H100, rows, measured_with=now, rule=rule).allows(p, TRITON)[0]
  for key, v in (("jax", "0.0.1"), ("cudnn", "9.22.0")):
    old = {**now, key: v}
    ok, why = guard.Evidence(MATMUL, H100, rows, measured_with=old,
                             rule=rule).allows(p, TRITON)
    assert not ok and "stale" in why
  # Choosing for a GPU named on a CPU: the target's versions are unknown.
  monkeypatch.setattr(versions, "current", lambda: {"jax": "0.0.2"})
  assert guard.Evidence(MATMUL, H100, rows, measured_with=old, rule=rule).allows(p, TRITON)[0]
  # Versions a file does not record are not compared (old sweeps: JAX only).
  assert not versions.differ({"cudnn": "9.19.0"}, {"jax": "1"})
  assert versions.differ({"cudnn": "9.19.0"}, {"cudnn": "9.22.0"})


def test_family_rules_are_the_replays_safe_choice():
  """Each family's rule is one of benchmarks/guard_radius.py's grid that left
  no held-out problem below 0.97x (the recorded run, data/probes)."""
  rec = json.load(open(os.path.join(ROOT, "data", "probes", "guard_radius.json")))
  for fam in (MATMUL, DECODE, RAGGED_DOT, wt.ATTENTION):
    r = guard.rule_of(fam)
    rows = [x for x in rec["rules"] if (x["rule"]["weight_radius"], x["rule"]["size_radius"],
                                        x["rule"]["win"]) == (r.weight_radius, r.size_radius,
                                                              r.win)]
    assert rows, fam.name
    assert rows[0]["per_family"][fam.name]["below_097"] == 0, fam.name


# --- the selector -------------------------------------------------------------------------


def test_decode_at_an_unseen_head_dim_keeps_cudnn():
  """The case the guard is for: head_dim 256, batch 64, a 20,000 cache (the
  heuristic's XLA config ran at 0.19x cuDNN on an H100; the heuristic now
  answers with the Mosaic kernel, which the shipped tables hold no evidence
  for at this head_dim)."""
  p = DecodeProblem(batch=64, q_heads=16, kv_heads=8, kv_len=20000, head_dim=256)
  with wt.policy("heuristic"):
    assert isinstance(wt.select("decode", p, H100).config, wt.MosaicDecodeConfig)
  with wt.policy("tables"):
    sel = wt.select("decode", p, H100)
  assert sel.config == CudnnDecodeConfig() and sel.source == "guard"
  assert "kept the platform op" in sel.note


def test_guard_follows_the_tables_evidence():
  t = _shipped(RAGGED_DOT)
  p = RaggedDotProblem(m=3000, g=60, k=2048, n=2816)
  with wt.use_tables(t, "ragged_dot"):
    sel = wt.select("ragged_dot", p, H100)
  assert RAGGED_DOT.backend_of(sel.config).name == "mosaic", sel
  # The same table without its evidence (the anchors then are, and they
  # hold no platform time next to a Mosaic one): the platform op.
  bare = dataclasses.replace(t, evidence=[], anchors=[a for a in t.anchors
                                                      if a[1].__class__.__name__ != "XlaRaggedDotConfig"])
  with wt.use_tables(bare, "ragged_dot"):
    sel = wt.select("ragged_dot", p, H100)
  assert sel.source == "guard" and RAGGED_DOT.backend_of(sel.config).name == "xla"


@pytest.mark.parametrize("m,g,trusted", [(131072, 64, "any"), (4096, 64, "any"), (1, 16, "any"),
                                           (8, 16, "any"), (9, 16, "rule"), (16, 16, "rule"),
                                           (17, 16, None), (3000, 60, None), (4095, 64, "any"),
                                           (128, 64, "any"), (100, 128, "any"), (127, 32, None)])
def test_grouped_gemm_past_the_evidence_trusts_the_kernel_over_the_dense_ragged_dot(
    m, g, trusted, monkeypatch):
  """From 64 rows per expert, at most one row for two experts, and with 64
  experts or more, XLA's dense ragged dot (cuDNN < 9.22) lost to every
  Mosaic config of both GPUs' sweeps, and at one row per expert or fewer to
  the rule's config:
  without evidence the guard keeps the kernel there ("any" config, or the
  "rule"'s). With cuDNN 9.22 (XLA's grouped GEMM) or no cuDNN version,
  evidence decides."""
  p = RaggedDotProblem(m=m, g=g, k=2048, n=2048)
  rule = RAGGED_DOT.heuristic(p, H100)
  other = wt.MosaicRaggedDotConfig(block_m=64, block_n=128, num_stages=3)
  assert rule != other
  xla = wt.XlaRaggedDotConfig()
  trust = RAGGED_DOT.trusted_without_evidence
  v = {"cudnn": "9.19.0"}
  assert trust(p, other, xla, hw=H100, versions=v) == (trusted == "any")
  assert trust(p, rule, xla, hw=H100, versions=v) == (trusted is not None)
  assert trust(p, rule, xla, versions=v) == (trusted == "any")  # the rule needs hw
  trusted = trusted is not None
  mosaic = rule
  assert not trust(p, mosaic, xla, versions={"cudnn": "9.22.0"})
  assert not trust(p, mosaic, xla, versions={"jax": "0.11.2"})
  assert not trust(p, xla, xla, versions={"cudnn": "9.19.0"})
  # Through the selector on a GPU, with a table that holds no evidence.
  bare = dataclasses.replace(_shipped(RAGGED_DOT), evidence=[], anchors=[], exact={})
  for cudnn, want in (("9.19.0", trusted), ("9.22.0", False)):
    monkeypatch.setattr(versions, "current", lambda cudnn=cudnn: {"cudnn": cudnn})
    selector.clear()
    with wt.policy("tables"), wt.use_tables(bare, "ragged_dot"):
      sel = wt.select("ragged_dot", p, H100)
    name = RAGGED_DOT.backend_of(sel.config).name
    assert name == ("mosaic" if want else "xla"), (cudnn, sel)
  # A replay stands the sweep's versions in for the platform's.
  ds = evaluate.load_dataset(os.path.join(ROOT, "data", "sweeps", "nvidia_h100_80gb_hbm3",
                                          "ragged_dot_bfloat16.jsonl.gz"))
  assert evaluate.platform_versions(ds.header)["cudnn"] == "9.19.0"


def test_no_guard_in_interpret_mode():
  """With no GPU speed is not the question: a table's Triton answer stands
  in interpret mode, and the same table without evidence is guarded on the
  GPU it names."""
  t = _shipped(MATMUL)
  p, (c, _) = next((p, e) for p, e in t.exact.items()
                   if MATMUL.backend_of(e[0]).name == "triton")
  bare = dataclasses.replace(t, evidence=[], anchors=[])
  cpu = get_hardware(None)
  assert cpu.interpret
  with wt.use_tables(bare, "matmul"):
    assert wt.select("matmul", p, cpu).config == c
    sel = wt.select("matmul", p, H100)
  assert sel.source == "guard" and sel.config == XlaMatmulConfig()
  with wt.use_tables(t, "matmul"):   # its evidence: the exact answer stands
    assert wt.select("matmul", p, H100).config == c


def test_evidence_round_trips_through_files_and_the_cache(tmp_path):
  t = _shipped(DECODE)
  assert t.evidence and t.evidence_versions.get("jax")
  path = tmp_path / "decode.json"
  tables.save(t, str(path))
  back = tables.load(str(path), DECODE, H100)
  assert back.evidence == t.evidence and back.evidence_versions == t.evidence_versions
  assert back.winners == t.winners and len(t.winners) == len(t.evidence)
  state = json.loads(json.dumps(table_cache.encode(t)))
  cached = table_cache.decode(state, DECODE, H100)
  assert cached.evidence == t.evidence and cached.evidence_versions == t.evidence_versions
  assert cached.winners == t.winners
  # The ranking measures what won next door: a neighbour's winner is ranked.
  p0, c0 = next(iter(t.winners.items()))
  near = DECODE.with_size(p0, DECODE.size_of(p0) + 8)
  assert c0 in selector.Decider(t, H100).ranked(near, 3)
  # Corrupt evidence: a one-line table error naming it.
  d = json.loads(path.read_text())
  d["evidence"]["rows"][0]["us"] = {"triton": -1.0}
  path.write_text(json.dumps(d))
  with pytest.raises(tables.TableError, match="evidence row .* finite and positive"):
    tables.load(str(path), DECODE, H100)
  d["evidence"]["rows"][0]["us"] = {"tpu": 1.0}
  path.write_text(json.dumps(d))
  with pytest.raises(tables.TableError, match="evidence row .*no backend 'tpu'"):
    tables.load(str(path), DECODE, H100)


# --- refinement -------------------------------------------------------------------------


@pytest.fixture
def measuring(tmp_path, monkeypatch):
  """Policy refine on the H100 preset as if it were this machine's GPU, with
  the measurement replaced: ``calls`` records each, ``result`` says what
  it returns (a config -> us dict, or an exception)."""
  saved = dict(table_cache._state)
  table_cache.set_dir(tmp_path / "cache")
  selector.clear()
  calls = []
  result = {}

  def fake(spec, problem, configs, platform, anchors=()):
    assert platform is None or platform == configs[0]
    assert not (anchors and platform is not None)
    calls.append((problem, list(configs)))
    r = result.get("value")
    if isinstance(r, Exception):
      raise r
    times = r if r is not None else {c: 10.0 for c in configs}
    ok = {c: t for c, t in times.items() if c in configs and t is not None}
    failed = [(c, "run_error: out of memory") for c in configs if c not in ok]
    best = refine.choose(ok, platform, None, anchors) if ok else None
    if best is None:
      return refine.Outcome(None, float("inf"), None, failed)
    return refine.Outcome(best, ok[best], ok.get(platform), failed)

  monkeypatch.setattr(refine, "measure_candidates", fake)
  monkeypatch.setattr(selector, "_on_this_gpu", lambda hw: not hw.interpret)
  yield calls, result, tmp_path / "cache"
  selector.clear()
  table_cache._state.update(saved)


def _new_process():
  """What a new process starts with: no memo, no stores in memory."""
  selector.clear()


def test_decode_first_use_measures_xla_next_to_cudnn(measuring):
  """Decode's first use times both platform ops (``refine_all_platforms``):
  where XLA's attention measures faster than cuDNN's (as on Gemma-3-1B's
  head_dim 256 at batch 3 on an H200), it is kept; other families measure
  their platform config only."""
  calls, result, _ = measuring
  p = DecodeProblem(batch=3, q_heads=4, kv_heads=1, kv_len=1800, head_dim=256, lengths=True)
  cands = refine.candidates(DECODE, p, H100, selector._decider(DECODE, H100), None)
  assert cands[0] == CudnnDecodeConfig() and XlaDecodeConfig() in cands
  result["value"] = {c: {CudnnDecodeConfig(): 14.9, XlaDecodeConfig(): 11.7}.get(c, 20.0)
                     for c in cands}
  with wt.policy("refine"):
    sel = wt.select("decode", p, H100)
  assert len(calls) == 1 and XlaDecodeConfig() in calls[0][1]
  assert sel.config == XlaDecodeConfig() and sel.source == "measured", sel
  # Without the flag, cuDNN's config alone stands for the platform.
  import unittest.mock as mock
  with mock.patch.object(type(DECODE), "refine_all_platforms", False):
    plain = refine.candidates(DECODE, p, H100, selector._decider(DECODE, H100), None)
  assert XlaDecodeConfig() not in plain and plain[0] == CudnnDecodeConfig()
  m = MatmulProblem(m=1100, n=5120, k=3584)
  assert not type(MATMUL).refine_all_platforms
  assert [c for c in refine.candidates(MATMUL, m, H100, selector._decider(MATMUL, H100), None)
          if MATMUL.backend_of(c).platform] == [XlaMatmulConfig()]


def test_refine_measures_once_per_problem_and_machine(measuring):
  calls, result, folder = measuring
  p = MatmulProblem(m=1100, n=5120, k=3584)
  cands = refine.candidates(MATMUL, p, H100, selector._decider(MATMUL, H100),
                            XlaMatmulConfig())
  assert cands[0] == XlaMatmulConfig() and 2 <= len(cands) <= refine.TOP_K + 4
  assert len(set(cands)) == len(cands)
  result["value"] = {c: (5.0 if c == cands[-1] else 10.0) for c in cands}
  with wt.policy("refine"):
    sel = wt.select("matmul", p, H100)
    assert wt.select("matmul", p, H100) is sel     # memoized: measured once
  assert len(calls) == 1 and sel.source == "measured" and sel.config == cands[-1]
  assert sel.predicted_us == 5.0 and "2.00x the platform op" in sel.note
  (store,) = folder.glob("refined-matmul-*.json")
  assert json.loads(store.read_text())["key"]["device_key"] == H100.device_key
  _new_process()
  with wt.policy("refine"):
    again = wt.select("matmul", p, H100)
  assert len(calls) == 1 and again.config == sel.config     # read, not measured
  assert selector.refinement_stats()["reused"] == 1
  # Other versions (a JAX or cuDNN upgrade) are another store: measured again.
  versions.current.cache_clear()
  try:
    import unittest.mock as mock
    with mock.patch.object(versions, "current", lambda: {"jax": "9.9", "cudnn": "9.22.0"}):
      _new_process()
      with wt.policy("refine"):
        wt.select("matmul", p, H100)
  finally:
    versions.current.cache_clear()
  assert len(calls) == 2 and len(list(folder.glob("refined-matmul-*.json"))) == 2


def test_refine_margin_keeps_the_platform_op(measuring):
  calls, result, _ = measuring
  p = MatmulProblem(m=777, n=4096, k=2048)
  cands = refine.candidates(MATMUL, p, H100, selector._decider(MATMUL, H100),
                            XlaMatmulConfig())
  result["value"] = {c: (9.9 if c != cands[0] else 10.0) for c in cands}   # 1% faster
  with wt.policy("refine"):
    assert wt.select("matmul", p, H100).config == XlaMatmulConfig()
  assert refine.pick({XlaMatmulConfig(): 10.0, TRITON: 9.0}, XlaMatmulConfig()) == TRITON
  assert refine.pick({TRITON: 9.0}, XlaMatmulConfig()) == TRITON   # platform failed


def test_refine_never_fails_the_call(measuring):
  calls, result, folder = measuring
  p = MatmulProblem(m=901, n=4096, k=2048)
  result["value"] = RuntimeError("CUPTI is busy")
  with wt.policy("tables"):
    table_answer = wt.select("matmul", p, H100)
  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    with wt.policy("refine"):
      sel = wt.select("matmul", p, H100)
  assert sel.config == table_answer.config and sel.source != "measured"
  assert any("first-use measurement of" in str(x.message) for x in w)
  # Failed candidates are dropped with one warning; the rest decide.
  q = MatmulProblem(m=902, n=4096, k=2048)
  cands = refine.candidates(MATMUL, q, H100, selector._decider(MATMUL, H100),
                            XlaMatmulConfig())
  result["value"] = {c: (None if i else 10.0) for i, c in enumerate(cands)}
  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    with wt.policy("refine"):
      sel = wt.select("matmul", q, H100)
  assert sel.config == XlaMatmulConfig() and sel.source == "measured"
  assert sum("dropped" in str(x.message) for x in w) == 1
  assert selector.refinement_stats()["dropped"] == len(cands) - 1


def test_a_corrupt_store_is_ignored_with_a_warning(measuring):
  calls, result, folder = measuring
  p = MatmulProblem(m=1234, n=4096, k=2048)
  with wt.policy("refine"):
    wt.select("matmul", p, H100)
  (store,) = folder.glob("refined-matmul-*.json")
  store.write_text(store.read_text()[:40])      # truncated
  _new_process()
  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    with wt.policy("refine"):
      wt.select("matmul", p, H100)
  assert any("ignoring the refinement store" in str(x.message) for x in w)
  assert len(calls) == 2                           # measured again, file rewritten
  assert json.loads(store.read_text())["decisions"]


def test_auto_measures_only_on_this_gpu_with_a_cache_folder(measuring, monkeypatch):
  calls, _, _ = measuring
  p = MatmulProblem(m=2345, n=4096, k=2048)
  with wt.policy("auto"):
    assert wt.select("matmul", p, H100).source == "measured"
  assert len(calls) == 1
  table_cache.set_dir(None)
  _new_process()
  with wt.policy("auto"):
    assert wt.select("matmul", MatmulProblem(m=2346, n=4096, k=2048), H100).source != "measured"
  assert len(calls) == 1
  # A GPU named on another machine (the presets on this CPU): never measured;
  # auto is the default.
  assert not _ON_THIS_GPU(H100) and not _ON_THIS_GPU(get_hardware(None))
  assert wt.POLICIES[0] == "auto" and selector._global["policy"] == "auto"


def test_eval_reports_recall_and_the_refinement_replay():
  ds = evaluate.load_dataset(os.path.join(ROOT, "data", "sweeps", "nvidia_h100_80gb_hbm3",
                                          "decode_bfloat16.jsonl.gz"))
  (r,), _ = evaluate.evaluate(ds, ["wavetune"], seed=0)
  ks = sorted(r.recall)
  assert ks == list(evaluate.RECALL_K)
  assert all(r.recall[a] <= r.recall[b] for a, b in zip(ks, ks[1:]))
  assert 0 < r.recall[ks[-1]] <= 1
  f = r.refined
  # Refinement measures the platform config: never below it on the sweep's times.
  assert f["vs_platform_min"] >= 1.0 and f["below_097"] == 0
  assert f["vs_platform_geomean"] >= r.vs_platform_geomean
  assert r.below_097 == 0   # the guard, tables alone


def test_an_unwritable_folder_never_fails_the_call(measuring, tmp_path):
  calls, _, _ = measuring
  blocker = tmp_path / "a_file"
  blocker.write_text("")
  table_cache.set_dir(blocker / "cache")          # a folder under a file
  p = MatmulProblem(m=3456, n=4096, k=2048)
  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    with wt.policy("refine"):
      sel = wt.select("matmul", p, H100)
  assert sel.source != "measured" and not calls
  assert any("cannot lock the refinement store" in str(x.message) for x in w)


def test_stored_rows_are_checked_against_this_gpu(measuring):
  calls, _, folder = measuring
  p = MatmulProblem(m=4567, n=4096, k=2048)
  with wt.policy("refine"):
    wt.select("matmul", p, H100)
  (store,) = folder.glob("refined-matmul-*.json")
  d = json.loads(store.read_text())
  huge = {"backend": "triton", "block_m": 256, "block_n": 256, "block_k": 256, "split_k": 1,
          "group_m": 8, "num_warps": 8, "num_stages": 4}          # too much shared memory
  d["decisions"][0]["config"] = huge
  store.write_text(json.dumps(d))
  _new_process()
  with warnings.catch_warnings(record=True) as w:
    warnings.simplefilter("always")
    with wt.policy("refine"):
      sel = wt.select("matmul", p, H100)
  assert sel.config != MATMUL.coerce_config(huge) and len(calls) == 2
  assert any("cannot use, left out" in str(x.message) for x in w)
  # A number no float holds, or a file nested too deep: ignored, never raised.
  for text in ('{"format": "wavetune-refined", "key": %s, "decisions": [{"problem": %s, '
               '"config": {"backend": "xla"}, "us": 1, "platform_us": 1%s}]}'
               % (json.dumps(d["key"]), json.dumps(d["decisions"][0]["problem"]), "0" * 400),
               "[" * 100000 + "]" * 100000):
    store.write_text(text)
    _new_process()
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      with wt.policy("refine"):
        wt.select("matmul", p, H100)


def test_kept_decisions_are_keyed_by_the_versions(monkeypatch):
  """The table cache keeps decisions made after the guard, whose evidence
  is stale or not by the CUDA and cuDNN versions: they are in its key."""
  k1 = table_cache.key(b"table", "matmul", H100)
  monkeypatch.setattr(versions, "current", lambda: {"jax": "x", "cudnn": "9.22.0"})
  assert table_cache.key(b"table", "matmul", H100) != k1


def test_no_measuring_inside_the_partitioner(measuring):
  calls, _, _ = measuring
  p = MatmulProblem(m=5678, n=4096, k=2048)
  with wt.policy("refine"):
    with selector.measuring_off():
      assert wt.select("matmul", p, H100).source != "measured"
  assert not calls


def test_a_decision_answers_its_size_bucket(measuring):
  """A server sees many token counts: one measurement per power-of-two
  bucket of a weight, reused where its config runs the new size."""
  calls, result, _ = measuring
  p = MatmulProblem(m=1100, n=4096, k=2048)
  cands = refine.candidates(MATMUL, p, H100, selector._decider(MATMUL, H100),
                            XlaMatmulConfig())
  result["value"] = {c: (5.0 if c == cands[-1] else 10.0) for c in cands}
  with wt.policy("refine"):
    first = wt.select("matmul", p, H100)
    same = wt.select("matmul", MatmulProblem(m=1900, n=4096, k=2048), H100)  # (1024, 2048]
    other = wt.select("matmul", MatmulProblem(m=2100, n=4096, k=2048), H100)  # next bucket
    weight = wt.select("matmul", MatmulProblem(m=1900, n=4096, k=4096), H100)  # other weight
  assert len(calls) == 3 and same.config == first.config and same.source == "measured"
  assert [c[0].m for c in calls] == [1100, 2100, 1900]
  assert other.source == weight.source == "measured"


def test_refinement_measures_a_backend_the_table_has_no_model_of():
  # A table swept before a backend existed (here the shipped H200 decode
  # table with its Mosaic models taken out, as tables were before the Mosaic
  # decode kernel): first use measures that kernel's own rule next to the
  # table's answers; a family whose table models every backend gets no such
  # extra candidate.
  h200 = wt.get_hardware("h200")
  p = DecodeProblem(batch=16, q_heads=16, kv_heads=8, kv_len=8192, head_dim=256)
  shipped = selector._decider(DECODE, h200).table
  assert "mosaic" in {dict(v)["backend"] for v in shipped.entries}
  older = dataclasses.replace(
      shipped, entries={v: e for v, e in shipped.entries.items()
                        if dict(v)["backend"] != "mosaic"})
  d = selector.Decider(older, h200)
  cands = refine.candidates(DECODE, p, h200, d, None)
  assert DECODE.backend("mosaic").heuristic(p, h200) in cands
  assert cands[0] == DECODE.platform_config(p, h200)
  m = MatmulProblem(m=1000, n=14336, k=4096)
  dm = selector._decider(MATMUL, H100)
  held = {dict(v)["backend"] for v in dm.table.entries}
  extra = [c for c in refine.candidates(MATMUL, m, H100, dm, None)
           if MATMUL.backend_of(c).name not in held and not MATMUL.backend_of(c).platform]
  assert extra == []


@pytest.mark.parametrize("m,g,cudnn,timed", [(3300 * 8, 128, "9.19.0", False),
                                             (3300 * 8, 128, "9.22.0", True),
                                             (2048, 16, "9.19.0", False),
                                             (40, 16, "9.19.0", True)])
def test_refine_leaves_a_dominated_platform_op_untimed(measuring, monkeypatch, m, g, cudnn,
                                                       timed):
  """First use does not time XLA's dense ragged dot (cuDNN < 9.22) where the
  family trusts a candidate over it (128 experts; 128 rows per expert):
  timing it was most of a first use (111 ms a call for Qwen3-235B-A22B's
  w13 at 3,300 tokens). With cuDNN 9.22 (XLA's grouped GEMM), or where no
  candidate is trusted (16 experts at 2.5 rows each), it is timed."""
  calls, result, _ = measuring
  monkeypatch.setattr(versions, "current", lambda: {"jax": "0.11.2", "cudnn": cudnn})
  selector.clear()
  p = RaggedDotProblem(m=m, g=g, k=4096, n=3072)
  xla = wt.XlaRaggedDotConfig()
  with wt.policy("refine"):
    sel = wt.select("ragged_dot", p, H100)
  (problem, configs), = calls
  assert problem == p and (xla in configs) == timed
  assert len(configs) >= 1 and sel.source == "measured"
  assert ("platform op not timed" in sel.note) == (not timed)
  cands = refine.candidates(RAGGED_DOT, p, H100, selector._decider(RAGGED_DOT, H100), None)
  assert cands[0] == xla
  assert bool(refine.dominating(RAGGED_DOT, p, cands, xla, H100)) == (not timed)
  assert not refine.dominating(RAGGED_DOT, p, [xla], xla, H100)
  assert not refine.dominating(RAGGED_DOT, p, cands[1:], xla, H100)  # not measured


def test_refine_times_the_platform_op_when_every_trusted_candidate_fails(measuring,
                                                                         monkeypatch):
  """Where the untimed platform op's kernels all fail (out of memory, a
  wrong result), the platform op is measured after all and kept."""
  calls, result, _ = measuring
  monkeypatch.setattr(versions, "current", lambda: {"jax": "0.11.2", "cudnn": "9.19.0"})
  selector.clear()
  p = RaggedDotProblem(m=3300 * 8, g=128, k=4096, n=3072)
  xla = wt.XlaRaggedDotConfig()
  result["value"] = {xla: 900.0}   # every other candidate fails
  with wt.policy("refine"):
    sel = wt.select("ragged_dot", p, H100)
  assert [xla in configs for _, configs in calls] == [False, True]
  assert calls[1][1] == [xla] and sel.config == xla and sel.source == "measured"


def test_a_decision_without_the_platform_timed_answers_only_where_trusted(measuring,
                                                                          monkeypatch):
  """A decision made with the platform op untimed answers other sizes of its
  size bucket only where the family trusts its config over the platform op
  there too: 16 experts at 64 rows each (trusted) does not answer 60 rows
  each (not trusted: XLA's op is timed there); 8 experts at 128 rows each
  answers 75 each (trusted)."""
  calls, result, _ = measuring
  monkeypatch.setattr(versions, "current", lambda: {"jax": "0.11.2", "cudnn": "9.19.0"})
  selector.clear()
  xla = wt.XlaRaggedDotConfig()
  for g, big, other, reused in ((16, 1024, 960, False), (8, 1024, 600, True)):
    calls.clear()
    b, o = (RaggedDotProblem(m=m, g=g, k=4096, n=3072) for m in (big, other))
    assert refine._bucket_key(RAGGED_DOT, b) == refine._bucket_key(RAGGED_DOT, o)
    with wt.policy("refine"):
      first = wt.select("ragged_dot", b, H100)
      assert xla not in calls[0][1] and first.config != xla
      again = wt.select("ragged_dot", o, H100)
    if reused:
      assert len(calls) == 1 and again.config == first.config
    else:
      assert len(calls) == 2 and calls[1][1][0] == xla


def test_dominating_reads_each_familys_trust():
  """Attention soft-capped: XLA's attention is the platform op, and the
  Mosaic kernel is trusted over it; not over cuDNN without the cap; GEMM
  trusts nothing; an override that raises counts as not trusted."""
  from wavetune_jax import ATTENTION, AttentionProblem
  from wavetune_jax.families.attention.xla import XlaAttentionConfig
  p = AttentionProblem(batch=1, q_heads=8, kv_heads=8, q_len=2048, kv_len=2048,
                       head_dim=128, soft_cap=50.0)
  plat = ATTENTION.platform_config(p, H100)
  assert plat == XlaAttentionConfig()
  mosaic = ATTENTION.backend("mosaic").heuristic(p, H100)
  assert refine.dominating(ATTENTION, p, [plat, mosaic], plat, H100) == [mosaic]
  plain = dataclasses.replace(p, soft_cap=0.0)
  cudnn = ATTENTION.platform_config(plain, H100)
  assert cudnn != plat
  assert not refine.dominating(ATTENTION, plain, [cudnn, mosaic], cudnn, H100)
  assert not refine.dominating(MATMUL, MatmulProblem(m=8, n=8, k=8),
                                       [XlaMatmulConfig(), TRITON], XlaMatmulConfig(), H100)

  class Raises(type(MATMUL)):
    def trusted_without_evidence(self, *a, **k):
      raise RuntimeError("boom")
  raises = object.__new__(Raises)
  assert not guard.trusted(raises, None, TRITON, XlaMatmulConfig(), H100)


def _fp8_gemma_qkv():
  """Gemma-3-27B's qkv as W8A8-FP8 at 7,000 rows on an H200: the FP8
  kernel's rule is trusted over XLA's FP8 dot there, other candidates not."""
  from wavetune_jax import QMATMUL, QMatmulProblem
  h200 = get_hardware("h200")
  p = QMatmulProblem(m=7000, n=8192, k=5376, dtype="float8_e4m3fn", w_dtype="float8_e4m3fn",
                     w_layout="nk")
  cands = refine.candidates(QMATMUL, p, h200, selector._decider(QMATMUL, h200), None)
  plat = QMATMUL.platform_config(p, h200)
  return QMATMUL, p, h200, cands, plat


def test_fp8_gemm_first_use_leaves_xla_untimed_where_the_rule_is_trusted(measuring,
                                                                          monkeypatch):
  """One trusted candidate is enough to leave the platform op untimed (the
  first use of XLA's FP8 dot took 10.9-12.3 s at 3,000 rows): the
  fastest trusted candidate that ran stands in for it, so another candidate
  replaces it only 3% faster; where no trusted candidate runs, the platform
  op is timed with the candidates that did."""
  calls, result, folder = measuring
  spec, p, h200, cands, plat = _fp8_gemma_qkv()
  anchors = refine.dominating(spec, p, cands, plat, h200)
  others = [c for c in cands if c != plat and c not in anchors]
  assert plat == cands[0] and anchors and others
  monkeypatch.setattr(selector, "_on_this_gpu", lambda hw: True)
  anchor, other = anchors[0], others[0]
  cases = (({anchor: 100.0, other: 99.0}, anchor),      # 1% faster: the anchor stays
           ({anchor: 100.0, other: 90.0}, other),       # 10% faster: replaces it
           ({anchor: None, other: 90.0}, "timed"))      # no anchor ran
  for times, want in cases:
    calls.clear()
    shutil.rmtree(folder, ignore_errors=True)   # a fresh machine: nothing stored
    selector.clear()
    result["value"] = {c: times.get(c, 200.0) for c in cands if c != plat} | {plat: 150.0}
    for c in anchors[1:]:
      result["value"][c] = None
    with wt.policy("refine"):
      sel = wt.select("qmatmul", p, h200)
    assert plat not in calls[0][1], want
    if want == "timed":
      assert len(calls) == 2 and calls[1][1][0] == plat and other in calls[1][1]
      assert not set(anchors) & set(calls[1][1])
      assert sel.config == other and "the platform op" in sel.note and "x the platform" in sel.note
    else:
      assert len(calls) == 1 and sel.config == want
      assert f"not timed: {len(anchors)} candidate(s) trusted over it" in sel.note
  # Neither a trusted candidate nor the platform op ran: the guarded answer
  # stands (an untrusted config that ran is not kept), nothing is stored.
  calls.clear()
  shutil.rmtree(folder, ignore_errors=True)
  selector.clear()
  result["value"] = {c: None for c in cands} | {other: 90.0}
  with wt.policy("refine"):
    sel = wt.select("qmatmul", p, h200)
  with wt.policy("tables"):
    guarded = wt.select("qmatmul", p, h200)
  assert len(calls) == 2 and sel.source != "measured" and sel.config == guarded.config


def test_choose_stands_a_trusted_candidate_in_for_the_untimed_platform():
  """With the platform untimed, a config replaces the fastest trusted one
  only 3% faster on every input mix; none where no trusted config ran."""
  a, b, c = "trusted", "faster", "other"
  times = {a: 100.0, b: 90.0, c: 95.0}
  assert refine.choose(times, None, None, [a]) == b
  assert refine.choose(times, None, [{a: 100.0, b: 101.0, c: 90.0}], [a]) == c
  assert refine.choose(times, None, [{a: 100.0, b: 101.0, c: 99.0}], [a]) == a
  assert refine.choose({b: 90.0}, None, None, [a]) is None
  assert refine.choose(times, None, None, ()) == b       # no anchors: pick's fastest
  # The faster anchor stands in: b is not 3% faster than c.
  assert refine.choose({a: 100.0, c: 95.0, b: 93.0}, None, None, [a, c]) == c
  with pytest.raises(ValueError, match="platform=None"):
    refine.choose(times, a, None, [c])


def test_a_cudnn_platform_is_timed_unless_every_candidate_is_trusted():
  """cuDNN's sliding window, where the attention family trusts the Mosaic
  rule's config (geomean 1.03-1.05x it on the H200 window sweep: a thin
  margin) but not the other
  candidates: first use still times cuDNN (cheap to compile and run); with
  the rule's config the only other candidate it is left untimed."""
  from wavetune_jax import ATTENTION, AttentionProblem
  from wavetune_jax.families.attention import mosaic as fm
  h200 = get_hardware("h200")
  p = AttentionProblem(batch=1, q_heads=40, kv_heads=8, q_len=8192, kv_len=8192, head_dim=128,
                       window_left=2047, window_right=0)
  plat = ATTENTION.platform_config(p, h200)
  assert ATTENTION.backend_of(plat).name == "cudnn"
  rule = fm.MosaicAttention.HEURISTIC
  other = dataclasses.replace(rule, block_k=64)
  assert guard.trusted(ATTENTION, p, rule, plat, h200)
  assert not guard.trusted(ATTENTION, p, other, plat, h200)
  assert refine.dominating(ATTENTION, p, [plat, rule, other], plat, h200) == []
  assert refine.dominating(ATTENTION, p, [plat, rule], plat, h200) == [rule]


def test_trust_stays_within_what_was_measured():
  """Grouped GEMM: no region below 8 experts (the sweeps hold none; with 2 or
  4 experts the dense form does only 2-4x the work). The persistent windowed
  attention over cuDNN: windows of 128-4,096 keys, GQA groups of 2-8,
  bfloat16."""
  from wavetune_jax import ATTENTION, AttentionProblem
  from wavetune_jax.families.attention import mosaic as fm
  v = {"cudnn": "9.19.0"}
  xla = wt.XlaRaggedDotConfig()
  for g, want in ((4, False), (8, True)):
    p = RaggedDotProblem(m=256 * g, g=g, k=4096, n=4096)
    rule = RAGGED_DOT.heuristic(p, H100)
    assert RAGGED_DOT.trusted_without_evidence(p, rule, xla, hw=H100, versions=v) == want
  h200 = get_hardware("h200")
  rule = fm.MosaicAttention.HEURISTIC

  def trusted(**kw):
    d = dict(batch=1, q_heads=32, kv_heads=8, q_len=16384, kv_len=16384, head_dim=128,
             window_left=1024, window_right=0)
    d.update(kw)
    p = AttentionProblem(**d)
    return guard.trusted(ATTENTION, p, rule, ATTENTION.platform_config(p, h200), h200)
  assert trusted() and trusted(window_left=127) and trusted(window_left=4095)
  assert not trusted(window_left=4096)          # 4,097 keys
  assert not trusted(window_left=63)
  assert not trusted(kv_heads=32)
  assert not trusted(dtype="float16")


def test_the_grouped_gemm_measures_the_models_top_two_at_first_use(capsys):
  """A Mosaic candidate costs a grouped GEMM's first use about 2 s, so its
  first use measures the wave model's top 2 (``Family.refine_top_k``), the other
  families the default 3; the replay (``benchmarks/guard_radius.py``) uses
  the family's k, and its ``--drop-stage-variants`` leaves out the model's
  configs that differ from an earlier candidate only in micro fields."""
  assert refine.top_k(RAGGED_DOT) == 2
  assert refine.top_k(MATMUL) == refine.top_k(DECODE) == refine.TOP_K == 3
  asked = []

  class Decider:
    table = type("T", (), {"exact": {}, "entries": {}})()

    def ranked(self, problem, k):
      asked.append(k)
      return []

  p = RaggedDotProblem(m=2200, g=8, k=4096, n=28672)
  refine.candidates(RAGGED_DOT, p, H100, Decider(), None)
  refine.candidates(RAGGED_DOT, p, H100, Decider(), None, k=5)
  assert asked == [2, 5]
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      "guard_radius", os.path.join(ROOT, "benchmarks", "guard_radius.py"))
  gr = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(gr)
  cands = {}
  original = refine.candidates
  try:
    for extra in ([], ["--top-k", "3"], ["--top-k", "3", "--drop-stage-variants"]):
      assert gr.main(["--families", "ragged_dot", "--seeds", "0", *extra]) == 0
      out = capsys.readouterr().out
      rows = [ln.split() for ln in out.splitlines() if ln.startswith("nvidia_")
              and ln.split()[1] == "ragged_dot"]
      assert len(rows) == 2, out   # H100 and H200
      assert all(r[-2] == "0" for r in rows)   # none below 0.97x the platform op
      cands[" ".join(extra)] = [float(r[-1]) for r in rows]
      assert refine.candidates is original   # (restored by the script)
  finally:
    refine.candidates = original
  k2, k3, drop = cands[""], cands["--top-k 3"], cands["--top-k 3 --drop-stage-variants"]
  assert all(a < b for a, b in zip(k2, k3)) and all(a < b for a, b in zip(drop, k3))


def test_first_use_says_at_info_when_it_measures_and_what_it_kept(measuring, caplog):
  """The ``wavetune_jax`` logger at INFO: one line as a first use starts
  measuring (the problem, the GPU, the candidates, where the decision is
  kept) and one when it is done; a later use of the stored decision says
  nothing."""
  import logging
  calls, result, _ = measuring
  p = MatmulProblem(m=1100, n=4096, k=2048)
  with caplog.at_level(logging.INFO, logger="wavetune_jax"), wt.policy("refine"):
    wt.select("matmul", p, H100)
    wt.select("matmul", p, H100)
  lines = [r.getMessage() for r in caplog.records if r.name == "wavetune_jax"]
  assert len(calls) == 1 and len(lines) == 2, lines
  assert lines[0].startswith(f"wavetune_jax: first use of matmul {MATMUL.problem_key(p)} on ")
  assert "measuring" in lines[0] and "refined-matmul-" in lines[0]
  assert lines[1].startswith("wavetune_jax: first use of matmul") and " us in " in lines[1]


def test_guard_radius_replays_skipping_confident_first_uses(capsys):
  """``benchmarks/guard_radius.py --skip-confident RATIO`` (an experiment):
  a first use measures nothing where the wave model predicts the table's
  answer RATIO times faster than every other candidate; on file
  (``data/probes/guard_radius_seeded_skip_confident_*.txt``, seeds 0-4):
  at 1.25 the GEMM skips 144 of 1,080 first uses at the same 0.986 of the
  oracle, decode 129 of 844 losing 0.4%, the grouped GEMM none."""
  import importlib.util
  spec = importlib.util.spec_from_file_location(
      "guard_radius", os.path.join(ROOT, "benchmarks", "guard_radius.py"))
  gr = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(gr)
  with pytest.raises(SystemExit):
    gr.main(["--skip-confident", "0.9"])
  assert "error:" in capsys.readouterr().err
  original = refine.candidates
  try:
    assert gr.main(["--families", "matmul", "--seeds", "0", "--skip-confident", "1.25"]) == 0
    assert refine.candidates is original
  finally:
    refine.candidates = original
  out = capsys.readouterr().out
  skipped = [ln for ln in out.splitlines() if ln.startswith("first uses that measured nothing")]
  assert len(skipped) == 1 and "matmul " in skipped[0], out
  n, of = map(int, skipped[0].split("matmul ")[1].split(" of "))
  assert 0 < n < of
  rec = open(os.path.join(ROOT, "data", "probes",
                          "guard_radius_seeded_skip_confident_1.25.txt")).read()
  assert ("attention 64 of 968, decode 129 of 844, matmul 144 of 1080, ragged_dot 0 of 990"
          in rec)


def test_decode_replay_with_both_platform_ops_on_record():
  """docs/results.md ("recall@k and refinement, replayed"): decode's first
  use timing XLA's attention next to cuDNN's adds about half a candidate on
  the sweeps (4.3-4.4 -> 4.8) and moves no replayed speed (XLA's decode wins
  no sweep problem): ``PYTHONHASHSEED=0 python3 benchmarks/guard_radius.py
  --seeds 0 1 2 3 4 --families decode`` with and without the flag."""
  def rows(name):
    text = open(os.path.join(ROOT, "data", "probes", name)).read()
    return {ln.split()[0]: ln.split()[1:] for ln in text.splitlines()
            if ln.startswith(("nvidia_h100_80gb_hbm3 decode", "nvidia_h200 decode"))}
  now = rows("guard_radius_seeded_decode_all_platforms.txt")
  before = rows("guard_radius_seeded_decode_cudnn_only.txt")
  assert set(now) == set(before) == {"nvidia_h100_80gb_hbm3", "nvidia_h200"}
  for gpu in now:
    # (decode, r@1..r@6, eff, vs plat, min, below, candidates)
    assert now[gpu][:-1] == before[gpu][:-1], gpu
    assert float(now[gpu][-1]) > float(before[gpu][-1]), gpu
  assert [now[g][-1] for g in sorted(now)] == ["4.8", "4.8"]
  assert [before[g][-1] for g in sorted(before)] == ["4.4", "4.3"]
  assert [now[g][6:9] for g in sorted(now)] == [["0.989", "5.898", "1.000"],
                                                ["0.990", "5.380", "1.000"]]
