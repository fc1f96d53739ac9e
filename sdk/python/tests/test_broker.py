"""The SDK against a real broker: admin, publish (acked, fire-and-forget, batches, core
routing), subscribe (earliest, latest, offsets, lag resume) and typed errors."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

import pytest
from broker import DEADLINE, Broker
from conftest import StartBroker, run

import felix_client
from felix_client import (
    Client,
    DeliveredRecord,
    ErrorCode,
    Start,
    StreamKind,
    Subscription,
    shard_for_key,
)

# Two data-plane cores even on a small machine, so that routing to the owning core matters.
TWO_CORES = {"FELIX_DATAPLANE_CORES": "2"}


def key_for_shard(shard: int, shard_count: int, prefix: str = "k") -> bytes:
    """A key that hashes to `shard` (found by a bounded search)."""
    for index in range(100_000):
        key = f"{prefix}{index}".encode()
        if shard_for_key(key, shard_count) == shard:
            return key
    raise AssertionError(f"no key for shard {shard} of {shard_count}")


async def take(subscription: Subscription, count: int) -> list[DeliveredRecord]:
    """The next `count` records, within the deadline."""
    records: list[DeliveredRecord] = []
    async with asyncio.timeout(DEADLINE):
        async for item in subscription:
            records.append(item)
            if len(records) == count:
                break
    assert len(records) == count, f"the subscription ended after {len(records)} records"
    return records


async def wait_for_metric(broker: Broker, name: str, value: float) -> None:
    """Waits (bounded) until metric `name` sums to `value`."""
    async with asyncio.timeout(DEADLINE):
        while await asyncio.to_thread(broker.metric_sum, name) != value:
            await asyncio.sleep(0.05)


def payloads(records: Iterable[DeliveredRecord]) -> list[bytes]:
    return [item.payload for item in records]


def test_stream_admin(start_broker: StartBroker) -> None:
    """Create, list, describe and delete streams, and their refusals as typed errors with codes."""
    broker = start_broker()

    async def scenario() -> None:
        async with await Client.connect(broker.config()) as client:
            assert client.hello.version == 1
            info = await client.create_stream("orders", 4, StreamKind.DURABLE)
            assert info.name == "orders" and info.kind == StreamKind.DURABLE
            assert [shard.shard for shard in info.shards] == [0, 1, 2, 3]
            await client.create_stream("events", 2)
            listed = {summary.name: summary for summary in await client.list_streams()}
            assert listed["orders"].shard_count == 4
            assert listed["events"].kind == StreamKind.IN_MEMORY
            described = await client.describe_stream("orders")
            assert all(shard.next_offset == 0 for shard in described.shards)

            with pytest.raises(felix_client.StreamExistsError) as exists:
                await client.create_stream("orders", 4)
            assert exists.value.code == ErrorCode.STREAM_EXISTS
            assert exists.value.code == 11
            with pytest.raises(felix_client.InvalidArgumentError) as bad_name:
                await client.create_stream("bad name!", 1)
            assert bad_name.value.code == 12
            with pytest.raises(felix_client.InvalidArgumentError):
                await client.create_stream("zero", 0)
            with pytest.raises(felix_client.LimitExceededError) as too_many:
                await client.create_stream("huge", client.limits.max_shards + 1)
            assert too_many.value.code == 6

            await client.delete_stream("events")
            with pytest.raises(felix_client.StreamNotFoundError) as missing:
                await client.describe_stream("events")
            assert missing.value.code == 10 and "events" in str(missing.value)
            # The connection is still good after every refusal.
            assert [s.name for s in await client.list_streams()] == ["orders"]

    run(scenario())


def test_publish_routes_keys_to_shards_on_their_owning_cores(start_broker: StartBroker) -> None:
    """Acked publishes put each key on shard fnv1a_64(key) % shards, sent straight to the
    owning core's port: no cross-core hop at the broker (a naive client makes some)."""
    broker = start_broker(**TWO_CORES)
    assert len(broker.core_ports) == 2

    async def scenario() -> None:
        async with await Client.connect(broker.config()) as client:
            assert len(client.hello.core_ports) == 2
            info = await client.create_stream("routed", 8)
            assert {shard.core for shard in info.shards} == {0, 1}
            keys = [f"user-{index}".encode() for index in range(64)]
            acks = await client.publish("routed", [(key, key) for key in keys])
            expected: dict[int, int] = {}
            for key in keys:
                shard = shard_for_key(key, 8)
                expected[shard] = expected.get(shard, 0) + 1
            assert [(ack.shard, ack.count) for ack in acks] == sorted(expected.items())
            assert all(ack.first_offset == 0 for ack in acks)
            assert client.core_connections() == 2
            described = await client.describe_stream("routed")
            assert {s.shard: s.next_offset for s in described.shards if s.next_offset} == expected

            subscription = await client.subscribe("routed", start=Start.EARLIEST)
            async with subscription:
                records = await take(subscription, len(keys))
            for item in records:
                assert item.shard == shard_for_key(item.key, 8)
            assert sorted(payloads(records)) == sorted(keys)
        assert await asyncio.to_thread(broker.metric_sum, "felix_core_cross_core_hops_total") == 0

        # The metric does see hops: a client that ignores the shard map makes them.
        async with await Client.connect(broker.config(core_aware=False)) as naive:
            await naive.publish("routed", [(key, key) for key in keys])
        assert await asyncio.to_thread(broker.metric_sum, "felix_core_cross_core_hops_total") > 0

    run(scenario())


