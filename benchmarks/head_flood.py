"""Keyless header flooding against a `laneway up` of its own (issue 36): the ingress's memory
and a keyed client's latency while clients without a key send huge heads, slow ones, and many
heads each just under the per-connection limit.

    python -m benchmarks.head_flood [--floods 3] [--flood-mib 100] [--slowloris 500]
                                     [--held 0] [--held-bytes 60000] [--held-pause-s 1]

Measures the median latency of sequential short completions (with the run's key) before, during
and after the attack, and the ingress's RSS before, at its peak (sampled every 50 ms) and after.
The attack: ``--floods`` connections each sending a request whose one header is ``--flood-mib``
MiB, and ``--slowloris`` connections each sending a request line, then a byte a second; each is
timed until the server closes it (the window ends at ``--window-s``, or when the floods end);
and ``--held`` connections each sending ``--held-bytes`` of a head and never its end, each made
again ``--held-pause-s`` after the server answers or closes it, until the window ends (what each
was answered is counted). The soft limit on open files is raised for the connections (the
ingress, started from here, inherits it). Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import socket
import statistics
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.live_cluster import laneway_up
from benchmarks.proc_stats import rss_mb

_MIB = 1 << 20
# Connections being made (connect, and the head sent) at once: a few thousand connect() calls at
# once overflow the listen backlog, and each waits out a SYN retransmission (1 s, then 3 s).
_CONNECTING = 256
_HELD_HEAD = b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Held: "


def raise_fd_limit(need: int) -> int:
    """This process's soft limit on open files raised to ``need`` where it is lower (up to the
    hard limit), for thousands of sockets; the processes it starts later inherit it. The soft
    limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        soft = need if hard == resource.RLIM_INFINITY else min(need, hard)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    return soft


def status_of(answer: bytes) -> str:
    """An HTTP answer's status code, or what came instead ("none": closed without a word)."""
    return answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/1.1 ") else "none"


async def _unfinished_head(
    port: int, head: bytes, connecting: asyncio.Semaphore, sent: asyncio.Event | None = None
) -> bytes:
    """One keyless connection sending ``head``, never its end (``sent`` set once it is in the
    kernel's hands): what the server answers, read to the connection's end (b"" where it closed
    without a word, or reset it). Closed when done, or when cancelled (the server holds it until
    then)."""
    async with connecting:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(head)
            await writer.drain()
        except ConnectionError:
            writer.close()
            return b""
        finally:
            if sent is not None:
                sent.set()
    try:
        return await reader.read()
    except ConnectionError:
        return b""
    finally:
        writer.close()


def unfinished_head(size: int) -> bytes:
    """A keyless request's head, ``size`` bytes of it, without its end."""
    return _HELD_HEAD + b"a" * (size - len(_HELD_HEAD))


@dataclass
class HeldHeads:
    """Keyless connections each holding an unfinished head, and what came of them."""

    held: list[asyncio.Task[bytes]] = field(default_factory=list)
    """Those the server neither answered nor closed: cancelling one closes it."""
    answers: list[bytes] = field(default_factory=list)
    """What the others were answered, each to its connection's end."""
    not_made: int = 0

    async def at_most(self, count: int, within_s: float) -> None:
        """Waits up to ``within_s`` for no more than ``count`` to be held, then moves those
        that ended since into ``answers`` or ``not_made``. On a busy host the server can go
        quiet for ``hold_heads``'s ``settle_s`` with heads still unread in its sockets; those
        are answered once it reads them."""
        deadline = time.monotonic() + within_s
        while sum(not task.done() for task in self.held) > count and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        held, self.held = self.held, []
        for task in held:
            self.add(task)

    def add(self, task: asyncio.Task[bytes]) -> None:
        """One connection counted by what has come of it so far."""
        if not task.done():
            self.held.append(task)
        elif task.exception() is not None:
            self.not_made += 1
        else:
            self.answers.append(task.result())

    async def close(self) -> None:
        for task in self.held:
            task.cancel()
        await asyncio.gather(*self.held, return_exceptions=True)


async def hold_heads(port: int, count: int, head_bytes: int, settle_s: float = 2.0) -> HeldHeads:
    """``count`` connections each sending ``head_bytes`` of a keyless request's head and never its
    end; once all have sent it and nothing has happened to any for ``settle_s`` (the server has
    read every head by then unless it is starved of CPU: see ``HeldHeads.at_most``, and holds
    those it has not answered), what came of them."""
    head = unfinished_head(head_bytes)
    connecting = asyncio.Semaphore(_CONNECTING)
    last = [time.monotonic()]
    sent = [asyncio.Event() for _ in range(count)]

    async def one(sent: asyncio.Event) -> bytes:
        try:
            return await _unfinished_head(port, head, connecting, sent)
        finally:
            sent.set()  # where the connection failed
            last[0] = time.monotonic()

    tasks = [asyncio.create_task(one(each)) for each in sent]
    for each in sent:
        await each.wait()
    last[0] = time.monotonic()
    while time.monotonic() - last[0] < settle_s:
        await asyncio.sleep(0.1)
    result = HeldHeads()
    for task in tasks:
        result.add(task)
    return result


def _flood(port: int, mib: int) -> dict[str, Any]:
    """One keyless request with a ``mib`` MiB header, sent until the server stops taking it."""
    start = time.monotonic()
    sent = 0
    reply = b""
    with socket.create_connection(("127.0.0.1", port), timeout=300) as sock:
        try:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nX-Flood: ")
            chunk = b"a" * _MIB
            for _ in range(mib):
                sock.sendall(chunk)
                sent += 1
            sock.sendall(b"\r\n\r\n")
        except OSError:
            pass
        try:
            while len(reply) < 4096 and (data := sock.recv(4096)):
                reply += data
        except OSError:
            pass
    return {"status": status_of(reply), "sent_mib": sent, "s": round(time.monotonic() - start, 2)}


