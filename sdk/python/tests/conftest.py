"""Fixtures: `start_broker` starts a real broker (killed at the test's end) in a fresh
temporary data directory; `run` runs a coroutine with a deadline."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from broker import DEADLINE, Broker  # noqa: E402

T = TypeVar("T")

StartBroker = Callable[..., Broker]


@pytest.fixture
def start_broker(tmp_path: Path) -> Iterator[StartBroker]:
    brokers: list[Broker] = []

    def start(**env: str) -> Broker:
        data_dir = tmp_path / f"broker-{len(brokers)}"
        data_dir.mkdir()
        broker = Broker(data_dir, env)
        brokers.append(broker)
        return broker

    yield start
    for broker in brokers:
        broker.stop()


def run(coro: Coroutine[Any, Any, T], deadline: float = 2 * DEADLINE) -> T:
    """Runs `coro` to completion within `deadline` seconds."""

    async def bounded() -> T:
        async with asyncio.timeout(deadline):
            return await coro

    return asyncio.run(bounded())
