"""netns mode over TUN links (``gossipgrad.experiment.link_tun``): real namespaces, real TUN
devices, real TCP and gloo between them (root and iproute2, else skipped).

A ping-pong over a 40 ms RTT link measures 40 ms; a bulk transfer over 20 mbit/s takes the
time the rate implies; configured loss drops packets that TCP then retransmits; gloo's
all-reduce -- the DDP, PowerSGD and DiLoCo baselines' transport -- crosses the same links and
pays their latency; and no namespace, device or thread survives an exception or SIGINT.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import signal
import statistics
import subprocess
import sys
import threading
from collections.abc import Iterator

import pytest
from gossipgrad.experiment import netns
from gossipgrad.experiment.link_path import LinkPath, Serializer, Stage
from gossipgrad.experiment.link_tun import QUEUE_PACKETS, queue_limit, subnet_sites
from gossipgrad.experiment.spec import NetworkSection

pytestmark = pytest.mark.skipif(
    netns.available() is not None, reason=f"netns mode unavailable: {netns.available()}"
)

ECHO = """
import socket, sys
srv = socket.socket()
srv.bind((sys.argv[1], 0))
srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    b = conn.recv(1 << 16)
    if not b:
        break
    conn.sendall(b)
"""
PING = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
for _ in range(int(sys.argv[3])):
    t = time.monotonic()
    s.sendall(b"x" * 32)
    got = 0
    while got < 32:
        got += len(s.recv(64))
    print(time.monotonic() - t, flush=True)
"""
RECEIVER = """
import hashlib, socket, sys, time
srv = socket.socket()
srv.bind((sys.argv[1], 0))
srv.listen(1)
print(srv.getsockname()[1], flush=True)
conn, _ = srv.accept()
h, n, t0 = hashlib.sha256(), 0, None
while True:
    b = conn.recv(1 << 16)
    if t0 is None:
        t0 = time.monotonic()
    if not b:
        break
    h.update(b)
    n += len(b)
print(n, time.monotonic() - t0, h.hexdigest(), flush=True)
"""
SENDER = """
import socket, sys
s = socket.create_connection((sys.argv[1], int(sys.argv[2])))
n = int(sys.argv[3])
s.sendall((bytes(range(256)) * (n // 256 + 1))[:n])
s.close()
"""
ALL_REDUCE = """
import os, sys, time, torch, torch.distributed as dist
os.environ["GLOO_SOCKET_IFNAME"] = "eth0"  # as the baselines' placement sets it
rank, host, port = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
dist.init_process_group("gloo", init_method=f"tcp://{host}:{port}", rank=rank, world_size=2)
x = torch.ones(1000)
dist.all_reduce(x)
times = []
for _ in range(10):
    t = time.monotonic()
    dist.all_reduce(x)
    times.append(time.monotonic() - t)
dist.destroy_process_group()
print(sorted(times)[5], float(x[0]), flush=True)
"""


def ours(prefix: str) -> list[str]:
    return [ns for ns in netns.list_namespaces() if ns.startswith(prefix)]


def switch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "tun-switch"]


@contextlib.contextmanager
def tun_lab(n: int = 2, **profile: object) -> Iterator[netns.NetnsLab]:
    """A lab whose links are TUN devices; afterwards no namespace or switch thread is left."""
    lab = netns.NetnsLab(n, NetworkSection(emulator="tun", **profile), seed=1)
    try:
        with lab:
            assert lab.switch is not None
            yield lab
    finally:
        assert ours(lab.prefix) == []
        assert switch_threads() == []


def in_site(lab: netns.NetnsLab, i: int, script: str, *args: object) -> subprocess.Popen:
    cmd = [*lab.exec_prefix(i), sys.executable, "-c", script, *map(str, args)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 60) -> str:
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, err[-3000:]
    return out


def round_trips(lab: netns.NetnsLab, count: int) -> list[float]:
    echo = in_site(lab, 1, ECHO, lab.address(1))
    try:
        port = echo.stdout.readline().strip()
        out = finish(in_site(lab, 0, PING, lab.address(1), port, count))
        return [float(x) for x in out.split()]
    finally:
        echo.kill()
        echo.wait()


