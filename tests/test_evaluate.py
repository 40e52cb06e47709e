"""The evaluation harness on synthetic sweeps with known answers."""

import dataclasses
import json
import math

import pytest

from synthetic import (HW, MS, PROBLEMS, FakeMeasure, config_only_us,
                       wave_us, write_sweep)
from synthetic import MATMUL
from wavetune_jax.tuning import evaluate
from wavetune_jax.cli import main as cli_main


@pytest.fixture(scope="module")
def wave_ds(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("s") / "wave.jsonl.gz")
  return evaluate.load_dataset(write_sweep(path, PROBLEMS, FakeMeasure(wave_us)))


@pytest.fixture(scope="module")
def flat_ds(tmp_path_factory):
  path = str(tmp_path_factory.mktemp("s") / "flat.jsonl.gz")
  return evaluate.load_dataset(write_sweep(path, PROBLEMS, FakeMeasure(
      config_only_us, with_failures=False)))


def test_split_holds_out_whole_weights_and_ms(wave_ds):
  train, test = evaluate.split(wave_ds, seed=0)
  assert set(train).isdisjoint(test) and set(train) | set(test) == set(PROBLEMS)
  test_w = {(p.n, p.k) for p in PROBLEMS} - {(p.n, p.k) for p in train}
  test_m = set(MS) - {p.m for p in train}
  assert test_w and test_m
  # Every problem of a held-out weight or at a held-out M is in the test set.
  assert set(test) == {p for p in PROBLEMS if (p.n, p.k) in test_w or p.m in test_m}
  assert evaluate.split(wave_ds, seed=0) == (train, test)  # fixed seed, same split


def test_known_answers(wave_ds):
  results, facts = evaluate.evaluate(wave_ds, ["oracle", "default", "heuristic"], seed=0)
  by = {r.policy: r for r in results}
  _, test = evaluate.split(wave_ds, seed=0)
  # Oracle: efficiency 1 everywhere, and it paid for every test measurement.
  assert all(v == 1.0 for v in by["oracle"].efficiency.values())
  assert by["oracle"].measurements == sum(len(MATMUL.space(p, HW)) for p in test) + sum(
      1 for p in test for c in (MATMUL.default(p), MATMUL.heuristic(p, HW))
      if c not in MATMUL.space(p, HW))
  for p in test:
    ok = {c: wave_us(p, c) for c in wave_ds.times[p]}
    best = min(ok.values())
    d = MATMUL.default(p)
    expected = best / (ok[d] if d in ok else max(ok.values()))
    assert by["default"].efficiency[MATMUL.problem_key(p)] == pytest.approx(expected)
  assert by["default"].measurements == 0 and by["heuristic"].gpu_seconds == 0
  g = math.exp(sum(map(math.log, by["default"].efficiency.values()))
               / len(by["default"].efficiency))
  assert by["default"].geomean == pytest.approx(g)
  assert facts["budget"] == round(0.03 * facts["train_points"])
  assert by["oracle"].vs_xla_geomean > 0
  # The slowest held-out problem against the baseline, from the same times.
  _, test = evaluate.split(wave_ds, seed=0)
  for name in ("oracle", "default"):
    r = by[name]
    speeds = [wave_ds.baseline[p] * r.efficiency[MATMUL.problem_key(p)]
              / wave_ds.times[p][wave_ds.oracle(p)] for p in test if p in wave_ds.baseline]
    assert speeds and r.vs_xla_min == pytest.approx(min(speeds))
    assert r.vs_xla_min <= r.vs_xla_geomean


@pytest.mark.parametrize("name", ["tree", "gbdt", "nearest"])
def test_learned_policies_respect_budget_and_never_see_test_shapes(wave_ds, name):
  train, test = evaluate.split(wave_ds, seed=0)
  import random
  p1 = evaluate.make_policy(name)
  used, _ = p1.fit(wave_ds, train, 40, random.Random(0))
  assert 0 < used <= max(40, max(len(wave_ds.times[p]) for p in train))
  # The same fit on a dataset whose test times are scrambled picks the same configs.
  scrambled = evaluate.Dataset(**{**wave_ds.__dict__, "times": {
      p: ({c: 1.0 / t for c, t in ts.items()} if p in test else ts)
      for p, ts in wave_ds.times.items()}})
  p2 = evaluate.make_policy(name)
  p2.fit(scrambled, train, 40, random.Random(0))
  assert [p1.select(p) for p in test] == [p2.select(p) for p in test]


