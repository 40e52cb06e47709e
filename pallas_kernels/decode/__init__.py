"""Flash-decoding kernels (a few queries per sequence against a KV cache)."""
