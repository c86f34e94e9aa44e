"""The declared records: status.json and summary.json (peer side), report.json (experiment
side) read and write through their models, tolerate other versions' keys, refuse wrong types,
and docs/experiments.md shows exactly the fields the models declare."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from gossipgrad.experiment import cli
from gossipgrad.experiment.records import (
    RECORDS,
    Report,
    records_reference,
    with_records_reference,
)
from gossipgrad.peer.records import (
    PeerStatus,
    PeerSummary,
    RecordError,
    read_record,
    write_record,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from support import ROOT

pytestmark = pytest.mark.timeout(60)

SUMMARY = {
    "id": "peer0", "task": "digits", "steps": 300, "rounds": 300, "metric": "accuracy",
    "higher_is_better": True, "final": {"accuracy": 0.96, "loss": 0.12}, "train_loss": 0.05,
    "params": 26122, "evals": [{"step": 100, "seconds": 3.5, "accuracy": 0.9}],
    "sent_bytes": 390000, "sent_heartbeat_bytes": 1200, "wall_seconds": 40.0,
}  # fmt: skip


def test_missing_or_half_written_file_reads_as_none(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    assert read_record(path, PeerStatus) is None
    path.write_text('{"id": "peer0", "st')
    assert read_record(path, PeerStatus) is None


def test_wrong_type_is_an_error_naming_the_file(tmp_path: Path) -> None:
    path = tmp_path / "summary.json"
    path.write_text(json.dumps({**SUMMARY, "steps": "many"}))
    with pytest.raises(RecordError, match=r"summary\.json: not a PeerSummary.*steps"):
        read_record(path, PeerSummary)


def test_summary_round_trips_with_keys_it_does_not_declare(tmp_path: Path) -> None:
    path = tmp_path / "summary.json"
    write_record(path, PeerSummary.model_validate(SUMMARY))
    back = read_record(path, PeerSummary)
    assert back is not None and back.final["accuracy"] == 0.96 and back.steps == 300
    assert back.sent_update_bytes == 0  # declared, absent: its default
    assert (back.model_extra or {})["sent_heartbeat_bytes"] == 1200  # kept as it came
    assert not list(tmp_path.glob(".*tmp*")), "the temporary file is renamed away"


@settings(max_examples=30, deadline=None)
@given(
    step=st.integers(0, 10**9),
    loss=st.none() | st.floats(allow_nan=False, allow_infinity=False),
    state=st.sampled_from(["starting", "training", "final-rounds", "done"]),
)
def test_status_round_trips(tmp_path_factory, step: int, loss: float | None, state: str) -> None:
    path = tmp_path_factory.mktemp("s") / "status.json"
    status = PeerStatus(id="p", step=step, loss=loss, state=state, metrics_port=9100)
    write_record(path, status)
    assert read_record(path, PeerStatus) == status


def test_an_old_status_with_only_id_and_port_still_reads(tmp_path: Path) -> None:
    path = tmp_path / "status.json"
    path.write_text(json.dumps({"id": "peer2", "metrics_port": 0}))
    status = read_record(path, PeerStatus)
    assert status is not None and status.state == "starting" and status.metrics_port == 0


def test_a_minimal_report_loads_with_defaults() -> None:
    raw = {"name": "r", "mode": "local", "peers": 2, "task": "digits", "steps": 10,
           "batch_size": 8, "seed": 0}  # fmt: skip
    report = Report.model_validate(raw)
    assert report.swarm.peers == [] and report.baselines == {} and report.time_to_target is None
    with pytest.raises(ValueError, match="peers"):
        Report.model_validate({"name": "r", "mode": "local", "peers": "two"})


def test_every_declared_field_has_a_description() -> None:
    for where, model in RECORDS:
        missing = [n for n, f in model.model_fields.items() if not f.description]
        assert missing == [], f"{where}: fields without a description: {missing}"


def test_docs_records_section_is_current(tmp_path: Path) -> None:
    page = (ROOT / "docs" / "experiments.md").read_text()
    assert page == with_records_reference(page), (
        "regenerate: gossipgrad-experiment --records-reference docs/experiments.md"
    )
    for _, model in RECORDS:
        assert f"({model.__name__})" in records_reference()
    # The CLI rewrites a page's section in place, and leaves the rest alone.
    stale = tmp_path / "page.md"
    stale.write_text("intro\n<!-- records:begin -->\nold\n<!-- records:end -->\nrest\n")
    assert cli.main(["--records-reference", str(stale)]) == 0
    text = stale.read_text()
    assert text.startswith("intro\n") and text.endswith("rest\n") and "old" not in text
    assert "| `metrics_port` | `int \\| None` |" in text
