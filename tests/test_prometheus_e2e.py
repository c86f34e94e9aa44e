"""A real Prometheus scraping a 3-peer swarm: dashboards' PromQL and byte counters, end to end.

* The scrape config comes from scripts/prometheus_config.py (and passes ``promtool``).
* Prometheus runs on 127.0.0.1 on a free port with its own storage in a tmp dir; only the
  processes this module starts are stopped.
* Every PromQL expression of every panel of every committed dashboard must parse and return
  data through ``/api/v1/query``, with template variables resolved the way Grafana does.
* The byte counters Prometheus stored must equal what the peers' own ``/metrics`` say.

The swarm comes from :data:`SWARM`. Today that is :func:`start_fake_swarm`: three processes
running tests/fake_metrics_peer.py, each a real PeerMetrics endpoint fed realistic values.
Switching to the real daemon is one function: write ``start_daemon_swarm`` returning the same
:class:`Swarm` (peer id -> metrics address, and a ``quiesce`` that lets training finish while
the peers stay up) and point :data:`SWARM` at it.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD_DIR = ROOT / "grafana" / "dashboards"
PROMETHEUS = shutil.which("prometheus")
PROMTOOL = shutil.which("promtool")
needs_prometheus = pytest.mark.skipif(
    PROMETHEUS is None, reason="prometheus binary not found (scripts/setup.sh --test installs it)"
)
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not found (Debian package prometheus provides it)"
)

SCRAPE_INTERVAL = "1s"
# What Grafana substitutes for $__rate_interval at a 1 s scrape interval: max(interval +
# scrape, 4 x scrape) -- four scrapes.
RATE_INTERVAL = "4s"
BYTE_COUNTERS = (
    "gossipgrad_sent_bytes_total",
    "gossipgrad_received_bytes_total",
    "gossipgrad_dense_bytes_total",
)


def load_script(name: str):
    """Import scripts/<name>.py (scripts/ is not a package)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- processes ------------------------------------------------------------------------------


