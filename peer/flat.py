"""One contiguous buffer for all trainable parameters of a model.

Gossip works on the model as one flat vector x: compressing, checksumming and mixing one
tensor is simpler and faster than doing it per parameter. After ``FlatParameters(model)`` the
model's parameters are views into ``flat.data``, so optimizer steps and gossip updates see the
same memory with no copies.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import os
import tempfile
import weakref
from functools import lru_cache

import torch
import xxhash
from torch import nn

log = logging.getLogger(__name__)

#: Where a spilled tensor goes when the temporary folder is memory (a tmpfs): the folder the
#: Filesystem Hierarchy Standard keeps for temporary files on disk.
DISK_TMP = "/var/tmp"
_MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def filesystem_type(path: str, mounts: str) -> str:
    """The type of the filesystem holding ``path``, from a ``/proc/self/mounts`` text (the
    mount point that is the longest prefix of the path; "" if none is)."""
    path = os.path.realpath(path)
    best, kind = "", ""
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) < 3:
            continue
        point = fields[1].replace("\\040", " ")
        inside = path == point or path.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, kind = point, fields[2]
    return kind


@lru_cache(maxsize=1)
def spill_directory() -> str | None:
    """The folder for :class:`SpilledTensor` files: the temporary folder (``TMPDIR``), unless
    it is held in memory (a tmpfs, common for ``/tmp``), where a spilled model would cost the
    RAM it is spilled to save; then :data:`DISK_TMP` if that is on disk. None: tempfile's
    own choice (no mount table to read, or no better folder)."""
    try:
        with open("/proc/self/mounts", encoding="utf-8") as f:
            mounts = f.read()
    except OSError:
        return None
    chosen = tempfile.gettempdir()
    if filesystem_type(chosen, mounts) not in _MEMORY_FILESYSTEMS:
        return None
    if os.access(DISK_TMP, os.W_OK) and filesystem_type(DISK_TMP, mounts) not in (
        _MEMORY_FILESYSTEMS
    ):
        log.info("%s is in memory (tmpfs): the initial model is spilled to %s", chosen, DISK_TMP)
        return DISK_TMP
    log.warning(
        "%s is in memory (tmpfs) and no disk folder was found: the initial model spilled there "
        "costs its size in RAM; set TMPDIR to a folder on disk",
        chosen,
    )
    return None


class FlatParameters:
    """The trainable parameters of ``model`` re-homed into one flat tensor ``data``, and
    (``keep_initial``) a copy of them as built, in ``initial``."""

    def __init__(self, model: nn.Module, keep_initial: bool = True) -> None:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("model has no trainable parameters")
        dtypes = {p.dtype for _, p in named}
        devices = {p.device for _, p in named}
        if len(dtypes) != 1 or len(devices) != 1:
            raise ValueError(
                f"all trainable parameters must share one dtype and device, got "
                f"{sorted(map(str, dtypes))} on {sorted(map(str, devices))}"
            )
        self.names = [n for n, _ in named]
        self.shapes = [tuple(p.shape) for _, p in named]
        self.dtype = dtypes.pop()
        self.device = devices.pop()
        self.numel = sum(p.numel() for _, p in named)
        self.data = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        self._params = [p for _, p in named]
        offset = 0
        with torch.no_grad():
            for p in self._params:
                n = p.numel()
                view = self.data[offset : offset + n].view_as(p)
                view.copy_(p)
                p.data = view
                offset += n
        self.fingerprint = model_fingerprint(self.names, self.shapes, self.dtype)
        # The model as built: peers seeded alike hold the same one, so a new edge's public
        # copies can start from it without sending it. Kept in a file, not in memory: it is
        # read only when an edge opens in a swarm's first rounds. Only a peer that gossips
        # needs it (``keep_initial``; a site's follower ranks do not).
        self.initial = SpilledTensor(self.data) if keep_initial else None

    def host_twin(self) -> FlatParameters:
        """A twin of these parameters whose ``data`` is a copy in host memory (pinned where
        CUDA is, for fast copies to and from the device): the same names, shapes, fingerprint
        and initial model, no model of its own. The gossip state of a model on an accelerator
        is built on it (``gossip.state_device``); the caller keeps the two ``data`` in step
        (``GossipOptimizer``: the parameters to the twin before a round, back after it)."""
        twin = copy.copy(self)
        twin.data = torch.empty(
            self.numel, dtype=self.dtype, pin_memory=torch.cuda.is_available()
        ).copy_(self.data)
        twin.device = twin.data.device
        twin._params = []
        return twin

    def grad(self) -> torch.Tensor:
        """The parameters' gradients as one flat tensor (zeros where a grad is None)."""
        if not self._params:
            raise RuntimeError("a host twin has no gradients: they stay with the model")
        parts = [
            p.grad.reshape(-1) if p.grad is not None else torch.zeros_like(p).reshape(-1)
            for p in self._params
        ]
        return torch.cat(parts)

    def set_grad(self, flat_grad: torch.Tensor) -> None:
        """Write a flat gradient back into the parameters' ``.grad``."""
        if not self._params:
            raise RuntimeError("a host twin has no gradients: they stay with the model")
        offset = 0
        for p in self._params:
            n = p.numel()
            g = flat_grad[offset : offset + n].view_as(p)
            if p.grad is None:
                p.grad = g.clone()
            else:
                p.grad.copy_(g)
            offset += n

    @property
    def nbytes(self) -> int:
        return self.numel * self.data.element_size()


