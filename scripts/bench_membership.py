"""Membership traffic per peer as the swarm grows: heartbeat bytes/s and messages/s at each n.

Starts ``n`` real peer daemons on 127.0.0.1 for each size (a tiny task, one thread each) that
wait for a peer that never comes (``peer.expected_peers = n + 1``), so they do nothing but
keep their membership: no training, no gossip. Once every peer sees the other ``n - 1`` alive,
and after ``--settle`` seconds for the views to agree, it reads every peer's Prometheus
counters twice, ``--seconds`` apart: ``gossipgrad_sent_bytes_total{kind="heartbeat"}`` and
``gossipgrad_sent_heartbeats_total`` (absent from older peers: messages then print as -),
and prints the per-peer rates and their growth from the smallest size, beside the growth of
log2(n) and of n. A peer declared dead during the window is a false death and is counted.

    python scripts/bench_membership.py --sizes 8,16,32 --seconds 30 --out new.json
    python scripts/bench_membership.py --table old.json,new.json   # saved runs side by side

Each peer process takes about half a GiB (torch); a size that would not fit in the memory
available now is refused rather than started.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from gossipgrad.experiment.launch import LocalSwarm

HEARTBEAT_BYTES = 'gossipgrad_sent_bytes_total{kind="heartbeat"'
HEARTBEATS = "gossipgrad_sent_heartbeats_total"
PEERS = "gossipgrad_peers{"
#: Resident memory one idle peer daemon takes (torch, gRPC, the task), with some margin.
PEER_BYTES = 512 << 20


def available_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    meminfo = Path("/proc/meminfo")
    if not meminfo.exists():
        return None
    for line in meminfo.read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return None


def scrape(port: int) -> dict[str, float]:
    """The heartbeat counters and peer-state gauges of one peer's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {"bytes": 0.0}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        if name.startswith("gossipgrad_sent_bytes_total{") and 'kind="heartbeat"' in name:
            out["bytes"] += float(value)
        elif name == HEARTBEATS:
            out["messages"] = float(value)
        elif name.startswith(PEERS):
            state = name.split('state="', 1)[1].split('"', 1)[0]
            out[state] = float(value)
    return out


def measure(n: int, seconds: float, settle: float, out: Path, interval: float | None) -> dict:
    """Start ``n`` idle peers, wait until they all meet, and measure one window."""
    overrides = {
        "train.task": "digits",
        "train.steps": "1",
        "peer.expected_peers": str(n + 1),  # never reached: the peers only keep membership
        "peer.start_timeout": "3600",
    }
    if interval is not None:
        overrides["membership.heartbeat_interval"] = str(interval)
    swarm = LocalSwarm(out / f"n{n}", n, overrides)
    for attempt in range(3):  # on a loaded machine the first peer can miss its start deadline
        try:
            swarm.start()
            break
        except RuntimeError as err:
            swarm.stop(timeout=5.0)
            if attempt == 2:
                raise
            print(f"n={n}: {err}; starting again", file=sys.stderr, flush=True)
    try:
        ports = wait_until_met(swarm, n, timeout=300 + 10 * n)
        time.sleep(settle)
        before = [scrape(p) for p in ports]
        started = time.monotonic()
        time.sleep(seconds)
        after = [scrape(p) for p in ports]
        window = time.monotonic() - started
    finally:
        swarm.stop(timeout=5.0)  # idle peers waiting for a missing peer: no need to linger
    bytes_s = [(a["bytes"] - b["bytes"]) / window for a, b in zip(after, before, strict=True)]
    has_messages = all("messages" in s for s in before + after)
    msgs_s = (
        [(a["messages"] - b["messages"]) / window for a, b in zip(after, before, strict=True)]
        if has_messages
        else None
    )
    return {
        "n": n,
        "window_s": window,
        "bytes_per_s": sum(bytes_s) / n,
        "bytes_per_s_max": max(bytes_s),
        "messages_per_s": sum(msgs_s) / n if msgs_s else None,
        "messages_per_s_max": max(msgs_s) if msgs_s else None,
        "false_deaths": int(sum(s.get("dead", 0.0) for s in after)),
    }


