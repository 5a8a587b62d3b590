"""A service's user name and password for NATS or etcd, kept in a file of its own.

Services get the path of their file in an environment variable, never the secret on their
command line (which every user of the machine can read in ``ps``). Tools and tests may carry the
credentials in the address instead (``nats://user:password@host:port``, ``user:password@host:port``
for etcd, the password percent-encoded where it has ``:@/,%``), as the NATS clients do.

Servers the operator runs take what they were set up with: for etcd, ``LANEWAY_ETCD_USER`` and
``LANEWAY_ETCD_PASSWORD`` (or a client certificate, ``bus.tls``); for NATS, a user in the URL, a
NATS credentials file (``LANEWAY_NATS_CREDENTIALS``: a user JWT and its seed, as ``nsc`` writes
it) or an nkey seed file (``LANEWAY_NATS_NKEY``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from bus.tls import nats_tls_from_env

NATS_CREDS_ENV = "LANEWAY_NATS_CREDS_FILE"
ETCD_CREDS_ENV = "LANEWAY_ETCD_CREDS_FILE"
ETCD_USER_ENV = "LANEWAY_ETCD_USER"
ETCD_PASSWORD_ENV = "LANEWAY_ETCD_PASSWORD"
NATS_JWT_CREDS_ENV = "LANEWAY_NATS_CREDENTIALS"
NATS_NKEY_ENV = "LANEWAY_NATS_NKEY"
NATS_IN_ORDER_ENV = "LANEWAY_NATS_IN_ORDER"

# User names become subject tokens (a user's reply inbox) and etcd role names.
_USER = re.compile(r"[A-Za-z0-9_-]{1,128}")
# A credentials file is a few dozen bytes; a larger one is not ours.
_MAX_FILE_BYTES = 4096


@dataclass(frozen=True)
class Credentials:
    user: str
    password: str

    def __post_init__(self) -> None:
        if not _USER.fullmatch(self.user):
            raise ValueError(
                f"a user name is 1-128 letters, digits, '_' or '-': {self.user[:64]!r}"
            )
        if not self.password or any(c in self.password for c in "\r\n\0"):
            raise ValueError(f"the password of {self.user} is empty or has a line end")

    def __repr__(self) -> str:  # keeps the password out of logs and tracebacks
        return f"Credentials(user={self.user!r})"

    @classmethod
    def new(cls, user: str) -> Credentials:
        return cls(user, secrets.token_urlsafe(24))

    @classmethod
    def read(cls, path: Path) -> Credentials:
        with open(path, "rb") as file:
            raw = file.read(_MAX_FILE_BYTES + 1)
        if len(raw) > _MAX_FILE_BYTES:
            raise ValueError(f"{path} is over {_MAX_FILE_BYTES} bytes: not a credentials file")
        found = json.loads(raw)
        if not isinstance(found, dict) or not all(
            isinstance(found.get(k), str) for k in ("user", "password")
        ):
            raise ValueError(f"{path} holds no user and password")
        return cls(found["user"], found["password"])

    @classmethod
    def from_env(cls, variable: str) -> Credentials | None:
        path = os.environ.get(variable)
        return cls.read(Path(path)) if path else None

    def write(self, path: Path) -> None:
        """Readable by its owner only (0600), from the moment it exists."""
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = path.with_name(path.name + ".tmp")
        tmp.unlink(missing_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as file:
            json.dump({"user": self.user, "password": self.password}, file)
        tmp.replace(path)

    def within(self, addresses: str) -> str:
        """``addresses`` (comma-separated, with or without a scheme) carrying these
        credentials."""
        return ",".join(
            f"{scheme}{self.user}:{quote(self.password, safe='')}@{rest}"
            for scheme, _, rest in (_parts(a) for a in addresses.split(","))
        )


def inbox_prefix(user: str) -> str:
    """The subjects a user's replies come to: its own, so that no other user may read them."""
    return f"_i.{user}"


def is_inbox(subject: str) -> bool:
    """Whether ``subject`` is a reply inbox (a user's own, or nats-py's shared one where the
    bus takes no users). An answer goes only to one: the asker names where it goes, and one
    sent to any subject it named (a stream's, an ingress's answers) would write there in the
    answerer's name, past the asker's permissions."""
    return subject.startswith((inbox_prefix(""), "_INBOX."))


