"""The ``wavetune`` command: demo, sweep, report, merge, tune, select, plot, eval."""

from wavetune_jax.cli.main import main

__all__ = ["main"]
