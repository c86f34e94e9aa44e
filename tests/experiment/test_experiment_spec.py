"""Experiment runner pieces that need no processes: spec validation, plans, command lines
(netns shaping, ssh), the report from a synthetic run, the CLI's errors."""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from gossipgrad.experiment import cli, ssh
from gossipgrad.experiment.analysis import smooth
from gossipgrad.experiment.baselines import RankPlacement, rank_command
from gossipgrad.experiment.markdown import markdown
from gossipgrad.experiment.netns import netem_args, shaping_commands
from gossipgrad.experiment.plots import PLOTS
from gossipgrad.experiment.records import Report
from gossipgrad.experiment.report import load_report, write_outputs
from gossipgrad.experiment.spec import (
    LinkProfile,
    SpecError,
    load_spec,
    parse_spec,
    rate_bits,
    time_seconds,
)
from gossipgrad.peer.records import PeerStatus
from hypothesis import given, settings
from hypothesis import strategies as st
from support import ROOT
from support.experiment import png_size

SPECS = sorted((ROOT / "scripts" / "experiments").glob("*.toml"))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("path", SPECS, ids=[p.stem for p in SPECS])
def test_shipped_specs_validate(path: Path) -> None:
    spec = load_spec(path)
    assert spec.experiment.peers >= 1
    assert spec.peer_config().train.steps > 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("raw", "key"),
    [
        ({"experiment": {"peerz": 3}}, "experiment.peerz: unknown key"),
        ({"experiment": {"peers": 0}}, "experiment.peers"),
        ({"experiment": {"mode": "cloud"}}, "experiment.mode"),
        ({"train": {"stepz": 3}}, "train.stepz: unknown key"),
        ({"gossip": {"codec": "bogus"}}, "gossip.codec"),
        ({"train": {"seed": 3}}, "train.seed: set by experiment.seed"),
        ({"peer": {"id": "x"}}, "peer:"),
        ({"experiment": {"mode": "netns"}, "network": {"rate": "10mb"}}, "network.rate"),
        ({"experiment": {"mode": "netns"}, "network": {"jitter": "1ms"}}, "jitter needs a delay"),
        ({"network": {"rate": "10mbit", "emulator": "netem"}}, "netem needs experiment.mode"),
        ({"network": {"delay": "10ms", "emulator": "tun"}}, "tun needs experiment.mode"),
        ({"experiment": {"mode": "netns"}, "network": {"emulator": "relay"}}, "local mode only"),
        ({"experiment": {"mode": "netns"}, "network": {"reset": 1.0}}, "network.reset"),
        (
            {"experiment": {"mode": "netns", "peers": 2}, "network": {"sites": [{"peers": [5]}]}},
            "network.sites.0.peers",
        ),
        ({"baselines": {"run": ["ddp", "allgather"]}}, "baselines.run"),
        ({"experiment": {"mode": "ssh"}}, "ssh.inventory"),
        (
            {
                "experiment": {"mode": "netns", "peers": 3},
                "network": {"natted": [1, 3]},
                "baselines": {"run": []},
            },
            r"network.natted: [3] out of range 0..2",
        ),
        (
            {"network": {"natted": [1]}, "baselines": {"run": []}},
            "network.natted: sites behind NAT need experiment.mode = 'netns'",
        ),
        (
            {"experiment": {"mode": "netns"}, "network": {"natted": [0]}, "baselines": {"run": []}},
            "network.natted: peer 0 is every peer's bootstrap",
        ),
        (
            {
                "experiment": {"mode": "netns"},
                "network": {"natted": [1, 1]},
                "baselines": {"run": []},
            },
            "network.natted: a site listed twice",
        ),
        (
            {"experiment": {"mode": "netns"}, "network": {"natted": [1]}},
            "network.natted: baseline ranks dial each other directly",
        ),
    ],
)
def test_bad_specs_name_the_key(raw: dict, key: str) -> None:
    pattern = key.replace(".", r"\.").replace("(", r"\(").replace("[", r"\[").replace("]", r"\]")
    with pytest.raises(SpecError, match=pattern):
        parse_spec(raw)


