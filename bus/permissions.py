"""Least privilege on the bus and in etcd, derived from the declared topology.

Each service role gets a NATS user whose permissions come from the channels of
:mod:`bus.topology`: a role named among a channel's producers may publish to it, one named among
its consumers may subscribe. On a channel with a subject per worker or instance, the role that
key stands for (a worker for ``{worker}``) gets only its own subject, unless the channel lists it
in ``publish_any`` (a prefill worker sends KV to its decode worker's). A subject naming two of
the same role names its reader first and its publisher last (``lw.prefilled.{worker}.
{prefill_worker}``): a publisher fills in its own id last, a reader its own first.

Added to that: the JetStream API calls each role makes, and no more. The admin makes every
stream, the object store's bucket and every durable (``laneway up``, before the services
start): no service may create, update, delete or purge a stream, as the server applies a
stream's ``subjects`` and ``republish`` itself, past any publish or subscribe permission. Nor
may a service make a durable: a consumer's deliveries go to the subject its create names, and
the server delivers there past the creator's permissions too. A service binds to its durable by
subscribing to the durable's own deliver subject and acks on it. What the server may still be
made to write anywhere (a reply to a request, an ordered consumer's deliveries) is in the
threat notes in docs/security.md.

Workers, ingress and kv-indexer instances therefore each have a user of their own; the planner's
replicas share one. The admin user (``laneway status``, recording, tests) may do everything.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal

from bus import readme
from bus.adapters import ADAPTERS_PREFIX
from bus.api_keys import KEYS_PREFIX
from bus.channels import Channel, Consumer, Endpoint, QueryEndpoint
from bus.credentials import inbox_prefix
from bus.registry import (
    INTAKE_AWAY_KEY,
    LEADER_KEY,
    PLANNERS_PREFIX,
    ROLES_PREFIX,
    WORKERS_PREFIX,
    claim_key,
    role_key,
)
from bus.sessions import SESSIONS_PREFIX
from bus.tenancy import TENANCY_PREFIX
from bus.topology import (
    CHANNELS,
    ENDPOINTS,
    INDEX_SNAPSHOTS,
    PLANNER_INTAKE,
    Subjects,
    bucket_stream,
    worker_routes,
)

Role = Literal["ingress", "planner", "kv-indexer", "worker", "admin"]
ROLES: tuple[Role, ...] = ("ingress", "planner", "kv-indexer", "worker", "admin")
# The role a subject key stands for.
KEY_ROLES: dict[str, Role] = {
    "worker": "worker",
    "prefill_worker": "worker",
    "ingress": "ingress",
    "indexer": "kv-indexer",
}
_INSTANCE = re.compile(r"[A-Za-z0-9_-]{1,64}")
_JS = "$JS.API"


@dataclass(frozen=True)
class Identity:
    """Who connects: a role, and for a role with subjects of its own, its key (worker id,
    ingress or indexer instance id)."""

    role: Role
    instance: str = ""

    def __post_init__(self) -> None:
        keyed = self.role in KEY_ROLES.values()
        if keyed != bool(self.instance):
            raise ValueError(f"a {self.role} {'needs' if keyed else 'takes no'} instance id")
        if self.instance and not _INSTANCE.fullmatch(self.instance):
            raise ValueError(f"an instance id is letters, digits, '_' or '-': {self.instance!r}")

    @property
    def user(self) -> str:
        return f"{self.role}-{self.instance}" if self.instance else self.role


@dataclass(frozen=True)
class NatsPermissions:
    publish: tuple[str, ...]
    subscribe: tuple[str, ...]
    # May answer requests it received (to the asker's inbox, once each).
    responds: bool = False

    def config(self) -> dict[str, Any]:
        """The user's ``permissions`` in a nats-server configuration."""
        found: dict[str, Any] = {
            "publish": {"allow": list(self.publish)},
            "subscribe": {"allow": list(self.subscribe)},
        }
        if self.responds:
            found["allow_responses"] = True
        return found


# Beyond the channels, the JetStream state each role uses. The planner folds the KV stream too
# (services/common/kv_follow.py, through bus/kv_source.py): it replays it and reads the
# indexer's snapshots, but writes none. A role replays only a stream it cannot write to, or its
# replay's deliveries (sent where it says) could carry words of its own.
_REPLAYS = {"kv-indexer": (Subjects.all_kv,), "planner": (Subjects.all_kv,)}
_OBJECT_STORES = {"kv-indexer": (INDEX_SNAPSHOTS,)}
_OBJECT_READS = {"planner": (INDEX_SNAPSHOTS,)}


