"""Write a finished experiment's outputs: ``report.json``, ``summary.md`` and the PNG plots.

``write_outputs(out, report)`` is what the runner calls; ``gossipgrad-experiment --report DIR``
redraws them from an existing report.json (``load_report``). The numbers come from
``gossipgrad.experiment.analysis`` (``time_to_target``: when each system first reached DDP's
final metric, stored as ``report.time_to_target``), the plots from ``plots`` and summary.md
from ``markdown``; the record itself is declared in ``records``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from gossipgrad.experiment.analysis import time_to_target
from gossipgrad.experiment.markdown import markdown
from gossipgrad.experiment.plots import plot_all
from gossipgrad.experiment.records import Report

log = logging.getLogger(__name__)

REPORT_FILE = "report.json"


def load_report(out: Path) -> Report:
    """The report.json in directory ``out`` (older reports load too: see ``records``)."""
    return Report.model_validate(json.loads((Path(out) / REPORT_FILE).read_text()))


def save_report(out: Path, report: Report) -> Path:
    """Write ``report`` as ``out/report.json``; returns the path."""
    path = Path(out) / REPORT_FILE
    path.write_text(json.dumps(report.model_dump(mode="json"), indent=1))
    return path


def write_outputs(out: Path, report: Report) -> None:
    """report.json (with ``time_to_target`` recomputed), summary.md and the PNG plots into
    ``out``."""
    out = Path(out)
    report.time_to_target = time_to_target(report)
    save_report(out, report)
    (out / "summary.md").write_text(markdown(report))
    try:
        plot_all(report, out)
    except ImportError as err:
        log.warning("no plots: %s (pip install 'gossipgrad[plots]')", err)
    log.info("report written to %s", out)
