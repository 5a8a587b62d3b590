"""Start-up failures told in one line: a port already taken, a child that died while starting."""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import re
import socket
from pathlib import Path
from urllib.parse import urlsplit

from bus.runtime import FATAL_PREFIX
from infra.ports import keep_clear

# A cause longer than this is cut: it has to fit one line of a terminal or so.
_MAX_CAUSE = 300


class StartupError(RuntimeError):
    """Something kept the cluster from starting; the message is one line meant for the user."""


def check_port_free(host: str, port: int, what: str, flag: str) -> None:
    # SO_REUSEADDR as the servers set it, so that a socket lingering in TIME_WAIT does not count.
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError as exc:
            hint = "stop what uses it or " if exc.errno == errno.EADDRINUSE else ""
            raise StartupError(
                f"cannot listen on the {what} port {host}:{port} ({exc.strerror or exc}): "
                f"{hint}pass another {flag}"
            ) from None
    # Free now, bound only once its server starts: until then a pick for another server (the
    # embedded NATS, a metrics port) would find it free too, and one of the two binds would fail.
    keep_clear(port)


def check_reachable(addresses: str, default_port: int, what: str, flag: str) -> None:
    """A server given by the user (``nats://host:port`` or ``host:port``, comma-separated) must
    answer at one of its addresses, or the services would wait for it until the start times out."""
    causes = []
    for address in addresses.split(","):
        parts = urlsplit(address.strip() if "://" in address else "//" + address.strip())
        try:
            port = parts.port or default_port
            socket.create_connection((parts.hostname or "127.0.0.1", port), timeout=2).close()
            return
        except (OSError, ValueError) as exc:
            causes.append(f"{_shown(address)}: {getattr(exc, 'strerror', None) or exc}")
    raise StartupError(f"cannot reach {what} ({'; '.join(causes)}): start it or fix {flag}")


def _shown(address: str) -> str:
    """An address without the ``user:password@`` it may carry: the line it goes in is printed."""
    scheme, sep, rest = address.strip().partition("://")
    if not sep:
        scheme, rest = "", scheme
    return scheme + sep + rest.rpartition("@")[2]


def log_cause(log: Path) -> str | None:
    """The cause a child left at the end of its log, in one line: the service runner's fatal
    line if there is one, else the exception of the last Python traceback, else the last line (a
    server's own fatal message)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return None
    fatal = [line for line in lines if line.startswith(FATAL_PREFIX)]
    if fatal:
        cause = fatal[-1].removeprefix(FATAL_PREFIX)
    else:
        cause = _exception(lines) or _plain(next((ln for ln in reversed(lines) if ln.strip()), ""))
    cause = " ".join(cause.split())
    if not cause:
        return None
    return cause if len(cause) <= _MAX_CAUSE else cause[: _MAX_CAUSE - 1] + "…"


def _exception(lines: list[str]) -> str | None:
    # What follows the last traceback's frames (indented) is the exception and its message.
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent")]
    if not starts:
        return None
    rest = lines[starts[-1] + 1 :]
    message = list(itertools.dropwhile(lambda line: line.startswith(" "), rest))
    if not message:
        return None
    # A qualified name says nothing the class name does not (pydantic_core._pydantic_core.X).
    message[0] = re.sub(r"^[\w.]+\.(\w+)", r"\1", message[0])
    return " ".join(message)


def _plain(line: str) -> str:
    # etcd logs JSON: its message and error say it; other servers log plain text.
    with contextlib.suppress(ValueError):
        entry = json.loads(line)
        if isinstance(entry, dict) and "msg" in entry:
            error = entry.get("error")
            return f"{entry['msg']}: {error}" if error else str(entry["msg"])
    return line
