from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class PutStatus(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PUT_STATUS_UNSPECIFIED: _ClassVar[PutStatus]
    PUT_STATUS_STORED: _ClassVar[PutStatus]
    PUT_STATUS_REJECTED: _ClassVar[PutStatus]
    PUT_STATUS_CORRUPT: _ClassVar[PutStatus]
    PUT_STATUS_ERROR: _ClassVar[PutStatus]
PUT_STATUS_UNSPECIFIED: PutStatus
PUT_STATUS_STORED: PutStatus
PUT_STATUS_REJECTED: PutStatus
PUT_STATUS_CORRUPT: PutStatus
PUT_STATUS_ERROR: PutStatus

class BatchExistsRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class BatchExistsResponse(_message.Message):
    __slots__ = ("num_present",)
    NUM_PRESENT_FIELD_NUMBER: _ClassVar[int]
    num_present: int
    def __init__(self, num_present: _Optional[int] = ...) -> None: ...

class BatchGetRequest(_message.Message):
    __slots__ = ("namespace", "keys", "max_message_bytes")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    MAX_MESSAGE_BYTES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    max_message_bytes: int
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ..., max_message_bytes: _Optional[int] = ...) -> None: ...

class Piece(_message.Message):
    __slots__ = ("index", "key", "object_bytes", "offset", "data")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    OBJECT_BYTES_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    index: int
    key: bytes
    object_bytes: int
    offset: int
    data: bytes
    def __init__(self, index: _Optional[int] = ..., key: _Optional[bytes] = ..., object_bytes: _Optional[int] = ..., offset: _Optional[int] = ..., data: _Optional[bytes] = ...) -> None: ...

class BatchGetResponse(_message.Message):
    __slots__ = ("pieces", "missing")
    PIECES_FIELD_NUMBER: _ClassVar[int]
    MISSING_FIELD_NUMBER: _ClassVar[int]
    pieces: _containers.RepeatedCompositeFieldContainer[Piece]
    missing: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, pieces: _Optional[_Iterable[_Union[Piece, _Mapping]]] = ..., missing: _Optional[_Iterable[int]] = ...) -> None: ...

class BatchPutRequest(_message.Message):
    __slots__ = ("namespace", "pieces")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    pieces: _containers.RepeatedCompositeFieldContainer[Piece]
    def __init__(self, namespace: _Optional[str] = ..., pieces: _Optional[_Iterable[_Union[Piece, _Mapping]]] = ...) -> None: ...

class BatchPutResponse(_message.Message):
    __slots__ = ("statuses", "reasons")
    STATUSES_FIELD_NUMBER: _ClassVar[int]
    REASONS_FIELD_NUMBER: _ClassVar[int]
    statuses: _containers.RepeatedScalarFieldContainer[PutStatus]
    reasons: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, statuses: _Optional[_Iterable[_Union[PutStatus, str]]] = ..., reasons: _Optional[_Iterable[str]] = ...) -> None: ...

class DeleteRequest(_message.Message):
    __slots__ = ("namespace", "keys")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KEYS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    keys: _containers.RepeatedScalarFieldContainer[bytes]
    def __init__(self, namespace: _Optional[str] = ..., keys: _Optional[_Iterable[bytes]] = ...) -> None: ...

class DeleteResponse(_message.Message):
    __slots__ = ("num_deleted",)
    NUM_DELETED_FIELD_NUMBER: _ClassVar[int]
    num_deleted: int
    def __init__(self, num_deleted: _Optional[int] = ...) -> None: ...

class StatsRequest(_message.Message):
    __slots__ = ("namespace",)
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    def __init__(self, namespace: _Optional[str] = ...) -> None: ...

class NamespaceStats(_message.Message):
    __slots__ = ("name", "num_objects", "stored_bytes", "capacity_bytes", "num_hits", "num_misses", "num_puts", "num_put_rejected", "num_evictions", "num_errors", "num_corrupt", "read_bytes", "written_bytes", "spill_objects", "spill_bytes", "spill_capacity_bytes", "num_spill_corrupt", "num_spill_dropped", "in_flight_bytes", "spilling_bytes")
    class NumCorruptEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class NumSpillCorruptEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    NAME_FIELD_NUMBER: _ClassVar[int]
    NUM_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    STORED_BYTES_FIELD_NUMBER: _ClassVar[int]
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_HITS_FIELD_NUMBER: _ClassVar[int]
    NUM_MISSES_FIELD_NUMBER: _ClassVar[int]
    NUM_PUTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PUT_REJECTED_FIELD_NUMBER: _ClassVar[int]
    NUM_EVICTIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_ERRORS_FIELD_NUMBER: _ClassVar[int]
    NUM_CORRUPT_FIELD_NUMBER: _ClassVar[int]
    READ_BYTES_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPILL_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    SPILL_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPILL_CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    NUM_SPILL_CORRUPT_FIELD_NUMBER: _ClassVar[int]
    NUM_SPILL_DROPPED_FIELD_NUMBER: _ClassVar[int]
    IN_FLIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    SPILLING_BYTES_FIELD_NUMBER: _ClassVar[int]
    name: str
    num_objects: int
    stored_bytes: int
    capacity_bytes: int
    num_hits: int
    num_misses: int
    num_puts: int
    num_put_rejected: int
    num_evictions: int
    num_errors: int
    num_corrupt: _containers.ScalarMap[str, int]
    read_bytes: int
    written_bytes: int
    spill_objects: int
    spill_bytes: int
    spill_capacity_bytes: int
    num_spill_corrupt: _containers.ScalarMap[str, int]
    num_spill_dropped: int
    in_flight_bytes: int
    spilling_bytes: int
    def __init__(self, name: _Optional[str] = ..., num_objects: _Optional[int] = ..., stored_bytes: _Optional[int] = ..., capacity_bytes: _Optional[int] = ..., num_hits: _Optional[int] = ..., num_misses: _Optional[int] = ..., num_puts: _Optional[int] = ..., num_put_rejected: _Optional[int] = ..., num_evictions: _Optional[int] = ..., num_errors: _Optional[int] = ..., num_corrupt: _Optional[_Mapping[str, int]] = ..., read_bytes: _Optional[int] = ..., written_bytes: _Optional[int] = ..., spill_objects: _Optional[int] = ..., spill_bytes: _Optional[int] = ..., spill_capacity_bytes: _Optional[int] = ..., num_spill_corrupt: _Optional[_Mapping[str, int]] = ..., num_spill_dropped: _Optional[int] = ..., in_flight_bytes: _Optional[int] = ..., spilling_bytes: _Optional[int] = ...) -> None: ...

class StatsResponse(_message.Message):
    __slots__ = ("version", "uptime_s", "spill_mode", "namespaces")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    UPTIME_S_FIELD_NUMBER: _ClassVar[int]
    SPILL_MODE_FIELD_NUMBER: _ClassVar[int]
    NAMESPACES_FIELD_NUMBER: _ClassVar[int]
    version: str
    uptime_s: float
    spill_mode: str
    namespaces: _containers.RepeatedCompositeFieldContainer[NamespaceStats]
    def __init__(self, version: _Optional[str] = ..., uptime_s: _Optional[float] = ..., spill_mode: _Optional[str] = ..., namespaces: _Optional[_Iterable[_Union[NamespaceStats, _Mapping]]] = ...) -> None: ...
