"""Session ownership in etcd: which worker holds each conversation's cache, shared by every
planner replica."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import aetcd

from bus.registry import UNREACHABLE, Skipped

SESSIONS_PREFIX = b"/laneway/sessions/"


class SessionRefused(Exception):
    """etcd will not store or read a session's binding, and asking again will not change that
    (a key past its request limit, its space quota reached): the request must not be retried."""


@contextlib.contextmanager
def _refusals(session_id: str) -> Iterator[None]:
    try:
        yield
    except UNREACHABLE:
        raise  # etcd away for now: a retry may find it back
    except aetcd.exceptions.ClientError as exc:
        raise SessionRefused(
            f"etcd refused the binding of session {session_id[:64]!r}: {exc}"
        ) from exc


class SessionStore:
    """`sessions/<id>` → the worker that owns that conversation's cache, shared by every planner
    replica. A binding lives ``ttl_s`` after it was last set; an idle conversation's cache is
    likely evicted by then anyway. A binding that is no worker id is taken as no binding."""

    def __init__(self, client: aetcd.Client, ttl_s: int) -> None:
        self._client = client
        self._ttl_s = ttl_s
        self._skipped = Skipped("session binding")

    @staticmethod
    def key(session_id: str) -> bytes:
        return SESSIONS_PREFIX + session_id.encode()

    async def owner(self, session_id: str) -> str | None:
        key = self.key(session_id)
        with _refusals(session_id):
            found = await self._client.get(key)
        return self._owner(key, found.value) if found is not None else None

    async def claim(self, session_id: str, worker_id: str) -> str:
        """Bind the session to ``worker_id`` unless a replica bound it first; returns the owner."""
        key = self.key(session_id)
        tx = self._client.transactions
        with _refusals(session_id):
            lease = await self._client.lease(self._ttl_s)
            try:
                won, responses = await self._client.transaction(
                    compare=[tx.create(key) == 0],
                    success=[tx.put(key, worker_id.encode(), lease=lease)],
                    failure=[tx.get(key)],
                )
            except aetcd.exceptions.ClientError:
                with contextlib.suppress(aetcd.exceptions.ClientError):
                    await lease.revoke()
                raise
            if won:
                return worker_id
            await lease.revoke()
        ranges = responses[0] if responses else []
        return (self._owner(key, ranges[0][0]) if ranges else None) or worker_id

    async def move(self, session_id: str, worker_id: str) -> None:
        with _refusals(session_id):
            lease = await self._client.lease(self._ttl_s)
            await self._client.put(self.key(session_id), worker_id.encode(), lease=lease)

    def _owner(self, key: bytes, value: bytes) -> str | None:
        return self._skipped.parse(key, value, _worker_id)


def _worker_id(key: bytes, value: bytes) -> str:
    return value.decode()
