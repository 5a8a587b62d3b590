"""What a disaggregated request's trace holds, whichever exporter brought its spans: every hop's
span, all in one trace, each under the span of the hop that caused it."""

from __future__ import annotations

from typing import Any

Span = dict[str, Any]

# Every prompt prefilled remotely, so that the trace has both sides of a hand-off; a prompt of
# several KV blocks, and the planner's overlaps asked of the kv-indexer (not answered by its own
# fold of the KV stream), so that the planner asks it.
DISAGG = {"LANEWAY_DISAGG": "always", "LANEWAY_OVERLAPS": "indexer"}
PROMPT = "a prompt long enough for blocks " * 8

# Each hop's span and the span it is a child of.
PARENTS = {
    "ingress.request": None,
    "planner.route": "ingress.request",
    "kv_indexer.overlaps": "planner.route",
    "worker.prefill": "planner.route",
    "worker.kv_send": "worker.prefill",
    "worker.generate": "planner.route",
    "worker.kv_wait": "worker.generate",
    "worker.kv_receive": "worker.generate",
}


def request_trace(spans: list[Span], request_id: str) -> list[Span] | None:
    """The spans of the request's trace (``name``, ``trace_id``, ``span_id``, ``parent_id``,
    ``attributes``), once every hop's has arrived; the decode side's come last."""
    roots = [
        s
        for s in spans
        if s["name"] == "ingress.request"
        and s["attributes"].get("laneway.request_id") == request_id
    ]
    if not roots:
        return None
    found = [s for s in spans if s["trace_id"] == roots[0]["trace_id"]]
    return found if {s["name"] for s in found} >= PARENTS.keys() else None


def check_hops(spans: list[Span]) -> dict[str, Span]:
    """Every hop's span, once each, with the right parent; by name."""
    assert len({s["trace_id"] for s in spans}) == 1
    by_name = {s["name"]: s for s in spans}
    assert sorted(s["name"] for s in spans) == sorted(PARENTS)
    for name, parent in PARENTS.items():
        expected = by_name[parent]["span_id"] if parent is not None else None
        assert by_name[name]["parent_id"] == expected, f"{name}'s parent is not {parent}"
    return by_name
