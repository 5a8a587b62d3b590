"""Every stream, channel and durable consumer of Laneway, declared once.

Services never spell a subject string themselves; the streams' subjects are those of the
channels they store. Ids used as subject tokens (worker, ingress instance) are hex strings, so
they never contain the NATS separators ``.``, ``*`` or ``>``. Where a subject names both who
reads it and who publishes it, the reader comes first.

``python -m bus.topology`` prints the table of channels; ``--readme README.md`` rewrites the one
in the README (between its marker comments).
"""

from __future__ import annotations

from typing import Any

from nats.js.api import StorageType

from bus import readme
from bus.channels import (
    Channel,
    Consumer,
    Endpoint,
    QueryEndpoint,
    Stream,
    Topic,
    markdown_table,
    stream_subjects,
    view,
)
from schemas.events import (
    CancellationRequested,
    CapacityReviewed,
    KvBlocksRemoved,
    KvBlocksStored,
    KvChanged,
    KvCleared,
    KvEvent,
    KvTransferred,
    PlannerConfigured,
    PrefillCompleted,
    RequestAccepted,
    RequestCancelled,
    RequestFailed,
    RequestFinished,
    RequestPlaced,
    RolesRebalanced,
    RouteDecided,
    TerminalEvent,
    TokenBatch,
    TokensGenerated,
    WorkerLoadReported,
)
from schemas.messages import (
    IndexState,
    IndexStateQuery,
    KvPullQuery,
    KvPullReply,
    OverlapQueries,
    OverlapQuery,
    OverlapReplies,
    OverlapReply,
    ResendQuery,
    ResendReply,
)

DAY_S = 24 * 3600.0

MIB = 1 << 20

# Their byte limits together (1,216 MiB on file, 32 MiB in memory) fit the smallest store they
# are deployed on: a 2 GiB volume, of which JetStream takes 75 %, and 256 MB of memory.
#
# Who may fill each stream is who may publish to its subjects (bus.permissions), and a full
# stream drops its oldest messages, whoever wrote them. So the history of requests and
# decisions (LW_REQUESTS: ingress and planner; LW_ROUTES and LW_CONTROL: planner) takes nothing
# from a worker, whose reports go to streams of their own (LW_OUTCOMES, LW_KV, LW_LOAD): junk
# from one worker can push other workers' reports out, never a request or a decision.
REQUESTS = Stream("LW_REQUESTS", StorageType.FILE, DAY_S, max_bytes=384 * MIB)
ROUTES = Stream("LW_ROUTES", StorageType.FILE, DAY_S, max_bytes=384 * MIB)
# A terminal is a few hundred bytes, a hand-off's report its prompt's block hashes.
OUTCOMES = Stream("LW_OUTCOMES", StorageType.FILE, DAY_S, max_bytes=128 * MIB, max_msg_size=MIB)
KV = Stream("LW_KV", StorageType.FILE, DAY_S, max_bytes=256 * MIB)
# One report per worker is kept, a few hundred bytes: no worker takes more than its share.
LOAD = Stream(
    "LW_LOAD",
    StorageType.MEMORY,
    600.0,
    keep_last_per_subject=True,
    max_bytes=32 * MIB,
    max_msg_size=16 * 1024,
)
CONTROL = Stream("LW_CONTROL", StorageType.FILE, DAY_S, max_bytes=64 * MIB)