def wait_until_met(swarm: LocalSwarm, n: int, timeout: float) -> list[int]:
    """Metrics ports of the ``n`` peers once each sees the others present and none dead."""
    deadline = time.monotonic() + timeout
    while True:
        if swarm.failed():
            raise RuntimeError(f"peers {swarm.failed()} exited; see {swarm.out}")
        ports = [swarm.status(i).metrics_port for i in range(n)]
        if all(ports):
            try:
                states = [scrape(p) for p in ports]
            except OSError:
                states = []
            # alive + suspect: the gauge moves on joins and deaths, so a peer that was
            # suspect for a moment under load may still show there
            if states and all(
                s.get("alive", 0) + s.get("suspect", 0) == n and s.get("dead") == 0 for s in states
            ):
                return ports
        if time.monotonic() > deadline:
            raise RuntimeError(f"the {n} peers did not all meet in {timeout:.0f}s")
        time.sleep(1.0)


def table(rows: list[dict]) -> str:
    """Per-peer rates and their growth from the first size of the same label, against
    log2(n) and n."""
    firsts: dict[str, dict] = {}
    lines = [
        "label    n  bytes/s/peer  msgs/s/peer  bytes/msg  growth(bytes)  growth(log2 n)  growth(n)"
        "  false deaths"
    ]
    for r in rows:
        first = firsts.setdefault(r.get("label", ""), r)
        msgs = r["messages_per_s"]
        rate = f"{msgs:.2f}" if msgs else "-"
        size = f"{r['bytes_per_s'] / msgs:.0f}" if msgs else "-"
        lines.append(
            f"{r.get('label', ''):<5} {r['n']:>4}  {r['bytes_per_s']:>12.0f}  "
            f"{rate:>11}  {size:>9}  "
            f"{r['bytes_per_s'] / first['bytes_per_s']:>13.2f}  "
            f"{math.log2(r['n']) / math.log2(first['n']):>14.2f}  "
            f"{r['n'] / first['n']:>9.2f}  {r['false_deaths']:>12}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="Example: python scripts/bench_membership.py --sizes 8,16,32 --seconds 30",
    )
    ap.add_argument("--sizes", default="8,16,32", help="comma-separated swarm sizes (>= 2)")
    ap.add_argument("--seconds", type=float, default=30.0, help="measured window per size")
    ap.add_argument(
        "--settle", type=float, default=5.0, help="seconds after all met before measuring"
    )
    ap.add_argument(
        "--interval", type=float, default=None, help="membership.heartbeat_interval (default 0.5)"
    )
    ap.add_argument("--label", default="", help="a name for this run in the table and JSON")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("--run-dir", type=Path, default=None, help="peer run dirs (default: temp)")
    ap.add_argument(
        "--table", default=None, help="only print the table of saved --out files (comma-separated)"
    )
    args = ap.parse_args(argv)
    if args.table:
        rows = [r for f in args.table.split(",") for r in json.loads(Path(f).read_text())["rows"]]
        print(table(rows))
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    if any(n < 2 for n in sizes):
        ap.error("every size must be at least 2")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-membership-") as tmp:
        run_dir = args.run_dir or Path(tmp)
        for n in sizes:
            free = available_bytes()
            if free is not None and free < n * PEER_BYTES:
                print(
                    f"n={n}: needs about {n * PEER_BYTES >> 30} GiB, {free >> 30} GiB available; "
                    "skipped",
                    file=sys.stderr,
                )
                continue
            rows.append(
                {
                    "label": args.label,
                    **measure(n, args.seconds, args.settle, run_dir, args.interval),
                }
            )
            r = rows[-1]
            print(
                f"n={n}: {r['bytes_per_s']:.0f} B/s, "
                f"{r['messages_per_s'] or 0:.2f} msgs/s per peer over {r['window_s']:.1f}s",
                file=sys.stderr,
                flush=True,
            )
    if rows:
        print(table(rows))
    if args.out is not None:
        args.out.write_text(json.dumps({"rows": rows}, indent=2))
    return 0 if rows else 1


if __name__ == "__main__":
    raise SystemExit(main())
