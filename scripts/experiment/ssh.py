"""ssh mode: peers on real hosts listed in an inventory, started and stopped over ssh.

Inventory (TOML), one ``[[hosts]]`` table per site, in peer order (a host listed twice runs
two peers)::

    [[hosts]]
    address = "site-a.example.org"    # what ssh connects to (user@host works)
    listen = "10.0.0.5"               # address the peer binds and advertises (default: address)
    python = "/opt/venv/bin/python"   # interpreter with gossipgrad installed
    data = "/srv/gossipgrad-data"     # GOSSIPGRAD_DATA on that host (task data cache)
    workdir = "/srv/gossipgrad-runs"  # where run directories go on that host
    ssh_port = 2222                   # sshd's port (default: ssh's own, or its config)
    identity = "keys/site-a"          # private key for ssh -i (relative: next to this file)

The runner starts ``ssh HOST 'mkdir -p RUN && cd WORKDIR && echo $$ > RUN/pid &&
GOSSIPGRAD_DATA=DATA exec PYTHON -m gossipgrad.peer ...'`` per peer: the pid file names the
peer process from the moment its shell runs, before the peer has written a status.json.
Without a tty, ending an ssh client does not end what it started, so the runner stops a peer
with ``ssh HOST kill -TERM <pid>`` (``-KILL`` if it has not left by the deadline). The ssh
clients run in sessions of their own: a Ctrl-C at the runner's terminal reaches the runner,
which stops the peers, and not the clients, whose end would cut the peers loose. After the
run each peer's status.json, summary.json, params.pt (and buffers.pt) are copied back with
``ssh HOST cat`` (no scp: it needs the host's sftp subsystem, and its quoting of remote paths
differs between its protocols).
"""

from __future__ import annotations

import logging
import shlex
import subprocess
import time
from pathlib import Path, PurePosixPath
from typing import Any

from gossipgrad.experiment.launch import reap, signals_deferred, unblock_stop_signals
from gossipgrad.experiment.spec import SpecError, tomllib
from gossipgrad.peer.records import PeerStatus
from pydantic import BaseModel, ConfigDict, Field, ValidationError

log = logging.getLogger(__name__)

FETCHED = ("status.json", "summary.json", "params.pt", "buffers.pt")
OPTIONAL = {"buffers.pt"}
"""Fetched files a finished peer may not have (a model without buffers)."""


