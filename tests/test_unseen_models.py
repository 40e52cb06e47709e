"""``benchmarks/unseen_models.py`` on a CPU: the problems of the model sets,
the selections it would time under a policy (``--dry-run``), its summary of
recorded H100 rows (``--report``), the policy reaching the profiler's compile
threads, and its errors."""

import concurrent.futures
import importlib.util
import json
import pathlib

import jax
import pytest

import wavetune_jax as wt
from wavetune_jax.core.hardware import get_hardware

ROOT = pathlib.Path(__file__).parent.parent
H100_ROWS = ROOT / "data" / "probes" / "unseen_models_h100.json"
TRAIN = ROOT / "wavetune_jax" / "shapes" / "train.json"
KEYS = ("nvidia_h100_80gb_hbm3", "nvidia_h200")


def _mod():
  spec = importlib.util.spec_from_file_location(
      "unseen_models", ROOT / "benchmarks" / "unseen_models.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  return mod


def test_problems_are_outside_the_training_suites():
  mod = _mod()
  plan = mod.problems(mod.FAMILIES, quick=False)
  assert len(plan) == 168
  dims = {p.head_dim for f, _, p in plan if f == "attention"}
  assert dims == {96, 128, 256}
  experts = {p.g for f, _, p in plan if f == "ragged_dot"}
  assert experts == {8, 60, 128}
  only = mod.problems(("attention",), quick=True, models=("phi_3_mini",))
  assert len(only) == 4 and all("phi_3_mini" in label for _, label, _ in only)


def _train_suite():
  """Model names and weight shapes of the training suite (train.json)."""
  d = json.loads(TRAIN.read_text())
  names = ({w.split(".")[0] for w in d["gemm"]["weights"]}
           | {w.split(".")[0] for w in d["grouped_gemm"]["weights"]}
           | set(d["attention"]["models"]) | set(d["decode"]["models"]))
  gemm = {(w["K"], w["N"]) for w in d["gemm"]["weights"].values()}
  grouped = {(w["E"], w["K"], w["N"]) for w in d["grouped_gemm"]["weights"].values()}
  heads = {(m["q_heads"], m["kv_heads"], m["head_dim"])
           for kind in ("attention", "decode") for m in d[kind]["models"].values()}
  return names, gemm, grouped, heads


def _power_of_two(n: int) -> bool:
  return n > 0 and n & (n - 1) == 0


def _sizes(plan) -> list:
  """Every size of ``plan``'s problems: rows, sequence lengths, batches,
  caches and their products with the batch."""
  sizes = []
  for fam, _, p in plan:
    if fam in ("matmul", "ragged_dot"):
      sizes.append(p.m)
    elif fam == "attention":
      sizes += [p.q_len, p.batch * p.q_len]
    else:
      sizes += [p.batch, p.kv_len, p.batch * p.kv_len]
  return sizes


def _assert_none_taken(plan, gemm, grouped, heads):
  """No GEMM weight in ``gemm``, expert weight in ``grouped`` or attention
  head layout in ``heads`` among ``plan``'s problems."""
  for fam, label, p in plan:
    if fam == "matmul":
      assert (p.k, p.n) not in gemm, label
    elif fam == "ragged_dot":
      assert (p.g, p.k, p.n) not in grouped, label
    else:
      assert (p.q_heads, p.kv_heads, p.head_dim) not in heads, label


def test_v2_is_a_new_set_of_models_and_sizes():
  mod = _mod()
  v1, v2 = mod.SETS["v1"], mod.SETS["v2"]
  assert len(v2.dense) >= 6 and len(v2.moe) >= 3
  names, gemm, grouped, heads = _train_suite()
  assert {"llama3_8b", "mixtral_8x7b", "dbrx", "olmoe_1b_7b", "phi_3_5_moe",
          "snowflake_arctic", "llama4_scout"} <= names  # the suite as read
  assert not set(v2.names) & (set(v1.names) | names)
  plan = mod.problems(mod.FAMILIES, quick=False, model_set="v2")
  labels = [label for _, label, _ in plan]
  v1_labels = [label for _, label, _ in mod.problems(mod.FAMILIES, quick=False)]
  assert len(set(labels)) == len(labels) and not set(labels) & set(v1_labels)
  # Not the training suite's models under other names: none of its GEMM
  # weights, expert weights or head layouts.
  v1_heads = {(c["q_heads"], c["kv_heads"], c["head_dim"]) for c in v1.dense.values()}
  _assert_none_taken(plan, gemm, grouped, heads | v1_heads)
  attn = [p for f, _, p in plan if f in ("attention", "decode")]
  assert {p.head_dim for p in attn} >= {64, 80, 96, 128, 256}
  assert all(p.q_heads % p.kv_heads == 0 for p in attn)
  assert {p.q_heads // p.kv_heads for p in attn} >= {1, 2, 4, 8}
  assert {p.g for f, _, p in plan if f == "ragged_dot"} == {32, 40, 64}
  # No token count, sequence, batch of decode rows or cache length is a
  # power of two.
  tokens = []
  for fam, _, p in plan:
    if fam in ("matmul", "ragged_dot"):
      tokens.append(p.m)
    elif fam == "attention":
      tokens += [p.q_len, p.kv_len, p.batch * p.q_len]
    else:
      tokens += [p.batch, p.kv_len, p.batch * p.kv_len]
  assert tokens and not [t for t in tokens if _power_of_two(t)]
  # The one MLP without a gate: its first GEMM is ffn wide.
  neox = mod.gemm_weights(v2.dense["gpt_neox_20b"])
  assert neox["up"] == (6144, 24576) and "gate_up" not in neox
  assert len(plan) == 8 * (4 * 5 + 2 * 3 + 2 * 2) + 4 * 2 * 3
  quick = mod.problems(mod.FAMILIES, quick=True, model_set="v2")
  assert 0 < len(quick) < len(plan) and set(quick) <= set(plan)


def test_v3_is_a_third_set_with_new_head_layouts():
  mod = _mod()
  v3 = mod.SETS["v3"]
  names, gemm, grouped, heads = _train_suite()
  assert len(v3.dense) == 8 and len(v3.moe) == 4
  earlier = [m for k, m in mod.SETS.items() if k != "v3"]
  assert not set(v3.names) & (names | {n for m in earlier for n in m.names})
  plan = mod.problems(mod.FAMILIES, quick=False, model_set="v3")
  labels = [label for _, label, _ in plan]
  earlier_labels = {label for k in ("v1", "v2")
                    for _, label, _ in mod.problems(mod.FAMILIES, quick=False, model_set=k)}
  assert len(set(labels)) == len(labels) and not set(labels) & earlier_labels
  # Head layouts of none of the other sets nor the suites; the suite's
  # weights and expert weights not taken again.
  seen = heads | {(c["q_heads"], c["kv_heads"], c["head_dim"])
                  for m in earlier for c in m.dense.values()}
  _assert_none_taken(plan, gemm, grouped, seen)
  attn = [p for f, _, p in plan if f in ("attention", "decode")]
  assert {p.head_dim for p in attn} == {64, 128, 256}
  assert {p.q_heads // p.kv_heads for p in attn} == {1, 2, 3, 4, 5, 12}
  assert all(p.q_heads % p.kv_heads == 0 for p in attn)
  assert {p.g for f, _, p in plan if f == "ragged_dot"} == {8, 64, 128}
  assert not [t for t in _sizes(plan) if _power_of_two(t)]
  assert "up" in mod.gemm_weights(v3.dense["gpt2_xl"])
  assert len(plan) == 8 * (4 * 5 + 2 * 3 + 2 * 2) + 4 * 2 * 3


def test_v4_is_a_fourth_set_of_models_and_sizes():
  """New models (expert weights in no other set nor the suites, a GEMM
  weight of its own per dense model; head layouts may repeat), sizes that
  are not powers of two."""
  mod = _mod()
  v4 = mod.SETS["v4"]
  names, gemm, grouped, _ = _train_suite()
  assert len(v4.dense) == 8 and len(v4.moe) == 4
  earlier = [m for k, m in mod.SETS.items() if k != "v4"]
  assert not set(v4.names) & (names | {n for m in earlier for n in m.names})
  plan = mod.problems(mod.FAMILIES, quick=False, model_set="v4")
  labels = [label for _, label, _ in plan]
  assert len(set(labels)) == len(labels)
  seen_gemm = gemm | {(k, n) for k_ in ("v1", "v2", "v3")
                      for f, _, p in mod.problems(("matmul",), False, None, k_)
                      for k, n in [(p.k, p.n)]}
  seen_grouped = grouped | {(p.g, p.k, p.n) for k_ in ("v1", "v2", "v3")
                            for f, _, p in mod.problems(("ragged_dot",), False, None, k_)}
  # Every expert weight is new, and every dense model has a GEMM weight of
  # its own (models share dims: Mistral-Small's qkv and o are
  # Mistral-NeMo's, SmolLM2-1.7B's MLP Llama-3.2-1B's).
  _assert_none_taken([t for t in plan if t[0] == "ragged_dot"], set(), seen_grouped, set())
  for name in v4.dense:
    own = {(p.k, p.n) for f, label, p in plan if f == "matmul" and label.startswith(name + ".")}
    assert own - seen_gemm, name
  attn = [p for f, _, p in plan if f in ("attention", "decode")]
  assert {p.head_dim for p in attn} == {64, 128}
  assert {p.q_heads // p.kv_heads for p in attn} == {1, 4, 6, 7, 8}
  assert {p.g for f, _, p in plan if f == "ragged_dot"} == {32, 128, 160}
  assert not [t for t in _sizes(plan) if _power_of_two(t)]
  assert "up" in mod.gemm_weights(v4.dense["mpt_7b"])
  assert len(plan) == 8 * (4 * 5 + 2 * 3 + 3 * 3) + 4 * 2 * 3


def test_report_of_the_v4_runs_on_the_tables(capsys):
  """docs/results.md ("A fourth set of models (v4): the tables alone, on an
  H200"): spread lengths and full caches, reported apart."""
  probes = ROOT / "data" / "probes"
  spread, full = (probes / "unseen_v4_tables_h200.json",
                  probes / "unseen_v4_tables_full_h200.json")
  assert _mod().main(["--report", str(spread)]) == 0
  out = capsys.readouterr().out
  for line in ("decode: wt vs the faster of cuDNN and XLA 1.045x geomean, min 0.980x, 0 of 48",
               "ragged_dot: wt vs base 11.148x geomean, min 1.157x, 0 of 16 below 0.97x"):
    assert line in out, line
  assert _mod().main(["--report", str(full)]) == 0
  out = capsys.readouterr().out
  assert "decode: wt vs the faster of cuDNN and XLA 1.027x geomean, min 0.962x, 3 of 48" in out
  rows = json.loads(full.read_text())["rows"]
  low = sorted(r["label"] for r in rows if r["us"]["wt"] > r["us"]["base"] / 0.97)
  assert low == ["granite_3_1_8b b=72 cache=14000", "internlm2_5_20b b=72 cache=14000",
                 "mistral_small_24b b=72 cache=14000"]
  assert json.loads(full.read_text())["lengths"] == "full"
  # The rows' picks: the Triton rule on 23 decode problems (cuDNN, the
  # guard's, on 25), the Mosaic kernel on the 16 grouped GEMMs (192-row
  # tiles for gpt-oss-120b at 5,200 tokens: 162.5 rows per expert).
  spread_rows = json.loads(spread.read_text())["rows"]
  dec = [r for r in spread_rows if r["family"] == "decode"]
  assert [r["label"] for r in dec] == [r["label"] for r in rows]
  assert sum(r["config"]["backend"] == "triton" for r in dec) == 23
  assert sum(r["source"] == "guard" for r in dec) == 25
  grouped = {r["label"]: r["config"] for r in spread_rows if r["family"] == "ragged_dot"}
  assert len(grouped) == 16 and {c["backend"] for c in grouped.values()} == {"mosaic"}
  assert grouped["gpt_oss_120b.w13 tokens=5200"]["block_m"] == 192
  # Not timed: the tables' GEMM and attention picks are the platform ops.
  lines, last = _dry_run(_mod(), capsys, ["--set", "v4", "--quick", "--policy", "tables",
                                          "--device-key", "nvidia_h200",
                                          "--families", "matmul,attention"])
  assert last == "128 problems" and {line.split()[-2] for line in lines} == {"xla", "cudnn"}
  # Two files of other mixes are not summed together.
  assert _mod().main(["--report", str(spread), str(full)]) == 2
  assert "several length mixes" in capsys.readouterr().err


def _dry_run(mod, capsys, argv):
  assert mod.main(["--dry-run"] + argv) == 0
  out = capsys.readouterr().out.splitlines()
  return out[:-1], out[-1]


@pytest.mark.parametrize("model_set", ("v2", "v3", "v4"))
@pytest.mark.parametrize("key", KEYS)
def test_dry_run_selects_runnable_configs_under_the_policy(key, model_set, capsys):
  """Every line is the selector's answer under ``--policy`` for that GPU, a
  config that runs the problem there; another policy answers otherwise."""
  mod = _mod()
  plan = mod.problems(mod.FAMILIES, quick=False, model_set=model_set)
  hw = get_hardware(key)
  lines = {}
  for pol in ("tables", "heuristic"):
    lines[pol], last = _dry_run(mod, capsys, ["--set", model_set, "--device-key", key,
                                              "--policy", pol])
    assert last == f"{len(plan)} problems" and len(lines[pol]) == len(plan)
    with wt.policy(pol):
      for line, (fam, label, p) in zip(lines[pol], plan):
        spec = wt.get_family(fam)
        sel = wt.select(fam, p, key)
        assert line[:52].split() == [fam, *label.split()]
        assert line[52:] == f"{mod.describe(spec, sel.config)}  [{sel.source}]"
        spec.validate(p, sel.config, hw)
  assert lines["tables"] != lines["heuristic"]


def test_dry_run_prints_each_selection(capsys):
  mod = _mod()
  lines, last = _dry_run(mod, capsys, ["--device-key", "nvidia_h100_80gb_hbm3",
                                       "--families", "attention", "--models", "phi_3_mini",
                                       "--policy", "heuristic"])
  assert last == "8 problems"
  by_label = {line[12:52].strip(): line[52:] for line in lines}
  # The heuristic: head_dim 96 above one wave, 6,000 tokens: the Mosaic
  # kernel; 777: cuDNN.
  assert by_label["phi_3_mini b=1 L=6000"].startswith("mosaic(")
  assert by_label["phi_3_mini b=6 L=777"].startswith("cudnn")
  # The default policy is the library's (auto): on a CPU, with another
  # GPU's tables, what tables answers.
  assert _dry_run(mod, capsys, ["--device-key", "nvidia_h100_80gb_hbm3", "--set", "v2"]) == \
      _dry_run(mod, capsys, ["--device-key", "nvidia_h100_80gb_hbm3", "--set", "v2",
                             "--policy", "tables"])


def test_quantized_gemms_are_an_optional_family(capsys):
  mod = _mod()
  # Not in the default families (the files on record hold none).
  assert len(mod.problems(mod.FAMILIES, quick=False)) == 168
  plan = mod.problems(("qmatmul",), quick=True, models=("phi_3_mini",))
  assert {p.w_layout for _, _, p in plan} == {"kn", "nk"} and len(plan) == 48
  lines, last = _dry_run(mod, capsys, ["--device-key", "nvidia_h100_80gb_hbm3",
                                       "--families", "qmatmul", "--models", "phi_3_mini",
                                       "--quick"])
  assert last == "48 problems"
  by_label = {line[12:52].strip(): line[52:] for line in lines}
  # The FP8 kernel where the guard trusts it (a wave of 128 x 256 tiles);
  # XLA's FP8 dot at 200 rows, without evidence.
  assert by_label["phi_3_mini.gate_up M=3000 w8a8"].startswith("mosaic(block_m=128,block_n=256")
  assert by_label["phi_3_mini.gate_up M=200 w8a8"].startswith("xla")
  # The H100 table's anchors admit the FP8 kernel for a down projection at
  # one row (XLA's FP8 dot without them).
  assert by_label["phi_3_mini.down M=1 w8a8"].startswith("mosaic(block_m=64,block_n=128")
  # The swapped weight-only kernel, trusted at one row with K >= 4096 (the
  # down projection's 8,192), not with the gate/up's K of 3,072.
  assert by_label["phi_3_mini.down M=1 int8 nk"].startswith("mosaic(block_m=64")
  assert by_label["phi_3_mini.gate_up M=1 int8 nk"].startswith("xla")
  # W4A16: the int4 kernel up to 64 rows.
  assert by_label["phi_3_mini.gate_up M=1 int4 nk"].startswith("mosaic(block_m=64")
  # An op call as the timing loop makes it, on a CPU (XLA).
  fam, _, p = next(t for t in plan if t[2].w8a8 and t[2].m == 1)
  spec = wt.get_family(fam)
  args = spec.inputs(p, jax.random.PRNGKey(0))
  out = mod.op_fn(fam, p, "tables")(*args)
  assert out.shape == (1, p.n) and out.dtype == jax.numpy.bfloat16


def test_the_policy_reaches_the_compile_threads():
  """The profiler traces in worker threads; the op enters the policy itself,
  so a thread outside any policy context compiles the policy's config."""
  mod = _mod()
  p = wt.MatmulProblem(m=40, n=256, k=128)
  args = wt.get_family("matmul").inputs(p, jax.random.PRNGKey(0))
  with wt.policy("fixed"):
    assert wt.select("matmul", p).config.__class__.__name__.startswith("Triton")
  with wt.policy("heuristic"):
    assert wt.select("matmul", p).config.__class__.__name__.startswith("Xla")

  def hlo(fn):
    return jax.jit(fn).lower(*args).as_text()

  with concurrent.futures.ThreadPoolExecutor(1) as pool, wt.policy("heuristic"):
    fixed = pool.submit(hlo, mod.op_fn("matmul", p, "fixed")).result()
    plain = pool.submit(hlo, mod.op_fn("matmul", p, "heuristic")).result()
  # A Pallas kernel in interpret mode (a loop over blocks) against one dot.
  assert len(fixed) > 5 * len(plain) and "while" in fixed and "while" not in plain
  # First use: lower, compile and one call, in seconds.
  assert 0 < mod.first_use(mod.op_fn("matmul", p, "heuristic"), args) < 60


class _FakeProfiler:
  """Times nothing: each function runs once and is 'ok' at 10 us (wt) or
  20 us (the baselines)."""

  def __init__(self, iterations, threads):
    pass

  def measure_many(self, fns, args, **kw):
    from wavetune_jax.tuning.profiler import Measurement
    out = []
    for i, f in enumerate(fns):
      jax.block_until_ready(jax.jit(f)(*args))
      out.append(Measurement(status="ok", median_us=10.0 if i == 0 else 20.0, samples=1))
    return out


def test_timing_rows_record_the_set_policy_and_first_use(tmp_path, monkeypatch, capsys):
  """The timing loop on a CPU (a fake profiler, one small problem): the
  header holds the set and policy, each row its selection's source and the
  first use's seconds; a resumed run must be of the same set and policy."""
  mod = _mod()
  from wavetune_jax.tuning import profiler
  p = wt.MatmulProblem(m=3, n=256, k=128)
  monkeypatch.setattr(mod, "problems", lambda *a: [("matmul", "qwen2_5_1_5b.o M=3", p)])
  monkeypatch.setattr(profiler, "Profiler", _FakeProfiler)

  class Gpu:  # this jax, on a "gpu" backend
    def __getattr__(self, name):
      return (lambda: "gpu") if name == "default_backend" else getattr(jax, name)

  monkeypatch.setattr(mod, "jax", Gpu())
  out = tmp_path / "rows.json"
  argv = ["--set", "v2", "--families", "matmul", "--json", str(out)]
  assert mod.main(argv + ["--policy", "heuristic"]) == 0
  text = capsys.readouterr().out
  assert text.splitlines()[0].endswith("set v2, policy heuristic, decode lengths spread")
  assert "1st s" in text and "matmul: wt vs base 2.000x" in text
  rows = json.loads(out.read_text())
  assert (rows["set"], rows["policy"], rows["lengths"]) == ("v2", "heuristic", "spread")
  (row,) = rows["rows"]
  assert row["source"] == "heuristic" and row["config"] == {"backend": "xla"}
  # The tables' answer is timed in the same row (the fake profiler gives
  # every function after the first 20 us).
  assert 0 < row["first_use_s"] < 60
  assert row["us"] == {"wt": 10.0, "wt_tables": 20.0, "base": 20.0}
  assert row["tables_source"] in ("heuristic", "guard", "exact", "model")
  assert mod.main(argv + ["--policy", "heuristic"]) == 0
  assert "1 problems on file, 0 to run" in capsys.readouterr().out
  with pytest.raises(SystemExit, match="--policy heuristic, this run is --policy fixed"):
    mod.main(argv + ["--policy", "fixed"])


def test_report_summarizes_recorded_rows(capsys):
  mod = _mod()
  assert mod.main(["--report", str(H100_ROWS), "--families", "ragged_dot"]) == 0
  out = capsys.readouterr().out
  # Rows recorded before --policy: the tables policy, no first-use column.
  assert out.startswith("NVIDIA H100 80GB HBM3 (policy tables):")
  assert " -  " in out.splitlines()[1] and "first use" not in out
  line = next(x for x in out.splitlines() if x.startswith("ragged_dot: "))
  rows = json.loads(H100_ROWS.read_text())["rows"]
  n = sum(r["family"] == "ragged_dot" for r in rows)
  assert f"0 of {n} below 0.97x" in line


def test_report_of_the_quantized_gemms_under_the_h100_table(capsys):
  # docs/results.md ("Tables for the quantized GEMMs"): every recorded row ran
  # what the shipped tables pick today, and the summary the docs quote.
  mod = _mod()
  rows = ROOT / "data" / "probes" / "unseen_qmatmul_tables_h100.json"
  assert mod.main(["--report", str(rows), "--families", "qmatmul"]) == 0
  out = capsys.readouterr().out
  # Two rows ran the [K, N] kernel's split before it took any count (the
  # docs say so): int8 at one row, qkv (4 -> 7 splits) and down (8 -> 9).
  assert "21 problems, 2 measured with an older selection" in out
  older = [x.split()[1] for x in out.splitlines() if "(older selection)" in x]
  assert older == ["qwen2_5_7b.qkv", "qwen2_5_7b.down"]
  assert "qmatmul: wt vs base 1.069x geomean, min 0.990x, 0 of 21 below 0.97x" in out
  down = next(x for x in out.splitlines() if "qwen2_5_7b.down M=1 w8a8" in x)
  assert down.split()[-1] == "mosaic" and "1.110" in down


@pytest.mark.parametrize("gpu,line", [
    ("h100", "decode: wt vs the faster of cuDNN and XLA 1.148x geomean, min 0.987x, 0 of 16"),
    ("h200", "decode: wt vs the faster of cuDNN and XLA 1.217x geomean, min 0.999x, 0 of 16")])
def test_report_of_refinement_on_both_length_mixes(capsys, gpu, line):
  # docs/results.md ("Refinement on full caches too"): the v2 decode runs.
  rows = ROOT / "data" / "probes" / f"unseen_v2_refine_fullmix_decode_{gpu}.json"
  assert _mod().main(["--report", str(rows)]) == 0
  assert line in capsys.readouterr().out


def test_decoder_runs_of_refinement_on_both_length_mixes():
  # The same section's decoder table: XLA's step time over refine's.
  def speeds(name):
    rows = json.loads((ROOT / "data" / "e2e" / name).read_text())["rows"]
    us = {(r["kind"], r["batch"], r["length"], r["setting"]): r["us"] for r in rows}
    return [round(t / us[k[:-1] + ("refine",)], 3) for k, t in us.items() if k[-1] == "xla"]
  assert speeds("decoder4_qwen2_5_1_5b_fullmix_h100.json") == [1.052, 0.999, 0.997, 1.046,
                                                               1.021]
  assert speeds("decoder4_qwen2_5_1_5b_fullmix_h200.json") == [1.037, 0.992, 0.999, 1.022,
                                                               1.305]
  assert speeds("decoder4_gemma_2_2b_fullmix_h100.json") == [1.005, 1.033, 1.135, 1.273, 1.65]
  assert speeds("decoder4_gemma_2_2b_fullmix_h200.json") == [1.025, 1.061, 1.186, 1.408, 1.889]


def test_bad_arguments_are_one_line_errors(tmp_path, capsys):
  mod = _mod()
  with pytest.raises(SystemExit):
    mod.main(["--families", "conv"])
  assert "--families: unknown ['conv']" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    mod.main(["--dry-run", "--models", "gpt5"])
  assert "--models: unknown ['gpt5']" in capsys.readouterr().err
  bad = tmp_path / "x.json"
  bad.write_text("{")
  assert mod.main(["--report", str(bad)]) == 2
  assert "is not readable JSON" in capsys.readouterr().err
  # Rows without their fields, and files of two GPUs.
  bad.write_text(json.dumps({"device_kind": "NVIDIA H100 80GB HBM3",
                             "rows": [{"family": "matmul", "label": "x"}]}))
  assert mod.main(["--report", str(bad)]) == 2
  assert "not a file this script wrote" in capsys.readouterr().err
  other = tmp_path / "h200.json"
  rows = json.loads(H100_ROWS.read_text())
  other.write_text(json.dumps({**rows, "device_kind": "NVIDIA H200"}))
  assert mod.main(["--report", str(H100_ROWS), str(other)]) == 2
  assert "several GPUs" in capsys.readouterr().err
  assert mod.main(["--report", str(H100_ROWS), "--models", "gpt5"]) == 2
  assert "--models: unknown ['gpt5']" in capsys.readouterr().err
  # Files of two policies, and a policy this library lacks.
  other.write_text(json.dumps({**rows, "policy": "heuristic"}))
  assert mod.main(["--report", str(H100_ROWS), str(other)]) == 2
  assert "several policies ['heuristic', 'tables']" in capsys.readouterr().err
  other.write_text(json.dumps({**rows, "policy": "psychic"}))
  assert mod.main(["--report", str(other)]) == 2
  assert "policy 'psychic' is not one of" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    mod.main(["--dry-run", "--policy", "psychic"])
  assert "--policy: unknown 'psychic'" in capsys.readouterr().err
  # A model of the other set, and a file of another set or policy to resume.
  with pytest.raises(SystemExit):
    mod.main(["--dry-run", "--models", "gemma_2_2b"])
  assert "unknown ['gemma_2_2b'] in --set v1" in capsys.readouterr().err
  kind = rows["device_kind"]
  with pytest.raises(SystemExit, match="holds rows of --set v1, this run is --set v2"):
    mod.resume(str(H100_ROWS), kind, "v2", "tables")
  with pytest.raises(SystemExit, match="--policy tables, this run is --policy auto"):
    mod.resume(str(H100_ROWS), kind, "v1", "auto")
  with pytest.raises(SystemExit, match="--lengths spread, this run is --lengths full"):
    mod.resume(str(H100_ROWS), kind, "v1", "tables", "full")
  # A file without decode rows holds no mix to match.
  no_decode = tmp_path / "no_decode.json"
  no_decode.write_text(json.dumps({**rows, "rows": [r for r in rows["rows"]
                                                   if r["family"] != "decode"]}))
  assert mod.resume(str(no_decode), kind, "v1", "tables", "full")["lengths"] == "full"
  with pytest.raises(SystemExit):
    mod.main(["--report", str(H100_ROWS), "--lengths", "full"])
  assert "--report reads each file's own" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    mod.main(["--dry-run", "--families", "matmul", "--lengths", "full"])
  assert "--lengths is decode's" in capsys.readouterr().err
  back = mod.resume(str(H100_ROWS), kind, "v1", "tables")
  assert (back["set"], back["policy"], len(back["rows"])) == ("v1", "tables", len(rows["rows"]))
  # Timing needs a GPU; a CPU says so.
  import jax
  if jax.default_backend() == "cpu":
    assert mod.main(["--families", "matmul"]) == 2
    assert "needs a GPU" in capsys.readouterr().err


def test_quantized_grouped_gemms_are_an_optional_family(capsys):
  mod = _mod()
  plan = mod.problems(("qragged_dot",), quick=True, models=("qwen3_30b_a3b",))
  w8a8 = [p for _, lab, p in plan if lab.endswith(" w8a8")]
  int8 = [p for _, lab, p in plan if lab.endswith(" int8")]
  assert len(plan) == 8 and len(w8a8) == len(int8) == 4
  assert all(p.w8a8 and p.w_layout == "nk" for p in w8a8)
  assert all(not p.w8a8 and p.w_dtype == "int8" and p.w_layout == "kn" for p in int8)
  lines, last = _dry_run(mod, capsys, ["--device-key", "nvidia_h100_80gb_hbm3",
                                       "--families", "qragged_dot", "--models",
                                       "qwen3_30b_a3b", "--quick"])
  assert last == "8 problems"
  # The kernels' rules everywhere (the guard trusts the FP8 kernel over XLA's
  # FP8 ragged dot, and the weight-only one over XLA's ragged dot on the
  # converted weights where not every expert is busy at a few rows).
  assert all(line[52:].startswith("mosaic(block_m=") for line in lines)
  # An op call as the timing loop makes it, on a CPU (XLA), at a small size
  # (the models' 128 experts would take gigabytes of random inputs here).
  fam = plan[0][0]
  p = wt.QRaggedDotProblem(m=24, g=4, k=256, n=128, dtype="float8_e4m3fn",
                           w_dtype="float8_e4m3fn", w_layout="nk")
  spec = wt.get_family(fam)
  out = mod.op_fn(fam, p, "tables")(*spec.inputs(p, jax.random.PRNGKey(0)))
  assert out.shape == (p.m, p.n) and out.dtype == jax.numpy.bfloat16


def test_report_of_the_v3_run(capsys):
  """docs/results.md ("A third set of models (v3), on an H200"): the table's
  summaries, and the first-use times before and after the grouped GEMM's
  platform op was left untimed."""
  probes = ROOT / "data" / "probes"
  files = [probes / "unseen_v3_auto_h200.json", probes / "unseen_v3_auto_matmul_h200.json"]
  assert _mod().main(["--report", *map(str, files)]) == 0
  out = capsys.readouterr().out
  for line in ("matmul: wt vs base 1.020x geomean, min 0.987x, 0 of 69 below 0.97x",
               "attention: wt vs base 1.020x geomean, min 0.977x, 0 of 30 below 0.97x",
               "decode: wt vs the faster of cuDNN and XLA 1.147x geomean, min 0.990x, 0 of 16",
               "ragged_dot: wt vs base 6.971x geomean, min 0.962x, 1 of 16 below 0.97x",
               "matmul: wt_tables vs base 1.000x geomean, min 0.966x, 1 of 69 below 0.97x",
               "attention: wt_tables vs base 0.994x geomean, min 0.887x, 3 of 30 below 0.97x",
               "decode: wt_tables vs the faster of cuDNN and XLA 0.978x geomean, min 0.787x, 2",
               "ragged_dot: wt_tables vs base 6.938x geomean, min 0.967x, 1 of 16 below 0.97x",
               "first use of wt (trace, compile, first call): median 2.37 s, max 55.68 s over 131"):
    assert line in out, line
  rows = {r["label"]: r for r in json.loads(files[0].read_text())["rows"]}
  first = {k: r["first_use_s"] for k, r in rows.items() if r["family"] == "ragged_dot"}
  assert round(first["qwen3_235b_a22b.w13 tokens=3300"], 2) == 55.68
  assert round(first["ernie_4_5_21b_a3b.w13 tokens=3300"], 2) == 14.89
  # The nine run after the change (from ERNIE's w2 at 3,300 tokens on).
  after = list(first)[list(first).index("ernie_4_5_21b_a3b.w2 tokens=3300"):]
  assert len(after) == 9
  assert (round(min(first[k] for k in after), 1), round(max(first[k] for k in after), 1)) == \
      (4.1, 9.0)
  fu = json.loads((ROOT / "data" / "e2e" / "first_use_qwen3_235b_w13_h200.json").read_text())
  by_lib = {r["lib"]: r for run in fu["runs"] if run["stage"] == 1 for r in run["rows"]}
  assert round(by_lib["xla"]["total_s"], 2) == 51.12
  assert round(by_lib["wt"]["total_s"], 2) == 7.53
  # With the later calls (the GEMMs at 7,000 rows of six models, StarCoder2's
  # attention at batch 5): the table's GEMM and attention rows.
  later = [probes / f"unseen_v3_auto_{n}_h200.json"
           for n in ("matmul_m7000", "matmul_m7000_b", "matmul_m7000_c", "attention_starcoder2")]
  assert _mod().main(["--report", *map(str, files + later)]) == 0
  out = capsys.readouterr().out
  for line in ("matmul: wt vs base 1.015x geomean, min 0.987x, 0 of 93 below 0.97x",
               "matmul: wt_tables vs base 0.999x geomean, min 0.962x, 2 of 93 below 0.97x",
               "attention: wt vs base 1.021x geomean, min 0.977x, 0 of 32 below 0.97x",
               "attention: wt_tables vs base 0.994x geomean, min 0.887x, 3 of 32 below 0.97x"):
    assert line in out, line
  m7000 = [r for f in later[:3] for r in json.loads(f.read_text())["rows"]]
  assert len(m7000) == 24 and {r["config"]["backend"] for r in m7000} == {"xla"}
  speed = [r["us"]["base"] / r["us"]["wt"] for r in m7000]
  assert (round(min(speed), 3), round(max(speed), 3)) == (0.996, 1.015)


def test_report_of_the_v3_quantized_runs(capsys):
  """docs/results.md ("A third set of models (v3), on an H200"): the FP8
  grouped GEMMs and the int4 GEMMs at 5 rows."""
  probes = ROOT / "data" / "probes"
  for fam, name, lines in (
      ("qragged_dot", "unseen_v3_auto_qragged_dot_h200.json",
       ("qragged_dot: wt vs base 24.807x geomean, min 7.033x, 0 of 8 below 0.97x",)),
      # With the later call's problems (a later file's rows join the first's).
      ("qragged_dot", ("unseen_v3_auto_qragged_dot_h200.json",
                       "unseen_v3_auto_qragged_dot_tokens12_h200.json"),
       ("qragged_dot: wt vs base 15.262x geomean, min 3.871x, 0 of 12 below 0.97x",
        "qragged_dot: wt_tables vs base 15.297x geomean, min 3.857x, 0 of 12 below 0.97x")),
      ("qmatmul", "unseen_v3_auto_qmatmul_int4_h200.json",
       ("qmatmul: wt vs base 2.901x geomean, min 0.977x, 0 of 26 below 0.97x",
        "qmatmul: wt_tables vs base 2.896x geomean, min 0.992x, 0 of 26 below 0.97x")),
      ("qmatmul", ("unseen_v3_auto_qmatmul_int4_h200.json",
                   "unseen_v3_auto_qmatmul_int4_starcoder2_h200.json"),
       ("qmatmul: wt vs base 3.179x geomean, min 0.977x, 0 of 30 below 0.97x",
        "qmatmul: wt_tables vs base 3.163x geomean, min 0.992x, 0 of 30 below 0.97x")),
      # W8A8-FP8 at 7,000 rows after XLA's FP8 dot was left untimed where a
      # trusted candidate stands in for it (25.8 and 28.7 s before).
      ("qmatmul", "unseen_v3_auto_qmatmul_w8a8_standin_h200.json",
       ("qmatmul: wt vs base 1.283x geomean, min 1.190x, 0 of 5 below 0.97x",
        "first use of wt (trace, compile, first call): median 5.65 s, max 6.50 s over 5 "
        "problems")),
      # All 32 (the stand-in run's five and three runs resuming its file).
      ("qmatmul", "unseen_v3_auto_qmatmul_w8a8_m7000_h200.json",
       ("qmatmul: wt vs base 1.404x geomean, min 0.998x, 0 of 32 below 0.97x",
        "qmatmul: wt_tables vs base 1.271x geomean, min 0.997x, 0 of 32 below 0.97x",
        "first use of wt (trace, compile, first call): median 5.64 s, max 21.30 s over 32 "
        "problems")),
      ("qmatmul", "unseen_v3_auto_qmatmul_int8_m5_h200.json",
       ("qmatmul: wt vs base 1.011x geomean, min 0.977x, 0 of 64 below 0.97x",
        "qmatmul: wt_tables vs base 1.002x geomean, min 0.957x, 1 of 64 below 0.97x")),
      ("qmatmul", "unseen_v3_auto_qmatmul_w8a8_m5_h200.json",
       ("qmatmul: wt vs base 1.104x geomean, min 0.976x, 0 of 32 below 0.97x",
        "qmatmul: wt_tables vs base 1.003x geomean, min 0.970x, 1 of 32 below 0.97x")),
      ("qmatmul", "unseen_v3_auto_qmatmul_int8_m450_h200.json",
       ("qmatmul: wt vs base 0.999x geomean, min 0.978x, 0 of 35 below 0.97x",
        "qmatmul: wt_tables vs base 1.001x geomean, min 0.973x, 0 of 35 below 0.97x")),
      ("qmatmul", "unseen_v3_auto_qmatmul_w8a8_m450_h200.json",
       ("qmatmul: wt vs base 1.000x geomean, min 0.977x, 0 of 16 below 0.97x",
        "first use of wt (trace, compile, first call): median 3.23 s, max 16.18 s over 16 "
        "problems"))):
    names = (name,) if isinstance(name, str) else name
    assert _mod().main(["--families", fam, "--report", *(str(probes / n) for n in names)]) == 0
    out = capsys.readouterr().out
    for line in lines:
      assert line in out, line


def test_a_refined_row_is_compared_by_its_tables_answer(capsys):
  """A row first-use refinement decided ran a config a selection without a
  GPU cannot reproduce; ``--report`` compares its recorded tables answer
  instead, so refined rows are not all marked "older selection"."""
  um = _mod()
  assert um._selected({"source": "measured", "config": {"backend": "mosaic"},
                       "tables_config": {"backend": "xla"}}) == {"backend": "xla"}
  assert um._selected({"source": "tables", "config": {"backend": "xla"},
                       "tables_config": {"backend": "mosaic"}}) == {"backend": "xla"}
  path = ROOT / "data" / "probes" / "unseen_v3_auto_qmatmul_w8a8_m5_h200.json"
  assert um.main(["--families", "qmatmul", "--report", str(path)]) == 0
  assert "32 problems, 0 measured with an older selection" in capsys.readouterr().out


def test_the_grouped_gemms_top_two_holds_what_refinement_took_on_unseen_models(monkeypatch):
  """The grouped GEMM measures the wave model's top 2 at first use, not 3
  (docs/results.md, "recall@k and refinement, replayed"): of the grouped
  GEMMs of models outside the suites that refinement decided on a GPU (36),
  the config it took is among today's candidates at k = 3 on 29 (7 were
  decided under earlier tables), and at k = 2 on 27 of those: the other two
  it took over the tables' answer by 1.9% and 2.2%."""
  from wavetune_jax.core import versions
  from wavetune_jax.runtime import refine, selector
  um = _mod()
  real = versions.current
  monkeypatch.setattr(versions, "current", lambda: {**real(), "cudnn": "9.19.0"})
  spec = wt.get_family("ragged_dot")
  plan = {(f, label): p for s in um.SETS
          for f, label, p in um.problems(um.ALL_FAMILIES, False, None, s)}
  in3, seen, lost = 0, 0, {}
  for name, key in (("unseen_v1_refine_h100.json", "nvidia_h100_80gb_hbm3"),
                    ("unseen_v2_refine_h100.json", "nvidia_h100_80gb_hbm3"),
                    ("unseen_v3_auto_h200.json", "nvidia_h200")):
    hw = get_hardware(key)
    for r in json.loads((ROOT / "data" / "probes" / name).read_text())["rows"]:
      if r["family"] != "ragged_dot" or r["source"] != "measured":
        continue
      seen += 1
      p = plan[("ragged_dot", r["label"])]
      sel, d = selector._from_tables(spec, p, hw)
      took = spec.config_from_dict(r["config"], legacy=False)
      if took not in refine.candidates(spec, p, hw, d, sel.config, k=3):
        continue   # (decided under earlier tables)
      in3 += 1
      if took not in refine.candidates(spec, p, hw, d, sel.config):
        lost[r["label"]] = round(r["us"]["wt_tables"] / r["us"]["wt"], 3)
  assert (seen, in3) == (36, 29)
  assert lost == {"deepseek_v2_lite.w2 tokens=4500": 1.019, "hunyuan_a13b.w13 tokens=3300": 1.022}


def test_w8a8_at_7000_rows_refinement_over_the_guard_on_record():
  """docs/results.md (v3, "All 32 W8A8-FP8 GEMMs at 7,000 rows"): the FP8
  kernel on 29 at 1.17-2.20x; XLA's FP8 dot on GPT-2 XL's three GEMMs of K
  1,600 (the kernel's K blocks are 128 deep); the tables alone keep XLA's
  on five GEMMs of N <= 2,048 that refinement ran 1.47-2.20x, where the H200
  table's anchor 4,096 x 1,280 x 8,192 has every kernel config slower than
  XLA's FP8 dot."""
  import json

  from pallas_kernels.matmul import fp8
  with open(ROOT / "data" / "probes" / "unseen_v3_auto_qmatmul_w8a8_m7000_h200.json") as f:
    rows = json.load(f)["rows"]
  assert len(rows) == 32
  speed = {r["label"]: r["us"]["base"] / r["us"]["wt"] for r in rows}
  kernel = [r for r in rows if r["config"]["backend"] == "mosaic"]
  assert len(kernel) == 29
  assert (round(min(speed[r["label"]] for r in kernel), 2),
          round(max(speed[r["label"]] for r in kernel), 2)) == (1.17, 2.20)
  xla = sorted(r["label"] for r in rows if r["config"]["backend"] != "mosaic")
  assert xla == ["gpt2_xl.o M=7000 w8a8", "gpt2_xl.qkv M=7000 w8a8", "gpt2_xl.up M=7000 w8a8"]
  for r in rows:
    k = int(r["problem"].split(":")[0].split("x")[2])
    assert (k % fp8.BLOCK_K != 0) == (r["label"] in xla), r["label"]
  guarded = [r for r in rows if r["tables_config"]["backend"] != "mosaic"
             and r["config"]["backend"] == "mosaic"]
  assert sorted(r["label"].split()[0] for r in guarded) == [
      "gemma_3_1b.down", "gemma_3_1b.o", "gemma_3_1b.qkv", "smollm3_3b.down", "smollm3_3b.o"]
  assert all(r["tables_source"] == "guard" for r in guarded)
  assert all(int(r["problem"].split("x")[1]) <= 2048 for r in guarded)
  assert (round(min(speed[r["label"]] for r in guarded), 2),
          round(max(speed[r["label"]] for r in guarded), 2)) == (1.47, 2.20)
  with open(ROOT / "tables" / "nvidia_h200" / "qmatmul.json") as f:
    anchors = [a for a in json.load(f)["anchors"]
               if (a["problem"]["m"], a["problem"]["n"], a["problem"]["k"]) == (4096, 1280, 8192)]
  xla_us = [a["us"] for a in anchors if a["config"]["backend"] == "xla"]
  kernel_us = [a["us"] for a in anchors if a["config"]["backend"] == "mosaic"]
  assert [round(u, 1) for u in xla_us] == [65.2] and len(kernel_us) == 5
  assert (round(min(kernel_us), 1), round(max(kernel_us), 1)) == (87.1, 95.2)


def test_the_long_cache_split_moves_three_unseen_decode_picks(monkeypatch):
  """docs/results.md ("Long caches: splits that fill the waves"): of the
  decode problems of the H200 sweep and of the four unseen sets, the
  H200's long-cache split moves the Triton rule's answer on six, all
  unseen: three v4 problems at batch 72 and 14,000 that the tables run, and
  three the guard sends to cuDNN either way."""
  import gzip
  from wavetune_jax import DECODE, DecodeProblem
  from wavetune_jax.families.decode import triton
  mod = _mod()
  hw = get_hardware("h200")
  rule = next(b for b in DECODE.backends if b.name == "triton")
  probs = {}
  with gzip.open(ROOT / "data" / "sweeps" / "nvidia_h200" / "decode_bfloat16.jsonl.gz", "rt") as f:
    for line in f:
      r = json.loads(line)
      if r.get("type") == "row":
        probs["sweep " + r["key"].split("|")[0]] = DecodeProblem(**r["problem"])
  for k in mod.SETS:
    for _, label, p in mod.problems(("decode",), False, None, k):
      probs[f"{k} {label}"] = p
  now = {k: rule.heuristic(p, hw) for k, p in probs.items()}
  with wt.policy("tables"):
    sources = {k: wt.select("decode", probs[k], "nvidia_h200").source for k in probs}
  monkeypatch.setattr(triton, "LONG_SPLIT_GPUS", frozenset())
  moved = sorted(k for k, p in probs.items() if rule.heuristic(p, hw) != now[k])
  assert moved == ["v3 llama3_2_3b b=40 cache=9000", "v3 qwen3_14b b=40 cache=9000",
                   "v4 granite_3_1_8b b=72 cache=14000", "v4 internlm2_5_20b b=72 cache=14000",
                   "v4 mistral_small_24b b=72 cache=14000", "v4 yi_1_5_9b b=72 cache=14000"]
  assert [sources[k] for k in moved] == ["guard", "guard", "heuristic", "heuristic",
                                         "heuristic", "guard"]


@pytest.mark.parametrize("key", KEYS)
def test_float16_calls_select_as_bfloat16_ones_do(key, capsys):
  """The guard judges a float16 call on the tables' bfloat16 measurements
  (one 16-bit class): on every v3 problem the tables answer float16 as
  they answer bfloat16 (before, the guard found no float16 evidence and
  kept XLA's dense ragged dot on 15 of the 16 grouped GEMMs)."""
  mod = _mod()
  argv = ["--set", "v3", "--quick", "--device-key", key, "--policy", "tables",
          "--families", "matmul,attention,decode,ragged_dot,qmatmul,qragged_dot"]
  bf16, last = _dry_run(mod, capsys, argv)
  f16, last16 = _dry_run(mod, capsys, argv + ["--dtype", "float16"])
  strip = lambda line: line.replace(" float16", " ").split()  # noqa: E731
  assert [strip(l) for l in f16] == [l.split() for l in bf16 if " w8a8" not in l[:52]]
  assert last16 == f"{len(f16)} problems" and len(f16) < len(bf16)
  plan = mod.problems(("ragged_dot", "qmatmul"), True, None, "v3", "float16")
  assert {p.dtype for _, _, p in plan} == {"float16"}   # (W8A8 left out)
  assert all(p.out_dtype == "float16" for _, _, p in plan)
  assert len(plan) == len(mod.problems(("ragged_dot", "qmatmul"), True, None, "v3")) - sum(
      p.dtype == "float8_e4m3fn" for _, _, p in mod.problems(("qmatmul",), True, None, "v3"))
  assert all(label.endswith(" float16") for _, label, _ in plan)
  # The grouped GEMMs (ragged_dot, not the quantized ones) on the Mosaic kernel.
  mosaic = sum("mosaic(" in l for l in f16 if l.startswith("ragged_dot "))
  assert mosaic == {"nvidia_h200": 15, "nvidia_h100_80gb_hbm3": 9}[key], mosaic
  spec = wt.RAGGED_DOT
  p = wt.RaggedDotProblem(m=26400, g=128, k=4096, n=3072)
  assert spec.evidence_features(p) == spec.evidence_features(
      wt.RaggedDotProblem(m=26400, g=128, k=4096, n=3072, dtype="float16"))


def test_report_of_the_float16_runs_on_the_tables(capsys):
  """docs/results.md ("Float16 models (H200)"): float16 calls of the v3
  models on the tables, after the guard took bfloat16 evidence for them."""
  probes = ROOT / "data" / "probes"
  grouped = probes / "unseen_v3_f16_ragged_dot_tables_h200.json"
  more = probes / "unseen_v3_f16_more_tables_h200.json"
  assert _mod().main(["--report", str(grouped), str(more)]) == 0
  out = capsys.readouterr().out
  for line in ("ragged_dot: wt vs base 6.779x geomean, min 0.965x, 1 of 16 below 0.97x",
               "decode: wt vs the faster of cuDNN and XLA 1.052x geomean, min 1.008x, 0 of 2"):
    assert line in out, line
  assert _mod().main(["--report", str(more), "--families", "qmatmul,qragged_dot"]) == 0
  out = capsys.readouterr().out
  for line in ("qmatmul: wt vs base 3.153x geomean, min 0.990x, 0 of 12 below 0.97x",
               "qragged_dot: wt vs base 5.027x geomean, min 0.985x, 0 of 6 below 0.97x"):
    assert line in out, line
  rows = [r for f in (grouped, more) for r in json.loads(f.read_text())["rows"]]
  assert all(r["label"].endswith(" float16") for r in rows) and len(rows) == 36
  # Float16 outputs too (no bfloat16 anywhere in the problems).
  assert all("float16" in r["problem"] and "bfloat16" not in r["problem"] for r in rows)
  # The grouped GEMMs XLA's op ran before (the guard's answer), by speed-up.
  speed = sorted(r["us"]["base"] / r["us"]["wt"] for r in rows if r["family"] == "ragged_dot"
                 and r["config"]["backend"] == "mosaic")
  assert len(speed) == 15 and (round(speed[0], 3), round(speed[-1], 1)) == (0.965, 85.5)


def test_float16_decoders_on_the_tables_and_refinement():
  """docs/results.md ("Float16 models (H200)"): each cell of the table is
  XLA's step over the setting's, from the recorded runs."""
  want = {"llama3_8b": {"tables": (1.000, 1.000, 0.999, 1.000), "auto": (1.048, 1.089, 1.002, 1.000)},
          "mixtral_8x7b": {"tables": (1.026, 4.854, 2.739, 1.000),
                           "auto": (1.333, 4.841, 2.775, 0.999)},
          "qwen2_5_1_5b": {"tables": (1.001, 1.000, 1.001, 0.999),
                           "auto": (1.079, 1.038, 1.174, 1.020)}}
  want["llama3_8b"]["tables after"] = (1.003, 1.004, 1.001, 0.985)
  want["mixtral_8x7b"]["tables after"] = (1.363, 4.694, 2.771, 1.003)
  for model, settings in want.items():
    run = json.loads((ROOT / "data" / "e2e" / f"{model}_f16_tables_auto_h200.json").read_text())
    if "tables after" in settings:
      after = json.loads((ROOT / "data" / "e2e" / f"{model}_f16_tables_guard16_h200.json")
                         .read_text())
      run["rows"] += [dict(r, setting="tables after") for r in after["rows"]
                      if r["setting"] == "tables"]
      # XLA's own step of that process is the base of its tables rows.
      for r in after["rows"]:
        if r["setting"] == "xla":
          run["rows"].append(dict(r, setting="xla after"))
    assert run["dtype"] == "float16" and run["device"] == "NVIDIA H200"
    us = {(r["setting"], r["kind"], r["length"], r["batch"]): r["us"] for r in run["rows"]}
    assert max(r["rel_diff_vs_xla"] for r in run["rows"]) <= 1.1e-3
    points = sorted({k[1:] for k in us}, key=lambda k: (k[0] != "prefill", k[1], k[2]))
    assert len(points) == 4
    for setting, cells in settings.items():
      base = "xla after" if setting == "tables after" else "xla"
      got = tuple(round(us[(base, *k)] / us[(setting, *k)], 3) for k in points)
      assert got == cells, (model, setting, got)
