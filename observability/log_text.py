"""Text from outside a process, made safe to write into a log line.

A URL path (``%0a`` decodes to a line feed), a model name or any other field a client chooses
may hold characters that end a log line, so that what follows reads as a line of its own (a
forged access-log entry with its own time and ``status=200``), or that move a terminal's cursor
or reorder what it shows. Each such character is written as an escape instead: ``\\n``, ``\\r``,
``\\t``, ``\\x1b``, ``\\u2028``. Backslashes are left as they are: an escape can then be mistaken
for the same characters sent literally, but neither starts a line.

``EscapingFormatter`` applies it to every message a service logs (``bus.runtime``), whoever
wrote the call; the access log also escapes spaces in its ``key=value`` fields.
"""

from __future__ import annotations

import logging
import re

# C0 and C1 controls with DEL, the Unicode line and paragraph separators, and the bidirectional
# embeddings, overrides and isolates (which reorder what a viewer shows).
_UNSAFE = "\x00-\x1f\x7f-\x9f\u2028-\u202e\u2066-\u2069"
_FOUND = re.compile(f"[{_UNSAFE}]")
# A space in a value would start another field of a ``key=value`` line.
_FOUND_IN_FIELD = re.compile(f"[{_UNSAFE} ]")
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
_ESCAPES = {
    ord(c): _SHORT.get(c, f"\\x{ord(c):02x}" if ord(c) < 0x100 else f"\\u{ord(c):04x}")
    for c in map(chr, range(0x2070))
    if _FOUND.fullmatch(c)
}
_FIELD_ESCAPES = {**_ESCAPES, ord(" "): "\\x20"}


def escaped(text: str, *, field: bool = False) -> str:
    """``text`` with each character that could end or forge a log line as an escape; with
    ``field``, spaces too (a value in a ``key=value`` line)."""
    # Most text has none: a search is a fraction of a translation's cost.
    if (_FOUND_IN_FIELD if field else _FOUND).search(text) is None:
        return text
    return text.translate(_FIELD_ESCAPES if field else _ESCAPES)


class EscapingFormatter(logging.Formatter):
    """A formatter whose messages are ``escaped``; a traceback after one keeps its lines."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        record.message = escaped(record.message)
        return super().formatMessage(record)