def stop_process(proc: subprocess.Popen, grace: float = 5.0) -> None:
    """SIGTERM one process we started, SIGKILL it if it lingers."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=grace)


@dataclass
class Swarm:
    """Peers whose metrics endpoints Prometheus scrapes."""

    targets: dict[str, str]  # peer id -> host:port of its /metrics
    quiesce: Callable[[], None]  # let training finish; the peers keep serving metrics
    procs: list[subprocess.Popen] = field(default_factory=list)

    def close(self) -> None:
        for p in self.procs:
            stop_process(p)


def start_fake_swarm(tmp: Path, n: int = 3, timeout: float = 30.0) -> Swarm:
    """``n`` fake_metrics_peer.py processes on a ring; returns once each reports its port."""
    ids = [f"peer-{i}" for i in range(n)]
    stop_file = tmp / "stop-training"
    swarm = Swarm(targets={}, quiesce=stop_file.touch)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        for i, pid in enumerate(ids):
            neighbors = sorted({ids[(i - 1) % n], ids[(i + 1) % n]} - {pid})
            cmd = [
                sys.executable,
                str(Path(__file__).with_name("fake_metrics_peer.py")),
                f"--id={pid}",
                f"--neighbors={','.join(neighbors)}",
                f"--seed={i}",
                f"--stop-file={stop_file}",
                "--max-seconds=150",
            ]
            swarm.procs.append(
                subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
            )
        deadline = time.monotonic() + timeout
        for pid, proc in zip(ids, swarm.procs, strict=True):
            line = read_line(proc, deadline)
            assert line.startswith("READY "), f"{pid} did not start: {line!r}"
            swarm.targets[pid] = f"127.0.0.1:{int(line.split()[1])}"
    except BaseException:
        swarm.close()
        raise
    return swarm


def read_line(proc: subprocess.Popen, deadline: float) -> str:
    """One stdout line of ``proc``, or fail at ``deadline``."""
    os.set_blocking(proc.stdout.fileno(), False)
    buf = b""
    while time.monotonic() < deadline:
        chunk = proc.stdout.read()
        if chunk:
            buf += chunk
            if b"\n" in buf:
                return buf.split(b"\n", 1)[0].decode()
        elif proc.poll() is not None:
            return f"<exited {proc.returncode}> {buf.decode(errors='replace')}"
        time.sleep(0.05)
    return f"<timeout> {buf.decode(errors='replace')}"


#: The swarm under test; see the module docstring for the switch to the real daemon.
SWARM: Callable[[Path], Swarm] = start_fake_swarm


@dataclass
class Prometheus:
    url: str
    proc: subprocess.Popen

    def api(self, path: str, **params: str) -> dict:
        q = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}{path}?{q}", timeout=10) as resp:
                body = json.load(resp)
        except urllib.error.HTTPError as e:  # 400 on a PromQL parse error: keep the message
            body = json.load(e)
        return body

    def query(self, expr: str) -> dict:
        return self.api("/api/v1/query", query=expr)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_prometheus(config: Path, data: Path, attempts: int = 5) -> Prometheus:
    """Start Prometheus on a free loopback port (retrying if another process takes it)."""
    last = ""
    for _ in range(attempts):
        port = free_port()
        log = (data.parent / f"prometheus-{port}.log").open("wb")
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={config}",
                f"--storage.tsdb.path={data}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        log.close()
        prom = Prometheus(f"http://127.0.0.1:{port}", proc)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and proc.poll() is None:
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{prom.url}/-/ready", timeout=1) as r,
            ):
                if r.status == 200:
                    return prom
            time.sleep(0.2)
        stop_process(proc)
        last = (data.parent / f"prometheus-{port}.log").read_text(errors="replace")[-2000:]
    raise RuntimeError(f"prometheus did not become ready: {last}")


@pytest.fixture(scope="module")
def scraped_swarm(tmp_path_factory) -> Iterator[tuple[Swarm, Prometheus]]:
    tmp = tmp_path_factory.mktemp("prom-e2e")
    swarm = SWARM(tmp)
    prom = None
    try:
        config = load_script("prometheus_config").write_prometheus_config(
            swarm.targets, tmp / "prometheus.yml", scrape_interval=SCRAPE_INTERVAL
        )
        prom = start_prometheus(config, tmp / "data")
        yield swarm, prom
    finally:
        if prom is not None:
            stop_process(prom.proc)
        swarm.close()
        shutil.rmtree(tmp, ignore_errors=True)


def wait_for(what: str, check: Callable[[], object], timeout: float, every: float = 0.5):
    """Poll ``check`` until it returns something truthy; fail with ``what`` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        got = check()
        if got:
            return got
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(every)


# --- dashboards through Prometheus ----------------------------------------------------------


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARD_DIR.glob("*.json"))}


def resolve_variables(dash: dict, prom: Prometheus) -> dict[str, str]:
    """Values Grafana would substitute for the dashboard's query variables, asked of Prometheus.

    ``label_values(metric, label)`` -> that label's values on ``metric``; a multi-value
    variable with "All" gets its ``allValue``, a single-value one its first value.
    """
    values: dict[str, str] = {"__rate_interval": RATE_INTERVAL}
    for var in dash["templating"]["list"]:
        if var["type"] != "query":
            continue
        q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        assert q.startswith("label_values(") and q.endswith(")"), q
        metric, label = (s.strip() for s in q[len("label_values(") : -1].rsplit(",", 1))
        body = prom.api(f"/api/v1/label/{label}/values", **{"match[]": metric})
        assert body["status"] == "success", body
        assert body["data"], f"variable {var['name']}: {q} has no values"
        if var.get("multi") and var.get("includeAll"):
            values[var["name"]] = var["allValue"]
        else:
            values[var["name"]] = body["data"][0]
    return values


