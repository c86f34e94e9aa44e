"""The TensorEnvelope wire format: building it, and parsing it without trusting it.

An encoded tensor is one serialized ``gossipgrad.proto.gossip_pb2.TensorEnvelope`` with up to
three sections (indices, values, scales). Each section is stored raw or as one zstd frame,
whichever the policy in :func:`_store` picks: zstd is tried on index streams, scales and small
sections (where it pays) and never on large dense value arrays (it shrinks them ~1.1x at
~700 MB/s, DESIGN.md). A CRC32 covers a fixed serialization of every header field followed by
the stored section bytes, so an edited field is caught like a flipped payload bit.

Parsing checks, in this order and before any allocation driven by the message: protobuf
well-formedness with no unknown or repeated fields, format version, codec spec, dtype, shape
against ``max_numel``, the CRC, and then (per section, by the caller) the declared raw size
against the size the codec requires and against the zstd frame header.
"""

from __future__ import annotations

import math
import struct
import sys
import threading
import warnings
import zlib
from dataclasses import dataclass

import numpy as np
import torch
import zstandard
from google.protobuf import message as pb_message
from google.protobuf.unknown_fields import UnknownFieldSet
from gossipgrad.compression.errors import DecodeError
from gossipgrad.proto.gossip_pb2 import DType, TensorEnvelope

__all__ = [
    "DEFAULT_MAX_NUMEL",
    "FORMAT_VERSION",
    "Envelope",
    "build_envelope",
    "bytes_to_tensor",
    "parse_envelope",
    "read_section",
]

if sys.byteorder != "little":  # pragma: no cover - every platform torch ships for
    raise ImportError("gossipgrad.compression writes little-endian values; big-endian host")

FORMAT_VERSION = 1
#: Cap on elements when the caller passes no max_numel: 2**31 (8 GiB of float32).
DEFAULT_MAX_NUMEL = 1 << 31
#: Sections up to this raw size are offered to zstd whatever they hold.
ZSTD_SMALL = 4 << 20
#: zstd output is kept only if it is at most this fraction of the raw size.
ZSTD_KEEP_RATIO = 0.97
ZSTD_LEVEL = 1

DTYPE_TO_WIRE: dict[torch.dtype, int] = {
    torch.float32: DType.FLOAT32,
    torch.float16: DType.FLOAT16,
    torch.bfloat16: DType.BFLOAT16,
    torch.float64: DType.FLOAT64,
}
WIRE_TO_DTYPE: dict[int, torch.dtype] = {v: k for k, v in DTYPE_TO_WIRE.items()}

_local = threading.local()


def _compressor() -> zstandard.ZstdCompressor:
    c = getattr(_local, "cctx", None)
    if c is None:
        c = _local.cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True)
    return c


def _decompressor() -> zstandard.ZstdDecompressor:
    d = getattr(_local, "dctx", None)
    if d is None:
        d = _local.dctx = zstandard.ZstdDecompressor()
    return d


def tensor_to_bytes(t: torch.Tensor | None) -> bytes:
    """The raw bytes of a tensor (copied to the host if it lives on a device)."""
    if t is None or t.numel() == 0:
        return b""
    return t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy().tobytes()


def bytes_to_tensor(buf: bytes | memoryview, device: torch.device | None = None) -> torch.Tensor:
    """A read-only-by-convention uint8 tensor over ``buf`` (no copy on CPU)."""
    if len(buf) == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": we never write
        t = torch.from_numpy(np.frombuffer(buf, dtype=np.uint8))
    return t if device is None or torch.device(device).type == "cpu" else t.to(device)


def _store(raw: bytes, *, try_zstd: bool) -> TensorEnvelope.Section:
    sec = TensorEnvelope.Section(raw_size=len(raw))
    if raw and (try_zstd or len(raw) <= ZSTD_SMALL):
        z = _compressor().compress(raw)
        if len(z) <= ZSTD_KEEP_RATIO * len(raw):
            sec.storage = TensorEnvelope.ZSTD
            sec.data = z
            return sec
    sec.storage = TensorEnvelope.RAW
    sec.data = raw
    return sec


def _header_crc(env: TensorEnvelope) -> int:
    spec = env.codec_spec.encode("utf-8")
    head = struct.pack(
        f"<IIQ{len(env.shape)}QI",
        env.format_version,
        env.dtype,
        len(env.shape),
        *env.shape,
        len(spec),
    )
    head += spec + struct.pack("<QQI", env.seed, env.count, env.index_bits)
    for sec in (env.indices, env.values, env.scales):
        head += struct.pack("<IQQ", sec.storage, sec.raw_size, len(sec.data))
    crc = zlib.crc32(head)
    for sec in (env.indices, env.values, env.scales):
        crc = zlib.crc32(sec.data, crc)
    return crc