class SpilledTensor:
    """A read-only copy of a tensor kept in an anonymous temporary file instead of memory.

    What is read rarely (the initial model, read when an edge opens) need not cost a model's
    worth of RAM: the file lives in the page cache while there is room, on disk otherwise,
    and the system removes it when the process ends, however it ends. The folder is
    ``directory``, else :func:`spill_directory` (``TMPDIR``, or a disk folder where that is
    a tmpfs, in which the file would be memory again).
    """

    def __init__(self, t: torch.Tensor, directory: str | None = None) -> None:
        self.shape = tuple(t.shape)
        self.dtype = t.dtype
        self.numel = t.numel()
        # A file with no name: removed by the system once the descriptor closes.
        folder = directory if directory is not None else spill_directory()
        self._fd, path = tempfile.mkstemp(prefix="gossipgrad-", dir=folder)
        os.unlink(path)
        self._closed = weakref.finalize(self, os.close, self._fd)
        view = _bytes_of(t.detach().reshape(-1).contiguous().cpu())
        for lo in range(0, len(view), _IO_BLOCK):
            os.pwrite(self._fd, view[lo : lo + _IO_BLOCK], lo)

    def copy_to(self, out: torch.Tensor) -> torch.Tensor:
        """Write the stored values into ``out`` (same shape; any floating dtype, rounded to
        it; any device). Thread-safe: reads use positioned I/O, so concurrent readers do not
        share a file offset."""
        if tuple(out.shape) != self.shape or not out.is_floating_point():
            raise ValueError(
                f"spilled tensor is {list(self.shape)} {self.dtype}, out is "
                f"{list(out.shape)} {out.dtype}"
            )
        flat = out.view(-1)
        if flat.device.type == "cpu" and out.is_contiguous() and out.dtype == self.dtype:
            self._read_into(_bytes_of(flat), 0)
            return out
        # Another device or dtype: through a bounded staging buffer, rounded on the copy.
        size = torch.empty(0, dtype=self.dtype).element_size()
        step = _IO_BLOCK // size
        staging = torch.empty(min(step, self.numel), dtype=self.dtype)
        for lo in range(0, self.numel, step):
            part = staging[: min(step, self.numel - lo)]
            self._read_into(_bytes_of(part), lo * size)
            flat[lo : lo + part.numel()].copy_(part)
        return out

    def load(self) -> torch.Tensor:
        """The stored values as a new CPU tensor."""
        return self.copy_to(torch.empty(self.shape, dtype=self.dtype))

    def _read_into(self, view: memoryview, offset: int) -> None:
        done = 0
        while done < len(view):
            n = os.preadv(self._fd, [view[done : done + _IO_BLOCK]], offset + done)
            if n <= 0:
                raise OSError(f"spilled tensor file ended at byte {offset + done}")
            done += n

    def close(self) -> None:
        """Give the file back now rather than when this object is collected."""
        self._closed()


#: Bytes per read or write of a spilled tensor (bounded staging for device tensors).
_IO_BLOCK = 64 << 20


