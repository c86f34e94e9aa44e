"""End to end, ssh mode: ``gossipgrad-experiment`` starts two peers through a real sshd on
127.0.0.1 (a throwaway server with its own host and user keys), collects their results, and
leaves no remote process behind: after a clean run, after a failed one, and after Ctrl-C."""

from __future__ import annotations

import contextlib
import getpass
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest
from gossipgrad.experiment.report import load_report
from gossipgrad.peer.records import PeerStatus, read_record
from support.experiment import processes_mentioning

SBIN = "/usr/sbin:/usr/local/sbin:/sbin"
# Multi-process runs of about a minute in all: the file is scheduled early (tests/conftest.py).
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _alive(pid: int) -> bool:
    """The process runs (a zombie waiting for its reaper does not count)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@dataclass
class Sshd:
    """A throwaway sshd on 127.0.0.1 that accepts ``key`` for the current user."""

    root: Path
    port: int
    key: Path
    proc: subprocess.Popen
    seen: list[psutil.Process] = field(default_factory=list)
    """Remote peers the tests saw running: killed at teardown if a test left one (psutil
    refuses to signal a pid that another process has taken since)."""

    def options(self) -> list[str]:
        """ssh options for this server, independent of the user's ssh config and keys."""
        return [
            "-F", "/dev/null", "-o", "BatchMode=yes", "-o", "IdentitiesOnly=yes",
            "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
            "-o", "LogLevel=ERROR",
        ]  # fmt: skip

    def stop(self) -> None:
        """Kill what the tests left under or started through the server, then the server."""
        for p in self.sessions() + self.seen:
            with contextlib.suppress(psutil.Error):
                if p.status() != psutil.STATUS_ZOMBIE:
                    p.kill()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def watch(self, pids: list[int]) -> None:
        """Remember these remote peers (while they run) for the teardown."""
        for pid in pids:
            with contextlib.suppress(psutil.Error):
                self.seen.append(psutil.Process(pid))

    def sessions(self) -> list[psutil.Process]:
        """Live processes under the server: open sessions and what they run."""
        with contextlib.suppress(psutil.Error):
            return [p for p in psutil.Process(self.proc.pid).children(recursive=True)
                    if _alive(p.pid)]  # fmt: skip
        return []


def _start_sshd(root: Path) -> Sshd:
    """Keys, config and a running ``sshd -D``; skips when there is none to run."""
    sshd = shutil.which("sshd", path=SBIN + ":" + os.environ.get("PATH", ""))
    keygen = shutil.which("ssh-keygen")
    if not sshd or not keygen or not shutil.which("ssh"):
        pytest.skip("needs openssh-server and openssh-client (scripts/setup.sh --test)")
    root.mkdir(parents=True, exist_ok=True)
    for name in ("host_key", "user_key"):
        subprocess.run(
            [keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(root / name)], check=True
        )
    (root / "authorized_keys").write_text((root / "user_key.pub").read_text())
    if os.geteuid() == 0:
        Path("/run/sshd").mkdir(mode=0o755, exist_ok=True)  # its privilege-separation dir
    port = _free_port()
    config = root / "sshd_config"
    config.write_text(
        f"ListenAddress 127.0.0.1\nPort {port}\nHostKey {root / 'host_key'}\n"
        f"AuthorizedKeysFile {root / 'authorized_keys'}\nPidFile {root / 'sshd.pid'}\n"
        "PasswordAuthentication no\nKbdInteractiveAuthentication no\nUsePAM no\n"
        "StrictModes no\nPermitRootLogin prohibit-password\n"
    )
    log = open(root / "sshd.log", "w")  # noqa: SIM115 - the server's lifetime
    proc = subprocess.Popen(
        [sshd, "-D", "-e", "-f", str(config)], stdout=log, stderr=subprocess.STDOUT
    )
    deadline = time.monotonic() + 10
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                break
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            pytest.skip(f"sshd did not start: {(root / 'sshd.log').read_text()[-500:]}")
        time.sleep(0.05)
    server = Sshd(root, port, root / "user_key", proc)
    login = subprocess.run(
        ["ssh", *server.options(), "-p", str(port), "-i", str(server.key),
         f"{getpass.getuser()}@127.0.0.1", "true"],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    if login.returncode != 0:  # a server that runs but refuses the key: fail, do not skip
        server.stop()
        pytest.fail(f"ssh login refused: {login.stderr}\n{(root / 'sshd.log').read_text()}")
    return server


@pytest.fixture(scope="module")
def sshd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sshd]:
    server = _start_sshd(tmp_path_factory.mktemp("sshd"))
    try:
        yield server
    finally:
        server.stop()


def _python_wrapper(path: Path) -> Path:
    """The remote peers' interpreter: this one, importing the same gossipgrad (sshd does not
    pass this process's environment on)."""
    env = f"PYTHONPATH='{os.environ['PYTHONPATH']}' " if os.environ.get("PYTHONPATH") else ""
    path.write_text(f'#!/bin/sh\n{env}exec {sys.executable} "$@"\n')
    path.chmod(0o755)
    return path


