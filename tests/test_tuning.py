"""Tuner, tables and selector: synthetic sweeps with known answers and the
recorded H200 sweep."""

import dataclasses
import json
import math
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from synthetic import HW, FakeMeasure, wave_us, write_sweep
import wavetune_jax as wt
from synthetic import MATMUL
from wavetune_jax import MatmulProblem
from wavetune_jax.tuning import evaluate, tuner as tuning
from wavetune_jax.runtime import selector, tables
from wavetune_jax.cli import main as cli_main

H200_SWEEP = os.path.join(os.path.dirname(__file__), "..", "data", "sweeps", "nvidia_h200",
                          "matmul_bfloat16.jsonl.gz")
WEIGHTS = [(256, 512), (512, 256), (384, 640), (1024, 1024)]
MS = [1, 16, 64, 200, 300, 1000, 2000]


@pytest.fixture(scope="module")
def wave_ds(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("s") / "wave.jsonl.gz")
  probs = [MatmulProblem(m=m, n=n, k=k) for n, k in WEIGHTS for m in MS]
  return evaluate.load_dataset(write_sweep(path, probs, FakeMeasure(
      wave_us, with_failures=False)))


@pytest.fixture(scope="module")
def wave_table(wave_ds):
  # Sixteen targeted anchors per problem and round (the default is two):
  # fewer rounds, each a refit of every variant; the held-out efficiency
  # below is the same (0.992 geomean with 2, 8 or 16; 16.7 s -> 6.2 s here).
  res = tuning.tune(MATMUL, HW, wave_ds.problems, tuning.ReplayMeasurer(wave_ds, wave_ds.problems),
                    budget=1000, per_round=16)
  return res


@pytest.fixture(autouse=True)
def _fresh_selector():
  selector.clear()
  yield
  selector.clear()


def test_replay_respects_budget_and_pool(wave_ds, wave_table):
  assert wave_table.measurements <= 1000
  assert len(wave_table.table.anchors) == wave_table.measurements
  with pytest.raises(ValueError, match="not in the pool"):
    tuning.ReplayMeasurer(wave_ds, wave_ds.problems[:1]).measure(
        [(wave_ds.problems[-1], MATMUL.default(wave_ds.problems[-1]))])


def test_synthetic_wave_latency_is_learned(wave_ds, wave_table):
  """The synthetic latency is a wave model: the models must pick near-oracle
  configs for problems it never measured (new M values of every weight);
  with the heuristic guard, the decisions are at least as good as the
  heuristic's."""
  d = selector.Decider(wave_table.table, HW, heuristic_margin=None)
  guarded = selector.Decider(wave_table.table, HW)
  effs, effs_guarded, effs_heuristic = [], [], []
  for n, k in WEIGHTS:
    for m in (8, 100, 500, 1500):
      p = MatmulProblem(m=m, n=n, k=k)
      space = MATMUL.space(p, HW)
      best = min(wave_us(p, c) for c in space)
      sel = d.decide(p)
      assert sel is not None and sel.config in space
      effs.append(best / wave_us(p, sel.config))
      effs_guarded.append(best / wave_us(p, guarded.decide(p).config))
      effs_heuristic.append(best / wave_us(p, MATMUL.heuristic(p, HW)))
  geo = lambda xs: math.exp(np.mean(np.log(xs)))
  assert geo(effs) > 0.97, effs
  assert geo(effs_guarded) >= geo(effs_heuristic) - 1e-9


def test_decider_buckets_match_direct_prediction(wave_table):
  """Without the heuristic guard the per-weight decision vector equals an
  argmin over the space."""
  table = wave_table.table
  d = selector.Decider(table, HW, heuristic_margin=None)
  assert d.margin is None and selector.Decider(table, HW).margin == MATMUL.heuristic_margin
  for m in (1, 15, 16, 17, 100, 129, 1000, 1023, 5000):
    p = MatmulProblem(m=m, n=384, k=640)
    space = MATMUL.space(p, HW)
    pred = table.predict(p, space)
    sel = d.decide(p)
    if not np.isfinite(pred).any():
      assert sel is None
      continue
    # Same minimum (the split-K column is taken at the top of the M bucket).
    assert table.predict(p, [sel.config])[0] == pytest.approx(np.min(pred), rel=0.02)


