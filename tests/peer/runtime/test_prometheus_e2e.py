"""A real Prometheus scraping a 3-peer swarm: dashboards' PromQL and byte counters, end to end.

* The scrape config comes from scripts/prometheus_config.py (and passes ``promtool``).
* Prometheus runs on 127.0.0.1 on a free port with its own storage in a tmp dir; only the
  processes this module starts are stopped.
* Every PromQL expression of every panel of every committed dashboard must parse and return
  data through ``/api/v1/query``, with template variables resolved the way Grafana does.
* The byte counters Prometheus stored must equal what the peers' own ``/metrics`` say.

Two kinds of swarm (:data:`SWARM_KINDS`, env ``GOSSIPGRAD_E2E_SWARMS``): ``daemon`` -- three
real peer daemons (``python -m gossipgrad.peer --config site.toml``) training the digits task
over gRPC -- and ``fake`` -- three tests/support/fake_metrics_peer.py processes, real PeerMetrics
endpoints fed realistic values, deterministic in shape and quick to start.

Prometheus scrapes each peer through a pass-through recorder (:class:`ScrapeRecorder`) that
keeps the exposition the peer served for every scrape, so "the bytes Prometheus stored equal
what the peer said" is checked exactly, sample by sample, while counters keep moving.
"""

from __future__ import annotations

import contextlib
import http.server
import importlib.util
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from gossipgrad.peer.metric_vocabulary import DEPARTED
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families
from support import ROOT, TESTS

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
# Every alert's ``for:`` in the generated rules (their own are minutes), so that an alert can
# be seen firing within seconds.
ALERT_FOR = "2s"
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
    procs: list[subprocess.Popen] = field(default_factory=list)
    logs: list[Path] = field(default_factory=list)

    def check_alive(self) -> None:
        """Fail (with the log tails) if a peer process has exited."""
        dead = [(p.args, p.returncode) for p in self.procs if p.poll() is not None]
        if dead:
            tails = "\n".join(f"--- {log}\n{tail(log)}" for log in self.logs)
            pytest.fail(f"peer processes exited: {dead}\n{tails}")

    def close(self, grace: float = 20.0) -> None:
        """SIGTERM every peer at once (daemons checkpoint and leave), SIGKILL stragglers."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + grace
        for p in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            stop_process(p, grace=5.0)


def tail(path: Path, n: int = 2000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return "<no log>"


def start_fake_swarm(tmp: Path, n: int = 3, timeout: float = 30.0) -> Swarm:
    """``n`` fake_metrics_peer.py processes on a ring; returns once each reports its port."""
    ids = [f"peer{i}" for i in range(n)]
    swarm = Swarm(targets={})
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        for i, pid in enumerate(ids):
            neighbors = sorted({ids[(i - 1) % n], ids[(i + 1) % n]} - {pid})
            cmd = [
                sys.executable,
                str(TESTS / "support" / "fake_metrics_peer.py"),
                f"--id={pid}",
                f"--neighbors={','.join(neighbors)}",
                f"--seed={i}",
                "--max-seconds=200",
                # peer0 relays for the last peer, as the daemon swarm's does
                f"--relay-for={ids[-1] if i == 0 else ''}",
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


# Site config of the real daemon; {placeholders} are filled per peer. Long enough to train
# through the whole test -- the swarm is stopped with SIGTERM at the end.
DAEMON_TOML = """\
[peer]
id = "{id}"
run_dir = "{run_dir}"
expected_peers = {n}
start_timeout = 120
bootstrap = [{bootstrap}]
advertise = "{advertise}"

[train]
task = "digits"
steps = 1000000
batch_size = 32
lr = 0.01
shard_index = {index}
num_shards = {n}
threads = 1
eval_every = 20

[gossip]
topology = "ring"
# The default gamma = 0.5 diverged (loss -> inf within ~600 steps) in this setting.
gamma = 0.1

[checkpoint]
every = 0

