"""The vocabulary of the bus: streams, channels and the topics handlers subscribe to.

A channel is one kind of traffic: a subject pattern, the events it carries, who publishes and
who reads them, whether a stream stores them and whether a publisher waits for that. Every
channel is declared once, in :mod:`bus.topology`; subjects, stream subjects, the typed dispatch
of :class:`bus.client.Bus` and the README's table of channels are all derived from it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Generic, Literal, TypeVar

from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    StorageType,
    StreamConfig,
)
from pydantic import BaseModel

from schemas.events import Envelope

E = TypeVar("E", bound=Envelope)
T = TypeVar("T", bound=Envelope)
Q = TypeVar("Q", bound=BaseModel)
R = TypeVar("R", bound=BaseModel)

# How a publisher hands an event over:
#   core:      core NATS only, no stream stores it (gone if nobody listens right then);
#   stored:    a stream stores it, the publisher does not wait for the stream's ack;
#   confirmed: a stream stores it and the publisher waits until the stream has it.
Delivery = Literal["core", "stored", "confirmed"]

# A token of a subject per worker or per instance, named for the docs: `{worker}`. A pattern
# with two names its reader first and its publisher last (`lw.tok.{ingress}.{worker}`): NATS
# does not tell a subscriber who published, so the subject does, and permissions make it true.
_KEY = re.compile(r"\{[a-z_]+\}")
# Topics a channel keeps filled in, per key (workers and instances: a few hundred at most).
TOPICS_KEPT = 4096


@dataclass(frozen=True)
class Stream:
    """A JetStream stream; its subjects are those of the channels it stores."""

    name: str
    storage: StorageType
    max_age_s: float
    # Keep only the newest message per subject (the latest load report of each worker).
    keep_last_per_subject: bool = False
    duplicate_window_s: float = 120.0
    # Past this the oldest messages go, so that a burst fills the stream, not the server's disk
    # or memory. The server reserves it up front: streams it cannot fit are refused. -1: none.
    max_bytes: int = -1
    # The largest message the stream stores (-1: the server's max payload): a bound on what
    # one publish may take of the stream's room, above the largest event its channels carry.
    max_msg_size: int = -1

    def config(self, subjects: list[str], replicas: int = 1) -> StreamConfig:
        return StreamConfig(
            name=self.name,
            subjects=subjects,
            num_replicas=replicas,
            storage=self.storage,
            max_age=self.max_age_s,
            max_msgs_per_subject=1 if self.keep_last_per_subject else -1,
            max_bytes=self.max_bytes,
            max_msg_size=self.max_msg_size,
            discard=DiscardPolicy.OLD,
            duplicate_window=min(self.duplicate_window_s, self.max_age_s),
        )


# The settings `Stream.config` declares; the server fills in the rest.
_DECLARED = (
    "subjects",
    "num_replicas",
    "storage",
    "max_age",
    "max_msgs_per_subject",
    "max_bytes",
    "max_msg_size",
    "discard",
    "duplicate_window",
)


def as_declared(found: StreamConfig, declared: StreamConfig) -> bool:
    """Whether a stream found on the server has every setting Laneway declares."""
    return all(getattr(found, name) == getattr(declared, name) for name in _DECLARED)


@dataclass(frozen=True)
class Channel(Generic[E]):
    """``pattern`` is a subject, with ``{name}`` tokens standing for worker or instance ids
    where the channel has a subject per worker or instance (or per pair)."""

    pattern: str
    events: tuple[type[E], ...]
    producers: tuple[str, ...]
    consumers: tuple[str, ...]
    delivery: Delivery
    stream: Stream | None = None
    about: str = ""
    # The event field that must name the subject's (last) key (a KV event's `worker_id` is the
    # worker whose subject it came on): an event that claims another is dropped on receipt.
    key_field: str | None = None
    # Roles that publish to any key's subject, not only their own (a prefill worker to its
    # decode worker's); see bus.permissions.
    publish_any: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if (self.stream is None) != (self.delivery == "core"):
            raise ValueError(f"{self.pattern}: a stream exactly when delivery is not core")
        if self.key_field is not None and not _KEY.search(self.pattern):
            raise ValueError(f"{self.pattern} has no key for {self.key_field} to name")

    def at(self, *keys: str) -> Topic[E]:
        """The subject of these keys, in the pattern's order; keys left out are any (``*``)."""
        # Asked for each event published (a request's route, its placement, a step's batch):
        # filled once per key. Keys come from events (an ingress id a request names), so the
        # kept ones are bounded.
        topic = self._topics.get(keys)
        if topic is None:
            topic = Topic(fill(self.pattern, keys), self.events, (self,))
            if len(self._topics) < TOPICS_KEPT:
                self._topics[keys] = topic
        return topic

    @cached_property
    def _topics(self) -> dict[tuple[str, ...], Topic[E]]:
        return {}

    @property
    def every(self) -> Topic[E]:
        """Every subject of the channel (all workers, all instances)."""
        return self.at()

    @property
    def key_names(self) -> tuple[str, ...]:
        """The names of the pattern's keys (``worker`` for ``{worker}``), in order."""
        return key_names(self.pattern)

    def key_of(self, subject: str) -> str | None:
        """The (last) key ``subject`` carries if it is one of this channel's subjects, else
        None (and None for a subject of a channel without keys)."""
        found = self.keys_of(subject)
        return found[-1] if found else None

    def keys_of(self, subject: str) -> tuple[str, ...] | None:
        """The keys ``subject`` carries, in the pattern's order, if it is one of this channel's
        subjects (none for a channel without keys); None if it is not."""
        parts, tokens = self._parts, subject.split(".")
        if len(parts) != len(tokens):
            return None
        keys: list[str] = []
        for part, token in zip(parts, tokens, strict=True):
            if part is None:
                keys.append(token)
            elif part != token:
                return None
        return tuple(keys)

    @cached_property
    def _parts(self) -> tuple[str | None, ...]:
        """The pattern's tokens, None for each key (parsed once, not per message)."""
        return tuple(None if _KEY.fullmatch(part) else part for part in self.pattern.split("."))

    @property
    def subject(self) -> Topic[E]:
        """The channel's one subject; only for a channel without a key."""
        if _KEY.search(self.pattern):
            raise ValueError(f"{self.pattern} has a subject per key: use at(key)")
        return self.at()