ACCEPTED: Channel[RequestAccepted] = Channel(
    "lw.req.accepted",
    (RequestAccepted,),
    ("ingress",),
    ("planner (durable `planner`, shared by replicas)",),
    "confirmed",
    REQUESTS,
    "a request is only taken once the stream has it; replayable",
)
CANCELS: Channel[CancellationRequested] = Channel(
    "lw.req.cancel",
    (CancellationRequested,),
    ("ingress",),
    ("worker",),
    "confirmed",
    REQUESTS,
    "every worker hears every ask; the one running the request ends it",
)
# An ingress takes a request's tokens and terminal only from the worker the planner placed it
# on; only the planner publishes placements, only a worker its own terminals and tokens. The
# ingress hears them on a core subscription, and the route (stored) holds the same decision, so
# no stream stores a placement: that cost nats-server a stream's store on every request's way to
# its worker. The planner says a placement again when its connection was lost while it went
# out, and an ingress that hears none submits the request again (`Recovery.unrouted_s`).
PLACEMENTS: Channel[RequestPlaced] = Channel(
    "lw.req.placed.{ingress}",
    (RequestPlaced,),
    ("planner",),
    ("ingress (its own instance)",),
    "core",
    None,
    "the planner's word to an ingress: where each attempt runs (its route says it, stored)",
)
# A request the planner cannot route ends here: a terminal, stored as the workers' are.
PLANNER_FAILURES: Channel[RequestFailed] = Channel(
    "lw.req.done.{ingress}",
    (RequestFailed,),
    ("planner",),
    ("ingress (its own instance)",),
    "stored",
    REQUESTS,
    "why an attempt ends without a worker (none, lost, refused, too late); replayable",
)
TERMINALS: Channel[TerminalEvent] = Channel(
    "lw.req.done.{ingress}.{worker}",
    (RequestFinished, RequestFailed, RequestCancelled),
    ("worker",),
    ("ingress (its own instance)", "planner (all)"),
    "confirmed",
    OUTCOMES,
    "a subject per ingress instance and worker; the end of every request, replayable",
    key_field="worker_id",
)
# Only the planner decides: a worker acts on a route (a new attempt included) from this
# subject alone, which no worker may publish to.
ROUTE: Channel[RouteDecided] = Channel(
    "lw.route.{worker}",
    (RouteDecided,),
    ("planner",),
    (
        "worker (durable per worker)",
        "kv-indexer",
        "planner (its own fold)",
    ),
    "confirmed",
    ROUTES,
    "one subject per worker: its work, in order; the why of every request",
)
# A prefill worker's word to the decode worker it computed a prompt for, on a subject that names
# them both: the decode worker takes it only from the prefill worker its route named.
PREFILLED: Channel[PrefillCompleted] = Channel(
    "lw.prefilled.{worker}.{prefill_worker}",
    (PrefillCompleted,),
    ("worker (prefill side)",),
    ("worker (decode side, its own)", "operators"),
    "stored",
    OUTCOMES,
    "a remote prefill's first token and KV announcement; the decode worker hears it live",
    key_field="worker_id",
)
TRANSFERRED: Channel[KvTransferred] = Channel(
    "lw.route.{worker}.transferred",
    (KvTransferred,),
    ("worker (decode side)",),
    ("bench", "operators"),
    "stored",
    OUTCOMES,
    "a hand-off's arrival, next to its decision's subject but in the workers' stream",
    key_field="to_worker_id",
)
# One `KvChanged` per engine step (all of that step's changes); the single-change events are still
# taken, as workers before batching sent them.
KV_EVENTS: Channel[KvEvent] = Channel(
    "lw.kv.{worker}",
    (KvChanged, KvBlocksStored, KvBlocksRemoved, KvCleared),
    ("worker",),
    ("kv-indexer (ordered replay)", "planner (ordered replay, its own fold)"),
    "stored",
    KV,
    "one subject per worker keeps its order; the indexer replays after its snapshot",
    key_field="worker_id",
)
# One `TokenBatch` per engine step per ingress (every request's new tokens of that step); a
# `TokensGenerated` (one request's) is still taken, as workers before batching sent them.
TOKEN_DELTAS: Channel[TokenBatch | TokensGenerated] = Channel(
    "lw.tok.{ingress}.{worker}",
    (TokenBatch, TokensGenerated),
    ("worker",),
    ("ingress (its own instance)",),
    "core",
    None,
    "a subject per ingress instance and worker, a batch per engine step; only the live client "
    "needs them, so no stream stores them",
    key_field="worker_id",
)
LOAD_REPORTS: Channel[WorkerLoadReported] = Channel(
    "lw.load.{worker}",
    (WorkerLoadReported,),
    ("worker",),
    ("planner", "ingress (admission)", "bench"),
    "stored",
    LOAD,
    "the stream keeps each worker's latest report",
    key_field="worker_id",
)
ROLE_MOVES: Channel[RolesRebalanced] = Channel(
    "lw.ctl.roles",
    (RolesRebalanced,),
    ("planner (capacity loop)",),
    ("bench", "operators"),
    "confirmed",
    CONTROL,
    "the capacity loop's moves between the pools (workers take roles from etcd); replayable",
)
CAPACITY_REVIEWS: Channel[CapacityReviewed] = Channel(
    "lw.ctl.capacity",
    (CapacityReviewed,),
    ("planner (capacity loop)",),
    ("operators (laneway status)",),
    "confirmed",
    CONTROL,
    "the capacity loop's look at each interval, and the targets no move can meet",
)
PLANNER_SETTINGS: Channel[PlannerConfigured] = Channel(
    "lw.ctl.planner",
    (PlannerConfigured,),
    ("planner",),
    ("replay", "operators"),
    "confirmed",
    CONTROL,
    "each replica's settings at start: with its decisions, what a replay needs to decide again",
)

