"""Flash-attention forward kernels: one module per backend."""