[metrics]
host = "127.0.0.1"
port = 0
"""


def start_daemon_swarm(tmp: Path, n: int = 3, timeout: float = 150.0) -> Swarm:
    """``n`` real peer daemons (``python -m gossipgrad.peer --config site.toml``) on loopback.

    peer0 starts first; the others bootstrap from its gossip address. The last one advertises
    an address where nothing listens, so it is called through a relay. Each daemon reports its
    metrics port in ``run_dir/status.json``. Returns once every peer is training.
    """
    swarm = Swarm(targets={})
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    deadline = time.monotonic() + timeout
    with socket.create_server(("127.0.0.1", 0)) as closed:  # a port nothing listens on after
        unreachable = f"127.0.0.1:{closed.getsockname()[1]}"
    bootstrap = ""
    try:
        for i in range(n):
            run_dir = tmp / f"peer{i}"
            run_dir.mkdir()
            site = tmp / f"site{i}.toml"
            site.write_text(
                DAEMON_TOML.format(
                    id=f"peer{i}",
                    run_dir=run_dir,
                    n=n,
                    index=i,
                    bootstrap=bootstrap,
                    # The last peer cannot be dialled (nothing serves at the address it
                    # gives): it is called through a relay, whose counters the relay panel
                    # shows.
                    advertise=unreachable if i == n - 1 else "",
                )
            )
            log = tmp / f"peer{i}.log"
            swarm.logs.append(log)
            with log.open("wb") as out:
                swarm.procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "gossipgrad.peer", "--config", str(site)],
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        env=env,
                    )
                )
            if i == 0:
                status = wait_status(swarm, run_dir, deadline, lambda s: s.get("address"))
                bootstrap = json.dumps(status["address"])
        run_dirs = [tmp / f"peer{i}" for i in range(n)]
        for run_dir in run_dirs:
            wait_status(swarm, run_dir, deadline, lambda s: s.get("state") == "training")
        swarm.targets = load_script("prometheus_config").targets_from_status(run_dirs)
        assert sorted(swarm.targets) == [f"peer{i}" for i in range(n)], swarm.targets
    except BaseException:
        swarm.close()
        raise
    return swarm


def wait_status(swarm: Swarm, run_dir: Path, deadline: float, ready: Callable) -> dict:
    """Poll ``run_dir/status.json`` until ``ready(status)``; fail if a peer dies or time is up."""
    while True:
        swarm.check_alive()
        with contextlib.suppress(OSError, ValueError):
            status = json.loads((run_dir / "status.json").read_text())
            if ready(status):
                return status
        if time.monotonic() > deadline:
            tails = "\n".join(f"--- {log}\n{tail(log)}" for log in swarm.logs)
            pytest.fail(f"{run_dir.name} not ready in time\n{tails}")
        time.sleep(0.2)


class ScrapeRecorder:
    """Pass-through HTTP proxy in front of one peer's metrics endpoint; keeps what it relays.

    Prometheus scrapes the recorder; the recorder forwards the request (Accept header
    included) to the peer and returns the peer's answer unchanged, remembering when each
    scrape arrived and the exact exposition the peer served for it. That makes "Prometheus
    stored what the peer said" checkable exactly while counters are still moving.
    """

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.relayed: list[tuple[float, str, bytes]] = []  # (arrival, content type, body)
        self._lock = threading.Lock()
        recorder = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                arrived = time.time()
                req = urllib.request.Request(
                    f"http://{recorder.upstream}{self.path}",
                    headers={"Accept": self.headers.get("Accept", "*/*")},
                )
                try:
                    with urllib.request.urlopen(req, timeout=5) as resp:
                        body, ctype = resp.read(), resp.headers["Content-Type"]
                except OSError:
                    self.send_error(503, "peer unreachable")
                    return
                with recorder._lock:
                    recorder.relayed.append((arrived, ctype, body))
                self.send_response(200)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.server.server_address[1]}"

    def snapshots(self) -> list[tuple[float, dict[SeriesKey, float]]]:
        """(arrival time, byte counters) of every relayed scrape."""
        with self._lock:
            relayed = sorted(self.relayed, key=lambda r: r[0])
        return [(t, parse_byte_counters(body.decode(), ctype)) for t, ctype, body in relayed]

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)


#: How to start each kind of swarm the end-to-end test can scrape.
SWARMS: dict[str, Callable[[Path], Swarm]] = {
    "fake": start_fake_swarm,
    "daemon": start_daemon_swarm,
}
#: The swarms the test runs against (override: GOSSIPGRAD_E2E_SWARMS=fake,daemon).
SWARM_KINDS = os.environ.get("GOSSIPGRAD_E2E_SWARMS", "fake,daemon").split(",")


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


@dataclass
class Scraped:
    swarm: Swarm
    prom: Prometheus
    recorders: dict[str, ScrapeRecorder]  # peer id -> the proxy Prometheus scrapes


@pytest.fixture(scope="module", params=SWARM_KINDS)
def scraped_swarm(request, tmp_path_factory) -> Iterator[Scraped]:
    """A swarm of the given kind, a recorder in front of each peer, Prometheus scraping them."""
    tmp = tmp_path_factory.mktemp(f"prom-e2e-{request.param}")
    swarm = SWARMS[request.param](tmp)
    recorders: dict[str, ScrapeRecorder] = {}
    prom = None
    try:
        for pid, target in swarm.targets.items():
            recorders[pid] = ScrapeRecorder(target)
        config = load_script("prometheus_config").write_prometheus_config(
            {pid: r.address for pid, r in recorders.items()},
            tmp / "prometheus.yml",
            scrape_interval=SCRAPE_INTERVAL,
            alert_for=ALERT_FOR,
        )
        prom = start_prometheus(config, tmp / "data")
        yield Scraped(swarm, prom, recorders)
    finally:
        if prom is not None:
            stop_process(prom.proc)
        for r in recorders.values():
            r.close()
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


def wait_until_all_up(prom: Prometheus, peers: set[str], timeout: float = 30) -> None:
    """Until every target is up, each series labelled with its peer id by the scrape config."""

    def all_up() -> bool:
        body = prom.query('up{job="gossipgrad"} == 1')
        return {s["metric"]["peer"] for s in body["data"]["result"]} == peers

    wait_for("every peer to be scraped", all_up, timeout=timeout)


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


@pytest.mark.slow
@needs_prometheus
@pytest.mark.timeout(400)
def test_every_dashboard_query_returns_data_and_byte_counters_match(scraped_swarm) -> None:
    swarm, prom = scraped_swarm.swarm, scraped_swarm.prom
    peers = set(swarm.targets)
    wait_until_all_up(prom, peers)
    time.sleep(5)  # enough history for rate() over $__rate_interval
    swarm.check_alive()

    # 1. Every expression of every panel parses and returns a finite value while peers train.
    checked = 0
    for name, dash in dashboards().items():
        values = resolve_variables(dash, prom)
        body = prom.api("/api/v1/label/peer/values", **{"match[]": "gossipgrad_build_info"})
        assert set(body["data"]) == peers, f"{name}: peer variable sees {body['data']}"
        failures = []
        for panel in dash["panels"]:
            for t in panel.get("targets", []):
                expr = substitute(t["expr"], values)
                last = query_until_data(prom, expr, timeout=15)
                if not (last.get("status") == "success" and has_finite_value(last)):
                    failures.append(f"{panel['title']!r}: {expr} -> {json.dumps(last)[:300]}")
                checked += 1
        assert not failures, f"{name}: queries without data:\n" + "\n".join(failures)
    assert checked >= 40

    # The generated recording and alert rules load, evaluate without errors, and record data.
    def rules_evaluated() -> list[dict]:
        groups = prom.api("/api/v1/rules")["data"]["groups"]
        rules = [r for g in groups for r in g["rules"]]
        never = [r for r in rules if r.get("lastEvaluation", "0001").startswith("0001")]
        return rules if rules and not never else []

    rules = wait_for("the rules to be evaluated", rules_evaluated, timeout=20)
    assert len(rules) >= 8
    assert all(r["health"] == "ok" for r in rules), [r for r in rules if r["health"] != "ok"]
    body = query_until_data(prom, "peer:gossipgrad_compression_ratio:rate1m", timeout=15)
    assert {r["metric"]["peer"] for r in body["data"]["result"]} == peers, body
    swarm.check_alive()

    # 2. Every byte-counter sample Prometheus stored equals what the peer's /metrics served
    # for that very scrape (recorded by the pass-through proxy).
    for pid, recorder in scraped_swarm.recorders.items():
        stored = prometheus_byte_samples(prom, pid)
        snaps = recorder.snapshots()
        assert stored and snaps, pid
        matched = 0
        for key, samples in stored.items():
            for ts, v in samples:
                served = relayed_for_scrape(snaps, ts)
                assert served is not None, f"{pid}: no relayed scrape for the sample at {ts}"
                assert served.get(key) == v, f"{pid} {key}: Prometheus {v}, peer {served.get(key)}"
                matched += 1
        # The newest stored scrape holds exactly the series the peer served in it.
        newest = max(ts for samples in stored.values() for ts, _ in samples)
        served = relayed_for_scrape(snaps, newest)
        at_newest = {key for key, samples in stored.items() if samples[-1][0] == newest}
        assert at_newest == set(served), (pid, sorted(set(served) ^ at_newest))
        # Every neighbour's updates flowed; a neighbour that left before its first update
        # (the relayed peer joins the ring an interval after its neighbours hear of it)
        # adds 0 to the departed series.
        updates = [v for key, v in served.items() if key[2] == "update" and key[1] != DEPARTED]
        assert updates and all(v > 0 for v in updates), (pid, served)
        assert any(key[0] == "gossipgrad_dense_bytes_total" and v > 0 for key, v in served.items())
        assert matched >= 5 * len(stored), (pid, matched, len(stored))


def relayed_for_scrape(snaps: list[tuple[float, dict]], ts: float) -> dict | None:
    """What the recorder relayed for the scrape Prometheus timestamped ``ts``.

    Prometheus stamps a sample with the scrape's start time (aligned by at most a few ms); the
    request reaches the recorder just after. Scrapes are a second apart, so the first
    arrival from just before ``ts`` to 0.9 s after it is that scrape.
    """
    for arrived, served in snaps:  # in arrival order
        if ts - 0.1 <= arrived < ts + 0.9:
            return served
    return None


def query_until_data(prom: Prometheus, expr: str, timeout: float) -> dict:
    """Run an instant query until it returns a finite value (a parse error returns at once)."""
    deadline = time.monotonic() + timeout
    while True:
        body = prom.query(expr)
        if body.get("status") == "success" and has_finite_value(body):
            return body
        if body.get("errorType") == "bad_data" or time.monotonic() > deadline:
            return body
        time.sleep(0.5)


SeriesKey = tuple[str, str, str]  # (sample name, neighbor, kind or "")


def parse_byte_counters(text: str, content_type: str = "text/plain") -> dict[SeriesKey, float]:
    """The byte counters in one exposition (Prometheus text or OpenMetrics)."""
    if content_type.startswith("application/openmetrics-text"):
        families = openmetrics_families(text)
    else:
        families = text_string_to_metric_families(text)
    out = {}
    for fam in families:
        for s in fam.samples:
            if s.name in BYTE_COUNTERS:
                out[s.name, s.labels.get("neighbor", ""), s.labels.get("kind", "")] = s.value
    return out


def prometheus_byte_samples(
    prom: Prometheus, peer: str, at: float | None = None
) -> dict[SeriesKey, list[tuple]]:
    """Every raw (timestamp, value) sample Prometheus holds for ``peer``'s byte counters (up
    to the Unix time ``at``, default now)."""
    names = "|".join(BYTE_COUNTERS)
    query = f'{{__name__=~"{names}", peer="{peer}"}}[10m]'
    body = prom.query(query) if at is None else prom.api("/api/v1/query", query=query, time=at)
    assert body["status"] == "success", body
    out = {}
    for series in body["data"]["result"]:
        labels = series["metric"]
        key = (labels["__name__"], labels.get("neighbor", ""), labels.get("kind", ""))
        out[key] = [(float(ts), float(v)) for ts, v in series["values"]]
    return out


def instant_value(prom: Prometheus, expr: str, at: float | None = None) -> float:
    """The single value an instant query of ``expr`` returns (at Unix time ``at``)."""
    body = prom.query(expr) if at is None else prom.api("/api/v1/query", query=expr, time=at)
    assert body["status"] == "success" and len(body["data"]["result"]) == 1, (expr, body)
    return float(body["data"]["result"][0]["value"][1])


def update_compression_ratio(counters: list[dict[SeriesKey, float]]) -> float:
    """Dense fp32 bytes over wire bytes of updates, summed over the peers' counters."""
    dense = sum(v for c in counters for (name, _, _), v in c.items()
                if name == "gossipgrad_dense_bytes_total")  # fmt: skip
    wire = sum(v for c in counters for (name, _, kind), v in c.items()
               if name == "gossipgrad_sent_bytes_total" and kind == "update")  # fmt: skip
    assert dense > 0 and wire > 0, counters
    return dense / wire


