"""Free loopback ports for the servers a cluster starts, picked before those servers bind them."""

from __future__ import annotations

import contextlib
import os
import random
import socket
from collections import deque
from pathlib import Path


def free_port() -> int:
    return free_ports(1)[0]


# Ports come from just below the kernel's ephemeral range: one from inside it (what binding port 0
# gives) can be taken by an outgoing connection before its server binds it.
def unephemeral_ports() -> range | None:
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return range(low - 12_000, low) if low >= 13_024 else None


def _pickable() -> range | None:
    """``LANEWAY_PORT_RANGE`` (``LOW-HIGH``, both included) if set, else the ports below the
    ephemeral range. Processes that start clusters side by side, each in a range of its own, never
    pick the same port (a pick is free when made, and bound only later)."""
    given = os.environ.get("LANEWAY_PORT_RANGE")
    if not given:
        return unephemeral_ports()
    low, _, high = given.partition("-")
    try:
        ports = range(int(low), int(high) + 1)
    except ValueError:
        raise ValueError(f"LANEWAY_PORT_RANGE={given!r}: not LOW-HIGH") from None
    if not 1024 <= ports.start < ports.stop <= 65536:
        raise ValueError(f"LANEWAY_PORT_RANGE={given!r}: not within 1024-65535")
    return ports


# A port handed out is free when picked but bound later (a server not started yet): without this
# memory a second pick before that bind (the next service's metrics port, the cluster's HTTP
# port) could hand it out again.
_HANDED_OUT: deque[int] = deque(maxlen=4096)


def _bind_free(sock: socket.socket, ports: range | None) -> None:
    if ports is not None:
        for _ in range(64):
            port = random.choice(ports)
            if port in _HANDED_OUT:
                continue
            try:
                sock.bind(("127.0.0.1", port))
                return
            except OSError:  # in use: another pick
                continue
    sock.bind(("127.0.0.1", 0))


def keep_clear(port: int) -> None:
    """A port someone chose (the user's HTTP port) that a server binds later: never picked."""
    _HANDED_OUT.append(port)


def free_ports(count: int) -> list[int]:
    """``count`` distinct free ports, none handed out before by this process (of its last 4,096):
    held together while they are picked, so that none is handed out twice."""
    ports = _pickable()
    with contextlib.ExitStack() as held:
        socks = [held.enter_context(socket.socket()) for _ in range(count)]
        for sock in socks:
            _bind_free(sock, ports)
        picked = [int(sock.getsockname()[1]) for sock in socks]
    _HANDED_OUT.extend(picked)
    return picked