def substitute(expr: str, values: dict[str, str]) -> str:
    # Longest names first so $peer never eats the start of a longer variable name.
    for name in sorted(values, key=len, reverse=True):
        expr = expr.replace(f"${{{name}}}", values[name]).replace(f"${name}", values[name])
    assert "$" not in expr, f"unresolved variable in {expr!r}"
    return expr


def has_finite_value(body: dict) -> bool:
    data = body["data"]
    if data["resultType"] == "scalar":
        return math.isfinite(float(data["result"][1]))
    for series in data["result"]:
        points = series.get("values") or [series["value"]]
        if any(math.isfinite(float(v)) for _, v in points):
            return True
    return False


@needs_prometheus
@pytest.mark.timeout(240)
def test_every_dashboard_query_returns_data_and_byte_counters_match(scraped_swarm) -> None:
    swarm, prom = scraped_swarm
    peers = set(swarm.targets)

    # All targets up, each series labelled with its peer id by the scrape config.
    def all_up() -> bool:
        body = prom.query('up{job="gossipgrad"} == 1')
        return {s["metric"]["peer"] for s in body["data"]["result"]} == peers

    wait_for("every peer to be scraped", all_up, timeout=30)
    # Enough history for rate() over $__rate_interval.
    time.sleep(5)

    # 1. Every expression of every panel parses and returns a finite value while peers train.
    checked = 0
    for name, dash in dashboards().items():
        values = resolve_variables(dash, prom)
        peer_var = next(v for v in dash["templating"]["list"] if v["name"] == "peer")
        body = prom.api("/api/v1/label/peer/values", **{"match[]": "gossipgrad_build_info"})
        assert set(body["data"]) == peers, f"{name}: peer variable sees {body['data']}"
        assert peer_var["query"]["query"] == "label_values(gossipgrad_build_info, peer)"
        failures = []
        for panel in dash["panels"]:
            for t in panel.get("targets", []):
                expr = substitute(t["expr"], values)
                last: dict = {}

                def answered(expr=expr) -> bool:
                    nonlocal last
                    last = prom.query(expr)
                    return last.get("status") == "success" and has_finite_value(last)

                deadline = time.monotonic() + 15
                while not answered() and time.monotonic() < deadline:
                    if last.get("errorType") == "bad_data":  # a parse error does not heal
                        break
                    time.sleep(0.5)
                if not (last.get("status") == "success" and has_finite_value(last)):
                    failures.append(f"{panel['title']!r}: {expr} -> {json.dumps(last)[:300]}")
                checked += 1
        assert not failures, f"{name}: queries without data:\n" + "\n".join(failures)
    assert checked >= 40

    # 2. Byte counters in Prometheus equal the peers' own /metrics.
    swarm.quiesce()
    for pid, target in swarm.targets.items():
        compared = wait_for(
            f"{pid}'s byte counters in Prometheus to equal its /metrics",
            lambda pid=pid, target=target: compare_byte_counters(prom, pid, target),
            timeout=30,
            every=1.0,
        )
        kinds = {key[2] for key in compared if key[0] == "gossipgrad_sent_bytes_total"}
        assert {"update", "resync", "state"} <= kinds, (pid, sorted(compared))
        assert any(key[0] == "gossipgrad_dense_bytes_total" for key in compared)
        assert all(v > 0 for key, v in compared.items() if key[2] == "update"), compared


SeriesKey = tuple[str, str, str]  # (sample name, neighbor, kind or "")


def peer_byte_counters(target: str) -> dict[SeriesKey, float]:
    """The byte counters a peer reports on its own /metrics."""
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name in BYTE_COUNTERS:
                out[s.name, s.labels["neighbor"], s.labels.get("kind", "")] = s.value
    return out