@pytest.mark.timeout(30)
def test_dry_run_places_natted_sites_behind_their_routers(tmp_path: Path) -> None:
    """network.natted: a NAT'd site binds its private address and advertises its router's."""
    proc = subprocess.run(
        [sys.executable, "-m", "gossipgrad.experiment", str(SPECS[0]), "--out",
         str(tmp_path / "out"), "--dry-run", "--set", "experiment.peers=3", "--set",
         "experiment.mode=netns", "--set", "network.natted=[2]", "--set", "baselines.run=[]"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    sites = [line for line in proc.stdout.splitlines() if line.startswith("site ")]
    assert len(sites) == 3 and "behind NAT (router ggPLANx0000-r2)" in sites[2], sites
    assert not any("behind NAT" in line for line in sites[:2]), sites
    peer2 = next(line for line in proc.stdout.splitlines() if line.startswith("peer 2:"))
    assert "--peer.listen 10.77.2.2:7000 --peer.advertise 198.18.0.3:7000" in peer2, peer2
    peer1 = next(line for line in proc.stdout.splitlines() if line.startswith("peer 1:"))
    assert "--peer.advertise" not in peer1 and "--peer.listen 198.18.0.2:0" in peer1, peer1


@pytest.mark.timeout(30)
def test_profiles_merge_site_over_default_and_pairs() -> None:
    spec = parse_spec(
        {
            "experiment": {"mode": "netns", "peers": 3},
            "network": {
                "rate": "100mbit",
                "sites": [{"peers": [2], "rate": "10mbit"}],
                "links": [{"a": 0, "b": 1, "rate": "1mbit"}],
            },
        }
    )
    assert spec.network.site(0).rate == "100mbit"
    assert spec.network.site(2).rate == "10mbit"
    assert spec.network.pair(1, 0) == LinkProfile(rate="1mbit")
    assert spec.network.pair(0, 2) is None
    assert rate_bits("10mbit") == 1e7 and time_seconds("20ms") == pytest.approx(0.02)


@pytest.mark.timeout(30)
def test_shaping_commands_cap_rate_and_route_pairs_by_destination() -> None:
    site = LinkProfile(rate="10mbit", delay="20ms", jitter="5ms", loss=1.0)
    cmds = shaping_commands("eth0", site, {"198.18.0.2": LinkProfile(rate="1mbit")})
    text = [" ".join(c) for c in cmds]
    assert text[0] == "tc qdisc add dev eth0 root handle 1: htb default 1"
    assert "tc class add dev eth0 parent 1: classid 1:1 htb rate 10mbit ceil 10mbit" in text
    assert "tc class add dev eth0 parent 1: classid 1:10 htb rate 1mbit ceil 1mbit" in text
    netem = [t for t in text if "netem" in t]
    # The pair inherits the site's delay/jitter/loss (both leaves get netem).
    assert len(netem) == 2 and all("delay 20ms 5ms" in t and "loss 1.0%" in t for t in netem)
    assert any("match ip dst 198.18.0.2/32 flowid 1:10" in t for t in text)
    assert shaping_commands("eth0", LinkProfile()) == []
    assert netem_args(LinkProfile(rate="1mbit")) == []


@pytest.mark.timeout(60)
def test_dry_run_prints_the_plan_and_starts_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "gossipgrad.experiment", str(SPECS[0]), "--out", str(out),
         "--dry-run", "--set", "experiment.peers=3", "--set", "baselines.run=['powersgd']"],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("-m gossipgrad.peer") == 3
    assert "--train.num_shards 3" in proc.stdout
    assert "baseline powersgd: 3 ranks" in proc.stdout and "baseline ddp" not in proc.stdout
    assert not out.exists()


@pytest.mark.timeout(60)
def test_cli_errors_name_the_key_and_help_works(tmp_path: Path, capsys) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[experiment]\npeers = 2\n[gossip]\ngama = 0.1\n")
    assert cli.main([str(bad), "--dry-run"]) == 2
    assert "gossip.gama: unknown key" in capsys.readouterr().out
    assert cli.main([str(tmp_path / "missing.toml")]) == 2
    assert "spec file not found" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    assert "--dry-run" in capsys.readouterr().out


@pytest.mark.timeout(30)
def test_rank_commands_carry_placement_and_hook(tmp_path: Path) -> None:
    place = RankPlacement(prefix=lambda r: ["ip", "netns", "exec", f"ns{r}"], host="198.18.0.1")
    cmd = rank_command("powersgd", 2, 3, tmp_path, place, powersgd_rank=4)
    assert cmd[:4] == ["ip", "netns", "exec", "ns2"]
    joined = " ".join(cmd)
    assert "--rank 2 --world 3 --host 198.18.0.1" in joined
    assert "--hook powersgd --psgd-rank 4" in joined
    assert "--hook dense" in " ".join(rank_command("ddp", 0, 3, tmp_path, RankPlacement()))


INVENTORY = """
[[hosts]]
address = "alice@site-a.example"
listen = "10.1.0.5"
python = "/opt/venv/bin/python"
data = "/srv/data dir"
workdir = "/srv/runs"
port = 7070

[[hosts]]
address = "site-b.example"
"""


@pytest.mark.timeout(30)
def test_ssh_commands(tmp_path: Path) -> None:
    inv_path = tmp_path / "hosts.toml"
    inv_path.write_text(INVENTORY)
    spec_path = tmp_path / "spec.toml"
    spec_path.write_text('[experiment]\nmode = "ssh"\npeers = 2\n[ssh]\ninventory = "hosts.toml"\n')
    spec = load_spec(spec_path)
    assert spec.ssh.inventory == inv_path
    inv = ssh.load_inventory(inv_path)
    swarm = ssh.SshSwarm(tmp_path / "swarm", 2, {"train.steps": "10"}, inv, "run1", ["-p", "22"])
    first = swarm.command(0, None)
    assert first[:4] == ["ssh", "-p", "22", "alice@site-a.example"]
    remote = shlex.split(first[4])
    assert remote[:3] == ["mkdir", "-p", "/srv/runs/run1/peer0"]
    assert "GOSSIPGRAD_DATA=/srv/data dir" in remote
    argv = remote[remote.index("exec") + 1 :]
    assert argv[:3] == ["/opt/venv/bin/python", "-m", "gossipgrad.peer"]
    opts = dict(zip(argv[3::2], argv[4::2], strict=True))
    assert opts["--peer.listen"] == "10.1.0.5:7070"
    assert opts["--peer.run_dir"] == "/srv/runs/run1/peer0"
    assert opts["--train.steps"] == "10" and "--peer.bootstrap" not in opts
    second = swarm.command(1, swarm.bootstrap())
    opts = shlex.split(second[-1])
    assert second[3] == "site-b.example"
    assert opts[opts.index("--peer.bootstrap") + 1] == "10.1.0.5:7070"
    assert opts[opts.index("--peer.listen") + 1] == "site-b.example:0"
    assert "echo $$ > /srv/runs/run1/peer0/pid &&" in first[4]
    stop = ssh.stop_command(inv.hosts[0], 0, "run1", [])
    assert stop[1] == "alice@site-a.example" and "kill -TERM" in stop[2]
    assert "kill -KILL" in ssh.stop_command(inv.hosts[0], 0, "run1", [], "KILL")[2]
    fetch = ssh.fetch_command(inv.hosts[0], 0, "run1", "status.json", [])
    assert fetch == ["ssh", "alice@site-a.example", "cat -- /srv/runs/run1/peer0/status.json"]
    no_port = inv_path.read_text().replace("port = 7070", "")
    inv_path.write_text(no_port)
    with pytest.raises(ValueError, match=r"hosts\.0\.port"):
        ssh.SshSwarm(tmp_path, 2, {}, ssh.load_inventory(inv_path), "r", [])


@pytest.mark.timeout(30)
def test_ssh_port_and_identity_per_host(tmp_path: Path) -> None:
    """An inventory host's ssh_port and identity (relative: next to the inventory) go into
    every ssh command for that host; a missing key file is an error naming the key."""
    (tmp_path / "keys").mkdir()
    (tmp_path / "keys" / "a").write_text("key")
    inv_path = tmp_path / "hosts.toml"
    inv_path.write_text(
        '[[hosts]]\naddress = "a"\nport = 7070\nssh_port = 2222\nidentity = "keys/a"\n'
        '[[hosts]]\naddress = "b"\n'
    )
    inv = ssh.load_inventory(inv_path)
    key = str(tmp_path / "keys" / "a")
    swarm = ssh.SshSwarm(tmp_path / "swarm", 2, {}, inv, "r", ["-o", "BatchMode=yes"])
    assert swarm.command(0, None)[:7] == ["ssh", "-o", "BatchMode=yes", "-p", "2222", "-i", key]
    assert ssh.stop_command(inv.hosts[0], 0, "r", [])[:6] == ["ssh", "-p", "2222", "-i", key, "a"]
    assert ssh.fetch_command(inv.hosts[0], 0, "r", "params.pt", [])[1:6] == [
        "-p", "2222", "-i", key, "a"
    ]  # fmt: skip
    assert swarm.command(1, "x")[:4] == ["ssh", "-o", "BatchMode=yes", "b"]
    inv_path.write_text('[[hosts]]\naddress = "a"\nidentity = "keys/missing"\n')
    with pytest.raises(SpecError, match=r"hosts\.0\.identity"):
        ssh.load_inventory(inv_path)
    inv_path.write_text('[[hosts]]\naddress = "a"\nssh_port = 70000\n')
    with pytest.raises(SpecError, match=r"hosts\.0\.ssh_port"):
        ssh.load_inventory(inv_path)


@pytest.mark.timeout(60)
def test_ssh_stop_command_signals_the_pid_in_the_pid_file(tmp_path: Path) -> None:
    """The remote half of ``stop_command``, run by a local shell: it reads the pid file the
    peer's shell wrote and sends SIGTERM to exactly that process; it tells a missing pid file
    and a process that no longer runs apart (the runner retries the one, is done with the
    other)."""
    host = ssh.Host(address="h", workdir=str(tmp_path / "w d"), python=sys.executable)
    run_dir = Path(ssh.remote_run_dir(host, "r", 0))
    run_dir.mkdir(parents=True)

    def remote(sig: str = "TERM") -> int:
        cmd = ssh.stop_command(host, 0, "r", [], sig)[-1]
        return subprocess.run(["bash", "-c", cmd], capture_output=True, timeout=30).returncode

    assert remote() == ssh.NO_PID_FILE
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (run_dir / "pid").write_text(f"{victim.pid}\n")
        assert remote("0") == 0  # it runs
        assert remote() == 0
        assert victim.wait(timeout=10) == -signal.SIGTERM
        assert remote() == remote("0") == ssh.PEER_GONE
    finally:
        victim.kill()
        victim.wait()


@settings(max_examples=50, deadline=None)
@given(values=st.lists(st.text(min_size=0, max_size=20), min_size=1, max_size=4))
@pytest.mark.timeout(60)
def test_ssh_remote_command_round_trips_any_value(values: list[str]) -> None:
    """Whatever a config value holds (spaces, quotes, $, ;), the remote shell sees it as one
    argument, unchanged."""
    host = ssh.Host(address="h", workdir="/w d", port=1)
    opts = {f"train.k{i}": v for i, v in enumerate(values)}
    remote = shlex.split(ssh.peer_command(host, 0, "r", opts, [])[-1])
    argv = remote[remote.index("exec") + 1 :]
    got = dict(zip(argv[3::2], argv[4::2], strict=True))
    for key, value in opts.items():
        assert got[f"--{key}"] == value


@settings(max_examples=50, deadline=None)
@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=50), st.integers(1, 10))
@pytest.mark.timeout(60)
def test_smoothing_is_a_trailing_mean(values: list[float], window: int) -> None:
    out = smooth(values, window)
    assert len(out) == len(values)
    for i, v in enumerate(out):
        chunk = values[max(0, i - window + 1) : i + 1]
        assert v == pytest.approx(sum(chunk) / len(chunk), rel=1e-6, abs=1e-3)


