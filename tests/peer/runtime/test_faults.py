"""Faults with real processes: crashes during checkpoints, a full or read-only disk.

Each test states what must hold and checks it. (A peer SIGKILLed mid-round is covered by
tests/peer/runtime/test_swarm.py::test_killed_peer_others_go_on_and_it_resumes_from_checkpoint;
network faults -- partition, slow and flapping links -- are in tests/experiment/test_faults_net.py.)
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from gossipgrad.peer.runtime import checkpoint

pytestmark = pytest.mark.timeout(120)

needs_root_mount = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("mount") is None, reason="needs root and mount(8)"
)

WRITER = textwrap.dedent(
    """
    import sys, torch
    from pathlib import Path
    from gossipgrad.peer.runtime.checkpoint import save_atomic
    path = Path(sys.argv[1])
    n = 0
    while True:
        n += 1
        # Large enough (2 MB) that a kill often lands inside the write or the fsync.
        save_atomic(path, {"version": n, "x": torch.full((500_000,), float(n))})
        print(n, flush=True)
    """
)


def test_sigkill_mid_checkpoint_leaves_the_previous_one_valid(tmp_path: Path) -> None:
    """Must hold: after a SIGKILL at any moment the checkpoint loads and is one complete
    version (every element equals its version number), never a torn mix or a partial file."""
    path = tmp_path / "checkpoint.pt"
    rng = random.Random(7)
    last = 0
    for _ in range(3):
        proc = subprocess.Popen(
            [sys.executable, "-c", WRITER, str(path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            proc.stdout.readline()  # at least one checkpoint published by this writer
            time.sleep(rng.uniform(0.0, 0.3))
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
        state = checkpoint.load(path)
        assert state is not None
        v = state["version"]
        assert torch.equal(state["x"], torch.full((500_000,), float(v))), "torn checkpoint"
        assert v >= 1
        last = v
    assert last >= 1
    # Leftover temp files of killed writers are harmless: they never shadow the checkpoint.
    assert path.exists()


@pytest.fixture
def small_fs(tmp_path: Path):
    """A 2 MiB tmpfs mounted under tmp_path (unmounted afterwards)."""
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "ggtest", str(mnt)],
            check=True,
            capture_output=True,
            timeout=10,
        )
    except (subprocess.CalledProcessError, OSError) as err:
        pytest.skip(f"cannot mount a tmpfs here: {err}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=10)


def _fill(mnt: Path, leave: int) -> None:
    """Fill the filesystem at ``mnt`` until about ``leave`` bytes are free."""
    st = os.statvfs(mnt)
    free = st.f_bavail * st.f_frsize
    with open(mnt / "filler", "wb") as f:
        f.write(b"\0" * max(0, free - leave))


@needs_root_mount
@pytest.mark.timeout(180)
def test_disk_full_training_goes_on_and_the_old_checkpoint_stays(small_fs: Path) -> None:
    """Must hold: a peer whose checkpoints hit ENOSPC logs a clear error, trains to the end,
    exits 0 with finite results, and the checkpoint that was there is unchanged."""
    run_dir = small_fs / "peer"
    run_dir.mkdir()
    old = {"marker": torch.arange(10)}
    checkpoint.save_atomic(run_dir / "checkpoint.pt", old)
    old_bytes = (run_dir / "checkpoint.pt").read_bytes()
    # Room for the final params.pt (~106 kB for digits) and the JSON files, not for a
    # checkpoint (~212 kB: parameters plus optimizer state and public copies).
    _fill(small_fs, leave=160 * 1024)
    cmd = [
        sys.executable,
        "-m",
        "gossipgrad.peer",
        "--train.task",
        "digits",
        "--train.steps",
        "60",
        "--train.eval_every",
        "0",
        "--train.threads",
        "1",
        "--checkpoint.every",
        "20",
        "--checkpoint.resume",
        "false",
        "--metrics.enabled",
        "false",
        "--peer.run_dir",
        str(run_dir),
    ]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    log = run.stdout + run.stderr
    assert run.returncode == 0, log[-3000:]
    assert "checkpoint failed, training goes on" in log
    assert "No space left on device" in log
    assert (run_dir / "checkpoint.pt").read_bytes() == old_bytes
    assert not [p for p in run_dir.iterdir() if ".tmp-" in p.name], "temp files left behind"
    params = torch.load(run_dir / "params.pt", weights_only=True)
    assert torch.isfinite(params).all()


@needs_root_mount
def test_read_only_checkpoint_dir_is_a_clear_error_and_changes_nothing(small_fs: Path) -> None:
    """Must hold: saving into a read-only directory raises OSError naming the problem, and
    the existing checkpoint stays loadable and unchanged."""
    path = small_fs / "checkpoint.pt"
    checkpoint.save_atomic(path, {"version": 1})
    before = path.read_bytes()
    subprocess.run(["mount", "-o", "remount,ro", str(small_fs)], check=True, timeout=10)
    try:
        with pytest.raises(OSError, match=r"[Rr]ead-only"):
            checkpoint.save_atomic(path, {"version": 2})
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_fs)], check=True, timeout=10)
    assert path.read_bytes() == before
    assert checkpoint.load(path) == {"version": 1}


def test_a_diverged_step_never_overwrites_the_last_good_checkpoint(tmp_path: Path) -> None:
    """Training turns NaN at step 35 with checkpoints every 10 steps: the daemon stops with a
    clear error, and the checkpoint left is the one of step 30, finite, so a restart resumes
    from good parameters instead of crash-looping on NaN."""
    from gossipgrad.peer.config import build_config
    from gossipgrad.peer.runtime.daemon import Daemon

    cfg = build_config(
        {},
        {
            "peer.id": "solo",
            "peer.run_dir": str(tmp_path),
            "train.task": "support.tiny_user_task:make_diverging_task",
            "train.steps": 100,
            "train.eval_every": 0,
            "checkpoint.every": 10,
            "metrics.enabled": False,
        },
    )
    with pytest.raises(FloatingPointError, match="loss is nan"):
        Daemon(cfg).run()
    state = checkpoint.load(tmp_path / "checkpoint.pt")
    assert state is not None and state["local_step"] == 30
    assert torch.isfinite(state["params"]).all()