@dataclass(frozen=True)
class Topic(Generic[E]):
    """A subject to publish to or subscribe to, and the events a handler of it receives.

    ``carried`` is every event type its channels declare; an event of one of them that is not in
    ``events`` (a handler that wants only some) is skipped quietly, any other type is a stray
    that the bus drops with a warning.
    """

    subject: str
    events: tuple[type[E], ...]
    channels: tuple[Channel[Any], ...]
    carried: tuple[type[Envelope], ...] = field(default=())

    def __post_init__(self) -> None:
        if not self.carried:
            carried = tuple(t for c in self.channels for t in c.events)
            object.__setattr__(self, "carried", carried)

    def only(self, kind: type[T]) -> Topic[T]:
        """The same subject, with handlers receiving only events of ``kind``."""
        if kind not in self.carried:
            raise ValueError(f"{self.subject} carries no {kind.__name__}")
        return Topic(self.subject, (kind,), self.channels, self.carried)

    @property
    def stream(self) -> Stream | None:
        return self.channels[0].stream

    def impostor(self, event: Envelope, subject: str) -> str | None:
        """Why ``event`` cannot have come on ``subject``: the subject is none of its channels'
        (a consumer's delivery keeps the subject it was stored under, whatever subject it was
        delivered to), or the event names another key than the subject's (a worker's KV event
        on another worker's subject, which only that worker may publish to). None if it can."""
        for channel in self.channels:
            if not isinstance(event, channel.events):
                continue
            keys = channel.keys_of(subject)
            if keys is None:
                continue
            if channel.key_field is None:
                return None
            claimed = getattr(event, channel.key_field)
            if claimed != keys[-1]:
                return f"its {channel.key_field} {str(claimed)[:64]!r} is not the subject's"
            return None
        return f"{subject[:128]} is not a subject of its channel"

    @property
    def delivery(self) -> Delivery:
        if len(self.channels) != 1 or "*" in self.subject or ">" in self.subject:
            raise ValueError(f"{self.subject} is a view over several subjects: publish to one")
        return self.channels[0].delivery


def key_names(pattern: str) -> tuple[str, ...]:
    return tuple(found[1:-1] for found in _KEY.findall(pattern))


def fill(pattern: str, keys: tuple[str, ...]) -> str:
    """``pattern`` with its keys replaced by ``keys`` in order, those left out by ``*``."""
    given = iter(keys)
    filled = _KEY.sub(lambda _: next(given, "*"), pattern)
    if next(given, None) is not None:
        raise ValueError(f"{pattern} has {len(key_names(pattern))} keys, not {len(keys)}")
    return filled


def matches(pattern: str, subject: str) -> bool:
    """Whether ``subject`` is one of ``pattern``'s (NATS wildcards: ``*`` one token, ``>`` the
    rest)."""
    want, have = pattern.split("."), subject.split(".")
    for i, token in enumerate(want):
        if token == ">":
            return len(have) > i
        if i >= len(have) or (token != "*" and token != have[i]):
            return False
    return len(want) == len(have)


