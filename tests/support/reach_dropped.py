"""Run inside a network namespace the test made (``ip netns exec``): two in-process peers on
127.0.0.1, the second advertising ``argv[1]``, an address whose inbound packets are dropped
unanswered. Prints the second peer's :class:`Reachability` and the seconds its check took,
as JSON."""

from __future__ import annotations

import dataclasses
import json
import sys
import time

from support.peers import close_started, start_peer


def main() -> None:
    p0 = start_peer("p0", [], 1, widths=(8, 4, 2))
    # Plaintext beyond loopback is refused without --insecure; the namespace is the test's.
    p1 = start_peer(
        "p1",
        [p0.address],
        2,
        {"peer.advertise": sys.argv[1], "security.insecure": True},
        widths=(8, 4, 2),
    )
    started = time.monotonic()
    found = p1.check_reachability()
    took = time.monotonic() - started
    close_started()
    print(json.dumps({**dataclasses.asdict(found), "seconds": took}))


if __name__ == "__main__":
    main()
