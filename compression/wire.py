"""The TensorEnvelope wire format: building it, and parsing it without trusting it.

An encoded tensor is one serialized ``TensorEnvelope`` (compression/envelope.proto) with up to
three sections (indices, values, scales). Each section is stored raw or as one zstd frame,
whichever the policy in :func:`_store` picks: zstd is tried on index streams, scales and small
sections (where it pays); a large dense value array is compressed only when a 1 MiB prefix
shrinks by 15% or more (fp16/fp32 shrink ~1.1x at ~700 MB/s: not worth it; int8 of
heavy-tailed gradients shrinks ~1.25x). A CRC32 covers a fixed serialization of every header
field followed by the stored section bytes, so an edited field is caught like a flipped
payload bit.

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
from gossipgrad.compression.envelope_pb2 import DType, TensorEnvelope
from gossipgrad.compression.errors import DecodeError
from gossipgrad.compression.varint import encode_varint, read_varint

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
#: Larger sections are zstd-compressed only if a prefix of this size shrinks to at most
#: ZSTD_PROBE_RATIO: int8 of heavy-tailed gradients shrinks ~1.25x (worth ~1.3 ms/MB on a WAN
#: link), fp32/fp16 ~1.05-1.1x (not worth it).
ZSTD_PROBE = 1 << 20
ZSTD_PROBE_RATIO = 0.85
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


# torch warns (once) that a tensor over a read-only buffer is not writable; bytes_to_tensor's
# tensors are never written. The filter is installed once, at import, and matches only this
# warning raised from this module: ``warnings.catch_warnings()`` around the call instead is not
# thread-safe (it swaps the process's filter list), and decodes run on several threads at once,
# which left an "ignore every UserWarning" filter behind in the user's process.
_NOT_WRITABLE = "The given NumPy array is not writable"
warnings.filterwarnings("ignore", message=_NOT_WRITABLE, category=UserWarning, module=__name__)


def tensor_to_bytes(t: torch.Tensor | None) -> memoryview:
    """A bytes-like view of a tensor's raw bytes (copied to the host only if on a device)."""
    if t is None or t.numel() == 0:
        return memoryview(b"")
    arr = t.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
    return memoryview(arr)


def bytes_to_tensor(buf: bytes | memoryview, device: torch.device | None = None) -> torch.Tensor:
    """A read-only-by-convention uint8 tensor over ``buf`` (no copy on CPU)."""
    if len(buf) == 0:
        return torch.empty(0, dtype=torch.uint8, device=device)
    t = torch.from_numpy(np.frombuffer(buf, dtype=np.uint8))  # see _NOT_WRITABLE
    return t if device is None or torch.device(device).type == "cpu" else t.to(device)


def _probe_pays(raw: memoryview) -> bool:
    probe = raw[:ZSTD_PROBE]
    return len(_compressor().compress(probe)) <= ZSTD_PROBE_RATIO * len(probe)


def _store(sec: TensorEnvelope.Section, raw: memoryview, *, try_zstd: bool) -> bytes | memoryview:
    """Set ``sec``'s storage and raw size for ``raw``, zstd-compressing it where it pays.

    Returns the bytes to store; the caller frames them (see :func:`build_envelope`).
    """
    sec.raw_size = len(raw)
    stored: bytes | memoryview = raw
    sec.storage = TensorEnvelope.RAW
    if len(raw) and (try_zstd or len(raw) <= ZSTD_SMALL or _probe_pays(raw)):
        z = _compressor().compress(raw)
        if len(z) <= ZSTD_KEEP_RATIO * len(raw):
            sec.storage = TensorEnvelope.ZSTD
            stored = z
    return stored


#: Field numbers of the sections in TensorEnvelope and of ``data`` in Section (envelope.proto).
_SECTION_FIELDS = (("indices", 11), ("values", 12), ("scales", 13))
_SECTION_DATA_FIELD = 3
_LEN = 2  # protobuf wire type "length-delimited"