def build_envelope(
    *,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    spec: str,
    seed: int,
    count: int,
    index_bits: int = 0,
    indices: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
) -> bytes:
    """Serialize one encoded tensor; sections are tensors moved to the host here, once."""
    env = TensorEnvelope(
        format_version=FORMAT_VERSION,
        shape=list(shape),
        dtype=DTYPE_TO_WIRE[dtype],
        codec_spec=spec,
        seed=seed,
        count=count,
        index_bits=index_bits,
    )
    env.indices.CopyFrom(_store(tensor_to_bytes(indices), try_zstd=True))
    env.values.CopyFrom(_store(tensor_to_bytes(values), try_zstd=False))
    env.scales.CopyFrom(_store(tensor_to_bytes(scales), try_zstd=True))
    env.crc32 = _header_crc(env)
    return env.SerializeToString()


@dataclass
class Envelope:
    """A parsed envelope whose header has been validated; sections are still stored bytes."""

    msg: TensorEnvelope
    shape: tuple[int, ...]
    dtype: torch.dtype
    numel: int
    seed: int
    count: int
    index_bits: int


def parse_envelope(
    data: bytes | bytearray | memoryview, spec: str, max_numel: int | None
) -> Envelope:
    """Parse and validate the envelope header and CRC (see the module docstring).

    Raises:
        DecodeError: on anything malformed, inconsistent or over the limits.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise DecodeError(f"expected bytes, got {type(data).__name__}")
    data = bytes(data) if not isinstance(data, bytes) else data
    env = TensorEnvelope()
    try:
        env.ParseFromString(data)
    except (pb_message.DecodeError, ValueError, RuntimeError) as e:
        raise DecodeError(f"not a TensorEnvelope: {e}") from None
    if len(UnknownFieldSet(env)) or any(
        len(UnknownFieldSet(s)) for s in (env.indices, env.values, env.scales)
    ):
        raise DecodeError("envelope has unknown fields")
    if env.ByteSize() != len(data):
        raise DecodeError("envelope has repeated or trailing fields")
    if env.format_version != FORMAT_VERSION:
        raise DecodeError(f"format_version {env.format_version}, expected {FORMAT_VERSION}")
    if env.codec_spec != spec:
        raise DecodeError(f"payload was written by codec {env.codec_spec!r}, not {spec!r}")
    dtype = WIRE_TO_DTYPE.get(env.dtype)
    if dtype is None:
        raise DecodeError(f"unsupported dtype enum value {env.dtype}")
    limit = DEFAULT_MAX_NUMEL if max_numel is None else max_numel
    shape = tuple(int(d) for d in env.shape)
    if len(shape) > 64:
        raise DecodeError(f"{len(shape)} dimensions")
    numel = math.prod(shape)
    if numel > limit:
        raise DecodeError(f"shape {list(shape)} has {numel} elements, over the limit {limit}")
    if any(d > limit for d in shape):
        raise DecodeError(f"dimension over the limit {limit} in shape {list(shape)}")
    if env.count > numel:
        raise DecodeError(f"count {env.count} exceeds the {numel} elements of the shape")
    for name in ("indices", "values", "scales"):
        sec = getattr(env, name)
        if sec.storage not in (TensorEnvelope.RAW, TensorEnvelope.ZSTD) and (
            sec.raw_size or sec.data or sec.storage
        ):
            raise DecodeError(f"{name} section has unknown storage {sec.storage}")
    if _header_crc(env) != env.crc32:
        raise DecodeError("CRC32 mismatch: corrupted or edited payload")
    return Envelope(env, shape, dtype, numel, env.seed, env.count, env.index_bits)


def read_section(env: Envelope, name: str, *, exact: int | None = None, limit: int = 0) -> bytes:
    """Return the raw bytes of section ``name``, checking its size before decompressing.

    Args:
        exact: the raw size the codec requires (checked when not None).
        limit: otherwise, the largest raw size the codec could produce.
    """
    sec: TensorEnvelope.Section = getattr(env.msg, name)
    raw = sec.raw_size
    if exact is not None and raw != exact:
        raise DecodeError(f"{name} section declares {raw} bytes, the codec needs {exact}")
    if exact is None and raw > limit:
        raise DecodeError(f"{name} section declares {raw} bytes, at most {limit} possible")
    if raw == 0:
        if sec.data:
            raise DecodeError(f"{name} section has data but raw_size 0")
        return b""
    if sec.storage == TensorEnvelope.RAW:
        if len(sec.data) != raw:
            raise DecodeError(f"{name} section holds {len(sec.data)} bytes, declares {raw}")
        return sec.data
    if sec.storage != TensorEnvelope.ZSTD:
        raise DecodeError(f"{name} section has no storage kind")
    try:
        params = zstandard.get_frame_parameters(sec.data)
        if params.content_size != raw:
            raise DecodeError(
                f"{name} zstd frame declares {params.content_size} bytes, header says {raw}"
            )
        out = _decompressor().decompress(sec.data, max_output_size=raw, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise DecodeError(f"{name} section: bad zstd data: {e}") from None
    if len(out) != raw:
        raise DecodeError(f"{name} section decompressed to {len(out)} bytes, declares {raw}")
    return out
