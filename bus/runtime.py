"""Process lifecycle shared by every service: logging, signals, orderly shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable

ServiceMain = Callable[[asyncio.Event], Awaitable[None]]


def run_service(main: ServiceMain, log_level: str = "INFO") -> None:
    """Run ``main(stop)`` until SIGINT/SIGTERM sets ``stop``; ``main`` then cleans up."""
    logging.basicConfig(
        level=log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    asyncio.run(runner())
