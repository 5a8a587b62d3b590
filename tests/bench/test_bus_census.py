"""Grouping bus subjects by kind, ids masked, and the per-request table."""

from __future__ import annotations

from benchmarks.bus_census import TERMINALS, matches, per_request, subject_kind


def test_ids_masked_kinds_kept() -> None:
    assert subject_kind("lw.tok.ingress-0c4aa973c1eb.decode-worker-3") == "lw.tok.*.*"
    assert subject_kind("lw.req.done.ingress-1.decode-worker-0") == "lw.req.done.*.*"
    assert subject_kind("lw.load.decode-worker-2") == "lw.load.*"
    assert subject_kind("lw.route.decode-worker-1.transferred") == "lw.route.*.transferred"
    assert subject_kind("_INBOX.Jm3s9ZkqP0.42") == "_INBOX.*"
    ack = "$JS.ACK.LW_REQUESTS.planner.1.77.77.1764590000.0"
    assert subject_kind(ack) == "$JS.ACK.LW_REQUESTS.*"
    assert subject_kind("$JS.API.STREAM.INFO.LW_KV") == "$JS.API.STREAM.*"
    assert subject_kind("lw.req.new") == "lw.req.new"


def test_per_request() -> None:
    kinds = {
        "lw.tok.*.*": {"messages": 300, "bytes": 60_000},
        "_INBOX.*": {"messages": 100, "bytes": 0},
    }
    rows = per_request(kinds, requests=100)
    assert rows[0] == {
        "subject": "lw.tok.*.*",
        "messages_per_request": 3.0,
        "bytes_per_message": 200,
    }
    assert rows[-1] == {"subject": "all", "messages_per_request": 4.0}


def test_terminals_are_matched_by_the_topologys_pattern() -> None:
    assert TERMINALS == "lw.req.done.*.*"
    assert matches(TERMINALS, "lw.req.done.ingress-1.decode-worker-0")
    # The planner's failure of a request (a terminal, but not a worker's).
    assert not matches(TERMINALS, "lw.req.done.ingress-1")
    assert not matches(TERMINALS, "lw.req.done.ingress-1.decode-worker-0.x")