def test_batches_pipelining_and_fire_and_forget(start_broker: StartBroker) -> None:
    """A batch's acks give contiguous per-shard offsets; pipelined and fire-and-forget
    publishes all arrive, in per-shard order, under a small in-flight budget."""
    broker = start_broker(**TWO_CORES)

    async def scenario() -> None:
        config = broker.config(publish_inflight_bytes=4096)
        async with await Client.connect(config) as client:
            await client.create_stream("batches", 4)
            subscription = await client.subscribe("batches", start=Start.EARLIEST)
            batch = [(f"key-{i % 7}", f"a-{i}") for i in range(100)]
            acks = await client.publish("batches", batch)
            assert sum(ack.count for ack in acks) == 100
            pending = [
                await client.publish_pipelined("batches", [(f"key-{i % 7}", f"b-{i}")])
                for i in range(50)
            ]
            for acked in pending:
                assert sum(ack.count for ack in await acked) == 1
            for i in range(50):
                await client.publish_no_ack("batches", [(f"key-{i % 7}", f"c-{i}")])
            assert await client.publish("batches", [("key-0", "last")], ack=False) == []
            records = await take(subscription, 201)
            subscription.close()
        by_shard: dict[int, list[DeliveredRecord]] = {}
        for item in records:
            by_shard.setdefault(item.shard, []).append(item)
        for shard_records in by_shard.values():
            offsets = [item.offset for item in shard_records]
            assert offsets == list(range(len(offsets))), "per-shard offsets in order, no gaps"
        # Per key, the publish order is the delivery order.
        for key_index in range(7):
            key = f"key-{key_index}".encode()
            seen = [item.payload.decode() for item in records if item.key == key]
            expected = [
                f"{p}-{i}"
                for p in "abc"
                for i in range(100 if p == "a" else 50)
                if i % 7 == key_index
            ]
            if key_index == 0:
                expected.append("last")
            assert seen == expected

    run(scenario())


def test_subscribe_latest_offsets_and_too_old(start_broker: StartBroker) -> None:
    """Latest sees only new records, offsets start where asked (per shard), and an evicted
    offset is TooOldError carrying the oldest offset still held."""
    broker = start_broker(FELIX_REPLAY_RING_MAX_RECORDS="4")

    async def scenario() -> None:
        async with await Client.connect(broker.config()) as client:
            await client.create_stream("positions", 2)
            key0, key1 = key_for_shard(0, 2), key_for_shard(1, 2)
            await client.publish("positions", [(key0, "old-0"), (key1, "old-1")])
            latest = await client.subscribe("positions")
            assert latest.start == {0: 1, 1: 1}
            await client.publish("positions", [(key0, "new-0")])
            assert payloads(await take(latest, 1)) == [b"new-0"]
            latest.close()

            # Shard 1 from offset 0 only; shard 0 is not selected.
            offsets = await client.subscribe("positions", shards=[1], start={1: 0})
            assert [(r.shard, r.offset, r.payload) for r in await take(offsets, 1)] == [
                (1, 0, b"old-1")
            ]
            offsets.close()

            await client.publish("positions", [(key0, f"fill-{i}") for i in range(8)])
            with pytest.raises(felix_client.TooOldError) as too_old:
                await client.subscribe("positions", shards=[0], start={0: 0})
            assert too_old.value.code == 20
            assert too_old.value.oldest_offset == 6 == too_old.value.detail
            with pytest.raises(felix_client.InvalidArgumentError):
                await client.subscribe("positions", shards=[5])
            with pytest.raises(felix_client.InvalidArgumentError):
                await client.subscribe("positions", shards=[0], start={1: 0})
            with pytest.raises(felix_client.StreamNotFoundError):
                await client.subscribe("nowhere")

    run(scenario())


def test_deleting_a_stream_ends_its_subscription(start_broker: StartBroker) -> None:
    """A subscription of a deleted stream raises StreamNotFoundError after its records."""
    broker = start_broker()

    async def scenario() -> None:
        async with await Client.connect(broker.config()) as client:
            await client.create_stream("doomed", 1)
            subscription = await client.subscribe("doomed")
            await client.publish("doomed", [("k", "v")])
            assert payloads(await take(subscription, 1)) == [b"v"]
            await client.delete_stream("doomed")
            with pytest.raises(felix_client.StreamNotFoundError):
                await take(subscription, 1)

    run(scenario())


