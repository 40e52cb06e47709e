"""Flash-decoding kernels (a few queries per sequence against a KV cache),
and the split arithmetic the Triton and Mosaic GPU kernels share."""


def chunk_len(kv_len: int, num_splits: int, block_k: int) -> int:
  """Keys per chunk of a full cache: ``kv_len / num_splits`` rounded up to
  whole blocks."""
  per = -(-kv_len // num_splits)
  return -(-per // block_k) * block_k


def splits_of(kv_len: int, num_splits: int, block_k: int) -> int:
  """Chunks that hold keys of a full cache when ``num_splits`` is asked for
  (fewer than asked where the blocks do not divide: each once)."""
  return -(-kv_len // chunk_len(kv_len, num_splits, block_k))