CHANNELS: tuple[Channel[Any], ...] = (
    ACCEPTED,
    CANCELS,
    PLACEMENTS,
    PLANNER_FAILURES,
    TERMINALS,
    ROUTE,
    PREFILLED,
    TRANSFERRED,
    KV_EVENTS,
    TOKEN_DELTAS,
    LOAD_REPORTS,
    ROLE_MOVES,
    CAPACITY_REVIEWS,
    PLANNER_SETTINGS,
)
STREAM_SUBJECTS = stream_subjects(CHANNELS)
# Streams an earlier version declared, deleted where they still exist: token deltas were kept
# for 60 s in LW_TOKENS, which nothing read back and which cost the nats-server 2.5 times the
# CPU per delta (benchmarks/bus_bench.py).
RETIRED_STREAMS = ("LW_TOKENS",)

OVERLAP_QUERY: QueryEndpoint[OverlapQuery, OverlapReply] = QueryEndpoint(
    "lw.query.overlap",
    ("operators", "tests"),
    ("kv-indexer (queue group)",),
    "request/reply: queries are not facts; one prompt's (the planner asks in batches)",
    query=OverlapQuery,
    reply=OverlapReply,
)
OVERLAP_QUERIES: QueryEndpoint[OverlapQueries, OverlapReplies] = QueryEndpoint(
    "lw.query.overlaps",
    ("planner",),
    ("kv-indexer (queue group)",),
    "the queries a planner asked in one turn of its loop, in one round trip",
    query=OverlapQueries,
    reply=OverlapReplies,
)
INDEX_STATE: QueryEndpoint[IndexStateQuery, IndexState] = QueryEndpoint(
    "lw.query.index.{indexer}",
    ("operators", "tests"),
    ("kv-indexer (that replica)",),
    "one replica's digest of its index",
    query=IndexStateQuery,
    reply=IndexState,
)
KV_HANDOFF = Endpoint(
    "lw.kvx.{worker}",
    ("worker (prefill side)",),
    ("worker (decode side)",),
    "megabytes, useless once delivered; announced by `PrefillCompleted`",
    publish_any=("worker",),
    carries="KV tensor chunks (bytes)",
)
KV_PULL: QueryEndpoint[KvPullQuery, KvPullReply] = QueryEndpoint(
    "lw.kvpull.{worker}",
    ("worker (a KV move's target)",),
    ("worker (the KV's holder)",),
    "a KV move: the chunks go to the asker's `lw.kvx.{worker}`, then the answer",
    publish_any=("worker",),
    query=KvPullQuery,
    reply=KvPullReply,
)
RESEND: QueryEndpoint[ResendQuery, ResendReply] = QueryEndpoint(
    "lw.resend.{worker}",
    ("ingress",),
    ("worker (its own)",),
    "token deltas are core messages: one lost on its way is asked of the request's worker again",
    query=ResendQuery,
    reply=ResendReply,
)
ENDPOINTS = (OVERLAP_QUERY, OVERLAP_QUERIES, INDEX_STATE, KV_HANDOFF, KV_PULL, RESEND)


