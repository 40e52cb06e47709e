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

__all__ = ["BALANCED", "SKEWED", "group_sizes", "expected_tasks", "expected_tasks_spread"]

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


def expected_tasks_spread(m: int, g: int, block_m: int, align: int = 8) -> float:
  """Row tasks of a balanced router with its spread: each of the ``min(g, m)``
  active groups gets ``s ~ Binomial(m, 1 / g)`` rows (normal approximation)
  and takes ``ceil((s + o) / block_m)`` tasks, ``o`` its first row's offset
  past an aligned row (0 for the first group, ``align / 2`` on average for
  the others). :func:`expected_tasks` counts every group at the mean, which
  misses the groups that spill into one more task."""
  import math
  active = min(g, m)
  mean = m / active
  offset = align / 2 * (active - 1) / active
  sd = math.sqrt(m * (1 / g) * (1 - 1 / g))
  if sd < 1e-6:  # one group: its size is m
    return active * math.ceil((mean + offset) / block_m)
  # E[ceil(x / b)] = sum over j >= 0 of P(x > j b), for x = s + o > 0.
  tasks, j = 1.0, 1
  while j * block_m < mean + offset + 8 * sd:
    tasks += 0.5 * math.erfc((j * block_m - offset - mean) / (sd * math.sqrt(2)))
    j += 1
  return active * tasks