def prometheus_byte_counters(prom: Prometheus, peer: str) -> dict[SeriesKey, tuple[float, float]]:
    """Latest raw sample (timestamp, value) of each byte counter series of ``peer``."""
    names = "|".join(BYTE_COUNTERS)
    body = prom.query(f'{{__name__=~"{names}", peer="{peer}"}}[10s]')
    assert body["status"] == "success", body
    out = {}
    for series in body["data"]["result"]:
        labels = series["metric"]
        ts, v = series["values"][-1]
        out[labels["__name__"], labels["neighbor"], labels.get("kind", "")] = (ts, float(v))
    return out


def compare_byte_counters(prom: Prometheus, peer: str, target: str) -> dict[SeriesKey, float]:
    """Compare once; returns the series compared (empty: not comparable yet, try again).

    Read the peer (A), let Prometheus scrape, read Prometheus's newest samples, read the peer
    again (B). A series that did not move between A and B (heartbeats still do) was the same
    when Prometheus scraped it after A, so Prometheus must hold exactly that value.
    """
    t_a = time.time()
    before = peer_byte_counters(target)
    time.sleep(2.5)  # > 2 scrape intervals
    stored = prometheus_byte_counters(prom, peer)
    after = peer_byte_counters(target)
    assert set(stored) == set(before) == set(after), (sorted(stored), sorted(before))
    if any(ts <= t_a for ts, _ in stored.values()):
        return {}
    stable = {key: v for key, v in before.items() if after[key] == v}
    mismatched = {key: (v, stored[key][1]) for key, v in stable.items() if stored[key][1] != v}
    assert not mismatched, f"{peer}: peer /metrics vs Prometheus differ: {mismatched}"
    if not any(key[2] == "update" for key in stable):
        return {}  # still training: nothing to compare yet
    return stable


# --- the generated scrape config ------------------------------------------------------------


@needs_promtool
@pytest.mark.timeout(60)
def test_generated_config_passes_promtool(tmp_path) -> None:
    cfg = load_script("prometheus_config")
    path = cfg.write_prometheus_config(
        {"site-a": "127.0.0.1:9101", "site-b": "[::1]:9102", "site.c_3": "localhost:9103"},
        tmp_path / "prometheus.yml",
    )
    res = subprocess.run(
        [PROMTOOL, "check", "config", str(path)], capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 0, res.stdout + res.stderr
    text = path.read_text()
    for pid in ("site-a", "site-b", "site.c_3"):
        assert f'peer: "{pid}"' in text


@needs_promtool
@pytest.mark.timeout(60)
def test_cli_writes_a_config_promtool_accepts(tmp_path) -> None:
    out = tmp_path / "p.yml"
    script = str(ROOT / "scripts" / "prometheus_config.py")
    peers = ["a=127.0.0.1:9101", "b=127.0.0.1:9102"]
    res = subprocess.run(
        [sys.executable, script, "--peers", *peers, "--out", str(out), "--scrape-interval", "5s"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert res.returncode == 0, res.stderr
    assert "scrape_interval: 5s" in out.read_text()
    res = subprocess.run(
        [PROMTOOL, "check", "config", str(out)], capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 0, res.stdout + res.stderr
    bad = subprocess.run(
        [sys.executable, script, "--peers", "a=nohostport", "--out", str(tmp_path / "x.yml")],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 2 and "host:port" in bad.stderr
    assert not (tmp_path / "x.yml").exists()


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("targets", "interval"),
    [
        ({}, "1s"),
        ({"a": "127.0.0.1"}, "1s"),
        ({"a": "127.0.0.1:0"}, "1s"),
        ({"a": "127.0.0.1:70000"}, "1s"),
        ({"a b": "127.0.0.1:9100"}, "1s"),
        ({"a": "127.0.0.1:9100", "b": "127.0.0.1:9100"}, "1s"),
        ({"a": "127.0.0.1:9100"}, "1 second"),
    ],
)
def test_config_rejects_bad_input(targets, interval) -> None:
    cfg = load_script("prometheus_config")
    with pytest.raises(ValueError):
        cfg.render_prometheus_config(targets, scrape_interval=interval)