def _bytes_of(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, as a writable memoryview (no copy)."""
    return memoryview(t.view(torch.uint8).numpy()).cast("B")


def persistent_buffers(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The model's buffers that belong to its state (those ``state_dict()`` saves): not the
    non-persistent ones (attention masks, rotary caches), which every peer rebuilds alike."""
    out = []
    for prefix, module in model.named_modules():
        skip = module._non_persistent_buffers_set
        for name, b in module.named_buffers(recurse=False):
            if b is not None and name not in skip:
                out.append((f"{prefix}.{name}" if prefix else name, b))
    return out


class FloatBuffers:
    """A model's floating-point buffers (BatchNorm running mean and variance, and the like)
    gathered into one flat fp32 vector and written back.

    They are copied, not re-homed like the parameters, because modules may replace a buffer
    tensor rather than update it in place. Integer buffers (BatchNorm's
    ``num_batches_tracked``) are left out: they count local batches, not a statistic to
    average; so are non-persistent ones (:func:`persistent_buffers`).
    """

    def __init__(self, model: nn.Module) -> None:
        self._model = model
        named = [(n, b) for n, b in persistent_buffers(model) if b.is_floating_point()]
        self.names = [n for n, _ in named]
        self.shapes = [tuple(b.shape) for _, b in named]
        self.numel = sum(b.numel() for _, b in named)
        self.device = named[0][1].device if named else torch.device("cpu")

    def __bool__(self) -> bool:
        return self.numel > 0

    def _tensors(self) -> list[torch.Tensor]:
        buffers = dict(persistent_buffers(self._model))
        return [buffers[n] for n in self.names]

    def gather(self) -> torch.Tensor:
        """The buffers' current values as one fp32 vector (a copy)."""
        return torch.cat([b.detach().reshape(-1).float() for b in self._tensors()])

    def add_(self, delta: torch.Tensor) -> None:
        """Add a flat fp32 vector to the buffers, in place (each keeps its dtype)."""
        offset = 0
        with torch.no_grad():
            for b in self._tensors():
                n = b.numel()
                b.add_(delta[offset : offset + n].view_as(b).to(b.dtype))
                offset += n


def model_fingerprint(names: list[str], shapes: list[tuple[int, ...]], dtype: torch.dtype) -> str:
    """A short hash of parameter names, shapes and dtype: peers must train the same model."""
    h = hashlib.sha256(str(dtype).encode())
    for n, s in zip(names, shapes, strict=True):
        h.update(f"{n}:{'x'.join(map(str, s))};".encode())
    return h.hexdigest()[:16]


def tensor_checksum(t: torch.Tensor) -> int:
    """A fast exact checksum of a tensor's bits (64-bit XXH3 of its bytes, in order).

    The same on any device or thread count (it hashes the bytes, not a float reduction), and
    it catches lost, duplicated, reordered and corrupted updates of a public copy. XXH3 runs
    at memory speed (about one ``copy_`` of the tensor), where the earlier strided integer sums
    took 13 copies. Not cryptographic: it guards against accidents, not adversaries.
    """
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu" or not flat.is_contiguous():
        flat = flat.contiguous().cpu()
    if flat.numel() == 0:
        return xxhash.xxh3_64_intdigest(b"")
    return xxhash.xxh3_64_intdigest(_bytes_of(flat))


#: Elements per slice of ``copy_with_checksum``: 4 MiB of float32, in cache between the two.
_CHECKSUM_SLICE = 1 << 20


def copy_with_checksum(dst: torch.Tensor, src: torch.Tensor) -> int:
    """``dst.copy_(src)`` and ``tensor_checksum(src)`` in one pass over memory: a slice at a
    time, the hash reading what the copy has just brought into cache (1.23 against 1.51
    copies of a 100M model). Tensors on another device or not contiguous: one after the
    other."""
    if not (
        dst.device.type == src.device.type == "cpu"
        and dst.is_contiguous()
        and src.is_contiguous()
        and dst.dtype == src.dtype
        and dst.shape == src.shape
    ):
        dst.copy_(src)
        return tensor_checksum(src)
    d, s = dst.detach().view(-1), src.detach().view(-1)
    digest = xxhash.xxh3_64()
    for lo in range(0, s.numel(), _CHECKSUM_SLICE):
        hi = min(s.numel(), lo + _CHECKSUM_SLICE)
        d[lo:hi].copy_(s[lo:hi])
        digest.update(_bytes_of(d[lo:hi]))
    return digest.intdigest()
