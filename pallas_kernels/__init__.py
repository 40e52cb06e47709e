"""Pallas GPU kernels, each a pure function of (inputs, config).

One folder per family, one module per backend (``matmul/triton.py``,
``attention/triton.py``, ``attention/mosaic.py``) with the float32 reference
beside them. This package knows nothing about tuning; :mod:`wavetune_jax`
chooses configs.
"""
