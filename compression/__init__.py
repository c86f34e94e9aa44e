"""Compression library: tensors in, bytes out. Knows nothing of gRPC or peers.

Quick use::

    from gossipgrad.compression import from_spec, ErrorFeedback
    codec = from_spec("topk:0.01+int8")        # or TopK(0.01) >> Int8()
    data = codec.encode(tensor)                # bytes: a serialized TensorEnvelope
    codec.decode_add_(data, target)            # target += decoded, deterministic

Spec grammar, codecs, wire format and error bounds: docs/compression.md.
"""

from gossipgrad.compression.base import Codec, Composed, Identity, Quantizer, Sparsifier
from gossipgrad.compression.engine import Encoded, Received
from gossipgrad.compression.error_feedback import ErrorFeedback
from gossipgrad.compression.errors import DecodeError
from gossipgrad.compression.quantizers import BF16, FP16, QSGD, Int2, Int4, Int8, Sign
from gossipgrad.compression.sparsifiers import ChunkTopK, RandomK, TopK
from gossipgrad.compression.spec import REGISTRY, from_spec, valid_forms
from gossipgrad.compression.wire import DEFAULT_MAX_NUMEL

__all__ = [
    "BF16",
    "DEFAULT_MAX_NUMEL",
    "FP16",
    "QSGD",
    "REGISTRY",
    "ChunkTopK",
    "Codec",
    "Composed",
    "DecodeError",
    "Encoded",
    "ErrorFeedback",
    "Identity",
    "Int2",
    "Int4",
    "Int8",
    "Quantizer",
    "RandomK",
    "Received",
    "Sign",
    "Sparsifier",
    "TopK",
    "from_spec",
    "valid_forms",
]
