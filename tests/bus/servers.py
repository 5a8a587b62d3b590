"""What the bus's tests are given to connect to their server, a real or an in-memory one."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from bus.client import Bus

# A connection to the test's server, with the topology's streams, by name.
Connect = Callable[[str], Awaitable[Bus]]
