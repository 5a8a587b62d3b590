"""Request traces: the Mooncake JSONL and Azure 2023 CSV formats, Laneway recordings, and the
prompts they imply.

A Mooncake trace names each 512-token block of a prompt by a hash id; equal ids mean equal
blocks. A recording names each engine block of a prompt by its chained hash, so equal ids there
mean equal prefixes. The tokens of a block are made up deterministically from its id, as
printable ASCII, so that the byte-level tokenizer maps the prompt's text back to the very same
tokens in live mode; a model with a tokenizer of its own takes the same bytes as token ids
(``SyntheticPrompt.token_ids``, ``check_token_ids``).
"""

from __future__ import annotations

import csv
import hashlib
import itertools
import json
import math
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from datetime import datetime
from pathlib import Path
from typing import Literal, overload

from infra.recording import HEADER_KEY, Recorded, RecordingError, read_recording
from schemas.block_hash import chain_block_hashes, salt_root
from schemas.cache_salt import adapter_salt
from schemas.events import RequestAccepted, RequestFinished

TraceFormat = Literal["mooncake", "azure", "recording"]
TRACE_BLOCK_SIZE = 512
# 64 printable characters: a token never is a control byte or a multi-byte UTF-8 sequence.
_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789 .,;"[:64]
_TO_ALPHABET = bytes(_ALPHABET[b % 64] for b in range(256))
# The token ids a prompt is made of, sent as ids: the alphabet's byte values.
PROMPT_TOKEN_IDS = frozenset(_ALPHABET)
_BLOCK_COUNTERS = tuple(c.to_bytes(4, "little") for c in range(TRACE_BLOCK_SIZE // 64))


@dataclass(frozen=True, slots=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    # Ids of the prompt's blocks of ``block_unit`` tokens. Empty: a prompt shared with nobody.
    hash_ids: tuple[int, ...]
    index: int
    # Tokens each hash id names: Mooncake's 512, a recording's engine block size.
    block_unit: int = TRACE_BLOCK_SIZE
    # Its tenant's cache salt (``with_tenants``), as the ingress would give it; None: unsalted.
    cache_salt: str | None = None
    # The LoRA adapter it asks for (the trace's own, a recording's or a Mooncake line's
    # ``lora``, else ``with_loras``'s); None: the base model.
    lora: str | None = None
    # The model it asks for (a recording's, a Mooncake line's ``model``, else ``with_models``'s);
    # None: the one model every worker serves.
    model: str | None = None


def block_tokens(hash_id: int, length: int = TRACE_BLOCK_SIZE) -> bytes:
    """The first ``length`` tokens of the trace block ``hash_id`` (as bytes, one per token)."""
    seed = hash_id.to_bytes(8, "little", signed=True)
    blake2b = hashlib.blake2b  # its default digest is the 64 bytes each counter adds
    digests = b"".join([blake2b(seed + counter).digest() for counter in _counters(length)])
    return digests[:length].translate(_TO_ALPHABET)


def _counters(length: int) -> Sequence[bytes]:
    """The counters whose digests make up ``length`` tokens (a trace block's, made once)."""
    n = -(-length // 64)
    if n == len(_BLOCK_COUNTERS):
        return _BLOCK_COUNTERS
    return [counter.to_bytes(4, "little") for counter in range(n)]


class SyntheticPrompt(Sequence[int]):
    """A prompt made of trace blocks of ``unit`` tokens, materialized only where the engine looks
    at it, optionally followed by ``tail`` tokens (a prefill worker's first token, when a decode
    worker resumes)."""

    __slots__ = ("_ids", "_length", "_tail", "_unit")

    def __init__(
        self,
        hash_ids: tuple[int, ...],
        length: int,
        tail: tuple[int, ...] = (),
        unit: int = TRACE_BLOCK_SIZE,
    ) -> None:
        self._ids = hash_ids
        self._length = length
        self._tail = tail
        self._unit = unit

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
            block = block_tokens(self._ids[index // self._unit], self._unit)
            return block[index % self._unit]
        start, stop, step = index.indices(len(self))
        if step != 1:
            return list(self)[index]
        head = self._blocks(start, min(stop, self._length)) if start < self._length else b""
        if stop <= self._length:
            return head
        return [*head, *self._tail[max(0, start - self._length) : stop - self._length]]

    def _blocks(self, start: int, stop: int) -> bytes:
        unit = self._unit
        out = bytearray()
        for k in range(start // unit, -(-stop // unit)):
            out += block_tokens(self._ids[k], unit)
        skip = start - (start // unit) * unit
        return bytes(out[skip : skip + stop - start])

    def tokens(self) -> bytes:
        """The trace prompt itself (without any tail), one byte per token."""
        return self._blocks(0, self._length)

    def text(self) -> str:
        return self.tokens().decode("ascii")

    def token_ids(self) -> list[int]:
        """The trace prompt as token ids, for a model whose tokenizer is not byte-level: equal
        hash ids give equal ids, so its prefix cache meets the same blocks Laneway hashes."""
        return list(self.tokens())


def check_token_ids(vocab_size: int, special_ids: Collection[int]) -> None:
    """ValueError unless a model of ``vocab_size`` token ids, ``special_ids`` among them, takes
    every id a prompt is made of as an ordinary token."""
    if max(PROMPT_TOKEN_IDS) >= vocab_size:
        raise ValueError(
            f"the prompts' token ids reach {max(PROMPT_TOKEN_IDS)}, the model has {vocab_size}"
        )
    special = sorted(PROMPT_TOKEN_IDS.intersection(special_ids))
    if special:
        raise ValueError(f"the prompts' token ids {special} are special tokens of the model")


class PromptFactory:
    """Prompts and their chained block hashes for trace requests, at one engine block size.

    Hashes are memoized per (parent, chunk of trace blocks), a chunk being the fewest trace blocks
    that end on an engine block's end: conversations repeat their history, and a chunk's engine
    blocks hash the same wherever the same prefix precedes them.
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._memo: dict[tuple[int, int, tuple[int, ...]], tuple[int, ...]] = {}

    def ids_for(self, request: TraceRequest) -> tuple[int, ...]:
        return block_ids(request)

    def prompt(self, request: TraceRequest, tail: tuple[int, ...] = ()) -> SyntheticPrompt:
        ids = self.ids_for(request)
        return SyntheticPrompt(ids, request.input_length, tail, request.block_unit)

    def block_hashes(self, request: TraceRequest) -> tuple[int, ...]:
        ids = self.ids_for(request)
        unit = request.block_unit
        per_chunk = math.lcm(unit, self.block_size) // unit
        full_blocks = request.input_length // self.block_size
        hashes: list[int] = []
        parent = salt_root(request.cache_salt)
        for start in range(0, len(ids), per_chunk):
            if len(hashes) >= full_blocks:
                break
            key = (parent, unit, ids[start : start + per_chunk])
            subs = self._memo.get(key)
            if subs is None:
                subs = self._sub_hashes(*key)
                self._memo[key] = subs
            if not subs:
                break
            hashes.extend(subs)
            parent = subs[-1]
        return tuple(hashes[:full_blocks])

    def _sub_hashes(self, parent: int, unit: int, chunk: tuple[int, ...]) -> tuple[int, ...]:
        tokens = b"".join(block_tokens(hash_id, unit) for hash_id in chunk)
        return chain_block_hashes(tokens, self.block_size, parent)


def block_ids(request: TraceRequest) -> tuple[int, ...]:
    """The ids of ``request``'s blocks; without sharing information, ids nobody else uses
    (negative, unlike Mooncake's)."""
    if request.hash_ids:
        return request.hash_ids
    blocks = -(-request.input_length // request.block_unit)
    return tuple(-(request.index * 1024 + k + 1) for k in range(blocks))


def with_block_unit(trace: Sequence[TraceRequest], unit: int) -> list[TraceRequest]:
    """``trace`` with each block id standing for ``unit`` tokens instead (Mooncake's 512 made 32
    scales its prompts down 16 times for a small model): which blocks requests share is kept,
    and a prompt keeps the share of its last block it filled."""
    if unit < 1:
        raise ValueError("tokens per block id must be at least 1")
    scaled = []
    for r in trace:
        ids = block_ids(r)
        length = min(-(-r.input_length * unit // r.block_unit), len(ids) * unit)
        scaled.append(replace(r, input_length=length, hash_ids=ids, block_unit=unit))
    return scaled


def capped(
    trace: Sequence[TraceRequest], max_prompt: int | None, max_output: int | None
) -> list[TraceRequest]:
    """``trace`` with prompts cut after ``max_prompt`` tokens (a prefix of the same prompt: the
    blocks it shares stay shared) and outputs after ``max_output``; None: as they are."""
    if (max_prompt is not None and max_prompt < 1) or (max_output is not None and max_output < 1):
        raise ValueError("a cap on prompt or output tokens must be at least 1")
    out = []
    for r in trace:
        length = r.input_length if max_prompt is None else min(r.input_length, max_prompt)
        ids = block_ids(r)[: -(-length // r.block_unit)]
        output = r.output_length if max_output is None else min(r.output_length, max_output)
        out.append(replace(r, input_length=length, hash_ids=ids, output_length=output))
    return out


def conversation(request: TraceRequest) -> tuple[int, ...]:
    """What names ``request``'s conversation: its prompt's first two blocks (a Mooncake turn
    extends its conversation's last prompt, whose first block is a system prompt all
    conversations share); a request without block ids is a conversation of its own."""
    return request.hash_ids[:2] or (-request.index - 1,)


def sample_conversations(trace: Sequence[TraceRequest], every: int) -> list[TraceRequest]:
    """Every ``every``-th conversation of ``trace`` (numbered as they first arrive), all its
    turns: a slice that keeps the whole trace's sharing between turns, which the first requests
    alone lack (a conversation's next turn comes minutes later). Arrivals start at 0 again."""
    if every < 1:
        raise ValueError("a sample of every n-th conversation needs n >= 1")
    numbers: dict[tuple[int, ...], int] = {}
    kept = [r for r in trace if numbers.setdefault(conversation(r), len(numbers)) % every == 0]
    start = kept[0].arrival_s if kept else 0.0
    return [replace(r, arrival_s=r.arrival_s - start) for r in kept]


def detect_format(path: Path) -> TraceFormat:
    """By the name (``.csv``: Azure; ``.gz``: a compressed recording), else by the first line."""
    suffix = path.suffix.lower()
    if suffix in (".csv", ".gz"):
        return "azure" if suffix == ".csv" else "recording"
    try:
        with path.open("rb") as handle:
            first = handle.readline(1 << 16)
    except OSError:
        return "mooncake"  # the loader says why it cannot be read
    return "recording" if HEADER_KEY.encode() in first else "mooncake"


def load_trace(
    path: Path, fmt: TraceFormat | None = None, speedup: float = 1.0, limit: int | None = None
) -> list[TraceRequest]:
    """Requests in arrival order; ``speedup`` divides the gaps between arrivals."""
    fmt = fmt or detect_format(path)
    if fmt == "recording":
        return recording_trace(read_recording(path), speedup, limit)
    rows = _mooncake(path) if fmt == "mooncake" else _azure(path)
    trace = _trace(rows, speedup, limit)
    if not trace:
        raise ValueError(f"{path} holds no requests")
    return trace


def recording_trace(
    recorded: Iterable[Recorded], speedup: float = 1.0, limit: int | None = None
) -> list[TraceRequest]:
    """A recording's requests as a trace: arrivals as the ingress accepted them, the prompt's
    length and engine blocks (its hashes, so requests share exactly the blocks they shared), and
    the output length it finished with (its ``max_tokens`` if it never finished)."""
    trace = _trace(_recorded_rows(recorded), speedup, limit)
    if not trace:
        raise RecordingError("the recording holds no requests (no RequestAccepted)")
    return trace


def _trace(rows: Iterable[Row], speedup: float, limit: int | None) -> list[TraceRequest]:
    requests: list[TraceRequest] = []
    for i, (arrival, inp, out, ids, unit, lora, model) in enumerate(rows):
        if limit is not None and i >= limit:
            break
        # Salted as the ingress salts an adapter's prompt: its blocks are its own.
        salt = adapter_salt(None, lora)
        request = TraceRequest(arrival / speedup, inp, max(1, out), ids, i, unit, salt, lora, model)
        requests.append(request)
    start = requests[0].arrival_s if requests else 0.0
    return [replace(r, arrival_s=r.arrival_s - start) for r in requests]


# Arrival (seconds), prompt tokens, output tokens, block ids, tokens per block id, LoRA adapter,
# model.
Row = tuple[float, int, int, tuple[int, ...], int, str | None, str | None]


def _recorded_rows(recorded: Iterable[Recorded]) -> Iterator[Row]:
    accepted: dict[str, RequestAccepted] = {}
    output: dict[str, int] = {}
    for r in recorded:
        event = r.event
        if isinstance(event, RequestAccepted) and event.request_id:
            accepted.setdefault(event.request_id, event)
        elif isinstance(event, RequestFinished) and event.request_id:
            output[event.request_id] = event.usage.completion_tokens
    # Engine block hashes are chained (equal hash, equal prefix): each becomes one small id.
    ids: dict[int, int] = {}
    # Blocks without a hash (the partial last one) are each this request's alone.
    unshared = itertools.count(-1, -1)
    for event in sorted(accepted.values(), key=lambda e: e.occurred_at):
        spec = event.spec
        blocks = [ids.setdefault(h, len(ids)) for h in spec.block_hashes]
        missing = -(-spec.prompt_length // spec.block_size) - len(blocks)
        blocks += [next(unshared) for _ in range(missing)]
        yield (
            event.occurred_at.timestamp(),
            spec.prompt_length,
            output.get(event.request_id or "", spec.sampling.max_tokens),
            tuple(blocks),
            spec.block_size,
            spec.lora,
            spec.model,
        )


def _name(value: object, what: str) -> str | None:
    """A Mooncake line's optional ``lora`` or ``model``: a name, as a request names it."""
    if value is None or (isinstance(value, str) and 0 < len(value) <= 128):
        return value
    raise ValueError(f"{str(value)[:40]!r} is no {what} name")


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
                    TRACE_BLOCK_SIZE,
                    _name(row.get("lora"), "adapter"),
                    _name(row.get("model"), "model"),
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
                    TRACE_BLOCK_SIZE,
                    None,
                    None,
                )
            except (KeyError, ValueError, TypeError) as err:
                raise ValueError(f"{path}:{n}: not an Azure trace row ({err})") from None
