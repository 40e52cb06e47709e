"""Argument types and checks shared by the ``wavetune`` commands."""

from __future__ import annotations

import argparse
import os

__all__ = ["positive_int", "positive_ints", "at_least", "existing_file", "add_family_arg", "CliError",
           "MAX_INT", "detect_gpu", "pyplot", "output_file"]

#: The largest integer an option takes (sizes, counts): beyond it, products
#: of problem sizes leave the int64 range of the grid arithmetic.
MAX_INT = 2**31 - 1


class CliError(Exception):
  """A user error: printed as one line, exit status 2."""


def positive_int(s: str) -> int:
  try:
    v = int(s)
  except ValueError:
    raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
  if v < 1:
    raise argparse.ArgumentTypeError(f"{s} is not an integer >= 1")
  if v > MAX_INT:
    raise argparse.ArgumentTypeError(f"{s} is too large (at most {MAX_INT})")
  return v


def positive_ints(names: str):
  """An argparse type: ``"a,b,..."`` -> a tuple of as many positive ints as
  ``names`` (e.g. ``"M,G,K,N"``) has fields."""
  count = len(names.split(","))

  def parse(s: str) -> tuple[int, ...]:
    try:
      v = tuple(positive_int(x) for x in s.split(","))
    except argparse.ArgumentTypeError:
      v = ()
    if len(v) != count:
      raise argparse.ArgumentTypeError(f"takes {names} of positive ints, got {s!r}")
    return v

  return parse


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


def output_file(s: str) -> str:
  """A file the command writes: not a folder, in a folder that exists (checked
  before the work, not after it)."""
  if os.path.isdir(s):
    raise argparse.ArgumentTypeError(f"{s!r} is a folder, not a file name")
  folder = os.path.dirname(os.path.abspath(s))
  if not os.path.isdir(folder):
    raise argparse.ArgumentTypeError(f"{s!r}: no folder {folder!r}")
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


def detect_gpu(command: str, instead: str):
  """This host's GPU, for a command that measures; without one a
  :class:`CliError` that says what to run ``instead`` (options that exist)."""
  import jax

  from wavetune_jax.core import hardware
  try:
    return hardware.detect()
  except RuntimeError:
    raise CliError(f"no GPU here (JAX's backend is {jax.default_backend()!r}): "
                   f"wavetune {command} measures on one; without a GPU, {instead}") from None


def pyplot():
  """``matplotlib.pyplot`` with a file backend, or a :class:`CliError` naming
  the extra that installs it."""
  try:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
  except ImportError:
    raise CliError('plots need matplotlib: pip install "wavetune-jax[report]"') from None
  return plt