# The roles that ask a stalled stream's leader to step down (bus.leaders): the streams a request
# waits on are theirs, and they run few.
_STEWARDS: tuple[Role, ...] = ("ingress", "planner")


def leader_step_downs(role: Role) -> tuple[str, ...]:
    """The streams whose leader ``role`` may ask to step down: those it publishes confirmed
    events into."""
    if role not in _STEWARDS:
        return ()
    streams = (
        c.stream.name
        for c in CHANNELS
        if c.delivery == "confirmed" and c.stream is not None and role in map(_role_of, c.producers)
    )
    return tuple(dict.fromkeys(streams))


def durable_step_downs(role: Role) -> tuple[Consumer[Any], ...]:
    """The durables whose leader ``role`` may ask to step down: the planners' intake, for the
    ingress that feeds it (a request it placed in the stream and no planner placed since)."""
    return (PLANNER_INTAKE,) if role == "ingress" else ()


def _durables(identity: Identity) -> tuple[Consumer[Any], ...]:
    if identity.role == "planner":
        return (PLANNER_INTAKE,)
    if identity.role == "worker":
        return (worker_routes(identity.instance),)
    return ()


def nats_permissions(identity: Identity) -> NatsPermissions:
    if identity.role == "admin":
        return NatsPermissions((">",), (">",))
    publish: list[str] = []
    subscribe: list[str] = [inbox_prefix(identity.user) + ".>"]
    responds = False
    declarations: tuple[Channel[Any] | Endpoint, ...] = (*CHANNELS, *ENDPOINTS)
    for declared in declarations:
        if identity.role in map(_role_of, declared.producers):
            publish.append(_subject(declared, identity, publishing=True))
        if identity.role in map(_role_of, declared.consumers):
            subscribe.append(_subject(declared, identity, publishing=False))
            # A query endpoint is answered by its consumers.
            responds |= isinstance(declared, QueryEndpoint)
    for consumer in _durables(identity):
        # The admin made it; its deliveries come on its own subject and are acked on theirs.
        publish.append(f"$JS.ACK.{consumer.stream.name}.{consumer.durable}.>")
        subscribe.append(consumer.deliver_subject)
    if identity.role == "planner":
        # Which server leads its intake: a replica leaves it to the others only when that is
        # not its own (services.planner.intake_gate).
        publish.append(f"{_JS}.CONSUMER.INFO.{PLANNER_INTAKE.stream.name}.{PLANNER_INTAKE.durable}")
    for topic in _REPLAYS.get(identity.role, ()):
        # An ordered consumer: ephemeral, unnamed (so any filter, on a stream it reads whole),
        # with flow control answered by the client; the stream's head tells how far behind.
        assert topic.stream is not None
        stream = topic.stream.name
        publish += [
            f"{_JS}.STREAM.INFO.{stream}",
            f"{_JS}.CONSUMER.CREATE.{stream}",
            f"$JS.FC.{stream}.>",
        ]
    publish += [f"{_JS}.STREAM.LEADER.STEPDOWN.{s}" for s in leader_step_downs(identity.role)]
    publish += [
        f"{_JS}.CONSUMER.LEADER.STEPDOWN.{c.stream.name}.{c.durable}"
        for c in durable_step_downs(identity.role)
    ]
    for bucket in _OBJECT_STORES.get(identity.role, ()):
        publish += _object_store(bucket)
    for bucket in _OBJECT_READS.get(identity.role, ()):
        publish += _object_reads(bucket)
    return NatsPermissions(
        tuple(dict.fromkeys(publish)),
        tuple(dict.fromkeys(subscribe)),
        responds=responds,
    )


def _object_store(bucket: str) -> list[str]:
    """Writing one JetStream object store's objects (the admin made its bucket): chunks and
    descriptions published to its subjects, and an object's old chunks purged once its new
    ones are in. Reading as for ``_object_reads``."""
    return [*_object_reads(bucket), f"{_JS}.STREAM.PURGE.{bucket_stream(bucket)}", f"$O.{bucket}.>"]


def _object_reads(bucket: str) -> list[str]:
    """Reading one JetStream object store's objects: its stream's settings, and each message
    (an object's description, then its chunks) fetched by subject. No consumer: its
    deliveries would go where the asker says, and a writer of the bucket could make them carry
    anything (bus.objects.load_object)."""
    stream = bucket_stream(bucket)
    return [f"{_JS}.STREAM.INFO.{stream}", f"{_JS}.STREAM.MSG.GET.{stream}"]


