"""``gossipgrad-observability``: what a site needs to watch its peers, from the installed wheel.

* ``gossipgrad-observability prometheus ARGS``: a Prometheus config (static targets or
  file_sd) with recording and alert rules (:mod:`gossipgrad.experiment.prometheus_config`;
  ``--help`` lists ARGS).
* ``gossipgrad-observability grafana --out DIR``: the dashboards (``DIR/dashboards/*.json``)
  and Grafana provisioning (``DIR/provisioning/``: a file provider pointing at those
  dashboards by absolute path, and the Prometheus data source), so
  ``GF_PATHS_PROVISIONING=DIR/provisioning`` is all Grafana needs.

Both worked only from a source checkout before (``scripts/``), which the wheel does not carry.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path

log = logging.getLogger(__name__)

DATASOURCE_UID = "gossipgrad-prometheus"


def provider_yaml(dashboards_dir: Path) -> str:
    """Grafana's file provider for the dashboards in ``dashboards_dir`` (absolute)."""
    return (
        "# Written by gossipgrad-observability grafana: loads the gossipgrad dashboards.\n"
        "apiVersion: 1\n\nproviders:\n  - name: gossipgrad\n    orgId: 1\n"
        "    folder: gossipgrad\n    type: file\n    disableDeletion: true\n"
        "    allowUiUpdates: false\n    updateIntervalSeconds: 30\n    options:\n"
        f"      path: {json.dumps(str(dashboards_dir))}\n"
        "      foldersFromFilesStructure: false\n"
    )


def datasource_yaml(prometheus_url: str, scrape_interval: str) -> str:
    """The Prometheus data source every dashboard query names (uid ``gossipgrad-prometheus``)."""
    return (
        "# Written by gossipgrad-observability grafana: the dashboards' Prometheus.\n"
        "apiVersion: 1\n\ndatasources:\n"
        f"  - name: {DATASOURCE_UID}\n    uid: {DATASOURCE_UID}\n    type: prometheus\n"
        f"    access: proxy\n    url: {json.dumps(prometheus_url)}\n    isDefault: true\n"
        "    editable: false\n    jsonData:\n"
        f"      timeInterval: {json.dumps(scrape_interval)}\n      httpMethod: POST\n"
    )


def write_grafana(out: Path, prometheus_url: str, scrape_interval: str = "1s") -> list[Path]:
    """Write the dashboards and the provisioning files under ``out``; returns their paths."""
    from gossipgrad.experiment.dashboards import build_dashboards, render

    out = out.resolve()
    files = {out / "dashboards" / name: render(d) for name, d in build_dashboards().items()}
    prov = out / "provisioning"
    files[prov / "dashboards" / "gossipgrad.yaml"] = provider_yaml(out / "dashboards")
    files[prov / "datasources" / "prometheus.yaml"] = datasource_yaml(
        prometheus_url, scrape_interval
    )
    for path, text in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    log.info("wrote %d Grafana files under %s", len(files), out)
    return sorted(files)


def main(argv: list[str] | None = None) -> int:
    """The ``gossipgrad-observability`` command; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["prometheus"]:
        from gossipgrad.experiment.prometheus_config import main as prometheus_main

        return prometheus_main(argv[1:])
    ap = argparse.ArgumentParser(
        prog="gossipgrad-observability",
        description="Prometheus config and Grafana dashboards for a gossipgrad swarm. "
        "'prometheus ARGS' writes the scrape config (see 'prometheus --help').",
    )
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("prometheus", help="write a Prometheus config (see 'prometheus --help')")
    g = sub.add_parser("grafana", help="write the dashboards and Grafana provisioning")
    g.add_argument("--out", type=Path, required=True, help="folder to write them under")
    g.add_argument(
        "--prometheus-url",
        default="http://127.0.0.1:9090",
        help="URL of the Prometheus that scrapes the peers (default: %(default)s)",
    )
    g.add_argument(
        "--scrape-interval",
        default="1s",
        help="the scrape interval of the Prometheus config (default: %(default)s)",
    )
    args = ap.parse_args(argv)
    for path in write_grafana(args.out, args.prometheus_url, args.scrape_interval):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
