"""PeerMetrics: names, label sets, pre-created children, counters, HTTP endpoint; dashboards.

Every test builds its own PeerMetrics on a fresh CollectorRegistry.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import socket
import time
import urllib.request

import pytest
from gossipgrad.peer.metrics import (
    DEPARTED,
    MESSAGE_KINDS,
    PEER_STATES,
    REJECT_REASONS,
    UNATTRIBUTED,
    PeerMetrics,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from support import ROOT

# The metric families the brief asks for, with their label names (the peer id is a target
# label added by Prometheus, never a metric label).
EXPECTED = {
    "gossipgrad_sent_bytes": ("counter", {"neighbor", "kind"}),
    "gossipgrad_received_bytes": ("counter", {"neighbor", "kind"}),
    "gossipgrad_dense_bytes": ("counter", {"neighbor"}),
    "gossipgrad_train_steps": ("counter", set()),
    "gossipgrad_samples": ("counter", set()),
    "gossipgrad_train_loss": ("gauge", set()),
    "gossipgrad_eval_metric": ("gauge", {"name"}),
    "gossipgrad_gossip_rounds": ("counter", set()),
    "gossipgrad_round_duration_seconds": ("histogram", set()),
    "gossipgrad_push_duration_seconds": ("histogram", {"neighbor"}),
    "gossipgrad_compress_duration_seconds": ("histogram", set()),
    "gossipgrad_consensus_distance": ("gauge", set()),
    "gossipgrad_error_feedback_norm": ("gauge", set()),
    "gossipgrad_peers": ("gauge", {"state"}),
    "gossipgrad_neighbors": ("gauge", set()),
    "gossipgrad_first_mix_seconds": ("gauge", set()),
    "gossipgrad_reachable": ("gauge", set()),
    "gossipgrad_relay_forwarded_bytes": ("counter", {"attached"}),
    "gossipgrad_relay_tunnels": ("counter", {"how"}),
    "gossipgrad_relayed_bytes": ("counter", {"relay"}),
    "gossipgrad_rejected_updates": ("counter", {"reason"}),
    "gossipgrad_resyncs": ("counter", {"neighbor"}),
    "gossipgrad_exchanges": ("counter", {"neighbor"}),
    "gossipgrad_push_lane_dropped": ("counter", {"neighbor"}),
    "gossipgrad_anchor_mismatches": ("counter", set()),
    "gossipgrad_build_info": ("gauge", {"version", "algorithm", "codec", "topology"}),
}


def load_script(name: str):
    """Import scripts/<name>.py (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def value(m: PeerMetrics, sample: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(sample, labels)


def filled(m: PeerMetrics) -> PeerMetrics:
    """Touch every metric once so every family has samples with all its labels."""
    m.set_build_info(version="0.1.0", algorithm="choco", codec="topk>>int8", topology="ring")
    m.record_sent("b", "update", 100, dense_bytes=4000)
    m.record_received("b", "update", 90)
    m.record_step(loss=1.5, samples=32)
    m.set_eval({"accuracy": 0.5})
    m.observe_round(0.2)
    m.observe_push("b", 0.05)
    m.observe_compress(0.01)
    m.set_consensus_distance(0.3)
    m.set_error_feedback_norm(2.0)
    m.set_peers(alive=2, suspect=0, dead=0)
    m.set_neighbors(1)
    m.record_relay_forwarded("b", 100)
    m.record_relay_tunnel("spliced")
    m.record_relayed("b", 100)
    return m


@pytest.mark.timeout(30)
def test_declares_every_expected_family_with_its_labels() -> None:
    m = filled(PeerMetrics())
    families = {f.name: f for f in m.registry.collect()}
    for name, (kind, labels) in EXPECTED.items():
        assert name in families, f"missing {name}"
        fam = families[name]
        assert fam.type == kind, name
        sample_labels = {
            frozenset(set(s.labels) - {"le"})
            for s in fam.samples
            if not s.name.endswith("_created")
        }
        assert sample_labels == {frozenset(labels)}, name


@pytest.mark.timeout(30)
def test_names_follow_the_naming_rule() -> None:
    m = filled(PeerMetrics())
    for fam in m.registry.collect():
        assert fam.name.startswith("gossipgrad_"), fam.name
        assert ":" not in fam.name
        assert "peer" not in {lbl for s in fam.samples for lbl in s.labels}, fam.name
        for s in fam.samples:
            if fam.type == "counter" and not s.name.endswith("_created"):
                assert s.name.endswith("_total"), s.name
            if fam.type == "histogram":
                assert fam.name.endswith("_seconds"), fam.name


@pytest.mark.timeout(30)
def test_closed_label_sets_exist_before_the_first_event() -> None:
    m = PeerMetrics()
    for reason in REJECT_REASONS:
        assert value(m, "gossipgrad_rejected_updates_total", reason=reason) == 0.0
    for state in PEER_STATES:
        assert value(m, "gossipgrad_peers", state=state) == 0.0
    assert value(m, "gossipgrad_sent_bytes_total", neighbor="b", kind="update") is None
    m.add_neighbor("b")
    for kind in MESSAGE_KINDS:
        assert value(m, "gossipgrad_sent_bytes_total", neighbor="b", kind=kind) == 0.0
        assert value(m, "gossipgrad_received_bytes_total", neighbor="b", kind=kind) == 0.0
    assert value(m, "gossipgrad_dense_bytes_total", neighbor="b") == 0.0
    assert value(m, "gossipgrad_resyncs_total", neighbor="b") == 0.0
    assert value(m, "gossipgrad_push_duration_seconds_count", neighbor="b") == 0.0


@pytest.mark.timeout(30)
def test_counters_and_gauges_move() -> None:
    m = PeerMetrics()
    m.record_sent("b", "update", 120, dense_bytes=4000)
    m.record_sent("b", "update", 80, dense_bytes=4000)
    m.record_sent("c", "heartbeat", 12)
    m.record_received("c", "resync", 5000)
    m.record_rejected("stale")
    m.record_rejected("stale")
    m.record_resync("c")
    m.record_step(loss=2.5, samples=64)
    m.record_step(loss=2.0, samples=64)
    m.set_eval({"accuracy": 0.75, "loss": 0.9})
    m.observe_round(0.3)
    m.observe_round(1.5)
    m.observe_push("b", 0.02)
    m.observe_compress(0.004)
    m.set_consensus_distance(0.125)
    m.set_error_feedback_norm(3.5)
    m.set_peers(alive=3, suspect=1, dead=2)
    m.set_neighbors(2)

    assert value(m, "gossipgrad_sent_bytes_total", neighbor="b", kind="update") == 200
    assert value(m, "gossipgrad_dense_bytes_total", neighbor="b") == 8000
    assert value(m, "gossipgrad_sent_bytes_total", neighbor="c", kind="heartbeat") == 12
    assert value(m, "gossipgrad_dense_bytes_total", neighbor="c") == 0
    assert value(m, "gossipgrad_received_bytes_total", neighbor="c", kind="resync") == 5000
    assert value(m, "gossipgrad_rejected_updates_total", reason="stale") == 2
    assert value(m, "gossipgrad_rejected_updates_total", reason="malformed") == 0
    assert value(m, "gossipgrad_resyncs_total", neighbor="c") == 1
    assert value(m, "gossipgrad_train_steps_total") == 2
    assert value(m, "gossipgrad_samples_total") == 128
    assert value(m, "gossipgrad_train_loss") == 2.0
    assert value(m, "gossipgrad_eval_metric", name="accuracy") == 0.75
    assert value(m, "gossipgrad_eval_metric", name="loss") == 0.9
    assert value(m, "gossipgrad_gossip_rounds_total") == 2
    assert value(m, "gossipgrad_round_duration_seconds_count") == 2
    assert value(m, "gossipgrad_round_duration_seconds_sum") == pytest.approx(1.8)
    assert value(m, "gossipgrad_round_duration_seconds_bucket", le="0.5") == 1
    assert value(m, "gossipgrad_push_duration_seconds_count", neighbor="b") == 1
    assert value(m, "gossipgrad_compress_duration_seconds_count") == 1
    assert value(m, "gossipgrad_consensus_distance") == 0.125
    assert value(m, "gossipgrad_error_feedback_norm") == 3.5
    assert value(m, "gossipgrad_peers", state="suspect") == 1
    assert value(m, "gossipgrad_peers", state="dead") == 2
    assert value(m, "gossipgrad_neighbors") == 2
    assert m.neighbor_ids == {"b", "c"}


@pytest.mark.timeout(30)
def test_first_mix_is_the_time_from_serving_to_the_first_round_that_mixed() -> None:
    m = PeerMetrics()
    m.set_neighbors(2)  # not serving yet: no origin to count from
    assert math.isnan(value(m, "gossipgrad_first_mix_seconds"))
    m = PeerMetrics()
    t0 = time.monotonic()
    m.mark_serving()
    m.set_neighbors(0)  # a round that mixed nobody
    assert math.isnan(value(m, "gossipgrad_first_mix_seconds"))
    time.sleep(0.05)
    m.set_neighbors(1)
    first = value(m, "gossipgrad_first_mix_seconds")
    assert 0.05 <= first <= time.monotonic() - t0
    time.sleep(0.02)
    m.set_neighbors(2)  # later rounds leave it as it was
    assert value(m, "gossipgrad_first_mix_seconds") == first


@pytest.mark.timeout(30)
def test_unattributed_traffic_has_an_empty_neighbor_and_no_neighbor_children() -> None:
    m = PeerMetrics()
    m.record_sent(UNATTRIBUTED, "heartbeat", 48)
    m.record_received(UNATTRIBUTED, "heartbeat", 40)
    assert value(m, "gossipgrad_sent_bytes_total", neighbor="", kind="heartbeat") == 48
    assert value(m, "gossipgrad_received_bytes_total", neighbor="", kind="heartbeat") == 40
    assert value(m, "gossipgrad_sent_bytes_total", neighbor="", kind="update") is None
    assert value(m, "gossipgrad_resyncs_total", neighbor="") is None
    assert m.neighbor_ids == frozenset()


@pytest.mark.timeout(30)
def test_build_info_is_replaced_not_accumulated() -> None:
    m = PeerMetrics()
    m.set_build_info(version="0.1.0", algorithm="choco", codec="topk", topology="ring")
    m.set_build_info(version="0.1.0", algorithm="ef", codec="int8", topology="full")
    samples = [
        s for f in m.registry.collect() if f.name == "gossipgrad_build_info" for s in f.samples
    ]
    assert [(s.labels["algorithm"], s.value) for s in samples] == [("ef", 1.0)]


@pytest.mark.timeout(30)
def test_remove_neighbor_drops_its_series_and_keeps_its_counts() -> None:
    m = PeerMetrics()
    m.record_sent("b", "update", 10, dense_bytes=40)
    m.record_received("b", "resync", 7)
    m.record_resync("b")
    m.observe_push("b", 0.1)
    m.record_sent("c", "update", 10)
    m.remove_neighbor("b")
    assert value(m, "gossipgrad_sent_bytes_total", neighbor="b", kind="update") is None
    assert value(m, "gossipgrad_dense_bytes_total", neighbor="b") is None
    assert value(m, "gossipgrad_push_duration_seconds_count", neighbor="b") is None
    assert value(m, "gossipgrad_sent_bytes_total", neighbor="c", kind="update") == 10
    # Totals over neighbours never go down: b's counts live on as the departed series.
    assert value(m, "gossipgrad_sent_bytes_total", neighbor=DEPARTED, kind="update") == 10
    assert value(m, "gossipgrad_received_bytes_total", neighbor=DEPARTED, kind="resync") == 7
    assert value(m, "gossipgrad_dense_bytes_total", neighbor=DEPARTED) == 40
    assert value(m, "gossipgrad_resyncs_total", neighbor=DEPARTED) == 1
    m.record_sent("b", "update", 3)
    assert value(m, "gossipgrad_sent_bytes_total", neighbor="b", kind="update") == 3
    m.remove_neighbor("b")
    assert value(m, "gossipgrad_sent_bytes_total", neighbor=DEPARTED, kind="update") == 13


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "call",
    [
        lambda m: m.record_rejected("bad_luck"),
        lambda m: m.record_rejected("Stale"),
        lambda m: m.record_sent("b", "gradient", 10),
        lambda m: m.record_received("b", "update", -1),
        lambda m: m.record_sent("b", "update", 10, dense_bytes=float("nan")),
        lambda m: m.add_neighbor(""),
        lambda m: m.observe_push("", 0.1),
        lambda m: m.record_resync(""),
        lambda m: m.observe_round(-0.1),
        lambda m: m.set_peers(alive=-1, suspect=0, dead=0),
        lambda m: m.set_eval({"": 1.0}),
        lambda m: m.set_eval({f"m{i}": 0.0 for i in range(100)}),
    ],
)
def test_bad_input_raises_value_error(call) -> None:
    m = PeerMetrics()
    with pytest.raises(ValueError):
        call(m)
    # Nothing was counted on the way to the error.
    assert value(m, "gossipgrad_sent_bytes_total", neighbor="b", kind="update") in (None, 0.0)
    assert all(value(m, "gossipgrad_rejected_updates_total", reason=r) == 0 for r in REJECT_REASONS)


@pytest.mark.timeout(30)
def test_registries_are_separate() -> None:
    reg = CollectorRegistry()
    a, b = PeerMetrics(registry=reg), PeerMetrics()
    assert a.registry is reg and b.registry is not reg
    a.record_step(loss=1.0, samples=1)
    assert value(a, "gossipgrad_train_steps_total") == 1
    assert value(b, "gossipgrad_train_steps_total") == 0


events = st.lists(
    st.tuples(
        st.sampled_from(["n0", "n1", "n2"]),
        st.sampled_from(MESSAGE_KINDS),
        st.integers(min_value=0, max_value=2**40),
        st.booleans(),
    ),
    max_size=40,
)


@pytest.mark.timeout(120)
@settings(max_examples=60, deadline=None)
@given(events)
def test_byte_counters_equal_sums_and_survive_the_text_format(evs) -> None:
    """Law: every recorded byte is counted once, and the exposition text round-trips it."""
    m = PeerMetrics()
    want_sent: dict[tuple[str, str], int] = {}
    want_recv: dict[tuple[str, str], int] = {}
    for neighbor, kind, n, outgoing in evs:
        if outgoing:
            m.record_sent(neighbor, kind, n)
            want_sent[neighbor, kind] = want_sent.get((neighbor, kind), 0) + n
        else:
            m.record_received(neighbor, kind, n)
            want_recv[neighbor, kind] = want_recv.get((neighbor, kind), 0) + n
    from prometheus_client import generate_latest

    text = generate_latest(m.registry).decode()
    got_sent: dict[tuple[str, str], float] = {}
    got_recv: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "gossipgrad_sent_bytes_total":
                got_sent[s.labels["neighbor"], s.labels["kind"]] = s.value
            elif s.name == "gossipgrad_received_bytes_total":
                got_recv[s.labels["neighbor"], s.labels["kind"]] = s.value
    neighbors = {e[0] for e in evs}
    assert set(got_sent) == {(n, k) for n in neighbors for k in MESSAGE_KINDS}
    for key, got in got_sent.items():
        assert got == want_sent.get(key, 0)
    for key, got in got_recv.items():
        assert got == want_recv.get(key, 0)
    # status.json's totals: every byte once, per kind and overall, and a departure (its
    # series folded into the departed one) takes nothing away.
    want = {"sent_bytes": sum(want_sent.values()), "received_bytes": sum(want_recv.values())}
    for kind in MESSAGE_KINDS:
        want[f"sent_{kind}_bytes"] = sum(v for (_, k), v in want_sent.items() if k == kind)
        want[f"received_{kind}_bytes"] = sum(v for (_, k), v in want_recv.items() if k == kind)
    want["dense_bytes"] = 0
    assert m.traffic_totals() == want
    # summary.json's bytes per neighbour: the same sums, per edge and direction.
    per_edge = {
        n: {
            "sent": sum(v for (nb, _), v in want_sent.items() if nb == n),
            "received": sum(v for (nb, _), v in want_recv.items() if nb == n),
        }
        for n in neighbors
    }
    assert m.bytes_by_neighbour() == per_edge
    m.remove_neighbor("n0")
    assert m.traffic_totals() == want
    if "n0" in per_edge:
        per_edge[DEPARTED] = per_edge.pop("n0")
    assert m.bytes_by_neighbour() == per_edge


@pytest.mark.timeout(30)
def test_http_endpoint_serves_the_text_format_on_loopback() -> None:
    m = filled(PeerMetrics())
    port = m.serve()
    try:
        assert port > 0 and m.port == port
        assert m._server.server_address[0] == "127.0.0.1"  # loopback unless asked otherwise
        with pytest.raises(RuntimeError):
            m.serve()
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
            text = resp.read().decode()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        sent = {
            (s.labels["neighbor"], s.labels["kind"]): s.value
            for s in fams["gossipgrad_sent_bytes"].samples
            if s.name == "gossipgrad_sent_bytes_total"
        }
        assert sent["b", "update"] == 100
        assert set(EXPECTED) <= set(fams)
    finally:
        m.stop()
    assert m.port is None
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass
    m.stop()  # idempotent


@pytest.mark.timeout(60)
def test_experiment_runner_reads_edge_bytes_from_the_exposition() -> None:
    """The runner's bytes-per-link plot sums a peer's byte counters per neighbour."""
    from gossipgrad.experiment.swarm_sampling import edge_bytes
    from prometheus_client import generate_latest

    m = PeerMetrics()
    m.record_sent("b", "update", 100, dense_bytes=4000)
    m.record_sent("b", "heartbeat", 12)
    m.record_received("b", "resync", 5000)
    m.record_received("c", "update", 7)
    m.record_sent(UNATTRIBUTED, "heartbeat", 3)
    got = edge_bytes(generate_latest(m.registry).decode())
    assert got["b"] == {"sent": 112, "received": 5000}
    assert got["c"] == {"sent": 0, "received": 7}
    assert got[UNATTRIBUTED] == {"sent": 3, "received": 0}
    assert set(got) == {"b", "c", UNATTRIBUTED}
    # summary.json's final counts: the same per neighbour, heartbeats to nobody left out.
    assert m.bytes_by_neighbour() == {k: v for k, v in got.items() if k != UNATTRIBUTED}


# --- dashboards -----------------------------------------------------------------------------

DASHBOARD_DIR = ROOT / "grafana" / "dashboards"


def dashboard_exprs(dash: dict) -> list[str]:
    return [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]


@pytest.mark.timeout(60)
@pytest.mark.usefixtures("scripts_on_path")  # make_dashboards imports scripts/dashboards/
def test_committed_dashboards_equal_the_generator_output() -> None:
    gen = load_script("make_dashboards")
    built = gen.build_dashboards()
    assert sorted(built) == sorted(p.name for p in DASHBOARD_DIR.glob("*.json"))
    for name, dash in built.items():
        committed = (DASHBOARD_DIR / name).read_text(encoding="utf-8")
        assert committed == gen.render(dash), f"{name} is stale: run scripts/make_dashboards.py"


@pytest.mark.timeout(60)
def test_dashboards_only_query_metrics_that_exist() -> None:
    m = filled(PeerMetrics())
    exported = {s.name for f in m.registry.collect() for s in f.samples}
    for path in sorted(DASHBOARD_DIR.glob("*.json")):
        dash = json.loads(path.read_text(encoding="utf-8"))
        exprs = dashboard_exprs(dash)
        assert exprs, path.name
        for expr in exprs:
            for name in re.findall(r"\bgossipgrad_[a-z_]+", expr):
                assert name in exported, f"{path.name}: {name} in {expr!r} is not exported"


@pytest.mark.timeout(60)
def test_dashboard_structure() -> None:
    needed_overview = [
        "gossipgrad_sent_bytes_total",
        "gossipgrad_received_bytes_total",
        "gossipgrad_dense_bytes_total",
        "gossipgrad_train_loss",
        'name="accuracy"',
        "gossipgrad_consensus_distance",
        "gossipgrad_train_steps_total",
        "gossipgrad_gossip_rounds_total",
        "histogram_quantile",
        "gossipgrad_peers",
        "gossipgrad_rejected_updates_total",
        "gossipgrad_resyncs_total",
        "gossipgrad_relay_forwarded_bytes_total",
    ]
    dashes = {p.name: json.loads(p.read_text()) for p in DASHBOARD_DIR.glob("*.json")}
    assert len({d["uid"] for d in dashes.values()}) == len(dashes)
    for name, dash in dashes.items():
        variables = {v["name"]: v for v in dash["templating"]["list"]}
        assert {"datasource", "peer"} <= set(variables), name
        ids = [p["id"] for p in dash["panels"]]
        assert len(ids) == len(set(ids)), name
        for p in dash["panels"]:
            g = p["gridPos"]
            assert g["x"] >= 0 and g["x"] + g["w"] <= 24, (name, p["title"])
            if p["type"] != "row":
                assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
                assert p["targets"] and all("$peer" in t["expr"] for t in p["targets"])
    overview = " ".join(dashboard_exprs(dashes["gossipgrad-overview.json"]))
    for needle in needed_overview:
        assert needle in overview, needle
    peer_vars = {
        name: next(v for v in d["templating"]["list"] if v["name"] == "peer")
        for name, d in dashes.items()
    }
    assert peer_vars["gossipgrad-overview.json"]["includeAll"] is True
    assert peer_vars["gossipgrad-peer.json"]["multi"] is False  # the drill-down shows one peer


@pytest.mark.timeout(30)
def test_provisioning_points_at_the_dashboards_and_prometheus() -> None:
    prov = ROOT / "grafana" / "provisioning"
    ds = (prov / "datasources" / "prometheus.yaml").read_text()
    assert "type: prometheus" in ds and "${GOSSIPGRAD_PROMETHEUS_URL}" in ds
    dashboards = (prov / "dashboards" / "gossipgrad.yaml").read_text()
    assert "path: ${GOSSIPGRAD_GRAFANA_DIR}/dashboards" in dashboards


@pytest.mark.timeout(30)
def test_every_metric_is_documented() -> None:
    doc = (ROOT / "docs" / "observability.md").read_text(encoding="utf-8")
    m = filled(PeerMetrics())
    for fam in m.registry.collect():
        name = f"{fam.name}_total" if fam.type == "counter" else fam.name
        assert f"`{name}`" in doc, f"{name} missing from docs/observability.md"
    for value_set in (MESSAGE_KINDS, REJECT_REASONS, PEER_STATES):
        for v in value_set:
            assert f"`{v}`" in doc, v


def _has_ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


@pytest.mark.timeout(30)
@pytest.mark.skipif(not _has_ipv6_loopback(), reason="no IPv6 loopback on this machine")
def test_http_endpoint_on_ipv6_loopback() -> None:
    m = PeerMetrics()
    m.record_step(loss=0.5, samples=8)
    port = m.serve(host="::1")
    try:
        with urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
        assert "gossipgrad_samples_total 8.0" in text
    finally:
        m.stop()


@pytest.mark.timeout(60)
def test_time_blocked_waiting_for_a_silent_neighbour_is_counted() -> None:
    """p1 never steps: p0's first round waits its round_timeout (1 s) for it. That wait is
    blocked time; the optimizer step itself is not."""
    import torch
    from support.optimizers import start_optimizers

    opts = start_optimizers(2, algorithm="choco", round_timeout=1.0, local_steps=1)
    p0 = opts[0]
    try:
        for _ in range(3):
            p0.flat.set_grad(torch.ones_like(p0.flat.data))
            p0.step()
        counted = value(p0.metrics, "gossipgrad_gossip_blocking_seconds_total")
        assert counted == pytest.approx(p0.blocking_seconds)
        assert 0.9 <= p0.blocking_seconds < 10.0
        assert value(opts[1].metrics, "gossipgrad_gossip_blocking_seconds_total") == 0.0
    finally:
        for o in opts:
            o.close()
