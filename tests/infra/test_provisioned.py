"""How credentials are found for servers the operator runs, and how a provisioned folder's users
are handed out (no servers: the live path is tests/infra/test_own_servers.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bus.credentials import (
    ETCD_CREDS_ENV,
    NATS_CREDS_ENV,
    NATS_JWT_CREDS_ENV,
    NATS_NKEY_ENV,
    Credentials,
    etcd_credentials,
    nats_login,
    nats_options,
    split_credentials,
)
from bus.permissions import Identity
from infra.bus_provision import Wanted, k8s_secrets, provision
from infra.provisioned import NATS_ACCOUNTS_FILE, NoIdentityLeft, Provisioned, identity_of_user


@pytest.fixture(autouse=True)
def no_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for variable in (ETCD_CREDS_ENV, NATS_CREDS_ENV, NATS_JWT_CREDS_ENV, NATS_NKEY_ENV):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.delenv("LANEWAY_ETCD_USER", raising=False)
    monkeypatch.delenv("LANEWAY_ETCD_PASSWORD", raising=False)


def test_a_password_with_url_characters_survives_the_url() -> None:
    creds = Credentials("op", "p@ss:w/rd,%20x")
    url = creds.within("nats://a:4222,nats://b:4222")
    assert url.count("@") == 2 and "p@ss" not in url
    assert split_credentials(url) == (creds, "nats://a:4222,nats://b:4222")


def test_etcd_credentials_come_from_the_endpoints_then_the_file_then_the_settings(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert etcd_credentials("127.0.0.1:2379") is None
    monkeypatch.setenv("LANEWAY_ETCD_USER", "root")
    monkeypatch.setenv("LANEWAY_ETCD_PASSWORD", "pw:@/")
    assert etcd_credentials("127.0.0.1:2379") == Credentials("root", "pw:@/")
    Credentials("planner", "own").write(tmp_path / "planner.json")
    monkeypatch.setenv(ETCD_CREDS_ENV, str(tmp_path / "planner.json"))
    assert etcd_credentials("127.0.0.1:2379") == Credentials("planner", "own")
    assert etcd_credentials("u:v@127.0.0.1:2379") == Credentials("u", "v")


def test_an_etcd_password_without_its_user_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LANEWAY_ETCD_PASSWORD", "pw")
    with pytest.raises(ValueError, match="LANEWAY_ETCD_USER"):
        etcd_credentials("127.0.0.1:2379")


def test_nats_login_takes_a_credentials_file_or_an_nkey_never_both(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    assert nats_login("nats://h:4222") == {}
    assert nats_options("nats://u:p@a:1,nats://b:2")["servers"] == ["nats://a:1", "nats://b:2"]
    assert not nats_options("nats://a:1")["dont_randomize"]
    monkeypatch.setenv("LANEWAY_NATS_IN_ORDER", "true")
    assert nats_options("nats://a:1")["dont_randomize"]
    (tmp_path / "user.creds").write_text("x")
    (tmp_path / "user.nk").write_text("x")
    monkeypatch.setenv(NATS_JWT_CREDS_ENV, str(tmp_path / "user.creds"))
    assert nats_login("nats://h:4222") == {"user_credentials": str(tmp_path / "user.creds")}
    assert nats_login("nats://u:p@h:4222")["user"] == "u"  # the URL's user comes first
    monkeypatch.setenv(NATS_NKEY_ENV, str(tmp_path / "user.nk"))
    with pytest.raises(ValueError, match="not both"):
        nats_login("nats://h:4222")
    monkeypatch.delenv(NATS_JWT_CREDS_ENV)
    assert nats_login("nats://h:4222") == {"nkeys_seed": str(tmp_path / "user.nk")}
    monkeypatch.setenv(NATS_NKEY_ENV, str(tmp_path / "missing.nk"))
    with pytest.raises(ValueError, match="no file"):
        nats_login("nats://h:4222")


@pytest.mark.parametrize(
    ("user", "identity"),
    [
        ("admin", Identity("admin")),
        ("planner", Identity("planner")),
        ("kv-indexer-indexer-0", Identity("kv-indexer", "indexer-0")),
        ("worker-ab12", Identity("worker", "ab12")),
        ("ingress-x", Identity("ingress", "x")),
        ("worker", None),
        ("root", None),
        ("planner-1", None),
    ],
)
def test_a_user_name_is_read_back_as_its_identity(user: str, identity: Identity | None) -> None:
    assert identity_of_user(user) == identity


def test_services_but_workers_take_the_users_provisioned(tmp_path: Path) -> None:
    folder = tmp_path / "prov"
    provision(folder, Wanted(workers=3, ingresses=2, indexers=2), etcd_endpoints=None)
    held = Provisioned(folder)
    roles = [identity.role for identity in held.identities()]
    assert sorted(roles) == sorted(
        ["admin", "planner", "ingress", "ingress", "kv-indexer", "kv-indexer", *["worker"] * 3]
    )
    assert held.servers() == ("nats",)  # no etcd given: no etcd users
    assert held.path("nats", "planner") == folder / "nats" / "planner.json"
    first = held.take("ingress", set())
    assert held.take("ingress", {first}) != first
    with pytest.raises(NoIdentityLeft, match="laneway bus provision"):
        held.take("ingress", {first, held.take("ingress", {first})})
    accounts = (folder / NATS_ACCOUNTS_FILE).read_text()
    assert all(identity.user in accounts for identity in held.identities())
    # Run again with more: those made before are kept.
    provision(folder, Wanted(workers=4, ingresses=2, indexers=2), etcd_endpoints=None)
    assert Provisioned(folder).take("ingress", set()) == first
    assert sum(i.role == "worker" for i in Provisioned(folder).identities()) == 4


def test_the_kubernetes_secrets_give_each_role_its_users_alone(tmp_path: Path) -> None:
    folder = tmp_path / "prov"
    provision(folder, Wanted(workers=2), etcd_endpoints=None)
    secrets = {s["metadata"]["name"]: s["stringData"] for s in k8s_secrets(folder)}
    assert secrets["laneway-nats-accounts"][NATS_ACCOUNTS_FILE].startswith("accounts:")
    workers = secrets["laneway-bus-worker"]
    assert len(workers) == 2 and all(key.startswith("nats.worker-") for key in workers)
    assert list(secrets["laneway-bus-planner"]) == ["nats.planner.json"]
    for role in ("ingress", "kv-indexer", "admin"):
        assert all(key.startswith(f"nats.{role}") for key in secrets[f"laneway-bus-{role}"])
    # As a pod mounts one: the flat layout reads as the folder did.
    mounted = tmp_path / "mounted"
    mounted.mkdir()
    for key, text in workers.items():
        (mounted / key).write_text(text)
    held = Provisioned(mounted)
    assert [i.role for i in held.identities()] == ["worker", "worker"]
    user = held.identities()[0].user
    assert held.path("nats", user) == mounted / f"nats.{user}.json"
    assert Credentials.read(held.path("nats", user)) == Credentials.read(
        folder / "nats" / f"{user}.json"
    )
