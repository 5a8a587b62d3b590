"""Request traces: the Mooncake JSONL and Azure 2023 CSV formats, and the prompts they imply.

A Mooncake trace names each 512-token block of a prompt by a hash id; equal ids mean equal
blocks. The tokens of a block are made up deterministically from its id, as printable ASCII, so
that the byte-level tokenizer maps the prompt's text back to the very same tokens in live mode.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Literal, overload

from schemas.block_hash import ROOT_HASH, hash_block

TraceFormat = Literal["mooncake", "azure"]
TRACE_BLOCK_SIZE = 512
# 64 printable characters: a token never is a control byte or a multi-byte UTF-8 sequence.
_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789 .,;"[:64]
_TO_ALPHABET = bytes(_ALPHABET[b % 64] for b in range(256))


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    # Mooncake: ids of the prompt's 512-token blocks. Empty: a prompt shared with nobody.
    hash_ids: tuple[int, ...]
    index: int


def block_tokens(hash_id: int, length: int = TRACE_BLOCK_SIZE) -> bytes:
    """The first ``length`` tokens of the trace block ``hash_id`` (as bytes, one per token)."""
    out = bytearray()
    counter = 0
    while len(out) < length:
        seed = hash_id.to_bytes(8, "little", signed=True) + counter.to_bytes(4, "little")
        out += hashlib.blake2b(seed, digest_size=64).digest()
        counter += 1
    return bytes(out[:length]).translate(_TO_ALPHABET)


class SyntheticPrompt(Sequence[int]):
    """A prompt made of trace blocks, materialized only where the engine looks at it, optionally
    followed by ``tail`` tokens (a prefill worker's first token, when a decode worker resumes)."""

    __slots__ = ("_ids", "_length", "_tail")

    def __init__(self, hash_ids: tuple[int, ...], length: int, tail: tuple[int, ...] = ()) -> None:
        self._ids = hash_ids
        self._length = length
        self._tail = tail

    def __len__(self) -> int:
        return self._length + len(self._tail)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...

    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        if isinstance(index, int):
            if index < 0:
                index += len(self)
            if not 0 <= index < len(self):
                raise IndexError(index)
            if index >= self._length:
                return self._tail[index - self._length]
            block = block_tokens(self._ids[index // TRACE_BLOCK_SIZE])
            return block[index % TRACE_BLOCK_SIZE]
        start, stop, step = index.indices(len(self))
        if step != 1:
            return list(self)[index]
        head = self._blocks(start, min(stop, self._length)) if start < self._length else b""
        if stop <= self._length:
            return head
        return [*head, *self._tail[max(0, start - self._length) : stop - self._length]]

    def _blocks(self, start: int, stop: int) -> bytes:
        out = bytearray()
        for k in range(start // TRACE_BLOCK_SIZE, -(-stop // TRACE_BLOCK_SIZE)):
            out += block_tokens(self._ids[k])
        skip = start - (start // TRACE_BLOCK_SIZE) * TRACE_BLOCK_SIZE
        return bytes(out[skip : skip + stop - start])

    def tokens(self) -> bytes:
        """The trace prompt itself (without any tail), one byte per token."""
        return self._blocks(0, self._length)

    def text(self) -> str:
        return self.tokens().decode("ascii")


class PromptFactory:
    """Prompts and their chained block hashes for trace requests, at one engine block size.

    Hashes are memoized per (parent, trace block): conversations repeat their history, and
    a trace block's sub-blocks hash the same wherever the same prefix precedes them.
    """

    def __init__(self, block_size: int) -> None:
        if TRACE_BLOCK_SIZE % block_size:
            raise ValueError(f"block size {block_size} must divide {TRACE_BLOCK_SIZE}")
        self.block_size = block_size
        self._memo: dict[tuple[int, int], tuple[int, ...]] = {}

    def ids_for(self, request: TraceRequest) -> tuple[int, ...]:
        if request.hash_ids:
            return request.hash_ids
        # No sharing information: ids nobody else uses (negative, unlike Mooncake's).
        blocks = -(-request.input_length // TRACE_BLOCK_SIZE)
        return tuple(-(request.index * 1024 + k + 1) for k in range(blocks))

    def prompt(self, request: TraceRequest, tail: tuple[int, ...] = ()) -> SyntheticPrompt:
        return SyntheticPrompt(self.ids_for(request), request.input_length, tail)

    def block_hashes(self, request: TraceRequest) -> tuple[int, ...]:
        ids = self.ids_for(request)
        full_blocks = request.input_length // self.block_size
        hashes: list[int] = []
        parent = ROOT_HASH
        for hash_id in ids:
            if len(hashes) >= full_blocks:
                break
            key = (parent, hash_id)
            subs = self._memo.get(key)
            if subs is None:
                subs = self._sub_hashes(parent, hash_id)
                self._memo[key] = subs
            hashes.extend(subs)
            parent = subs[-1]
        return tuple(hashes[:full_blocks])

    def _sub_hashes(self, parent: int, hash_id: int) -> tuple[int, ...]:
        tokens = block_tokens(hash_id)
        size = self.block_size
        out = []
        for start in range(0, TRACE_BLOCK_SIZE, size):
            parent = hash_block(parent, tokens[start : start + size])
            out.append(parent)
        return tuple(out)


def detect_format(path: Path) -> TraceFormat:
    return "azure" if path.suffix.lower() == ".csv" else "mooncake"


def load_trace(
    path: Path, fmt: TraceFormat | None = None, speedup: float = 1.0, limit: int | None = None
) -> list[TraceRequest]:
    """Requests in arrival order; ``speedup`` divides the gaps between arrivals."""
    fmt = fmt or detect_format(path)
    rows = _mooncake(path) if fmt == "mooncake" else _azure(path)
    requests: list[TraceRequest] = []
    for i, (arrival, inp, out, ids) in enumerate(rows):
        if limit is not None and i >= limit:
            break
        requests.append(TraceRequest(arrival / speedup, inp, max(1, out), ids, i))
    if not requests:
        raise ValueError(f"{path} holds no requests")
    start = requests[0].arrival_s
    return [
        TraceRequest(r.arrival_s - start, r.input_length, r.output_length, r.hash_ids, r.index)
        for r in requests
    ]


Row = tuple[float, int, int, tuple[int, ...]]


def _mooncake(path: Path) -> Iterator[Row]:
    with path.open() as lines:
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                yield (
                    float(row["timestamp"]) / 1000.0,
                    int(row["input_length"]),
                    int(row["output_length"]),
                    tuple(int(h) for h in row.get("hash_ids", ())),
                )
            except (KeyError, ValueError, TypeError) as err:
                raise ValueError(f"{path}:{n}: not a Mooncake trace line ({err})") from None


def _azure(path: Path) -> Iterator[Row]:
    with path.open(newline="") as handle:
        for n, row in enumerate(csv.DictReader(handle), 2):
            try:
                stamp = datetime.fromisoformat(row["TIMESTAMP"][:26])
                yield (
                    stamp.timestamp(),
                    int(row["ContextTokens"]),
                    int(row["GeneratedTokens"]),
                    (),
                )
            except (KeyError, ValueError, TypeError) as err:
                raise ValueError(f"{path}:{n}: not an Azure trace row ({err})") from None
