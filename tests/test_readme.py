"""Every README command that can run on a CPU, run as the README writes it.

The bash blocks' ``wavetune`` commands run in a scratch folder that links the
repository's ``data/`` (commands that need a GPU, ``pip`` and ``pytest`` lines
are skipped); then the python blocks run in the same folder.
"""

import os
import re
import shlex

import pytest

from wavetune_jax.cli import main as cli_main
from wavetune_jax.runtime import selector

ROOT = os.path.join(os.path.dirname(__file__), "..")
README = open(os.path.join(ROOT, "README.md")).read()


def _blocks(lang):
  return re.findall(rf"```{lang}\n(.*?)```", README, flags=re.S)


def _commands():
  out = []
  for block in _blocks("bash"):
    for line in block.replace("\\\n", " ").splitlines():
      line = line.split("  #")[0].strip()
      if line:
        out.append(line)
  return out


def _needs_gpu(argv):
  cmd = argv[0] if argv else ""
  return cmd == "sweep" or (cmd == "tune" and "--replay" not in argv and "--fit-only" not in argv)


def test_readme_has_the_commands_it_promises():
  cmds = _commands()
  assert "pip install -e . && wavetune demo" in cmds
  assert 'pip install -e ".[dev]" && python -m pytest -q -n 2 --dist loadfile tests' in cmds


def test_every_cpu_command_and_example_of_the_readme(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  os.symlink(os.path.abspath(os.path.join(ROOT, "data")), tmp_path / "data")
  ran = []
  for line in _commands():
    for part in line.split("&&"):
      words = shlex.split(part)
      env = {}
      while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
      if not words or words[0] != "wavetune" or _needs_gpu(words[1:]):
        continue
      for k, v in env.items():
        monkeypatch.setenv(k, v)
      selector.clear()
      assert cli_main(words[1:]) == 0, part
      for k in env:
        monkeypatch.delenv(k)
      ran.append(words[1])
  selector.clear()
  assert {"demo", "select", "report", "tune", "eval"} <= set(ran)
  namespace = {}  # the blocks continue one another, as a reader runs them
  for code in _blocks("python"):
    exec(compile(code, "README.md", "exec"), namespace)
  selector.clear()