class Subjects:
    """Every topic and subject Laneway uses, by what it is for."""

    request_accepted = ACCEPTED.subject
    cancellation_requested = CANCELS.subject
    # The workers' terminals and the planner's failures, for observers.
    all_request_terminals: Topic[TerminalEvent] = Topic(
        "lw.req.done.>", TERMINALS.events, (PLANNER_FAILURES, TERMINALS)
    )
    worker_terminals = TERMINALS.every
    all_tokens = TOKEN_DELTAS.every
    all_kv = KV_EVENTS.every
    all_load = LOAD_REPORTS.every
    roles_rebalanced = ROLE_MOVES.subject
    capacity_reviewed = CAPACITY_REVIEWS.subject
    planner_configured = PLANNER_SETTINGS.subject
    # Decisions and hand-off arrivals.
    all_routes: Topic[RouteDecided | KvTransferred] = view("lw.route.>", ROUTE, TRANSFERRED)
    route_decisions = ROUTE.every
    all_prefilled = PREFILLED.every
    overlap_query = OVERLAP_QUERY.ask()
    overlap_queries = OVERLAP_QUERIES.ask()
    resend = staticmethod(RESEND.ask)
    index_state = staticmethod(INDEX_STATE.ask)
    placements = staticmethod(PLACEMENTS.at)
    planner_failures = staticmethod(PLANNER_FAILURES.at)
    request_terminal = staticmethod(TERMINALS.at)
    route = staticmethod(ROUTE.at)
    prefilled = staticmethod(PREFILLED.at)
    kv_transferred = staticmethod(TRANSFERRED.at)
    kv_handoff = staticmethod(KV_HANDOFF.at)
    kv_pull = staticmethod(KV_PULL.ask)
    kv = staticmethod(KV_EVENTS.at)
    tokens = staticmethod(TOKEN_DELTAS.at)
    load = staticmethod(LOAD_REPORTS.at)


PLANNER_INTAKE = Consumer("planner", Subjects.request_accepted, queue="planner")

# The kv-indexer's snapshots (JetStream object store): the index folded up to a KV stream position.
INDEX_SNAPSHOTS = "LW_INDEX_SNAPSHOTS"
INDEX_SNAPSHOT_NAME = "prefix-index"
# Room for two snapshots (a new one is written before the old one's chunks go) of an index of
# millions of blocks; past it a snapshot is refused, never another stream's room taken.
INDEX_SNAPSHOTS_MAX_BYTES = 256 * MIB


def bucket_stream(bucket: str) -> str:
    """The stream that holds a JetStream object store's bucket."""
    return f"OBJ_{bucket}"


def worker_routes(worker_id: str) -> Consumer[RouteDecided]:
    # Made by the admin with the worker's credentials, as a worker may not make consumers
    # (bus.permissions): it outlives a day away; the worker's retirement deletes it.
    return Consumer(f"worker-{worker_id}", ROUTE.at(worker_id), inactive_threshold_s=DAY_S)


TABLE_BEGIN = "<!-- channels: generated by `python -m bus.topology --readme README.md` -->"
TABLE_END = "<!-- /channels -->"


def channel_table() -> str:
    return markdown_table(CHANNELS, ENDPOINTS)


def readme_table(text: str) -> str:
    """The table between the markers of a README's text."""
    return readme.section(text, TABLE_BEGIN, TABLE_END)


def main() -> None:
    readme.main(
        "The table of Laneway's channels, as markdown.", TABLE_BEGIN, TABLE_END, channel_table
    )


if __name__ == "__main__":
    main()
