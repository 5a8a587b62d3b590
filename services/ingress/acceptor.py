"""uvicorn's server, taking every connection that is waiting at each turn of the event loop.

uvloop's server (libuv since 1.45) accepts one connection per turn of the loop. An ingress
serving thousands of streams turns its loop every few tens of milliseconds, so a burst of new
connections queued in the kernel (the listen backlog) is taken at a few dozen a second: a new
client waits there, invisible to admission and its deadline, for as long as the queue ahead of
it takes, and gets neither an answer nor a 429. Taken at once, every request meets admission,
which lets it in, queues it, or pushes it back.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import socket
import ssl
from collections.abc import Callable

import uvicorn

from services.ingress.coalesce import coalesced

log = logging.getLogger(__name__)

# Connections taken per turn of the loop: a flood cannot hold up the streams already served for
# long, and a loop turning every 50 ms still takes a few thousand a second.
ACCEPTS_PER_TURN = 128
# Out of file descriptors (or memory): how long to leave the backlog alone, as asyncio does.
RETRY_AFTER_S = 1.0
_EXHAUSTED = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


class _Acceptor:
    """Accepts on one listening socket from the loop's reader callback."""

    def __init__(
        self,
        sock: socket.socket,
        factory: Callable[[], asyncio.Protocol],
        ssl_context: ssl.SSLContext | None,
    ) -> None:
        self._sock = sock
        self._factory = factory
        self._ssl = ssl_context
        self._loop = asyncio.get_running_loop()
        # Connections whose set-up (a TLS handshake) is under way: tasks are weakly held.
        self._connecting: set[asyncio.Task[None]] = set()
        sock.setblocking(False)
        self._start()

    def _start(self) -> None:
        self._loop.add_reader(self._sock.fileno(), self._accept)

    def _accept(self) -> None:
        for _ in range(ACCEPTS_PER_TURN):
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno not in _EXHAUSTED:
                    raise
                log.warning("cannot accept connections (%s); again in %.0f s", exc, RETRY_AFTER_S)
                self._loop.remove_reader(self._sock.fileno())
                self._loop.call_later(RETRY_AFTER_S, self._start)
                return
            conn.setblocking(False)
            task = self._loop.create_task(self._connect(conn))
            self._connecting.add(task)
            task.add_done_callback(self._connecting.discard)

    async def _connect(self, conn: socket.socket) -> None:
        # The socket is the transport's from here: it closes it on a failure too.
        try:
            await self._loop.connect_accepted_socket(self._factory, conn, ssl=self._ssl)
        except (OSError, ssl.SSLError) as exc:  # gone already, or its TLS handshake failed
            log.debug("connection not set up: %s", exc)

    def close(self) -> None:
        self._loop.remove_reader(self._sock.fileno())
        for task in self._connecting:
            task.cancel()


class EagerAcceptServer(uvicorn.Server):
    """A ``uvicorn.Server`` whose given sockets are accepted from greedily (see the module)."""

    _acceptors: list[_Acceptor]

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        if sockets is None:
            raise ValueError("EagerAcceptServer serves the sockets it is given")
        # uvicorn's own start-up (lifespan, state) with no server of its own.
        await super().startup(sockets=[])
        config = self.config
        # Typed as a bare asyncio.Protocol; uvicorn's protocols take these keywords.
        factory = functools.partial(
            config.http_protocol_class,
            config=config,  # type: ignore[call-arg]
            server_state=self.server_state,
            app_state=self.lifespan.state,
        )
        for sock in sockets:
            # uvicorn's backlog, as its own server sets it on a socket given (a burst larger
            # than the socket's default of 128 would have its handshakes dropped and retried).
            sock.listen(config.backlog)
        self._acceptors = [_Acceptor(sock, coalesced(factory), config.ssl) for sock in sockets]

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for acceptor in getattr(self, "_acceptors", ()):
            acceptor.close()
        await super().shutdown(sockets=sockets)
