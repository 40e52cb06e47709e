"""Runs a command and reports its peak memory: the largest sum of resident
memory over the command's process tree, sampled every 0.2 s from /proc.

    python .ci/peak_mem.py --limit-gb 6 -- python -m pytest -q tests

Exits with the command's status, or 3 when the peak passes ``--limit-gb``.
"""

import argparse
import os
import subprocess
import sys
import threading
import time


def _tree_rss(root: int) -> int:
  """Resident bytes of ``root`` and all its descendants (Linux /proc)."""
  children: dict[int, list[int]] = {}
  rss: dict[int, int] = {}
  page = os.sysconf("SC_PAGE_SIZE")
  for d in os.listdir("/proc"):
    if not d.isdigit():
      continue
    try:
      with open(f"/proc/{d}/stat") as f:
        ppid = int(f.read().rsplit(")", 1)[1].split()[1])
      with open(f"/proc/{d}/statm") as f:
        rss[int(d)] = int(f.read().split()[1]) * page
    except (OSError, ValueError, IndexError):
      continue
    children.setdefault(ppid, []).append(int(d))
  total, stack = 0, [root]
  while stack:
    p = stack.pop()
    total += rss.get(p, 0)
    stack.extend(children.get(p, ()))
  return total


def main() -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--limit-gb", type=float, required=True)
  ap.add_argument("cmd", nargs=argparse.REMAINDER)
  args = ap.parse_args()
  cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
  if not cmd:
    ap.error("no command given")
  t0 = time.monotonic()
  proc = subprocess.Popen(cmd)
  peak = [0]
  done = threading.Event()

  def sample():
    while not done.wait(0.2):
      peak[0] = max(peak[0], _tree_rss(proc.pid))
  threading.Thread(target=sample, daemon=True).start()
  rc = proc.wait()
  done.set()
  gb = peak[0] / 2**30
  print(f"peak memory {gb:.2f} GB (process tree), wall {time.monotonic() - t0:.0f} s, "
        f"limit {args.limit_gb} GB", file=sys.stderr)
  if rc == 0 and gb > args.limit_gb:
    print(f"FAILED: peak memory {gb:.2f} GB is above {args.limit_gb} GB", file=sys.stderr)
    return 3
  return rc


if __name__ == "__main__":
  sys.exit(main())