def _write_spec(
    tmp: Path, sshd: Sshd, *, steps: int, timeout: int, no_python: int | None = None
) -> Path:
    """A 2-peer digits spec in ssh mode, both peers on ``sshd``, data and runs under tmp;
    the host of peer ``no_python`` names an interpreter that does not exist."""
    python = str(_python_wrapper(tmp / "python"))
    work = tmp / "remote runs"  # a space: remote paths must be quoted right
    hosts = ""
    for i in range(2):
        py = tmp / "no-python" if i == no_python else python
        hosts += (
            f'[[hosts]]\naddress = "{getpass.getuser()}@127.0.0.1"\npython = "{py}"\n'
            f'data = "{tmp / "data"}"\nworkdir = "{work}"\n'
            f"port = {_free_port() if i == 0 else 0}\n"
            f'ssh_port = {sshd.port}\nidentity = "{sshd.key}"\n'
        )
    (tmp / "hosts.toml").write_text(hosts)
    options = sshd.options()
    spec = tmp / "spec.toml"
    spec.write_text(
        f'[experiment]\nname = "ssh-e2e"\npeers = 2\nmode = "ssh"\nseed = 0\n'
        f"timeout = {timeout}\nsample_every = 0.5\n"
        f'[train]\ntask = "digits"\nsteps = {steps}\nbatch_size = 32\neval_every = 0\n'
        '[gossip]\ncodec = "topk:0.1+int8"\ntopology = "ring"\n'
        "[membership]\nheartbeat_interval = 0.2\n[checkpoint]\nevery = 0\n"
        f'[baselines]\nrun = []\n[ssh]\ninventory = "hosts.toml"\noptions = {json.dumps(options)}\n'
    )
    return spec


