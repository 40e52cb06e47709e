"""The decode family (flash-decoding against a KV cache) and its backends."""

from wavetune_jax.families.decode.family import DecodeFamily, decode_models
from wavetune_jax.families.decode.library import (CudnnDecode, CudnnDecodeConfig, XlaDecode,
                                                  XlaDecodeConfig)
from wavetune_jax.families.decode.mosaic import MosaicDecode, MosaicDecodeConfig
from wavetune_jax.families.decode.problem import DecodeProblem
from wavetune_jax.families.decode.triton import TritonDecode, TritonDecodeConfig

__all__ = ["CudnnDecode", "CudnnDecodeConfig", "DecodeFamily", "DecodeProblem", "MosaicDecode",
           "MosaicDecodeConfig", "TritonDecode",
           "TritonDecodeConfig", "XlaDecode", "XlaDecodeConfig", "decode_models", "make"]


def make() -> DecodeFamily:
  """The decode family with every backend, in order of preference (the
  Triton kernel's rule is the heuristic, the Mosaic kernel's where Triton is
  gone or does not run the problem; the library backends have none)."""
  return DecodeFamily([TritonDecode(), MosaicDecode(), CudnnDecode(), XlaDecode()])