def test_nearest_uses_the_nearest_tuned_m(flat_ds):
  train, test = evaluate.split(flat_ds, seed=0)
  import random
  pol = evaluate.make_policy("nearest")
  pol.fit(flat_ds, train, 10**9, random.Random(0))  # budget for every training shape
  assert set(pol.tuned) == set(train)
  for p in test:
    same_w = [q for q in train if (q.n, q.k) == (p.n, p.k)]
    if not same_w:
      continue
    q = min(same_w, key=lambda q: abs(math.log2(q.m) - math.log2(p.m)))
    ranking = sorted(flat_ds.times[q], key=flat_ds.times[q].get)
    space = set(MATMUL.space(p, HW))
    assert pol.select(p) == next(c for c in ranking if c in space)


def test_learned_models_find_a_config_only_ranking(flat_ds):
  # Latency ranks configs identically on every problem: with the whole training
  # split as budget the trees must find (nearly) the best config everywhere.
  train, _ = evaluate.split(flat_ds, seed=0)
  budget = sum(len(flat_ds.times[p]) for p in train)
  results, _ = evaluate.evaluate(flat_ds, ["tree", "gbdt", "default"], budget=budget)
  by = {r.policy: r for r in results}
  assert by["tree"].geomean > 0.99 and by["gbdt"].geomean > 0.9
  assert by["gbdt"].geomean > by["default"].geomean


def test_unknown_policy(wave_ds):
  with pytest.raises(ValueError, match="unknown policy 'magic'"):
    evaluate.evaluate(wave_ds, ["magic"])


def test_cli_json_and_plot(tmp_path, capsys):
  path = write_sweep(str(tmp_path / "s.jsonl.gz"), PROBLEMS, FakeMeasure(wave_us))
  plot = str(tmp_path / "eff.png")
  assert cli_main(["eval", "--family", "matmul", "--sweep", path, "--policy",
                   "default,oracle", "--json", "--plot", plot]) == 0
  out = json.loads(capsys.readouterr().out)
  assert [r["policy"] for r in out["results"]] == ["default", "oracle"]
  assert out["results"][1]["geomean"] == 1.0
  import os
  assert os.path.getsize(plot) > 1000
  with pytest.raises(SystemExit):  # the family is required
    cli_main(["eval", "--sweep", path, "--policy", "oracle"])
  assert "required: --family" in capsys.readouterr().err
  assert cli_main(["eval", "--family", "attention", "--sweep", path]) == 2
  assert "holds 'matmul' measurements" in capsys.readouterr().err
  assert cli_main(["eval", "--family", "matmul", "--sweep", path, "--policy", "best"]) == 2
  assert "unknown policy ['best']" in capsys.readouterr().err


def test_learned_policies_features_have_one_length_across_windows():
  # A sweep holds plain and windowed attention problems (window fields -1 or
  # a size): the regressors' features must have one length, or gbdt / tree
  # fail on the recorded attention sweeps.
  from wavetune_jax import ATTENTION, AttentionProblem
  from wavetune_jax.core.hardware import PRESETS
  hw = PRESETS["h100"]
  plain = AttentionProblem(batch=1, q_heads=8, kv_heads=8, q_len=8192, head_dim=128)
  local = dataclasses.replace(plain, window_left=1024, window_right=0)
  diagonal = dataclasses.replace(plain, window_left=0, window_right=0)
  feats = [evaluate._features(ATTENTION, hw, p, ATTENTION.default(p))
           for p in (plain, local, diagonal)]
  assert len({len(f) for f in feats}) == 1
  # An unbounded side (-1), a side of 0 and one of 1,024 read apart.
  assert len({tuple(f) for f in feats}) == 3
