"""Where an on-disk cache lives: a folder set in code, else an environment
variable (a folder, or ``off``), else a default (the kernel and table caches)."""

from __future__ import annotations

import os
import pathlib
import threading
from typing import Callable

_OFF = ("", "0", "off", "false", "no")


def env_on(name: str) -> bool:
  """Whether the on/off environment variable ``name`` is on: set, and not
  empty, ``0``, ``off``, ``false`` or ``no`` (any case)."""
  return os.environ.get(name, "").strip().lower() not in _OFF


class CacheFolder:
  """One cache's folder setting. ``state`` (``{"dir", "set"}``) is what
  :meth:`set` overrides; tests save and restore it."""

  def __init__(self, env: str, default: Callable[[], pathlib.Path | None] = lambda: None):
    self.env, self.default = env, default
    self.state = {"dir": None, "set": False}
    self._lock = threading.Lock()

  def set(self, path: str | os.PathLike | None) -> None:
    with self._lock:
      self.state["dir"] = None if path is None else pathlib.Path(path).expanduser()
      self.state["set"] = True

  def get(self) -> pathlib.Path | None:
    if self.state["set"]:
      return self.state["dir"]
    env = os.environ.get(self.env)
    if env is not None:
      # (``~`` expanded: a quoted value in a .env file or a container's
      # ENV reaches here unexpanded)
      return None if env.strip().lower() in _OFF else pathlib.Path(env).expanduser()
    return self.default()