def transfer(lab: netns.NetnsLab, nbytes: int) -> tuple[int, float, str]:
    """Bytes site 1 received from site 0, seconds from the first byte, their sha256."""
    rx = in_site(lab, 1, RECEIVER, lab.address(1))
    port = rx.stdout.readline().strip()
    finish(in_site(lab, 0, SENDER, lab.address(1), port, nbytes))
    got, seconds, digest = finish(rx).split()
    return int(got), float(seconds), digest


def sent_digest(nbytes: int) -> str:
    return hashlib.sha256((bytes(range(256)) * (nbytes // 256 + 1))[:nbytes]).hexdigest()


@pytest.mark.timeout(90)
def test_ping_pong_over_a_40ms_rtt_tun_link_measures_40ms() -> None:
    """Each site's access link adds 10 ms each way, so 0 -> 1 is 20 ms one-way and a round
    trip 40 ms: the median of 25 within 10 %, none shorter than the delay allows."""
    with tun_lab(delay="10ms") as lab:
        rtts = round_trips(lab, 25)
        report = lab.switch.report()
    assert statistics.median(rtts) == pytest.approx(0.040, rel=0.10), sorted(rtts)
    assert min(rtts) >= 0.040 * 0.75, sorted(rtts)  # early by at most the wake-up lead
    # Every packet crossed the switch, both ways, and nothing else was sent anywhere.
    assert report["paths"]["0->1"]["chunks"] >= 25 and report["paths"]["1->0"]["chunks"] >= 25
    assert report["write_errors"] == 0


@pytest.mark.timeout(90)
def test_bulk_transfer_over_a_tun_link_takes_the_time_the_rate_implies() -> None:
    nbytes, rate_bits = 2_500_000, 20e6
    with tun_lab(rate="20mbit") as lab:
        got, seconds, digest = transfer(lab, nbytes)
        report = lab.switch.report()
    assert got == nbytes and digest == sent_digest(nbytes)
    assert seconds == pytest.approx(nbytes * 8 / rate_bits, rel=0.10)
    assert report["paths"]["0->1"]["bytes"] >= nbytes  # payload plus headers
    print(f"2.5 MB at 20 mbit/s: {seconds:.3f} s; switch CPU {report['cpu_seconds']:.3f} s")


@pytest.mark.timeout(90)
def test_loss_drops_packets_and_tcp_still_delivers_every_byte() -> None:
    nbytes = 1_000_000
    with tun_lab(rate="50mbit", loss=3.0) as lab:
        got, _, digest = transfer(lab, nbytes)
        lost = lab.switch.report()["paths"]["0->1"]["lost_chunks"]
    assert got == nbytes and digest == sent_digest(nbytes)
    # ~700 data packets at 3 % per site's stage (two stages): about 40 dropped.
    assert 10 <= lost <= 100, lost


@pytest.mark.timeout(120)
def test_gloo_all_reduce_crosses_the_tun_links_and_pays_their_latency() -> None:
    """What the DDP, PowerSGD and DiLoCo baselines do, between two site namespaces: the
    all-reduce of two ranks needs at least one one-way trip (20 ms here) each way."""
    with tun_lab(delay="10ms") as lab:
        port = 29517
        ranks = [in_site(lab, r, ALL_REDUCE, r, lab.address(0), port) for r in range(2)]
        outs = [finish(p, timeout=90) for p in ranks]
        report = lab.switch.report()
    for out in outs:
        median, value = out.split()
        assert float(value) == 2.0**11  # eleven all-reduces (sums) of ones over two ranks
        assert float(median) >= 0.020, outs
    print(f"gloo all-reduce over 20 ms one-way: medians {[o.split()[0] for o in outs]} s")
    assert report["paths"]["0->1"]["bytes"] > 10 * 4000
    assert report["paths"]["1->0"]["bytes"] > 10 * 4000


@pytest.mark.timeout(60)
def test_an_exception_in_the_body_leaves_no_namespace_device_or_thread() -> None:
    before = set(os.listdir("/proc/self/fd"))
    with pytest.raises(RuntimeError, match="boom"), tun_lab(delay="5ms") as lab:
        assert len(round_trips(lab, 2)) == 2
        raise RuntimeError("boom")
    assert set(os.listdir("/proc/self/fd")) <= before | {str(n) for n in range(3)}


LAB_PROCESS = """
import sys, time
from gossipgrad.experiment import netns
from gossipgrad.experiment.spec import NetworkSection
with netns.NetnsLab(3, NetworkSection(delay="5ms", emulator="tun")) as lab:
    print(lab.prefix, flush=True)
    time.sleep(60)
"""


@pytest.mark.timeout(60)
def test_sigint_removes_every_namespace_and_device_of_a_tun_lab() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", LAB_PROCESS], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        prefix = proc.stdout.readline().strip()
        assert prefix and len(ours(prefix)) == 4  # hub + 3 sites
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "KeyboardInterrupt" in proc.stderr.read()
    assert ours(prefix) == []


def test_queue_limit_holds_what_is_in_flight_plus_a_fifo_and_unshaped_never_fills() -> None:
    rate = 2.5e6  # 20 mbit/s
    shaped = LinkPath([Stage(delay=0.02, serializer=Serializer(rate)), Stage(delay=0.01)])
    assert queue_limit(shaped) == int(rate * 0.03) + QUEUE_PACKETS * 1500
    assert queue_limit(LinkPath([Stage(delay=0.02)])) is None


def test_only_addresses_of_the_sites_are_routed() -> None:
    site_of = subnet_sites("198.18.0", 3)
    assert [site_of(bytes([198, 18, 0, k])) for k in (1, 2, 3)] == [0, 1, 2]
    for other in ([198, 18, 0, 0], [198, 18, 0, 4], [198, 18, 1, 1], [127, 0, 0, 1]):
        assert site_of(bytes(other)) is None


def test_a_tun_path_drops_lost_packets_rather_than_delaying_them() -> None:
    path = LinkPath([Stage(delay=0.01, loss=0.5)], seed=3)
    outcomes = [path.deliver(float(k), 1500, 0.0) for k in range(200)]
    dropped = sum(o is None for o in outcomes)
    assert 60 <= dropped <= 140 and path.stats.lost_chunks == dropped
    assert all(o == pytest.approx(k + 0.01) for k, o in enumerate(outcomes) if o is not None)
    # FIFO: a packet never leaves before the one offered ahead of it.
    assert path.deliver(0.0, 1500, previous=5.0) in (None, 5.0)


def test_netem_asked_for_on_a_kernel_without_it_fails_cleanly() -> None:
    lab = netns.NetnsLab(2, NetworkSection(delay="20ms", emulator="netem"))
    try:
        lab.up()
    except netns.NetnsError as err:
        assert "tun" in str(err) and ours(lab.prefix) == []
        return
    try:
        assert lab.switch is None  # this kernel has netem: tc shapes
    finally:
        lab.down()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_latency_scaling_bench_runs_swarm_and_ddp_over_the_same_tun_links(tmp_path) -> None:
    """scripts/bench_latency_scaling.py as a user runs it, at 2 sites: both phases crossed
    the TUN switch, and DDP's all-reduce, paying the 40 ms RTT every step, is slower per
    step than the swarm, which overlaps its round trip with the next step."""
    from gossipgrad.experiment.report import load_report
    from support import ROOT

    out = tmp_path / "bench"
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_latency_scaling.py"), "--peers", "2",
           "--steps", "30", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=280)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (row,) = json.loads((out / "latency_scaling.json").read_text())
    assert (out / "latency_scaling.png").stat().st_size > 1000
    assert row["ddp_s_per_step"] >= 0.040  # at least one round trip per all-reduce
    assert row["ddp_s_per_step"] > row["gossip_s_per_step"]
    report = load_report(out / "n2")
    for phase in (report.swarm, report.baselines["ddp"]):
        assert phase.link_emulator is not None and phase.link_emulator["emulator"] == "tun"
        paths = phase.link_emulator["paths"]
        assert paths["0->1"]["bytes"] > 0 and paths["1->0"]["bytes"] > 0