def test_decider_first_size_alone_equals_the_block():
  """A weight's first size is decided alone, later ones from the block of 64
  sizes: the same answers either way (shipped H200 GEMM table)."""
  hw = wt.get_hardware("h200")
  table = tables.load(os.path.join(os.path.dirname(__file__), "..", "tables", "nvidia_h200",
                                   "matmul.json"), wt.MATMUL, hw)
  for n, k in ((4160, 4096), (14400, 4096), (4096, 14400)):
    ms = (1, 7, 16, 100, 333, 512, 1000, 1024)
    alone = []
    for m in ms:
      d = selector.Decider(table, hw)  # fresh: m is decided alone
      alone.append(d.decide(MatmulProblem(m=m, n=n, k=k)))
    d = selector.Decider(table, hw)
    d.decide(MatmulProblem(m=2000, n=n, k=k))  # seen: the next ones build blocks
    d.decide(MatmulProblem(m=1, n=n, k=k))
    for m, a in zip(ms, alone):
      b = d.decide(MatmulProblem(m=m, n=n, k=k))
      assert (a is None) == (b is None)
      if a is not None:
        assert (a.config, a.source) == (b.config, b.source)
        assert a.predicted_us == b.predicted_us or a.predicted_us == pytest.approx(
            b.predicted_us, rel=1e-6)


def test_decider_keeps_the_heuristic_unless_the_model_wins_by_the_margin(wave_table):
  table = wave_table.table
  margin = MATMUL.heuristic_margin
  assert margin
  d = selector.Decider(table, HW)
  seen, sources = set(), set()
  for n, k in ((384, 640), (4096, 4096), (1280, 8192)):
    for m in (16, 128, 1024, 4096, 8192):  # tops of M buckets: the rule's own sizes
      p = MatmulProblem(m=m, n=n, k=k)
      pred = table.predict(p, MATMUL.space(p, HW))
      sel = d.decide(p)
      if not np.isfinite(pred).any():
        assert sel is None
        continue
      sources.add(sel.source)
      if sel.source == "exact":  # a measured win (the heuristic measured too)
        assert table.exact[p][0] == sel.config
        continue
      h = MATMUL.heuristic(p, HW)
      t_h = table.predict(p, [h])[0]
      floor = d._floor(p, np.array([m]))[0]
      if np.isfinite(t_h) and max(np.min(pred), floor) * (1.0 + margin) < t_h:
        assert table.predict(p, [sel.config])[0] == pytest.approx(np.min(pred), rel=0.02)
        assert sel.source == "model"
        seen.add("model")
      else:
        assert sel.config == h and sel.source == "heuristic"
        assert sel.predicted_us is None or np.isfinite(sel.predicted_us)
        seen.add("heuristic")
  assert seen == {"model", "heuristic"}
  assert {"model", "heuristic"} <= sources  # both kinds of decision, not only exact hits


def test_decider_believes_no_claim_below_the_measured_rates(wave_table):
  """The floor: the fastest FLOP and byte rates of the table's anchors. A
  model claim below it cannot replace the heuristic."""
  table = wave_table.table
  d = selector.Decider(table, HW)
  assert d.rates is not None
  for p, _, us in table.anchors:  # no anchor beats its own floor
    assert d._floor(p, np.array([p.m]))[0] <= us * (1 + 1e-9)
  probs = [p for p in (MatmulProblem(m=m, n=n, k=k)
                       for n, k in ((384, 640), (4096, 4096), (1280, 8192))
                       for m in (16, 128, 1024, 4096, 8192)) if d.decide(p) is not None]
  assert any(d.decide(p).source == "model" for p in probs)
  slow = selector.Decider(table, HW)
  slow.rates = tuple(r / 1e6 for r in d.rates)  # a floor far above every prediction
  for p in probs:
    sel = slow.decide(p)
    assert sel.source == "exact" or (sel.config == MATMUL.heuristic(p, HW)
                                     and sel.source == "heuristic")


