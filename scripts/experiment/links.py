"""A WAN in user space: TCP relays that delay, jitter, rate-limit and (as TCP sees it) lose
the bytes they forward, for kernels without the netem qdisc.

The emulator is four modules, one job each; this one gathers their public names and runs one
relay from the command line:

* ``link_path`` -- what a direction does to its bytes: ``Stage`` (rate, delay, jitter, loss,
  reset), ``Serializer`` (a shared transmitter), ``LinkPath`` (release time of each chunk).
* ``link_relay`` -- ``Relay``: a socket on 127.0.0.1:0 forwarding each connection to one
  upstream through a forward and a reverse path, a pipe rather than store-and-forward.
* ``link_emulator`` -- ``LinkEmulator``: every relay on one asyncio loop in one thread.
* ``link_swarm`` -- ``SwarmRelays``: the relays of a whole ``[network]`` spec section.

::

    with LinkEmulator() as emu:
        relay = emu.add("0->1", "127.0.0.1:5000", [Stage(delay=0.02)], [Stage(delay=0.02)])
        sock = socket.create_connection(relay.address_tuple)   # 40 ms RTT to :5000

``python -m gossipgrad.experiment.links --to HOST:PORT --delay 20ms`` runs one relay until
Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import logging
import signal
import sys
import threading

from gossipgrad.experiment.link_emulator import LinkEmulator
from gossipgrad.experiment.link_path import LinkPath, LinkReset, PathStats, Serializer, Stage
from gossipgrad.experiment.link_relay import Relay
from gossipgrad.experiment.link_swarm import SwarmRelays, site_host
from gossipgrad.experiment.spec import LinkProfile
from pydantic import ValidationError

__all__ = [
    "LinkEmulator",
    "LinkPath",
    "LinkReset",
    "PathStats",
    "Relay",
    "Serializer",
    "Stage",
    "SwarmRelays",
    "build_parser",
    "main",
    "site_host",
]

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m gossipgrad.experiment.links",
        description="Run one emulated WAN link: a TCP relay on 127.0.0.1 that forwards to "
        "--to with the given one-way delay, jitter, rate and loss in each direction, until "
        "Ctrl-C. Prints its address as JSON on the first line.",
    )
    p.add_argument("--to", required=True, metavar="HOST:PORT", help="upstream address")
    p.add_argument("--delay", default=None, help="one-way delay each way, e.g. 20ms")
    p.add_argument("--jitter", default=None, help="delay variation each way, e.g. 5ms")
    p.add_argument("--rate", default=None, help="bandwidth each way, e.g. 20mbit")
    p.add_argument("--loss", type=float, default=0.0, help="packet loss in percent each way")
    p.add_argument("--reset", type=float, default=0.0, help="reset chance in percent per packet")
    p.add_argument("--seed", type=int, default=0, help="seed of jitter, loss and resets")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        profile = LinkProfile(
            rate=args.rate, delay=args.delay, jitter=args.jitter, loss=args.loss, reset=args.reset
        )
    except ValidationError as err:
        problems = "; ".join(f"--{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in err.errors())
        sys.stderr.write(f"links: {problems}\n")
        return 2
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    stop = threading.Event()
    emu = LinkEmulator()
    relay = emu.add(
        "relay", args.to, [Stage.from_profile(profile)], [Stage.from_profile(profile)],
        seed=args.seed,
    )  # fmt: skip
    with emu:
        sys.stdout.write(json.dumps({"address": relay.address}) + "\n")
        sys.stdout.flush()
        try:
            while not stop.wait(3600):
                pass
        except KeyboardInterrupt:
            log.info("stopping relay %s", relay.address)
        stats = relay.stats()
    log.info("relay stats: %s", json.dumps(stats))
    return 0


if __name__ == "__main__":
    sys.exit(main())
