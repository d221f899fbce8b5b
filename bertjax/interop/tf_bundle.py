"""TensorFlow's checkpoint format (a "tensor bundle"), read and written without TensorFlow.

A checkpoint with prefix `P` is `P.index` plus `P.data-0000i-of-0000n`. The index is a
LevelDB-style sorted table (uncompressed blocks, each followed by a type byte and a masked
crc32c) mapping "" to a BundleHeaderProto and each tensor name to a BundleEntryProto (dtype,
shape, data shard, byte offset, byte size, masked crc32c of the bytes). The data files hold
the raw little-endian tensor bytes. Every block checksum and every tensor checksum is checked.
"""

from __future__ import annotations

import dataclasses
import os
import re
import struct

import google_crc32c
import ml_dtypes
import numpy as np

from bertjax.errors import UserError
from bertjax.runtime import files

TABLE_MAGIC = 0xDB4775248B80FB57
FOOTER_SIZE = 48  # two block handles padded to 40 bytes, then the 8-byte magic
BLOCK_TRAILER_SIZE = 5  # compression type byte + masked crc32c
NO_COMPRESSION = 0
# TensorFlow DataType enum values (types.proto) of the plain-bytes dtypes.
DTYPES = {
    1: np.dtype(np.float32),
    2: np.dtype(np.float64),
    3: np.dtype(np.int32),
    4: np.dtype(np.uint8),
    5: np.dtype(np.int16),
    6: np.dtype(np.int8),
    9: np.dtype(np.int64),
    10: np.dtype(np.bool_),
    14: np.dtype(ml_dtypes.bfloat16),
    17: np.dtype(np.uint16),
    19: np.dtype(np.float16),
    22: np.dtype(np.uint32),
    23: np.dtype(np.uint64),
}
DTYPE_ENUMS = {dtype: enum for enum, dtype in DTYPES.items()}
DT_STRING = 7


class CheckpointFormatError(UserError, ValueError):
    """A TF checkpoint file is missing, truncated, corrupt or of an unsupported kind."""


@dataclasses.dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives, from its BundleEntryProto; `dtype` is None if unsupported."""

    name: str
    dtype: np.dtype | None
    dtype_enum: int
    shape: tuple[int, ...]
    shard_id: int
    offset: int
    size: int
    crc32c: int  # masked, as stored


# ---------------------------------------------------------------------------
# Checksums and protobuf wire format (only what the two protos need).


def masked_crc32c(data: bytes) -> int:
    """LevelDB/TF's masked crc32c: rotate right by 15 bits and add a constant."""
    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(data):
            raise CheckpointFormatError("varint runs past the end of its buffer")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if byte < 0x80:
            return result, pos
        shift += 7


def _encode_varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _proto_fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """`(field_number, value)` pairs: ints for varint/fixed fields, bytes for messages."""
    fields: list[tuple[int, int | bytes]] = []
    pos = 0
    while pos < len(data):
        key, pos = _varint(data, pos)
        number, wire_type = key >> 3, key & 7
        value: int | bytes
        if wire_type == 0:
            value, pos = _varint(data, pos)
        elif wire_type == 1:
            value, pos = struct.unpack_from("<Q", data, pos)[0], pos + 8
        elif wire_type == 2:
            length, pos = _varint(data, pos)
            value, pos = data[pos : pos + length], pos + length
        elif wire_type == 5:
            value, pos = struct.unpack_from("<I", data, pos)[0], pos + 4
        else:
            raise CheckpointFormatError(f"unsupported protobuf wire type {wire_type}")
        fields.append((number, value))
    return fields


def _field(number: int, value: int | bytes, fixed32: bool = False) -> bytes:
    """One protobuf field; zero integers are left out, as proto3 serialises them."""
    if isinstance(value, bytes):
        return _encode_varint(number << 3 | 2) + _encode_varint(len(value)) + value
    if value == 0:
        return b""
    if fixed32:
        return _encode_varint(number << 3 | 5) + struct.pack("<I", value)
    return _encode_varint(number << 3) + _encode_varint(value)


def _integer(value: int | bytes, where: str) -> int:
    """A varint or fixed protobuf field's value (a message there: CheckpointFormatError)."""
    if isinstance(value, bytes):
        raise CheckpointFormatError(f"{where}: a message where the index holds a number")
    return value


def _message(value: int | bytes, where: str) -> bytes:
    """A length-delimited protobuf field's bytes (a number there: CheckpointFormatError)."""
    if not isinstance(value, bytes):
        raise CheckpointFormatError(f"{where}: a number where the index holds a message")
    return value