def _role_of(entry: str) -> str:
    """``"worker (prefill side)"`` → ``worker``: a channel names its roles first, then why."""
    return entry.split(maxsplit=1)[0]


def _subject(declared: Channel[Any] | Endpoint, identity: Identity, publishing: bool) -> str:
    """The key that names a publisher is the last, the one naming a reader the first (one key
    names both): where that key stands for the role, it is its own instance (a worker publishes
    tokens to ``lw.tok.*.<itself>``, an ingress reads ``lw.tok.<itself>.*``); any other key is
    any."""
    names = declared.key_names
    own = len(names) - 1 if publishing else 0
    if publishing and identity.role in declared.publish_any:
        own = -1
    tokens = tuple(
        identity.instance if i == own and KEY_ROLES.get(key) == identity.role else "*"
        for i, key in enumerate(names)
    )
    return declared.at(*tokens).subject if isinstance(declared, Channel) else declared.at(*tokens)


@dataclass(frozen=True)
class KeyGrant:
    """An etcd permission: ``key`` itself, or every key under it when ``prefix``."""

    key: bytes
    prefix: bool
    write: bool


def etcd_grants(identity: Identity) -> tuple[KeyGrant, ...]:
    """The keys a role reads or writes in etcd; nothing else is open to it."""
    workers = KeyGrant(WORKERS_PREFIX, prefix=True, write=False)
    match identity.role:
        case "worker":
            own = WORKERS_PREFIX + identity.instance.encode()
            return (
                KeyGrant(own, prefix=False, write=True),
                KeyGrant(role_key(identity.instance), prefix=True, write=False),
                KeyGrant(claim_key(identity.user), prefix=False, write=True),
            )
        case "planner":
            return (
                workers,
                KeyGrant(PLANNERS_PREFIX, prefix=True, write=True),
                KeyGrant(LEADER_KEY, prefix=False, write=True),
                KeyGrant(INTAKE_AWAY_KEY, prefix=False, write=True),
                KeyGrant(ROLES_PREFIX, prefix=True, write=True),
                KeyGrant(SESSIONS_PREFIX, prefix=True, write=True),
            )
        case "ingress":
            return (
                workers,
                KeyGrant(PLANNERS_PREFIX, prefix=True, write=False),
                KeyGrant(KEYS_PREFIX, prefix=True, write=False),
                # The LoRA adapters loaded and unloaded through its API (admin keys only).
                KeyGrant(ADAPTERS_PREFIX, prefix=True, write=True),
                # Each tenant's requests held by each replica: its limits hold cluster-wide.
                KeyGrant(TENANCY_PREFIX, prefix=True, write=True),
                KeyGrant(claim_key(identity.user), prefix=False, write=True),
            )
        case "kv-indexer":
            return (workers, KeyGrant(claim_key(identity.user), prefix=False, write=True))
        case "admin":
            return (KeyGrant(b"/laneway/", prefix=True, write=True),)


PERMISSIONS_BEGIN = (
    "<!-- permissions: generated by `python -m bus.permissions --readme docs/security.md` -->"
)
PERMISSIONS_END = "<!-- /permissions -->"
# The table shows each keyed role for an instance `{id}`, which no real id can spell.
_SAMPLE = "ID"


def permissions_table() -> str:
    rows = [
        "| NATS user | publishes | subscribes | etcd keys (rw: read and write) |",
        "| --- | --- | --- | --- |",
    ]
    for role in ROLES[:-1]:
        identity = Identity(role, _SAMPLE if role in KEY_ROLES.values() else "")
        found = nats_permissions(identity)
        keys = ", ".join(
            f"`{g.key.decode()}{'…' if g.prefix else ''}` {'rw' if g.write else 'r'}"
            for g in etcd_grants(identity)
        )
        cells = [
            _shown(identity.user),
            "<br>".join(_shown(s) for s in found.publish if not s.startswith("$JS.")),
            "<br>".join(_shown(s) for s in found.subscribe),
            keys.replace(_SAMPLE, "{id}"),
        ]
        rows.append("| " + " | ".join(cells) + " |")
    rows.append("| admin | everything | everything | `/laneway/…` rw |")
    return "\n".join(rows) + "\n"


def _shown(subject: str) -> str:
    tokens = [t.replace(_SAMPLE, "{id}") for t in subject.split(".")]
    return "`" + ".".join(tokens) + "`"


def main() -> None:
    readme.main(
        "Each service's NATS and etcd permissions, as markdown.",
        PERMISSIONS_BEGIN,
        PERMISSIONS_END,
        permissions_table,
    )


if __name__ == "__main__":
    main()
