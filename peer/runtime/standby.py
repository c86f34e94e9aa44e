"""A warm spare: a peer process that has done its start-up work and waits for the word to go.

Starting a peer process costs seconds of CPU before it trains (the interpreter, torch, and the
``torch._dynamo`` import that a torch optimizer makes on first use: about 3 s on one core,
most of a restart's time). ``gossipgrad-peer --standby PATH`` does that work at once, then
makes ``PATH`` a named pipe (its appearance says the spare is warm) and blocks on it, using no
CPU, until something writes to it: ``KEY=VALUE`` lines, applied last as ``--set`` items. So the
site's failover script decides what only it knows then (``peer.id``, ``peer.run_dir``,
``peer.bootstrap``) and the peer is in the swarm a fraction of a second later. Write every
line in one command (the spare reads until the writer closes the pipe), once ``PATH`` is a
pipe. Only a pipe is read: a regular file at ``PATH`` (left from another run, or put there by
anyone who can write the folder) is refused, left in place, and the spare exits with an
error, since applying it would start a peer under settings nobody gave this spare. The spare
removes its pipe once it has read it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from pathlib import Path

log = logging.getLogger(__name__)


def warm_up() -> None:
    """Do now what a peer's first seconds would: import the runtime, and make torch load
    what it loads lazily when the first optimizer is built (``torch._dynamo``)."""
    import torch
    from gossipgrad.peer.runtime import daemon  # noqa: F401 - the import is the point

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)


class NotAPipe(ValueError):
    """Something other than a named pipe is at the spare's trigger path."""


def _check_not_file(trigger: Path) -> None:
    """Raise NotAPipe if ``trigger`` exists and is no named pipe (it is left alone)."""
    try:
        mode = trigger.lstat().st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISFIFO(mode):
        raise NotAPipe(
            f"standby: {trigger} exists and is not a named pipe; refusing to apply it "
            "(remove it; write the keys once the spare has made its pipe there)"
        )


def wait_for_trigger(trigger: Path) -> list[str]:
    """Warm up, wait on the named pipe ``trigger``; the ``KEY=VALUE`` lines written to it
    (blank lines and ``#`` comments left out). Raises NotAPipe if a file is at the path."""
    t0 = time.monotonic()
    _check_not_file(trigger)
    warm_up()
    # Already there: a pipe left by an earlier spare (nothing in it outlives its writer).
    with contextlib.suppress(FileExistsError):
        os.mkfifo(trigger)
    _check_not_file(trigger)  # a file put there while this spare warmed up
    log.info("standby: warm after %.1fs, waiting for keys on %s", time.monotonic() - t0, trigger)
    with open(trigger) as f:  # a pipe: blocks until a writer opens it; reads to its close
        text = f.read()
    trigger.unlink(missing_ok=True)
    items = [ln.strip() for ln in text.splitlines()]
    items = [ln for ln in items if ln and not ln.startswith("#")]
    log.info("standby: %d keys on %s: starting", len(items), trigger)
    return items