def scrape_byte_counters(target: str) -> dict[SeriesKey, float]:
    """The byte counters of one peer's /metrics, fetched directly (not through Prometheus)."""
    with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as resp:
        return parse_byte_counters(resp.read().decode(), resp.headers["Content-Type"])


@needs_prometheus
@pytest.mark.timeout(200)
def test_compression_ratio_panel_matches_the_counters_and_peer_down_fires(scraped_swarm) -> None:
    """The overview's compression-ratio stat is the ratio of the peers' own byte counters, and
    GossipgradPeerDown fires for a killed peer (and only for it). Runs after the test above on
    the same swarm, since it kills a peer."""
    swarm, prom = scraped_swarm.swarm, scraped_swarm.prom
    peers = set(swarm.targets)
    wait_until_all_up(prom, peers)
    swarm.check_alive()
    dash = dashboards()["gossipgrad-overview.json"]
    (panel,) = [p for p in dash["panels"] if p["title"] == "Compression ratio (since start)"]
    (target,) = panel["targets"]
    expr = substitute(target["expr"], resolve_variables(dash, prom))

    # 1. Exactly, at one instant: what the panel shows at time T is the ratio of the counters
    # each peer served in its last scrape before T (as the pass-through recorder kept them).
    assert has_finite_value(query_until_data(prom, expr, timeout=15)), expr
    time.sleep(3)
    at = time.time() - 2  # scrapes up to T are stored by now
    shown = instant_value(prom, expr, at)
    served = []
    for pid, recorder in scraped_swarm.recorders.items():
        stored = prometheus_byte_samples(prom, pid, at)
        last = max(ts for samples in stored.values() for ts, _ in samples)
        snapshot = relayed_for_scrape(recorder.snapshots(), last)
        assert snapshot is not None, (pid, last)
        served.append(snapshot)
    expected = update_compression_ratio(served)
    print(f"compression-ratio panel {shown:.2f}, from the served counters {expected:.2f}")
    assert shown == pytest.approx(expected, rel=1e-9)
    # Top-1 % + int8 updates: far smaller than dense (a panel of the wrong counters is not).
    assert shown > 20

    # 2. Against the peers' /metrics fetched directly now: equal up to the counters' movement
    # between Prometheus's last scrape and this fetch.
    direct = update_compression_ratio([scrape_byte_counters(t) for t in swarm.targets.values()])
    assert instant_value(prom, expr) == pytest.approx(direct, rel=0.05)

    # 3. Kill one peer: Prometheus's scrapes of it fail, and GossipgradPeerDown (its for:
    # shortened to ALERT_FOR) goes pending, then firing -- for that peer only.
    victim = sorted(peers)[-1]
    proc = swarm.procs[sorted(swarm.targets).index(victim)]
    proc.kill()
    proc.wait(timeout=10)

    def peer_down_firing() -> list[dict]:
        alerts = prom.api("/api/v1/alerts")["data"]["alerts"]
        down = [a for a in alerts if a["labels"]["alertname"] == "GossipgradPeerDown"]
        return down if any(a["state"] == "firing" for a in down) else []

    down = wait_for("GossipgradPeerDown to fire", peer_down_firing, timeout=30)
    assert [(a["labels"]["peer"], a["state"]) for a in down] == [(victim, "firing")], down
    assert down[0]["labels"]["severity"] == "critical"


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
    assert "1 rule files found" in res.stdout + res.stderr
    text = path.read_text()
    for pid in ("site-a", "site-b", "site.c_3"):
        assert f'peer: "{pid}"' in text
    rules = tmp_path / cfg.RULES_FILE
    res = subprocess.run(
        [PROMTOOL, "check", "rules", str(rules)], capture_output=True, text=True, timeout=30
    )
    assert res.returncode == 0, res.stdout + res.stderr
    n_rules = len(cfg.RECORDING_RULES) + len(cfg.ALERT_RULES)
    assert f"{n_rules} rules found" in res.stdout


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
    assert (tmp_path / "gossipgrad-rules.yml").exists()
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


