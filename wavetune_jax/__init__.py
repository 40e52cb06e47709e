"""wavetune-jax: the fastest backend and launch config for each LLM kernel call,
chosen at jit trace time."""

from wavetune_jax.dropin import autotune
from wavetune_jax.core.family import Backend, Family, Problem
from wavetune_jax.core.hardware import Hardware, detect, device_key, get_hardware
from wavetune_jax.core.registry import get_family, register, registered
from wavetune_jax.families import ATTENTION, DECODE, MATMUL, QMATMUL, QRAGGED_DOT, RAGGED_DOT
from wavetune_jax.families.attention import (AttentionProblem, CudnnAttentionConfig,
                                             MosaicAttentionConfig, TritonAttentionConfig,
                                             XlaAttentionConfig)
from wavetune_jax.families.decode import (CudnnDecodeConfig, DecodeProblem, MosaicDecodeConfig,
                                          TritonDecodeConfig, XlaDecodeConfig)
from wavetune_jax.families.matmul import (MatmulProblem, MosaicMatmulConfig,
                                          TritonMatmulConfig, XlaMatmulConfig)
from wavetune_jax.families.qmatmul import (QMatmulProblem, XlaQMatmulConfig, from_qwix,
                                           quantize_rows, quantize_weight)
from wavetune_jax.families.qragged_dot import QRaggedDotProblem, XlaQRaggedDotConfig
from wavetune_jax.families.ragged_dot import (MosaicRaggedDotConfig, RaggedDotProblem,
                                              TritonRaggedDotConfig, XlaRaggedDotConfig)
from wavetune_jax.ops import (attention, decode_attention, matmul, quantized_matmul,
                             quantized_ragged_dot, ragged_dot)
from wavetune_jax.runtime.selector import (POLICIES, get_policy, load_tables, policy, select,
                                           set_policy, use_config, use_tables)
from wavetune_jax.runtime.tables import TableError

__version__ = "0.2.0"

__all__ = [
    "ATTENTION",
    "AttentionProblem",
    "Backend",
    "Family",
    "Hardware",
    "MATMUL",
    "CudnnAttentionConfig",
    "CudnnDecodeConfig",
    "DECODE",
    "DecodeProblem",
    "MatmulProblem",
    "MosaicAttentionConfig",
    "MosaicDecodeConfig",
    "MosaicMatmulConfig",
    "MosaicRaggedDotConfig",
    "POLICIES",
    "Problem",
    "QMATMUL",
    "QMatmulProblem",
    "QRAGGED_DOT",
    "QRaggedDotProblem",
    "RAGGED_DOT",
    "RaggedDotProblem",
    "TableError",
    "TritonAttentionConfig",
    "TritonDecodeConfig",
    "TritonMatmulConfig",
    "TritonRaggedDotConfig",
    "XlaAttentionConfig",
    "XlaDecodeConfig",
    "XlaMatmulConfig",
    "XlaQMatmulConfig",
    "XlaQRaggedDotConfig",
    "XlaRaggedDotConfig",
    "attention",
    "autotune",
    "decode_attention",
    "detect",
    "device_key",
    "from_qwix",
    "get_family",
    "get_hardware",
    "load_tables",
    "matmul",
    "policy",
    "quantize_rows",
    "quantize_weight",
    "quantized_matmul",
    "quantized_ragged_dot",
    "ragged_dot",
    "register",
    "registered",
    "select",
    "set_policy",
    "get_policy",
    "use_config",
    "use_tables",
]