def test_table_round_trip_and_validation(tmp_path, wave_table):
  path = str(tmp_path / "matmul.json")
  tables.save(wave_table.table, path)
  t2 = tables.load(path, MATMUL, HW)
  assert t2.entries == wave_table.table.entries
  assert t2.exact == wave_table.table.exact
  assert t2.distance_penalty == wave_table.table.distance_penalty == tables.DEFAULT_DISTANCE_PENALTY
  d = json.load(open(path))
  # A table written before the distance penalty existed predicts without it.
  old = {**d, "model": {k: v for k, v in d["model"].items() if k != "distance_penalty"}}
  json.dump(old, open(path, "w"))
  assert tables.load(path, MATMUL, HW).distance_penalty == 0.0
  # No trust box: written as null, read back as inf.
  tables.save(dataclasses.replace(wave_table.table, trust=math.inf), path)
  assert json.load(open(path))["model"]["trust"] is None
  assert tables.load(path, MATMUL, HW).trust == math.inf
  cases = {
      "trust 0.5 must be >= 1": lambda: json.dump(
          {**d, "model": {**d["model"], "trust": 0.5}}, open(path, "w")),
      "distance_penalty 'x'": lambda: json.dump(
          {**d, "model": {**d["model"], "distance_penalty": "x"}}, open(path, "w")),
      "not readable JSON": lambda: open(path, "w").write("{not json"),
      "schema 99": lambda: json.dump({**d, "schema": 99}, open(path, "w")),
      "is for 'nvidia_a100": lambda: json.dump({**d, "device_key": "nvidia_a100"},
                                                open(path, "w")),
      "revision": lambda: json.dump({**d, "revisions": {"triton": 0}}, open(path, "w")),
      "configs of backend 'cudnn'": lambda: json.dump({**d, "revisions": {"cudnn": 1}},
                                              open(path, "w")),
      "num_sms=0": lambda: json.dump({**d, "num_sms": 0}, open(path, "w")),
      "is for family 'attention'": lambda: json.dump({**d, "family": "attention"},
                                                     open(path, "w")),
      r"model entry .*invalid coef": lambda: json.dump(
          {**d, "model": {**d["model"], "entries": [
              {**d["model"]["entries"][0],
               "coef": [-1.0] + d["model"]["entries"][0]["coef"][1:]}]}}, open(path, "w")),
      r"model entry .*invalid occupancy": lambda: json.dump(
          {**d, "model": {**d["model"], "entries": [
              {**d["model"]["entries"][0], "occupancy": 0}]}}, open(path, "w")),
      r"model entry .*invalid max_l": lambda: json.dump(
          {**d, "model": {**d["model"], "entries": [
              {**d["model"]["entries"][0], "max_l": float("inf")}]}}, open(path, "w")),
      "exact entry .*split_k=16 is larger": lambda: json.dump(
          {**d, "exact": [{"problem": {"m": 16, "n": 256, "k": 64},
                           "config": {"backend": "triton", "block_m": 16, "block_n": 32,
                                      "block_k": 32, "split_k": 16},
                           "us": 3.0}]}, open(path, "w")),
      "exact entry .*time -3.0": lambda: json.dump(
          {**d, "exact": [{"problem": {"m": 16, "n": 256, "k": 64},
                           "config": {"backend": "triton"}, "us": -3.0}]}, open(path, "w")),
      "not a wavetune table": lambda: json.dump([1, 2], open(path, "w")),
      "coefficients": lambda: json.dump(
          {**d, "model": {**d["model"], "entries": [
              {**d["model"]["entries"][0], "coef": [1.0]}]}}, open(path, "w")),
  }
  for msg, corrupt in cases.items():
    corrupt()
    with pytest.raises(tables.TableError, match=msg):
      tables.load(path, MATMUL, HW)
  with pytest.raises(tables.TableError, match="no table at"):
    tables.load(str(tmp_path / "missing.json"), MATMUL, HW)


