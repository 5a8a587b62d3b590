"""Values under an etcd key that no reader here understands, skipped without flooding the log."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class Skipped:
    """Values under a key we read that no reader here understands (a foreign tool's write, a
    corrupted or older record): skipped, with one warning per key rather than one per read,
    so that one bad key neither stops a watch nor floods the log."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._keys: set[bytes] = set()

    def parse(self, key: bytes, value: bytes, parse: Callable[[bytes, bytes], T]) -> T | None:
        try:
            parsed = parse(key, value)
        except ValueError as exc:  # pydantic's ValidationError and UnicodeDecodeError are too
            if key not in self._keys:
                self._keys.add(key)
                log.warning(
                    "skipping %s at %r (%d bytes): %s",
                    self._what,
                    key[:200],
                    len(value),
                    str(exc).splitlines()[0][:200],
                )
            return None
        self.forget(key)  # a later bad value there is worth a warning again
        return parsed

    def forget(self, key: bytes) -> None:
        self._keys.discard(key)
