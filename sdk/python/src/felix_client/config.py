"""How to reach and trust a broker, and how the client proves who it is."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PORT = 7400
DEFAULT_PUBLISH_INFLIGHT_BYTES = 4 * 1024 * 1024
DEFAULT_SUBSCRIPTION_WINDOW_BYTES = 4 * 1024 * 1024


def dev_cert_path() -> Path:
    """Where ``felix broker`` writes its development certificate by default
    (``$XDG_DATA_HOME/felix/tls/dev-cert.pem``, else ``~/.local/share/felix/tls/dev-cert.pem``)."""
    import os

    data_home = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return Path(data_home) / "felix" / "tls" / "dev-cert.pem"


@dataclass
class ClientConfig:
    """Connection settings. Only `host` and `port` are needed for a broker whose certificate
    the system trusts; a development broker needs ``ca=dev_cert_path()``."""

    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    #: TLS server name verified against the broker's certificate (and sent as SNI).
    server_name: str = "localhost"
    #: PEM file of the CA certificate(s) to trust; None trusts the system store.
    ca: str | Path | None = None
    #: Skips certificate verification: development only, anyone can impersonate the broker.
    insecure: bool = False
    #: Bearer token (``felix_<id>_<secret>``) sent in every connection's ``Hello``.
    token: str | None = field(default=None, repr=False)
    #: Client certificate and key (PEM files) for mutual TLS.
    client_cert: str | Path | None = None
    client_key: str | Path | None = None
    #: Free text the broker logs.
    client_name: str = "felix-client-python/0.1.0"
    #: Send each shard's records to (and subscribe on) the port of the core that owns it,
    #: one connection per core opened on first use; False sends everything to `port`.
    core_aware: bool = True
    #: Bytes of publishes outstanding (acked: until answered; fire-and-forget: until handed to
    #: the network) before publishers wait.
    publish_inflight_bytes: int = DEFAULT_PUBLISH_INFLIGHT_BYTES
    #: Bytes a subscription holds that the application has not consumed yet; beyond this the
    #: broker is stopped by QUIC flow control (at least one whole frame is always allowed).
    subscription_window_bytes: int = DEFAULT_SUBSCRIPTION_WINDOW_BYTES
    #: Seconds allowed for the QUIC + TLS handshake and ``HelloOk``.
    connect_timeout: float = 10.0
    #: Seconds of silence after which a connection is considered dead (keep-alives are sent
    #: well within it).
    idle_timeout: float = 30.0
