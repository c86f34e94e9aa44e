"""The benchmark scripts in a tiny configuration, marked ``bench``: ``pytest -m bench`` runs
them and the default run (``-m "not bench"`` in pyproject's addopts) leaves them out.

Each runs the real script as a process and checks the figures it prints or writes: the
compression ratios are those of the codecs' wire formats, and gossip-only rounds shrink the
peers' disagreement.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from gossipgrad.peer.config.recommended import recommended
from gossipgrad.peer.network.relay import FRAME_BYTES
from support import ROOT

pytestmark = [pytest.mark.bench, pytest.mark.timeout(180)]

SCRIPTS = ROOT / "scripts"


def run_script(name: str, *args: str) -> str:
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / name), *args],
        capture_output=True,
        text=True,
        timeout=170,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_bench_compression_reports_the_wire_ratios(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    stdout = run_script(
        "bench_compression.py", "--sizes", "100k", "--codecs", "int8,topk:0.01+int8",
        "--repeat", "1", "--out", str(out),
    )  # fmt: skip
    # One progress line per codec: "<codec> enc X ms dec Y ms into Z ms add W ms B B/el".
    per_codec = dict(re.findall(r"^\s+(\S+)\s+enc .*?([0-9.]+) B/el$", stdout, re.M))
    assert set(per_codec) == {"int8", "topk:0.01+int8"}, stdout[-2000:]
    results = {r["codec"]: r for r in json.loads(out.read_text())["results"]}
    for codec, printed in per_codec.items():
        r = results[codec]
        assert r["numel"] == 100_000
        assert float(printed) == pytest.approx(r["bytes_per_element"], abs=1e-4)
        assert r["ratio_vs_fp32"] == pytest.approx(4 / r["bytes_per_element"], rel=1e-6)
        assert r["encode_s"] > 0 and r["decode_s"] > 0
    # int8: a byte per element plus a scale per block, entropy-coded (heavy tails shrink it to
    # ~0.8 B, docs/compression.md); top-1 % + int8: under 0.024 B per element (BENCHMARKS.md).
    print({c: round(r["ratio_vs_fp32"], 2) for c, r in results.items()})
    assert 3.5 < results["int8"]["ratio_vs_fp32"] < 6
    assert results["int8"]["rel_error"] < 0.05
    assert results["topk:0.01+int8"]["bytes_per_element"] < 0.024


def test_bench_consensus_rounds_shrink_the_disagreement() -> None:
    stdout = run_script(
        "bench_consensus.py", "--gammas", "0.5", "--codec", "int8", "--peers", "3",
        "--rounds", "40", "--every", "20",
    )  # fmt: skip
    rows = re.findall(r"^0\.5\s+(\d+)\s+([0-9.]+e[-+]\d+)$", stdout, re.M)
    assert [int(r) for r, _ in rows] == [0, 20, 40], stdout
    start, *_, end = (float(d) for _, d in rows)
    assert start > 0 and end < start / 10, rows


@pytest.mark.timeout(1200)
def test_bench_churn_compares_a_swarm_with_and_without_churn(tmp_path: Path) -> None:
    """Three peers, an event every 20 rounds: both runs end, churn happened, figures print."""
    proc = subprocess.run(
        [
            sys.executable, str(SCRIPTS / "bench_churn.py"), "--peers", "3", "--min-live", "2",
            "--every-rounds", "20", "--steps", "400", "--timeout", "250", "--pairs", "2",
            "--out", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=1150, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    m = re.search(r"^goodput ([0-9.]+)% \(per live peer-second ([0-9.]+)%\)$", proc.stdout, re.M)
    assert m, proc.stdout[-2000:]
    result = json.loads((tmp_path / "churn.json").read_text())
    steady, churn = result["steady"], result["churn"]
    assert steady["events"] == 0 and churn["events"] >= 2
    assert float(m[1]) == pytest.approx(100 * churn["throughput"] / steady["throughput"], abs=0.1)
    assert steady["final_peers"] == 3 and churn["final_peers"] >= 2
    assert 0 < steady["relative_consensus_distance"] < 1e-2
    assert 0 < churn["relative_consensus_distance"] < 1e-1
    assert (tmp_path / "churn0" / "events.jsonl").read_text().count("\n") == churn["events"]
    # Two pairs, run alternately; each pair's goodput and their median are printed.
    assert len(result["pairs"]) == 2 and result["pairs"][0]["churn"] == churn
    rates = [100 * p["churn"]["throughput"] / p["steady"]["throughput"] for p in result["pairs"]]
    m = re.search(r"^goodput by pair ([0-9.]+)% ([0-9.]+)%; median ([0-9.]+)%$", proc.stdout, re.M)
    assert m, proc.stdout[-2000:]
    assert [float(m[1]), float(m[2])] == pytest.approx(rates, abs=0.1)
    assert float(m[3]) == pytest.approx(sum(rates) / 2, abs=0.1)


@pytest.mark.timeout(900)
def test_bench_churn_side_by_side_runs_both_swarms_at_once_on_swapped_cpus(
    tmp_path: Path,
) -> None:
    """--side-by-side: in each pair both runs overlap in time, each swarm's every process
    (the churn run's spare too) started on its own half of the CPUs, the halves swapped in
    the second pair."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("needs 2 CPUs")
    halves = [
        ",".join(map(str, cpus[: len(cpus) // 2])),
        ",".join(map(str, cpus[len(cpus) // 2 :])),
    ]
    proc = subprocess.run(
        [
            sys.executable, str(SCRIPTS / "bench_churn.py"), "--peers", "3", "--min-live", "2",
            "--every-rounds", "20", "--steps", "400", "--timeout", "250", "--pairs", "2",
            "--spares", "1", "--side-by-side", "--out", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=850, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "churn.json").read_text())
    assert result["side_by_side"] is True
    for i, pair in enumerate(result["pairs"]):
        steady_cpus, churn_cpus = halves if i == 0 else halves[::-1]
        assert pair["steady"]["events"] == 0 and pair["churn"]["events"] >= 2
        for run, want in ((f"steady{i}", steady_cpus), (f"churn{i}", churn_cpus)):
            lines = (tmp_path / run / "commands.sh").read_text().splitlines()
            started = [line for line in lines if not line.startswith("#")]
            assert len(started) >= 3, started
            assert all(line.startswith(f"taskset --cpu-list {want} ") for line in started), run
        a, b = (
            json.loads((tmp_path / f"{r}{i}" / "trace.json").read_text())
            for r in ("steady", "churn")
        )
        assert a["started"] < b["ended"] and b["started"] < a["ended"], "the runs did not overlap"
    assert "spare0" in (tmp_path / "churn0" / "commands.sh").read_text()
    m = re.search(r"^goodput by pair ([0-9.]+)% ([0-9.]+)%; median ([0-9.]+)%$", proc.stdout, re.M)
    assert m, proc.stdout[-2000:]


@pytest.mark.timeout(600)
def test_bench_churn_on_an_emulated_accelerator_waits_in_every_peer_step(tmp_path: Path) -> None:
    """--accelerator-ms 100: the peers train the emulated task, so no peer makes more than 10
    steps a second (digits alone: well over 50 on this machine)."""
    proc = subprocess.run(
        [
            sys.executable, str(SCRIPTS / "bench_churn.py"), "--peers", "3", "--min-live", "2",
            "--every-rounds", "20", "--steps", "150", "--timeout", "250", "--spares", "1",
            "--accelerator-ms", "100", "--out", str(tmp_path),
        ],
        capture_output=True, text=True, timeout=550, check=False,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    result = json.loads((tmp_path / "churn.json").read_text())
    assert result["accelerator_ms"] == 100
    assert result["config"]["train.task"] == "gossipgrad.experiment.bench.emulated_accelerator:task"
    steady, churn = result["steady"], result["churn"]
    assert churn["events"] >= 2
    assert 0 < steady["per_peer_rate"] <= 10 and 0 < churn["per_peer_rate"] <= 10
    log = (tmp_path / "steady" / "peer0.log").read_text()
    assert "digits, 100 ms per step on an emulated accelerator" in log


@pytest.mark.timeout(300)
def test_bench_leave_measures_the_cpu_of_both_ways_to_exit() -> None:
    """One peer SIGTERMed each way: the fast exit and the interpreter's teardown."""
    stdout = run_script("bench_leave.py", "--repeats", "1", "--steps", "5")
    pattern = r"^(fast exit|teardown) +run 0: ([0-9.]+) CPU s from SIGTERM to exit$"
    runs = dict(re.findall(pattern, stdout, re.M))
    assert sorted(runs) == ["fast exit", "teardown"], stdout
    assert all(0 < float(v) < 60 for v in runs.values()), runs
    assert re.search(r"^ratio teardown / fast exit: [0-9.]+x$", stdout, re.M), stdout


@pytest.mark.timeout(240)
def test_bench_relay_runs_the_swarm_direct_and_through_a_relay(tmp_path: Path) -> None:
    """One pair of short runs: in the relayed one peer1 and peer2 are called through peer0,
    which counts the bytes it forwarded for each; the table and the ratio are printed."""
    stdout = run_script(
        "bench_relay.py", "--steps", "120", "--pairs", "1", "--accelerator-ms", "10",
        "--out", str(tmp_path),
    )  # fmt: skip
    rows = dict(
        re.findall(r"^(direct|relayed)\s+([0-9.]+)\s+[0-9.]+\s+[0-9.]+\s+[0-9.]+", stdout, re.M)
    )
    assert sorted(rows) == ["direct", "relayed"], stdout
    assert re.search(r"^ratio\s+[0-9.]+x", stdout, re.M), stdout
    assert re.search(r"relayed / direct by pair [0-9.]+; median [0-9.]+$", stdout, re.M), stdout
    pair = json.loads((tmp_path / "relay.json").read_text())["pairs"][0]
    direct, relayed = pair["direct"], pair["relayed"]
    assert not any(direct["forwarded"].values())  # nobody relayed
    assert relayed["relays"] == {"peer1": "peer0", "peer2": "peer0"}
    assert relayed["forwarded"]["peer1"] > 0 and relayed["forwarded"]["peer2"] > 0
    assert all(v > 0 for v in relayed["carried"].values()) and len(relayed["carried"]) == 2
    assert direct["steps"] == relayed["steps"] == 120


def test_bench_relay_forwarding_measures_the_relays_cpu_per_byte() -> None:
    """x's state comes to j through the relay intact; every byte of it was forwarded, in
    frames, and the relay's CPU per GB and per frame are printed."""
    stdout = run_script("bench_relay_forwarding.py", "--mb", "4", "--downloads", "2")
    assert re.search(r"relay CPU [0-9.]+ s/GB, [0-9]+ frames of [0-9.]+ KiB", stdout), stdout
    r = json.loads(stdout.strip().splitlines()[-1])
    assert r["forwarded_mb"] >= 2 * 4
    assert r["frames"] > 0 and r["mean_frame_kib"] <= FRAME_BYTES / 1024 + 1


def test_bench_round_prints_each_step_and_the_round_in_copies() -> None:
    stdout = run_script("bench_round.py", "--size", "300k", "--repeat", "1")
    steps = re.findall(r"^  (.+?)\s+([0-9.]+) x (\d+)$", stdout, re.M)
    codec = recommended("diloco", "codec")
    assert [label for label, _, _ in steps] == [
        f"{codec} encode, error feedback",
        f"{codec} a message checked on arrival",
        f"{codec} average into the anchor (own + 2)",
        "sign encode, x̂ += q",
        "sign decode into a mirror",
        "consensus step, θ = a",
        "checksum of a copy",
    ], stdout
    total = float(re.search(r"^round: ([0-9.]+) copies", stdout, re.M).group(1))
    assert total == pytest.approx(sum(float(c) * int(t) for _, c, t in steps), abs=0.1 * len(steps))
