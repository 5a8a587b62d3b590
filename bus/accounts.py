"""The NATS accounts Laneway's users live in, and what crosses between them, derived from the
declared channels (:mod:`bus.topology`).

Within one account nothing checks a reply subject: a stream's acknowledgement of a publish, and
any answer of the JetStream API or of a service, goes to whatever subject the request named, and
a stream stores it like anything else published there. So one worker's connection could have the
server write its acknowledgements onto ``lw.req.accepted``: about 111,000 a second emptied
``LW_REQUESTS`` and queued junk at the planners' durable until every request waited a minute.
Workers, which run the engines and so what users bring, are the least trusted identities: they
live in an account of their own (``WORKERS``), and the other services, the streams and the admin
in ``LANEWAY``. Between the two only the channels' subjects cross, each the way its traffic
needs:

- what a worker publishes that a stream keeps (terminals, KV events, load reports, hand-offs) is
  a *service* the streams' account exports: the server rewrites its reply subject to one of its
  own on the way, so an acknowledgement finds its way back and can be sent nowhere else;
- what a worker publishes that nothing keeps (token batches) is a *stream* the workers' account
  exports; no one in ``LANEWAY`` answers those;
- what workers hear from the other services (cancellations) is a stream ``LANEWAY`` exports, and
  their durables' deliveries too, with the acknowledgements a service ``LANEWAY`` exports;
- what the other services ask of a worker (resends) is a service ``WORKERS`` exports.

A worker then has no JetStream API at all (its account has no JetStream), and nothing it sends
reaches a subject of ``LANEWAY`` that it does not publish to by its own permissions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from bus.channels import Channel, Endpoint
from bus.topology import CHANNELS, ENDPOINTS, worker_routes

Account = Literal["LANEWAY", "WORKERS"]
ACCOUNTS: tuple[Account, ...] = ("LANEWAY", "WORKERS")
# The role whose users live in ``WORKERS``; every other role's live in ``LANEWAY``.
_WORKER = "worker"
# Names a channel lists among its producers or consumers that are roles with users.
_ROLES = frozenset({"ingress", "planner", "kv-indexer", "worker"})


def account_of(role: str) -> Account:
    return "WORKERS" if role == _WORKER else "LANEWAY"


@dataclass
class Links:
    """One account's ``exports`` and ``imports`` in a nats-server configuration."""

    exports: list[dict[str, Any]] = field(default_factory=list)
    imports: list[dict[str, Any]] = field(default_factory=list)


def account_links() -> dict[Account, Links]:
    """What each account exports and imports: the channels and endpoints that a worker and
    another role share, and the workers' durables."""
    links: dict[Account, Links] = {account: Links() for account in ACCOUNTS}

    def share(kind: str, subject: str, source: Account) -> None:
        target: Account = "LANEWAY" if source == "WORKERS" else "WORKERS"
        links[source].exports.append({kind: subject})
        links[target].imports.append({kind: {"account": source, "subject": subject}})

    durable = worker_routes("*")
    declared: tuple[Channel[Any] | Endpoint, ...] = (*CHANNELS, *ENDPOINTS)
    for item in declared:
        producers, consumers = _roles(item.producers), _roles(item.consumers)
        subject = item.every.subject if isinstance(item, Channel) else item.at()
        stored = isinstance(item, Channel) and item.stream is not None
        if _WORKER in producers and (stored or consumers - {_WORKER}):
            if isinstance(item, Endpoint):
                raise ValueError(f"{item.pattern}: a worker asking the other services")
            # Stored: the streams (and any reader) answer through the server's own reply.
            share("service" if stored else "stream", subject, "LANEWAY" if stored else "WORKERS")
        if producers - {_WORKER} and _WORKER in consumers:
            if isinstance(item, Endpoint):
                share("service", subject, "WORKERS")
            elif item is not durable.topic.channels[0]:  # routes come through the durable
                share("stream", subject, "LANEWAY")
    # A worker's durable delivers on its own subject (``_lw.deliver.<durable>``: the planners'
    # too, which no worker may subscribe to) and is acked on its acknowledgements'.
    deliveries = durable.deliver_subject.rpartition(".")[0] + ".*"
    share("stream", deliveries, "LANEWAY")
    share("service", f"$JS.ACK.{durable.stream.name}.*.>", "LANEWAY")
    return links


def _roles(entries: tuple[str, ...]) -> set[str]:
    """``("worker (prefill side)", "bench")`` → ``{"worker"}``: a channel names its roles first,
    then why; readers that are not services (bench, operators) have no users."""
    return {entry.split(maxsplit=1)[0] for entry in entries} & _ROLES