class Host(BaseModel):
    """One site of the inventory."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    address: str = Field(pattern=r"^[A-Za-z0-9_.@\-\[\]:]+$")
    listen: str = ""
    python: str = "python3"
    data: str = ""
    workdir: str = "gossipgrad-runs"
    port: int = Field(0, ge=0, le=65535)
    """Gossip port to bind (0: the peer picks one and reports it in status.json)."""
    ssh_port: int = Field(0, ge=0, le=65535)
    """Port of the host's sshd (0: ssh's default, or what its config says)."""
    identity: str = ""
    """Private key file for ``ssh -i`` (relative: next to the inventory)."""

    @property
    def listen_host(self) -> str:
        return self.listen or self.address.split("@")[-1]

    def ssh(self, options: list[str], remote: str) -> list[str]:
        """argv that runs the shell command ``remote`` on this host."""
        argv = ["ssh", *options]
        if self.ssh_port:
            argv += ["-p", str(self.ssh_port)]
        if self.identity:
            argv += ["-i", self.identity]
        return [*argv, self.address, remote]


class Inventory(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    hosts: list[Host] = Field(min_length=1)


def load_inventory(path: Path) -> Inventory:
    """Read and validate an inventory; a relative ``identity`` resolves next to it.

    Raises:
        SpecError: naming the bad key.
    """
    try:
        raw = tomllib.loads(Path(path).read_text())
    except FileNotFoundError:
        raise SpecError(f"ssh.inventory: file not found: {path}") from None
    except tomllib.TOMLDecodeError as err:
        raise SpecError(f"ssh.inventory: {path}: invalid TOML: {err}") from None
    try:
        inv = Inventory.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"])
        raise SpecError(f"ssh.inventory {path}: {key}: {first['msg']}") from None
    hosts = []
    for k, host in enumerate(inv.hosts):
        if host.identity:
            key_file = Path(path).parent / Path(host.identity).expanduser()
            if not key_file.is_file():
                raise SpecError(f"ssh.inventory {path}: hosts.{k}.identity: no file {key_file}")
            host = host.model_copy(update={"identity": str(key_file)})
        hosts.append(host)
    return Inventory(hosts=hosts)


def remote_run_dir(host: Host, run: str, i: int) -> str:
    return str(PurePosixPath(host.workdir) / run / f"peer{i}")


def _remote_file(host: Host, run: str, i: int, name: str) -> str:
    return shlex.quote(str(PurePosixPath(remote_run_dir(host, run, i)) / name))


def peer_command(
    host: Host, i: int, run: str, opts: dict[str, str], ssh_options: list[str]
) -> list[str]:
    """argv that starts peer i on ``host`` over ssh with config ``opts`` (dotted keys)."""
    run_dir = remote_run_dir(host, run, i)
    opts = {
        **opts,
        "peer.run_dir": run_dir,
        "peer.listen": f"{host.listen_host}:{host.port}",
    }
    argv = [host.python, "-m", "gossipgrad.peer"]
    for key, value in opts.items():
        argv += [f"--{key}", value]
    env = f"GOSSIPGRAD_DATA={shlex.quote(host.data)} " if host.data else ""
    # exec keeps the shell's pid ($$): the pid file names the peer process.
    remote = (
        f"mkdir -p {shlex.quote(run_dir)} && cd {shlex.quote(host.workdir)} && "
        f"echo $$ > {_remote_file(host, run, i, 'pid')} && "
        f"{env}OMP_NUM_THREADS=1 exec {shlex.join(argv)}"
    )
    return host.ssh(ssh_options, remote)


#: Exit statuses of :func:`stop_command`'s remote half (0: signalled; ssh itself: 255).
NO_PID_FILE, PEER_GONE = 3, 4


def stop_command(
    host: Host, i: int, run: str, ssh_options: list[str], sig: str = "TERM"
) -> list[str]:
    """argv that sends ``sig`` to peer i on ``host`` (the pid in its run dir's pid file;
    ``sig`` 0 only asks whether it runs). Exits 0 when signalled, ``NO_PID_FILE`` while its
    shell has not written the pid file, ``PEER_GONE`` when that process no longer runs."""
    pid_file = _remote_file(host, run, i, "pid")
    return host.ssh(
        ssh_options,
        f"pid=$(cat {pid_file} 2>/dev/null) || exit {NO_PID_FILE}; "
        f'kill -{sig} "$pid" 2>/dev/null || exit {PEER_GONE}',
    )


def fetch_command(host: Host, i: int, run: str, name: str, ssh_options: list[str]) -> list[str]:
    """argv that writes peer i's result file ``name`` to stdout."""
    return host.ssh(ssh_options, f"cat -- {_remote_file(host, run, i, name)}")


