"""The HTTP server's bounds on what a client sends before the app, and its key check, see it.

httptools reads a request's head (its request line and headers) in full before uvicorn hands
the request to the app, however large it is (it joins a header's pieces as they come) and
however slowly it comes (uvicorn's only timer runs between requests). So a client without a key
could make the ingress hold 100 MB per connection (the memory stayed taken after it left), or
hold a connection open for ever by sending its head a byte at a time. This protocol, uvicorn's
own with its input bounded, gives the parser no more than ``max_bytes`` of a head and no more
than ``max_headers`` headers: past either, the client is answered 431 and the connection closed,
and the bytes past the limit are read only to be dropped. A head not complete ``timeout_s``
after its connection opened or its first byte came is answered 408 (closed silently where
nothing came), and so is the rest of a body still coming after its answer went out (the key
check answers before reading it). A connection idle between requests is closed after uvicorn's
keep-alive timeout (``IngressSettings.keep_alive_s``).

Where a head begins in the read that ends the previous request (pipelined), it is counted from
the earliest place it may have begun (after the read's last blank line, or past its bodies'
bytes), so such a head may be refused a little early, never late. A body's read is fed whole
(cutting it would cost large bodies a tenth more time): a head that begins in it may reach the
parser past the limit, up to the read's size, and is refused, and dropped, at once.

Those bounds are per connection: 5,000 connections each holding a 60 KB head just under them
took the ingress from 74 to 403 MB. So what the heads still unfinished at the end of a read hold
is also summed over every connection of the server (one per ingress process), against
``buffer_bytes``: a connection whose head would take the sum past it is answered 503 with a
Retry-After and closed, and what its parser held is dropped at once. A head that comes whole in
one read (nearly every client's) is never held between reads, so it is served however full the
buffer is. What a connection holds is given back however its head ends: complete, refused, timed
out, or its connection closed.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any, ClassVar

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE, HttpToolsProtocol

from observability.drops import RateLimitedLog
from services.ingress.errors import ApiError, head_buffer_full, head_timeout, headers_too_large

log = RateLimitedLog(logging.getLogger(__name__))

# After a refusal, what the client still sends is read and dropped for this long, or up to this
# many bytes, before the connection closes: a socket closed with unread data is reset, and the
# reset can reach the client before it has read the answer.
_LINGER_S = 2.0
_LINGER_BYTES = 1 << 20


@dataclass(frozen=True, slots=True)
class HeadLimits:
    max_bytes: int = 64 * 1024
    """Largest request head: the request line and every header, their line ends included."""
    max_headers: int = 100
    timeout_s: float = 10.0
    """Seconds a head (and the rest of a body already answered) may take to arrive."""
    buffer_bytes: int = 32 * 1024 * 1024
    """What the unfinished heads of all the server's connections may hold together."""

    def __post_init__(self) -> None:
        if min(self.max_bytes, self.max_headers) < 1 or self.timeout_s <= 0:
            raise ValueError("the header limits and timeout must be positive")
        if self.buffer_bytes < self.max_bytes:
            # Else a head at the per-connection limit, arriving in pieces, could never be held.
            raise ValueError("the head buffer must be at least the largest head")


class HeadBuffer:
    """The bytes the unfinished heads of one server's connections hold, summed, and its limit."""

    __slots__ = ("held", "limit")

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.held = 0


class _TooManyHeaders(Exception):
    pass


class BoundedHeadProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with ``limits`` on each request's head (see the module)."""

    limits: ClassVar[HeadLimits] = HeadLimits()
    buffer: ClassVar[HeadBuffer] = HeadBuffer(limits.buffer_bytes)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Between a request's end and its successor's headers: the bytes fed and headers seen.
        self._in_head = True
        self._head_bytes = 0
        self._headers_seen = 0
        # In the piece being fed: whether a request began (and has not ended), its bodies' bytes.
        self._begun = False
        self._body_bytes = 0
        # What this connection's unfinished head holds of the server's buffer.
        self._held = 0
        # Runs while the server waits for a head, or for the rest of an answered body.
        self._read_timer: asyncio.TimerHandle | None = None
        # Refused: what comes is dropped until the connection closes.
        self._refused = False
        self._dropped = 0
        self._linger: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_read_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._hold(0)
        self._cancel_read_timer()
        if self._linger is not None:
            self._linger.cancel()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._refused:
            self._drop(len(data))
            return
        self._unset_keepalive_if_required()
        rest: bytes | memoryview = data
        while rest:
            piece = rest
            if self._in_head:
                room = self.limits.max_bytes - self._head_bytes
                if room <= 0:
                    self._refuse(headers_too_large(self.limits.max_bytes, self.limits.max_headers))
                    return
                if len(rest) > room:  # the parser gets no byte past the limit
                    view = memoryview(rest)
                    piece, rest = view[:room], view[room:]
                else:
                    rest = b""
                self._head_bytes += len(piece)
            else:
                rest = b""
            self._begun = False
            self._body_bytes = 0
            if not self._feed(piece):
                self._hold(0)  # refused, or the connection is another protocol's or closing
                return
            if self._begun and self._in_head:
                # A request began in this piece, after another ended in it or after a body's
                # end, and its head is not complete: counted from where it may have begun.
                self._head_bytes = _unfinished_head_bound(piece, self._body_bytes)
                if self._head_bytes > self.limits.max_bytes:  # begun in a body's read, uncut
                    self._refuse(headers_too_large(self.limits.max_bytes, self.limits.max_headers))
                    return
        # One comparison per read where the head came whole (or not at all).
        held = self._head_bytes if self._in_head else 0
        if held != self._held and not self._hold(held):
            log.warning(
                "buffer_full",
                "refused a request whose unfinished headers would take those of all connections "
                "past LANEWAY_HEAD_BUFFER_BYTES (%d bytes); many clients sending headers slowly?",
                self.buffer.limit,
            )
            self._refuse(head_buffer_full())
            return
        # A head begun, or the body of an answered request: both must end within the timeout.
        waiting = not self._in_head or self._head_bytes > 0
        if waiting and self._read_timer is None and not self._answering():
            self._arm_read_timer()

    def _feed(self, data: bytes | memoryview) -> bool:
        """uvicorn's ``data_received`` for one piece, a 431 for too many headers; whether the
        connection goes on."""
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            if self._headers_seen > self.limits.max_headers:
                self._refuse(headers_too_large(self.limits.max_bytes, self.limits.max_headers))
            else:
                msg = "Invalid HTTP request received."
                self.logger.warning(msg)
                self.send_400_response(msg)
            return False
        except httptools.HttpParserUpgrade:
            if self._should_upgrade():
                self.handle_websocket_upgrade()
            else:
                self._unsupported_upgrade_warning()
            return False
        return True

    def on_message_begin(self) -> None:
        self._begun = True
        super().on_message_begin()

    def on_body(self, body: bytes) -> None:
        self._body_bytes += len(body)
        super().on_body(body)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._headers_seen += 1
        if self._headers_seen > self.limits.max_headers:
            raise _TooManyHeaders  # the parser stops, and the request is never started
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._in_head = False
        # The app is in charge of the request from here (its own timeout, its body limit).
        self._cancel_read_timer()
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        super().on_message_complete()
        self._in_head = True
        self._begun = False
        self._head_bytes = self._headers_seen = 0
        if not self._answering():
            # The answer went out before the body was in (a refusal): uvicorn armed its idle
            # timer then, and the body's bytes unarmed it; it is idle from now.
            self._cancel_read_timer()
            if self.timeout_keep_alive_task is None and not self.transport.is_closing():
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # A head begun behind the answer gets the head's timeout from here, not the idle one.
        if (
            self._in_head
            and self._head_bytes
            and self._read_timer is None
            and not self._answering()
            and not self.transport.is_closing()
        ):
            self._unset_keepalive_if_required()
            self._arm_read_timer()

    def _answering(self) -> bool:
        """Whether a request of this connection is still being answered."""
        return bool(self.pipeline) or (self.cycle is not None and not self.cycle.response_complete)

    def _arm_read_timer(self) -> None:
        self._read_timer = self.loop.call_later(self.limits.timeout_s, self._read_timed_out)

    def _cancel_read_timer(self) -> None:
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self) -> None:
        self._read_timer = None
        if self._answering() or self.transport.is_closing():
            return  # armed again when the client sends more after the answer
        if self._in_head and self._head_bytes:
            self._refuse(head_timeout(self.limits.timeout_s))
        else:  # nothing of a request came, or the rest of a body already answered
            self.transport.close()

    def _hold(self, size: int) -> bool:
        """Hold ``size`` bytes of the server's buffer for this connection's head in place of what
        it held; False, holding what it held, where the buffer has no room for that."""
        more = size - self._held
        if more > 0 and self.buffer.held + more > self.buffer.limit:
            return False
        self.buffer.held += more
        self._held = size
        return True

    def _refuse(self, error: ApiError) -> None:
        """Answer ``error`` and close, or, where an earlier request of the connection is still
        being answered, close once it is; nothing more is parsed."""
        self._refused = True
        self._cancel_read_timer()
        self._hold(0)
        # Drop the unfinished head now, not when the connection closes (after the linger): the
        # parser joins a header's pieces, uvicorn the URL's and the headers so far. An answer
        # still in progress has its own copy of its headers, in its scope.
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.headers = []
        if self._answering():
            self.cycle.keep_alive = False
            return
        body = error.body()
        head = [STATUS_LINE[error.status]]
        for name, value in [*self.server_state.default_headers, *error.headers]:
            head += [name, b": ", value, b"\r\n"]
        head += [
            b"content-type: application/json\r\n",
            b"content-length: %d\r\n" % len(body),
            b"connection: close\r\n\r\n",
        ]
        self.transport.write(b"".join(head) + body)
        if self.transport.can_write_eof():
            self.transport.write_eof()  # the answer ends here; the client may stop sending
        self._linger = self.loop.call_later(_LINGER_S, self.transport.close)

    def _drop(self, size: int) -> None:
        self._dropped += size
        if self._dropped > _LINGER_BYTES and self._linger is not None:
            self.transport.close()


def _unfinished_head_bound(piece: bytes | memoryview, body_bytes: int) -> int:
    """At least the bytes of an unfinished head that began in ``piece`` (and so ends it): the
    lesser of what follows the piece's last blank line (a head ends with one, and so does a
    chunked body; the unfinished head has none) and the piece less the ``body_bytes`` the parser
    took of it (bodies come before the head). More only by the previous request's head or body,
    where it is in the piece too."""
    data = bytes(piece)  # a rare path: pipelined requests
    blank = data.rfind(b"\r\n\r\n")
    after_blank = len(data) - (blank + 4 if blank >= 0 else 0)
    return min(after_blank, len(data) - body_bytes)


def bounded_head_protocol(limits: HeadLimits) -> type[BoundedHeadProtocol]:
    """The protocol class for uvicorn's ``http`` setting, with these limits, and a buffer of its
    own that all its connections share."""
    attrs = {"limits": limits, "buffer": HeadBuffer(limits.buffer_bytes)}
    return type("BoundedHeadProtocol", (BoundedHeadProtocol,), attrs)
