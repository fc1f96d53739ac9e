"""How to reach and trust a broker, and how the client proves who it is."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_PORT = 7400
DEFAULT_PUBLISH_INFLIGHT_BYTES = 4 * 1024 * 1024
DEFAULT_SUBSCRIPTION_WINDOW_BYTES = 4 * 1024 * 1024
#: Default :attr:`ClientConfig.publish_retries` (the Rust client's).
DEFAULT_PUBLISH_RETRIES = 8
#: Default :attr:`ClientConfig.publish_retry_backoff`, seconds.
DEFAULT_PUBLISH_RETRY_BACKOFF = 0.02
#: The longest wait between two retries of a publish, seconds.
PUBLISH_RETRY_BACKOFF_MAX = 1.0


def data_dir(environ: Mapping[str, str] | None = None) -> Path:
    """The broker's data directory as the ``felix`` CLI finds it: ``FELIX_DATA_DIR``, else
    ``$XDG_DATA_HOME/felix``, else ``$HOME/.local/share/felix``, else ``./felix-data``."""
    env = os.environ if environ is None else environ
    if env.get("FELIX_DATA_DIR"):
        return Path(env["FELIX_DATA_DIR"])
    if env.get("XDG_DATA_HOME"):
        return Path(env["XDG_DATA_HOME"]) / "felix"
    if env.get("HOME"):
        return Path(env["HOME"]) / ".local" / "share" / "felix"
    return Path("felix-data")


def dev_cert_path(environ: Mapping[str, str] | None = None) -> Path:
    """The development certificate a broker generates in its data directory (:func:`data_dir`):
    what a client trusts to reach ``make run``'s broker."""
    return data_dir(environ) / "tls" / "dev-cert.pem"


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
    #: broker is stopped by QUIC flow control. At least one whole frame of the broker's
    #: ``max_frame_bytes`` (and 64 KiB) is always allowed.
    subscription_window_bytes: int = DEFAULT_SUBSCRIPTION_WINDOW_BYTES
    #: Seconds allowed for the QUIC + TLS handshake and ``HelloOk``.
    connect_timeout: float = 10.0
    #: Seconds of silence after which a connection is considered dead (keep-alives are sent
    #: well within it).
    idle_timeout: float = 30.0
    #: Publish as an idempotent producer (docs/semantics.md, "Idempotent producers"): acked
    #: publishes carry the client's producer id and a sequence per shard, so a retried batch is
    #: stored once. Used only when the broker echoes the ``PRODUCER`` feature in ``HelloOk``
    #: (else plain publishes). False: plain publishes, never retried (``felix pub
    #: --no-idempotence``).
    idempotent: bool = True
    #: The producer id (a non-zero 64-bit integer); None picks one at random per
    #: :class:`~felix_client.Client`. A client numbers each shard's batches from 1, so a new
    #: client given the id of an earlier one that sends the same batches in the same order has
    #: them deduplicated (``felix pub --producer-id``). Never give one id to two live clients.
    producer_id: int | None = None
    #: Times an idempotent publish's batch is sent again, with the same producer id, sequence
    #: and records, after a retryable answer (``ingress_budget_exhausted``; ``unavailable``
    #: naming the batch's sequence; ``out_of_sequence`` naming an earlier, still missing
    #: batch); 0 turns retries off.
    publish_retries: int = DEFAULT_PUBLISH_RETRIES
    #: Seconds before the first retry; the wait doubles per retry, up to
    #: :data:`PUBLISH_RETRY_BACKOFF_MAX`.
    publish_retry_backoff: float = DEFAULT_PUBLISH_RETRY_BACKOFF

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> ClientConfig:
        """The settings the ``felix`` CLI reads (docs/configuration.md): ``FELIX_ADDR``
        (``ip:port``), ``FELIX_SERVER_NAME``, ``FELIX_CA`` (unset or empty: the development
        certificate of :func:`data_dir` when it exists, else the system store),
        ``FELIX_INSECURE``, ``FELIX_TOKEN``, ``FELIX_CLIENT_CERT`` and ``FELIX_CLIENT_KEY``.
        Raises ValueError naming a variable whose value is unusable."""
        env = os.environ if environ is None else environ
        config = cls()
        addr = env.get("FELIX_ADDR")
        if addr:
            host, sep, port = addr.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"FELIX_ADDR={addr!r} is not an ip:port address")
            config.host, config.port = host.removeprefix("[").removesuffix("]"), int(port)
        if env.get("FELIX_SERVER_NAME"):
            config.server_name = env["FELIX_SERVER_NAME"]
        if env.get("FELIX_CA"):
            config.ca = Path(env["FELIX_CA"])
        elif dev_cert_path(env).is_file():
            config.ca = dev_cert_path(env)
        insecure = env.get("FELIX_INSECURE", "0").lower()
        if insecure not in ("0", "1", "true", "false"):
            raise ValueError(f"FELIX_INSECURE={insecure!r} is not one of 0, 1, true, false")
        config.insecure = insecure in ("1", "true")
        config.token = env.get("FELIX_TOKEN") or None
        cert, key = env.get("FELIX_CLIENT_CERT") or None, env.get("FELIX_CLIENT_KEY") or None
        if (cert is None) != (key is None):
            raise ValueError("FELIX_CLIENT_CERT and FELIX_CLIENT_KEY: set both or neither")
        config.client_cert = None if cert is None else Path(cert)
        config.client_key = None if key is None else Path(key)
        return config
