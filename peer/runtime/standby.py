"""A warm spare: a peer process that has done its start-up work and waits for the word to go.

Starting a peer process costs seconds of CPU before it trains (the interpreter, torch, and the
``torch._dynamo`` import that a torch optimizer makes on first use: about 3 s on one core,
most of a restart's time). ``gossipgrad-peer --standby PATH`` does that work at once, writes
``PATH.ready`` (its pid), then waits until ``PATH`` exists and starts the peer with the lines
of ``PATH`` applied last, each ``KEY=VALUE`` as ``--set`` takes it. So the site's failover
script decides what only it knows then (``peer.id``, ``peer.run_dir``, ``peer.bootstrap``)
and the peer is in the swarm a fraction of a second later. Create ``PATH`` atomically (write
another name, then rename it), or the spare may read half of it.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

#: Seconds between two looks for the trigger file.
POLL_S = 0.05


def ready_path(trigger: Path) -> Path:
    """The file a spare writes (its pid) once it is warm: ``PATH.ready``."""
    return trigger.with_name(trigger.name + ".ready")


def warm_up() -> None:
    """Do now what a peer's first seconds would: import the runtime, and make torch load
    what it loads lazily when the first optimizer is built (``torch._dynamo``)."""
    import torch
    from gossipgrad.peer.runtime import daemon  # noqa: F401 - the import is the point

    torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)


def wait_for_trigger(trigger: Path) -> list[str]:
    """Warm up, announce readiness in ``PATH.ready``, block until ``trigger`` exists; its
    ``KEY=VALUE`` lines (blank lines and ``#`` comments left out)."""
    t0 = time.monotonic()
    warm_up()
    ready = ready_path(trigger)
    tmp = ready.with_name(ready.name + ".tmp")
    tmp.write_text(f"{os.getpid()}\n")
    tmp.replace(ready)
    log.info("standby: warm after %.1fs, waiting for %s", time.monotonic() - t0, trigger)
    while not trigger.exists():
        time.sleep(POLL_S)
    lines = [ln.strip() for ln in trigger.read_text().splitlines()]
    items = [ln for ln in lines if ln and not ln.startswith("#")]
    log.info("standby: %s appeared (%d keys): starting", trigger, len(items))
    return items
