"""The tenant records the ingress replicas share in etcd (services.ingress.shared_limits): each
replica's :class:`~services.ingress.limits.Holdings` as JSON, and a view of the others' as of a
revision, from a read or from a transaction's reply."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from services.ingress.limits import Holdings

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class View:
    """The other replicas' records of a tenant as of an etcd revision."""

    others: list[Holdings]
    revision: int

    @classmethod
    def of(cls, records: Iterable[tuple[bytes, Any]], key: bytes, revision: int) -> View:
        """From ``(value, key-value)`` pairs, leaving out this replica's own ``key``."""
        return cls([parsed(value) for value, meta in records if meta.key != key], revision)

    @classmethod
    def replied(cls, records: list[tuple[bytes, Any]], key: bytes) -> View | None:
        """From a transaction's read; None where it read nothing (no revision to go by)."""
        if not records:
            return None
        return cls.of(records, key, records[0][1].header.revision)


def encoded(holdings: Holdings) -> bytes:
    return json.dumps(holdings.to_json(), separators=(",", ":")).encode()


def parsed(value: bytes) -> Holdings:
    """Another replica's record; one that does not parse counts as nothing, not as a refusal of
    every request (only ingress replicas may write there)."""
    try:
        return Holdings.from_json(json.loads(value))
    except ValueError:
        log.warning("a tenant record in etcd does not parse; counted as empty")
        return Holdings()
