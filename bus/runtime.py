"""Process lifecycle shared by every service: logging, signals, orderly shutdown, and a failure
told in one line."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable

import uvloop

from observability.log_text import EscapingFormatter

ServiceMain = Callable[[asyncio.Event], Awaitable[None]]

# After SIGINT/SIGTERM, how long a service may take to wind down before it is cancelled: one
# still starting (say, waiting for a NATS server that never comes) never looks at `stop`.
SHUTDOWN_GRACE_S = 10.0

# A service that fails ends its output with one line starting so; whoever started it (laneway
# up) reports that line instead of a traceback.
FATAL_PREFIX = "laneway fatal: "

logger = logging.getLogger(__name__)

# uvloop's loop (libuv) or the standard library's: with uvloop a live request costs the services
# about a sixth less CPU (c=32 streams, 4 sim workers). "asyncio" is for debugging (asyncio's
# debug mode, tools that hook its loop).
EVENT_LOOP_ENV = "LANEWAY_EVENT_LOOP"


def without_websockets() -> None:
    """Called by a service's entry point before anything imports nats-py: its optional websocket
    transport imports aiohttp, and with it an SSL context, at a fifth of a cluster's start (4.2
    against 3.4 s, `LocalCluster.start` of 2 workers on 2 cores), while no service connects over
    a websocket. A process that has aiohttp imported already keeps it; one that imports it after
    this call gets ImportError, so nothing but an entry point calls it."""
    sys.modules.setdefault("aiohttp", None)  # type: ignore[arg-type]


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop]:
    chosen = os.environ.get(EVENT_LOOP_ENV, "uvloop")
    if chosen == "uvloop":
        return uvloop.new_event_loop
    if chosen == "asyncio":
        return asyncio.new_event_loop
    raise ValueError(f"{EVENT_LOOP_ENV} is uvloop or asyncio, not {chosen!r}")


def run_service(main: ServiceMain, log_level: str = "INFO") -> None:
    """Run ``main(stop)`` until SIGINT/SIGTERM sets ``stop``; ``main`` then cleans up. A second
    signal, or the grace period running out, cancels it. If ``main`` fails, the process says why
    in one line and exits with code 1."""
    # Every message escaped: what a client or another service sends (a URL path, a model name,
    # an error quoting its input) must not end a line and start a forged one.
    handler = logging.StreamHandler()
    handler.setFormatter(EscapingFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    logging.basicConfig(level=log_level.upper(), handlers=[handler])
    last_error = _LastError()
    logging.getLogger().addHandler(last_error)

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(main(stop))

        def force_stop() -> None:
            # Some libraries swallow one cancellation while they clean up (nats-py's connect loop
            # does): keep cancelling until the task is really gone.
            if not task.done():
                task.cancel()
                loop.call_later(0.2, force_stop)

        def on_signal() -> None:
            if stop.is_set():
                force_stop()
                return
            stop.set()
            loop.call_later(SHUTDOWN_GRACE_S, force_stop)

        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, on_signal)
        with contextlib.suppress(asyncio.CancelledError):
            await task

    # Each request allocates thousands of short-lived objects (events, dicts, tasks): with
    # Python's default of a young collection every 700 allocations, the collector took 4 to 14 %
    # of the ingress's CPU per request (three alternating runs at c=32).
    gc.set_threshold(50_000, 50, 100)
    try:
        with asyncio.Runner(loop_factory=loop_factory()) as run:
            run.run(runner())
    except SystemExit as exc:
        # A library that gives up exits (uvicorn does), having logged why just before.
        if exc.code not in (None, 0):
            _fatal(f"{last_error.message or 'exited'} (exit code {exc.code})")
        raise
    except Exception as exc:
        # The environment's refusals (a port taken, a server not there) need no traceback;
        # anything else is a bug, and its traceback goes to the log.
        if not isinstance(exc, OSError):
            logger.exception("service failed")
        _fatal(f"{type(exc).__name__}: {exc}")
        raise SystemExit(1) from None


class _LastError(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.message = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.message = record.getMessage()


def _fatal(cause: str) -> None:
    print(FATAL_PREFIX + " ".join(cause.split()), file=sys.stderr, flush=True)
