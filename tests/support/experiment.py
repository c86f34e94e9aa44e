"""Helpers shared by the experiment tests (not a test module)."""

from __future__ import annotations

import os
import struct
import subprocess
import sys
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


def run_spec(
    spec: str, out: Path, *sets: str, env: dict[str, str] | None = None, timeout: float = 250
) -> Path:
    """Run ``gossipgrad-experiment`` on the spec text ``spec`` (``--set`` each of ``sets``)
    into ``out``, as a user would; assert it ended well and left no process behind."""
    path = out.with_suffix(".toml")
    path.write_text(spec)
    args = [a for s in sets for a in ("--set", s)]
    proc = subprocess.run(
        [sys.executable, "-m", "gossipgrad.experiment", str(path), "--out", str(out),
         "--no-live", *args],
        capture_output=True, text=True, timeout=timeout, check=False,
        env={**os.environ, **(env or {})},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert processes_mentioning(str(out)) == []
    return out