def _parse_entry(name: str, data: bytes) -> TensorEntry:
    values = {"dtype": 0, "shard_id": 0, "offset": 0, "size": 0, "crc32c": 0}
    names = {1: "dtype", 3: "shard_id", 4: "offset", 5: "size", 6: "crc32c"}
    shape_field, where = b"", f"tensor {name!r}"
    for number, value in _proto_fields(data):
        if number == 7:
            raise CheckpointFormatError(
                f"tensor {name!r} is stored in slices (partitioned "
                "variable); only whole tensors are supported"
            )
        if number == 2:
            shape_field = _message(value, where)
        elif number in names:
            values[names[number]] = _integer(value, where)
    shape = []
    for number, dim in _proto_fields(shape_field):
        if number == 2:
            shape.append(_integer(dict(_proto_fields(_message(dim, where))).get(1, 0), where))
    return TensorEntry(
        name,
        DTYPES.get(values["dtype"]),
        values["dtype"],
        tuple(shape),
        values["shard_id"],
        values["offset"],
        values["size"],
        values["crc32c"],
    )


def _encode_entry(entry: TensorEntry) -> bytes:
    dims = b"".join(_field(2, _field(1, d)) for d in entry.shape)
    return (
        _field(1, entry.dtype_enum)
        + _field(2, dims)
        + _field(3, entry.shard_id)
        + _field(4, entry.offset)
        + _field(5, entry.size)
        + _field(6, entry.crc32c, True)
    )


# BundleHeaderProto: one shard, little-endian (0, left out), version {producer: 1}.
ONE_SHARD_HEADER = _field(1, 1) + _field(3, _field(1, 1))


# ---------------------------------------------------------------------------
# The sorted table (.index).


def _read_block(table: bytes, offset: int, size: int, path: str) -> bytes:
    end = offset + size + BLOCK_TRAILER_SIZE
    if end > len(table):
        raise CheckpointFormatError(
            f"{path} is truncated: a block ends at byte {end}, the file has {len(table)}"
        )
    contents, kind = table[offset : offset + size], table[offset + size]
    (stored_crc,) = struct.unpack_from("<I", table, offset + size + 1)
    if masked_crc32c(table[offset : offset + size + 1]) != stored_crc:
        raise CheckpointFormatError(
            f"{path} is corrupt: checksum mismatch in the block at byte {offset}"
        )
    if kind != NO_COMPRESSION:
        raise CheckpointFormatError(
            f"{path}: compressed index blocks (type {kind}) are not supported"
        )
    return contents


def _block_entries(block: bytes) -> list[tuple[bytes, bytes]]:
    """The `(key, value)` pairs of one block (keys are prefix-compressed)."""
    (num_restarts,) = struct.unpack_from("<I", block, len(block) - 4)
    limit = len(block) - 4 * (num_restarts + 1)
    entries, key, pos = [], b"", 0
    while pos < limit:
        shared, pos = _varint(block, pos)
        unshared, pos = _varint(block, pos)
        value_length, pos = _varint(block, pos)
        key = key[:shared] + block[pos : pos + unshared]
        pos += unshared
        entries.append((key, block[pos : pos + value_length]))
        pos += value_length
    return entries


def _read_table(path: str) -> list[tuple[bytes, bytes]]:
    try:
        with open(path, "rb") as f:
            table = f.read()
    except OSError as e:
        raise CheckpointFormatError(
            f"cannot read TF checkpoint index {path}: {e.strerror}"
        ) from None
    magic = struct.unpack_from("<Q", table, len(table) - 8)[0] if len(table) >= 8 else None
    if len(table) < FOOTER_SIZE or magic != TABLE_MAGIC:
        raise CheckpointFormatError(
            f"{path} is not a TF checkpoint index (truncated or another format: no table footer)"
        )
    footer = table[-FOOTER_SIZE:]
    _, pos = _varint(footer, _varint(footer, 0)[1])  # skip the metaindex handle
    index_offset, pos = _varint(footer, pos)
    index_size, _ = _varint(footer, pos)
    entries = []
    for _, handle in _block_entries(_read_block(table, index_offset, index_size, path)):
        offset, pos = _varint(handle, 0)
        size, _ = _varint(handle, pos)
        entries.extend(_block_entries(_read_block(table, offset, size, path)))
    return entries


def _block(entries: list[tuple[bytes, bytes]]) -> bytes:
    """A block without prefix compression (every entry a restart point): valid and simple."""
    body, restarts = bytearray(), []
    for key, value in entries:
        restarts.append(len(body))
        body += _encode_varint(0) + _encode_varint(len(key)) + _encode_varint(len(value))
        body += key + value
    restarts = restarts or [0]
    return bytes(body) + struct.pack(f"<{len(restarts) + 1}I", *restarts, len(restarts))


def _table(entries: list[tuple[bytes, bytes]]) -> bytes:
    """A whole table: one data block, an empty metaindex block, the index block, the footer."""
    out = bytearray()

    def append_block(contents: bytes) -> bytes:
        handle = _encode_varint(len(out)) + _encode_varint(len(contents))
        out.extend(contents + bytes([NO_COMPRESSION]))
        out.extend(struct.pack("<I", masked_crc32c(contents + bytes([NO_COMPRESSION]))))
        return handle

    data_handle = append_block(_block(entries))
    metaindex_handle = append_block(_block([]))
    index_handle = append_block(_block([(entries[-1][0], data_handle)]))
    handles = metaindex_handle + index_handle
    out.extend(handles + bytes(40 - len(handles)) + struct.pack("<Q", TABLE_MAGIC))
    return bytes(out)


