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
from bus.registry import WORKERS_PREFIX
from bus.topology import CHANNELS

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
    assert not any("DELETE" in s or "PURGE" in s for s in found.publish)
    # Its durable only, and only over its own routes.
    creates = [s for s in found.publish if ".CONSUMER.CREATE." in s]
    assert creates == ["$JS.API.CONSUMER.CREATE.LW_ROUTES.worker-w1.lw.route.w1"]


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


def test_a_worker_writes_its_own_registration_key_only() -> None:
    writes = [g for g in etcd_grants(WORKER) if g.write]
    assert [(g.key, g.prefix) for g in writes] == [(WORKERS_PREFIX + b"w1", False)]


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


def test_the_readme_table_is_the_generated_one() -> None:
    text = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert section(text, PERMISSIONS_BEGIN, PERMISSIONS_END) == permissions_table(), (
        "regenerate it: python -m bus.permissions --readme README.md"
    )
