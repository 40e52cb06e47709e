"""Argument types and checks shared by the ``wavetune`` commands."""

from __future__ import annotations

import argparse
import os

__all__ = ["positive_int", "at_least", "existing_file", "add_family_arg", "CliError"]


class CliError(Exception):
  """A user error: printed as one line, exit status 2."""


def positive_int(s: str) -> int:
  try:
    v = int(s)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
  if v < 1:
    raise argparse.ArgumentTypeError(f"{s} is not an integer >= 1")
  return v


def at_least(lo: float):
  def parse(s: str) -> float:
    try:
      v = float(s)
    except ValueError:
      raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not v >= lo:
      raise argparse.ArgumentTypeError(f"{s} is not a number >= {lo}")
    return v
  return parse


def existing_file(s: str) -> str:
  if not os.path.isfile(s):
    raise argparse.ArgumentTypeError(f"no file {s!r}")
  if os.path.getsize(s) == 0:
    raise argparse.ArgumentTypeError(f"{s!r} is empty")
  return s


def add_family_arg(ap: argparse.ArgumentParser, *, positional: bool = False) -> None:
  """The family an operation works on (required: there is no default)."""
  from wavetune_jax.core.registry import registered
  names = list(registered())
  if positional:
    ap.add_argument("family", choices=names, help=f"the op family: {', '.join(names)}")
  else:
    ap.add_argument("--family", "--kernel", dest="family", required=True, choices=names,
                    help=f"the op family: {', '.join(names)} (required)")
