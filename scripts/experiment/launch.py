"""Launching and stopping local processes: a swarm of peer daemons, and reaping process trees.

``LocalSwarm`` starts N ``gossipgrad-peer`` processes (``python -m gossipgrad.peer``) on this
machine, peer0 first and the others bootstrapping from the address peer0 reports in its
``status.json``; ``reap`` makes sure that whatever was started -- a peer, a torchrun site with
its ranks, a baseline rank with its helper daemons -- is gone when a phase ends.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import IO

import psutil
from gossipgrad.peer.records import PeerStatus, read_record

log = logging.getLogger(__name__)

ADDRESS_TIMEOUT_S = 60.0
# What a peer leaves in its run dir; removed before a fresh start.
RUN_FILES = ("status.json", "summary.json", "params.pt", "buffers.pt", "checkpoint.pt")


class LocalSwarm:
    """N peer processes on 127.0.0.1, each with its own run directory and log file.

    Args:
        out: directory for peer run dirs, logs and the swarm summary.
        n: number of peers.
        overrides: dotted config keys applied to every peer (``train.task`` etc.).
        config: optional base TOML file every peer reads first.
        command_prefix: optional ``i -> argv prefix`` run before peer i's python, e.g.
            ``["ip", "netns", "exec", NS]`` to start it inside a network namespace.
        peer_overrides: optional ``i -> {key: value}`` applied to peer i after
            ``overrides`` and the bootstrap address, e.g. its own ``peer.listen`` address
            (or ``peer.bootstrap = ""`` for a peer meant to start a swarm of its own).
        spares: warm spare processes (``gossipgrad-peer --standby``, see
            :mod:`gossipgrad.peer.runtime.standby`) that ``start()`` brings up, warm, before
            the first peer; a later ``spawn`` takes one while any is left instead of starting
            a process, as a site whose process start-up does not share the swarm's cores.
        cpus: optional CPUs every process of the swarm (spares included) is confined to
            (``taskset``), e.g. to run two swarms side by side on separate cores.
    """

    def __init__(
        self,
        out: Path,
        n: int,
        overrides: dict[str, str],
        config: Path | None = None,
        *,
        command_prefix: Callable[[int], list[str]] | None = None,
        peer_overrides: Callable[[int], dict[str, str]] | None = None,
        spares: int = 0,
        cpus: Iterable[int] | None = None,
    ) -> None:
        if n < 1:
            raise ValueError(f"need at least one peer, got {n}")
        if spares and command_prefix is not None:
            raise ValueError("warm spares run on this host only (no command_prefix)")
        self.out = Path(out)
        self.n = n
        self.overrides = overrides
        self.config = config
        self.command_prefix = command_prefix
        self.peer_overrides = peer_overrides
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: list[IO[str]] = []
        self.log_path: dict[int, Path] = {}  # peer -> the log of its current process
        self.bootstrap: str | None = None
        self.spares = spares
        self._idle_spares: list[tuple[Path, subprocess.Popen]] = []  # (trigger, process)
        self.spare_pids: set[int] = set()  # every spare process started
        self._spares_started = False
        self.cpus = sorted(set(cpus)) if cpus is not None else None
        if self.cpus is not None and not self.cpus:
            raise ValueError("cpus: name at least one CPU")

    def peer_dir(self, i: int) -> Path:
        return self.out / f"peer{i}"

    def options(
        self, i: int, bootstrap: str | None, extra: dict[str, str] | None = None
    ) -> dict[str, str]:
        """Every config key peer i starts with; ``extra``: keys applied last, for this start
        only."""
        opts = {
            "peer.id": f"peer{i}",
            "peer.run_dir": str(self.peer_dir(i)),
            "peer.expected_peers": str(self.n),
            # A joiner past the first n (a churn run's newcomer) trains a departed one's shard.
            "train.shard_index": str(i % self.n),
            "train.num_shards": str(self.n),
            "train.threads": "1",
            **self.overrides,
        }
        if bootstrap:
            opts["peer.bootstrap"] = bootstrap
        if self.peer_overrides is not None:
            opts.update(self.peer_overrides(i))
        opts.update(extra or {})
        return opts

    def command(
        self, i: int, bootstrap: str | None, extra: dict[str, str] | None = None
    ) -> list[str]:
        """The command line of peer i (also written to DIR/commands.sh)."""
        prefix = self.command_prefix(i) if self.command_prefix else []
        return self._argv(prefix, self.options(i, bootstrap, extra))

    def _argv(self, prefix: list[str], opts: dict[str, str]) -> list[str]:
        cmd = [*prefix, sys.executable, "-m", "gossipgrad.peer"]
        if self.config is not None:
            cmd += ["--config", str(self.config)]
        for k, v in opts.items():
            cmd += [f"--{k}", v]
        return cmd

    def _spare_options(self) -> dict[str, str]:
        """The keys every spare starts with (a peer's own keys come in its trigger)."""
        return {"train.threads": "1", **self.overrides}

    def _record_command(self, line: str) -> None:
        """Append one line to OUT/commands.sh (what was started, as a shell would)."""
        with open(self.out / "commands.sh", "a") as f:
            f.write(line + "\n")

    def _popen(self, cmd: list[str], log_path: Path) -> subprocess.Popen:
        if self.cpus is not None:  # taskset execs the command: the pid stays the peer's
            cmd = ["taskset", "--cpu-list", ",".join(map(str, self.cpus)), *cmd]
        self._record_command(" ".join(cmd) + " &")
        log_file = open(log_path, "a")  # noqa: SIM115 - closed in stop()
        self.logs.append(log_file)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
        return subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env)

    def start_spares(self, timeout: float = ADDRESS_TIMEOUT_S * 10) -> None:
        """Start ``spares`` standby processes and wait until every one is warm (``start``
        does it first if it was not done before)."""
        if self._spares_started:
            return
        self._spares_started = True
        self._prepare()
        spares_dir = self.out / "spares"
        spares_dir.mkdir(exist_ok=True)
        for k in range(self.spares):
            trigger = spares_dir / f"spare{k}.go"
            trigger.unlink(missing_ok=True)
            argv = [*self._argv([], self._spare_options()), "--standby", str(trigger)]
            proc = self._popen(argv, spares_dir / f"spare{k}.log")
            self._idle_spares.append((trigger, proc))
            self.spare_pids.add(proc.pid)
        deadline = time.monotonic() + timeout
        for trigger, proc in self._idle_spares:
            while not spare_is_warm(trigger):
                if proc.poll() is not None:
                    raise RuntimeError(f"spare {trigger.stem} exited; see its log in {spares_dir}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"spare {trigger.stem} not warm in {timeout:.0f}s")
                time.sleep(0.1)

    def _take_spare(self, i: int, opts: dict[str, str]) -> subprocess.Popen | None:
        """Hand peer i's own keys to an idle warm spare (None if none is left)."""
        while self._idle_spares:
            trigger, proc = self._idle_spares.pop(0)
            if proc.poll() is not None:
                continue
            base = self._spare_options()
            own = {k: v for k, v in opts.items() if base.get(k) != v}
            try:  # no reader on the pipe (the spare is gone): ENXIO rather than a hang
                fd = os.open(trigger, os.O_WRONLY | os.O_NONBLOCK)
            except OSError:
                continue
            os.set_blocking(fd, True)
            try:
                with os.fdopen(fd, "w") as pipe:
                    pipe.write("".join(f"{k}={v}\n" for k, v in own.items()))
            except BrokenPipeError:  # it died between the open and the write
                continue
            self._record_command(
                f"# peer{i}: warm spare {trigger.stem} (pid {proc.pid}), {trigger}"
            )
            self.log_path[i] = trigger.with_suffix(".log")
            return proc
        return None

    def spawn(
        self,
        i: int,
        bootstrap: str | None = None,
        extra: dict[str, str] | None = None,
        *,
        spare: bool = True,
    ) -> None:
        """Start (or restart) peer i, bootstrapping from ``bootstrap`` when given, else from
        peer0 unless it is peer0. An index from ``n`` on is a newcomer with a run dir of its
        own (it downloads the swarm's state); ``extra``: config keys for this start only,
        e.g. ``peer.expected_peers=1`` for a peer joining a swarm that already runs;
        ``spare``: an idle warm spare takes it if there is one."""
        if bootstrap is None:
            bootstrap = None if i == 0 else self.bootstrap
        self.peer_dir(i).mkdir(parents=True, exist_ok=True)
        taken = self._take_spare(i, self.options(i, bootstrap, extra)) if spare else None
        if taken is not None:
            self.procs[i] = taken
            return
        self.log_path[i] = self.out / f"peer{i}.log"
        self.procs[i] = self._popen(self.command(i, bootstrap, extra), self.log_path[i])

    def _prepare(self) -> None:
        """Before anything starts (``start_spares``, once): a fresh commands.sh, no files of
        an earlier run."""
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "commands.sh").write_text("#!/usr/bin/env bash\n")
        for i in range(self.n):
            for name in RUN_FILES:
                (self.peer_dir(i) / name).unlink(missing_ok=True)
            (self.out / f"peer{i}.log").unlink(missing_ok=True)

    def start(self, count: int | None = None) -> None:
        """Start peer0, wait for its address, then peers 1..count-1 bootstrapping from it."""
        self.start_spares()
        self.spawn(0, spare=False)
        self.bootstrap = self._wait_for_address(0)
        for i in range(1, self.n if count is None else count):
            self.spawn(i, spare=False)

    def _wait_for_address(self, i: int) -> str:
        """The gossip address peer i reports in its status.json, once it does."""
        deadline = time.monotonic() + ADDRESS_TIMEOUT_S
        while True:
            status = read_record(self.peer_dir(i) / "status.json", PeerStatus)
            if status is not None and status.address:
                return status.address
            if self.procs[i].poll() is not None:
                raise RuntimeError(f"peer{i} exited early; see {self.out / f'peer{i}.log'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"peer{i} did not start in {ADDRESS_TIMEOUT_S}s")
            time.sleep(0.1)

    def kill(self, i: int) -> None:
        """SIGKILL peer i (a crash: no checkpoint, no goodbye)."""
        self.procs[i].kill()
        self.procs[i].wait()

    def terminate(self, i: int, timeout: float | None = 30.0) -> int | None:
        """SIGTERM peer i (it finishes its step, checkpoints, says goodbye and exits) and
        wait for it; SIGKILL it after ``timeout``. Its exit status (None if it had to be
        killed, or with ``timeout=None``: signal only, do not wait)."""
        proc = self.procs[i]
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        if timeout is None:
            return proc.poll()
        try:
            return proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            log.warning("peer%d did not leave in %.0fs after SIGTERM: killed", i, timeout)
            proc.kill()
            proc.wait()
            return None

    def alive(self, i: int) -> bool:
        """Peer i was started and its process still runs."""
        proc = self.procs.get(i)
        return proc is not None and proc.poll() is None

    def address(self, i: int) -> str | None:
        """The gossip address peer i's status.json reports (None before it wrote one)."""
        return self.status(i).address

    def status(self, i: int) -> PeerStatus:
        """Peer i's latest status.json (a 'starting' one before it wrote any)."""
        return read_record(self.peer_dir(i) / "status.json", PeerStatus) or PeerStatus(
            id=f"peer{i}"
        )

    def statuses(self) -> list[PeerStatus]:
        return [self.status(i) for i in range(self.n)]

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs.values())

    def failed(self) -> list[int]:
        return [i for i, p in self.procs.items() if p.poll() not in (None, 0)]

    def wait(self, timeout: float) -> bool:
        """Wait for every peer to exit; False on timeout."""
        deadline = time.monotonic() + timeout
        while self.running():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.2)
        return True

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM every peer (they checkpoint and leave), SIGKILL what is left after timeout
        (their child processes included)."""
        terminate([*self.procs.values(), *(p for _, p in self._idle_spares)], timeout)
        self._idle_spares.clear()
        for log_file in self.logs:
            log_file.close()
        self.logs.clear()


def spare_is_warm(trigger: Path) -> bool:
    """A ``gossipgrad-peer --standby PATH`` spare is warm once ``PATH`` is a named pipe."""
    try:
        return stat.S_ISFIFO(trigger.stat().st_mode)
    except OSError:
        return False


#: Signals that stop a run.
STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Hold SIGINT/SIGTERM/SIGHUP (a signal that arrives meanwhile is delivered afterwards):
    while cleaning up, so a second Ctrl-C cannot cut the cleanup short, and while a child is
    spawned and recorded, so a Ctrl-C between the fork and the assignment cannot leave a
    child nobody knows. A child spawned inside must unblock them (``preexec_fn=``
    :func:`unblock_stop_signals`) or it inherits them held."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def unblock_stop_signals() -> None:
    """In a child before exec: do not inherit the stop signals held by the parent."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def _descendants(procs: Iterable[subprocess.Popen]) -> list[psutil.Process]:
    """Every live process below ``procs`` (children, grandchildren, ...), looked up now,
    while the parents still exist: once a parent is gone its orphans are not its any more."""
    out: list[psutil.Process] = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            out += psutil.Process(p.pid).children(recursive=True)
    return out


