"""A peer's state as a stream: written piece by piece from its tensors, read into tensors.

``torch.save`` builds a zip archive that ``torch.load`` reads back only from a whole buffer
or a seekable file, so a state served that way costs the donor the state's size again (the
blob) and the joiner twice (the blob, then the tensors loaded from it): at 100M parameters
several GB for a download that needs none of it. This format (``StateHeader.state_format``
1) keeps the tensors' bytes out of the archive:

1. ``MAGIC``, then the skeleton's length (8 bytes, little-endian);
2. the skeleton: ``torch.save`` of ``{"state": ..., "shapes": [...]}``, the state with every
   tensor replaced by an empty one of its dtype, in the order a depth-first walk of dicts,
   lists and tuples meets them, and each tensor's shape in that order;
3. each tensor's bytes, contiguous, in that order.

The donor (:class:`StateWriter`) sends from its snapshot's tensors without building the
stream; the joiner (:class:`StateReader`) reads the skeleton (a few KB), checks that the
shapes add up to the declared size, and copies the bytes into tensors allocated as their
first byte arrives: the whole state in memory once, a declared size alone allocating
nothing. The skeleton is loaded with ``weights_only=True``, as any received state is.
"""

from __future__ import annotations

import io
import math
import struct
from collections.abc import Callable, Iterator
from typing import Any

import torch

#: ``StateHeader.state_format`` of this format (0: a ``torch.save`` blob).
STATE_FORMAT = 1

#: First bytes of a stream of this format.
MAGIC = b"GGSTATE1"

_LENGTH = struct.Struct("<Q")
_PREFIX = len(MAGIC) + _LENGTH.size

#: Largest skeleton a reader accepts: counters, optimizer hyperparameters and one empty
#: tensor per state tensor come to a few KB, even for a model of thousands of tensors.
MAX_SKELETON_BYTES = 16 << 20


