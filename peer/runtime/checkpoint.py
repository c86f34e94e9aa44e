"""Atomic checkpoints: a crash at any moment leaves the previous checkpoint valid.

Write to a temporary file in the same directory, fsync it, rename it over the old one, then
fsync the directory (POSIX rename is atomic; the directory fsync makes the rename durable).
A failed write (disk full, read-only directory) is reported and leaves the old file alone.
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)


def save_atomic(path: Path, state: dict[str, Any]) -> None:
    """Serialize `state` with torch.save and publish it at `path` atomically.

    Raises:
        OSError: when the directory is not writable or the disk is full; `path` is unchanged.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    buf = io.BytesIO()
    torch.save(state, buf)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(buf.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:
        dir_fd = os.open(path.parent, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def load(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any] | None:
    """Load a checkpoint, or None if there is none. A corrupt file raises ValueError."""
    path = Path(path)
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as err:
        raise ValueError(f"checkpoint {path} is unreadable: {err}") from err


def params_digest(params: torch.Tensor) -> str:
    """A short SHA-256 of a flat parameter tensor's float32 bytes: the evidence a donor logs for
    the state it sends and a joiner or a resumed peer records for the state it applied, so a
    test can tell that the two are bit-identical without shipping the tensors."""
    data = params.detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]
