"""The prefix index's snapshot format: a header and packed little-endian uint64 arrays.

    header   magic "LWKI", u16 version, u32 CRC-32 of everything after it
    u64      stream position the snapshot was taken at (opaque to the index)
    workers  u32 count, then each: u32 length, UTF-8 id, i32 slot (-1: none), u64 next seq (0: none)
    groups   u32 count, then each: u32 length, mask bytes, u64 n, n × u64 block hash
    pending  u32 count, then each: u32 worker number, u64 seq, u8 kind, u32 n, n × u64 block hash
             (an event of several changes is one entry per change, in order, under its seq)

Blocks are grouped by the mask of slots holding them, so a block costs its 8-byte hash whatever
the number of workers caching it, and loading a group is one C-level ``dict.fromkeys``. Hashes are
random, so the format is not compressed: zlib would spend time to win nothing.
"""

from __future__ import annotations

import struct
import sys
import zlib
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from services.common.kv_index.changes import Changes

MAGIC = b"LWKI"
# 2: an event's changes may be several entries of one seq; 1 had one each, read the same way.
VERSION = 2
_READABLE = (1, VERSION)
_HEADER = struct.Struct("<4sHI")
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_WORKER = struct.Struct("<iQ")
_PENDING = struct.Struct("<IQBI")
_SWAP = sys.byteorder != "little"


@dataclass
class State:
    position: int
    slots: dict[str, int]
    groups: Mapping[int, Sequence[int]]
    next_seq: dict[str, int]
    pending: dict[str, dict[int, Changes]]


def dump(state: State) -> bytes:
    names = list(dict.fromkeys([*state.slots, *state.next_seq, *state.pending]))
    number = {name: i for i, name in enumerate(names)}
    parts: list[bytes] = [_U64.pack(state.position), _U32.pack(len(names))]
    for name in names:
        encoded = name.encode()
        parts += [
            _U32.pack(len(encoded)),
            encoded,
            _WORKER.pack(state.slots.get(name, -1), state.next_seq.get(name, 0)),
        ]
    parts.append(_U32.pack(len(state.groups)))
    for mask, blocks in state.groups.items():
        encoded = mask.to_bytes((mask.bit_length() + 7) // 8, "little")
        parts += [_U32.pack(len(encoded)), encoded, _U64.pack(len(blocks)), _pack(blocks)]
    entries = [
        (w, seq, change)
        for w, p in state.pending.items()
        for seq, changes in p.items()
        for change in changes
    ]
    parts.append(_U32.pack(len(entries)))
    for name, seq, (kind, blocks) in entries:
        parts += [_PENDING.pack(number[name], seq, kind, len(blocks)), _pack(blocks)]
    body = b"".join(parts)
    return _HEADER.pack(MAGIC, VERSION, zlib.crc32(body)) + body


def load(data: bytes) -> State:
    view = memoryview(data)
    if len(view) < _HEADER.size:
        raise ValueError("not a prefix-index snapshot: too short")
    magic, version, crc = _HEADER.unpack_from(view)
    if magic != MAGIC or version not in _READABLE:
        raise ValueError("not a prefix-index snapshot of version 1 or 2")
    reader = _Reader(view[_HEADER.size :])
    if zlib.crc32(reader.view) != crc:
        raise ValueError("prefix-index snapshot is corrupt (CRC mismatch)")
    state = State(reader.u64(), {}, {}, {}, {})
    names = []
    for _ in range(reader.u32()):
        name = bytes(reader.take(reader.u32())).decode()
        slot, next_seq = reader.unpack(_WORKER)
        names.append(name)
        if slot >= 0:
            state.slots[name] = slot
        if next_seq:
            state.next_seq[name] = next_seq
    groups: dict[int, Sequence[int]] = {}
    for _ in range(reader.u32()):
        mask = int.from_bytes(reader.take(reader.u32()), "little")
        groups[mask] = reader.hashes(reader.u64())
    state.groups = groups
    for _ in range(reader.u32()):
        number, seq, kind, n = reader.unpack(_PENDING)
        pending = state.pending.setdefault(names[number], {})
        pending[seq] = (*pending.get(seq, ()), (kind, tuple(reader.hashes(n))))
    if reader.offset != len(reader.view):
        raise ValueError("prefix-index snapshot has trailing bytes")
    return state


def _pack(blocks: Sequence[int]) -> bytes:
    packed = array("Q", blocks)
    if _SWAP:
        packed.byteswap()
    return packed.tobytes()


class _Reader:
    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.offset = 0

    def take(self, n: int) -> memoryview:
        if self.offset + n > len(self.view):
            raise ValueError("prefix-index snapshot is truncated")
        chunk = self.view[self.offset : self.offset + n]
        self.offset += n
        return chunk

    def unpack(self, fmt: struct.Struct) -> tuple[int, ...]:
        return fmt.unpack(self.take(fmt.size))

    def u32(self) -> int:
        return self.unpack(_U32)[0]

    def u64(self) -> int:
        return self.unpack(_U64)[0]

    def hashes(self, n: int) -> array[int]:
        blocks = array("Q")
        blocks.frombytes(self.take(8 * n))
        if _SWAP:
            blocks.byteswap()
        return blocks
