"""`laneway explain REQUEST_ID`: why a request went where it went, from the log alone: its
timeline, every candidate the planner weighed with the terms of its cost, the session owner, the
reason, the policy and its turn, and the trace to look it up by."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import datetime, timedelta
from typing import Any

from infra.debug.log import (
    MIN_PREFIX,
    LogIndex,
    RequestLog,
    add_source_arguments,
    bare_id,
    load,
)
from infra.recording import RecordingError
from schemas.events import (
    Envelope,
    RequestCancelled,
    RequestFailed,
    RequestFinished,
    RouteCandidate,
)

# A candidate's terms, in the order the table shows them (the JSON has the same names).
TERMS = (
    "cached_blocks",
    "running",
    "waiting",
    "in_flight",
    "kv_usage",
    "waiting_prefill_tokens",
    "owns_session",
    "kv_handoff",
    "lora_resident",
    "predicted_queue_ms",
    "predicted_prefill_ms",
    "cost",
)
_HEADINGS = {
    "cached_blocks": "cached",
    "waiting_prefill_tokens": "queued_tok",
    "owns_session": "owner",
    "kv_handoff": "handoff",
    "lora_resident": "adapter",
    "predicted_queue_ms": "queue_ms",
    "predicted_prefill_ms": "prefill_ms",
}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    explain = sub.add_parser(
        "explain", help="why a request went where it went: timeline, candidates, costs"
    )
    explain.add_argument("request_id", help="the request's id (as the API returned it)")
    add_source_arguments(explain)
    explain.add_argument("--json", action="store_true", help="print JSON instead of text")
    explain.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    try:
        log = load(args, bare_id(args.request_id))
        explained = explain(log, args.request_id)
    except RecordingError as err:
        print(f"laneway explain: {err}", file=sys.stderr)
        return 2
    print(json.dumps(explained, indent=2) if args.json else render(explained))
    return 0


def explain(log: LogIndex, request_id: str) -> dict[str, Any]:
    found = log.find(request_id)
    if found is None:
        many = log.starting_with(request_id)
        if many and len(bare_id(request_id)) < MIN_PREFIX:
            raise RecordingError(f"give at least {MIN_PREFIX} characters of the request id")
        if many > 1:
            raise RecordingError(f"{many} requests' ids start with {request_id}: give more of it")
        raise RecordingError(f"no request {request_id} in this log")
    route = found.route
    config = log.config_of(route) if route is not None else None
    out: dict[str, Any] = {
        "request_id": found.request_id,
        "session_id": _first(found).session_id,
        "trace_id": _trace_id(found),
        "timeline": timeline(found),
        "candidates": [],
        "prefill": None,
    }
    if found.accepted is not None:
        spec = found.accepted.spec
        out["prompt_tokens"] = spec.prompt_length
        out["max_tokens"] = spec.sampling.max_tokens
        out["model"], out["lora"] = spec.model, spec.lora
    if route is None:
        return out
    out |= {
        "worker_id": route.worker_id,
        "policy": route.policy,
        "policy_turn": route.policy_turn,
        "planner": route.source,
        "planner_version": config.version if config is not None else None,
        "reason": route.reason,
        "session_owner": next((c.worker_id for c in route.candidates if c.owns_session), None),
        "candidates": [_candidate(c, c.worker_id == route.worker_id) for c in route.candidates],
    }
    if route.prefill is not None:
        chosen = route.prefill.prefill_worker_id
        out["prefill"] = {
            "prefill_worker_id": chosen,
            "local_ms": route.prefill.local_ms,
            "remote_ms": route.prefill.remote_ms,
            "reason": route.prefill.reason,
            "candidates": [_candidate(c, c.worker_id == chosen) for c in route.prefill.candidates],
        }
    return out


def _first(log: RequestLog) -> Envelope:
    first = log.accepted or log.route or log.terminal
    assert first is not None, "a request in the index has at least one event"
    return first


def _trace_id(log: RequestLog) -> str | None:
    """The OpenTelemetry trace id: the middle field of the W3C traceparent the request carried."""
    for event in (log.accepted, log.route, log.terminal):
        if event is not None and event.trace is not None:
            parts = event.trace.traceparent.split("-")
            return parts[1] if len(parts) == 4 else event.trace.traceparent
    return None


def _candidate(candidate: RouteCandidate, chosen: bool) -> dict[str, Any]:
    values = candidate.model_dump()
    return {
        "worker_id": candidate.worker_id,
        "chosen": chosen,
        **{term: values[term] for term in TERMS},
        "block_size": candidate.block_size,
        "kv_capacity_tokens": candidate.kv_capacity_tokens,
    }


def timeline(log: RequestLog) -> list[dict[str, Any]]:
    """Each step of the request with the time it happened, in order."""
    steps: list[tuple[datetime, dict[str, Any]]] = []
    if log.accepted is not None:
        spec = log.accepted.spec
        steps.append(
            _step(
                log.accepted.occurred_at,
                "accepted",
                by=log.accepted.source,
                prompt_tokens=spec.prompt_length,
                max_tokens=spec.sampling.max_tokens,
            )
        )
    if log.route is not None:
        remote = log.route.prefill.prefill_worker_id if log.route.prefill is not None else None
        steps.append(
            _step(
                log.route.occurred_at,
                "routed",
                by=log.route.source,
                worker_id=log.route.worker_id,
                prefill_worker_id=remote,
            )
        )
    for done in log.prefill_completed:
        steps.append(
            _step(
                done.occurred_at,
                "prefill_completed",
                worker_id=done.worker_id,
                decode_worker_id=done.decode_worker_id,
                prefilled_tokens=done.prefilled_tokens,
                cached_tokens=done.cached_tokens,
                error=done.error,
            )
        )
    for moved in log.transferred:
        steps.append(
            _step(
                moved.occurred_at,
                "kv_transferred",
                from_worker_id=moved.from_worker_id,
                to_worker_id=moved.to_worker_id,
                blocks=len(moved.block_hashes),
                transfer_ms=moved.transfer_ms,
            )
        )
    if log.cancel_requested is not None:
        asked = log.cancel_requested
        steps.append(_step(asked.occurred_at, "cancel_requested", reason=asked.reason))
    steps += _terminal_steps(log)
    steps.sort(key=lambda s: s[0])
    start = steps[0][0] if steps else None
    return [
        {**step, "at_ms": round((when - start).total_seconds() * 1000, 3) if start else 0.0}
        for when, step in steps
    ]


def _terminal_steps(log: RequestLog) -> list[tuple[datetime, dict[str, Any]]]:
    end = log.terminal
    if isinstance(end, RequestFinished):
        # The worker times both from the moment it received the route.
        received = end.occurred_at - timedelta(milliseconds=end.e2e_ms)
        return [
            _step(
                received + timedelta(milliseconds=end.ttft_ms),
                "first_token",
                worker_id=end.worker_id,
                ttft_ms=end.ttft_ms,
            ),
            _step(
                end.occurred_at,
                "finished",
                worker_id=end.worker_id,
                finish_reason=end.finish_reason,
                completion_tokens=end.usage.completion_tokens,
                cached_tokens=end.usage.cached_tokens,
                e2e_ms=end.e2e_ms,
            ),
        ]
    if isinstance(end, RequestFailed):
        return [
            _step(
                end.occurred_at,
                "failed",
                by=end.source,
                worker_id=end.worker_id,
                code=end.code,
                message=end.message,
            )
        ]
    if isinstance(end, RequestCancelled):
        return [
            _step(
                end.occurred_at,
                "cancelled",
                worker_id=end.worker_id,
                reason=end.reason,
                completion_tokens=end.completion_tokens,
            )
        ]
    return []


def _step(when: datetime, event: str, **details: Any) -> tuple[datetime, dict[str, Any]]:
    return when, {"event": event, "time": when.isoformat(), **details}


def render(explained: dict[str, Any]) -> str:
    lines = [f"request {explained['request_id']}"]
    for label, key in (("session", "session_id"), ("trace id", "trace_id")):
        if explained.get(key):
            lines.append(f"  {label:<9} {explained[key]}")
    if "policy" in explained:
        version = explained["planner_version"] or "settings not recorded"
        lines += [
            f"  policy    {explained['policy']} (turn {explained['policy_turn']}), decided by "
            f"{explained['planner']} ({version})",
            f"  routed to {explained['worker_id']}: {explained['reason']}",
            f"  session owner {explained['session_owner'] or '-'}",
        ]
    else:
        lines.append("  never routed")
    if "model" in explained:
        adapter = f", LoRA adapter {explained['lora']}" if explained["lora"] else ""
        lines.append(f"  model     {explained['model']}{adapter}")
    lines += ["", "timeline"]
    for step in explained["timeline"]:
        details = ", ".join(
            f"{k}={_cell(v)}"
            for k, v in step.items()
            if k not in ("event", "time", "at_ms") and v is not None
        )
        lines.append(f"  {step['at_ms']:>+10.1f} ms  {step['time']}  {step['event']:<17} {details}")
    if explained["candidates"]:
        lines += ["", "decode candidates (* chosen)"]
        lines += _table(explained["candidates"])
    prefill = explained["prefill"]
    if prefill is not None:
        remote = "-" if prefill["remote_ms"] is None else f"{prefill['remote_ms']:.2f} ms"
        lines += [
            "",
            f"prefill on {prefill['prefill_worker_id'] or 'the decode worker'} "
            f"(local {prefill['local_ms']:.2f} ms, remote {remote}): {prefill['reason']}",
        ]
        if prefill["candidates"]:
            lines += _table(prefill["candidates"])
    return "\n".join(lines)


def _table(candidates: list[dict[str, Any]]) -> list[str]:
    header = ["", "worker", *(_HEADINGS.get(t, t) for t in TERMS)]
    rows = [
        ["*" if c["chosen"] else "", c["worker_id"], *(_cell(c[t]) for t in TERMS)]
        for c in candidates
    ]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  "
        + "  ".join(
            v.rjust(w) if i > 1 else v.ljust(w)
            for i, (v, w) in enumerate(zip(r, widths, strict=True))
        ).rstrip()
        for r in [header, *rows]
    ]


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else ""
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)
