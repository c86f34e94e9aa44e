"""Run a command as a child subreaper and report the orphans it adopted.

``python subreaper.py REPORT -- CMD...`` runs CMD; every process below it whose parent dies
before it is reparented to this one (Linux ``PR_SET_CHILD_SUBREAPER``) instead of to init. Once
CMD ends, REPORT gets JSON: ``adopted``, every such process (``"name (status, group G):
command line"``, running or a zombie), and ``running``, those still running after a grace of
``GRACE_S``, which are then killed; all are reaped. A command that ends its own processes
leaves both lists empty, whatever the host's init does with zombies. The exit status is
CMD's."""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

PR_SET_CHILD_SUBREAPER = 36
GRACE_S = 5.0


def adopted() -> dict[int, str]:
    """This process's children (the command is reaped already): pid → "name (status): command
    line", running or a zombie."""
    out = {}
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error, ProcessLookupError):  # ended and reaped meanwhile
            info = child.as_dict(["name", "status", "cmdline"])
            # The process group tells whose it was (a zombie keeps it, not its command line).
            group = os.getpgid(child.pid)
            out[child.pid] = (
                f"{info['name']} ({info['status']}, group {group}): "
                f"{' '.join(info['cmdline'] or ())}"
            )
    return out


def running() -> list[int]:
    """The adopted processes that have not ended (a zombie has: it only awaits a wait)."""
    alive = []
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):
            if child.status() != psutil.STATUS_ZOMBIE:
                alive.append(child.pid)
    return alive


def reap() -> None:
    with contextlib.suppress(ChildProcessError):
        while os.waitpid(-1, os.WNOHANG)[0]:
            pass


def main() -> int:
    report_path, sep, *cmd = sys.argv[1:]
    assert sep == "--" and cmd, __doc__
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")
    rc = subprocess.run(cmd, check=False).returncode
    orphans = adopted()
    # A grace for the adopted to end on their own (a daemon that exits once its last client
    # has gone), reaping them as they do; then whatever still runs is killed.
    deadline = time.monotonic() + GRACE_S
    while running() and time.monotonic() < deadline:
        reap()
        time.sleep(0.02)
    left = {pid: what for pid, what in adopted().items() if pid in running()}
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    while adopted() and time.monotonic() < deadline + 10:
        reap()
        time.sleep(0.02)
    report = {"adopted": sorted(orphans.values()), "running": sorted(left.values())}
    Path(report_path).write_text(json.dumps(report))
    return rc


if __name__ == "__main__":
    sys.exit(main())
