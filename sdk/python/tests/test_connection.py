"""Connection lifetime against a real broker: keep-alives hold an idle connection open, and a
broker that disappears fails waiting requests with FelixConnectionError instead of hanging."""

from __future__ import annotations

import asyncio

import pytest
from conftest import StartBroker, run
from test_broker import take

import felix_client
from felix_client import Client

# Short, so that the tests wait a few seconds, not the default 30.
IDLE_TIMEOUT = 2.0


def test_keepalives_hold_an_idle_subscription(start_broker: StartBroker) -> None:
    """A subscription idle for twice the idle timeout still receives: the client's pings keep
    its connections alive."""
    broker = start_broker()

    async def scenario() -> None:
        config = broker.config(idle_timeout=IDLE_TIMEOUT)
        async with await Client.connect(config) as client:
            await client.create_stream("quiet", 1)
            async with await client.subscribe("quiet") as subscription:
                # The idle time is what is tested here.
                await asyncio.sleep(2 * IDLE_TIMEOUT)
                await client.publish("quiet", [("k", "after the silence")])
                assert (await take(subscription, 1))[0].payload == b"after the silence"

    run(scenario())


def test_a_vanished_broker_fails_requests(start_broker: StartBroker) -> None:
    """When the broker dies, a waiting request and the subscription fail with
    FelixConnectionError once the idle timeout passes; later calls fail at once."""
    broker = start_broker()

    async def scenario() -> None:
        config = broker.config(idle_timeout=IDLE_TIMEOUT)
        client = await Client.connect(config)
        await client.create_stream("gone", 1)
        subscription = await client.subscribe("gone")
        broker.stop()
        with pytest.raises(felix_client.FelixConnectionError):
            await client.list_streams()
        with pytest.raises(felix_client.FelixConnectionError):
            await take(subscription, 1)
        with pytest.raises(felix_client.FelixConnectionError):
            await client.publish("gone", [("k", "v")])
        await client.close()

    run(scenario())
