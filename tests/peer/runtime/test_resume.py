"""Resume continuity: a peer resumed from its checkpoint goes on as an uninterrupted run
would (same next batch, same random draws), never checkpoints a diverged state, publishes its
final files atomically, and cleans up after a writer that was killed.

Solo daemons run in-process (no neighbours: nothing but the checkpoint decides what they do);
the killed writer is a real process, really SIGKILLed.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from gossipgrad.peer.config import build_config
from gossipgrad.peer.runtime import checkpoint
from gossipgrad.peer.runtime.daemon import Daemon

pytestmark = pytest.mark.timeout(120)

TASK = "support.tiny_recording_task:make_task"


def _run(run_dir: Path, steps: int, task: str = TASK, **overrides: Any) -> dict[str, Any]:
    cfg = build_config(
        {},
        {
            "peer.id": "solo",
            "peer.run_dir": str(run_dir),
            "train.task": task,
            "train.steps": steps,
            "train.batch_size": 8,
            "train.eval_every": 0,
            "train.schedule": "constant",  # the same learning rates whatever train.steps says
            "metrics.enabled": False,
            **overrides,
        },
    )
    return Daemon(cfg).run()


def _training_draws() -> list[tuple[torch.Tensor, float]]:
    """What the recording task saw since the last call (one record per training step)."""
    from support import tiny_recording_task

    seen = list(tiny_recording_task.SEEN)
    tiny_recording_task.SEEN.clear()
    return seen


def test_a_resumed_peer_draws_the_batch_and_randoms_an_uninterrupted_run_would(
    tmp_path: Path, support_on_path
) -> None:
    """Resumed at step 7 (of a 12-batch epoch), its next batch is the uninterrupted run's
    batch 7 and its next draw of torch's generator that run's draw 7; so its final parameters
    are the uninterrupted run's bit for bit."""
    _training_draws()
    torch.manual_seed(0)
    _run(tmp_path / "whole", 10)
    whole = _training_draws()
    torch.manual_seed(0)
    _run(tmp_path / "parts", 7)
    first = _training_draws()
    torch.manual_seed(12345)  # whatever the process drew meanwhile: the checkpoint decides
    _run(tmp_path / "parts", 10)
    resumed = _training_draws()
    assert len(whole) == 10 and len(first) == 7 and len(resumed) == 3
    for k, (batch, draw) in enumerate(resumed, start=7):
        assert torch.equal(batch, whole[k][0]), f"batch {k} differs"
        assert draw == whole[k][1], f"random draw {k} differs"
    assert torch.equal(
        torch.load(tmp_path / "parts" / "params.pt", weights_only=True),
        torch.load(tmp_path / "whole" / "params.pt", weights_only=True),
    )


def test_an_overflowed_optimizer_state_is_never_checkpointed(
    tmp_path: Path, support_on_path
) -> None:
    """Adam's second moment turns infinite at step 15 while the parameters and the loss stay
    finite: the checkpoints of steps 20 and 30 and the one at exit are refused, and the one
    of step 10 stays, finite throughout (a restart would otherwise resume a frozen Adam)."""
    task = "support.tiny_recording_task:make_overflowing_task"
    _run(tmp_path, 30, task, **{"train.optimizer": "adam", "checkpoint.every": 10})
    state = checkpoint.load(tmp_path / "checkpoint.pt")
    assert state is not None
    assert state["local_step"] == 10
    assert checkpoint.nonfinite(state) == []
    params = torch.load(tmp_path / "params.pt", weights_only=True)
    assert torch.isfinite(params).all(), "the parameters must stay finite in this test"


def test_final_parameters_and_buffers_are_published_by_rename(
    tmp_path: Path, support_on_path
) -> None:
    """params.pt and buffers.pt replace the old files whole (a new file renamed over the
    old): a reader that opened the old one reads it to its end, never a truncated file."""
    tmp_path.mkdir(exist_ok=True)
    old = {}
    for name in ("params.pt", "buffers.pt"):
        path = tmp_path / name
        path.write_bytes(b"old contents " * 100)
        old[name] = open(path, "rb")  # noqa: SIM115 - held open across the run
    try:
        _run(tmp_path, 3, **{"checkpoint.resume": False})
        for name, f in old.items():
            assert f.read() == b"old contents " * 100, f"{name} was rewritten in place"
            assert torch.load(tmp_path / name, weights_only=True) is not None
    finally:
        for f in old.values():
            f.close()


KILLED_WRITER = textwrap.dedent(
    """
    import os, sys, time, torch
    from pathlib import Path
    from gossipgrad.peer.runtime.checkpoint import save_atomic
    os.fsync = lambda fd: (print("writing", flush=True), time.sleep(600))
    save_atomic(Path(sys.argv[1]), {"x": torch.zeros(1000)})
    """
)


def test_a_killed_writers_temporary_checkpoint_is_removed_on_the_next_start(
    tmp_path: Path, support_on_path
) -> None:
    """A process SIGKILLed while it writes its checkpoint leaves its temporary file; the
    next daemon started in that run directory removes it (and leaves none of its own)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", KILLED_WRITER, str(tmp_path / "checkpoint.pt")],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
    left = [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
    assert left == [f".checkpoint.pt.tmp-{proc.pid}"]
    _run(tmp_path, 3)
    assert [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name] == []
    assert checkpoint.load(tmp_path / "checkpoint.pt")["local_step"] == 3
