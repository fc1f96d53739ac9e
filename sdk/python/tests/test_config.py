"""ClientConfig.from_env reads the settings the felix CLI reads, with the same defaults."""

from __future__ import annotations

from pathlib import Path

import pytest

from felix_client import ClientConfig, data_dir, dev_cert_path


def test_defaults_and_data_dir(tmp_path: Path) -> None:
    """Without settings: 127.0.0.1:7400, localhost, the dev certificate only if it exists."""
    assert data_dir({"HOME": "/home/me"}) == Path("/home/me/.local/share/felix")
    assert data_dir({"HOME": "/h", "XDG_DATA_HOME": "/x"}) == Path("/x/felix")
    assert data_dir({"FELIX_DATA_DIR": "/d", "XDG_DATA_HOME": "/x"}) == Path("/d")
    assert data_dir({}) == Path("felix-data")
    env = {"FELIX_DATA_DIR": str(tmp_path)}
    config = ClientConfig.from_env(env)
    assert (config.host, config.port, config.server_name) == ("127.0.0.1", 7400, "localhost")
    assert config.ca is None and config.token is None and not config.insecure
    dev_cert_path(env).parent.mkdir(parents=True)
    dev_cert_path(env).write_text("pem")
    assert ClientConfig.from_env(env).ca == tmp_path / "tls" / "dev-cert.pem"


def test_every_setting() -> None:
    """Each FELIX_* client setting lands in its field; the token is never in the repr."""
    config = ClientConfig.from_env(
        {
            "FELIX_ADDR": "[::1]:7500",
            "FELIX_SERVER_NAME": "broker.example",
            "FELIX_CA": "/ca.pem",
            "FELIX_INSECURE": "true",
            "FELIX_TOKEN": "felix_0123_secret",
            "FELIX_CLIENT_CERT": "/c.pem",
            "FELIX_CLIENT_KEY": "/c.key",
        }
    )
    assert (config.host, config.port) == ("::1", 7500)
    assert config.server_name == "broker.example" and config.ca == Path("/ca.pem")
    assert config.insecure and config.token == "felix_0123_secret"
    assert (config.client_cert, config.client_key) == (Path("/c.pem"), Path("/c.key"))
    assert "secret" not in repr(config)


@pytest.mark.parametrize(
    "env",
    [
        {"FELIX_ADDR": "localhost"},
        {"FELIX_ADDR": "127.0.0.1:99999"},
        {"FELIX_INSECURE": "yes"},
        {"FELIX_CLIENT_CERT": "/c.pem"},
    ],
)
def test_bad_settings_are_named(env: dict[str, str]) -> None:
    """An unusable value is a ValueError naming its variable."""
    with pytest.raises(ValueError, match=next(iter(env)).split("_CERT")[0]):
        ClientConfig.from_env(env)
