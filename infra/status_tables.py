"""``laneway status`` as one screen of text tables, from the dict ``infra.status`` gathers (the
same one ``--json`` prints)."""

from __future__ import annotations

from typing import Any

Row = list[str]


def _table(title: str, header: Row, rows: list[Row]) -> list[str]:
    if not rows:
        return [f"{title}: none"]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]

    def line(row: Row) -> str:
        return "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True))

    return [title, *("  " + line(r).rstrip() for r in [header, *rows])]


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024  # type: ignore[assignment]
    raise AssertionError("unreachable")


def _short(name: str) -> str:
    """Ids are 32 hex digits; 12 tell them apart on a screen (``--json`` has them whole)."""
    head, sep, tail = name.rpartition("-")
    return f"{head}{sep}{tail[:12]}" if len(tail) == 32 else name


def _opt(value: Any, fmt: str = "{}") -> str:
    return "-" if value is None else fmt.format(value)


def _health(found: dict[str, Any]) -> list[str]:
    rows: list[Row] = []
    for s in found["nats"]["servers"]:
        detail = s["error"] if not s["ok"] else f"nats-server {s['version']}"
        if s["ok"] and s["cluster"]:
            detail += f", cluster {s['cluster']} as {s['name']}"
        rows.append(["NATS", s["url"], "ok" if s["ok"] else "DOWN", detail])
    js = found["nats"]["jetstream"]
    if js is not None:
        detail = (
            f"{js['streams']} streams, {js['consumers']} consumers, "
            f"{_bytes(js['storage_bytes'])} file, {_bytes(js['memory_bytes'])} memory"
        )
        rows.append(
            [
                "JetStream",
                "",
                "on" if js["enabled"] else "OFF",
                detail if js["enabled"] else js["error"],
            ]
        )
    for m in found["etcd"]["members"]:
        detail = (
            m["error"]
            if not m["ok"]
            else (
                f"etcd {m['version']}, leader {m['leader']}, term {m['raft_term']}, "
                f"db {_bytes(m['db_bytes'])}"
            )
        )
        rows.append(["etcd", m["endpoint"], "ok" if m["ok"] else "DOWN", detail])
    return _table("HEALTH", ["server", "address", "state", "detail"], rows)


def _services(found: dict[str, Any]) -> list[str]:
    leader = found["planner"]["leader"]
    rows = []
    for s in found["services"]:
        note = s["seen_in"]
        if s["service"] == "planner":
            note += (
                f"; leader {_short(leader)}" if leader else "; no leader (only --autoscale elects)"
            )
        local = "-" if s["processes"] is None else f"{s['processes']} ({s['ready']} ready)"
        rows.append([s["service"], _opt(s["replicas"]), local, note])
    lines = _table("SERVICES", ["service", "replicas", "local procs", "seen in"], rows)
    capacity = found["planner"].get("capacity")
    if capacity is not None:
        lines.append(_capacity_line(capacity))
    for p in found["processes"]:
        if not p["alive"]:
            lines.append(f"  ! {p['name']} (pid {p['pid']}) is not running")
        elif p.get("ready") is False:
            lines.append(f"  ! {p['name']} (pid {p['pid']}): {p['readiness']}")
    return lines


def _capacity_line(c: dict[str, Any]) -> str:
    """The capacity loop's last look, a target out of reach first."""
    pool = f" ({c['model']})" if c["model"] else ""
    seen = (
        f"TTFT p95 {_opt(c['ttft_p95_ms'], '{:.0f}')}/{c['ttft_target_ms']:.0f} ms, "
        f"ITL p95 {_opt(c['itl_p95_ms'], '{:.1f}')}/{c['itl_target_ms']:.1f} ms, "
        f"{c['prefill_workers']}P+{c['decode_workers']}D, {c['age_s']:.0f}s ago"
    )
    if c["out_of_reach"]:
        targets = " and ".join(t.upper() for t in c["out_of_reach"])
        return f"  ! capacity{pool}: {targets} out of reach of any move: {c['reason']} ({seen})"
    return f"  capacity{pool}: {c['reason']} ({seen})"


def _workers(found: dict[str, Any]) -> list[str]:
    rows = []
    for w in found["workers"]:
        lease = f"{w['lease_ttl_left_s']}/{w['lease_granted_s']}s" if w["lease_granted_s"] else "-"
        kv = (
            f"{w['kv_blocks_used']}/{w['kv_blocks_total']} ({w['kv_usage']:.0%})"
            if "kv_usage" in w
            else "-"
        )
        rows.append(
            [
                _short(w["worker_id"]),
                w["model"],
                w["role"],
                "yes" if w["draining"] else "no",
                lease,
                _opt(w.get("running")),
                _opt(w.get("waiting")),
                kv,
                _opt(w.get("report_age_s"), "{:.1f}s"),
            ]
        )
    header = [
        "worker",
        "model",
        "role",
        "draining",
        "lease left",
        "running",
        "waiting",
        "kv blocks",
        "load age",
    ]
    return _table("WORKERS", header, rows)


def _streams(found: dict[str, Any]) -> list[str]:
    rows = [
        [
            s["name"],
            str(s["messages"]),
            _bytes(s["bytes"]),
            str(s["replicas"])
            if s["replicas_current"] is None
            else f"{s['replicas_current']}/{s['replicas']} current",
            _opt(s["leader"]),
            str(s["consumers"]),
        ]
        for s in found["streams"]
    ]
    return _table(
        "STREAMS", ["stream", "messages", "size", "replicas", "leader", "consumers"], rows
    )


def _consumers(found: dict[str, Any]) -> list[str]:
    rows = [
        [
            c["stream"],
            _short(c["name"]) + (" (worker gone)" if c["orphaned"] else "")
            if c["durable"]
            else f"(ordered) {c['filter']}",
            str(c["pending"]),
            str(c["ack_pending"]),
            str(c["redelivered"]),
        ]
        for c in found["consumers"]
    ]
    header = ["stream", "consumer", "pending", "unacked", "redelivered"]
    return _table("CONSUMERS (lag)", header, rows)


def render(found: dict[str, Any]) -> str:
    verdict = "healthy" if found["healthy"] else "DEGRADED"
    lines = [f"Laneway cluster ({found['source']}): {verdict}"]
    for section in (_health, _services, _workers, _streams, _consumers):
        lines += ["", *section(found)]
    return "\n".join(lines)
