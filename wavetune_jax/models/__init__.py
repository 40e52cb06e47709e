"""LLM decoders in plain JAX whose GEMMs and attention go through one switch
(XLA + cuDNN, or the wavetune ops under a policy): what the ops buy a model
end to end (``wavetune bench model``)."""

from wavetune_jax.models.decoder import (MODELS, OPS, WEIGHT_FORMATS, ModelConfig,
                                         decode_step, init, library_attention_impl, make_ops,
                                         moe_mlp, paged_decode_step, paged_prefill, prefill,
                                         quantize_params, random_block_tables,
                                         random_kv_caches)

__all__ = ["MODELS", "OPS", "WEIGHT_FORMATS", "ModelConfig", "decode_step", "init",
           "library_attention_impl", "make_ops", "moe_mlp", "paged_decode_step",
           "paged_prefill", "prefill", "quantize_params", "random_block_tables",
           "random_kv_caches"]