@pytest.mark.timeout(30)
def test_alert_for_replaces_every_alerts_duration() -> None:
    cfg = load_script("prometheus_config")
    own = cfg.render_rules()
    short = cfg.render_rules(alert_for="5s")
    assert [f"for: {a[2]}" for a in cfg.ALERT_RULES] == [
        line.strip() for line in own.splitlines() if "for:" in line
    ]
    assert [line.strip() for line in short.splitlines() if "for:" in line] == ["for: 5s"] * len(
        cfg.ALERT_RULES
    )
    with pytest.raises(ValueError, match="duration"):
        cfg.render_rules(alert_for="5 seconds")


@pytest.mark.timeout(30)
def test_targets_from_status_files(tmp_path) -> None:
    cfg = load_script("prometheus_config")
    for i, port in enumerate((9101, 9102)):
        (tmp_path / f"p{i}").mkdir()
        (tmp_path / f"p{i}" / "status.json").write_text(
            json.dumps({"id": f"peer{i}", "metrics_port": port, "state": "training"})
        )
    got = cfg.targets_from_status([tmp_path / "p0", tmp_path / "p1" / "status.json"])
    assert got == {"peer0": "127.0.0.1:9101", "peer1": "127.0.0.1:9102"}
    assert cfg.targets_from_status([tmp_path / "p0"], host="::1") == {"peer0": "[::1]:9101"}
    with pytest.raises(ValueError, match="twice"):
        cfg.targets_from_status([tmp_path / "p0", tmp_path / "p0"])
    (tmp_path / "p2").mkdir()
    (tmp_path / "p2" / "status.json").write_text(json.dumps({"id": "peer2", "metrics_port": 0}))
    with pytest.raises(ValueError, match="no metrics"):
        cfg.targets_from_status([tmp_path / "p2"])
    with pytest.raises(ValueError, match="metrics_port"):
        cfg.targets_from_status([tmp_path / "missing"])