def _walk(obj: Any, on_tensor: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with each tensor replaced by ``on_tensor(tensor)``, in depth-first order."""
    if isinstance(obj, torch.Tensor):
        return on_tensor(obj)
    if isinstance(obj, dict):
        return {k: _walk(v, on_tensor) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_walk(v, on_tensor) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_walk(v, on_tensor) for v in obj)
    return obj


def host_copy(obj: Any) -> Any:
    """``obj`` with each tensor copied, once, into contiguous host memory: a snapshot that
    training may run on beside, e.g. while the snapshot is sent."""

    def copy(t: torch.Tensor) -> torch.Tensor:
        return torch.empty(t.shape, dtype=t.dtype, device="cpu").copy_(t.detach())

    return _walk(obj, copy)


def on_host(obj: Any) -> Any:
    """``obj`` with each tensor in contiguous host memory: moved if it is not (a copy), else
    itself (for tensors that are copies already, e.g. an algorithm's ``state_dict``)."""
    return _walk(obj, lambda t: t.detach().to("cpu").contiguous())


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous host tensor (no copy)."""
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


class StateWriter:
    """A state's stream, produced piece by piece from its tensors (module docstring).

    Args:
        state: nested dicts, lists and tuples of plain values and tensors, every tensor
            contiguous in host memory (:func:`host_copy`) and not changed while a stream of
            it is being sent.

    ``size`` is the stream's length in bytes; :meth:`pieces` yields it, any number of times.
    """

    def __init__(self, state: Any) -> None:
        tensors: list[torch.Tensor] = []

        def placeholder(t: torch.Tensor) -> torch.Tensor:
            if t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("a state to stream holds contiguous host tensors only")
            tensors.append(t)
            return torch.empty(0, dtype=t.dtype)

        self._state = state
        self._blob: bytes | None = None
        skeleton = _walk(state, placeholder)
        buf = io.BytesIO()
        torch.save({"state": skeleton, "shapes": [list(t.shape) for t in tensors]}, buf)
        self._head = MAGIC + _LENGTH.pack(buf.tell()) + buf.getvalue()
        self._tensors = tensors
        #: Bytes of the whole stream.
        self.size = len(self._head) + sum(t.numel() * t.element_size() for t in tensors)

    def blob(self) -> bytes:
        """The state as one ``torch.save`` blob (format 0), for a joiner that reads no other:
        serialized on the first call and kept with the snapshot (the state's size again)."""
        if self._blob is None:
            buf = io.BytesIO()
            torch.save(self._state, buf)
            self._blob = buf.getvalue()
        return self._blob

    def pieces(self) -> Iterator[memoryview]:
        """The stream, as views of the skeleton and of each tensor's bytes (no copies)."""
        yield memoryview(self._head)
        for t in self._tensors:
            if t.numel():
                yield _bytes_of(t)


class StateReader:
    """Reads a stream of ``size`` bytes as its pieces arrive (:meth:`write`); :meth:`state`
    once all have.

    Every refusal is a string saying why (the transport ends the download with it): a bad
    prefix, a skeleton too large or undecodable, shapes that do not add up to ``size``.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._head = bytearray()  # the prefix, then the skeleton, while they arrive
        self._skeleton_bytes = -1
        self._skeleton: Any = None
        self._specs: list[tuple[torch.dtype, list[int], int]] = []  # dtype, shape, bytes
        self._tensors: list[torch.Tensor] = []
        self._index = 0  # the tensor being filled
        self._offset = 0  # bytes of it filled so far
        self._done = False

    def write(self, part: memoryview) -> str | None:
        """Take the next bytes of the stream; why they are refused, or None. ``part`` is not
        kept past the call."""
        view = part
        while view.nbytes:
            if self._skeleton is None:
                taken, why = self._take_head(view)
            else:
                taken, why = self._take_tensor(view)
            if why is not None:
                return why
            view = view[taken:]
        return None

    def _take_head(self, view: memoryview) -> tuple[int, str | None]:
        want = _PREFIX if self._skeleton_bytes < 0 else _PREFIX + self._skeleton_bytes
        taken = min(view.nbytes, want - len(self._head))
        self._head += view[:taken]
        if len(self._head) < want:
            return taken, None
        if self._skeleton_bytes < 0:
            if bytes(self._head[: len(MAGIC)]) != MAGIC:
                return taken, "state stream does not start with its magic bytes"
            (n,) = _LENGTH.unpack_from(self._head, len(MAGIC))
            if not 0 < n <= min(MAX_SKELETON_BYTES, self.size - _PREFIX):
                return taken, f"state skeleton of {n} bytes is empty or too large"
            self._skeleton_bytes = n
            return taken, None
        return taken, self._parse_skeleton()

    def _parse_skeleton(self) -> str | None:
        try:
            loaded = torch.load(
                io.BytesIO(bytes(self._head[_PREFIX:])), map_location="cpu", weights_only=True
            )
        except Exception as err:
            return f"state skeleton is unreadable: {type(err).__name__}: {err}"
        self._head = bytearray()
        if not isinstance(loaded, dict) or not isinstance(loaded.get("shapes"), list):
            return "state skeleton has no shapes"
        shapes = loaded["shapes"]
        dtypes: list[torch.dtype] = []
        skeleton = _walk(loaded.get("state"), lambda t: dtypes.append(t.dtype) or t)
        if len(dtypes) != len(shapes):
            return f"state skeleton has {len(dtypes)} tensors and {len(shapes)} shapes"
        total = _PREFIX + self._skeleton_bytes
        for dtype, shape in zip(dtypes, shapes, strict=True):
            if not isinstance(shape, list) or not all(isinstance(d, int) and d >= 0 for d in shape):
                return f"state skeleton has a bad shape {shape!r}"
            nbytes = math.prod(shape) * dtype.itemsize
            total += nbytes
            if total > self.size:
                break
            self._specs.append((dtype, shape, nbytes))
        if total != self.size:
            return f"state skeleton's tensors do not add up to the declared {self.size} bytes"
        self._skeleton = skeleton
        self._skip_empty()
        return None

    def _skip_empty(self) -> None:
        """Allocate the tensors that have no bytes to wait for (empty ones) at the index."""
        while self._index < len(self._specs) and self._specs[self._index][2] == 0:
            dtype, shape, _ = self._specs[self._index]
            self._tensors.append(torch.empty(shape, dtype=dtype))
            self._index += 1
        self._done = self._index == len(self._specs)

    def _take_tensor(self, view: memoryview) -> tuple[int, str | None]:
        if self._done:
            return 0, "state stream longer than its tensors"
        dtype, shape, nbytes = self._specs[self._index]
        if self._offset == 0:  # its first bytes: allocated now, not when declared
            self._tensors.append(torch.empty(shape, dtype=dtype))
        taken = min(view.nbytes, nbytes - self._offset)
        target = _bytes_of(self._tensors[-1])
        target[self._offset : self._offset + taken] = view[:taken]
        self._offset += taken
        if self._offset == nbytes:
            self._index += 1
            self._offset = 0
            self._skip_empty()
        return taken, None

    def state(self) -> Any:
        """The state read, its tensors in place of the skeleton's placeholders. Raises
        ValueError before the whole stream has arrived."""
        if self._skeleton is None or not self._done:
            raise ValueError("the state stream has not arrived whole")
        tensors = iter(self._tensors)
        return _walk(self._skeleton, lambda _t: next(tensors))