def synthetic_report() -> Report:
    hist = [{"step": s, "loss": 2.0 / s, "sent_bytes": 1000 * s, "seconds": 0.1 * s,
             "consensus_distance": 1.0 / s} for s in range(1, 40)]  # fmt: skip
    evals = [{"step": 20, "seconds": 1.9, "accuracy": 0.8, "loss": 0.5}]
    peer = {"id": "peer0", "final": {"accuracy": 0.9, "loss": 0.3}, "metric": "accuracy",
            "steps": 39, "history": hist, "sent_bytes": 39000, "dense_bytes": 4e6,
            "evals": evals, "final_seconds": 3.8}  # fmt: skip
    base = {"final": {"accuracy": 0.95, "loss": 0.2}, "metric": "accuracy", "steps": 39,
            "ranks": [{"history": hist}], "mean_sent_bytes": 4e6, "wall_seconds": 2.0,
            "dense_bytes_per_rank": 4e6, "link_bytes": {"rank0 ring": 4e6},
            "evals": evals, "final_seconds": 2.0}  # fmt: skip
    return Report.model_validate({
        "name": "synthetic", "task": "digits", "peers": 1, "mode": "local", "seed": 0,
        "steps": 39, "batch_size": 32, "codec": "topk:0.01", "topology": "ring",
        "swarm": {"peers": [peer], "metric": "accuracy", "mean_sent_bytes": 39000,
                  "mean_dense_bytes": 4e6, "wall_seconds": 4.0, "consensus_distance": 1e-3,
                  "relative_consensus_distance": 1e-5, "link_bytes": {"peer0→peer1": 39000}},
        "baselines": {"ddp": base},
    })  # fmt: skip


