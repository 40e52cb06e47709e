"""wavetune-jax: near-optimal launch configs for Pallas GPU kernels at trace time."""

from wavetune_jax.attention_spec import (ATTENTION, AttentionConfig, AttentionProblem,
                                         AttentionSpec)
from wavetune_jax.hardware import Hardware, detect, device_key, get_hardware
from wavetune_jax.matmul_spec import MATMUL, MatmulConfig, MatmulProblem, MatmulSpec
from wavetune_jax.ops import attention, matmul
from wavetune_jax.selector import load_tables, policy, select, set_policy, use_config, use_tables
from wavetune_jax.spec import KernelSpec, get_spec, register

__version__ = "0.1.0"

__all__ = [
    "ATTENTION",
    "AttentionConfig",
    "AttentionProblem",
    "AttentionSpec",
    "Hardware",
    "KernelSpec",
    "MATMUL",
    "MatmulConfig",
    "MatmulProblem",
    "MatmulSpec",
    "detect",
    "device_key",
    "get_hardware",
    "attention",
    "get_spec",
    "load_tables",
    "matmul",
    "policy",
    "register",
    "select",
    "set_policy",
    "use_config",
    "use_tables",
]
