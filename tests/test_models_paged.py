"""The decoder on a paged KV cache, and ``wavetune bench model --cache-layout paged``.

The paged decoder keeps each layer's keys and values in a shuffled pool of
pages named by one block table; with the same weights and tokens its logits
must equal the contiguous decoder's, step after step, with sequences at
different lengths crossing page boundaries (a token written to the wrong
page or row, or a table read in the wrong order, changes the next steps'
logits). The bench command checks every setting's paged logits against the
xla setting's (which gathers the pages for ``jax.nn.dot_product_attention``).
"""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from wavetune_jax import models as M
from wavetune_jax.cli.main import main


def _run_both(cfg, ops, params, toks, lengths, *, page_size, max_pages, steps, jit=False,
              prefill_ops=None):
  """Prefill of ``toks[:, :prompt]`` (with ``prefill_ops``, default ``ops``)
  then ``steps`` decode steps from ``lengths``, contiguous and paged: per
  step ``(contiguous logits, paged logits)``, and the final caches and pages
  with the table."""
  b, total = toks.shape
  prompt = total - steps
  tables = M.random_block_tables(jax.random.PRNGKey(7), b, max_pages)
  wrap = jax.jit if jit else (lambda f: f)
  pops = prefill_ops or ops
  pre = wrap(functools.partial(M.prefill, cfg=cfg, ops=pops, max_len=max_pages * page_size))
  ppre = wrap(functools.partial(M.paged_prefill, cfg=cfg, ops=pops, page_size=page_size))
  step = wrap(functools.partial(M.decode_step, cfg=cfg, ops=ops))
  pstep = wrap(functools.partial(M.paged_decode_step, cfg=cfg, ops=ops))
  lc, kc, vc = pre(params, toks[:, :prompt])
  lp, kp, vp = ppre(params, toks[:, :prompt], tables)
  out = [(lc, lp)]
  n = jnp.asarray(lengths, jnp.int32)
  for t in range(prompt, total):
    lc, kc, vc = step(params, kc, vc, n, toks[:, t])
    lp, kp, vp = pstep(params, kp, vp, tables, n, toks[:, t])
    out.append((lc, lp))
    n = n + 1
  return out, (kc, vc), (kp, vp), tables, n


@pytest.mark.parametrize("name", ["small", "small_moe"])
def test_paged_decoder_equals_contiguous(name):
  """xla setting, float32: the same logits for the prompt and four steps;
  the pages, gathered by the table, hold the contiguous cache."""
  cfg = M.MODELS[name]
  ops = M.make_ops("xla")
  params = M.init(jax.random.PRNGKey(0), cfg, dtype=jnp.float32)
  toks = jax.random.randint(jax.random.PRNGKey(1), (3, 13), 0, cfg.vocab)
  # Pages of 4 positions, 5 per sequence; the steps write positions 9-12,
  # 3-6 and 7-10 (each crosses a page boundary).
  out, (kc, vc), (kp, vp), tables, n = _run_both(cfg, ops, params, toks, [9, 3, 7],
                                                 page_size=4, max_pages=5, steps=4,
                                                 jit=True)
  assert not np.array_equal(np.sort(np.asarray(tables), axis=None),
                            np.asarray(tables).reshape(-1)), "the pool was not shuffled"
  for c, p in out:
    np.testing.assert_allclose(np.asarray(p), np.asarray(c), rtol=1e-6, atol=1e-6)
  # The steps differ (so equal logits are not a constant's).
  assert not np.allclose(np.asarray(out[1][0]), np.asarray(out[2][0]))
  for layer in range(cfg.layers):
    for cache, pages in ((kc[layer], kp[layer]), (vc[layer], vp[layer])):
      gathered = np.asarray(pages)[np.asarray(tables)].reshape(cache.shape)
      for b, filled in enumerate(np.asarray(n)):
        np.testing.assert_array_equal(gathered[b, :filled], np.asarray(cache)[b, :filled])


def test_paged_decoder_with_wavetune_ops():
  """The wavetune decode attention (Pallas in interpret mode, bfloat16)
  reads the pages and the table: two decode steps on one layer (after the
  xla setting's prefill; prefill has no paged op) match the contiguous
  steps and the xla setting's paged ones (a paged op that read the wrong
  pages is off by about 1)."""
  cfg = M.MODELS["small"].with_layers(1)
  params = M.init(jax.random.PRNGKey(0), cfg)
  toks = jax.random.randint(jax.random.PRNGKey(1), (2, 12), 0, cfg.vocab)
  got = {}
  for setting in ("xla", "heuristic"):
    out = _run_both(cfg, M.make_ops(setting), params, toks, [10, 17], page_size=16,
                    max_pages=2, steps=2, jit=True, prefill_ops=M.make_ops("xla"))[0]
    got[setting] = [(np.asarray(c, np.float32), np.asarray(p, np.float32))
                    for c, p in out[1:]]

  def rel(a, b):
    return float(np.sqrt(np.mean((a - b) ** 2) / np.mean(b ** 2)))

  for (c, p), (xc, xp) in zip(got["heuristic"], got["xla"]):
    assert np.isfinite(p).all()
    # Paged against contiguous with the same ops; against the xla setting
    # within bench model's 5% for a dense model.
    assert rel(p, c) < 2e-2 and rel(p, xp) < 5e-2 and rel(xp, xc) < 1e-2


