from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]
    FLOAT64: _ClassVar[DType]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
FLOAT64: DType

class TensorEnvelope(_message.Message):
    __slots__ = ("format_version", "shape", "dtype", "codec_spec", "crc32", "seed", "count", "index_bits", "indices", "values", "scales")
    class Storage(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
        __slots__ = ()
        STORAGE_UNSPECIFIED: _ClassVar[TensorEnvelope.Storage]
        RAW: _ClassVar[TensorEnvelope.Storage]
        ZSTD: _ClassVar[TensorEnvelope.Storage]
    STORAGE_UNSPECIFIED: TensorEnvelope.Storage
    RAW: TensorEnvelope.Storage
    ZSTD: TensorEnvelope.Storage
    class Section(_message.Message):
        __slots__ = ("storage", "raw_size", "data")
        STORAGE_FIELD_NUMBER: _ClassVar[int]
        RAW_SIZE_FIELD_NUMBER: _ClassVar[int]
        DATA_FIELD_NUMBER: _ClassVar[int]
        storage: TensorEnvelope.Storage
        raw_size: int
        data: bytes
        def __init__(self, storage: _Optional[_Union[TensorEnvelope.Storage, str]] = ..., raw_size: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...
    FORMAT_VERSION_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    CODEC_SPEC_FIELD_NUMBER: _ClassVar[int]
    CRC32_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    INDEX_BITS_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    VALUES_FIELD_NUMBER: _ClassVar[int]
    SCALES_FIELD_NUMBER: _ClassVar[int]
    format_version: int
    shape: _containers.RepeatedScalarFieldContainer[int]
    dtype: DType
    codec_spec: str
    crc32: int
    seed: int
    count: int
    index_bits: int
    indices: TensorEnvelope.Section
    values: TensorEnvelope.Section
    scales: TensorEnvelope.Section
    def __init__(self, format_version: _Optional[int] = ..., shape: _Optional[_Iterable[int]] = ..., dtype: _Optional[_Union[DType, str]] = ..., codec_spec: _Optional[str] = ..., crc32: _Optional[int] = ..., seed: _Optional[int] = ..., count: _Optional[int] = ..., index_bits: _Optional[int] = ..., indices: _Optional[_Union[TensorEnvelope.Section, _Mapping]] = ..., values: _Optional[_Union[TensorEnvelope.Section, _Mapping]] = ..., scales: _Optional[_Union[TensorEnvelope.Section, _Mapping]] = ...) -> None: ...
