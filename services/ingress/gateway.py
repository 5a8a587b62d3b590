"""The only way the HTTP layer reaches the cluster; the live implementation speaks NATS."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Literal, Protocol

from schemas.events import RequestSpec, TerminalEvent, TokensGenerated

GatewayEvent = TokensGenerated | TerminalEvent
CancelReason = Literal["client_disconnected", "timeout"]


class Gateway(Protocol):
    def submit(
        self, request_id: str, session_id: str | None, spec: RequestSpec
    ) -> AsyncIterator[GatewayEvent]:
        """Hand a request to the cluster; iterating the result publishes it (RequestAccepted).

        Yields the request's token batches in order, then exactly one terminal event, then stops.
        The caller stops iterating at the terminal event, or earlier on timeout or disconnect,
        and always calls ``aclose()`` when the iterator has one (async generators do), so an
        implementation can release its subscription in a ``finally``.
        """
        ...

    async def cancel(self, request_id: str, reason: CancelReason) -> None:
        """Ask whoever holds the request to stop it; the caller no longer reads its events."""
        ...