class SshSwarm:
    """Peers on inventory hosts; the same surface as ``LocalSwarm`` for the runner.

    Peer 0 must have a fixed ``port`` in the inventory: the others bootstrap from it.
    Results are copied back into ``out/peer{i}`` by ``fetch()`` after the run.
    """

    def __init__(
        self,
        out: Path,
        n: int,
        overrides: dict[str, str],
        inventory: Inventory,
        run: str,
        ssh_options: list[str],
    ) -> None:
        if len(inventory.hosts) < n:
            raise ValueError(f"inventory lists {len(inventory.hosts)} hosts for {n} peers")
        if n > 1 and inventory.hosts[0].port == 0:
            raise ValueError("ssh.inventory: hosts.0.port must be set (the others bootstrap)")
        self.out, self.n, self.overrides = Path(out), n, overrides
        self.hosts = inventory.hosts[:n]
        self.run, self.ssh_options = run, ssh_options
        self.procs: dict[int, subprocess.Popen] = {}
        self.logs: list[Any] = []

    def peer_dir(self, i: int) -> Path:
        return self.out / f"peer{i}"

    def bootstrap(self) -> str:
        h = self.hosts[0]
        return f"{h.listen_host}:{h.port}"

    def command(self, i: int, bootstrap: str | None) -> list[str]:
        opts = {
            "peer.id": f"peer{i}",
            "peer.expected_peers": str(self.n),
            "train.shard_index": str(i),
            "train.num_shards": str(self.n),
            "train.threads": "1",
            **self.overrides,
        }
        if bootstrap:
            opts["peer.bootstrap"] = self.bootstrap()
        return peer_command(self.hosts[i], i, self.run, opts, self.ssh_options)

    def start(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        for i in range(self.n):
            self.peer_dir(i).mkdir(parents=True, exist_ok=True)
            log_file = open(self.out / f"peer{i}.log", "w")  # noqa: SIM115 - closed in stop()
            self.logs.append(log_file)
            cmd = self.command(i, self.bootstrap() if i else None)
            # A session of its own: a Ctrl-C at the runner's terminal must not end the client
            # (that would leave the peer running, unreachable); the runner stops the peer.
            # The stop signals wait while the client is spawned and recorded: a Ctrl-C
            # between the fork and the assignment left a peer the runner did not know.
            with signals_deferred():
                self.procs[i] = subprocess.Popen(
                    cmd, stdin=subprocess.DEVNULL, stdout=log_file, stderr=subprocess.STDOUT,
                    start_new_session=True, preexec_fn=unblock_stop_signals,
                )  # fmt: skip

    def statuses(self) -> list[PeerStatus]:
        """Placeholders: remote status files are fetched only after the run."""
        return [PeerStatus(id=f"peer{i}", state="remote") for i in range(self.n)]

    def running(self) -> bool:
        return any(p.poll() is None for p in self.procs.values())

    def failed(self) -> list[int]:
        return [i for i, p in self.procs.items() if p.poll() not in (None, 0)]

    def _signal(self, i: int, sig: str) -> int:
        """Send ``sig`` to remote peer i; :func:`stop_command`'s exit status (255: ssh
        failed or timed out)."""
        cmd = stop_command(self.hosts[i], i, self.run, self.ssh_options, sig)
        try:
            return subprocess.run(cmd, capture_output=True, timeout=30, check=False).returncode
        except subprocess.TimeoutExpired:
            return 255

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM every remote peer (it checkpoints and leaves), wait until none runs, SIGKILL
        those still running at the deadline, then end the ssh clients.

        Peers are followed by their pid on the host, not by their ssh client: a client whose
        connection dropped ends while its peer runs on, and that peer must be stopped too. A
        peer whose shell has not written its pid file yet is signalled once it has (unless
        its client has ended: then its shell is gone, or never started)."""
        deadline = time.monotonic() + timeout
        todo = set(self.procs)
        while todo and time.monotonic() < deadline:
            for i in sorted(todo):
                rc = self._signal(i, "TERM")
                if rc in (0, PEER_GONE) or (rc == NO_PID_FILE and self.procs[i].poll() is not None):
                    todo.discard(i)
            if todo:
                time.sleep(0.2)
        running = set(self.procs) - todo
        while running and time.monotonic() < deadline:
            running = {i for i in running if self._signal(i, "0") == 0}
            if running:
                time.sleep(0.5)
        for i in sorted(running | todo):
            log.warning(
                "peer%d on %s did not leave in %.0fs: killed", i, self.hosts[i].address, timeout
            )
            self._signal(i, "KILL")
        reap(self.procs.values(), 10.0)
        for f in self.logs:
            f.close()
        self.logs.clear()

    def fetch(self) -> None:
        """Copy status.json, summary.json, params.pt and (if any) buffers.pt of every peer back."""
        for i in range(self.n):
            for name in FETCHED:
                self._fetch(i, name)

    def _fetch(self, i: int, name: str) -> None:
        dest = self.peer_dir(i) / name
        part = dest.with_name(f"{name}.part")
        cmd = fetch_command(self.hosts[i], i, self.run, name, self.ssh_options)
        try:
            with open(part, "wb") as f:
                done = subprocess.run(cmd, stdout=f, stderr=subprocess.PIPE, timeout=120)
            ok, why = done.returncode == 0, done.stderr.decode(errors="replace").strip()
        except subprocess.TimeoutExpired:
            ok, why = False, "timed out"
        if ok:
            part.replace(dest)
            return
        part.unlink(missing_ok=True)
        if name not in OPTIONAL:
            log.warning(
                "peer%d: could not fetch %s from %s: %s", i, name, self.hosts[i].address, why
            )
