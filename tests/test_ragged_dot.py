"""The grouped-GEMM family (``wt.ragged_dot``) on a CPU.

The work list both Pallas kernels share is checked against a row-by-row
model of it; the Triton kernel runs in interpret mode against the float32
reference on the ragged edge cases; the Mosaic kernel (no interpret mode)
must lower to a CUDA module for its configs, where Mosaic raises its layout,
tiling and shared-memory errors. Its numerics are checked on a Hopper GPU
(``benchmarks/ragged_dot_mosaic.py --check`` and every sweep row).
"""

import dataclasses
import functools
import json
import pathlib

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import wavetune_jax as wt
from pallas_kernels.ragged_dot import mosaic as mosaic_kernel
from pallas_kernels.ragged_dot.reference import ragged_dot_reference
from pallas_kernels.ragged_dot import worklist
from pallas_kernels.ragged_dot.worklist import max_tasks, row_tasks
from wavetune_jax import RAGGED_DOT, RaggedDotProblem, get_hardware
from wavetune_jax.families.ragged_dot import routing
from wavetune_jax.families.ragged_dot.mosaic import TILES
from wavetune_jax.shapes import load_suite

H100 = get_hardware("h100")
MOSAIC = RAGGED_DOT.backend("mosaic")
TRITON = RAGGED_DOT.backend("triton")
SMALL = wt.TritonRaggedDotConfig(block_m=16, block_n=32, block_k=16)


def _owner(sizes, m):
  """Which group owns each row (len(sizes) for the tail)."""
  ends = np.minimum(np.cumsum(np.maximum(sizes, 0)), m)
  starts = np.r_[0, ends[:-1]]
  own = np.full(m, len(sizes))
  for i, (s, e) in enumerate(zip(starts, ends)):
    own[s:e] = i
  return own


def test_work_list_covers_every_row_once():
  # One compiled work list per (M, G, block_m), with 4 draws of group sizes
  # each (24 shapes): run op by op, 150 shapes left thousands of small
  # executables (1.6 GB).
  work_list = jax.jit(row_tasks, static_argnums=(1, 2))
  rng = np.random.default_rng(0)
  for trial in range(96):
    if trial % 4 == 0:
      m = int(rng.integers(1, 300))
      g = int(rng.integers(1, 12))
      bm = int(rng.choice([8, 16, 64, 128]))
    sizes = rng.multinomial(int(rng.integers(0, m + 1)), np.ones(g) / g)
    if trial % 5 == 0:
      sizes[rng.integers(g)] += rng.integers(0, 50)  # past M: clipped
    tasks, count = work_list(jnp.asarray(sizes, jnp.int32), m, bm)
    tasks, c = np.asarray(tasks), int(count[0])
    assert tasks.shape == (4, max_tasks(m, g, bm)) and c <= tasks.shape[1]
    owner = np.full(m, -1)
    for j in range(tasks.shape[1]):
      grp, row0, start, size = tasks[:, j]
      if j >= c:
        assert size == 0
        continue
      assert size > 0 and row0 % 8 == 0 and 0 <= start and start + size <= bm
      rows = np.arange(row0 + start, row0 + start + size)
      assert (owner[rows] == -1).all()
      owner[rows] = grp
    np.testing.assert_array_equal(owner, _owner(sizes, m))


_DEFAULT_LISTS = []


@pytest.mark.parametrize("sums_from,telescoped_from,max_groups,max_elements",
                         [(0, 0, 2048, 1 << 22), (99, 99, 2048, 1 << 22),
                          (0, 99, 2048, 1 << 22), (99, 0, 2048, 1 << 22),
                          (0, 0, 3, 1 << 22), (0, 0, 2048, 16)])
def test_every_way_of_building_the_work_list_gives_the_same_list(
    monkeypatch, sums_from, telescoped_from, max_groups, max_elements):
  # Masked sums or cumsums, telescoped lookups or searchsorted and gathers,
  # and past MASKED_MAX_GROUPS scans: the same list and clipped sizes.
  from pallas_kernels.ragged_dot import worklist

  def build():  # a new function each time: jit's trace cache keys on it
    return jax.jit(lambda s: (worklist.row_tasks(s, 200, 16, band_cap=2),
                              worklist.clip_sizes(s, 200)))

  rng = np.random.default_rng(1)
  sizes = [jnp.asarray(rng.integers(-3, 90, 9), jnp.int32) for _ in range(2)]
  sizes.append(jnp.asarray(rng.integers(-1, 9, 40), jnp.int32))  # the default's masked way
  sizes.append(jnp.zeros((0,), jnp.int32))  # no groups: every row is the tail's
  if not _DEFAULT_LISTS:  # the lists the default thresholds build, once per module
    _DEFAULT_LISTS.extend(jax.tree.map(np.asarray, build()(x)) for x in sizes)
  want = _DEFAULT_LISTS
  assert want[-1][0][1][0] == 13 and (want[-1][0][0][worklist.GROUP, :13] == 0).all()
  monkeypatch.setattr(worklist, "MASKED_SUMS_FROM", sums_from)
  monkeypatch.setattr(worklist, "TELESCOPED_FROM", telescoped_from)
  monkeypatch.setattr(worklist, "MASKED_MAX_GROUPS", max_groups)
  monkeypatch.setattr(worklist, "TELESCOPED_MAX_ELEMENTS", max_elements)
  # Spies: which way each list was built (traced anew each time).
  used = {"masked sums": 0, "search": 0}

  def spy(name, fn):
    def wrapped(*args, **kwargs):
      used[name] += 1
      return fn(*args, **kwargs)
    return wrapped
  monkeypatch.setattr(worklist, "_prefix_sums", spy("masked sums", worklist._prefix_sums))
  monkeypatch.setattr(jnp, "searchsorted", spy("search", jnp.searchsorted))
  for i, (x, w) in enumerate(zip(sizes, want)):
    got = build()(x)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(w)):
      np.testing.assert_array_equal(np.asarray(a), b)
    if i == 0:  # 9 groups
      assert bool(used["masked sums"]) == (sums_from == 0 and max_groups >= 9)
      assert bool(used["search"]) == (telescoped_from > 0 or max_groups < 10
                                      or max_elements < 16 * 9)
  # Sums past int32 (G * M > 2**31 - 1): the saturating scan.
  big = jnp.asarray([2**31 - 1, 5, 2**31 - 1], jnp.int32)
  np.testing.assert_array_equal(np.asarray(worklist.clip_sizes(big, 2**30)), [2**30, 0, 0])


CASES = {
    "balanced": (50, [10, 15, 12, 13]),
    "empty groups": (50, [0, 30, 0, 20]),
    "all rows in one group": (40, [0, 40, 0]),
    "sum < M": (45, [5, 0, 20, 3]),
    "no rows routed": (20, [0, 0, 0]),
    "one row": (1, [0, 1]),
    "sum > M (clipped)": (30, [20, 20]),
}


@pytest.mark.parametrize("name", list(CASES))
def test_triton_matches_lax_ragged_dot(name):
  m, sizes = CASES[name]
  g, k, n = len(sizes), 40, 48
  kx, kw = jax.random.split(jax.random.PRNGKey(0))
  lhs = jax.random.normal(kx, (m, k), jnp.float32)
  rhs = jax.random.normal(kw, (g, k, n), jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)
  total = min(sum(sizes), m)
  if total < m:
    lhs = lhs.at[total:].set(jnp.nan)  # must not reach the output
  ref = np.array(ragged_dot_reference(jnp.nan_to_num(lhs), rhs, jnp.minimum(
      gs, jnp.maximum(m - jnp.cumsum(gs) + gs, 0))))
  ref[total:] = 0.0
  out = jax.jit(lambda a, b, s: wt.ragged_dot(a, b, s, config=SMALL))(lhs, rhs, gs)
  np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-4)
  assert np.all(np.asarray(out)[total:] == 0.0)