def test_distance_penalty_grows_away_from_the_anchors():
  c = MATMUL.space(MatmulProblem(m=64, n=4096, k=4096), HW)[0]
  anchors = [(MatmulProblem(m=m, n=4096, k=4096), c, 10.0) for m in (64, 4096)]
  xy = [MATMUL.coords(p, c) for p, _, _ in anchors]
  v = MATMUL.variant(c)
  entry = tables.ModelEntry(variant=v, occupancy=1, coef=(1.0,) + (0.0,) * 7, points=2,
                            min_g=1, max_g=10**9, min_l=0.01, max_l=1e9,
                            aux_seen=(True, True), fit_med_err=0.0)
  table = tables.Table(family=MATMUL, device_kind=HW.name, device_key=HW.device_key,
                       num_sms=HW.num_sms, form="bilinear", entries={v: entry}, exact={},
                       anchors=anchors, provenance={})
  (g0, l0), (g1, l1) = xy
  g = np.array([g0, g1, g0 * 4, g0], float)
  l = np.array([l0, l1, l0, l0 * 2], float)
  aux = np.zeros((4, len(MATMUL.aux_names)), np.float32)
  raw = table.predict_arrays([c] * 4, g, l, aux, trusted=False)
  pen = table.predict_arrays([c] * 4, g, l, aux)
  k = table.distance_penalty
  assert k > 0
  # At an anchor: no penalty; elsewhere 1 + k * (L1 distance in log G, log L to
  # the nearest anchor).
  np.testing.assert_allclose(pen, raw * (1 + k * np.array([0, 0, np.log(4), np.log(2)])),
                             rtol=1e-5)


def test_selection_order_and_policies(wave_table):
  p = MatmulProblem(m=100, n=384, k=640)
  with selector.use_tables(wave_table.table, "matmul"):
    sel = selector.select(MATMUL, p, HW)
    assert sel.source in ("exact", "model")
    with selector.policy("fixed"):
      assert selector.select(MATMUL, p, HW).config == MATMUL.default(p)
    with selector.policy("heuristic"):
      assert selector.select(MATMUL, p, HW).config == MATMUL.heuristic(p, HW)
    pin = MATMUL.default(p)
    with selector.use_config("matmul", pin):
      assert selector.select(MATMUL, p, HW) == selector.Selection(pin, "explicit")
    assert selector.select(MATMUL, p, HW) == sel  # memoized, state restored
  with pytest.raises(ValueError, match="unknown policy"):
    selector.set_policy("fastest")


def test_missing_or_foreign_table_falls_back_once(tmp_path, monkeypatch, wave_table):
  monkeypatch.setenv("WAVETUNE_TABLES", str(tmp_path))
  os.makedirs(tmp_path / HW.device_key)
  bad = dict(wave_table.table.to_json(), device_key="nvidia_a100")
  json.dump(bad, open(tmp_path / HW.device_key / "matmul.json", "w"))
  with pytest.warns(UserWarning, match="no usable matmul table") as rec:
    s1 = selector.select(MATMUL, MatmulProblem(m=5, n=256, k=512), HW)
    s2 = selector.select(MATMUL, MatmulProblem(m=7, n=256, k=512), HW)
  assert len(rec) == 1
  assert s1.source == s2.source == "heuristic"


def test_jit_retraces_when_the_policy_changes():
  traces = []

  @jax.jit
  def f(x, w):
    traces.append(1)
    return wt.matmul(x, w)

  x = jnp.ones((8, 64), jnp.float32)
  w = jnp.ones((64, 32), jnp.float32)
  with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    with wt.policy("fixed"):
      y1 = f(x, w)
      f(x, w)
    assert len(traces) == 1
    with wt.policy("heuristic"):
      y2 = f(x, w)
    assert len(traces) == 2
    with wt.use_config("matmul", {"backend": "triton", "block_m": 16, "block_n": 32,
                                  "block_k": 32}):
      f(x, w)
    assert len(traces) == 3
  np.testing.assert_allclose(np.asarray(y1), 64.0)
  np.testing.assert_allclose(np.asarray(y2), 64.0)


def test_a_global_change_inside_a_scoped_block_retraces():
  """``wt.set_policy`` inside a ``with`` block of another setting (or from
  another thread) retraces as it does outside one: the jit cache keys the
  global generation apart from the block's own state."""
  import threading
  traces = []

  @jax.jit
  def f(x, w):
    traces.append(1)
    return wt.matmul(x, w)

  x, w = jnp.ones((8, 64), jnp.float32), jnp.ones((64, 32), jnp.float32)
  try:
    with warnings.catch_warnings():
      warnings.simplefilter("ignore")
      with wt.use_config("attention", {"backend": "xla"}):
        f(x, w)
        wt.set_policy("fixed")
        f(x, w)
        assert len(traces) == 2
        f(x, w)
        assert len(traces) == 2
      with wt.policy("heuristic"):
        f(x, w)
        assert len(traces) == 3
        t = threading.Thread(target=wt.set_policy, args=("tables",))
        t.start()
        t.join()
        f(x, w)
        assert len(traces) == 4
  finally:
    wt.set_policy("auto")


