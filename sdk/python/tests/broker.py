"""Starts real `felix broker` processes for the tests: loopback, ephemeral ports, a fresh data
directory each, no FELIX_* variable inherited from the test's environment."""

from __future__ import annotations

import os
import queue
import subprocess
import threading
import time
import urllib.request
from collections import deque
from collections.abc import Mapping
from pathlib import Path

import felix_client

# Generous: the machine running the tests may be busy compiling.
DEADLINE = 60.0
# Lines of broker output kept for failure messages.
_KEPT_LINES = 200


def felix_bin() -> Path:
    """FELIX_BIN if set, else the repository's debug build, else its release build."""
    explicit = os.environ.get("FELIX_BIN")
    if explicit:
        path = Path(explicit)
        if not path.is_file():
            raise RuntimeError(f"FELIX_BIN={explicit} is not a file")
        return path
    repo = Path(__file__).resolve().parents[3]
    for candidate in (repo / "target/debug/felix", repo / "target/release/felix"):
        if candidate.is_file():
            return candidate
    raise RuntimeError(
        "no felix binary: set FELIX_BIN, or build one (cargo build -p felix) so that "
        f"{repo}/target/debug/felix exists"
    )


def clean_env(extra: Mapping[str, str]) -> dict[str, str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("FELIX_")}
    env.update(extra)
    return env


def run_cli(args: list[str], env: Mapping[str, str]) -> str:
    """Runs `felix ARGS` and returns its stdout."""
    done = subprocess.run(
        [str(felix_bin()), *args],
        env=clean_env(env),
        capture_output=True,
        text=True,
        timeout=DEADLINE,
        check=False,
    )
    if done.returncode != 0:
        raise RuntimeError(f"felix {' '.join(args)} failed: {done.stderr}")
    return done.stdout


class Broker:
    """A running broker; :meth:`stop` kills it."""

    def __init__(self, data_dir: Path, env: Mapping[str, str]) -> None:
        self.data_dir = data_dir
        self.output: deque[str] = deque(maxlen=_KEPT_LINES)
        full_env = clean_env(
            {
                "FELIX_DATA_DIR": str(data_dir),
                "FELIX_BIND": "127.0.0.1:0",
                "FELIX_METRICS_BIND": "127.0.0.1:0",
                "FELIX_DURABLE_SEGMENT_BYTES": "4MiB",
                **env,
            }
        )
        self.process = subprocess.Popen(
            [str(felix_bin()), "broker"],
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        lines: queue.Queue[str | None] = queue.Queue()
        # Drains the pipe for the broker's whole life, so it never blocks on a full pipe.
        self._drainer = threading.Thread(target=self._drain, args=(lines,), daemon=True)
        self._drainer.start()
        self.quic_port = 0
        self.metrics_addr = ""
        self.core_ports: list[int] = []
        deadline = time.monotonic() + DEADLINE
        try:
            while not (self.quic_port and self.metrics_addr):
                remaining = deadline - time.monotonic()
                try:
                    line = lines.get(timeout=max(remaining, 0.01))
                except queue.Empty:
                    line = None
                if line is None:
                    raise RuntimeError(
                        "the broker did not announce its ports; output:\n" + "\n".join(self.output)
                    )
                if line.startswith("felix: quic listening on "):
                    self.quic_port = int(line.rsplit(":", 1)[1])
                elif line.startswith("felix: metrics listening on "):
                    self.metrics_addr = line.removeprefix("felix: metrics listening on ").strip()
                elif line.startswith("felix: core ") and " listening on " in line:
                    self.core_ports.append(int(line.rsplit(":", 1)[1]))
        except BaseException:
            self.stop()
            raise

    def _drain(self, lines: queue.Queue[str | None]) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            self.output.append(line.rstrip("\n"))
            lines.put(line.rstrip("\n"))
        lines.put(None)

    @property
    def ca(self) -> Path:
        return self.data_dir / "tls" / "dev-cert.pem"

    def config(self, **overrides: object) -> felix_client.ClientConfig:
        config = felix_client.ClientConfig(
            host="127.0.0.1", port=self.quic_port, ca=self.ca, client_name="felix-python-tests"
        )
        for name, value in overrides.items():
            setattr(config, name, value)
        return config

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://{self.metrics_addr}/metrics", timeout=DEADLINE) as r:
            text: str = r.read().decode()
        return text

    def metric_sum(self, name: str) -> float:
        """The sum of every sample of metric `name` (all label sets)."""
        total = 0.0
        for line in self.metrics().splitlines():
            if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(timeout=DEADLINE)
        # The pipe ends with the process; the drainer then stops and the pipe can be closed.
        self._drainer.join(timeout=DEADLINE)
        if self.process.stdout is not None:
            self.process.stdout.close()