def _frame_data(field: int, stored: bytes | memoryview) -> bytes:
    """Wire bytes that, appended to a serialized envelope, set ``<section>.data = stored``.

    Protobuf merges repeated occurrences of an embedded message field, so the header (with the
    sections' storage and raw_size) can be serialized by protobuf and each payload appended
    after it, with one copy of the payload in total instead of three.
    """
    inner = encode_varint((_SECTION_DATA_FIELD << 3) | _LEN) + encode_varint(len(stored))
    return encode_varint((field << 3) | _LEN) + encode_varint(len(inner) + len(stored)) + inner


def _header_crc(env: TensorEnvelope, datas: tuple[bytes | memoryview, ...] | None = None) -> int:
    """CRC32 of the header fields, then of the stored section bytes.

    ``datas`` are the sections' stored bytes when the caller already holds them (reading a
    bytes field of a parsed message copies it, which costs ~10 ms per 40 MB).
    """
    if datas is None:
        datas = (env.indices.data, env.values.data, env.scales.data)
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
    for sec, data in zip((env.indices, env.values, env.scales), datas, strict=True):
        head += struct.pack("<IQQ", sec.storage, sec.raw_size, len(data))
    crc = zlib.crc32(head)
    for data in datas:
        crc = zlib.crc32(data, crc)
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
    datas = (
        _store(env.indices, tensor_to_bytes(indices), try_zstd=True),
        _store(env.values, tensor_to_bytes(values), try_zstd=False),
        _store(env.scales, tensor_to_bytes(scales), try_zstd=True),
    )
    env.crc32 = _header_crc(env, datas)
    parts: list[bytes | memoryview] = [env.SerializeToString()]
    for (_, field), stored in zip(_SECTION_FIELDS, datas, strict=True):
        if len(stored):
            parts += [_frame_data(field, stored), stored]
    return b"".join(parts)


#: A valid envelope has ~15 top-level fields (unpacked shape dims at most 64 more) and 3 per
#: section; the caps keep a hostile message of millions of tiny fields from costing seconds.
_MAX_FIELDS = 256
_MAX_SECTION_FIELDS = 32


def _scan(buf: bytes, pos: int, end: int, max_fields: int) -> list[tuple[int, int, int, int, int]]:
    """Top-level fields of the message in ``buf[pos:end]`` as (field, wire type, start of the
    field, start of its value, end), checking every length against the buffer."""
    fields: list[tuple[int, int, int, int, int]] = []
    while pos < end:
        if len(fields) >= max_fields:
            raise DecodeError(f"not a TensorEnvelope: more than {max_fields} fields")
        start = pos
        key, pos = read_varint(buf, pos, end)
        field, wt = key >> 3, key & 7
        value_start = pos
        if wt == 0:
            _, pos = read_varint(buf, pos, end)
        elif wt == 1:
            pos += 8
        elif wt == 5:
            pos += 4
        elif wt == 2:
            length, value_start = read_varint(buf, pos, end)
            pos = value_start + length
        else:
            raise DecodeError(f"not a TensorEnvelope: wire type {wt} (field {field})")
        if field == 0 or pos > end:
            raise DecodeError("not a TensorEnvelope: bad field or truncated message")
        fields.append((field, wt, start, value_start, pos))
    return fields


