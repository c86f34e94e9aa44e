"""Atomic checkpoints: a failed write leaves the previous checkpoint intact."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from gossipgrad.peer.runtime import checkpoint

pytestmark = pytest.mark.timeout(60)


def test_round_trip_and_missing(tmp_path: Path) -> None:
    path = tmp_path / "ck" / "checkpoint.pt"
    assert checkpoint.load(path) is None
    state = {"params": torch.arange(10.0), "local_step": 7}
    checkpoint.save_atomic(path, state)
    back = checkpoint.load(path)
    assert back["local_step"] == 7
    assert torch.equal(back["params"], state["params"])
    assert [p.name for p in path.parent.iterdir()] == ["checkpoint.pt"]  # no temp file left


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores directory permissions")
def test_read_only_directory_keeps_old_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    checkpoint.save_atomic(path, {"v": 1})
    tmp_path.chmod(0o500)
    try:
        with pytest.raises(OSError):
            checkpoint.save_atomic(path, {"v": 2})
    finally:
        tmp_path.chmod(0o700)
    assert checkpoint.load(path) == {"v": 1}


def test_failed_write_keeps_old_checkpoint(tmp_path: Path, monkeypatch) -> None:
    """A write that dies half way (disk full) leaves the old file and no temp file."""
    path = tmp_path / "checkpoint.pt"
    checkpoint.save_atomic(path, {"v": 1})
    real_fsync = os.fsync

    def full_disk(fd: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError, match="No space"):
        checkpoint.save_atomic(path, {"v": 2})
    monkeypatch.setattr(os, "fsync", real_fsync)
    assert checkpoint.load(path) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]


def test_corrupt_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="unreadable"):
        checkpoint.load(path)


def test_save_streams_to_the_file_without_a_serialized_copy_in_memory(tmp_path: Path) -> None:
    """A checkpoint is written as it is serialized: the Python heap does not hold the
    state's bytes a second time (at 100M parameters that copy was the state's size again)."""
    import tracemalloc

    state = {"params": torch.randn(8 << 20)}  # 32 MiB, outside the Python heap
    tracemalloc.start()
    try:
        checkpoint.save_atomic(tmp_path / "checkpoint.pt", state)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20
    assert torch.equal(checkpoint.load(tmp_path / "checkpoint.pt")["params"], state["params"])


def test_params_digest_is_sha256_of_the_float32_bytes() -> None:
    import hashlib

    t = torch.arange(10, dtype=torch.float32)
    assert checkpoint.params_digest(t) == hashlib.sha256(t.numpy().tobytes()).hexdigest()[:16]
    assert checkpoint.params_digest(t.double()) == checkpoint.params_digest(t)


def test_a_disk_that_fills_while_streaming_is_an_oserror(tmp_path: Path, monkeypatch) -> None:
    """The save streams to its file, so a full disk strikes inside torch.save, whose zip
    writer then raises a RuntimeError over the OSError; save_atomic raises the OSError (the
    daemon logs it and trains on), keeps the old checkpoint and leaves no temp file."""
    import builtins

    path = tmp_path / "checkpoint.pt"
    checkpoint.save_atomic(path, {"v": 1})

    class FillsUp:
        def __init__(self, f) -> None:
            self.f, self.room = f, 4096

        def write(self, data) -> int:
            if len(data) > self.room:
                raise OSError(28, "No space left on device")
            self.room -= len(data)
            return self.f.write(data)

        def __getattr__(self, name: str):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.f.close()

    real_open = builtins.open
    monkeypatch.setattr(
        checkpoint, "open", lambda *a, **k: FillsUp(real_open(*a, **k)), raising=False
    )
    with pytest.raises(OSError, match="No space"):
        checkpoint.save_atomic(path, {"v": torch.randn(1 << 16)})
    monkeypatch.undo()
    assert checkpoint.load(path) == {"v": 1}
    assert [p.name for p in tmp_path.iterdir()] == ["checkpoint.pt"]
