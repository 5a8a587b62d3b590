"""Streams and subjects as objects. Services never spell a subject string themselves.

Ids used as subject tokens (worker, ingress instance) are hex strings, so they never contain the
NATS separators ``.``, ``*`` or ``>``.
"""

from __future__ import annotations

from dataclasses import dataclass

from nats.js.api import StorageType, StreamConfig

_PREFIX = "lw"


@dataclass(frozen=True)
class Stream:
    name: str
    subjects: tuple[str, ...]
    storage: StorageType
    max_age_s: float
    # Keep only the newest message per subject (the latest load report of each worker).
    keep_last_per_subject: bool = False
    duplicate_window_s: float = 120.0

    def config(self) -> StreamConfig:
        return StreamConfig(
            name=self.name,
            subjects=list(self.subjects),
            storage=self.storage,
            max_age=self.max_age_s,
            max_msgs_per_subject=1 if self.keep_last_per_subject else -1,
            duplicate_window=min(self.duplicate_window_s, self.max_age_s),
        )


DAY_S = 24 * 3600.0

# Request lifecycle: accepted, cancellation asks and terminal events. Replayable.
REQUESTS = Stream("LW_REQUESTS", (f"{_PREFIX}.req.>",), StorageType.FILE, DAY_S)
# Routing decisions, one subject per worker. Replayable: the "why" of every request.
ROUTES = Stream("LW_ROUTES", (f"{_PREFIX}.route.>",), StorageType.FILE, DAY_S)
# KV cache events, one subject per worker so that each worker's events stay in order.
KV = Stream("LW_KV", (f"{_PREFIX}.kv.>",), StorageType.FILE, DAY_S)
# Token deltas, one subject per ingress instance. Short-lived: only the live client needs them.
TOKENS = Stream("LW_TOKENS", (f"{_PREFIX}.tok.>",), StorageType.MEMORY, 60.0)
# Worker load reports; only the latest per worker matters.
LOAD = Stream(
    "LW_LOAD", (f"{_PREFIX}.load.>",), StorageType.MEMORY, 600.0, keep_last_per_subject=True
)

# The capacity loop's moves between the prefill and decode pools. Replayable.
CONTROL = Stream("LW_CONTROL", (f"{_PREFIX}.ctl.>",), StorageType.FILE, DAY_S)

ALL_STREAMS = (REQUESTS, ROUTES, KV, TOKENS, LOAD, CONTROL)


class Subjects:
    """Every subject Laneway uses."""

    request_accepted = f"{_PREFIX}.req.accepted"
    cancellation_requested = f"{_PREFIX}.req.cancel"
    all_request_terminals = f"{_PREFIX}.req.done.>"
    all_routes = f"{_PREFIX}.route.>"
    all_kv = f"{_PREFIX}.kv.>"
    all_load = f"{_PREFIX}.load.>"
    roles_rebalanced = f"{_PREFIX}.ctl.roles"
    # Core NATS request/reply, deliberately outside every stream: queries are not facts.
    overlap_query = f"{_PREFIX}.query.overlap"

    @staticmethod
    def index_state(instance_id: str) -> str:
        """One kv-indexer replica's digest of its index (operators, tests)."""
        return f"{_PREFIX}.query.index.{instance_id}"

    @staticmethod
    def request_terminal(ingress_id: str) -> str:
        return f"{_PREFIX}.req.done.{ingress_id}"

    @staticmethod
    def route(worker_id: str) -> str:
        return f"{_PREFIX}.route.{worker_id}"

    @staticmethod
    def kv_transferred(worker_id: str) -> str:
        """A hand-off's arrival at the decode worker; in the routes stream with the decision,
        outside the worker's own route subject."""
        return f"{_PREFIX}.route.{worker_id}.transferred"

    @staticmethod
    def kv_handoff(worker_id: str) -> str:
        """Core NATS, outside every stream: the KV tensors of hand-offs to this worker, chunked."""
        return f"{_PREFIX}.kvx.{worker_id}"

    @staticmethod
    def kv(worker_id: str) -> str:
        return f"{_PREFIX}.kv.{worker_id}"

    @staticmethod
    def tokens(ingress_id: str) -> str:
        return f"{_PREFIX}.tok.{ingress_id}"

    @staticmethod
    def load(worker_id: str) -> str:
        return f"{_PREFIX}.load.{worker_id}"


@dataclass(frozen=True)
class Consumer:
    """A durable JetStream consumer: its name, stream, filter, and who shares it."""

    durable: str
    stream: Stream
    filter_subject: str
    # Replicas of a service share one durable through a deliver group (each message to one).
    queue: str | None = None
    # Seconds a durable survives without a subscriber (workers die; their consumers should not
    # pile up). None: forever.
    inactive_threshold_s: float | None = None
    ack_wait_s: float = 30.0


PLANNER_INTAKE = Consumer("planner", REQUESTS, Subjects.request_accepted, queue="planner")

# The kv-indexer's snapshots (JetStream object store): the index folded up to a KV stream position.
INDEX_SNAPSHOTS = "LW_INDEX_SNAPSHOTS"
INDEX_SNAPSHOT_NAME = "prefix-index"


def worker_routes(worker_id: str) -> Consumer:
    return Consumer(
        f"worker-{worker_id}", ROUTES, Subjects.route(worker_id), inactive_threshold_s=300.0
    )
