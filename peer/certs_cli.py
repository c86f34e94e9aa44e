"""``gossipgrad-peer certs``: create a swarm CA and one certificate per peer.

Example::

    gossipgrad-peer certs --out certs site-a site-b site-c --host site-a=203.0.113.7

writes ``certs/ca.pem``, ``certs/ca.key`` (keep it off the peers) and ``<id>.pem`` /
``<id>.key`` per peer. Run it again with new ids to add peers under the same CA. Each site
then gets ``ca.pem`` and its own pair, set as ``security.ca``, ``security.cert``,
``security.key`` (SECURITY.md).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from gossipgrad.peer.security import write_swarm_certs

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gossipgrad-peer certs",
        description="Create (or reuse) a swarm CA in --out and sign a certificate for each "
        "peer id.",
    )
    parser.add_argument("ids", nargs="+", help="peer ids (each must equal that peer's peer.id)")
    parser.add_argument("--out", type=Path, default=Path("certs"), help="output directory")
    parser.add_argument(
        "--host",
        action="append",
        default=[],
        metavar="ID=HOST[,HOST]",
        help="extra subject alternative names (DNS names or IPs) for one peer; repeatable",
    )
    parser.add_argument("--days", type=int, default=825, help="validity of peer certificates")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    hosts: dict[str, list[str]] = {}
    for item in args.host:
        pid, sep, names = item.partition("=")
        if not sep or pid not in args.ids:
            print(
                f"gossipgrad-peer certs: --host {item!r}: need ID=HOST with a listed id",
                file=sys.stderr,
            )
            return 2
        hosts.setdefault(pid, []).extend(h for h in names.split(",") if h)
    try:
        paths = write_swarm_certs(args.out, args.ids, hosts, days=args.days)
    except (OSError, ValueError) as err:
        print(f"gossipgrad-peer certs: {err}", file=sys.stderr)
        return 1
    sys.stdout.write(f"CA: {paths.ca} (private key {paths.ca_key}: keep it off the peers)\n")
    for pid in args.ids:
        sys.stdout.write(f"{pid}: {paths.certs[pid]} {paths.keys[pid]}\n")
    return 0