def _split_payloads(data: bytes) -> tuple[bytes, dict[int, memoryview]]:
    """Split the serialized envelope into the header without the sections' ``data`` fields
    (small: protobuf parses it) and zero-copy views of those fields, by section field number.

    Parsing the whole message with protobuf would copy every payload twice (into the message,
    then out into a bytes object): ~0.4 s per 400 MB. Merge semantics are kept: a repeated
    section field merges, and its last ``data`` wins.
    """
    view = memoryview(data)
    head = bytearray()
    payloads: dict[int, memoryview] = {}
    section_fields = {field for _, field in _SECTION_FIELDS}
    for field, wt, start, value_start, end in _scan(data, 0, len(data), _MAX_FIELDS):
        if wt != _LEN or field not in section_fields:
            head += view[start:end]
            continue
        inner = bytearray()
        for f, w, s, vs, e in _scan(data, value_start, end, _MAX_SECTION_FIELDS):
            if f == _SECTION_DATA_FIELD and w == _LEN:
                payloads[field] = view[vs:e]
            else:
                inner += view[s:e]
        head += encode_varint((field << 3) | _LEN) + encode_varint(len(inner)) + inner
    return bytes(head), payloads


@dataclass
class Header:
    """An envelope's validated header fields: what a decoder needs besides the sections."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    numel: int
    seed: int
    count: int
    index_bits: int


@dataclass
class Envelope(Header):
    """A parsed envelope whose header has been validated; sections are still stored bytes."""

    msg: TensorEnvelope
    #: Stored (possibly compressed) bytes per section name: views into the received bytes.
    sections: dict[str, memoryview]


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
    head, payloads = _split_payloads(data)
    env = TensorEnvelope()
    try:
        env.ParseFromString(head)
    except (pb_message.DecodeError, ValueError, RuntimeError) as e:
        raise DecodeError(f"not a TensorEnvelope: {e}") from None
    if len(UnknownFieldSet(env)) or any(
        len(UnknownFieldSet(s)) for s in (env.indices, env.values, env.scales)
    ):
        raise DecodeError("envelope has unknown fields")
    # Repeated fields ("last one wins") need no check of their own: whatever they change is
    # covered by the CRC, and a repeat that changes nothing decodes to the same tensor.
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
            sec.storage or sec.raw_size
        ):
            raise DecodeError(f"{name} section has unknown storage {sec.storage}")
    empty = memoryview(b"")
    datas = tuple(payloads.get(field, empty) for _, field in _SECTION_FIELDS)
    if _header_crc(env, datas) != env.crc32:
        raise DecodeError("CRC32 mismatch: corrupted or edited payload")
    sections = dict(zip(("indices", "values", "scales"), datas, strict=True))
    return Envelope(shape, dtype, numel, env.seed, env.count, env.index_bits, env, sections)


def read_section(
    env: Envelope, name: str, *, exact: int | None = None, limit: int = 0
) -> bytes | memoryview:
    """Return the raw bytes of section ``name``, checking its size before decompressing.

    Args:
        exact: the raw size the codec requires (checked when not None).
        limit: otherwise, the largest raw size the codec could produce.
    """
    sec: TensorEnvelope.Section = getattr(env.msg, name)
    stored = env.sections[name]
    raw = sec.raw_size
    if exact is not None and raw != exact:
        raise DecodeError(f"{name} section declares {raw} bytes, the codec needs {exact}")
    if exact is None and raw > limit:
        raise DecodeError(f"{name} section declares {raw} bytes, at most {limit} possible")
    if raw == 0:
        if stored:
            raise DecodeError(f"{name} section has data but raw_size 0")
        return b""
    if sec.storage == TensorEnvelope.RAW:
        if len(stored) != raw:
            raise DecodeError(f"{name} section holds {len(stored)} bytes, declares {raw}")
        return stored
    if sec.storage != TensorEnvelope.ZSTD:
        raise DecodeError(f"{name} section has no storage kind")
    try:
        params = zstandard.get_frame_parameters(stored)
        if params.content_size != raw:
            raise DecodeError(
                f"{name} zstd frame declares {params.content_size} bytes, header says {raw}"
            )
        out = _decompressor().decompress(stored, max_output_size=raw, allow_extra_data=False)
    except zstandard.ZstdError as e:
        raise DecodeError(f"{name} section: bad zstd data: {e}") from None
    if len(out) != raw:
        raise DecodeError(f"{name} section decompressed to {len(out)} bytes, declares {raw}")
    return out
