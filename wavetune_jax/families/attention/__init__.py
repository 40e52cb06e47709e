"""The attention family and its backends."""

from wavetune_jax.families.attention.cudnn import CudnnAttention, CudnnAttentionConfig
from wavetune_jax.families.attention.family import AttentionFamily, attention_models
from wavetune_jax.families.attention.mosaic import MosaicAttention, MosaicAttentionConfig
from wavetune_jax.families.attention.problem import AttentionProblem
from wavetune_jax.families.attention.triton import TritonAttention, TritonAttentionConfig
from wavetune_jax.families.attention.xla import XlaAttention, XlaAttentionConfig

__all__ = ["AttentionFamily", "CudnnAttention", "CudnnAttentionConfig", "AttentionProblem", "MosaicAttention", "MosaicAttentionConfig",
           "TritonAttention", "TritonAttentionConfig", "XlaAttention", "XlaAttentionConfig",
           "attention_models", "make"]


def make() -> AttentionFamily:
  """The attention family with every backend, in order of preference."""
  return AttentionFamily([CudnnAttention(), MosaicAttention(), TritonAttention(),
                          XlaAttention()])
