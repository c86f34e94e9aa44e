"""Process-wide glibc malloc tuning for chunk-sized allocations (see :func:`tune_malloc`)."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import platform
import threading
import time

log = logging.getLogger(__name__)

MiB = 1 << 20

_malloc_lock = threading.Lock()
_malloc_tuned: bool | None = None

#: glibc ``mallopt`` parameters and the values :func:`tune_malloc` sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
MALLOC_MMAP_THRESHOLD = 8 * MiB
MALLOC_TRIM_THRESHOLD = 64 * MiB
MALLOC_ARENA_MAX = 2


def tune_malloc() -> bool:
    """Keep chunk-sized allocations on glibc's heap instead of fresh mmaps; idempotent.

    Every streamed chunk allocates and frees a few buffers of ``chunk_size`` (gRPC read
    slices, the Python ``bytes`` of the message). With glibc's defaults these are served by
    ``mmap``/``munmap`` or trimmed off the heap again, so each one is page-faulted afresh --
    on loopback that was the largest CPU cost of a push after the copies. Fixing the mmap
    threshold at 8 MiB (above any gRPC message we allow by default) and the trim threshold at
    64 MiB -- the same bounds glibc's own dynamic thresholds may grow to -- lets freed chunks be
    reused. And at most two malloc arenas: glibc gives each new thread its own (up to 8 per
    core), and a peer's dozen gRPC, push and membership threads each kept chunk-sized free
    blocks in theirs; with a 10M-parameter model on a ring that grew a peer's resident memory
    by 1.5 models over 16 rounds, with two arenas by none (scripts/bench_scale.py).
    Process-wide; returns False (and changes nothing) off glibc.
    """
    global _malloc_tuned
    with _malloc_lock:
        if _malloc_tuned is not None:
            return _malloc_tuned
        _malloc_tuned = False
        if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
            return False
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            ok = libc.mallopt(_M_MMAP_THRESHOLD, MALLOC_MMAP_THRESHOLD) == 1
            ok = libc.mallopt(_M_TRIM_THRESHOLD, MALLOC_TRIM_THRESHOLD) == 1 and ok
            ok = libc.mallopt(_M_ARENA_MAX, MALLOC_ARENA_MAX) == 1 and ok
        except (OSError, AttributeError) as err:
            log.debug("mallopt unavailable: %s", err)
            return False
        _malloc_tuned = ok
        log.debug("malloc thresholds tuned: %s", ok)
        return ok


def trim_malloc(every: float = 0.0) -> None:
    """Give the pages glibc holds free back to the system (``malloc_trim``); nothing off glibc.

    A round frees model-sized and chunk-sized temporaries; glibc keeps some of them in its
    heaps for reuse, which a site reads as resident memory: 0.8 of a 100M-parameter model on
    a choco ring (scripts/bench_scale.py: 5.02 models resident, 4.20 after a trim). A trim
    walks every heap: 0.2 ms in a bare process, 0.7 ms in a peer's (a py-spy profile of a
    three-peer run), against steps of a few ms for a small model, which frees little. So
    ``every``: no trim if this process trimmed less than that many seconds ago.
    """
    global _trimmed_at
    now = time.monotonic()
    with _malloc_lock:
        if every > 0 and now - _trimmed_at < every:
            return
        _trimmed_at = now
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def _libc():
    global _trim_libc
    if _trim_libc is None:
        _trim_libc = False
        if platform.system() == "Linux" and platform.libc_ver()[0] == "glibc":
            try:
                _trim_libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            except OSError as err:
                log.debug("libc unavailable: %s", err)
    return _trim_libc or None


_trim_libc = None
_trimmed_at = -float("inf")