def terminate(procs: Iterable[subprocess.Popen], timeout: float) -> None:
    """SIGTERM each process still running, then :func:`reap` them and their descendants.

    The descendants are looked up before the signal: a parent that exits on SIGTERM hands its
    children to init at once, and after that nothing ties them to it.
    """
    procs = list(procs)
    tree = _descendants(procs)
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    _reap(procs, tree, timeout)


def reap(procs: Iterable[subprocess.Popen], timeout: float) -> None:
    """Wait for processes already told to stop, and for their descendants still attached to
    them; SIGKILL whatever of them still runs at the deadline. (:func:`terminate` also finds
    the children of a process that exits on the signal.)"""
    procs = list(procs)
    _reap(procs, _descendants(procs), timeout)


def _reap(procs: list[subprocess.Popen], tree: list[psutil.Process], timeout: float) -> None:
    """Wait until the deadline for ``procs`` and ``tree``; SIGKILL what still runs then."""
    deadline = time.monotonic() + timeout
    for p in procs:
        with contextlib.suppress(subprocess.TimeoutExpired):
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
    for p in procs:
        if p.poll() is None:
            log.warning("pid %d did not stop in %.0fs: killed", p.pid, timeout)
            p.kill()
            p.wait()
    left = _still_running(tree, deadline)
    for child in left:
        log.warning("pid %d (a child) outlived its parent: killed", child.pid)
        with contextlib.suppress(psutil.Error):
            child.kill()
    _still_running(left, time.monotonic() + 5.0)


def _running(p: psutil.Process) -> bool:
    """Alive and not a zombie (an orphan's zombie may wait for a reaper that never comes)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _still_running(procs: list[psutil.Process], deadline: float) -> list[psutil.Process]:
    """Poll until every one of ``procs`` is gone or the deadline passes; those left."""
    while True:
        left = [p for p in procs if _running(p)]
        if not left or time.monotonic() >= deadline:
            return left
        time.sleep(0.1)
