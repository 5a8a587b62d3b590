"""How far a long command has got, on stderr: a bar with an ETA on a terminal, plain lines
(every tenth of the way, and every few seconds) when stderr is a file or a pipe.

Standard output stays the command's result: reports and tables are never interleaved with it.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from types import TracebackType
from typing import TextIO

_BAR = 30
# A terminal redraws at most this often: a tight loop calling update() costs a clock read.
_REDRAW_S = 0.1


def _duration(seconds: float) -> str:
    minutes, secs = divmod(int(seconds + 0.5), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """``done`` of ``total`` units of ``label``'s work; a context manager that marks all of it
    done when its block ends without an exception. The clock runs from construction, or from a
    first ``update(0)`` when the work starts later."""

    def __init__(
        self,
        label: str,
        total: int,
        stream: TextIO | None = None,
        every_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._label = label
        self._total = max(total, 1)
        self._stream = stream if stream is not None else sys.stderr
        self._tty = self._stream.isatty()
        self._every_s = every_s
        self._clock = clock
        self._started = clock()
        self._done = 0
        self._shown: int | None = None
        self._shown_at = self._started
        self._width = 0

    def __enter__(self) -> Progress:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self._done = self._total
        if self._shown != self._done:
            self._show(self._clock())
        if self._tty:
            self._stream.write("\n")
            self._stream.flush()

    def update(self, done: int) -> None:
        self._done = max(self._done, min(done, self._total))
        now = self._clock()
        if self._shown is None:
            if done == 0:
                self._started = now
            due = True
        elif self._tty:
            due = now - self._shown_at >= _REDRAW_S
        else:
            tenth = self._done * 10 // self._total
            due = tenth > self._shown * 10 // self._total or now - self._shown_at >= self._every_s
        if due and self._shown != self._done:
            self._show(now)

    def _show(self, now: float) -> None:
        elapsed = now - self._started
        fraction = self._done / self._total
        left = elapsed * (self._total - self._done) / self._done if self._done else None
        status = (
            f"{self._done}/{self._total} ({fraction:.0%}), {_duration(elapsed)} elapsed, "
            f"ETA {'?' if left is None else _duration(left)}"
        )
        if self._tty:
            filled = int(fraction * _BAR)
            line = f"{self._label} [{'#' * filled}{'.' * (_BAR - filled)}] {status}"
            # Pad over a longer previous line instead of clearing it: one write per redraw.
            self._stream.write("\r" + line.ljust(self._width))
            self._width = len(line)
        else:
            self._stream.write(f"{self._label}: {status}\n")
        self._stream.flush()
        self._shown, self._shown_at = self._done, now
