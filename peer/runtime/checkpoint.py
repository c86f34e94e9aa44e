"""Atomic checkpoints: a crash at any moment leaves the previous checkpoint valid.

Write to a temporary file in the same directory, fsync it, rename it over the old one, then
fsync the directory (POSIX rename is atomic; the directory fsync makes the rename durable).
A failed write (disk full, read-only directory) is reported and leaves the old file alone; the
temporary file of a process killed mid-write is removed by the next start
(``remove_stale_temps``).

Beside the files: what a checkpoint must hold for a resumed run to go on as an uninterrupted
one would (the random number generators' state, ``rng_state``) and the check that keeps a
diverged state out of it (``nonfinite``).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)


#: The name of a temporary file ``save_atomic`` writes (the writer's pid at the end).
_TEMP = re.compile(r"^\..+\.tmp-(\d+)$")


def save_atomic(path: Path, state: Any) -> None:
    """Serialize `state` (a checkpoint's dict, a tensor) with torch.save and publish it at
    `path` atomically.

    Raises:
        OSError: when the directory is not writable or the disk is full; `path` is unchanged.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            # Straight to the file: a serialized copy in memory first would cost the state's
            # size again (1.6 GB for a 100M-parameter diloco peer) for the save's duration.
            _save_raising_os_errors(state, f)
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


def _save_raising_os_errors(state: Any, f: Any) -> None:
    """``torch.save`` to an open file. A write that fails (a full disk) surfaces as what it is,
    the OSError: torch's zip writer, closing the archive it could not write, raises a
    RuntimeError over it."""
    try:
        torch.save(state, f)
    except RuntimeError as err:
        if isinstance(err.__context__, OSError):
            raise err.__context__ from None
        raise


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
    data = params.detach().to("cpu", torch.float32).contiguous().numpy()
    return hashlib.sha256(memoryview(data).cast("B")).hexdigest()[:16]  # no copy of the bytes


def remove_stale_temps(directory: Path) -> list[Path]:
    """Remove the temporary files ``save_atomic`` left in ``directory`` when its writer was
    killed mid-write (SIGKILL, power loss): files of processes no longer alive. Returns them.
    """
    removed = []
    directory = Path(directory)
    if not directory.is_dir():
        return removed
    for path in directory.iterdir():
        match = _TEMP.match(path.name)
        if match is None or _alive(int(match.group(1))):
            continue
        try:
            path.unlink()
        except OSError as err:
            log.warning("stale temporary file %s not removed: %s", path, err)
            continue
        log.info("removed %s, left by a writer that was killed", path.name)
        removed.append(path)
    return removed


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


def nonfinite(state: Any, prefix: str = "") -> list[str]:
    """Where a nested state (dicts, lists, tensors) holds a NaN or infinity: the keys' paths
    of its non-finite floating-point tensors (parameters, optimizer moments, an algorithm's
    anchor or residual), empty when every one is finite."""
    if isinstance(state, torch.Tensor):
        finite = not state.is_floating_point() or bool(torch.isfinite(state).all())
        return [] if finite else [prefix or "."]
    if isinstance(state, dict):
        items = state.items()
    elif isinstance(state, list | tuple):
        items = enumerate(state)
    else:
        return []
    return [bad for k, v in items for bad in nonfinite(v, f"{prefix}/{k}")]


def rng_state() -> dict[str, Any]:
    """The state of the random number generators a training step may draw from (torch's on
    the CPU and on every CUDA device, numpy's and Python's global ones), as tensors and plain
    values a ``weights_only`` load takes back."""
    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    return {
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else [],
        "python": [version, torch.tensor(internal, dtype=torch.int64), gauss],
        "numpy": [kind, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss, cached],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    """Restore what ``rng_state`` returned (CUDA only where this process has the devices)."""
    # A checkpoint loaded onto a GPU brings its tensors there; the generators want them here.
    torch.set_rng_state(state["torch"].cpu())
    cuda = state.get("cuda") or []
    if cuda and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all([s.cpu() for s in cuda])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(int(v) for v in internal.cpu().tolist()), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, keys.cpu().numpy().astype(np.uint32), pos, has_gauss, cached))
