"""Write a ready Prometheus config that scrapes a gossipgrad swarm.

Each peer's metrics endpoint becomes one static target carrying a ``peer`` label with the
peer's id -- that is how the id reaches Prometheus (metrics themselves never repeat it).

Usage::

    gossipgrad-observability prometheus --peers a=127.0.0.1:9101 b=127.0.0.1:9102 \\
        --out prometheus.yml
    prometheus --config.file=prometheus.yml --web.listen-address=127.0.0.1:9090

For a swarm running on this machine (``gossipgrad-swarm``, or daemons with ``metrics.port = 0``),
read the targets from the peers' ``status.json``::

    gossipgrad-observability prometheus --status runs/swarm/peer* --out prometheus.yml

With ``--file-sd`` the targets go to ``gossipgrad-targets.json`` next to the config
(Prometheus file-based service discovery), which Prometheus re-reads when it changes: as
peers join or leave, rewrite only that file, and Prometheus follows without a restart::

    gossipgrad-observability prometheus --status runs/swarm/peer* --out prometheus.yml \
        --file-sd --targets-only

Next to the config it writes ``gossipgrad-rules.yml``: recording rules (compression ratio,
bandwidth and round p90 per peer) and alerts (peer down, no gossip rounds, suspect peers,
rejected updates, resync storms); ``--no-rules`` leaves them out.

Importable too: ``write_prometheus_config(targets, path, scrape_interval="1s")``.
The YAML is written by hand (no PyYAML dependency); strings are emitted as JSON strings,
which are valid YAML double-quoted scalars.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from gossipgrad.peer.records import PeerStatus, read_record

JOB_NAME = "gossipgrad"
_DURATION = re.compile(r"^([0-9]+(ms|s|m|h|d|w|y))+$")
_PEER_ID = re.compile(r"^[A-Za-z0-9_.:-]+$")
_TARGET = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):([0-9]{1,5})$")


def _q(value: str) -> str:
    return json.dumps(value)


def validate_targets(targets: Mapping[str, str]) -> None:
    """Raise ValueError unless every peer id and ``host:port`` target is well formed."""
    if not targets:
        raise ValueError("no targets: pass at least one peer as id=host:port")
    seen: dict[str, str] = {}
    for peer_id, target in targets.items():
        if not _PEER_ID.match(peer_id):
            raise ValueError(f"peer id {peer_id!r} must match {_PEER_ID.pattern}")
        m = _TARGET.match(target)
        if not m or not 1 <= int(m.group(2)) <= 65535:
            raise ValueError(
                f"target {target!r} of peer {peer_id!r} must be host:port "
                "(IPv6 as [::1]:port, port 1-65535)"
            )
        if target in seen:
            raise ValueError(f"peers {seen[target]!r} and {peer_id!r} share target {target}")
        seen[target] = peer_id


RULES_FILE = "gossipgrad-rules.yml"
#: The targets file of ``--file-sd``, next to the config; re-read every FILE_SD_REFRESH too.
TARGETS_FILE = "gossipgrad-targets.json"
FILE_SD_REFRESH = "5s"

#: Recording rules (colons mark recorded series, per the Prometheus naming guide).
RECORDING_RULES: tuple[tuple[str, str], ...] = (
    (
        "peer:gossipgrad_compression_ratio:rate1m",
        "sum by (peer) (rate(gossipgrad_dense_bytes_total[1m]))"
        ' / sum by (peer) (rate(gossipgrad_sent_bytes_total{kind="update"}[1m]))',
    ),
    ("peer:gossipgrad_sent_bytes:rate1m", "sum by (peer) (rate(gossipgrad_sent_bytes_total[1m]))"),
    (
        "peer:gossipgrad_round_duration_seconds:p90_1m",
        "histogram_quantile(0.9, sum by (peer, le) "
        "(rate(gossipgrad_round_duration_seconds_bucket[1m])))",
    ),
)

#: Alerts: (name, PromQL with {job}, for, severity, summary).
ALERT_RULES: tuple[tuple[str, str, str, str, str], ...] = (
    (
        "GossipgradPeerDown",
        'up{{job="{job}"}} == 0',
        "1m",
        "critical",
        "Prometheus cannot scrape peer {{ $labels.peer }}.",
    ),
    (
        "GossipgradNoGossipRounds",
        "rate(gossipgrad_train_steps_total[2m]) > 0"
        " unless on (peer) rate(gossipgrad_gossip_rounds_total[2m]) > 0",
        "5m",
        "warning",
        "Peer {{ $labels.peer }} trains but completes no gossip rounds.",
    ),
    (
        "GossipgradPeersSuspect",
        'gossipgrad_peers{{state="suspect"}} > 0',
        "2m",
        "warning",
        "Peer {{ $labels.peer }} suspects {{ $value }} other peers.",
    ),
    (
        "GossipgradUpdatesRejected",
        'sum by (peer, reason) (rate(gossipgrad_rejected_updates_total{{reason!="stale"}}[5m]))'
        " > 0",
        "5m",
        "warning",
        "Peer {{ $labels.peer }} rejects updates ({{ $labels.reason }}).",
    ),
    (
        "GossipgradResyncStorm",
        "sum by (peer) (rate(gossipgrad_resyncs_total[5m])) > 0.05",
        "10m",
        "warning",
        "Peer {{ $labels.peer }} resyncs edges more than once per 20 s.",
    ),
)


def render_rules(job_name: str = JOB_NAME, alert_for: str | None = None) -> str:
    """Return the recording and alerting rules (YAML text) for a gossipgrad swarm.

    ``alert_for`` replaces every alert's ``for:`` duration (e.g. ``"2s"`` for a demo or a
    test that must see an alert fire within seconds); None keeps :data:`ALERT_RULES`' own.
    """
    if alert_for is not None and not _DURATION.match(alert_for):
        raise ValueError(f"alert_for {alert_for!r} is not a Prometheus duration")
    lines = [
        "# Generated by scripts/prometheus_config.py -- gossipgrad recording and alert rules.",
        "groups:",
        '  - name: "gossipgrad-recording"',
        "    rules:",
    ]
    for record, expr in RECORDING_RULES:
        lines += [f"      - record: {_q(record)}", f"        expr: {_q(expr)}"]
    lines += ['  - name: "gossipgrad-alerts"', "    rules:"]
    for name, expr, for_, severity, summary in ALERT_RULES:
        lines += [
            f"      - alert: {_q(name)}",
            f"        expr: {_q(expr.format(job=job_name))}",
            f"        for: {for_ if alert_for is None else alert_for}",
            "        labels:",
            f"          severity: {_q(severity)}",
            "        annotations:",
            f"          summary: {_q(summary)}",
        ]
    return "\n".join(lines) + "\n"


def render_prometheus_config(
    targets: Mapping[str, str],
    scrape_interval: str = "1s",
    job_name: str = JOB_NAME,
    rule_files: Sequence[str] = (),
    file_sd: str | None = None,
) -> str:
    """Return the Prometheus config (YAML text) scraping ``targets`` ({peer id: host:port}).

    ``rule_files`` are paths Prometheus resolves relative to the config file's directory.
    ``file_sd``: read the targets from that JSON file instead (:func:`render_targets_file`;
    relative to the config's directory), so they can change while Prometheus runs.
    """
    if file_sd is None:
        validate_targets(targets)
    if not _DURATION.match(scrape_interval):
        raise ValueError(f"scrape_interval {scrape_interval!r} is not a Prometheus duration")
    lines = [
        "# Generated by scripts/prometheus_config.py -- one target per gossipgrad peer.",
        "global:",
        f"  scrape_interval: {scrape_interval}",
        f"  scrape_timeout: {scrape_interval}",
        f"  evaluation_interval: {scrape_interval}",
    ]
    if rule_files:
        lines += ["rule_files:"] + [f"  - {_q(f)}" for f in rule_files]
    lines += [
        "scrape_configs:",
        f"  - job_name: {_q(job_name)}",
        "    metrics_path: /metrics",
        "    honor_labels: false",
    ]
    if file_sd is not None:
        lines += [
            "    file_sd_configs:",
            f"      - files: [{_q(file_sd)}]",
            f"        refresh_interval: {FILE_SD_REFRESH}",
        ]
        return "\n".join(lines) + "\n"
    lines.append("    static_configs:")
    for peer_id, target in sorted(targets.items()):
        lines += [
            f"      - targets: [{_q(target)}]",
            "        labels:",
            f"          peer: {_q(peer_id)}",
        ]
    return "\n".join(lines) + "\n"


def render_targets_file(targets: Mapping[str, str]) -> str:
    """The file-based service discovery JSON for ``targets``: one group per peer, its id in
    the ``peer`` label."""
    validate_targets(targets)
    groups = [{"targets": [t], "labels": {"peer": p}} for p, t in sorted(targets.items())]
    return json.dumps(groups, indent=2) + "\n"


def write_targets_file(targets: Mapping[str, str], path: str | Path) -> Path:
    """Replace the targets file atomically (Prometheus never reads half of one)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(render_targets_file(targets))
    tmp.replace(path)
    return path


def write_prometheus_config(
    targets: Mapping[str, str],
    path: str | Path,
    scrape_interval: str = "1s",
    job_name: str = JOB_NAME,
    rules: bool = True,
    alert_for: str | None = None,
    file_sd: bool = False,
) -> Path:
    """Write the config for ``targets`` ({peer id: host:port}) to ``path``; returns the path.

    With ``rules``, also writes :data:`RULES_FILE` (recording + alert rules, every alert's
    ``for:`` replaced by ``alert_for`` if given) next to it and loads it from the config.
    With ``file_sd``, the targets go to :data:`TARGETS_FILE` next to it (rewrite it with
    :func:`write_targets_file` as peers come and go).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    rule_files: list[str] = []
    if rules:
        (path.parent / RULES_FILE).write_text(render_rules(job_name, alert_for))
        rule_files.append(RULES_FILE)
    if file_sd:
        write_targets_file(targets, path.parent / TARGETS_FILE)
    text = render_prometheus_config(
        targets, scrape_interval, job_name, rule_files, TARGETS_FILE if file_sd else None
    )
    path.write_text(text)
    return path


def parse_peer_args(items: list[str]) -> dict[str, str]:
    """Turn ``["a=127.0.0.1:9101", ...]`` into ``{"a": "127.0.0.1:9101", ...}``."""
    targets: dict[str, str] = {}
    for item in items:
        peer_id, sep, target = item.partition("=")
        if not sep:
            raise ValueError(f"{item!r}: expected id=host:port")
        if peer_id in targets:
            raise ValueError(f"peer id {peer_id!r} given twice")
        targets[peer_id] = target
    return targets


def targets_from_status(paths: list[Path], host: str = "127.0.0.1") -> dict[str, str]:
    """Targets of running peers from their ``run_dir/status.json`` (``id``, ``metrics_port``).

    ``host`` is where the metrics endpoints listen (the daemon's ``metrics.host``).
    """
    targets: dict[str, str] = {}
    for path in paths:
        path = path / "status.json" if path.is_dir() else path
        try:
            status = read_record(path, PeerStatus)
        except OSError as e:
            raise ValueError(f"{path}: no peer id and metrics_port ({e})") from e
        if status is None or not status.id or status.metrics_port is None:
            raise ValueError(f"{path}: no peer id and metrics_port (missing or not JSON)")
        peer_id, port = status.id, status.metrics_port
        if not port:
            raise ValueError(f"{path}: peer {peer_id!r} serves no metrics (metrics_port 0)")
        if peer_id in targets:
            raise ValueError(f"peer id {peer_id!r} found twice")
        host_part = f"[{host}]" if ":" in host else host
        targets[peer_id] = f"{host_part}:{port}"
    return targets


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--peers", nargs="+", metavar="ID=HOST:PORT")
    src.add_argument(
        "--status",
        nargs="+",
        type=Path,
        metavar="RUN_DIR",
        help="peers' run dirs (or their status.json): targets of a running local swarm",
    )
    ap.add_argument("--metrics-host", default="127.0.0.1", help="with --status: metrics host")
    ap.add_argument("--out", required=True, help="where to write prometheus.yml ('-' = stdout)")
    ap.add_argument("--scrape-interval", default="1s")
    ap.add_argument("--job-name", default=JOB_NAME)
    ap.add_argument(
        "--no-rules",
        action="store_true",
        help=f"do not write {RULES_FILE} (recording + alert rules) next to --out",
    )
    ap.add_argument(
        "--file-sd",
        action="store_true",
        help=f"targets in {TARGETS_FILE} next to --out, re-read by Prometheus when it changes",
    )
    ap.add_argument(
        "--targets-only",
        action="store_true",
        help=f"with --file-sd: rewrite only {TARGETS_FILE} (a running Prometheus follows)",
    )
    ap.add_argument(
        "--alert-for",
        metavar="DURATION",
        help="replace every alert's 'for:' (default: each alert's own, 1m to 10m), e.g. 5s",
    )
    args = ap.parse_args(argv)
    try:
        if args.peers:
            targets = parse_peer_args(args.peers)
        else:
            targets = targets_from_status(args.status, args.metrics_host)
        if args.targets_only:
            if not args.file_sd or args.out == "-":
                raise ValueError("--targets-only needs --file-sd and an --out file")
            write_targets_file(targets, Path(args.out).parent / TARGETS_FILE)
        elif args.out == "-":
            sys.stdout.write(render_prometheus_config(targets, args.scrape_interval, args.job_name))
        else:
            write_prometheus_config(
                targets,
                args.out,
                args.scrape_interval,
                args.job_name,
                rules=not args.no_rules,
                alert_for=args.alert_for,
                file_sd=args.file_sd,
            )
    except (ValueError, OSError) as e:
        ap.error(str(e))
    return 0


if __name__ == "__main__":
    sys.exit(main())
