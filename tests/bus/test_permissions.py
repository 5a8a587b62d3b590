"""The permissions generated from the topology, and the credentials' file and address forms
(pure; tests/security/test_bus_attacks.py runs them against real servers)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from bus.credentials import Credentials, split_credentials
from bus.permissions import (
    PERMISSIONS_BEGIN,
    PERMISSIONS_END,
    Identity,
    etcd_grants,
    nats_permissions,
    permissions_table,
)
from bus.readme import section
from bus.registry import WORKERS_PREFIX, claim_key
from bus.topology import CHANNELS, STREAM_SUBJECTS

WORKER = Identity("worker", "w1")


IDENTITIES = (
    Identity("ingress", "x"),
    Identity("planner"),
    Identity("kv-indexer", "x"),
    Identity("worker", "x"),
)


@pytest.mark.parametrize("identity", IDENTITIES, ids=lambda i: i.role)
def test_every_role_named_on_a_channel_may_use_it(identity: Identity) -> None:
    found = nats_permissions(identity)
    for channel in CHANNELS:
        # Any of the channel's subjects with x for one key (and any for the others), or all.
        n = len(channel.key_names)
        own = (channel.at(*("x" if i == j else "*" for i in range(n))) for j in range(n))
        subjects = {channel.every.subject, *(topic.subject for topic in own)}
        roles = {entry.split()[0] for entry in channel.producers}
        assert (identity.role in roles) == bool(subjects & set(found.publish)), channel.pattern
        roles = {entry.split()[0] for entry in channel.consumers}
        assert (identity.role in roles) == bool(subjects & set(found.subscribe)), channel.pattern


def test_a_worker_has_its_own_keyed_subjects_only() -> None:
    found = nats_permissions(WORKER)
    assert "lw.kv.w1" in found.publish and "lw.load.w1" in found.publish
    assert not {"lw.kv.*", "lw.load.*", "lw.kv.>", ">"} & set(found.publish)
    assert "lw.req.accepted" not in found.subscribe
    assert "_i.worker-w1.>" in found.subscribe and "_INBOX.>" not in found.subscribe
    # No JetStream API at all: the admin made its durable, whose deliveries it takes on the
    # durable's own subject and acks there.
    assert not [s for s in found.publish if s.startswith("$JS.API.")]
    assert [s for s in found.publish if s.startswith("$")] == ["$JS.ACK.LW_ROUTES.worker-w1.>"]
    assert "_lw.deliver.worker-w1" in found.subscribe
    assert not [s for s in found.subscribe if s.startswith("_lw.") and s.endswith(("*", ">"))]
    # Its routes come from the planner alone; hand-offs from a prefill worker name both.
    assert not [s for s in found.publish if s.startswith("lw.route.") and s.count(".") == 2]
    assert "lw.prefilled.*.w1" in found.publish and "lw.prefilled.w1.*" in found.subscribe


def _meet(a: str, b: str) -> bool:
    """Whether two NATS subjects (wildcards in either) match a subject in common."""
    x, y = a.split("."), b.split(".")
    for i, (p, q) in enumerate(zip(x, y, strict=False)):
        if ">" in (p, q):
            return True
        if p != q and "*" not in (p, q):
            return False
        if i == min(len(x), len(y)) - 1:
            return len(x) == len(y)
    return False


@pytest.mark.parametrize("identity", IDENTITIES, ids=lambda i: i.role)
def test_no_role_administers_a_stream(identity: Identity) -> None:
    """The server applies a stream's subjects and republish past every permission: only the
    admin creates, updates, deletes or purges one. The kv-indexer purges its own bucket's old
    chunks, nothing else."""
    found = nats_permissions(identity).publish
    admin = [
        s
        for s in found
        if s.startswith("$JS.API.")
        and any(f".{op}" in s for op in ("CREATE", "UPDATE", "DELETE", "PURGE", "RESTORE"))
        and ".CONSUMER.CREATE." not in s
    ]
    allowed = {"kv-indexer": ["$JS.API.STREAM.PURGE.OBJ_LW_INDEX_SNAPSHOTS"]}
    assert admin == allowed.get(identity.role, [])
    assert not [s for s in found if "*" in s.split(".")[2:4] and s.startswith("$JS.API.")]
    assert not [s for s in found if s.startswith(("$JS.API.DIRECT", "$JS.API.STREAM.MSG.DELETE"))]


@pytest.mark.parametrize("identity", IDENTITIES, ids=lambda i: i.role)
def test_no_role_makes_a_consumer_over_what_it_writes(identity: Identity) -> None:
    """A consumer's deliveries go where its create says, past every permission: a role that
    could make one over messages of its own could put them on any subject (a forged answer on
    an ingress's). So it makes consumers only over streams it cannot write to."""
    found = nats_permissions(identity)
    creates = [s.split(".")[4] for s in found.publish if s.startswith("$JS.API.CONSUMER.CREATE.")]
    written = [s for s in found.publish if not s.startswith(("$JS.", "_"))]
    for stream, subjects in STREAM_SUBJECTS.items():
        if stream.name in creates:
            assert not [(w, s) for w in written for s in subjects if _meet(w, s)], stream.name
    assert all(stream.startswith("LW_") for stream in creates)


def test_subjects_meet() -> None:
    assert _meet("lw.kv.w1", "lw.kv.*") and _meet("lw.>", "lw.kv.w1")
    assert not _meet("lw.kv.w1", "lw.kv.w2") and not _meet("lw.kv.*", "lw.kv.*.x")


def test_an_ingress_reads_its_own_answers_only() -> None:
    found = nats_permissions(Identity("ingress", "i1"))
    assert {"lw.tok.i1.*", "lw.req.done.i1.*", "lw.req.done.i1", "lw.req.placed.i1"} <= set(
        found.subscribe
    )
    assert not any(
        s.startswith(("lw.tok.", "lw.req.done.", "lw.req.placed.", "lw.route."))
        for s in found.publish
    )


def test_a_worker_sends_answers_under_its_own_name_only() -> None:
    """Tokens and terminals to any ingress, on subjects naming this worker; not the planner's
    placements, and resend queries are asked of it alone."""
    found = nats_permissions(WORKER)
    answers = {s for s in found.publish if s.startswith(("lw.tok.", "lw.req.done."))}
    assert answers == {"lw.tok.*.w1", "lw.req.done.*.w1"}
    assert "lw.resend.w1" in found.subscribe
    assert not any(s.startswith("lw.resend") and s != "lw.resend.w1" for s in found.subscribe)
    planner = nats_permissions(Identity("planner"))
    assert {"lw.req.done.*", "lw.req.placed.*"} <= set(planner.publish)
    assert "lw.req.done.*.*" in planner.subscribe
    assert not any(s.startswith("lw.req.placed.") for s in found.publish)


def test_a_worker_writes_its_own_registration_and_claim_keys_only() -> None:
    writes = [g for g in etcd_grants(WORKER) if g.write]
    assert [(g.key, g.prefix) for g in writes] == [
        (WORKERS_PREFIX + b"w1", False),
        (claim_key("worker-w1"), False),
    ]


def test_an_instance_id_must_be_a_subject_token() -> None:
    for bad in ("a.b", "*", ">", "a b", ""):
        with pytest.raises(ValueError):
            Identity("worker", bad)
    with pytest.raises(ValueError):
        Identity("planner", "x")


def test_credentials_file_is_its_owners_only(tmp_path: Path) -> None:
    creds = Credentials.new("planner")
    path = tmp_path / "auth" / "planner.json"
    creds.write(path)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert Credentials.read(path) == creds
    assert creds.password not in repr(creds)
    path.write_text("x" * 5000)
    with pytest.raises(ValueError, match="not a credentials file"):
        Credentials.read(path)


def test_credentials_travel_in_and_out_of_addresses() -> None:
    creds = Credentials("admin", "pw")
    both = creds.within("nats://h1:1,nats://h2:2")
    assert both == "nats://admin:pw@h1:1,nats://admin:pw@h2:2"
    assert split_credentials(both) == (creds, "nats://h1:1,nats://h2:2")
    assert split_credentials(creds.within("127.0.0.1:2379")) == (creds, "127.0.0.1:2379")
    assert split_credentials("127.0.0.1:2379") == (None, "127.0.0.1:2379")


def test_the_docs_table_is_the_generated_one() -> None:
    text = (Path(__file__).resolve().parents[2] / "docs" / "security.md").read_text()
    assert section(text, PERMISSIONS_BEGIN, PERMISSIONS_END) == permissions_table(), (
        "regenerate it: python -m bus.permissions --readme docs/security.md"
    )