@pytest.mark.timeout(120)
def test_report_writes_valid_pngs_and_a_table(tmp_path: Path) -> None:
    report = synthetic_report()
    write_outputs(tmp_path, report)
    assert load_report(tmp_path) == report  # what was written reads back the same
    for name in PLOTS:
        w, h = png_size(tmp_path / name)
        assert w >= 400 and h >= 200
    md = markdown(report)
    assert "| gossipgrad (topk:0.01, ring) | 0.9000 (0.9000-0.9000)" in md
    assert "103x fewer" in md  # 4e6 / 39000 bytes
    assert "consensus distance" in md
    assert "## Time to DDP's final accuracy" in md and "| swarm | never |" in md
    assert all(f"![{name}]({name})" in md for name in PLOTS)


@pytest.mark.timeout(30)
def test_live_view_shows_every_process() -> None:
    import io

    from gossipgrad.experiment.live import LiveView
    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    # A baseline rank's progress dict, and a peer's status record: the view shows both.
    statuses = [
        {"id": "peer0", "state": "training", "step": 42, "loss": 0.5, "sent_bytes": 2_500_000},
        PeerStatus(id="peer1"),
    ]
    with LiveView(console, live=True) as view:
        view.finish("swarm: accuracy 0.9")
        view.update("ddp", statuses, 150)
    text = buf.getvalue()
    assert "42/150" in text and "0.5000" in text and "2.50" in text and "peer1" in text
    assert "swarm: accuracy 0.9" in text
    plain = io.StringIO()
    with LiveView(Console(file=plain), live=True) as view:  # not a terminal: plain lines
        view.update("swarm", statuses, 150)
    assert "swarm step/loss peer0:42/0.500 peer1:0" in plain.getvalue()


@pytest.mark.timeout(30)
def test_baselines_train_the_swarm_budget_unless_baselines_steps_says_otherwise(
    tmp_path: Path,
) -> None:
    from gossipgrad.experiment.runner import Experiment

    raw = {"experiment": {"seed": 7}, "train": {"steps": 120, "lr": 0.03}}
    same = Experiment(parse_spec(raw), tmp_path / "a").baseline_train()
    assert (same.steps, same.seed, same.lr) == (120, 7, 0.03)
    raced = Experiment(parse_spec({**raw, "baselines": {"steps": 60}}), tmp_path / "b")
    assert raced.baseline_train().steps == 60
    assert raced.cfg.train.steps == 120  # the swarm keeps its own budget
    with pytest.raises(SpecError, match=r"baselines\.steps"):
        parse_spec({**raw, "baselines": {"steps": -1}})