def test_op_default_is_lax_ragged_dot_off_hopper():
  p_lhs = jax.random.normal(jax.random.PRNGKey(1), (64, 32), jnp.bfloat16)
  p_rhs = jax.random.normal(jax.random.PRNGKey(2), (4, 32, 64), jnp.bfloat16)
  gs = routing.group_sizes(jax.random.PRNGKey(3), 60, 4)
  assert int(gs.sum()) == 60
  with warnings.catch_warnings():  # no GPU (and, for other presets, no table)
    warnings.simplefilter("ignore", UserWarning)
    out = jax.jit(wt.ragged_dot)(p_lhs, p_rhs, gs)
  ref = jax.lax.ragged_dot(p_lhs, p_rhs, gs)
  np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
  # out_dtype and a config as a dict.
  out = wt.ragged_dot(p_lhs, p_rhs, gs, out_dtype=jnp.float32,
                      config={"backend": "triton", "block_m": 16, "block_n": 32,
                              "block_k": 16, "num_warps": 4, "num_stages": 3})
  assert out.dtype == jnp.float32
  np.testing.assert_allclose(np.asarray(out), np.asarray(ragged_dot_reference(
      p_lhs, p_rhs, gs, jnp.float32)), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("args,match", [
    (((8, 4, 2), (2, 4, 8), (2,)), "lhs must have rank 2"),
    (((8, 4), (4, 8), (2,)), "rhs must have rank 3"),
    (((8, 4), (2, 5, 8), (2,)), "contracting dimensions differ"),
    (((8, 4), (2, 4, 8), (3,)), "group_sizes must have shape"),
])
def test_op_rejects_bad_shapes(args, match):
  ls, rs, gs = args
  with pytest.raises(ValueError, match=match):
    wt.ragged_dot(jnp.ones(ls), jnp.ones(rs), jnp.ones(gs, jnp.int32))


def test_op_rejects_bad_dtypes_and_configs():
  lhs, rhs = jnp.ones((8, 4)), jnp.ones((2, 4, 8))
  with pytest.raises(ValueError, match="must be integers"):
    wt.ragged_dot(lhs, rhs, jnp.ones((2,)))
  with pytest.raises(ValueError, match="must be the same"):
    wt.ragged_dot(lhs, rhs.astype(jnp.bfloat16), jnp.ones((2,), jnp.int32))
  with pytest.raises(ValueError, match="out_dtype"):
    wt.ragged_dot(lhs, rhs, jnp.ones((2,), jnp.int32), out_dtype=jnp.int8)
  with pytest.raises(ValueError, match="cannot run here"):
    wt.ragged_dot(jnp.ones((8, 64), jnp.bfloat16), jnp.ones((2, 64, 64), jnp.bfloat16),
                  jnp.ones((2,), jnp.int32), config=wt.MosaicRaggedDotConfig())
  with pytest.raises(ValueError, match="unknown"):
    wt.ragged_dot(lhs, rhs, jnp.ones((2,), jnp.int32), config={"backend": "triton",
                                                               "block_z": 4})
  assert wt.ragged_dot(jnp.ones((0, 4)), rhs, jnp.zeros((2,), jnp.int32)).shape == (0, 8)


def _lower(p, c, options=mosaic_kernel.DEFAULT_OPTIONS):
  shapes = (jax.ShapeDtypeStruct((p.m, p.k), jnp.bfloat16),
            jax.ShapeDtypeStruct((p.g, p.k, p.n), jnp.bfloat16),
            jax.ShapeDtypeStruct((p.g,), jnp.int32))
  f = functools.partial(mosaic_kernel.ragged_dot, config=c, out_dtype=jnp.dtype(p.out_dtype),
                        num_sms=H100.num_sms, options=options)
  return jax.jit(f).trace(*shapes).lower(lowering_platforms=("cuda",))


@pytest.mark.parametrize("m,g,k,n,out", [(2048, 8, 4096, 28672, "bfloat16"),
                                         (1554, 16, 1024, 2048, "float32"),
                                         (5, 64, 2048, 1024, "bfloat16")])
def test_mosaic_configs_lower_for_cuda(m, g, k, n, out):
  p = RaggedDotProblem(m=m, g=g, k=k, n=n, out_dtype=out)
  space = MOSAIC.space(p, H100, prune=False)
  assert space
  for c in space[:: max(1, len(space) // 5)]:
    MOSAIC.validate(p, c, H100)
    _lower(p, c)


@pytest.mark.parametrize("cm,delay,band,tile", [(2, 0, 0, (128, 256)), (2, 1, 3, (64, 256)),
                                                (1, 1, 0, (256, 128)), (1, 0, 8, (128, 128)),
                                                (2, 0, 2, (128, 128))])
def test_mosaic_schedule_options_lower(cm, delay, band, tile):
  # 2-CTA clusters (weight multicast), one wgmma in flight, task bands.
  p = RaggedDotProblem(m=1000, g=8, k=512, n=1024)
  c = wt.MosaicRaggedDotConfig(block_m=tile[0], block_n=tile[1], num_stages=3,
                               grid_minor=0 if band else 1)
  _lower(p, c, mosaic_kernel.MosaicRaggedDotOptions(cluster_m=cm, delay_release=delay,
                                                    task_band=band))


def test_output_staging_by_shared_memory():
  """The whole output tile is staged where it fits next to the ring (every
  config of the sweeps before the 4-stage ring), else 2 slots, else 1."""
  slots = functools.partial(mosaic_kernel.staging_slots, itemsize=2)
  assert slots(block_m=128, block_n=256, num_stages=3, out_itemsize=2) == 0
  assert slots(block_m=128, block_n=256, num_stages=4, out_itemsize=2) == 2
  assert slots(block_m=128, block_n=256, num_stages=4, out_itemsize=4) == 2
  assert slots(block_m=256, block_n=128, num_stages=4, out_itemsize=2) == 1
  assert slots(block_m=64, block_n=256, num_stages=4, out_itemsize=2) == 0
  assert slots(block_m=64, block_n=256, num_stages=5, out_itemsize=2) == 1
  for bm, bn, ns in ((128, 256, 4), (256, 128, 4), (64, 256, 5)):
    auto = mosaic_kernel.smem_bytes(block_m=bm, block_n=bn, num_stages=ns, itemsize=2,
                                    out_itemsize=2)
    whole = mosaic_kernel.smem_bytes(block_m=bm, block_n=bn, num_stages=ns, itemsize=2,
                                     out_itemsize=2, out_slots=0)
    assert auto <= mosaic_kernel.SMEM_LIMIT < whole
  # The 128 x 256 stages of the pruned space: 3 (RG6, the whole tile) for
  # every order, 4 for order 2 (RG8).
  p = RaggedDotProblem(m=24000, g=64, k=2048, n=2048)
  got = {(c.num_stages, c.grid_minor) for c in MOSAIC.space(p, H100)
         if (c.block_m, c.block_n) == (128, 256)}
  assert got == {(3, 0), (3, 1), (3, 2), (4, 2)}
  with pytest.raises(ValueError, match="out_slots"):
    mosaic_kernel.MosaicRaggedDotOptions(out_slots=-2)


@pytest.mark.parametrize("tile,stages,out,slots", [((128, 256), 4, "bfloat16", -1),
                                                   ((256, 128), 4, "bfloat16", -1),
                                                   ((128, 256), 4, "float32", -1),
                                                   ((128, 256), 3, "bfloat16", 1)])
def test_mosaic_sliced_output_staging_lowers(tile, stages, out, slots):
  # 2 slots, 1 slot (by the shared memory left), fp32 slices of 32 columns,
  # 1 slot asked for where the whole tile fits.
  p = RaggedDotProblem(m=1000, g=8, k=512, n=1024, out_dtype=out)
  c = wt.MosaicRaggedDotConfig(block_m=tile[0], block_n=tile[1], num_stages=stages,
                               grid_minor=2)
  MOSAIC.validate(p, c, H100)
  _lower(p, c, mosaic_kernel.MosaicRaggedDotOptions(out_slots=slots))


@pytest.mark.parametrize("stages", [2, 3])  # 8 K steps: chained pipelines at 2, not at 3
def test_mosaic_order2_lowers(stages):
  p = RaggedDotProblem(m=1000, g=8, k=512, n=1024)
  _lower(p, wt.MosaicRaggedDotConfig(block_m=128, block_n=128, num_stages=stages, grid_minor=2))


@pytest.mark.parametrize("tile,order", [((128, 256), 2), ((256, 128), 1), ((64, 256), 2)])
def test_mosaic_skip_idle_lowers(tile, order):
  # A consumer warpgroup with no valid row in its half of a task skips its
  # wgmmas (a 64-row tile splits columns instead: nothing to skip).
  p = RaggedDotProblem(m=1000, g=8, k=512, n=1024)
  c = wt.MosaicRaggedDotConfig(block_m=tile[0], block_n=tile[1], num_stages=2, grid_minor=order)
  _lower(p, c, mosaic_kernel.MosaicRaggedDotOptions(skip_idle=1))


def test_mosaic_schedule_options_errors():
  o = mosaic_kernel.MosaicRaggedDotOptions
  for bad in (dict(cluster_m=3), dict(delay_release=2), dict(task_band=-1),
              dict(cluster_m=True), dict(skip_idle=2), dict(skip_idle=1, delay_release=1)):
    with pytest.raises(ValueError, match="MosaicRaggedDotOptions"):
      o(**bad)
  p = RaggedDotProblem(m=64, g=2, k=128, n=128)
  with pytest.raises(ValueError, match="task_band=4 needs config.grid_minor=0"):
    _lower(p, wt.MosaicRaggedDotConfig(grid_minor=1), o(task_band=4))
  with pytest.raises(ValueError, match="num_stages >= 3"):
    _lower(p, wt.MosaicRaggedDotConfig(num_stages=2), o(delay_release=1))
  with pytest.raises(ValueError, match="options must be"):
    _lower(p, wt.MosaicRaggedDotConfig(), {"cluster_m": 2})


def test_mosaic_every_tile_lowers():
  p = RaggedDotProblem(m=1000, g=8, k=512, n=1024)
  for bm, bn in TILES:
    c = wt.MosaicRaggedDotConfig(block_m=bm, block_n=bn, num_stages=2)
    MOSAIC.validate(p, c, H100)
    _lower(p, c)


def test_mosaic_space_and_heuristic_rules():
  mixtral = dict(g=8, k=4096, n=28672)
  for m in (2, 32, 2048, 16384):
    p = RaggedDotProblem(m=m, **mixtral)
    for c in MOSAIC.space(p, H100):
      assert MOSAIC.smem_bytes(p, c) <= H100.smem_per_block
      assert c.block_m <= max(64, 1 << (max(1, -(-m // 8)) - 1).bit_length())
  # Decode with every one of 8 experts busy: XLA; one token: Mosaic (reads
  # 2 of 8 experts); prefill: big tiles; many experts: Mosaic.
  assert isinstance(RAGGED_DOT.heuristic(RaggedDotProblem(m=64, **mixtral), H100),
                    wt.XlaRaggedDotConfig)
  assert isinstance(RAGGED_DOT.heuristic(RaggedDotProblem(m=2, **mixtral), H100),
                    wt.MosaicRaggedDotConfig)
  big = RAGGED_DOT.heuristic(RaggedDotProblem(m=2048, **mixtral), H100)
  assert (big.block_m, big.block_n, big.grid_minor) == (128, 256, 2)  # by expert
  # The deeper ring (the output staged a slice at a time) on the H100 only.
  assert big.num_stages == 4 and big in MOSAIC.space(RaggedDotProblem(m=2048, **mixtral), H100)
  h200 = RAGGED_DOT.heuristic(RaggedDotProblem(m=2048, **mixtral), get_hardware("h200"))
  assert (h200.block_m, h200.block_n, h200.num_stages, h200.grid_minor) == (128, 256, 3, 2)
  pcie = dataclasses.replace(H100, name="NVIDIA H100 PCIe", device_key="nvidia_h100_pcie")
  assert RAGGED_DOT.heuristic(RaggedDotProblem(m=2048, **mixtral), pcie).num_stages == 3
  # A float32 output sizes the ring with its whole tile, as before (2 stages).
  f32 = RaggedDotProblem(m=2048, out_dtype="float32", **mixtral)
  for hw in (H100, get_hardware("h200")):
    c = RAGGED_DOT.heuristic(f32, hw)
    assert (c.block_m, c.block_n, c.num_stages) == (128, 256, 2), (hw.name, c)
    assert c in MOSAIC.space(f32, hw)
  mid = RAGGED_DOT.heuristic(RaggedDotProblem(m=512, **mixtral), H100)  # 64 rows per expert
  assert (mid.block_m, mid.block_n, mid.grid_minor) == (64, 128, 0)
  # ... column tiles first where the weight has only 16 of them (OLMoE).
  olmoe = RAGGED_DOT.heuristic(RaggedDotProblem(m=4096, g=64, k=2048, n=2048), H100)
  assert (olmoe.block_m, olmoe.block_n, olmoe.grid_minor) == (64, 128, 1)
  # 65-128 rows per expert: 64-row tasks walked by expert, on both GPUs
  # (within 5% of the sweeps' best on 17 / 18 of 18 problems at 96-128 rows,
  # H200 / H100); from 129 rows, 128-row tasks.
  for hw in (H100, get_hardware("h200")):
    for m, g, k, n in ((1554, 16, 4096, 12800), (8192, 64, 1024, 2048), (1024, 8, 14336, 4096)):
      p = RaggedDotProblem(m=m, g=g, k=k, n=n)
      c = RAGGED_DOT.heuristic(p, hw)
      assert (c.block_m, c.block_n, c.num_stages, c.grid_minor) == (64, 256, 4, 2), (hw.name, c)
      assert c in MOSAIC.space(p, hw)
    c = RAGGED_DOT.heuristic(RaggedDotProblem(m=1040, g=8, k=14336, n=4096), hw)  # 130 rows
    # (On the H200 one 192-row task an expert, where 128-row tiles take two.)
    want = (192, 128, 2) if hw.device_key == "nvidia_h200" else (128, 256, 2)
    assert (c.block_m, c.block_n, c.grid_minor) == want
  arctic = RaggedDotProblem(m=128, g=128, k=4864, n=7168)
  assert isinstance(RAGGED_DOT.heuristic(arctic, H100), wt.MosaicRaggedDotConfig)
  # Off Hopper, and for shapes the kernel does not run: XLA.
  assert isinstance(RAGGED_DOT.heuristic(RaggedDotProblem(m=2048, **mixtral),
                                         get_hardware("a100")), wt.XlaRaggedDotConfig)
  assert isinstance(RAGGED_DOT.heuristic(RaggedDotProblem(m=2048, g=8, k=100, n=256), H100),
                    wt.XlaRaggedDotConfig)
  g, l = RAGGED_DOT.coords(RaggedDotProblem(m=2048, **mixtral), big)
  # 256 rows per expert, starting 4 rows past an aligned row on average: 3 tasks.
  assert g == 8 * 3 * 112 and l == 64


def _walk(tasks, count, tiles_n, band_cap):
  """The kernel's map of work items to (task, column tile) under order 2
  (``worklist.banded_item``, which the kernel calls), over every item."""
  t = np.asarray(tasks)
  assert np.all((t[worklist.BANDW] >= 1) & (t[worklist.BANDW] <= band_cap))
  rest = jnp.arange(count * tiles_n, dtype=jnp.int32)
  task, ni = worklist.banded_item(rest, tiles_n, jnp.asarray(t))
  return list(zip(np.asarray(task).tolist(), np.asarray(ni).tolist()))


@pytest.mark.parametrize("sizes,m,block_m,cap", [
    ([375] * 4, 1500, 128, 8),                     # 3 tasks per expert, one band each
    ([0, 300, 0, 250, 0, 450, 0, 0], 1000, 64, 3),  # empty experts, bands of at most 3
    ([2048] * 2 + [7], 4200, 128, 6),               # 16 tasks: bands of 6, 6, 4
    ([100, 7, 0, 93, 200, 1, 0, 300], 1000, 128, 2),  # a tail past the sizes
    ([0] * 5, 40, 64, 4),                           # only the tail
])
def test_order2_bands_cover_every_work_item_once(sizes, m, block_m, cap):
  # Order 2 walks each expert's tasks in bands: every (task, column tile)
  # is one work item, a band holds tasks of one group only, and no band is
  # wider than the cap; a group's bands share one width but the last.
  tiles_n = 3
  tasks, count = worklist.row_tasks(jnp.asarray(sizes, jnp.int32), m, block_m, band_cap=cap)
  count = int(count[0])
  items = _walk(tasks, count, tiles_n, cap)
  assert sorted(items) == [(t, n) for t in range(count) for n in range(tiles_n)]
  t = np.asarray(tasks)
  grp = t[worklist.GROUP]
  for b0 in set(t[worklist.BAND0, :count].tolist()):
    bw = t[worklist.BANDW, b0]
    assert len(set(grp[b0:b0 + bw].tolist())) == 1
  for g in set(grp[:count].tolist()):
    starts = sorted({int(t[worklist.BAND0, i]) for i in range(count) if grp[i] == g})
    widths = [int(t[worklist.BANDW, b]) for b in starts]
    assert len(set(widths[:-1])) <= 1 and widths[-1] <= widths[0]
    n_g = int((grp[:count] == g).sum())
    assert len(starts) == -(-n_g // cap)
  # The four rows of the plain work list are unchanged.
  plain, c2 = worklist.row_tasks(jnp.asarray(sizes, jnp.int32), m, block_m)
  assert int(c2[0]) == count
  np.testing.assert_array_equal(np.asarray(plain), t[:4])


def test_order2_band_cap_and_pipelining():
  # Bands hold at most BAND_BYTES of rows; order 2 pipelines work items
  # where the K steps are a multiple of the stages.
  assert mosaic_kernel.band_cap(128, 4096, 2) == mosaic_kernel.BAND_BYTES // (128 * 4096 * 2)
  assert mosaic_kernel.band_cap(256, 1 << 20, 2) == 1
  o = mosaic_kernel.DEFAULT_OPTIONS
  c2 = wt.MosaicRaggedDotConfig(block_m=128, block_n=256, num_stages=3, grid_minor=2)
  assert mosaic_kernel._pipelined(c2, o, 45) and not mosaic_kernel._pipelined(c2, o, 56)
  c1 = wt.MosaicRaggedDotConfig(block_m=128, block_n=256, num_stages=3, grid_minor=1)
  assert not mosaic_kernel._pipelined(c1, o, 45)
  with pytest.raises(ValueError, match="grid_minor=3 must be one of"):
    wt.MosaicRaggedDotConfig(grid_minor=3)


def test_suite_and_routing():
  probs = RAGGED_DOT.problems_from_suite(load_suite("train"))
  assert len(probs) == 216
  assert len({RAGGED_DOT.problem_key(p) for p in probs}) == 216
  assert {p.g for p in probs} == {8, 16, 64, 128}
  key = jax.random.PRNGKey(0)
  bal = np.asarray(routing.group_sizes(key, 4096, 64, routing.BALANCED))
  skew = np.asarray(routing.group_sizes(key, 4096, 64, routing.SKEWED))
  assert bal.sum() == skew.sum() == 4096
  assert skew.max() > 2 * bal.max()
  lhs, rhs, gs = RAGGED_DOT.with_routing(routing.SKEWED).inputs(
      RaggedDotProblem(m=64, g=4, k=32, n=64), key)
  assert lhs.shape == (64, 32) and rhs.shape == (4, 32, 64) and int(gs.sum()) == 64


def test_moe_mlp_example_runs_on_cpu(capsys):
  import importlib.util
  import pathlib
  path = pathlib.Path(__file__).parent.parent / "examples" / "moe_mlp.py"
  spec = importlib.util.spec_from_file_location("moe_mlp", path)
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  mod.main(["--small"])  # the pinned Triton kernel against lax.ragged_dot; raises if they differ
  assert "tokens=16" in capsys.readouterr().out


def test_work_list_never_overflows():
  """Sizes near 2**31 (or negative) give the clipped groups, not an int32
  wrap-around that would leave rows unwritten or write before row 0."""
  for sizes, m in [([40, 2**31 - 1, 3], 40), ([2**31 - 1, 2**31 - 1, 0], 40),
                   ([10, -5, 20], 50)]:
    tasks, count = row_tasks(jnp.asarray(sizes, jnp.int32), m, 16)
    tasks, c = np.asarray(tasks), int(count[0])
    owner = np.full(m, -1)
    for grp, row0, start, size in tasks[:, :c].T:
      assert row0 >= 0
      owner[row0 + start:row0 + start + size] = grp
    np.testing.assert_array_equal(owner, _owner(sizes, m))


def test_recorded_h100_numbers_are_reproduced(capsys):
  """docs/results.md's grouped-GEMM numbers come from the committed rows."""
  import importlib.util
  import pathlib
  root = pathlib.Path(__file__).parent.parent
  spec = importlib.util.spec_from_file_location("rdm", root / "benchmarks" / "ragged_dot_mosaic.py")
  mod = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(mod)
  out = mod.summarize(str(root / "data" / "probes" / "ragged_dot_mosaic_h100.json"))
  big = [v for (w, t), v in out["speedup"].items() if t >= 1024]
  assert len(big) == 6 and min(big) == pytest.approx(4.47, abs=0.01)
  assert np.exp(np.mean(np.log(big))) == pytest.approx(8.48, abs=0.01)
  # The rule's configs from 64 rows per expert use order 2, which this run
  # (recorded before it existed) did not time: only the smaller ones count.
  hb = list(out["heuristic_of_best"].values())
  assert len(hb) == 4 and sum(v >= 0.95 for v in hb) == 4
  assert min(hb) == pytest.approx(0.97, abs=0.01)
  assert min(out["heuristic_vs_xla"].values()) >= 0.999


def _load_benchmark(name):
  from bench_module import load_benchmark
  return load_benchmark(name)


def _table_vs_sweep(capsys, gpu: str, *flags: str) -> str:
  """``table_vs_sweep.py`` on ``gpu``'s grouped-GEMM sweep and table on
  record; what it printed."""
  import pathlib
  root = pathlib.Path(__file__).parent.parent
  capsys.readouterr()
  with warnings.catch_warnings():
    warnings.simplefilter("ignore", UserWarning)
    _load_benchmark("table_vs_sweep").main([
        str(root / f"data/sweeps/{gpu}/ragged_dot_bfloat16.jsonl.gz"),
        str(root / f"tables/{gpu}/ragged_dot.json"), *flags])
  return capsys.readouterr().out


def test_tokamax_benchmark_without_tokamax_and_kernel_renames(monkeypatch, capsys):
  import sys
  mod = _load_benchmark("ragged_dot_tokamax")
  monkeypatch.setitem(sys.modules, "tokamax", None)  # not importable
  assert mod.main(["--quick"]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert len(err) == 1 and "tokamax is not importable" in err[0]
  # tokamax's plgpu.kernel(out_shape=, scratch_shapes=) reaches a JAX that
  # names them out_type=, scratch_types= under those names.
  from jax.experimental.pallas import mosaic_gpu as plgpu
  seen = {}

  def new_kernel(body, *, out_type, scratch_types=(), grid=()):
    seen.update(out_type=out_type, scratch_types=scratch_types, grid=grid)

  monkeypatch.setattr(plgpu, "kernel", new_kernel)
  for name in ("untile_ref", "unswizzle_ref"):   # (gone after the test either way)
    monkeypatch.setattr(plgpu, name, None, raising=False)
    monkeypatch.delattr(plgpu, name)
  assert mod.jax_compat() and not mod.jax_compat()  # once
  plgpu.kernel(None, out_shape="o", scratch_shapes="s", grid=(2,))
  assert seen == {"out_type": "o", "scratch_types": "s", "grid": (2,)}

  def old_kernel(body, *, out_shape, scratch_shapes=()):
    pass

  monkeypatch.setattr(plgpu, "kernel", old_kernel)
  assert not mod.jax_compat() and plgpu.kernel is old_kernel
  # plgpu.untile_ref / unswizzle_ref, which tokamax's quantized kernel calls,
  # are back as the transforms they applied
  from jax._src.pallas.mosaic_gpu import core as mgpu_core
  applied = []
  monkeypatch.setattr(plgpu, "transform_ref", lambda ref, t: applied.append((ref, t)))
  plgpu.untile_ref("r", (8, 64))
  plgpu.unswizzle_ref("r", 128)
  assert applied == [("r", mgpu_core.UntilingTransform((8, 64))),
                     ("r", mgpu_core.UnswizzleRef(128))]


def test_tokamax_benchmark_int8_weights_as_tokamax_takes_them():
  # --weights int8: the weight-only problem, and the qwix.QArray tokamax reads
  # (values [G, K, N], a bf16 scale per expert and output channel); tokamax
  # itself is not installed here (the CI), so its call is not run.
  pytest.importorskip("qwix")
  from wavetune_jax import QRAGGED_DOT
  mod = _load_benchmark("ragged_dot_tokamax")
  p = mod.problem({}, "mixtral_8x7b.w1", 64, "int8")
  assert (p.m, p.g, p.k, p.n, p.dtype, p.w_dtype) == (128, 8, 4096, 14336, "bfloat16", "int8")
  small = mod.problem({"w": {"E": 3, "top_k": 2, "K": 256, "N": 128}}, "w", 5, "int8")
  x, w, s, gs = QRAGGED_DOT.inputs(small, jax.random.PRNGKey(0))
  q = mod.tokamax_qarray(w, s)
  assert q.qvalue is w and q.scale.shape == (3, 1, 128) and q.scale.dtype == jnp.bfloat16
  deq = q.qvalue.astype(jnp.float32) * q.scale.astype(jnp.float32)
  np.testing.assert_allclose(deq, w.astype(jnp.float32) * s[:, None, :], rtol=4e-3)


@pytest.mark.parametrize("sizes", [(5, 0, 17, 9), (0, 31, 0, 0), (3, 4, 0, 2), (10, 10, 10, 10)])
def test_blocked_reference_equals_lax_ragged_dot(sizes):
  """The row-block loop the reference takes for problems too big for XLA's
  ragged dot (31 rows, blocks of 8: windows that end at the array's edge;
  empty experts, one expert, sum below and above M)."""
  kx, kw = jax.random.split(jax.random.PRNGKey(4))
  lhs = jax.random.normal(kx, (31, 24), jnp.float32)
  rhs = jax.random.normal(kw, (4, 24, 16), jnp.float32)
  gs = jnp.asarray(sizes, jnp.int32)
  want = np.asarray(jax.lax.ragged_dot(lhs, rhs, gs, precision=jax.lax.Precision.HIGHEST))
  got = np.asarray(jax.jit(functools.partial(ragged_dot_reference, block_rows=8))(lhs, rhs, gs))
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert np.all(got[min(sum(sizes), 31):] == 0.0)


def test_blocked_reference_with_a_size_near_int32s_limit():
  lhs = jax.random.normal(jax.random.PRNGKey(5), (31, 5), jnp.float32)
  rhs = jax.random.normal(jax.random.PRNGKey(6), (3, 5, 3), jnp.float32)
  gs = jnp.asarray([10, 2**31 - 5, 10], jnp.int32)  # all rows past 10 in expert 1
  got = ragged_dot_reference(lhs, rhs, gs, block_rows=8)
  want = np.concatenate([np.asarray(lhs[:10] @ rhs[0]), np.asarray(lhs[10:] @ rhs[1])])
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("gpu,lines", [
    ("nvidia_h100_80gb_hbm3", ("at >= 1024 tokens: 13.48x over 82 problems (min 2.80x)",
                               "mixtral_8x7b: 3.16x over 36; >= 1024 tokens 6.67x over 16 (min 5.05x)")),
    ("nvidia_h200", ("at >= 1024 tokens: 13.98x over 79 problems (min 3.68x)",
                     "mixtral_8x7b: 3.41x over 36; >= 1024 tokens 6.94x over 16 (min 5.02x)")),
])
def test_table_vs_sweep_per_model_reproduces_the_docs(capsys, gpu, lines):
  """docs/results.md's grouped-GEMM speeds per model and GPU come from this
  command on the sweeps and tables on record (both with order-2 rows)."""
  out = _table_vs_sweep(capsys, gpu, "--min-tokens", "1024")
  for line in lines:
    assert line in out


def test_triple_tiles_rule():
  """192-row tiles (three consumer warpgroups): on the H200 where a balanced
  router's experts fit one task of them and 128-row tiles need two; never
  at a mean of exactly 192 rows (half the experts spill), off the H200, or
  with a float32 output (the whole tile does not fit next to the ring)."""
  h200 = get_hardware("h200")
  shape = dict(g=128, k=2048, n=1536)  # 128 experts, K 2,048, N 1,536
  c = RAGGED_DOT.heuristic(RaggedDotProblem(m=128 * 160, **shape), h200)
  assert (c.block_m, c.block_n, c.num_stages, c.grid_minor) == (192, 192, 3, 2)
  assert MOSAIC.smem_bytes(RaggedDotProblem(m=128 * 160, **shape), c) <= h200.smem_per_block
  for m, hw in ((128 * 192, h200), (128 * 160, H100)):
    c = RAGGED_DOT.heuristic(RaggedDotProblem(m=m, **shape), hw)
    assert (c.block_m, c.block_n) == (128, 256), (m, hw.name)
  c = RAGGED_DOT.heuristic(RaggedDotProblem(m=128 * 160, out_dtype="float32", **shape), h200)
  assert c.block_m == 128
  # N not a multiple of 192: 192 x 128 where it leaves fewer waves.
  c = RAGGED_DOT.heuristic(RaggedDotProblem(m=8 * 160, g=8, k=4096, n=28672), h200)
  assert (c.block_m, c.block_n, c.num_stages) == (192, 128, 4)
  # On the models outside the suites (benchmarks/unseen_models.py) it
  # moves four picks on the H200: Qwen1.5-MoE's w13 and w2 at 2,000 tokens
  # and Granite-3.0-3B-A800M's w13 and w2 at 700.
  for m, g, k, n, bn in ((8000, 60, 2048, 2816, 192), (8000, 60, 1408, 2048, 128),
                         (5600, 40, 1536, 1024, 192), (5600, 40, 512, 1536, 128)):
    c = RAGGED_DOT.heuristic(RaggedDotProblem(m=m, g=g, k=k, n=n), h200)
    assert (c.block_m, c.block_n) == (192, bn), (m, g, k, n)
  # Not where 192-row tiles take two tasks an expert too (Mixtral's w2 at
  # 360 rows, 16 experts at 240), nor at a mean of exactly 192 rows (above);
  # one expert of 190 rows fits one task exactly.
  for m, g, k, n in ((8 * 360, 8, 14336, 4096), (16 * 240, 16, 4096, 1024)):
    assert RAGGED_DOT.heuristic(RaggedDotProblem(m=m, g=g, k=k, n=n), h200).block_m != 192
  assert RAGGED_DOT.heuristic(RaggedDotProblem(m=190, g=1, k=4096, n=4096), h200).block_m == 192
  assert routing.expected_tasks_spread(190, 1, 192) == 1
  assert routing.expected_tasks_spread(256, 1, 128) == 2
  # The exact device key: an H200 NVL, never measured, keeps 128 x 256.
  nvl = dataclasses.replace(h200, name="NVIDIA H200 NVL", device_key="nvidia_h200_nvl")
  assert RAGGED_DOT.heuristic(RaggedDotProblem(m=128 * 160, **shape), nvl).block_m == 128
  # The sweeps' problems never fall in the band, so their tables' scores
  # do not move.
  for m in (16, 64, 256, 1024, 4096):
    c = RAGGED_DOT.heuristic(RaggedDotProblem(m=m * 2, g=8, k=4096, n=28672), h200)
    assert getattr(c, "block_m", 0) != 192
  # The family takes the tiles as explicit configs too, and rejects others.
  p = RaggedDotProblem(m=4096, **shape)
  MOSAIC.validate(p, wt.MosaicRaggedDotConfig(block_m=192, block_n=192, num_stages=3), h200)
  with pytest.raises(ValueError, match="needs block_n in"):
    wt.MosaicRaggedDotConfig(block_m=192, block_n=256)


def test_triple_limits_from_the_balanced_router_runs(monkeypatch):
  """The 192-row tiles' limits (TRIPLE_SPILL 0.3, TRIPLE_MARGIN 1.05) against
  the H200 runs under a balanced router (docs/results.md, "The 192-row tiles
  under a balanced router"): the rule takes them on 11 of the 12 problems
  where they beat 128 x 256 (not on 8 experts at 176 rows: fewer than 16
  experts keep the spill limit of 0.1, from the four-layer Mixtral-8x7B
  prefill) and on none of the 9 where they did not; the limits before
  (0.1, 1.15) took none of the 21."""
  import math
  from wavetune_jax.families.ragged_dot import mosaic as mosaic_backend
  h200 = get_hardware("h200")
  rows = []
  for name in ("r192", "edge192", "edge192_more"):
    rows += json.loads((pathlib.Path(__file__).parent.parent / "data" / "probes" / f"{name}_balanced_h200.json").read_text())["rows"]
  assert len(rows) == 21
  base_lab = "mosaic 128x256 s3 k1 o2 cl1 d0 b0 p0"
  tall = {192: "mosaic 192x192 s3 k1 o2 cl1 d0 b0 p0 r1",
          128: "mosaic 192x128 s4 k1 o2 cl1 d0 b0 p0 r1"}

  def work(p, bm, bn):
    items = routing.expected_tasks_spread(p.m, p.g, bm) * -(-p.n // bn)
    return math.ceil(items / h200.num_sms) * bm * bn

  won, lost, gains, ratios_won, ratios_lost, few_kept = 0, [], [], [], [], None
  for r in rows:
    t = {k: v["us"] for k, v in r["times"].items() if v["status"] == "ok"}
    p = RaggedDotProblem(m=r["g"] * r["r"], g=r["g"], k=r["k"], n=r["n"])
    best = t[base_lab] / min(t[lab] for lab in tall.values())
    ratio = work(p, 128, 256) / min(work(p, 192, bn) for bn in tall)
    c = RAGGED_DOT.heuristic(p, h200)
    with monkeypatch.context() as mp:  # the limits before
      mp.setattr(mosaic_backend, "TRIPLE_SPILL", 0.1)
      mp.setattr(mosaic_backend, "TRIPLE_MARGIN", 1.15)
      assert RAGGED_DOT.heuristic(p, h200).block_m == 128
    if best > 1.02:
      won += 1
      ratios_won.append(ratio)
      if p.g < mosaic_backend.TRIPLE_MANY and r["r"] > 172:
        assert (c.block_m, c.block_n) == (128, 256)
        few_kept = (r["g"], r["r"], round(best, 3))
        continue
      assert c.block_m == 192, (r["g"], r["r"], r["k"], r["n"])
      gains.append(t[base_lab] / t[tall[c.block_n]])
    else:
      lost.append(best)
      ratios_lost.append(ratio)
      assert (c.block_m, c.block_n) == (128, 256), (r["g"], r["r"], r["k"], r["n"])
  geo = math.exp(sum(map(math.log, gains)) / len(gains))
  assert won == 12 and len(gains) == 11 and len(lost) == 9 and few_kept == (8, 176, 1.061)
  assert (round(min(gains), 3), round(max(gains), 3), round(geo, 3)) == (1.020, 1.167, 1.111)
  assert (round(min(lost), 3), round(max(lost), 3)) == (0.736, 1.014)
  assert (round(min(ratios_won), 3), round(max(ratios_won), 3)) == (1.067, 1.231)
  assert (round(min(ratios_lost), 3), round(max(ratios_lost), 3)) == (0.667, 0.978)
  assert sum(x < 1.15 for x in ratios_won) == 9  # the margin before left these out


def test_triple_before_after_in_the_decoders():
  """``benchmarks/model_before_after.py`` on an H200 (docs/results.md): the
  four-layer Mixtral-8x7B prefill of 700 tokens (175 rows per expert) ran
  its grouped GEMMs 0.985x with 192 x 128 tiles on w13 (the kernels' CUPTI
  sums; the reason fewer than 16 experts keep the 0.1 spill limit), and
  gpt-oss-20b's prefill of 1,400 tokens (32 experts, 175 rows) 1.019x."""
  import statistics
  root = pathlib.Path(__file__).parent.parent / "data" / "e2e"

  def grouped(side):
    out = []
    for f in sorted((root / "triple_before_after_mixtral_runs_h200").glob(f"{side}_*.json")):
      for row in json.loads(f.read_text())["rows"]:
        if row["setting"] == "tables" and row["kind"] == "prefill":
          out.append(sum(us for name, us in row["kernels"] if "mosaic_gpu_kernel" in name))
    return out

  before, now = grouped("before"), grouped("now")
  assert len(before) == len(now) == 2
  assert round(statistics.mean(before) / statistics.mean(now), 3) == 0.985
  rows = json.loads((root / "triple_before_after_gpt_oss_20b_h200.json").read_text())["rows"]
  (pre,) = [r for r in rows if r["setting"] == "tables" and r["kind"] == "prefill"]
  assert round(pre["now_over_before"], 3) == 1.019 and max(pre["now_runs"]) < min(pre["before_runs"])
  # Under the rule now both models' grouped GEMMs at those sizes: Mixtral's
  # back on 128 x 256, gpt-oss-20b's on 192 x 128.
  h200 = get_hardware("h200")
  for m, g, k, n, bm in ((1400, 8, 4096, 28672, 128), (5600, 32, 2880, 5760, 192),
                         (5600, 32, 2880, 2880, 192)):
    assert RAGGED_DOT.heuristic(RaggedDotProblem(m=m, g=g, k=k, n=n), h200).block_m == bm


@pytest.mark.parametrize("args,match", [
    (["--problems", "128,192,2048"], "G,r,K,N of positive ints"),
    (["--problems", "128,192,2048,1536", "--only", "0"], "drop --only"),
    (["--router", "skewed"], "invalid choice"),
    (["--only", "9"], "--only takes indices 0-5"),
    (["--only", "x"], "--only takes indices")])
def test_efficiency_benchmark_bad_arguments(args, match, capsys, monkeypatch):
  """``benchmarks/ragged_dot_efficiency.py``'s bad arguments: one line, before
  any GPU work; its summary reads the balanced-router runs."""
  mod = _load_benchmark("ragged_dot_efficiency")
  monkeypatch.setattr("sys.argv", ["ragged_dot_efficiency.py", *args])
  with pytest.raises(SystemExit):
    mod.main()
  err = capsys.readouterr().err
  assert match in err and "Traceback" not in err
  root = pathlib.Path(__file__).parent.parent / "data" / "probes"
  out = mod.summarize(str(root / "edge192_balanced_h200.json"))
  assert out[(64, 176, 2048, 2816)]["192_over_rest"] == pytest.approx(285.0 / 244.2, abs=1e-3)


def test_expected_tasks_spread_matches_a_simulated_router():
  """The balanced router's expected tasks with its spread, against the
  mean of ``ceil((s + 4) / block_m)`` over simulated multinomial sizes."""
  rng = np.random.default_rng(0)
  for m, g, bm in ((24576, 128, 192), (20480, 128, 192), (20480, 128, 128), (1040, 8, 128),
                   (4096, 64, 64)):
    sizes = rng.multinomial(m, np.full(g, 1 / g), size=400)
    sim = np.ceil((sizes + 4) / bm).sum(axis=1).mean()
    est = routing.expected_tasks_spread(m, g, bm)
    assert est == pytest.approx(sim, rel=0.02), (m, g, bm, est, sim)
  # At a mean of exactly 192 rows, half the experts spill into a second task.
  assert routing.expected_tasks_spread(128 * 192, 128, 192) == pytest.approx(128 * 1.6, rel=0.1)


@pytest.mark.parametrize("m,g,k,n,config,options", [
    (24576, 128, 2048, 1536, dict(block_m=192, block_n=192, num_stages=3, grid_minor=2), {}),
    (1554, 8, 256, 512, dict(block_m=192, block_n=128, num_stages=4, split_k=2), {}),
    (5, 8, 256, 512, dict(block_m=192, block_n=192, num_stages=3, grid_minor=1), {}),
    (8192, 64, 1024, 2048, dict(block_m=128, block_n=256, num_stages=3, grid_minor=2),
     dict(item_ring=1)),
    (8192, 64, 1024, 2048, dict(block_m=128, block_n=128, num_stages=5, grid_minor=2),
     dict(pingpong=1)),
    (1554, 8, 256, 512, dict(block_m=64, block_n=256, num_stages=4, split_k=2, grid_minor=0),
     dict(pingpong=1)),
    (5, 8, 256, 512, dict(block_m=64, block_n=128, num_stages=3, grid_minor=1),
     dict(pingpong=1)),
    (8192, 64, 1024, 2048, dict(block_m=128, block_n=256, num_stages=4, grid_minor=2),
     dict(item_ring=1, delay_release=1)),
    (24576, 128, 2048, 1536, dict(block_m=192, block_n=192, num_stages=4, grid_minor=2), {}),
    (24576, 128, 2048, 1536, dict(block_m=192, block_n=128, num_stages=5, grid_minor=2), {}),
    (1000, 8, 256, 512, dict(block_m=64, block_n=256, num_stages=4, grid_minor=2),
     dict(item_ring=1, delay_release=1)),
])
def test_ring_and_triple_tiles_lower_for_cuda(m, g, k, n, config, options):
  """The kernel's own ring (``item_ring``) and the 192-row tiles lower to
  Mosaic GPU on a CPU (their results are checked on a GPU:
  benchmarks/ragged_dot_mosaic.py --check --check-item-ring)."""
  c = mosaic_kernel.MosaicRaggedDotConfig(**config)
  o = mosaic_kernel.MosaicRaggedDotOptions(**options)
  f = lambda a, b, s: mosaic_kernel.ragged_dot(a, b, s, config=c, options=o,  # noqa: E731
                                               num_sms=132)
  args = (jax.ShapeDtypeStruct((m, k), jnp.bfloat16), jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16),
          jax.ShapeDtypeStruct((g,), jnp.int32))
  jax.jit(f).trace(*args).lower(lowering_platforms=("cuda",))


def test_ring_options_are_checked():
  with pytest.raises(ValueError, match="item_ring=1 needs cluster_m=1"):
    mosaic_kernel.MosaicRaggedDotOptions(item_ring=1, skip_idle=1)
  # The ring keeps one wgmma in flight under delay_release.
  assert mosaic_kernel.MosaicRaggedDotOptions(item_ring=1, delay_release=1).delay_release == 1
  with pytest.raises(ValueError, match="pingpong=1 .on the kernel's ring. needs cluster_m=1"):
    mosaic_kernel.MosaicRaggedDotOptions(pingpong=1, cluster_m=2)
  with pytest.raises(ValueError, match="pingpong=.* must be 0 or 1"):
    mosaic_kernel.MosaicRaggedDotOptions(pingpong=3)
  assert mosaic_kernel.MosaicRaggedDotOptions(pingpong=1).ring
  assert not mosaic_kernel.MosaicRaggedDotOptions().ring
  x0, w0, g0 = jnp.zeros((64, 64), jnp.bfloat16), jnp.zeros((2, 64, 256), jnp.bfloat16), \
      jnp.ones((2,), jnp.int32)
  for bm, bn, ns in ((128, 256, 3), (192, 128, 3), (256, 64, 3), (128, 128, 2)):
    with pytest.raises(ValueError, match="pingpong=1 runs a whole tile per consumer"):
      mosaic_kernel.ragged_dot(
          x0, w0, g0, num_sms=132, options=mosaic_kernel.MosaicRaggedDotOptions(pingpong=1),
          config=mosaic_kernel.MosaicRaggedDotConfig(block_m=bm, block_n=bn, num_stages=ns))
  # Each warpgroup stages its whole tile.
  assert mosaic_kernel.out_staging(128, 128, 2, 0, pingpong=True) == \
      2 * mosaic_kernel.out_staging(128, 128, 2, 0)
  with pytest.raises(ValueError, match="item_ring=.* must be 0 or 1"):
    mosaic_kernel.MosaicRaggedDotOptions(item_ring=2)
  c = mosaic_kernel.MosaicRaggedDotConfig(block_m=192, block_n=192, num_stages=3, grid_minor=2)
  x, w, gs = jnp.zeros((64, 64), jnp.bfloat16), jnp.zeros((2, 64, 64), jnp.bfloat16), \
      jnp.ones((2,), jnp.int32)
  with pytest.raises(ValueError, match="block_m=192 runs on the kernel's own ring"):
    mosaic_kernel.ragged_dot(x, w, gs, config=c, num_sms=132,
                             options=mosaic_kernel.MosaicRaggedDotOptions(cluster_m=2))


def test_ring_and_triple_runs_on_record_reproduce_the_docs(capsys):
  """docs/results.md's numbers of the ring through the items and the 192-row
  tiles: ``ragged_dot_efficiency.py --mode ring --summarize`` on the H200 runs."""
  import pathlib
  root = pathlib.Path(__file__).parent.parent / "data" / "probes"
  mod = _load_benchmark("ragged_dot_efficiency")
  ring = mod.summarize(str(root / "ragged_dot_item_ring_h200.json"))
  pairs, chained = ring.pop("ring_pairs"), ring.pop("ring_pairs_chained")
  assert len(ring) == 11 and len(pairs) == 40
  assert mod._geo(pairs) == pytest.approx(1.006, abs=5e-4)
  assert min(pairs) == pytest.approx(0.978, abs=5e-4) and max(pairs) == pytest.approx(1.056,
                                                                                      abs=5e-4)
  assert len(chained) == 23 and mod._geo(chained) == pytest.approx(0.998, abs=5e-4)
  out = capsys.readouterr().out
  assert "it does not chain): 17 pairs, 0.981-1.056x, geomean 1.018x" in out
  triple = mod.summarize(str(root / "ragged_dot_triple_h200.json"))
  triple.pop("ring_pairs")
  triple.pop("ring_pairs_chained")
  first = triple[(128, 192, 2048, 1536)]
  assert first["best_192"] == pytest.approx(0.940, abs=5e-4)
  assert first["wt"] == pytest.approx(0.743, abs=5e-4)
  assert triple[(64, 375, 3584, 5120)]["best_192"] == pytest.approx(0.961, abs=5e-4)
  assert triple[(16, 375, 6400, 4096)]["192_over_rest"] == pytest.approx(0.978, abs=5e-4)
  assert "ring run, 3 problems" in capsys.readouterr().out


def test_pingpong_run_on_record_reproduces_the_docs(capsys):
  """docs/results.md's ping-pong table and pairs (``--mode pingpong
  --summarize`` on the H200 run) and its edge-case check."""
  import pathlib
  root = pathlib.Path(__file__).parent.parent / "data" / "probes"
  mod = _load_benchmark("ragged_dot_efficiency")
  run = mod.summarize(str(root / "ragged_dot_pingpong_h200.json"))
  pairs = run.pop("pingpong_pairs")
  assert len(run) == 8 and len(pairs) == 22
  assert mod._geo(pairs) == pytest.approx(0.995, abs=5e-4)
  assert (round(min(pairs), 3), round(max(pairs), 3)) == (0.972, 1.030)
  table = {(64, 375, 3584, 5120): (724, 0.966, 0.971, 0.956, 0.985),
           (32, 375, 2880, 5760): (740, 0.929, 0.944, 0.941, 0.997),
           (8, 512, 4096, 28672): (779, 0.970, 0.972, 0.947, 0.974),
           (8, 2048, 4096, 28672): (814, 0.978, 0.976, 0.920, 0.943),
           (128, 192, 2048, 1536): (632, 0.756, 0.832, 0.818, 0.983),
           (64, 48, 3584, 5120): (211, 0.953, 0.958, 0.962, 1.004),
           (8, 1024, 14336, 4096): (811, 0.984, 0.987, 0.913, 0.925),
           (16, 256, 6144, 21504): (731, 0.966, 0.965, 0.926, 0.960)}
  for key, (tf, wt_, other, pp, over) in table.items():
    res = run[key]
    assert round(res["batched_tflops"]) == tf, key
    got = tuple(round(res[c], 3) for c in ("wt", "best_other", "best_pingpong",
                                            "pp_over_rest"))
    assert got == (wt_, other, pp, over), key
  assert mod._geo([r["pp_over_rest"] for r in run.values()]) == pytest.approx(0.971, abs=5e-4)
  check = (root / "ragged_dot_pingpong_check_h200.txt").read_text()
  assert check.count("8/8 right") == 6 and "wrong" not in check


def test_delay_cluster_and_sass_runs_on_record_reproduce_the_docs(capsys):
  """docs/results.md's numbers of the ring with a wgmma in flight, the 2-CTA
  clusters in order 2, the 192-row tiles on seven problems, and the warp
  samples of the consumers' loop."""
  import pathlib
  root = pathlib.Path(__file__).parent.parent / "data" / "probes"
  mod = _load_benchmark("ragged_dot_efficiency")
  ring = mod.summarize(str(root / "ragged_dot_ring_delay_h200.json"))
  delays = ring.pop("delay_pairs")
  ring.pop("ring_pairs"), ring.pop("ring_pairs_chained")
  assert len(delays) == 25 and mod._geo(delays) == pytest.approx(0.981, abs=5e-4)
  assert (round(min(delays), 3), round(max(delays), 3)) == (0.954, 1.022)
  table = {(64, 375, 3584, 5120): (750, 0.956, 0.982, 1.008),
           (32, 375, 2880, 5760): (750, 0.948, 0.984, 1.019),
           (8, 512, 4096, 28672): (800, 0.963, 0.877, 0.897),
           (8, 2048, 4096, 28672): (835, 0.972, 0.949, 0.989),
           (128, 192, 2048, 1536): (641, 0.763, 0.944, 1.126),
           (8, 1024, 14336, 4096): (823, 0.989, 0.891, 0.897)}
  for key, (tf, wt_, b192, over) in table.items():
    res = ring[key]
    assert round(res["batched_tflops"]) == tf, key
    assert tuple(round(res[c], 3) for c in ("wt", "best_192", "192_over_rest")) == \
        (wt_, b192, over), key
  clus = mod.summarize(str(root / "ragged_dot_cluster_h200.json"))
  pairs = clus.pop("cluster_pairs")
  assert len(pairs) == 40 and mod._geo(pairs) == pytest.approx(0.935, abs=5e-4)
  with open(root / "ragged_dot_cluster_h200.json") as f:
    rows = __import__("json").load(f)["rows"]
  o2 = []
  for row in rows:
    t = {k: v["us"] for k, v in row["times"].items() if v["status"] == "ok"}
    o2 += [t[k.replace(" cl2 ", " cl1 ")] / us for k, us in t.items()
           if " cl2 " in k and " o2 " in k and k.replace(" cl2 ", " cl1 ") in t]
  assert len(o2) == 32 and mod._geo(o2) == pytest.approx(0.914, abs=5e-4)
  assert (round(min(o2), 3), round(max(o2), 3)) == (0.758, 1.015)
  over = [res["cluster_over_one"] for res in clus.values()]
  assert (round(min(over), 3), round(max(over), 3)) == (0.842, 0.999)
  assert "0.758-1.298x" in capsys.readouterr().out
  check = (root / "ragged_dot_cluster_check_h200.txt").read_text()
  assert check.count("8/8 right") == 6 and "wrong" not in check
  check = (root / "ragged_dot_ring_delay_check_h200.txt").read_text()
  assert check.count("12/12 right") == 5 and "wrong" not in check
  check = (root / "ragged_dot_ring_delay_check_most_empty_h200.txt").read_text()
  assert "64 experts, most empty             12/12 right" in check and "wrong" not in check
  kc = _load_benchmark("kernel_case")
  assert kc.main(["--sass-summary", str(root / "ragged_dot_sass_h200.csv.gz")]) == 0
  out = capsys.readouterr().out
  assert "71 instructions, 24239 samples" in out
  assert "WARPGROUP         2 instructions  16077 samples" in out
  assert "BRA               2 instructions   3581 samples" in out
  assert "HGMMA             4 instructions    785 samples" in out
  assert "outside the step loop: 14876 samples" in out and "samples   8573" in out


def test_deeper_ring_run_of_the_192_row_tiles_matches_the_docs():
  import json
  import pathlib
  root = pathlib.Path(__file__).parent.parent / "data" / "probes"
  with open(root / "ragged_dot_deep192_h200.json") as f:
    rows = {(r["g"], r["r"]): {k: v["us"] for k, v in r["times"].items()}
            for r in json.load(f)["rows"]}
  s4, s3 = "mosaic 192x192 s4 k1 o2 cl1 d0 b0 p0 r1", "mosaic 192x192 s3 k1 o2 cl1 d0 b0 p0 r1"
  got = {key: (round(t[s3] / t[s4], 3), round(t["batched"] / t[s3], 3),
               round(t["batched"] / t["wt"], 3)) for key, t in rows.items()}
  assert got == {(128, 192): (1.0, 0.941, 0.75), (64, 375): (0.987, 0.966, 0.938),
                 (32, 375): (0.994, 0.971, 0.94)}
  assert round(rows[(128, 192)]["batched"] / rows[(128, 192)][s4], 3) == 0.942
  check = (root / "ragged_dot_deep192_check_h200.txt").read_text()
  assert check.count("2/2 right") == 6 and "wrong" not in check


def test_documented_check_commands_run_the_recorded_number_of_configs(monkeypatch):
  """The GPU edge-case commands of docs/results.md's schedule sections build
  as many runs as their recorded logs show (``N/N right``)."""
  import pathlib
  root = pathlib.Path(__file__).parent.parent / "data" / "probes"
  mod = _load_benchmark("ragged_dot_mosaic")
  counts = []
  monkeypatch.setattr(mod, "check_cases", lambda runs, *a, **k: counts.append(len(runs)) or 0)
  mod.check_edges(None, 4, True, delay=True)          # --check-ring-delay --check-stages-from 4
  mod.check_edges(None, 9, True, config="192x192/s4")  # deep192's check
  mod.check_edges(None, 0, pingpong=True)
  mod.check_edges(None, 0, cluster=True)
  mod.check_edges(None, 9, True)                       # the 192-row tiles' check
  assert counts == [12, 2, 8, 8, 6]
  for name, n in (("ring_delay_check", 12), ("deep192_check", 2), ("pingpong_check", 8),
                  ("cluster_check", 8), ("triple_check", 6)):
    assert f"{n}/{n} right" in (root / f"ragged_dot_{name}_h200.txt").read_text(), name
  docs = (pathlib.Path(__file__).parent.parent / "docs" / "results.md").read_text()
  for text in ("0.972-1.030x, geomean\n**0.995x**", "25 pairs, 0.954-1.022x",
               "32 order-2 pairs, 0.758-1.015x", "1.008, 1.019, 0.897,\n0.989 and 0.897",
               "16,077 (66%)", "3,581 (15%)"):
    assert text in docs, text


def test_work_ratios_of_the_192_row_tiles_match_the_docs():
  """docs/results.md: 192 x 192 over 128 x 256 wave-quantized tile work at
  uniform routing and under a balanced router's spread."""
  import math
  from wavetune_jax.families.ragged_dot.routing import expected_tasks_spread

  def uniform(g, r, n, bm, bn):
    tasks = sum(-(-(r + (r * i) % 8) // bm) for i in range(g))
    return math.ceil(tasks * -(-n // bn) / 132) * bm * bn

  def spread(g, r, n, bm, bn):
    return math.ceil(expected_tasks_spread(g * r, g, bm) * -(-n // bn) / 132) * bm * bn

  probs = [(64, 375, 5120), (32, 375, 5760), (8, 512, 28672), (8, 2048, 28672),
           (128, 192, 1536), (8, 1024, 4096)]
  got_u = [round(uniform(g, r, n, 128, 256) / uniform(g, r, n, 192, 192), 3)
           for g, r, n in probs]
  got_s = [round(spread(g, r, n, 128, 256) / spread(g, r, n, 192, 192), 2) for g, r, n in probs]
  assert got_u == [0.988, 1.007, 0.889, 0.969, 1.333, 0.889]
  assert got_s == [0.92, 0.94, 0.98, 0.99, 0.82, 1.00]


def test_ncu_profile_on_record_matches_the_docs():
  """docs/results.md's ncu table ("The kernel's own ring ..."): duration and
  tensor-pipe share of each recorded kernel."""
  import pathlib
  import re
  text = (pathlib.Path(__file__).parent.parent / "data" / "probes" /
          "ragged_dot_ncu_h200.txt").read_text()
  got = {}
  for block in text.split("=== ")[1:]:
    name = block.split()[0]
    dur = float(re.search(r"Duration\s+us\s+([\d.]+)", block).group(1))
    tensor = float(re.search(r"sm__pipe_tensor_cycles_active\S*\s+%\s+([\d.]+)", block).group(1))
    got[name] = (round(dur, 1), round(tensor, 1))
  assert got == {"a_mos": (385.4, 84.4), "a_bat": (351.8, 92.0), "b_mos128": (310.9, 83.2),
                 "b_mos64": (285.1, 66.2), "b_bat": (247.6, 73.6)}
  assert "nvjet_sm90_tst_192x192_64x3_2x1" in text and "nvjet_sm90_tst_256x128_64x4_1x2" in text


def test_efficiency_runs_on_record_reproduce_the_docs(capsys):
  """docs/results.md's grouped-GEMM-against-batched-GEMM numbers come from
  ``ragged_dot_efficiency.py --summarize`` on the committed H100 runs."""
  import pathlib
  root = pathlib.Path(__file__).parent.parent / "data" / "probes"
  mod = _load_benchmark("ragged_dot_efficiency")
  rule = mod.summarize(str(root / "ragged_dot_efficiency_rule_h100.json"))
  new = [v["new_rule"] for v in rule.values()]
  old = [v["old_rule"] for v in rule.values()]
  assert len(rule) == 8
  assert mod._geo(new) == pytest.approx(0.945, abs=5e-4)
  assert mod._geo(old) == pytest.approx(0.777, abs=5e-4)
  assert min(new) == pytest.approx(0.888, abs=5e-4) and max(new) == pytest.approx(0.996, abs=5e-4)
  assert min(v["skew_wt_vs_padded"] for v in rule.values()) == pytest.approx(2.746, abs=5e-4)
  orders = mod.summarize(str(root / "ragged_dot_efficiency_orders_h100.json"))
  pairs = orders.pop("p1_over_p0")
  assert len(orders) == 11 and len(pairs) == 25
  assert min(pairs) == pytest.approx(0.999, abs=5e-4) and max(pairs) == pytest.approx(1.046, abs=5e-4)
  assert mod._geo([v["best_o2"] for v in orders.values()]) == pytest.approx(0.940, abs=5e-4)
  opts = mod.summarize(str(root / "ragged_dot_efficiency_options_h100.json"))
  assert mod._geo([v["cluster_2"] for v in opts.values()]) == pytest.approx(0.906, abs=5e-4)
  assert min(v["cluster_2"] for v in opts.values()) == pytest.approx(0.835, abs=5e-4)
  assert max(v["cluster_2"] for v in opts.values()) == pytest.approx(0.988, abs=5e-4)
  assert mod._geo([v["task_band"] for v in opts.values()]) == pytest.approx(1.100, abs=5e-4)
  assert "rule run, 8 problems" in capsys.readouterr().out
  h200 = mod.summarize(str(root / "ragged_dot_efficiency_rule_h200.json"))
  wt_speed = [v["wt"] for v in h200.values()]
  assert len(h200) == 12 and mod._geo(wt_speed) == pytest.approx(0.912, abs=5e-4)
  assert min(wt_speed) == pytest.approx(0.763, abs=5e-4)
  assert max(wt_speed) == pytest.approx(0.978, abs=5e-4)


def test_work_list_runs_on_record_reproduce_the_docs(capsys):
  """docs/results.md's work-list numbers come from ``ragged_dot_worklist.py
  --summarize`` on the committed H100 runs."""
  import json
  import pathlib
  root = pathlib.Path(__file__).parent.parent / "data" / "probes"
  mod = _load_benchmark("ragged_dot_worklist")
  for name in ("ragged_dot_worklist_h100.json", "ragged_dot_worklist_lists_h100.json"):
    mod.summarize(json.loads((root / name).read_text()))
  out = capsys.readouterr().out
  assert "geomean 1.010x (0.998-1.030x) over 9" in out
  assert "256 experts, 512 rows" in out and "masked 8 kernels  13.0 us" in out
  assert out.count("same=True") == 18


@pytest.mark.parametrize("gpu,lines", [
    ("nvidia_h100_80gb_hbm3", (
        "4 stages over 3 (128 x 256, order 2), 91 problems: 1.016x (0.946-1.102); by rows per "
        "expert 128-511 1.031x over 42, 65-127 0.999x over 8, >= 512 1.005x over 41",
        "trusted with 64 experts or more: 521 Mosaic configs over 53 problems, the slowest 1.22x",
        "trusted from 64 rows per expert: 1750 Mosaic configs over 100 problems, the slowest "
        "1.26x")),
    ("nvidia_h200", (
        "4 stages over 3 (128 x 256, order 2), 87 problems: 1.006x (0.959-1.064); by rows per "
        "expert 128-511 1.008x over 40, 65-127 1.012x over 8, >= 512 1.003x over 39",
        "trusted with 64 experts or more: 485 Mosaic configs over 48 problems, the slowest 1.13x",
        "trusted one row per expert or fewer, the rule's config: 26 Mosaic configs over 26")),
])
def test_deeper_ring_and_trusted_regions_on_the_sweeps(capsys, gpu, lines):
  """docs/results.md's 4-over-3-stage gains and the guard's regions come
  from ``table_vs_sweep.py --vs-batched --trusted`` on the sweeps on record."""
  out = _table_vs_sweep(capsys, gpu, "--vs-batched", "--trusted")
  for line in lines:
    assert line in out


def test_epilogue_runs_on_record_reproduce_the_docs(capsys):
  """docs/results.md's deeper-ring numbers: ``ragged_dot_efficiency.py
  --mode epilogue`` on an H100, before the rule took 4 stages and after."""
  import pathlib
  root = pathlib.Path(__file__).parent.parent / "data" / "probes"
  mod = _load_benchmark("ragged_dot_efficiency")
  before = mod.summarize(str(root / "ragged_dot_efficiency_epilogue_h100.json"))
  assert len(before) == 12
  assert mod._geo([v["sliced_over_e0"] for v in before.values()]) == pytest.approx(1.021,
                                                                                  abs=5e-4)
  assert mod._geo([v["wt"] for v in before.values()]) == pytest.approx(0.924, abs=5e-4)
  after = mod.summarize(str(root / "ragged_dot_efficiency_epilogue_rule_h100.json"))
  assert len(after) == 10
  assert mod._geo([v["wt"] for v in after.values()]) == pytest.approx(0.961, abs=5e-4)
  assert mod._geo([v["rule_e0"] for v in after.values()]) == pytest.approx(0.937, abs=5e-4)
  assert "epilogue run, 10 problems" in capsys.readouterr().out


def test_tails_and_vs_batched_on_record_reproduce_the_docs(capsys):
  """docs/results.md's numbers under the sweeps' balanced router: the tails
  run (``ragged_dot_tails.py --summarize``) and the H100 sweep against its
  batched-GEMM rows (``table_vs_sweep.py --vs-batched``)."""
  import pathlib
  root = pathlib.Path(__file__).parent.parent
  tails = _load_benchmark("ragged_dot_tails").summarize(
      str(root / "data/probes/ragged_dot_tails_h100.json"))
  gains = [x for r in tails.values() for x in r["gain"]]
  assert len(tails) == 8 and len(gains) == 14
  mixtral_w2 = tails[(2048, 8, 14336, 4096)]
  assert mixtral_w2["tail_tasks"] == "5/21"
  assert (round(mixtral_w2["waves"], 2), round(mixtral_w2["waves_uniform"], 2)) == (2.55, 1.94)
  assert min(gains) == pytest.approx(0.707, abs=5e-4) and max(gains) == pytest.approx(1.038, abs=5e-4)
  rule = [v["128x256 s3 o2 skip0"] for v in tails.values() if "128x256 s3 o2 skip0" in v]
  assert len(rule) == 7  # Arctic's 17 GB of weights left no room for the reference
  assert min(p for _, p in rule) == pytest.approx(0.744, abs=5e-4)
  assert max(p for _, p in rule) == pytest.approx(0.972, abs=5e-4)
  out = _table_vs_sweep(capsys, "nvidia_h100_80gb_hbm3", "--vs-batched")
  assert "efficiency vs oracle: geomean 0.995, min 0.932" in out
  assert ("order 2 over the earlier orders (128 x 256, 3 stages), 91 problems: 1.136x "
          "(0.993-2.118); by rows per expert 128-511 1.125x over 42, 65-127 1.014x over 8, "
          ">= 512 1.172x over 41") in out
  # With the rule's 4-stage ring (RG8) on the H100 (3 stages before: 0.840 and 0.895) and
  # 64-row tasks up to 128 rows per expert (0.866 before).
  assert ("128-512 rows: 42 problems; batched 0.872x (0.748x) / 0.873x; >= 0.95x 0, >= 1.0x 0; "
          "faster of the two 0.872x (0.748x); padded 0.907x (0.755x) over 42") in out
  assert ("512- rows: 41 problems; batched 0.900x (0.817x) / 0.906x; >= 0.95x 5, >= 1.0x 0; "
          "faster of the two 0.900x (0.817x); padded 0.940x (0.819x) over 41") in out
  # The rule's 64-row tasks at 65-128 rows per expert ("64-row tasks up to 128 rows per expert").
  assert ("64 x 256 over 128 x 256 (4 stages), order 2, at 65-128 rows per expert, 18 problems: "
          "1.028x (0.985-1.071), 64 x 256 faster on 16; share of the best Mosaic config 0.996 "
          "(min 0.961) / 0.969 (min 0.934), within 5% on 18 / 13") in out
  assert ("at 129-255 rows per expert, 10 problems: 0.900x (0.845-0.966), 64 x 256 faster "
          "on 0") in out


def test_tile_height_on_the_h200_sweep_reproduces_the_docs(capsys):
  out = _table_vs_sweep(capsys, "nvidia_h200", "--vs-batched")
  assert "efficiency vs oracle: geomean 0.989, min 0.864, within 5% 0.90" in out
  assert ("64 x 256 over 128 x 256 (3 stages), order 2, at 65-128 rows per expert, 18 problems: "
          "1.035x (0.948-1.114), 64 x 256 faster on 13; share of the best Mosaic config 0.989 "
          "(min 0.948) / 0.955 (min 0.898), within 5% on 17 / 10") in out
  assert ("at 129-255 rows per expert, 10 problems: 0.960x (0.897-1.015), 64 x 256 faster "
          "on 3") in out


# One compiled program per trial, not one per op (the trials' shapes differ).
_REFERENCE = jax.jit(ragged_dot_reference, static_argnums=(3,))
_ROW_TASKS = jax.jit(row_tasks, static_argnums=(1, 2), static_argnames=("band_cap",))
_FIXUP = jax.jit(mosaic_kernel.stream_k_fixup,
                 static_argnames=("steps", "block_n", "grid_minor", "band"))


def _stream_k_emulated(lhs, rhs, sizes, c, ctas, out_dtype):
  """The Mosaic kernel's stream-K schedule run in numpy (``stream_k_plan``:
  whole items, then each CTA's pieces of the last items, partial tiles as
  the kernel stores them) and finished by ``stream_k_fixup``; rows the
  schedule never writes stay NaN."""
  m, k = lhs.shape
  g, _, n = rhs.shape
  bm, bn, steps = c.block_m, c.block_n, -(-k // 64)
  cap = mosaic_kernel.band_cap(bm, k, 2) if c.grid_minor == 2 else 0
  tasks, count = _ROW_TASKS(jnp.asarray(sizes, jnp.int32), m, bm, band_cap=cap)
  t, cnt, tiles_n = np.asarray(tasks), int(count[0]), -(-n // bn)
  x = np.zeros((m + 256, steps * 64), np.float32)
  x[:m, :k] = np.asarray(lhs, np.float32)
  w = np.zeros((g, steps * 64, tiles_n * bn), np.float32)
  w[:, :k, :n] = np.asarray(rhs, np.float32)
  out = np.full((m, tiles_n * bn), np.nan, np.float32)
  halves = mosaic_kernel.partial_halves(out_dtype)
  parts = np.full((ctas, 2, halves, bm, bn), np.nan, np.float32)

  # Every work item's (task, column tile), in one call.
  items = mosaic_kernel.work_item(jnp.arange(max(cnt * tiles_n, 1), dtype=jnp.int32),
                                  jnp.int32(cnt), tiles_n, c.grid_minor, tasks)
  item_task, item_ni = (np.asarray(a) for a in items)

  def tile(item, kb0, kb1):
    task, ni = int(item_task[item]), int(item_ni[item])
    grp, row0, start, size = t[:4, task]
    if grp >= g:  # the tail: zeros
      return np.zeros((bm, bn), np.float32), (row0, start, size, ni)
    ks = slice(kb0 * 64, kb1 * 64)
    return x[row0:row0 + bm, ks] @ w[grp, ks, ni * bn:(ni + 1) * bn], (row0, start, size, ni)

  def store(item):
    v, (row0, start, size, ni) = tile(item, 0, steps)
    out[row0 + start:row0 + start + size, ni * bn:(ni + 1) * bn] = v[start:start + size]

  dp, sk_steps = mosaic_kernel.stream_k_plan(cnt * tiles_n, ctas, steps)
  for item in range(dp):
    store(item)
  for cta in range(ctas):
    pos, end = cta * sk_steps // ctas, (cta + 1) * sk_steps // ctas
    for _ in range(mosaic_kernel.STREAM_K_PIECES):
      if pos >= end:
        break
      item, kb0 = divmod(pos, steps)
      kb1 = min(steps, kb0 + end - pos)
      if kb0 == 0 and kb1 == steps:
        store(dp + item)
      else:
        v = tile(dp + item, kb0, kb1)[0]
        rounded = lambda a: np.asarray(a, np.float32).astype(out_dtype).astype(np.float32)  # noqa: E731
        hi = rounded(v)
        parts[cta, 0 if kb0 else 1, 0] = hi
        if halves == 2:
          parts[cta, 0 if kb0 else 1, 1] = rounded(v - hi)
      pos += kb1 - kb0
    assert pos == end, "a CTA's range took more pieces than the kernel runs"
  res = _FIXUP(jnp.asarray(out[:, :n]).astype(out_dtype), jnp.asarray(parts).astype(out_dtype),
               tasks, count, steps=steps, block_n=bn, grid_minor=c.grid_minor)
  return np.asarray(res.astype(jnp.float32)), dp, sk_steps


def test_stream_k_plan_and_fixup_give_every_row():
  # The stream-K schedule (the last items cut along K between CTAs, the cut
  # items summed after the kernel) covers every output element once: no
  # NaN is left, and the result is the float32 reference to the output's
  # rounding, with orders 0, 1 and 2, columns past N, empty experts, the
  # tail's zero rows, and bfloat16 (two terms per partial) or float32 out.
  rng = np.random.default_rng(0)
  cut_cases = 0
  for trial in range(6):
    m = int(rng.integers(100, 700))
    g = int(rng.integers(1, 9))
    sizes = rng.multinomial(int(rng.integers(m // 2, m + 1)), np.ones(g) / g)
    sizes[rng.integers(g)] = 0
    k = int(rng.choice([256, 320, 448]))
    n = int(rng.choice([256, 320, 512]))
    bm, bn = [(64, 256), (128, 256), (256, 128), (128, 128)][trial % 4]
    c = wt.MosaicRaggedDotConfig(block_m=bm, block_n=bn, num_stages=2,
                                 grid_minor=trial % 3)
    out_dtype = jnp.dtype(jnp.float32 if trial % 5 == 4 else jnp.bfloat16)
    lhs = jnp.asarray(rng.standard_normal((m, k), np.float32), jnp.bfloat16)
    rhs = jnp.asarray(rng.standard_normal((g, k, n), np.float32) / 16, jnp.bfloat16)
    ref = np.asarray(_REFERENCE(lhs, rhs, jnp.asarray(sizes, jnp.int32), jnp.float32))
    ctas = int(rng.choice([3, 5, 7, 11]))
    got, dp, sk_steps = _stream_k_emulated(lhs, rhs, sizes, c, ctas, out_dtype)
    cut_cases += sk_steps > 0
    assert not np.isnan(got).any()
    tol = 1e-5 if out_dtype == jnp.float32 else 1e-2
    np.testing.assert_allclose(got, ref, atol=tol * np.abs(ref).max(), rtol=tol)
  assert cut_cases >= 4  # (deterministic draws: 5 of the 6 cut items)


def test_stream_k_plan():
  plan = mosaic_kernel.stream_k_plan
  assert plan(264, 132, 10) == (264, 0)  # whole waves
  assert plan(100, 132, 10) == (100, 0)  # less than one wave
  assert plan(336, 132, 10) == (132, (132 + 72) * 10)  # 2.55 waves: the last 1.55 cut
  for items in (100, 264, 336, 1000):
    d, s = plan(jnp.int32(items), 132, 10)
    assert (int(d), int(s)) == plan(items, 132, 10)


@pytest.mark.parametrize("tile,order,out", [((128, 256), 2, "bfloat16"),
                                            ((64, 256), 1, "float32"),
                                            ((256, 128), 0, "float16")])
def test_mosaic_stream_k_lowers(tile, order, out):
  p = RaggedDotProblem(m=2048, g=8, k=1024, n=4096, out_dtype=out)
  c = wt.MosaicRaggedDotConfig(block_m=tile[0], block_n=tile[1], num_stages=3, grid_minor=order)
  _lower(p, c, mosaic_kernel.MosaicRaggedDotOptions(stream_k=1))


def test_mosaic_stream_k_errors():
  o = mosaic_kernel.MosaicRaggedDotOptions
  for bad in (dict(stream_k=2), dict(stream_k=1, cluster_m=2), dict(stream_k=1, delay_release=1)):
    with pytest.raises(ValueError, match="MosaicRaggedDotOptions"):
      o(**bad)
  p = RaggedDotProblem(m=512, g=2, k=512, n=128)
  with pytest.raises(ValueError, match="stream_k=1 needs config.split_k=1"):
    _lower(p, wt.MosaicRaggedDotConfig(split_k=2), o(stream_k=1))


def test_stream_k_run_on_record_reproduces_the_docs():
  """docs/results.md's stream-K numbers (``ragged_dot_tails.py --summarize``
  on the H100 run): slower on every pair, the traced step count free."""
  import pathlib
  root = pathlib.Path(__file__).parent.parent
  rows = _load_benchmark("ragged_dot_tails").summarize(
      str(root / "data/probes/ragged_dot_streamk_h100.json"))
  gains = [x for r in rows.values() for x in r["gain"]]
  assert len(gains) == 6
  assert min(gains) == pytest.approx(0.494, abs=5e-4) and max(gains) == pytest.approx(0.953, abs=5e-4)
  assert mosaic_kernel.stream_k_plan(336, 132, 224)[0] == 132  # Mixtral w2: 2.55 waves


def test_local_items_splits_items_over_ctas():
  """``pallas_kernels._launch.local_items``: CTA c takes items c, c + C, ...;
  none where the (traced) item count is at most c, as the grouped GEMM's
  ring has when its run-time tasks are fewer than its CTAs."""
  from pallas_kernels._launch import local_items
  for items, ctas in ((10, 3), (132, 132), (1000, 132), (5, 7), (0, 4)):
    got = [int(local_items(jnp.int32(c), jnp.int32(items), ctas)) for c in range(ctas)]
    assert got == [len(range(c, items, ctas)) for c in range(ctas)], (items, ctas)


def test_xla_sizes_benchmark_args_and_recorded_run(capsys):
  """``benchmarks/ragged_dot_xla_sizes.py``: its argument errors, and the
  H200 run on file (docs/results.md): the op, with XLA's config, ran
  0.968-0.996x ``lax.ragged_dot`` on the four decode steps, 0.9-5.6 us of
  clipping the sizes a call."""
  from bench_module import load_benchmark
  mod = load_benchmark("ragged_dot_xla_sizes")
  for bad in (["--problems", "8,24,5632"], ["--problems", "8,0,1,1"], ["--iterations", "0"]):
    with pytest.raises(SystemExit):
      mod.main(bad)
    assert "error:" in capsys.readouterr().err
  rows = json.loads((pathlib.Path(__file__).parent.parent / "data" / "probes"
                     / "ragged_dot_xla_sizes_h200.json").read_text())["rows"]
  assert [r["problem"] for r in rows] == [list(p) for p in mod.PROBLEMS]
  speed = [r["us"]["lax"] / r["us"]["op"] for r in rows]
  extra = [r["us"]["op"] - r["us"]["lax"] for r in rows]
  assert (round(min(speed), 3), round(max(speed), 3)) == (0.968, 0.996)
  assert (round(min(extra), 1), round(max(extra), 1)) == (0.9, 5.6)


def test_xla_sizes_benchmark_checks_odd_sizes_on_the_no_running_sum_path(monkeypatch, capsys):
  """The benchmark's odd-size check, run on a CPU through the path a GPU
  with cuDNN older than 9.22 takes (XLA's ragged dot on sizes each clipped,
  no running sum; the CPU's lax.ragged_dot standing in for the GPU's dense
  form): every kind right, and a wrong path would be caught (sizes handed
  over unclipped give wrong rows)."""
  from bench_module import load_benchmark
  from wavetune_jax.families.ragged_dot import xla as xla_backend
  from wavetune_jax.families.ragged_dot.xla import XlaRaggedDot
  mod = load_benchmark("ragged_dot_xla_sizes")
  monkeypatch.setattr(xla_backend, "cudnn_below", lambda bound: True)
  run = XlaRaggedDot.run

  def on_a_gpu(self, p, config, lhs, rhs, sizes, *, interpret=False):
    return run(self, p, config, lhs, rhs, sizes, interpret=False)
  monkeypatch.setattr(XlaRaggedDot, "run", on_a_gpu)
  checks = mod.check_sizes([(4, 24, 16, 8)], backends=("xla",))
  assert len(checks) == 4 and all(c["ok"] for c in checks), checks
  # the same check fails where the op's clip is taken away
  from wavetune_jax.core.family import Call
  bind = RAGGED_DOT.bind

  def unclipped(lhs, rhs, group_sizes, **kw):
    call = bind(lhs, rhs, group_sizes, **kw)
    return Call(call.problem, (lhs, rhs, group_sizes), {})
  monkeypatch.setattr(RAGGED_DOT, "bind", unclipped)
  assert not all(c["ok"] for c in mod.check_sizes([(4, 24, 16, 8)], backends=("xla",)))
  capsys.readouterr()


def test_xla_sizes_benchmark_run_since_the_elementwise_clip():
  """The H200 run since the op hands XLA's ragged dot each size clipped and
  nothing more (docs/results.md): 0.964-1.015x ``lax.ragged_dot``, the op
  within 1.7 us of the same module (the third column), and the op right on
  all 32 odd size vectors (4 problems x 4 kinds x XLA and Mosaic)."""
  from bench_module import load_benchmark
  mod = load_benchmark("ragged_dot_xla_sizes")
  run = json.loads((pathlib.Path(__file__).parent.parent / "data" / "probes"
                    / "ragged_dot_xla_sizes_clip_h200.json").read_text())
  rows, checks = run["rows"], run["checks"]
  speed = [r["us"]["lax"] / r["us"]["op"] for r in rows]
  assert (round(min(speed), 3), round(max(speed), 3)) == (0.964, 1.015)
  assert round(max(r["us"]["op"] - r["us"]["clip"] for r in rows), 1) == 1.7
  assert len(checks) == 32 and all(c["ok"] for c in checks)
  assert {c["sizes"] for c in checks} == set(mod.odd_sizes(8, 24))
  assert max(c["rel_err"] for c in checks) < 1.7e-3
