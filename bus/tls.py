"""TLS for the connections to NATS and etcd, as certificate paths.

``LANEWAY_NATS_TLS_CA`` (the CA that signed the server's certificate) turns TLS on for NATS;
``LANEWAY_NATS_TLS_CERT`` and ``LANEWAY_NATS_TLS_KEY`` add a client certificate for servers
that ask for one. ``LANEWAY_ETCD_TLS_*`` are the same for etcd.
"""

from __future__ import annotations

import os
import ssl
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TlsFiles:
    ca: Path
    cert: Path | None = None
    key: Path | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs its key, and a key its certificate")

    @classmethod
    def from_env(cls, server: str) -> TlsFiles | None:
        """``server``: NATS or ETCD, as in the variables' names."""
        ca = os.environ.get(f"LANEWAY_{server}_TLS_CA")
        cert = os.environ.get(f"LANEWAY_{server}_TLS_CERT")
        key = os.environ.get(f"LANEWAY_{server}_TLS_KEY")
        if not ca:
            if cert or key:
                raise ValueError(f"LANEWAY_{server}_TLS_CERT/KEY need LANEWAY_{server}_TLS_CA")
            return None
        return cls(Path(ca), Path(cert) if cert else None, Path(key) if key else None)

    def env(self, server: str) -> dict[str, str]:
        """The variables that hand these files to a service."""
        found = {f"LANEWAY_{server}_TLS_CA": str(self.ca)}
        if self.cert is not None and self.key is not None:
            found[f"LANEWAY_{server}_TLS_CERT"] = str(self.cert)
            found[f"LANEWAY_{server}_TLS_KEY"] = str(self.key)
        return found

    def client_context(self) -> ssl.SSLContext:
        context = ssl.create_default_context(cafile=str(self.ca))
        if self.cert is not None and self.key is not None:
            context.load_cert_chain(str(self.cert), str(self.key))
        return context


def nats_tls_from_env() -> ssl.SSLContext | None:
    files = TlsFiles.from_env("NATS")
    return files.client_context() if files is not None else None


@dataclass(frozen=True)
class BusTlsDir:
    """The files of ``laneway up --bus-tls-dir``: ``ca.pem`` (the CA every certificate here is
    signed by), ``server.pem`` and ``server-key.pem`` (the embedded NATS's and etcd's), and,
    where present, ``client.pem`` and ``client-key.pem``: the services' client certificate,
    which the embedded servers then require of every client."""

    folder: Path

    def __post_init__(self) -> None:
        needed = [self.ca, *self.server]
        if (self.folder / "client.pem").exists() or (self.folder / "client-key.pem").exists():
            needed += [self.folder / "client.pem", self.folder / "client-key.pem"]
        missing = [path.name for path in needed if not path.is_file()]
        if missing:
            raise ValueError(f"{self.folder} lacks {', '.join(missing)}")

    @property
    def ca(self) -> Path:
        return self.folder / "ca.pem"

    @property
    def server(self) -> tuple[Path, Path]:
        return self.folder / "server.pem", self.folder / "server-key.pem"

    @property
    def client_certs(self) -> bool:
        """Whether clients must show a certificate (one is here for the services)."""
        return (self.folder / "client.pem").is_file()

    @property
    def client(self) -> TlsFiles:
        if not self.client_certs:
            return TlsFiles(self.ca)
        return TlsFiles(self.ca, self.folder / "client.pem", self.folder / "client-key.pem")

    def env(self) -> dict[str, str]:
        """The settings that connect a service to both servers over TLS."""
        return {**self.client.env("NATS"), **self.client.env("ETCD")}
