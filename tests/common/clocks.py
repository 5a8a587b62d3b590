"""A listener's monotonic and wall clocks, moved together by a test."""

from __future__ import annotations


class Clocks:
    def __init__(self) -> None:
        self.now = 1000.0

    def mono(self) -> float:
        return self.now

    def wall(self) -> float:
        return 1_700_000_000.0 + self.now