def split_credentials(addresses: str) -> tuple[Credentials | None, str]:
    """The credentials ``addresses`` carry (those of its first address that has any) and the
    addresses without them."""
    found: Credentials | None = None
    plain = []
    for address in addresses.split(","):
        scheme, userinfo, rest = _parts(address)
        if userinfo and found is None:
            user, _, password = userinfo.partition(":")
            found = Credentials(unquote(user), unquote(password))
        plain.append(scheme + rest)
    return found, ",".join(plain)


def etcd_credentials(endpoints: str) -> Credentials | None:
    """Who a process is to etcd: the user in ``endpoints``, else the file
    ``LANEWAY_ETCD_CREDS_FILE`` names (a service's own, from ``laneway up`` or ``laneway bus
    provision``), else ``LANEWAY_ETCD_USER`` and ``LANEWAY_ETCD_PASSWORD``; None for an etcd
    without auth (or one that knows its clients by certificate)."""
    found = split_credentials(endpoints)[0] or Credentials.from_env(ETCD_CREDS_ENV)
    if found is not None:
        return found
    user, password = os.environ.get(ETCD_USER_ENV), os.environ.get(ETCD_PASSWORD_ENV)
    if not user:
        if password:
            raise ValueError(f"{ETCD_PASSWORD_ENV} is set without {ETCD_USER_ENV}")
        return None
    return _checked(user, password or "", ETCD_PASSWORD_ENV)


def nats_options(url: str) -> dict[str, Any]:
    """nats-py's connect options for ``url`` (several servers, comma-separated): its servers
    without credentials, the login (``nats_login``) and TLS (``bus.tls``)."""
    servers = [u.strip() for u in split_credentials(url)[1].split(",") if u.strip()]
    # nats-py picks any server of the list, which spreads a cluster's clients over its servers.
    # On hosts that each run a server, a service lists its own host's first and asks for the
    # order kept: a link cut between hosts then cuts none of its connections (with any, an
    # ingress whose server was on a worker's host lost its bus with that host).
    in_order = os.environ.get(NATS_IN_ORDER_ENV, "").lower() in ("1", "true", "yes")
    return {
        "servers": servers,
        "tls": nats_tls_from_env(),
        "dont_randomize": in_order,
        **nats_login(url),
    }


def nats_login(url: str) -> dict[str, Any]:
    """nats-py's connect options that log a process in: the user in ``url``, else the file
    ``LANEWAY_NATS_CREDS_FILE`` names, else a NATS credentials file or an nkey seed file; none
    for a server that lets anyone in (or knows its clients by certificate)."""
    creds = split_credentials(url)[0] or Credentials.from_env(NATS_CREDS_ENV)
    if creds is not None:
        return {
            "user": creds.user,
            "password": creds.password,
            "inbox_prefix": inbox_prefix(creds.user),
        }
    jwt, nkey = os.environ.get(NATS_JWT_CREDS_ENV), os.environ.get(NATS_NKEY_ENV)
    if jwt and nkey:
        raise ValueError(f"set {NATS_JWT_CREDS_ENV} or {NATS_NKEY_ENV}, not both")
    options = {NATS_JWT_CREDS_ENV: "user_credentials", NATS_NKEY_ENV: "nkeys_seed"}
    for variable, option in options.items():
        path = os.environ.get(variable)
        if path:
            if not Path(path).is_file():
                raise ValueError(f"{variable}: no file {path}")
            return {option: path}
    return {}


def _checked(user: str, password: str, variable: str) -> Credentials:
    """Credentials from settings, a bad one named by its variable."""
    try:
        return Credentials(user, password)
    except ValueError as exc:
        raise ValueError(f"{variable}: {exc}") from None


def _parts(address: str) -> tuple[str, str, str]:
    """(scheme with its ``://``, user:password or empty, host:port and the rest)."""
    address = address.strip()
    scheme, sep, rest = address.partition("://")
    if not sep:
        scheme, rest = "", address
    else:
        scheme += sep
    userinfo, at, host = rest.rpartition("@")
    return scheme, userinfo if at else "", host