async def _slowloris(port: int, count: int, window_s: float) -> dict[str, Any]:
    """``count`` connections each trickling a head a byte a second; when each was closed."""

    async def one() -> float | None:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            return 0.0
        start = time.monotonic()
        writer.write(b"POST /v1/chat/completions HTTP/1.1\r\n")
        try:
            while time.monotonic() - start < window_s:
                try:
                    if await asyncio.wait_for(reader.read(4096), 1.0) == b"":
                        return time.monotonic() - start
                except TimeoutError:
                    writer.write(b"X")
                    await writer.drain()
            return None
        except ConnectionError:
            return time.monotonic() - start
        finally:
            writer.close()

    closed = await asyncio.gather(*(one() for _ in range(count)))
    times = sorted(t for t in closed if t is not None)
    return {
        "connections": count,
        "closed": len(times),
        "open_at_window_end": count - len(times),
        "closed_after_s_median": round(statistics.median(times), 2) if times else None,
    }


async def _held_flood(
    port: int, count: int, head_bytes: int, pause_s: float, window_s: float
) -> dict[str, Any]:
    """``count`` connections each holding an unfinished head of ``head_bytes``, each made again
    ``pause_s`` after the server ends it, for ``window_s``: how each was ended."""
    head = unfinished_head(head_bytes)
    connecting = asyncio.Semaphore(_CONNECTING)
    ended: Counter[str] = Counter()
    end = time.monotonic() + window_s

    async def attacker() -> None:
        while (left := end - time.monotonic()) > 0:
            try:
                answer = await asyncio.wait_for(_unfinished_head(port, head, connecting), left)
            except TimeoutError:
                ended["open_at_window_end"] += 1
                return
            except OSError:
                ended["not_made"] += 1
            else:
                ended[status_of(answer)] += 1
            await asyncio.sleep(pause_s)

    await asyncio.gather(*(attacker() for _ in range(count)))
    return {"connections": count, "head_bytes": head_bytes, "ended": dict(ended)}


def _latencies_ms(client: httpx.Client, until: threading.Event | int) -> dict[str, Any]:
    """Sequential short completions, ``until`` of them or until the event is set: the median
    latency of those answered 200, and how the others were answered."""
    body = {"model": "laneway-sim", "prompt": "Once upon", "max_tokens": 4}
    served: list[float] = []
    refused: dict[str, int] = {}
    while not until.is_set() if isinstance(until, threading.Event) else len(served) < until:
        start = time.perf_counter()
        try:
            status = str(client.post("/completions", json=body).status_code)
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        if status == "200":
            served.append((time.perf_counter() - start) * 1000)
        else:
            refused[status] = refused.get(status, 0) + 1
    median = round(statistics.median(served), 2) if served else None
    return {"median": median, "served": len(served), "refused": refused}


def measure(args: argparse.Namespace) -> dict[str, Any]:
    fd_limit = raise_fd_limit(2 * (args.slowloris + args.held + args.floods) + 1024)
    with laneway_up(workers=1, speedup=1000.0) as up:
        pid = up.pids["ingress"]
        port = int(up.base_url.rsplit(":", 1)[1].split("/")[0])
        headers = {"Authorization": f"Bearer {up.api_key}"} if up.api_key else {}
        with httpx.Client(base_url=up.base_url, headers=headers, timeout=30) as client:
            _latencies_ms(client, 20)  # warm: connections, code paths
            before = _latencies_ms(client, args.requests)
            rss_before = rss_mb(pid) or 0.0
            peak = [rss_before]
            done = threading.Event()

            def sample() -> None:
                while not done.is_set():
                    peak[0] = max(peak[0], rss_mb(pid) or 0.0)
                    time.sleep(0.05)

            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            with ThreadPoolExecutor(args.floods + 3) as pool:
                floods = [pool.submit(_flood, port, args.flood_mib) for _ in range(args.floods)]
                slow = pool.submit(asyncio.run, _slowloris(port, args.slowloris, args.window_s))
                held = pool.submit(
                    asyncio.run,
                    _held_flood(port, args.held, args.held_bytes, args.held_pause_s, args.window_s),
                )
                attacked = threading.Event()

                def watch() -> None:
                    for future in [slow, held, *floods]:
                        future.exception()  # until it ends, either way
                    attacked.set()

                pool.submit(watch)
                during = _latencies_ms(client, attacked)
            time.sleep(2)
            rss_after = rss_mb(pid) or 0.0
            done.set()
            sampler.join()
            after = _latencies_ms(client, args.requests)
    return {
        "ingress_rss_mb": {
            "before": round(rss_before, 1),
            "peak": round(peak[0], 1),
            "after": round(rss_after, 1),
            "peak_growth": round(peak[0] - rss_before, 1),
        },
        "latency_ms": {"before": before, "during": during, "after": after},
        "floods": [f.result() for f in floods],
        "slowloris": slow.result(),
        "held": held.result(),
        "fd_limit": fd_limit,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.head_flood",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--floods", type=int, default=3)
    parser.add_argument("--flood-mib", type=int, default=100)
    parser.add_argument("--slowloris", type=int, default=500)
    parser.add_argument("--held", type=int, default=0)
    parser.add_argument("--held-bytes", type=int, default=60_000)
    parser.add_argument("--held-pause-s", type=float, default=1.0)
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--requests", type=int, default=50, help="sequential, before and after")
    print(json.dumps(measure(parser.parse_args(argv)), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
