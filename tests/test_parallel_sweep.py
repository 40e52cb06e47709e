"""Sweeps over several GPUs: one worker process per device, one result file.

Without GPUs, the workers run a fake measuring function (tests/fake_measure.py)
in real subprocesses; one of them dies in the middle of a problem. The file
must then hold every row of the plan exactly once, the same rows as a
one-process sweep.
"""

import collections
import gzip
import json
import os

import fake_measure
import pytest

from wavetune_jax import MATMUL, get_hardware
from wavetune_jax.shapes import load_suite
from wavetune_jax.tuning import parallel, sweep

FAM = MATMUL.with_backends(["triton"])
HW = get_hardware("h100")
PROBS = FAM.problems_from_suite(load_suite(), weights=["llama3_8b.o"], sizes=[16, 64, 1000])


def _keys(path):
  rows = [json.loads(line) for line in gzip.open(path)][1:]
  return collections.Counter(r["key"] for r in rows if r["impl"] != "timing"), rows


def _file(path):
  return sweep.SweepFile(path, sweep.make_header(FAM, HW, jax_version="test"), FAM)


def test_two_workers_one_dies_no_row_lost_or_twice(tmp_path, monkeypatch):
  monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  marker = tmp_path / "died"
  monkeypatch.setenv("WAVETUNE_TEST_DIE_ON", FAM.problem_key(PROBS[1]))
  monkeypatch.setenv("WAVETUNE_TEST_MARKER", str(marker))
  f = _file(str(tmp_path / "two.jsonl.gz"))
  todo, _ = sweep.plan_sweep(FAM, PROBS, HW, f)
  counts = parallel.run_parallel(FAM, todo, f, devices=["0", "1"], worker_args={},
                                 measure="tests.fake_measure:factory")
  assert marker.exists() and counts["worker_deaths"] == 1
  keys, rows = _keys(f.path)
  assert max(keys.values()) == 1
  one = _file(str(tmp_path / "one.jsonl.gz"))
  sweep.run_sweep(FAM, PROBS, HW, one, fake_measure.factory(FAM, {}))
  assert set(keys) == set(_keys(one.path)[0])
  assert counts["measured"] == len(keys)
  assert {r.get("device") for r in rows if r["impl"] == "timing"} <= {"0", "1"}
  # Resuming finds nothing to do.
  again = _file(f.path)
  assert sweep.plan_sweep(FAM, PROBS, HW, again)[0] == []


def test_devices_option():
  from wavetune_jax.cli.sweep import _devices
  assert _devices("2") == ["0", "1"] and _devices("1,3") == ["1", "3"]
  for bad in ("0", "1,1", "x"):
    with pytest.raises(ValueError, match="--devices"):
      _devices(bad)


def test_tuner_measurer_on_two_workers(tmp_path, monkeypatch):
  monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  monkeypatch.delenv("WAVETUNE_TEST_DIE_ON", raising=False)
  log = _file(str(tmp_path / "anchors.jsonl.gz"))
  m = parallel.ParallelMeasurer(FAM, log, devices=["0", "1"], worker_args={},
                                measure="tests.fake_measure:factory")
  points = [(p, c) for p in PROBS for c in FAM.space(p, HW)[:3]]
  got = m.measure(points)
  want = {}
  for p in PROBS:
    cs = [c for q, c in points if q == p]
    for _, c, meas in fake_measure.factory(FAM, {})(p, cs, False):
      want[(p, c)] = meas.median_us
  assert got == [want[pc] for pc in points]
  keys, _ = _keys(log.path)
  assert len(keys) == len(points) and max(keys.values()) == 1
  # Known anchors are read back, not measured again (no worker is started).
  monkeypatch.setattr(parallel, "run_parallel", lambda *a, **k: pytest.fail("measured again"))
  assert parallel.ParallelMeasurer(FAM, _file(log.path), devices=["0", "1"], worker_args={},
                                   measure="x:y").measure(points) == got


def test_a_config_that_kills_workers_is_recorded_failed(tmp_path, monkeypatch):
  monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  monkeypatch.delenv("WAVETUNE_TEST_DIE_ON", raising=False)
  monkeypatch.setenv("WAVETUNE_TEST_POISON", FAM.problem_key(PROBS[0]))
  f = _file(str(tmp_path / "poison.jsonl.gz"))
  todo, _ = sweep.plan_sweep(FAM, PROBS, HW, f)
  counts = parallel.run_parallel(FAM, todo, f, devices=["0", "1"], worker_args={},
                                 measure="tests.fake_measure:factory")
  keys, rows = _keys(f.path)
  failed = [r for r in rows if r["impl"] == "pallas" and r["status"] != "ok"]
  assert counts["worker_deaths"] == parallel.MAX_DEATHS and len(failed) == 1
  assert FAM.config_from_dict(failed[0]["config"]) == FAM.space(PROBS[0], HW)[0]
  assert max(keys.values()) == 1 and len(keys) == sum(len(c) + len(b) for _, c, b in todo)


def test_a_worker_that_cannot_start_stops_the_sweep(tmp_path, monkeypatch):
  monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  monkeypatch.setenv("WAVETUNE_TEST_BROKEN", "1")
  f = _file(str(tmp_path / "broken.jsonl.gz"))
  todo, _ = sweep.plan_sweep(FAM, PROBS, HW, f)
  with pytest.raises(RuntimeError, match="before it was ready"):
    parallel.run_parallel(FAM, todo, f, devices=["0", "1"], worker_args={},
                          measure="tests.fake_measure:factory")


def test_an_error_in_the_parent_does_not_hang(tmp_path, monkeypatch):
  monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  f = _file(str(tmp_path / "full.jsonl.gz"))
  todo, _ = sweep.plan_sweep(FAM, PROBS, HW, f)

  def disk_full(rows):
    raise OSError("No space left on device")
  with pytest.raises(RuntimeError, match="No space left"):
    parallel.run_parallel(FAM, todo, f, devices=["0", "1"], worker_args={},
                          measure="tests.fake_measure:factory", on_rows=disk_full)


def test_several_workers_on_one_gpu(tmp_path, monkeypatch):
  """A device listed twice (``--workers-per-gpu 2``): two workers share it
  through a lock; the file holds the plan's rows once each."""
  monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  monkeypatch.delenv("WAVETUNE_TEST_DIE_ON", raising=False)
  f = _file(str(tmp_path / "shared.jsonl.gz"))
  todo, _ = sweep.plan_sweep(FAM, PROBS, HW, f)
  parallel.run_parallel(FAM, todo, f, devices=["0", "0"],
                        worker_args={"gpu_lock_dir": str(tmp_path)},
                        measure="tests.fake_measure:factory")
  keys, rows = _keys(f.path)
  assert max(keys.values()) == 1
  one = _file(str(tmp_path / "one.jsonl.gz"))
  sweep.run_sweep(FAM, PROBS, HW, one, fake_measure.factory(FAM, {}))
  assert set(keys) == set(_keys(one.path)[0])
  assert {r.get("device") for r in rows if r["impl"] == "timing"} == {"0"}
