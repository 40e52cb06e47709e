"""Realistic group sizes for tuning and tests: rows routed to experts.

A router gives each expert a popularity ``softmax(skew * z)``, ``z`` standard
normal; each row then picks an expert at random with those probabilities.
``skew = 0`` is a balanced router (random top-k of random logits gives each
expert about the same share); ``skew = 2`` leaves a few hot experts with most
rows and some experts empty, as routers do early in training or on
out-of-domain text.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["BALANCED", "SKEWED", "group_sizes", "expected_tasks"]

BALANCED = 0.0
SKEWED = 2.0


def group_sizes(key: jax.Array, m: int, g: int, skew: float = BALANCED) -> jax.Array:
  """``[g]`` int32 sizes summing to ``m`` (module doc)."""
  kp, kr = jax.random.split(key)
  logits = skew * jax.random.normal(kp, (g,))
  picks = jax.random.categorical(kr, logits, shape=(m,))
  return jnp.bincount(picks, length=g).astype(jnp.int32)


def expected_tasks(m, g, block_m, align: int = 8):
  """Row tasks of a balanced router (``m`` rows over ``min(g, m)`` equally
  filled groups, each starting ``align / 2`` rows past an aligned row on
  average); works on ints and NumPy arrays."""
  m = np.asarray(m, np.float64)
  active = np.minimum(g, m)
  per = m / active
  return (active * np.ceil((per + align / 2) / block_m)).astype(np.int64)