# A subscriber backlog at its 64 KiB minimum, and frames small enough that the client's
# flow-control window (one frame) is far below what is published: a subscriber that does not
# read stalls the broker's stream, and the broker ends it as lagged once its QUIC send buffers
# and the backlog are full. The ring keeps every record published, for the resume.
LAG_ENV = {
    "FELIX_SUBSCRIBER_QUEUE_MAX_BYTES": "64KiB",
    "FELIX_MAX_FRAME_BYTES": "64KiB",
    "FELIX_MAX_PAYLOAD_BYTES": "16KiB",
    "FELIX_REPLAY_RING_MAX_RECORDS": "4096",
    **TWO_CORES,
}
LAG_PAYLOAD = 16_000
LAG_BATCH = 8
# Far more than the broker buffers for a stalled subscriber (about 6 MiB per core here), and
# well within the ring (4096 records per shard).
LAG_RECORDS_MAX = 4000


async def lag(client: Client, broker: Broker) -> list[bytes]:
    """Publishes while the stream's one subscription does not read, until the broker has
    ended it (no subscriber left); returns the payloads published."""
    sent: list[bytes] = []
    while await asyncio.to_thread(broker.metric_sum, "felix_subscribers") != 0:
        assert len(sent) < LAG_RECORDS_MAX, "the broker never ended the stalled subscriber"
        for _ in range(8):
            records = [
                (f"key-{index}", f"{len(sent) + index:06d}".encode().ljust(LAG_PAYLOAD, b"."))
                for index in range(LAG_BATCH)
            ]
            await client.publish("lagging", records)
            sent.extend(payload for _, payload in records)
    return sent


def check_exactly_once(records: list[DeliveredRecord], sent: list[bytes]) -> None:
    assert sorted(payloads(records)) == sorted(sent), "every record once"
    for shard in {item.shard for item in records}:
        offsets = [item.offset for item in records if item.shard == shard]
        assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)


def test_resume_on_lag(start_broker: StartBroker) -> None:
    """A subscriber that stops reading is ended as subscriber_lagged; with resume_on_lag it
    subscribes again from its positions and gets every record exactly once."""
    broker = start_broker(**LAG_ENV)

    async def scenario() -> None:
        config = broker.config(subscription_window_bytes=1)
        async with await Client.connect(config) as client:
            await client.create_stream("lagging", 4)
            subscription = await client.subscribe("lagging", start=Start.LATEST, resume_on_lag=True)
            sent = await lag(client, broker)
            records = await take(subscription, len(sent))
            assert subscription.resumes >= 1
            check_exactly_once(records, sent)
            subscription.close()

    run(scenario())


def test_lagged_error_exposes_resume_positions(start_broker: StartBroker) -> None:
    """Without resume_on_lag, SubscriberLaggedError (code 21) carries per-shard resume
    positions; subscribing from them loses and repeats nothing."""
    broker = start_broker(**LAG_ENV)

    async def scenario() -> None:
        config = broker.config(subscription_window_bytes=1)
        async with await Client.connect(config) as client:
            await client.create_stream("lagging", 4)
            subscription = await client.subscribe("lagging")
            sent = await lag(client, broker)
            received: list[DeliveredRecord] = []
            with pytest.raises(felix_client.SubscriberLaggedError) as lagged:
                async with asyncio.timeout(DEADLINE):
                    async for item in subscription:
                        received.append(item)
            assert lagged.value.code == 21
            positions = lagged.value.resume_positions
            assert sorted(positions) == [0, 1, 2, 3]
            assert len(received) < len(sent)
            resumed = await client.subscribe("lagging", start=positions)
            rest = await take(resumed, len(sent) - len(received))
            check_exactly_once(received + rest, sent)
            resumed.close()

    run(scenario())


def test_client_side_limits_fail_alone(start_broker: StartBroker) -> None:
    """A request over the broker's limits is refused before sending, as the broker would
    (typed, same code), and the connection carries on."""
    broker = start_broker(FELIX_MAX_PAYLOAD_BYTES="1KiB")

    async def scenario() -> None:
        async with await Client.connect(broker.config()) as client:
            assert client.limits.max_payload_bytes == 1024
            await client.create_stream("small", 1)
            with pytest.raises(felix_client.LimitExceededError):
                await client.publish("small", [("k", b"x" * 1025)])
            with pytest.raises(felix_client.LimitExceededError):
                await client.publish("small", [(b"k" * (client.limits.max_key_bytes + 1), "")])
            with pytest.raises(felix_client.InvalidArgumentError):
                await client.publish("small", [])
            with pytest.raises(felix_client.LimitExceededError):
                await client.describe_stream("n" * 256)
            with pytest.raises(felix_client.StreamNotFoundError):
                await client.publish("missing", [("k", "v")])
            assert (await client.publish("small", [("k", b"x" * 1024)]))[0].count == 1

    run(scenario())
