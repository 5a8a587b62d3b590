"""Hosts made of network namespaces on this machine, for the multi-host chaos suite: each host a
namespace with one veth link (``eth0``, 10.77.0.<n>/24) to a bridge in a switch namespace of its
own, a client namespace beside them, and the faults a network can have: a host's link down, a
slow link (a token bucket: this kernel has no netem), and a one-way cut (what goes to a host
dropped, what it sends still delivered). Nothing is made outside the namespaces, which are
removed at the end with every process started in them.

A thread of the test's own process can work inside a namespace (``in_namespace``: Linux gives
each thread its network namespace), so the client and the test's calls to the servers need no
process of their own."""

from __future__ import annotations

import ctypes
import os
import re
import subprocess
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from infra.embedded import die_with_parent

T = TypeVar("T")

_CLONE_NEWNET = 0x40000000
_LIBC = ctypes.CDLL(None, use_errno=True)
SUBNET = "10.77.0"


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


def _tc(namespace: str, *args: str) -> None:
    subprocess.run(
        ["ip", "netns", "exec", namespace, "tc", *args], check=True, capture_output=True, timeout=30
    )


def _remove_stale(prefix: str) -> None:
    """Namespaces an earlier run left (killed before its end), named ``lw<its pid>…``."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    for line in listed.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        pid = re.match(r"lw(\d+)", name)
        if pid and not name.startswith(prefix) and not Path(f"/proc/{pid[1]}").exists():
            subprocess.run(["ip", "netns", "del", name], check=False, capture_output=True)


def can_make_namespaces() -> bool:
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, check=False)
    return os.geteuid() == 0 and listed.returncode == 0


class Hosts:
    """``count`` hosts and a client, named ``<prefix>h<i>`` and ``<prefix>c``."""

    def __init__(self, prefix: str, count: int, logs: Path) -> None:
        self.prefix, self.count, self.logs = prefix, count, logs
        self.switch = f"{prefix}sw"
        self.hosts = [f"{prefix}h{i}" for i in range(count)]
        self.client = f"{prefix}c"
        self.procs: list[subprocess.Popen[bytes]] = []

    def address(self, i: int) -> str:
        return f"{SUBNET}.{i + 1}"

    def _port(self, i: int | None) -> str:
        return f"v{'c' if i is None else i}"

    def make(self) -> None:
        _remove_stale(self.prefix)
        _ip("netns", "add", self.switch)
        _ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.switch, "link", "set", "br0", "up")
        _ip("-n", self.switch, "link", "set", "lo", "up")
        ends: list[tuple[str, int | None, str]] = [
            (name, i, self.address(i)) for i, name in enumerate(self.hosts)
        ]
        ends.append((self.client, None, f"{SUBNET}.100"))
        for namespace, i, address in ends:
            port = self._port(i)
            _ip("netns", "add", namespace)
            _ip(
                *("link", "add", port, "netns", self.switch, "type", "veth"),
                *("peer", "name", "eth0", "netns", namespace),
            )
            _ip("-n", self.switch, "link", "set", port, "master", "br0", "up")
            _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", namespace, "link", "set", "eth0", "up")
            _ip("-n", namespace, "link", "set", "lo", "up")

    def remove(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            proc.wait()
        for namespace in [*self.hosts, self.client, self.switch]:
            subprocess.run(["ip", "netns", "del", namespace], check=False, capture_output=True)

    def spawn(
        self, i: int, name: str, argv: list[str], env: dict[str, str]
    ) -> subprocess.Popen[bytes]:
        """``argv`` run on host ``i``, its output in ``<logs>/<name>.log``."""
        self.logs.mkdir(parents=True, exist_ok=True)
        with open(self.logs / f"{name}.log", "ab") as log:
            proc = subprocess.Popen(
                ["ip", "netns", "exec", self.hosts[i], *argv],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=die_with_parent(),  # kept across ip's exec of the command
            )
        self.procs.append(proc)
        return proc

    # -- faults, each undone by ``heal`` ------------------------------------------------------

    def cut(self, i: int) -> None:
        """Host ``i``'s link down: nothing goes to it or comes from it."""
        _ip("-n", self.switch, "link", "set", self._port(i), "down")

    def slow(self, i: int, rate: str = "512kbit", latency: str = "300ms") -> None:
        """Host ``i``'s link a token bucket each way: ``rate``, a queue of ``latency``, and
        what does not fit dropped."""
        for namespace, dev in ((self.switch, self._port(i)), (self.hosts[i], "eth0")):
            _tc(
                namespace,
                *("qdisc", "add", "dev", dev, "root", "tbf"),
                *("rate", rate, "burst", "16kb", "latency", latency),
            )

    def deaf(self, i: int) -> None:
        """What goes to host ``i`` is dropped; what it sends still arrives: a queue of no
        packets on the switch's side of its link (this kernel has neither the prio qdisc nor
        tc actions, so no drop filter)."""
        _tc(self.switch, "qdisc", "add", "dev", self._port(i), "root", "pfifo", "limit", "0")

    def heal(self, i: int) -> None:
        _ip("-n", self.switch, "link", "set", self._port(i), "up")
        for namespace, dev in ((self.switch, self._port(i)), (self.hosts[i], "eth0")):
            subprocess.run(
                ["ip", "netns", "exec", namespace, "tc", "qdisc", "del", "dev", dev, "root"],
                check=False,
                capture_output=True,
            )


def in_namespace(namespace: str, work: Callable[[], T]) -> T:
    """``work()`` run on a thread of its own that lives in ``namespace`` (its sockets are
    there); an async one is given ``asyncio.run``."""

    def run() -> T:
        fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
        try:
            if _LIBC.setns(fd, _CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {namespace}")
        finally:
            os.close(fd)
        return work()

    with ThreadPoolExecutor(1) as pool:
        return pool.submit(run).result()
