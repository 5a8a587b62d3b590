"""A bus that records what a worker publishes instead of sending it."""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from bus.channels import Topic


class RecordingBus:
    def __init__(self) -> None:
        self.sent: list[tuple[str, object]] = []

    @property
    def published(self) -> list[object]:
        return [event for _, event in self.sent]

    async def publish(self, topic: Topic[Any], event: object) -> None:
        self.sent.append((topic.subject, event))

    async def send_confirmed(
        self, topic: Topic[Any], event: object, retry: Callable[[Coroutine[Any, Any, None]], object]
    ) -> None:
        """Recorded as sent at once and confirmed: nothing is left to ``retry``."""
        self.sent.append((topic.subject, event))
