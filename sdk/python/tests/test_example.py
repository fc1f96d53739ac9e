"""The README's runnable example works against a real broker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from broker import DEADLINE
from conftest import StartBroker

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "quickstart.py"


def test_quickstart_example(start_broker: StartBroker, tmp_path: Path) -> None:
    """examples/quickstart.py trusts the dev certificate where the broker writes it by default,
    publishes two records and reads them back (twice: a second run reuses the stream)."""
    broker = start_broker()
    # The example trusts $XDG_DATA_HOME/felix/tls/dev-cert.pem, the broker's default location.
    data_home = tmp_path / "data-home"
    data_home.mkdir()
    (data_home / "felix").symlink_to(broker.data_dir)
    env = {**os.environ, "XDG_DATA_HOME": str(data_home)}
    for _ in range(2):
        done = subprocess.run(
            [sys.executable, str(EXAMPLE), "127.0.0.1", str(broker.quic_port)],
            env=env,
            capture_output=True,
            text=True,
            timeout=DEADLINE,
            check=False,
        )
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        assert sum(line.startswith("acked: ") for line in lines) >= 1
        assert any(line.endswith("customer-7 hello") for line in lines), done.stdout
        assert any(line.endswith("customer-8 world") for line in lines), done.stdout
