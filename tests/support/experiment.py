"""Helpers shared by the experiment tests (not a test module)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import psutil

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def png_size(path: Path) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk (after checking the signature)."""
    data = Path(path).read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def processes_mentioning(text: str) -> list[int]:
    """Live processes (other than this one) whose command line contains ``text``."""
    return [
        p.info["pid"]
        for p in psutil.process_iter(["pid", "cmdline"])
        if p.info["pid"] != os.getpid() and text in " ".join(p.info["cmdline"] or ())
    ]