@pytest.mark.slow
@needs_prometheus
@pytest.mark.timeout(120)
def test_file_sd_targets_follow_the_swarm_without_a_restart(tmp_path) -> None:
    """``--file-sd``: Prometheus scrapes what gossipgrad-targets.json lists; rewriting it
    with ``--targets-only`` (a peer joined, another left) changes the targets of the same,
    running Prometheus."""
    script = str(ROOT / "scripts" / "prometheus_config.py")
    out = tmp_path / "prometheus.yml"
    swarm = start_fake_swarm(tmp_path, n=3, timeout=90)
    prom = None

    def write(peers: list[str], *extra: str) -> None:
        items = [f"{p}={swarm.targets[p]}" for p in peers]
        res = subprocess.run(
            [sys.executable, script, "--peers", *items, "--out", str(out), "--file-sd", *extra],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr

    def scraped() -> set[str]:
        body = prom.api("/api/v1/targets", state="active")
        return {t["labels"]["peer"] for t in body["data"]["activeTargets"]}

    try:
        write(["peer0", "peer1"])
        assert "file_sd_configs" in out.read_text()
        prom = start_prometheus(out, tmp_path / "data")
        wait_until_all_up(prom, {"peer0", "peer1"})
        write(["peer1", "peer2"], "--targets-only")  # peer2 joined, peer0 left
        wait_for("the rewritten targets", lambda: scraped() == {"peer1", "peer2"}, timeout=30)
        wait_until_all_up(prom, {"peer1", "peer2"})
        assert prom.proc.poll() is None  # the same Prometheus, never restarted
        bad = subprocess.run(
            [sys.executable, script, "--peers", "a=127.0.0.1:1", "--out", "-", "--targets-only"],
            capture_output=True, text=True, timeout=30,
        )  # fmt: skip
        assert bad.returncode == 2 and "--targets-only needs --file-sd" in bad.stderr
    finally:
        if prom is not None:
            stop_process(prom.proc)
        swarm.close()