def test_bench_model_paged_runs_and_checks_every_setting(tmp_path, capsys):
  # Decisions memoized by earlier tests of this process would count as none.
  from wavetune_jax.runtime import selector
  selector.clear()
  out = tmp_path / "bench.json"
  rc = main(["bench", "model", "--model", "small", "--layers", "1", "--prompt", "12",
             "--decode-batch", "2", "--cache", "32", "--ops", "heuristic",
             "--cache-layout", "paged", "--page-size", "16", "--json", str(out)])
  assert rc == 0
  text = capsys.readouterr().out
  assert "paged KV cache (pages of 16)" in text and "[4/4] TPOT heuristic" in text
  assert "cache 32     paged/16" in text
  data = json.loads(out.read_text())
  assert (data["cache_layout"], data["page_size"]) == ("paged", 16)
  rows = data["rows"]
  assert {(r["setting"], r["kind"]) for r in rows} == {
      (s, k) for s in ("xla", "heuristic") for k in ("prefill", "decode")}
  assert all(r["cache_layout"] == "paged" and r["page_size"] == 16 for r in rows)
  assert all(r["rel_diff_vs_xla"] < 5e-2 and r["compile_s"] > 0 for r in rows)
  assert all(r["decisions"] > 0 for r in rows if r["setting"] != "xla")


def test_bench_model_default_layout_is_contiguous():
  from wavetune_jax.cli.main import build_parser
  a = build_parser().parse_args(["bench", "model"])
  assert (a.cache_layout, a.page_size) == ("contiguous", None)
  from wavetune_jax.cli.bench import _page_size
  assert _page_size(a) is None
  a = build_parser().parse_args(["bench", "model", "--cache-layout", "paged"])
  assert _page_size(a) == 64  # divides the default cache lengths


@pytest.mark.parametrize("argv,msg", [
    (["--page-size", "4"], "must be in [8, 1024]"),
    (["--page-size", "2048"], "must be in [8, 1024]"),
    (["--page-size", "32"], "divide every --cache length (not 16)"),
    (["--page-size", "0"], "must be in [8, 1024]"),
])
def test_bench_model_bad_page_size(argv, msg, capsys):
  rc = main(["bench", "model", "--model", "small", "--prompt", "8", "--cache", "16", "32",
             "--cache-layout", "paged"] + argv)
  assert rc == 2
  err = capsys.readouterr().err
  assert msg in err and len(err.strip().splitlines()) == 1, err


def test_bench_model_page_size_needs_paged(capsys):
  assert main(["bench", "model", "--model", "small", "--cache", "16", "--page-size", "16"]) == 2
  assert "--cache-layout paged" in capsys.readouterr().err


def test_random_block_tables_shuffle_the_pool():
  t = np.asarray(M.random_block_tables(jax.random.PRNGKey(0), 4, 8))
  assert t.shape == (4, 8) and t.dtype == np.int32
  assert sorted(t.reshape(-1).tolist()) == list(range(32))
  assert any(not np.all(np.diff(row) == 1) for row in t)


@pytest.mark.parametrize("change,msg", [
    (lambda t, n: (t.at[1, 1].set(10), n), r"block_tables\[1, 1\] = 10"),
    (lambda t, n: (t.at[0, 0].set(-1), n), r"block_tables\[0, 0\] = -1"),
    (lambda t, n: (t, n + 4), "table's pages"),
    (lambda t, n: (t[:1], n), "block_tables must be"),
])
def test_paged_decode_step_bad_input(change, msg):
  cfg = M.MODELS["small"].with_layers(1)
  params = M.init(jax.random.PRNGKey(0), cfg, dtype=jnp.float32)
  tables = M.random_block_tables(jax.random.PRNGKey(1), 2, 2)
  toks = jnp.zeros((2, 5), jnp.int32)
  ops = M.make_ops("xla")
  _, kp, vp = M.paged_prefill(params, toks, tables, cfg=cfg, ops=ops, page_size=4)
  t, n = change(tables, jnp.array([5, 4]))
  with pytest.raises(ValueError, match=msg):
    M.paged_decode_step(params, kp, vp, t, n, toks[:, 0], cfg=cfg, ops=ops)
  # An entry no sequence reads may hold anything (-1 padding).
  M.paged_decode_step(params, kp, vp, tables.at[1, 1].set(-1), jnp.array([5, 3]), toks[:, 0],
                      cfg=cfg, ops=ops)