def test_replay_on_the_recorded_h200_sweep(tmp_path):
  """Real measurements: tune on the training split within 3% of its points,
  the table answers every held-out problem with a config of its space, and
  beats the fixed default."""
  ds = evaluate.load_dataset(H200_SWEEP)
  res, facts = evaluate.evaluate(ds, ["wavetune", "default"], seed=0)
  wt_res, default_res = res
  assert wt_res.measurements <= facts["budget"]
  assert wt_res.misses <= 2
  assert wt_res.geomean > default_res.geomean
  # Where the default is far off, the table's choices are much faster.
  assert wt_res.vs_default_where_differ > 1.3
  assert default_res.vs_default_where_differ == pytest.approx(1.0)


def test_cli_tune_replay_select_and_plot(tmp_path, capsys, wave_ds):
  out = str(tmp_path / "t.json")
  sweep_path = str(tmp_path / "s.jsonl.gz")
  write_sweep(sweep_path, wave_ds.problems, FakeMeasure(wave_us, with_failures=False))
  assert cli_main(["tune", "--family", "matmul", "--replay", sweep_path, "--budget", "200",
                   "--out", out]) == 0
  assert tables.load(out, MATMUL, HW).provenance["mode"] == "replay"
  assert cli_main(["select", "matmul", "--m", "300", "--n", "384", "--k", "640",
                   "--device", "h100", "--table", out]) == 0
  text = capsys.readouterr().out
  # The table models Triton configs only: the XLA default stays unless the
  # model predicts a gain beyond the family's margin.
  assert "answered by" in text and ("block_m" in text or "xla" in text)
  png = str(tmp_path / "p.png")
  assert cli_main(["plot", "matmul", "--sweep", sweep_path, "--table", out, "--set",
                   "n=384", "--set", "k=640", "--out", png]) == 0
  assert os.path.getsize(png) > 1000


@pytest.mark.parametrize("device_key,kernel,floor", [
    ("nvidia_h200", "matmul", 0.88),
    ("nvidia_h200", "attention", 0.93),
    ("nvidia_h100_80gb_hbm3", "matmul", 0.87),
    ("nvidia_h100_80gb_hbm3", "attention", 0.93),
])
def test_shipped_tables_validate_and_choose_well_on_recorded_sweeps(device_key, kernel, floor):
  """Every shipped table loads for its GPU and, on that GPU's recorded sweep,
  picks configs within ``floor`` (geomean) of the exhaustive best."""
  root = os.path.join(os.path.dirname(__file__), "..")
  ds = evaluate.load_dataset(os.path.join(root, "data", "sweeps", device_key,
                                          f"{kernel}_bfloat16.jsonl.gz"))
  assert ds.hw.device_key == device_key
  table = tables.load(tables.default_path(kernel, device_key), ds.family, ds.hw)
  d = selector.Decider(table, ds.hw)
  eff = []
  for p in ds.problems:
    sel = d.decide(p)
    c = ds.family.heuristic(p, ds.hw) if sel is None else sel.config
    assert c in ds.times[p], (p, c)  # every choice lies in the swept space
    eff.append(min(ds.times[p].values()) / ds.times[p][c])
  assert math.exp(np.mean(np.log(eff))) >= floor


def test_wavetune_policy_passes_form_and_penalty_to_its_table(wave_ds):
  import random as _random
  train = wave_ds.problems[::2]
  policy = evaluate.make_policy("wavetune", {"form": "tied", "distance_penalty": 0.0,
                                            "family_weight": 0.5, "heuristic_margin": None})
  policy.fit(wave_ds, train, 200, _random.Random(0))
  assert policy.table.form == "tied" and policy.table.distance_penalty == 0.0
  assert policy.decider.margin is None
  assert policy.table.provenance["family_weight"] == 0.5
  default = evaluate.make_policy("wavetune")
  default.fit(wave_ds, train, 200, _random.Random(0))
  assert default.table.form == "bilinear"
  assert default.table.distance_penalty == tables.DEFAULT_DISTANCE_PENALTY
  assert "family_weight" not in default.table.provenance
  assert default.decider.margin == MATMUL.heuristic_margin
  from wavetune_jax.cli.eval import parse_margin
  assert parse_margin("spec") == "spec" and parse_margin("none") is None
  assert parse_margin("0.25") == 0.25
  with pytest.raises(Exception, match=">= 0"):
    parse_margin("-1")