def view(subject: str, *channels: Channel[Any]) -> Topic[Any]:
    """One subscription over several channels (an observer of a whole stream)."""
    return Topic(subject, tuple(t for c in channels for t in c.events), channels)


@dataclass(frozen=True)
class Endpoint:
    """A subject that carries no events: request/reply queries and bulk bytes, core NATS only."""

    pattern: str
    producers: tuple[str, ...]
    consumers: tuple[str, ...]
    about: str = ""
    # As for a channel: roles that send to any key's subject, not only their own.
    publish_any: tuple[str, ...] = ()
    # What it carries, for the docs (a query endpoint's is said by its types).
    carries: str = field(default="", kw_only=True)

    def at(self, *keys: str) -> str:
        return fill(self.pattern, keys)

    @property
    def key_names(self) -> tuple[str, ...]:
        return key_names(self.pattern)


@dataclass(frozen=True)
class Asked(Generic[Q, R]):
    """One request/reply subject, with what it is asked and what it answers: the bus's
    ``request`` returns a ``reply``, its ``serve`` hands a handler a ``query``."""

    subject: str
    query: type[Q]
    reply: type[R]


@dataclass(frozen=True)
class QueryEndpoint(Endpoint, Generic[Q, R]):
    """An endpoint of typed request/reply, as a channel is typed by its events; what it
    ``carries`` for the docs is said by its types."""

    query: type[Q] = field(kw_only=True)
    reply: type[R] = field(kw_only=True)

    def __post_init__(self) -> None:
        carries = f"`{self.query.__name__}` → `{self.reply.__name__}`"
        object.__setattr__(self, "carries", carries)

    def ask(self, *keys: str) -> Asked[Q, R]:
        return Asked(self.at(*keys), self.query, self.reply)


@dataclass(frozen=True)
class Consumer(Generic[E]):
    """A durable JetStream consumer of one topic, and who shares it."""

    durable: str
    topic: Topic[E]
    # Replicas of a service share one durable through a deliver group (each message to one).
    queue: str | None = None
    # Seconds a durable survives without a subscriber (workers die; their consumers should not
    # pile up). None: forever.
    inactive_threshold_s: float | None = None
    ack_wait_s: float = 30.0

    @property
    def stream(self) -> Stream:
        stream = self.topic.stream
        if stream is None:
            raise ValueError(f"{self.topic.subject} is in no stream")
        return stream

    @property
    def deliver_subject(self) -> str:
        """Where the durable delivers: a subject named after it, which only its own service may
        subscribe to. Fixed, so that replicas starting together make identical creates (with
        an inbox of each, the last create would take every message), and so that a service
        binds to a durable the admin made without asking the server for it."""
        return f"_lw.deliver.{self.durable}"

    def config(self) -> ConsumerConfig:
        """The durable as the admin (or, on an open server, its own service) creates it."""
        return ConsumerConfig(
            durable_name=self.durable,
            # Named, a create request names its filter in its subject.
            name=self.durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s,
            filter_subject=self.topic.subject,
            inactive_threshold=self.inactive_threshold_s,
            deliver_policy=DeliverPolicy.ALL,
            max_ack_pending=4096,
            deliver_subject=self.deliver_subject,
            deliver_group=self.queue,
        )


def stream_subjects(channels: tuple[Channel[Any], ...]) -> dict[Stream, list[str]]:
    """Each stream with the subjects of the channels it stores: nothing else lands in it."""
    found: dict[Stream, list[str]] = {}
    for channel in channels:
        if channel.stream is not None:
            found.setdefault(channel.stream, []).append(channel.every.subject)
    return found


def _names(types: tuple[type[Any], ...]) -> str:
    return ", ".join(f"`{t.__name__}`" for t in types)


def markdown_table(channels: tuple[Channel[Any], ...], endpoints: tuple[Endpoint, ...]) -> str:
    rows = [
        "| subject | carries | stored in | delivery | producers | consumers | why |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in channels:
        stream = f"`{c.stream.name}`" if c.stream is not None else "—"
        rows.append(
            _row(c.pattern, _names(c.events), stream, c.delivery, c.producers, c.consumers, c.about)
        )
    for e in endpoints:
        rows.append(_row(e.pattern, e.carries, "—", "core", e.producers, e.consumers, e.about))
    return "\n".join(rows) + "\n"


def _row(
    pattern: str,
    carries: str,
    stream: str,
    delivery: str,
    producers: tuple[str, ...],
    consumers: tuple[str, ...],
    about: str,
) -> str:
    cells = [f"`{pattern}`", carries, stream, delivery, ", ".join(producers), ", ".join(consumers)]
    return "| " + " | ".join([*cells, about]) + " |"
