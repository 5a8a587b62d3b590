"""What a message on a topic carries for its handler, checked on the way in: an event that does
not decode, that names another publisher than its subject's, or that its channel does not carry
is dropped. Whoever may publish on a subject can send any number of such messages, so each drop
is counted, and logged now and then (:mod:`observability.drops`), not once per message."""

from __future__ import annotations

import logging
from typing import TypeVar

from bus.channels import Topic
from observability.drops import Drops, first_line
from schemas.codec import decode_event
from schemas.events import Envelope, Event

log = logging.getLogger(__name__)
drops = Drops(log)

E = TypeVar("E", bound=Envelope)


def for_handler(topic: Topic[E], event: Event, subject: str) -> E | None:
    """The event if the topic's handler takes its type and it can have come on ``subject``;
    None if not: a drop for a type the channel does not carry at all, or an event that names
    another publisher than its subject's."""
    if isinstance(event, topic.events):
        wrong = topic.impostor(event, subject)
        if wrong is None:
            return event
        drops("impostor", "dropping a %s on %s: %s", event.type, subject, wrong)
        return None
    if not isinstance(event, topic.carried):
        drops("stray", "dropping a %s on %s: the channel does not carry it", event.type, subject)
    return None


def undecodable(subject: str, error: Exception, done: str = "dropping") -> None:
    drops("undecodable", "%s an undecodable message on %s: %s", done, subject, first_line(error))


def received(topic: Topic[E], data: bytes, subject: str) -> E | None:
    """The event a message on ``topic`` carries, if its handler takes it (see for_handler);
    None, a drop, for one that does not decode."""
    try:
        event = decode_event(data)
    except ValueError as error:  # pydantic's ValidationError is one
        undecodable(subject, error)
        return None
    return for_handler(topic, event, subject)
