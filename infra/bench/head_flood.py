"""Keyless header flooding against a `laneway up` of its own (issue 36): the ingress's memory
and a keyed client's latency while clients without a key send huge heads and slow ones.

    python -m infra.bench.head_flood [--floods 3] [--flood-mib 100] [--slowloris 500]

Measures the median latency of sequential short completions (with the run's key) before, during
and after the attack, and the ingress's RSS before, at its peak (sampled every 50 ms) and after.
The attack: ``--floods`` connections each sending a request whose one header is ``--flood-mib``
MiB, and ``--slowloris`` connections each sending a request line, then a byte a second; each is
timed until the server closes it (the window ends at ``--window-s``, or when the floods end).
Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx

from infra.bench.live_cluster import laneway_up
from infra.bench.proc_stats import rss_mb

_MIB = 1 << 20


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
    status = reply.split(b" ", 2)[1].decode() if reply.startswith(b"HTTP/1.1 ") else "none"
    return {"status": status, "sent_mib": sent, "s": round(time.monotonic() - start, 2)}


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
            with ThreadPoolExecutor(args.floods + 2) as pool:
                floods = [pool.submit(_flood, port, args.flood_mib) for _ in range(args.floods)]
                slow = pool.submit(asyncio.run, _slowloris(port, args.slowloris, args.window_s))
                attacked = threading.Event()

                def watch() -> None:
                    for future in [slow, *floods]:
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
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m infra.bench.head_flood",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--floods", type=int, default=3)
    parser.add_argument("--flood-mib", type=int, default=100)
    parser.add_argument("--slowloris", type=int, default=500)
    parser.add_argument("--window-s", type=float, default=20.0)
    parser.add_argument("--requests", type=int, default=50, help="sequential, before and after")
    print(json.dumps(measure(parser.parse_args(argv)), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
