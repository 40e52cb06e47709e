"""Grouped GEMM ``out[rows of group g] = lhs[rows of group g] @ rhs[g]`` (the
expert GEMMs of mixture-of-experts layers): one module per backend, the row
work list they share, and the float32 reference."""
