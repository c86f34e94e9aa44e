"""Issue 42: the wheel is what a site installs. It carries the commands and what a site needs
to watch its peers (the Prometheus config writer, the Grafana dashboards), not the
benchmark-only modules; its observability command works with no source tree on the path."""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from gossipgrad.compression import native
from support import ROOT

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MUST = [
    "gossipgrad/peer/cli.py",
    "gossipgrad/experiment/swarm.py",
    "gossipgrad/experiment/prometheus_config.py",
    "gossipgrad/experiment/observability.py",
    "gossipgrad/experiment/dashboards/__init__.py",
    "gossipgrad/experiment/dashboards/overview.py",
]
MUST_NOT = ["churn", "emulated_accelerator", "bench_", "tests/", "scripts/"]
COMMANDS = {
    "gossipgrad-peer",
    "gossipgrad-swarm",
    "gossipgrad-experiment",
    "gossipgrad-observability",
}


#: What the copy the wheel is built from leaves out (environments, caches, build output).
NOT_SOURCES = (
    ".git", ".venv*", "build", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis", "*.so",
)  # fmt: skip


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy: setuptools leaves build/ and *.egg-info beside the sources it builds,
    # and in the checkout they were linted and copied by the other tests.
    source = tmp_path_factory.mktemp("source") / "gossipgrad"
    shutil.copytree(ROOT, source, ignore=shutil.ignore_patterns(*NOT_SOURCES))
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out), str(source)],
        check=True, timeout=240, capture_output=True,
    )  # fmt: skip
    (found,) = out.glob("gossipgrad-*.whl")
    return found


def test_the_wheel_carries_what_a_site_needs_and_no_benchmarks(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    for path in MUST:
        assert path in names, path
    code = [n for n in names if n.endswith(".py")]
    assert not [n for n in code if any(bad in n for bad in MUST_NOT)]
    if platform.machine() == "x86_64":  # compression/kernels.c, built with the wheel
        assert [n for n in names if n.startswith("gossipgrad/compression/_kernels")]
    (entry_points,) = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert {line.split("=")[0].strip() for line in text.splitlines() if "=" in line} >= COMMANDS


def test_the_installed_observability_command_writes_prometheus_and_grafana(
    wheel: Path, tmp_path: Path
) -> None:
    """The wheel unpacked alone, run with the interpreter's dependencies but without this
    checkout (``-S``: no .pth, so no editable install; cwd outside the repository)."""
    target = tmp_path / "installed"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target),
         str(wheel)],
        check=True, timeout=120, capture_output=True,
    )  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(target), sysconfig.get_paths()["purelib"]]),
    }
    site = tmp_path / "site"
    site.mkdir()
    status = site / "peer0" / "status.json"
    status.parent.mkdir()
    status.write_text(
        json.dumps({"id": "peer0", "address": "127.0.0.1:7000", "metrics_port": 9101})
    )
    script = (
        "import sys, gossipgrad.experiment.observability as o; "
        "assert o.__file__.startswith(sys.argv[1]), o.__file__; "
        "sys.exit(o.main(sys.argv[2:]))"
    )

    def run(*args: str) -> None:
        subprocess.run(
            [sys.executable, "-S", "-c", script, str(target), *args],
            cwd=site, env=env, check=True, timeout=60, capture_output=True,
        )  # fmt: skip

    kernels = "import sys, gossipgrad.compression.native as n; print(n.__file__, n.status())"
    shown = subprocess.run(
        [sys.executable, "-S", "-c", kernels],
        cwd=site, env=env, check=True, timeout=60, capture_output=True, text=True,
    ).stdout.split()  # fmt: skip
    assert shown[0].startswith(str(target))
    if native.available():  # where this checkout's build runs them, the wheel's does too
        assert shown[1] == "avx2"
    run("prometheus", "--status", str(status.parent), "--out", "prometheus.yml", "--file-sd")
    assert "file_sd_configs" in (site / "prometheus.yml").read_text()
    targets = json.loads((site / "gossipgrad-targets.json").read_text())
    assert targets[0]["labels"]["peer"] == "peer0"
    run("grafana", "--out", "grafana", "--prometheus-url", "http://prom:9090")
    dashboards = sorted(p.name for p in (site / "grafana" / "dashboards").glob("*.json"))
    assert dashboards == ["gossipgrad-overview.json", "gossipgrad-peer.json"]
    for name in dashboards:
        assert json.loads((site / "grafana" / "dashboards" / name).read_text())["uid"]
    provider = (site / "grafana" / "provisioning" / "dashboards" / "gossipgrad.yaml").read_text()
    assert str((site / "grafana" / "dashboards").resolve()) in provider
    source = (site / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    assert '"http://prom:9090"' in source
