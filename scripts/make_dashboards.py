"""Generate gossipgrad's Grafana dashboards (grafana/dashboards/*.json) from one place.

The dashboards themselves are built by the ``scripts/dashboards/`` package (panel helpers,
PromQL, grid layout, the overview and the per-peer drill-down); this script writes them, or
checks that the committed JSON is what they build.

Usage::

    python scripts/make_dashboards.py            # rewrite grafana/dashboards/*.json
    python scripts/make_dashboards.py --check    # exit 1 if the committed JSON is stale
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from gossipgrad.experiment.dashboards import build_dashboards, render

OUT_DIR = Path(__file__).resolve().parent.parent / "grafana" / "dashboards"

__all__ = ["OUT_DIR", "build_dashboards", "main", "render"]


def stale_dashboards(out_dir: Path) -> list[str]:
    """Paths under ``out_dir`` whose text differs from (or lacks) what the generator builds."""
    stale = []
    for name, dash in build_dashboards().items():
        path = out_dir / name
        if not path.exists() or path.read_text(encoding="utf-8") != render(dash):
            stale.append(str(path))
    return stale


def write_dashboards(out_dir: Path) -> None:
    """Write every dashboard's JSON under ``out_dir`` (created)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    for name, dash in build_dashboards().items():
        (out_dir / name).write_text(render(dash), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Generate grafana/dashboards/*.json.")
    ap.add_argument("--check", action="store_true", help="fail if the committed JSON is stale")
    ap.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = ap.parse_args(argv)
    if not args.check:
        write_dashboards(args.out_dir)
        return 0
    stale = stale_dashboards(args.out_dir)
    if stale:
        sys.stderr.write(
            "stale dashboards (run scripts/make_dashboards.py): " + ", ".join(stale) + "\n"
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