def _runner(spec: Path, out: Path) -> subprocess.Popen:
    """The runner as a user starts it, in a session of its own (its own process group, so
    SIGINT is delivered to it as a terminal's Ctrl-C would be, not ignored)."""
    script = Path(sys.executable).parent / "gossipgrad-experiment"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "gossipgrad.experiment"]
    log = open(out.parent / "runner.log", "w")  # noqa: SIM115 - closed by the child's exit
    with log:
        return subprocess.Popen(
            [*cmd, str(spec), "--out", str(out), "--no-live"],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip


def _finish(proc: subprocess.Popen, timeout: float) -> int:
    """The runner's exit status; killed (with its process group) if it overruns."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise


def _remote_statuses(tmp: Path) -> dict[int, PeerStatus]:
    """The status.json each remote peer has written so far, read where it runs."""
    out = {}
    for path in (tmp / "remote runs").glob("*/peer*/status.json"):
        status = read_record(path, PeerStatus)
        if status is not None:
            out[int(path.parent.name[4:])] = status
    return out


def _assert_nothing_left(tmp: Path, sshd: Sshd, pids: list[int]) -> None:
    """No peer pid runs, no session is open on the server, and no process names the remote
    run directory (a peer that never wrote a pid file) -- shortly after the runner exits."""
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and (sshd.sessions() or any(map(_alive, pids))):
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    sshd.watch(left)
    assert left == [], "remote peers left running"
    assert sshd.sessions() == [], "ssh sessions left open"
    strays = processes_mentioning(str(tmp / "remote runs"))
    sshd.watch(strays)
    assert strays == [], "processes of the run left running"


def _log(tmp: Path) -> str:
    text = (tmp / "runner.log").read_text()[-3000:]
    for p in sorted((tmp / "out" / "swarm").glob("peer*.log")):
        text += f"\n--- {p.name}\n" + p.read_text()[-1500:]
    return text


@pytest.mark.timeout(60)
def test_ssh_run_collects_results_and_leaves_nothing(tmp_path: Path, sshd: Sshd) -> None:
    spec = _write_spec(tmp_path, sshd, steps=30, timeout=45)
    out = tmp_path / "out"
    rc = _finish(_runner(spec, out), timeout=50)
    assert rc == 0, _log(tmp_path)
    report = load_report(out)
    assert report.ok and report.mode == "ssh" and len(report.swarm.peers) == 2
    pids = []
    for i, p in enumerate(report.swarm.peers):
        assert p.ok and p.steps == 30 and p.final is not None, p
        for name in ("status.json", "summary.json", "params.pt"):
            assert (out / "swarm" / f"peer{i}" / name).stat().st_size > 0, name
        status = read_record(out / "swarm" / f"peer{i}" / "status.json", PeerStatus)
        assert status is not None and status.pid and status.step == 30
        pids.append(status.pid)
    assert report.swarm.consensus_distance is not None
    _assert_nothing_left(tmp_path, sshd, pids)


@pytest.mark.timeout(90)
def test_ssh_failed_run_stops_every_remote_peer(tmp_path: Path, sshd: Sshd) -> None:
    """peer1's host has no such interpreter (its ssh exits 127 at once); peer0 waits for it
    until experiment.timeout, when the runner stops it over ssh (SIGTERM ends its wait for
    peer.expected_peers at once: it leaves cleanly, stopped early, so it is not ok either).
    The timeout leaves peer0 time to start and write its status.json even on a loaded host
    (6 s did not, once, with the suite on both cores)."""
    spec = _write_spec(tmp_path, sshd, steps=100_000, timeout=15, no_python=1)
    out = tmp_path / "out"
    rc = _finish(_runner(spec, out), timeout=75)
    assert rc == 1, _log(tmp_path)
    report = load_report(out)
    assert not report.ok and not report.swarm.ok
    assert [p.ok for p in report.swarm.peers] == [False, False]
    status = read_record(out / "swarm" / "peer0" / "status.json", PeerStatus)
    assert status is not None and status.pid, "peer0's status.json is fetched after a failure"
    _assert_nothing_left(tmp_path, sshd, [status.pid])


@contextlib.contextmanager
def _running(spec: Path, out: Path) -> Iterator[subprocess.Popen]:
    """The runner on ``spec``, SIGKILLed (its whole group) if still running at the end."""
    proc = _runner(spec, out)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def _ctrl_c(proc: subprocess.Popen, tmp_path: Path) -> None:
    """SIGINT to the runner's process group, as a terminal's Ctrl-C: it exits 130."""
    os.killpg(proc.pid, signal.SIGINT)
    assert _finish(proc, timeout=40) == 130, _log(tmp_path)


def _training(proc: subprocess.Popen, tmp: Path) -> list[int]:
    """Wait until both remote peers train; their pids."""
    deadline = time.monotonic() + 40
    while True:
        statuses = _remote_statuses(tmp)
        if len(statuses) == 2 and all(s.pid and s.step >= 1 for s in statuses.values()):
            return [s.pid for s in statuses.values() if s.pid]
        assert proc.poll() is None and time.monotonic() < deadline, _log(tmp)
        time.sleep(0.2)


@pytest.mark.timeout(60)
def test_ssh_ctrl_c_stops_every_remote_peer(tmp_path: Path, sshd: Sshd) -> None:
    """Ctrl-C (SIGINT to the runner's process group, as a terminal sends it) while both
    peers train: the runner stops them over ssh and exits 130."""
    spec = _write_spec(tmp_path, sshd, steps=100_000, timeout=120)
    with _running(spec, tmp_path / "out") as proc:
        pids = _training(proc, tmp_path)
        sshd.watch(pids)
        _ctrl_c(proc, tmp_path)
    _assert_nothing_left(tmp_path, sshd, pids)


@pytest.mark.timeout(60)
def test_ssh_a_peer_whose_connection_dropped_is_stopped_all_the_same(
    tmp_path: Path, sshd: Sshd
) -> None:
    """peer1's ssh client dies while peer1 trains (a dropped connection: without a tty the
    remote peer runs on); Ctrl-C must still stop it, found by its pid, not by its client."""
    spec = _write_spec(tmp_path, sshd, steps=100_000, timeout=120)
    with _running(spec, tmp_path / "out") as proc:
        pids = _training(proc, tmp_path)
        sshd.watch(pids)
        [client] = [
            c for c in psutil.Process(proc.pid).children()
            if "--peer.id peer1" in " ".join(c.cmdline())
        ]  # fmt: skip
        client.kill()  # the runner's child: a zombie until the runner polls it
        deadline = time.monotonic() + 10
        while _alive(client.pid):
            assert time.monotonic() < deadline, "the ssh client did not die"
            time.sleep(0.1)
        time.sleep(1.0)
        assert all(map(_alive, pids)), "both peers still train after the client's end"
        _ctrl_c(proc, tmp_path)
    _assert_nothing_left(tmp_path, sshd, pids)


@pytest.mark.timeout(60)
def test_ssh_ctrl_c_at_start_stops_every_remote_peer(tmp_path: Path, sshd: Sshd) -> None:
    """Ctrl-C as soon as the ssh clients run, before any peer has written its status.json
    (or its shell its pid file): every peer that was started is stopped all the same."""
    spec = _write_spec(tmp_path, sshd, steps=100_000, timeout=120)
    out = tmp_path / "out"
    with _running(spec, out) as proc:
        deadline = time.monotonic() + 30
        while not (out / "swarm" / "peer1.log").exists():
            assert proc.poll() is None and time.monotonic() < deadline, _log(tmp_path)
            time.sleep(0.05)
        _ctrl_c(proc, tmp_path)
    pid_files = list((tmp_path / "remote runs").glob("*/peer*/pid"))
    _assert_nothing_left(tmp_path, sshd, [int(f.read_text()) for f in pid_files])
