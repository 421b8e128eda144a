"""The page-carrying messages of hicache.v1.KVStore, encoded and decoded by hand.

`BatchGetResponse` and `BatchPutRequest` (proto/kvstore.proto) carry pages as `Piece`s. The
generated protobuf classes would copy every page several times on the way in and out
(docs/performance.md); this module writes the same protobuf wire format with
one `b"".join` of the caller's buffers, and reads it back as memoryviews into the received
message, without copying a page; `ObjectAssembly` puts a stream's pieces back into objects.
Tests check both directions against the generated classes.

Decoding follows protobuf's rules (any field order, unknown fields skipped, the last value of a
scalar wins, packed or unpacked repeated integers), and names what is wrong in a `WireError`
on any input: the daemon decodes what strangers send it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import NamedTuple

from .buffers import Buffer
from .objects import (
    HEADER_FIXED_BYTES,
    MAC_BYTES,
    MAX_LAYOUT_BYTES,
    MAX_PAYLOAD_BYTES,
    CorruptReason,
)

_VARINT, _I64, _LEN, _I32 = 0, 1, 2, 5
_MAX_VARINT_BYTES = 10
_UINT32_MAX = (1 << 32) - 1
_UINT64_MAX = (1 << 64) - 1
# The largest object a page can be: a longer one is refused before any of it is kept.
MAX_OBJECT_BYTES = HEADER_FIXED_BYTES + MAX_LAYOUT_BYTES + MAC_BYTES + MAX_PAYLOAD_BYTES

# Piece fields
_INDEX, _KEY, _OBJECT_BYTES, _OFFSET, _DATA = 1, 2, 3, 4, 5
# BatchGetResponse fields
_GET_PIECES, _GET_MISSING = 1, 2
# BatchPutRequest fields
_PUT_NAMESPACE, _PUT_PIECES = 1, 2


class WireError(ValueError):
    """A message that is not valid protobuf, or not the message it claims to be."""


class Piece(NamedTuple):
    """Bytes [offset, offset + len(data)) of the object of page `index`."""

    index: int
    key: bytes
    object_bytes: int
    offset: int
    data: memoryview


class OutPiece(NamedTuple):
    """A piece to send; `parts` are concatenated on the wire (a header and a page slice)."""

    index: int
    key: bytes
    object_bytes: int
    offset: int
    parts: Sequence[Buffer]

    @property
    def nbytes(self) -> int:
        return sum(len(part) for part in self.parts)


# -- encoding --------------------------------------------------------------------------------


def _varint(value: int) -> bytes:
    if value < 0x80:
        return bytes((value,))
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _tag(field: int, wire_type: int) -> bytes:
    return _varint(field << 3 | wire_type)


_TAGS = {
    "index": _tag(_INDEX, _VARINT),
    "key": _tag(_KEY, _LEN),
    "object_bytes": _tag(_OBJECT_BYTES, _VARINT),
    "offset": _tag(_OFFSET, _VARINT),
    "data": _tag(_DATA, _LEN),
    "get_pieces": _tag(_GET_PIECES, _LEN),
    "get_missing": _tag(_GET_MISSING, _LEN),
    "put_namespace": _tag(_PUT_NAMESPACE, _LEN),
    "put_pieces": _tag(_PUT_PIECES, _LEN),
}

# Bytes a piece adds to its data on the wire, at most: tags, varints, the key.
PIECE_OVERHEAD_BYTES = 72  # 1 + 10 (field, length) + 6 + 18 + 11 + 11 + 11 (data tag, length)


def _piece_parts(piece: OutPiece, out: list[Buffer]) -> None:
    """Append the wire form of `piece`, as a field of its message, to `out`."""
    data_bytes = piece.nbytes
    head = [_TAGS["index"], _varint(piece.index)] if piece.index else []
    head += [_TAGS["key"], _varint(len(piece.key)), piece.key]
    head += [_TAGS["object_bytes"], _varint(piece.object_bytes)]
    if piece.offset:
        head += [_TAGS["offset"], _varint(piece.offset)]
    head += [_TAGS["data"], _varint(data_bytes)]
    fields = b"".join(head)
    out.append(_varint(len(fields) + data_bytes))
    out.append(fields)
    out.extend(piece.parts)


def encode_get_response(pieces: Iterable[OutPiece], missing: Sequence[int] = ()) -> bytes:
    """A `BatchGetResponse` holding `pieces`, and the indices of `missing` keys."""
    out: list[Buffer] = []
    for piece in pieces:
        out.append(_TAGS["get_pieces"])
        _piece_parts(piece, out)
    if missing:
        packed = b"".join(_varint(index) for index in missing)
        out += [_TAGS["get_missing"], _varint(len(packed)), packed]
    return b"".join(out)


def encode_put_request(namespace: str, pieces: Iterable[OutPiece]) -> bytes:
    """A `BatchPutRequest` for `namespace` (may be "" after the first message)."""
    out: list[Buffer] = []
    if namespace:
        name = namespace.encode()
        out += [_TAGS["put_namespace"], _varint(len(name)), name]
    for piece in pieces:
        out.append(_TAGS["put_pieces"])
        _piece_parts(piece, out)
    return b"".join(out)


# -- decoding --------------------------------------------------------------------------------


def _read_varint(buf: memoryview, pos: int, end: int) -> tuple[int, int]:
    value = shift = 0
    for i in range(pos, min(end, pos + _MAX_VARINT_BYTES)):
        byte = buf[i]
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            if value > _UINT64_MAX:
                raise WireError(f"varint at byte {pos} overflows 64 bits")
            return value, i + 1
        shift += 7
    if end - pos >= _MAX_VARINT_BYTES:
        raise WireError(f"varint at byte {pos} is longer than {_MAX_VARINT_BYTES} bytes")
    raise WireError(f"truncated varint at byte {pos}")


def _fields(buf: memoryview, start: int, end: int, what: str):
    """Yield (field number, wire type, value, value start) of the message in buf[start:end].

    `value` is an int for varint, fixed64 and fixed32 fields, or a memoryview for
    length-delimited fields.
    """
    pos = start
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise WireError(f"{what}: field number 0 at byte {pos}")
        value_at = pos
        if wire_type == _VARINT:
            value, pos = _read_varint(buf, pos, end)
        elif wire_type == _LEN:
            length, pos = _read_varint(buf, pos, end)
            if length > end - pos:
                raise WireError(
                    f"{what}: field {field} claims {length} bytes, only {end - pos} remain"
                )
            value, pos = buf[pos : pos + length], pos + length
        elif wire_type in (_I64, _I32):
            width = 8 if wire_type == _I64 else 4
            if width > end - pos:
                raise WireError(f"{what}: truncated fixed-width field {field}")
            value, pos = int.from_bytes(buf[pos : pos + width], "little"), pos + width
        else:  # groups (3, 4) and the undefined wire types 6, 7
            raise WireError(f"{what}: field {field} has unsupported wire type {wire_type}")
        yield field, wire_type, value, value_at


def _expect(field: int, wire_type: int, wanted: int, what: str) -> None:
    if wire_type != wanted:
        raise WireError(f"{what}: field {field} has wire type {wire_type}, expected {wanted}")


def _uint32(value: int, name: str, what: str) -> int:
    value &= _UINT64_MAX
    if value > _UINT32_MAX:  # protobuf truncates; a sender that does this is broken
        raise WireError(f"{what}: {name} {value} does not fit uint32")
    return value


def _decode_piece(view: memoryview, what: str) -> Piece:
    index = object_bytes = offset = 0
    key = b""
    data = view[0:0]
    for field, wire_type, value, _ in _fields(view, 0, len(view), what):
        if field == _INDEX:
            _expect(field, wire_type, _VARINT, what)
            index = _uint32(value, "index", what)
        elif field == _KEY:
            _expect(field, wire_type, _LEN, what)
            key = bytes(value)
        elif field == _OBJECT_BYTES:
            _expect(field, wire_type, _VARINT, what)
            object_bytes = value
        elif field == _OFFSET:
            _expect(field, wire_type, _VARINT, what)
            offset = value
        elif field == _DATA:
            _expect(field, wire_type, _LEN, what)
            data = value
    return Piece(index, key, object_bytes, offset, data)


def _packed_uint32(field: int, wire_type: int, value, what: str) -> list[int]:
    if wire_type == _VARINT:
        return [_uint32(value, "missing index", what)]
    _expect(field, wire_type, _LEN, what)
    out, pos = [], 0
    while pos < len(value):
        item, pos = _read_varint(value, pos, len(value))
        out.append(_uint32(item, "missing index", what))
    return out


def decode_get_response(message: Buffer) -> tuple[list[Piece], list[int]]:
    """(pieces, missing indices) of a `BatchGetResponse`; data are views into `message`."""
    view = memoryview(message).cast("B")
    pieces: list[Piece] = []
    missing: list[int] = []
    for field, wire_type, value, at in _fields(view, 0, len(view), "BatchGetResponse"):
        if field == _GET_PIECES:
            _expect(field, wire_type, _LEN, "BatchGetResponse")
            pieces.append(_decode_piece(value, f"BatchGetResponse piece at byte {at}"))
        elif field == _GET_MISSING:
            missing += _packed_uint32(field, wire_type, value, "BatchGetResponse")
    return pieces, missing


def decode_put_request(message: Buffer) -> tuple[str, list[Piece]]:
    """(namespace, pieces) of a `BatchPutRequest`; data are views into `message`."""
    view = memoryview(message).cast("B")
    namespace = ""
    pieces: list[Piece] = []
    for field, wire_type, value, at in _fields(view, 0, len(view), "BatchPutRequest"):
        if field == _PUT_NAMESPACE:
            _expect(field, wire_type, _LEN, "BatchPutRequest")
            try:
                namespace = bytes(value).decode()
            except UnicodeDecodeError:
                raise WireError("BatchPutRequest: namespace is not valid UTF-8") from None
        elif field == _PUT_PIECES:
            _expect(field, wire_type, _LEN, "BatchPutRequest")
            pieces.append(_decode_piece(value, f"BatchPutRequest piece at byte {at}"))
    return namespace, pieces


# -- putting objects back together --------------------------------------------------------


class ObjectAssembly:
    """Puts the pieces of one BatchGet stream back into objects, in arrival order.

    `on_object(index, item)` is called once per key the stream settles: `item` is the object
    (a view into a message, or a list of views when it came in several pieces), None when the
    server says it is missing, or a CorruptReason when its pieces do not add up (a piece for
    another key, out of order, past the object's end, or cut short by the stream's end).
    """

    def __init__(self, keys: Sequence[bytes], on_object: Callable[[int, object], None]) -> None:
        self.keys = keys
        self.on_object = on_object
        self.partial: dict[int, tuple[int, list[memoryview], int]] = {}  # index -> size, parts, got
        self.finished: set[int] = set()
        self.started = False

    def add(self, message: bytes) -> None:
        self.started = True
        pieces, missing = decode_get_response(message)
        for index in missing:
            if index < len(self.keys):
                self._finish(index, None)
        for piece in pieces:
            self._add_piece(piece)

    def _add_piece(self, piece: Piece) -> None:
        index = piece.index
        if index >= len(self.keys) or index in self.finished:
            return  # not a key of ours, or already settled: ignore, never misplace
        if piece.key != self.keys[index]:
            self._finish(index, CorruptReason.KEY)
            return
        size, parts, got = self.partial.get(index, (piece.object_bytes, [], 0))
        if size > MAX_OBJECT_BYTES:  # the sender's word, bounded before we hold pieces for it
            self._finish(index, CorruptReason.LENGTH)
            return
        if piece.object_bytes != size or piece.offset != got or got + len(piece.data) > size:
            self._finish(index, CorruptReason.LENGTH)
            return
        parts.append(piece.data)
        got += len(piece.data)
        if got == size:
            self._finish(index, parts if len(parts) > 1 else parts[0])
        else:
            self.partial[index] = (size, parts, got)

    def _finish(self, index: int, item: object) -> None:
        if index in self.finished:
            return
        self.finished.add(index)
        self.partial.pop(index, None)
        self.on_object(index, item)

    def finish(self) -> None:
        """The stream ended: objects still incomplete are truncated."""
        for index in list(self.partial):
            self._finish(index, CorruptReason.TRUNCATED)


# -- splitting objects into messages -----------------------------------------------------------

_MESSAGE_SLACK_BYTES = 64  # a message's own fields besides its pieces (the namespace)
_MIN_SPLIT_BYTES = 64 << 10  # never start an object in a message with less room than this


def split_into_messages(
    objects: Sequence[tuple[int, bytes, Sequence[Buffer]]], max_message_bytes: int
) -> Iterator[list[OutPiece]]:
    """Group objects `(index, key, parts)` into messages of at most `max_message_bytes` on the
    wire, each message a list of pieces. An object that fits a message travels whole; a larger
    one is cut into consecutive pieces.

    The objects are spread evenly over the fewest messages the limit allows: a message is
    closed once it holds its share of the whole. 32 pages of 256 KiB under a 4 MiB limit go
    as 11 + 11 + 10 pages, not 15 + 15 + 2: the receiver gets to work on the first message
    sooner, and no message is sent for a stray tail.
    """
    capacity = max_message_bytes - _MESSAGE_SLACK_BYTES
    if capacity - PIECE_OVERHEAD_BYTES < 1024:
        raise ValueError(f"max_message_bytes={max_message_bytes} is too small to carry pages")
    sizes = [sum(len(part) for part in parts) for _, _, parts in objects]
    wire_bytes = sum(sizes) + PIECE_OVERHEAD_BYTES * len(sizes)
    num_messages = max(1, -(-wire_bytes // capacity))  # the fewest that could carry them
    share = -(-wire_bytes // num_messages)  # a message is closed once it holds this much
    batch: list[OutPiece] = []
    used = 0
    for (index, key, parts), object_bytes in zip(objects, sizes, strict=True):
        if batch and used >= share:
            yield batch
            batch, used = [], 0
        offset = 0
        while True:
            room = capacity - used - PIECE_OVERHEAD_BYTES
            remaining = object_bytes - offset
            fits_a_message = remaining <= capacity - PIECE_OVERHEAD_BYTES
            if batch and remaining > room and (fits_a_message or room < _MIN_SPLIT_BYTES):
                yield batch
                batch, used = [], 0
                continue
            take = min(remaining, room)
            piece_parts = _slice(parts, object_bytes, offset, take)
            batch.append(OutPiece(index, key, object_bytes, offset, piece_parts))
            used += take + PIECE_OVERHEAD_BYTES
            offset += take
            if offset >= object_bytes:
                break
    if batch:
        yield batch


def _slice(parts: Sequence[Buffer], total: int, offset: int, length: int) -> Sequence[Buffer]:
    """Bytes [offset, offset + length) of the concatenation of `parts`, as views (no copy)."""
    if offset == 0 and length == total:
        return parts
    out: list[Buffer] = []
    start = 0
    for part in parts:
        end = start + len(part)
        lo, hi = max(offset, start), min(offset + length, end)
        if lo < hi:
            out.append(memoryview(part).cast("B")[lo - start : hi - start])
        start = end
    return out
