"""Several devices: shard_map and sharded jit of every op, on 4 CPU devices.

The checks (tests/sharding_checks.py) run in a subprocess: the device count
is fixed when JAX starts. Each prints OK or FAIL; see that file for what is
checked (results equal the unsharded op, output shardings, no all-gather of
a sharded operand, configs selected on per-shard shapes, the GPU kernels
inside shard_map lowering for CUDA).
"""

import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def results():
  env = dict(os.environ, PYTHONPATH=os.path.dirname(HERE) + os.pathsep
             + os.environ.get("PYTHONPATH", ""))
  out = subprocess.run([sys.executable, os.path.join(HERE, "sharding_checks.py")],
                       capture_output=True, text=True, env=env, timeout=900)
  lines = [l for l in out.stdout.splitlines() if l.startswith(("OK ", "FAIL "))]
  assert lines, f"no result lines:\n{out.stdout}\n{out.stderr[-3000:]}"
  return {l.split()[1].rstrip(":"): l for l in lines}, out.stderr


@pytest.mark.parametrize("name", ["sharded_jit_matmul", "sharded_jit_disagreeing_layouts",
                                  "vmap_on_several_devices",
                                  "sharded_jit_attention_batch_and_heads",
                                  "sharded_jit_multi_head_attention",
                                  "explicit_mesh_runs_xlas_op",
                                  "explicit_types_without_the_mesh_set",
                                  "explicit_mesh_ragged_dot",
                                  "autotune_keeps_a_dot_with_out_sharding",
                                  "autotune_custom_functions_keep_their_types",
                                  "sharded_jit_ragged_dot", "sharded_jit_quantized_ragged_dot",
                                  "shard_map_default_check_vma",
                                  "shard_map_pinned_pallas_on_cpu",
                                  "shard_map_kernels_lower_for_cuda"])
def test_multi_device(results, name):
  lines, stderr = results
  assert name in lines, f"{name} did not run:\n{stderr[-3000:]}"
  assert lines[name].startswith("OK"), f"{lines[name]}\n{stderr[-3000:]}"


def test_tensor_parallel_layer_benchmark_small():
  """benchmarks/tp_layer.py --small: the layer with wt ops equals XLA's on a
  2 x 2 mesh of CPU devices, and its compiled step gathers no weight."""
  root = os.path.dirname(HERE)
  env = dict(os.environ, PYTHONPATH=root, JAX_PLATFORMS="cpu")
  out = subprocess.run([sys.executable, os.path.join(root, "benchmarks", "tp_layer.py"),
                        "--small", "--tp", "2", "--dp", "2"],
                       capture_output=True, text=True, env=env, timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  assert "wt step all-gathers: False" in out.stdout, out.stdout
