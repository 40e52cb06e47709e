"""``python -m wavetune_jax``: the ``wavetune`` command."""

import sys

from wavetune_jax.cli import main

sys.exit(main())
