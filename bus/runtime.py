"""Process lifecycle shared by every service: logging, signals, orderly shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Awaitable, Callable

ServiceMain = Callable[[asyncio.Event], Awaitable[None]]

# After SIGINT/SIGTERM, how long a service may take to wind down before it is cancelled: one
# still starting (say, waiting for a NATS server that never comes) never looks at `stop`.
SHUTDOWN_GRACE_S = 10.0


def run_service(main: ServiceMain, log_level: str = "INFO") -> None:
    """Run ``main(stop)`` until SIGINT/SIGTERM sets ``stop``; ``main`` then cleans up. A second
    signal, or the grace period running out, cancels it."""
    logging.basicConfig(
        level=log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )

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

    asyncio.run(runner())
