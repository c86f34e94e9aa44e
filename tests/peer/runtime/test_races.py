"""Races between the threads of one peer, and between the ranks of one site.

The membership-change handler runs on server, push and membership threads; a site's ranks
must take every decision that ends their loop together (stop, a non-finite loss).
"""

from __future__ import annotations

import contextlib
import threading

import pytest
from support.peers import start_peers

pytestmark = pytest.mark.timeout(120)


class _SnapshotTogether(dict):
    """A dict of incarnations whose iteration waits until two threads both took their
    snapshot (or a second passed): it opens the window between reading who is known and
    dropping those who left as wide as a scheduler can."""

    def __init__(self, *args, barrier: threading.Barrier) -> None:
        super().__init__(*args)
        self.barrier = barrier

    def __iter__(self):
        keys = list(super().__iter__())
        with contextlib.suppress(threading.BrokenBarrierError):
            self.barrier.wait(timeout=1.0)
        return iter(keys)


def test_two_threads_dropping_one_peer_drop_it_once() -> None:
    """Two threads run the membership handler while a peer is gone: neither raises, the
    peer is dropped (and its edge forgotten) once."""
    p0, _p1 = start_peers(2)
    forgotten: list[str] = []
    real_forget = p0.algorithm.forget

    def counting_forget(peer: str) -> None:
        forgotten.append(peer)
        real_forget(peer)

    p0.algorithm.forget = counting_forget
    known = dict(p0._incarnations)
    assert "p1" in known
    p0._incarnations = _SnapshotTogether({**known, "ghost": 1}, barrier=threading.Barrier(2))
    errors: list[BaseException] = []

    def handler() -> None:
        try:
            p0._on_membership_change()
        except BaseException as err:
            errors.append(err)

    threads = [threading.Thread(target=handler) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    assert "ghost" not in p0._incarnations and "p1" in p0._incarnations
    assert forgotten.count("ghost") == 1
