"""Model sizes as a command line writes them: ``100M``, ``300k``, ``1.5G``, ``2000``."""

from __future__ import annotations


def parse_size(text: str) -> int:
    """'10M' -> 10_000_000; '300k' -> 300_000; '1.5G' -> 1_500_000_000; plain integers as
    they are (ValueError for anything else)."""
    raw = text.strip().upper()
    scale = {"K": 10**3, "M": 10**6, "G": 10**9}.get(raw[-1:], 1)
    try:
        return int(float(raw[:-1] if scale > 1 else raw) * scale)
    except ValueError:
        raise ValueError(f"a model size such as 100M, got {text!r}") from None
