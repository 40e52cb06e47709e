"""The ``wavetune`` command line."""

from __future__ import annotations

import argparse
import sys
import warnings

__all__ = ["main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
  from wavetune_jax.cli import bench, demo, eval as eval_cli, sweep, tune
  ap = argparse.ArgumentParser(
      prog="wavetune",
      description="Fast launch configs for LLM kernels in JAX: choose, tune, evaluate.")
  sub = ap.add_subparsers(dest="command", required=True, metavar="COMMAND")
  demo.add_commands(sub)
  sweep.add_commands(sub)
  tune.add_commands(sub)
  eval_cli.add_commands(sub)
  bench.add_commands(sub)
  return ap


def _message(e: BaseException) -> str:
  """One line for an error: an OS error as ``file: reason``."""
  if isinstance(e, OSError) and e.strerror:
    where = f"{e.filename} -> {e.filename2}" if e.filename2 else e.filename
    return f"{where}: {e.strerror}" if where else e.strerror
  msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
  if isinstance(e, KeyError):
    msg = f"missing field {msg} (not a file of the expected kind?)"
  return msg


def main(argv=None) -> int:
  """Runs one command. User errors (a bad file, device, option value) print
  one line, ``wavetune COMMAND: error: ...`` (argparse's form), on stderr and
  exit with status 2; ``WAVETUNE_DEBUG=1`` shows the traceback."""
  from wavetune_jax.cli.common import CliError
  from wavetune_jax.core.cache_folder import env_on
  args = build_parser().parse_args(argv)
  plain = warnings.formatwarning
  # A warning prints as one line too (not the source line of the library
  # that raised it); recorded warnings (tests, `warnings.catch_warnings`)
  # are not affected.
  warnings.formatwarning = lambda message, category, *_: (
      f"wavetune {args.command}: warning: {str(message).strip()}\n")
  try:
    return args.func(args)
  except (CliError, ValueError, OSError, EOFError, KeyError, RuntimeError, OverflowError,
          ImportError) as e:
    if env_on("WAVETUNE_DEBUG"):
      raise
    print(f"wavetune {args.command}: error: {_message(e)}", file=sys.stderr)
    return 2
  except KeyboardInterrupt:
    print(f"wavetune {args.command}: interrupted (what was measured is on file)",
          file=sys.stderr)
    return 130
  finally:
    warnings.formatwarning = plain


if __name__ == "__main__":
  sys.exit(main())
