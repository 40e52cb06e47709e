"""``python -m wavetune_jax.cli``: the ``wavetune`` command."""

import sys

from wavetune_jax.cli import main

if __name__ == "__main__":
  sys.exit(main())
