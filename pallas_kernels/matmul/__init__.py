"""GEMM kernels ``y[M, N] = x[M, K] @ w[K, N]``: one module per backend."""