# ---------------------------------------------------------------------------
# Public API.


def data_file(prefix: str, shard_id: int, num_shards: int) -> str:
    return f"{prefix}.data-{shard_id:05d}-of-{num_shards:05d}"


def resolve_prefix(path: str) -> str:
    """The checkpoint prefix for a prefix, an `.index` file, or a directory (its TF
    `checkpoint` file's latest checkpoint, else its only `*.index`); local or a URL."""
    if path.endswith(".index"):
        return path[: -len(".index")]
    if not files.isdir(path):
        return path
    state_file = os.path.join(path, "checkpoint")
    if files.isfile(state_file):
        with files.open(state_file, encoding="utf-8") as f:
            match = re.search(r'^model_checkpoint_path:\s*"(.*)"', f.read(), re.MULTILINE)
        if match:
            return os.path.join(path, match.group(1))
    indexes = files.glob(os.path.join(path, "*.index"))
    if len(indexes) != 1:
        found = ", ".join(os.path.basename(i) for i in indexes) or "none"
        raise CheckpointFormatError(
            f"{path}: expected exactly one TF checkpoint (*.index), found "
            f"{found}; pass the checkpoint prefix, e.g. "
            f"{path}/model.ckpt-N"
        )
    return indexes[0][: -len(".index")]


class BundleReader:
    """The index of a TF checkpoint; `read(name)` loads and checks one tensor."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix
        self.index_path = prefix + ".index"
        self.num_shards = 1
        self.entries: dict[str, TensorEntry] = {}
        for key, value in _read_table(self.index_path):
            if key == b"":
                header = dict(_proto_fields(value))
                self.num_shards = _integer(header.get(1, 1), self.index_path)
                if header.get(2, 0) != 0:
                    raise CheckpointFormatError(
                        f"{self.index_path}: big-endian checkpoints are not supported"
                    )
            else:
                name = key.decode("utf-8")
                self.entries[name] = _parse_entry(name, value)

    def read(self, name: str) -> np.ndarray:
        """The tensor `name` (read-only); raises CheckpointFormatError if its file is missing,
        truncated or its bytes fail the checksum."""
        entry = self.entries[name]
        if entry.dtype is None:
            raise CheckpointFormatError(
                f"{self.index_path}: tensor {name!r} has dtype enum "
                f"{entry.dtype_enum}, which is not supported"
            )
        path = data_file(self.prefix, entry.shard_id, self.num_shards)
        try:
            with open(path, "rb") as f:
                f.seek(entry.offset)
                buffer = f.read(entry.size)
        except OSError as e:
            raise CheckpointFormatError(
                f"cannot read TF checkpoint data {path}: {e.strerror}; the .index and its "
                ".data-* files must stay together"
            ) from None
        if len(buffer) != entry.size:
            raise CheckpointFormatError(
                f"{path} is truncated: tensor {name!r} needs bytes {entry.offset}..."
                f"{entry.offset + entry.size}, the file ends at {entry.offset + len(buffer)}"
            )
        if masked_crc32c(buffer) != entry.crc32c:
            raise CheckpointFormatError(f"{path} is corrupt: checksum mismatch for tensor {name!r}")
        expected = int(np.prod(entry.shape)) * entry.dtype.itemsize
        if entry.size != expected:
            raise CheckpointFormatError(
                f"{self.index_path}: tensor {name!r} has {entry.size} "
                f"bytes, its shape {entry.shape} needs {expected}"
            )
        return np.frombuffer(buffer, dtype=entry.dtype).reshape(entry.shape)


def write_bundle(prefix: str, tensors: dict[str, np.ndarray]) -> None:
    """Writes `tensors` as a one-shard TF checkpoint (what `tf.train.Saver` would write)."""
    entries, offset = [], 0
    os.makedirs(os.path.dirname(os.path.abspath(prefix)), exist_ok=True)
    with open(data_file(prefix, 0, 1), "wb") as f:
        for name in sorted(tensors):
            array = np.asarray(tensors[name])
            if array.dtype not in DTYPE_ENUMS:
                raise ValueError(f"tensor {name!r}: dtype {array.dtype} cannot be written")
            data = array.astype(array.dtype.newbyteorder("<"), copy=False).tobytes()
            f.write(data)
            entry = TensorEntry(
                name,
                array.dtype,
                DTYPE_ENUMS[array.dtype],
                array.shape,
                0,
                offset,
                len(data),
                masked_crc32c(data),
            )
            entries.append((name.encode("utf-8"), _encode_entry(entry)))
            offset += len(data)
    with open(prefix + ".index", "wb") as f:
        f.write(_table([(b"", ONE_SHARD_HEADER), *entries]))
