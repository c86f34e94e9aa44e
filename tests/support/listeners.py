"""A TCP port that counts the connections made to it: the address of a peer nobody can dial.

Tests of reachability and relays advertise it for a peer whose real server listens elsewhere:
a call that reached it instead of going through the relay (or a dial-back made to it) shows
in ``accepted``; each connection is closed at once, so nothing is ever served there.
"""

from __future__ import annotations

import socket
import threading


class CountingListener:
    """Listens on 127.0.0.1 (a free port), counts and closes every connection made to it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.accepted = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                continue
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
        self.sock.close()
