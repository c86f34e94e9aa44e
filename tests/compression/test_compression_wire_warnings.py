"""Decoding leaves the user's warning filters alone, from any number of threads at once.

Payload bytes become tensors without a copy (``bytes_to_tensor``), over which torch warns that
the buffer is not writable. That warning was silenced with ``warnings.catch_warnings()``
around each call, which swaps the process-wide filter list: server threads decoding at the
same time restored each other's copies and left an "ignore every UserWarning" filter behind in
the user's process.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import warnings

import pytest
from gossipgrad.compression.wire import bytes_to_tensor

pytestmark = pytest.mark.timeout(120)


def test_decoding_on_many_threads_leaves_the_warning_filters_as_they_were() -> None:
    before = list(warnings.filters)
    old_interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as possible: the race shows at once
    try:
        for _ in range(3):

            def decode() -> None:
                for _ in range(20_000):
                    bytes_to_tensor(b"\x01" * 16)

            threads = [threading.Thread(target=decode) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert warnings.filters == before
    finally:
        sys.setswitchinterval(old_interval)


def test_only_the_not_writable_warning_of_the_decoder_is_silenced() -> None:
    """With UserWarnings made errors, a decode raises nothing and the user's own UserWarning
    still does (a fresh interpreter: torch gives its warning once per process)."""
    code = (
        "import warnings\n"
        "from gossipgrad.compression.wire import bytes_to_tensor\n"
        "assert bytes_to_tensor(b'abc').tolist() == [97, 98, 99]\n"
        "try:\n"
        "    warnings.warn('mine', UserWarning)\n"
        "except UserWarning:\n"
        "    print('raised')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-W", "error::UserWarning", "-c", code],
        capture_output=True,
        text=True,
        timeout=100,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "raised"