def test_family_points_carry_a_sparse_variant_to_far_waves():
  """Two micro variants of one tile; one has 2 anchors at few waves, its
  family member has many. With family weight the sparse one's prediction far
  out follows the family's curve; alone it cannot know it."""
  from wavetune_jax import TritonMatmulConfig as MatmulConfig
  from synthetic import wave_us
  kw = dict(block_m=128, block_n=128, block_k=64, split_k=1, group_m=8, num_warps=4)
  a = MatmulConfig(**kw, num_stages=3)
  b = MatmulConfig(**kw, num_stages=4)
  ps = [MatmulProblem(m=m, n=4096, k=4096)
        for m in (128, 256, 512, 1024, 2048, 3000, 4096, 6144, 8192, 12288, 16384)]
  pts = [(p, a, wave_us(p, a)) for p in ps[:2]] + [(p, b, wave_us(p, b)) for p in ps]
  far = ps[-1]
  err = {}
  for fw in (0.0, 0.5):
    entries = tuning.fit_entries(MATMUL, HW, pts, family_weight=fw)
    assert entries[MATMUL.variant(a)].points == 2  # its own points only
    t = tables.Table(family=MATMUL, device_kind=HW.name, device_key=HW.device_key,
                     num_sms=HW.num_sms, form="bilinear", entries=entries, exact={},
                     anchors=[], provenance={}, distance_penalty=0.0)
    err[fw] = abs(t.predict(far, [a], trusted=False)[0] / wave_us(far, a) - 1)
  assert err[0.5] < 0.02 < 0.5 < err[0.0]


def test_table_load_pauses_the_garbage_collector_and_restores_it(tmp_path, monkeypatch,
                                                                 wave_table):
  import gc
  seen = []
  with tables.gc_paused():
    with tables.gc_paused():  # nested: the outer pause's state is restored
      seen.append(gc.isenabled())
    seen.append(gc.isenabled())
  assert seen == [False, False] and gc.isenabled()
  gc.disable()
  try:
    with tables.gc_paused():
      pass
    assert not gc.isenabled()  # a caller's own setting is kept
  finally:
    gc.enable()
  # load() parses with the collector off, and turns it back on after.
  path = str(tmp_path / "matmul.json")
  tables.save(wave_table.table, path)
  real = tables.from_json
  during = []

  def spy(*a, **k):
    during.append(gc.isenabled())
    return real(*a, **k)
  monkeypatch.setattr(tables, "from_json", spy)
  tables.load(path, MATMUL, HW)
  assert during == [False] and gc.isenabled()
  bad = tmp_path / "t.json"
  bad.write_text("{")
  with pytest.raises(tables.TableError):
    tables.load(str(bad), MATMUL)
  assert gc.isenabled()  # and restored on errors


def test_select_restores_the_collector_when_a_decision_fails(monkeypatch, wave_table):
  import gc
  from wavetune_jax.runtime import selector

  def boom(self, problem):
    assert not gc.isenabled()  # decided with the collector paused
    raise RuntimeError("boom")
  monkeypatch.setattr(selector.Decider, "decide", boom)
  selector.clear()
  with selector.use_tables(wave_table.table, MATMUL):
    with pytest.raises(RuntimeError, match="boom"):
      selector.select(MATMUL, MatmulProblem(m=3, n=256, k=256), HW)
  selector.clear()
  assert gc.isenabled()


def test_get_policy_reads_the_policy_in_force():
  """``wt.get_policy()``: the innermost ``wt.policy`` block's, else the global
  one (``"auto"`` unless set); another thread sees only the global one."""
  import threading
  before = wt.get_policy()
  assert before in wt.POLICIES
  try:
    wt.set_policy("tables")
    assert wt.get_policy() == "tables"
    with wt.policy("heuristic"):
      assert wt.get_policy() == "heuristic"
      seen = []
      t = threading.Thread(target=lambda: seen.append(wt.get_policy()))
      t.start()
      t.join()
      assert seen == ["tables"]
      with wt.policy("fixed"):
        assert wt.get_policy() == "fixed"
      assert wt.get_policy() == "heuristic"
    assert wt.get_policy() == "tables"
  finally:
    wt.set_policy(before)
