"""A warm spare: a peer process that has done its start-up work and waits for the word to go.

Starting a peer process costs seconds of CPU before it trains (the interpreter, torch, and the
``torch._dynamo`` import that a torch optimizer makes on first use: about 3 s on one core,
most of a restart's time). ``gossipgrad-peer --standby PATH`` does that work at once, then
makes ``PATH`` a named pipe (its appearance says the spare is warm) and blocks on it, using no
CPU, until something writes to it: ``KEY=VALUE`` lines, applied last as ``--set`` items. So the
site's failover script decides what only it knows then (``peer.id``, ``peer.run_dir``,
``peer.bootstrap``) and the peer is in the swarm a fraction of a second later. Write every
line in one command (the spare reads until the writer closes the pipe). A regular file already
at ``PATH`` when the spare is warm is read at once instead. The spare removes ``PATH`` once it
has read it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)


def warm_up() -> None:
    """Do now what a peer's first seconds would: import the runtime, and make torch load
    what it loads lazily when the first optimizer is built (``torch._dynamo``)."""
    import torch
    from gossipgrad.peer.runtime import daemon  # noqa: F401 - the import is the point

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)


def wait_for_trigger(trigger: Path) -> list[str]:
    """Warm up, wait on the named pipe ``trigger``; the ``KEY=VALUE`` lines written to it
    (blank lines and ``#`` comments left out)."""
    t0 = time.monotonic()
    warm_up()
    # Already there: a pipe left by an earlier spare, or the keys written before this one was
    # warm (a regular file, read at once).
    with contextlib.suppress(FileExistsError):
        os.mkfifo(trigger)
    log.info("standby: warm after %.1fs, waiting for keys on %s", time.monotonic() - t0, trigger)
    with open(trigger) as f:  # a pipe: blocks until a writer opens it; reads to its close
        text = f.read()
    trigger.unlink(missing_ok=True)
    items = [ln.strip() for ln in text.splitlines()]
    items = [ln for ln in items if ln and not ln.startswith("#")]
    log.info("standby: %d keys on %s: starting", len(items), trigger)
    return items
