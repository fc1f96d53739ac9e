"""Idempotent producers (docs/wire-protocol.md section 4.16): against real brokers, a producer's
batches are acked and stored once, also when the same (producer id, sequence) is sent again;
against a scripted server, what a real broker rarely answers (retryable refusals, a broker that
does not echo PRODUCER) gets the Rust client's behaviour: retries with the same producer id and
sequence, bounded, and a fresh id for a shard whose batch failed for good."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from broker import Broker
from conftest import StartBroker, run
from test_broker import TWO_CORES, key_for_shard, take, wait_for_metric
from test_scripted_server import LIMITS, scripted

import felix_client
from felix_client import Client, ErrorCode, Record, ShardAck, Start, StreamKind, wire

PRODUCER = 0x5EED_F00D_0000_0001
DUPLICATES = "felix_core_producer_duplicates_total"
KINDS = [StreamKind.IN_MEMORY, StreamKind.DURABLE]


def batch(index: int, size: int = 8) -> list[Record]:
    """Batch `index`: records whose keys spread over the shards."""
    return [felix_client.record(f"key-{i}", f"batch {index} record {i}") for i in range(size)]


async def read_back(client: Client, stream: str) -> list[bytes]:
    """Every payload the stream holds: as many records as its shards' offsets say are stored,
    read from the earliest."""
    info = await client.describe_stream(stream)
    total = sum(shard.next_offset - shard.oldest_offset for shard in info.shards)
    async with await client.subscribe(stream, start=Start.EARLIEST) as subscription:
        records = await take(subscription, total)
    for shard in {item.shard for item in records}:
        offsets = [item.offset for item in records if item.shard == shard]
        assert offsets == list(range(len(offsets))), "dense offsets per shard"
    return [item.payload for item in records]


def copies(stored: list[bytes], batches: list[list[Record]]) -> Counter[bytes]:
    """How many times each record of `batches` is stored (records not sent count too)."""
    counts = Counter(stored)
    for sent in batches:
        for item in sent:
            counts.setdefault(item.payload, 0)
    return counts


# ---------------------------------------------------------------------------------------------
# Against real brokers


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name.lower())
def test_a_producer_publish_is_acked_and_stored_once(
    start_broker: StartBroker, kind: StreamKind
) -> None:
    """By default the client publishes as an idempotent producer with a random id (the broker
    echoed PRODUCER); a batch over several shards is acked per shard and read back once."""
    broker = start_broker(**TWO_CORES)

    async def scenario() -> None:
        async with await Client.connect(broker.config()) as client:
            assert client.hello.features & wire.FEATURE_PRODUCER
            assert client.producer_id is not None and 0 < client.producer_id < 2**64
            await client.create_stream("produced", 4, kind)
            first = await client.publish("produced", batch(0))
            assert [ack.shard for ack in first] == sorted({ack.shard for ack in first})
            assert sum(ack.count for ack in first) == 8 and len(first) > 1
            assert all(ack.first_offset == 0 for ack in first)
            pending = [await client.publish_pipelined("produced", batch(i)) for i in (1, 2)]
            later = [await acked for acked in pending]
            # Each shard's batches follow one another: batch 1 right after batch 0, and so on.
            for index, acks in enumerate(later, start=1):
                for ack in acks:
                    assert ack.first_offset == index * ack.count
            stored = await read_back(client, "produced")
            counts = copies(stored, [batch(i) for i in range(3)])
            assert len(stored) == 24 and set(counts.values()) == {1}, counts
        assert await broker_duplicates(broker) == 0

    run(scenario())


async def broker_duplicates(broker: Broker) -> float:
    return await asyncio.to_thread(broker.metric_sum, DUPLICATES)


@pytest.mark.parametrize("kind", KINDS, ids=lambda kind: kind.name.lower())
def test_the_same_producer_batch_sent_twice_is_stored_once(
    start_broker: StartBroker, kind: StreamKind
) -> None:
    """publish_sequenced sends a batch as the (producer, sequence) given: the same batch sent
    again is answered with the original ack and not stored again; a gap or an unknown
    producer's later batch is refused out_of_sequence naming the sequence expected."""
    broker = start_broker()

    async def scenario() -> None:
        async with await Client.connect(broker.config()) as client:
            await client.create_stream("dedup", 2, kind)
            key = key_for_shard(1, 2)
            first = [felix_client.record(key, f"first {i}") for i in range(3)]
            second = [felix_client.record(key, "second")]

            acked = await client.publish_sequenced("dedup", first, producer=PRODUCER, sequence=1)
            assert acked == [ShardAck(1, 0, 3)]
            again = await client.publish_sequenced(
                "dedup", first, producer=PRODUCER, sequence=1, shard=1
            )
            assert again == acked, "the original ack, same offsets"
            # The next sequence is stored right after the first batch's one copy.
            after = await client.publish_sequenced("dedup", second, producer=PRODUCER, sequence=2)
            assert after == [ShardAck(1, 3, 1)]

            info = await client.describe_stream("dedup")
            assert [shard.next_offset for shard in info.shards] == [0, 4]
            stored = await read_back(client, "dedup")
            assert stored == [item.payload for item in first + second]
            await wait_for_metric(broker, DUPLICATES, 1)

            with pytest.raises(felix_client.OutOfSequenceError) as gap:
                await client.publish_sequenced("dedup", second, producer=PRODUCER, sequence=5)
            assert gap.value.code == ErrorCode.OUT_OF_SEQUENCE and gap.value.code == 13
            assert gap.value.expected_sequence == 3 == gap.value.detail
            with pytest.raises(felix_client.OutOfSequenceError) as unknown:
                await client.publish_sequenced("dedup", second, producer=PRODUCER + 1, sequence=2)
            assert unknown.value.expected_sequence == 1
            # Nothing of the refused batches was stored.
            info = await client.describe_stream("dedup")
            assert [shard.next_offset for shard in info.shards] == [0, 4]

            with pytest.raises(felix_client.InvalidArgumentError):
                await client.publish_sequenced(
                    "dedup", first, producer=PRODUCER, sequence=3, shard=0
                )
            with pytest.raises(felix_client.StreamNotFoundError):
                await client.publish_sequenced("nowhere", first, producer=PRODUCER, sequence=1)

    run(scenario())


def resend(broker: Broker, **config: object) -> Iterator[list[list[ShardAck]]]:
    """Two clients in turn publish batches 0..2 (several shards each) as configured; yields
    each client's acks."""

    async def publish_all() -> list[list[ShardAck]]:
        async with await Client.connect(broker.config(**config)) as client:
            return [await client.publish("resent", batch(i)) for i in range(3)]

    for _ in range(2):
        yield run(publish_all())


def test_a_new_client_with_the_same_producer_id_stores_a_resend_once(
    start_broker: StartBroker,
) -> None:
    """What an application does after losing its connection: a new client given the same
    producer_id sends the same batches in the same order again; every batch is answered with
    the first client's offsets and each record is stored once."""
    broker = start_broker(**TWO_CORES)
    run(create(broker, "resent"))

    first, second = resend(broker, producer_id=PRODUCER)
    assert second == first

    async def check() -> None:
        async with await Client.connect(broker.config()) as client:
            stored = await read_back(client, "resent")
        counts = copies(stored, [batch(i) for i in range(3)])
        assert len(stored) == 24 and set(counts.values()) == {1}, counts

    run(check())


def test_idempotence_can_be_turned_off(start_broker: StartBroker) -> None:
    """idempotent=False (felix pub --no-idempotence): the Hello does not ask for PRODUCER,
    publishes are plain (a producer_id is ignored), so the same batches sent again by a new
    client are stored twice, and publish_sequenced is refused."""
    broker = start_broker(**TWO_CORES)
    run(create(broker, "resent"))

    async def plain_client() -> None:
        config = broker.config(idempotent=False, producer_id=PRODUCER)
        async with await Client.connect(config) as client:
            assert client.producer_id is None
            assert not client.hello.features & wire.FEATURE_PRODUCER
            with pytest.raises(felix_client.InvalidArgumentError):
                await client.publish_sequenced("resent", batch(0)[:1], producer=1, sequence=1)

    run(plain_client())

    first, second = resend(broker, idempotent=False, producer_id=PRODUCER)
    for acks_first, acks_second in zip(first, second, strict=True):
        assert [ack.shard for ack in acks_first] == [ack.shard for ack in acks_second]
        assert all(
            b.first_offset > a.first_offset for a, b in zip(acks_first, acks_second, strict=True)
        )

    async def check() -> None:
        async with await Client.connect(broker.config()) as client:
            stored = await read_back(client, "resent")
        counts = copies(stored, [batch(i) for i in range(3)])
        assert len(stored) == 48 and set(counts.values()) == {2}, counts
        assert await broker_duplicates(broker) == 0

    run(check())


async def create(broker: Broker, stream: str) -> None:
    async with await Client.connect(broker.config()) as client:
        await client.create_stream(stream, 4)


# ---------------------------------------------------------------------------------------------
# Against a scripted server

ROUTE = wire.StreamRoute("s", wire.StreamKind.IN_MEMORY, 1, wire.HashKind.FNV1A_64, (0,))


def hello_ok(features: int) -> bytes:
    """A HelloOk echoing `features`, with stream "s" (one shard) in its shard map."""
    return wire.encode(wire.HelloOk(1, features, LIMITS, (), (ROUTE,)))


def refusal(frame: wire.ProducerPublish, code: ErrorCode, detail: int) -> bytes:
    return wire.encode(wire.ErrorFrame(frame.request_id, code, detail, code.wire_name))


def ack(frame: wire.ProducerPublish | wire.Publish, first_offset: int = 0) -> bytes:
    shard = frame.shard if isinstance(frame, wire.ProducerPublish) else 0
    return wire.encode(wire.Ack(frame.request_id, (ShardAck(shard, first_offset, 1),)))


def produced(received: list[wire.Frame]) -> list[wire.ProducerPublish]:
    return [frame for frame in received if isinstance(frame, wire.ProducerPublish)]


def test_retryable_answers_are_retried_with_the_same_producer_and_sequence(
    tmp_path: Path,
) -> None:
    """unavailable naming the batch's sequence and ingress_budget_exhausted are retried: the
    same producer id, sequence, shard and records under a new request id, until acked; the
    shard's next batch then takes the next sequence."""
    received: list[wire.Frame] = []
    answers = iter([ErrorCode.UNAVAILABLE, ErrorCode.INGRESS_BUDGET_EXHAUSTED])

    def script(frame: wire.Frame) -> list[bytes]:
        match frame:
            case wire.Hello():
                return [hello_ok(frame.features & wire.FEATURE_PRODUCER)]
            case wire.ProducerPublish():
                code = next(answers, None)
                if code is None:
                    return [ack(frame, frame.sequence - 1)]
                return [refusal(frame, code, frame.sequence)]
        return []

    async def scenario() -> None:
        server, config = await scripted(tmp_path, script, received)
        config.producer_id = PRODUCER
        config.publish_retry_backoff = 0.001
        try:
            async with await Client.connect(config) as client:
                assert client.producer_id == PRODUCER
                assert await client.publish("s", [("k", "v")]) == [ShardAck(0, 0, 1)]
                assert await client.publish("s", [("k", "w")]) == [ShardAck(0, 1, 1)]
        finally:
            server.close()
        hello = received[0]
        assert isinstance(hello, wire.Hello) and hello.features & wire.FEATURE_PRODUCER
        sent = produced(received)
        assert [(f.producer, f.sequence, f.shard) for f in sent] == [
            (PRODUCER, 1, 0),
            (PRODUCER, 1, 0),
            (PRODUCER, 1, 0),
            (PRODUCER, 2, 0),
        ]
        assert {f.records for f in sent[:3]} == {(Record(b"k", b"v"),)}
        assert len({f.request_id for f in sent}) == 4, "each attempt has its own request id"
        assert not [frame for frame in received if isinstance(frame, wire.Publish)]

    run(scenario())


def test_a_batch_behind_a_missing_one_is_retried(tmp_path: Path) -> None:
    """Pipelined batches 1 and 2: batch 1 answered unavailable, batch 2 out_of_sequence naming
    1 (the missing earlier batch); both are retried as they were and both acked."""
    received: list[wire.Frame] = []
    refused: set[int] = set()

    def script(frame: wire.Frame) -> list[bytes]:
        match frame:
            case wire.Hello():
                return [hello_ok(wire.FEATURE_PRODUCER)]
            case wire.ProducerPublish():
                if frame.sequence not in refused:
                    refused.add(frame.sequence)
                    if frame.sequence == 1:
                        return [refusal(frame, ErrorCode.UNAVAILABLE, 1)]
                    return [refusal(frame, ErrorCode.OUT_OF_SEQUENCE, 1)]
                return [ack(frame, frame.sequence - 1)]
        return []

    async def scenario() -> None:
        server, config = await scripted(tmp_path, script, received)
        config.publish_retry_backoff = 0.001
        try:
            async with await Client.connect(config) as client:
                pending = [await client.publish_pipelined("s", [("k", v)]) for v in "ab"]
                assert [await acked for acked in pending] == [
                    [ShardAck(0, 0, 1)],
                    [ShardAck(0, 1, 1)],
                ]
                producer = client.producer_id
        finally:
            server.close()
        sent = produced(received)
        assert Counter(f.sequence for f in sent) == {1: 2, 2: 2}
        assert {f.producer for f in sent} == {producer}

    run(scenario())


@pytest.mark.parametrize(
    ("code", "detail", "error"),
    [
        (ErrorCode.OUT_OF_SEQUENCE, 1, felix_client.OutOfSequenceError),
        (ErrorCode.OUT_OF_SEQUENCE, 0, felix_client.OutOfSequenceError),
        (ErrorCode.UNAVAILABLE, 0, felix_client.UnavailableError),
        (ErrorCode.STORAGE_FULL, 0, felix_client.StorageFullError),
    ],
    ids=["out-of-sequence-1", "out-of-sequence-0", "unavailable-0", "storage-full"],
)
def test_a_batch_refused_for_good_moves_its_shard_to_a_new_producer_id(
    tmp_path: Path, code: ErrorCode, detail: int, error: type[felix_client.FelixError]
) -> None:
    """A refusal that retrying cannot fix (the shard expects this very sequence, a plain
    unavailable, storage full) is raised after one attempt; the shard's later batches go out
    under a fresh random producer id from sequence 1 (the refused sequence is a gap)."""
    received: list[wire.Frame] = []
    first = True

    def script(frame: wire.Frame) -> list[bytes]:
        nonlocal first
        match frame:
            case wire.Hello():
                return [hello_ok(wire.FEATURE_PRODUCER)]
            case wire.ProducerPublish():
                if first:
                    first = False
                    return [refusal(frame, code, detail)]
                return [ack(frame)]
        return []

    async def scenario() -> None:
        server, config = await scripted(tmp_path, script, received)
        config.producer_id = PRODUCER
        config.publish_retry_backoff = 0.001
        try:
            async with await Client.connect(config) as client:
                with pytest.raises(error) as refused:
                    await client.publish("s", [("k", "v")])
                assert refused.value.code == code and refused.value.detail == detail
                assert await client.publish("s", [("k", "v")]) == [ShardAck(0, 0, 1)]
                assert client.producer_id == PRODUCER
        finally:
            server.close()
        sent = produced(received)
        assert [(f.producer == PRODUCER, f.sequence) for f in sent] == [(True, 1), (False, 1)]

    run(scenario())


@pytest.mark.parametrize("retries", [0, 3])
def test_retries_are_bounded(tmp_path: Path, retries: int) -> None:
    """A broker that keeps answering ingress_budget_exhausted gets the batch publish_retries
    + 1 times, then the client raises the refusal."""
    received: list[wire.Frame] = []

    def script(frame: wire.Frame) -> list[bytes]:
        match frame:
            case wire.Hello():
                return [hello_ok(wire.FEATURE_PRODUCER)]
            case wire.ProducerPublish():
                return [refusal(frame, ErrorCode.INGRESS_BUDGET_EXHAUSTED, 0)]
        return []

    async def scenario() -> None:
        server, config = await scripted(tmp_path, script, received)
        config.publish_retries = retries
        config.publish_retry_backoff = 0.001
        try:
            async with await Client.connect(config) as client:
                with pytest.raises(felix_client.IngressBudgetExhaustedError):
                    await client.publish("s", [("k", "v")])
        finally:
            server.close()
        sent = produced(received)
        assert len(sent) == retries + 1
        assert {(f.producer, f.sequence) for f in sent} == {(sent[0].producer, 1)}

    run(scenario())


@pytest.mark.parametrize("idempotent", [True, False], ids=["not-echoed", "turned-off"])
def test_plain_publishes_without_the_producer_feature(tmp_path: Path, idempotent: bool) -> None:
    """A broker that does not echo PRODUCER, or a client with idempotent=False, publishes plain
    Publish frames, never retried, and publish_sequenced is refused."""
    received: list[wire.Frame] = []

    def script(frame: wire.Frame) -> list[bytes]:
        match frame:
            case wire.Hello():
                # A broker from before idempotent producers: the bit is not echoed.
                return [hello_ok(0)]
            case wire.Publish(ack=wire.AckMode.ACKED):
                return [
                    wire.encode(wire.ErrorFrame(frame.request_id, ErrorCode.UNAVAILABLE, 0, ""))
                ]
        return []

    async def scenario() -> None:
        server, config = await scripted(tmp_path, script, received)
        config.idempotent = idempotent
        config.publish_retry_backoff = 0.001
        try:
            async with await Client.connect(config) as client:
                assert client.producer_id is None
                with pytest.raises(felix_client.UnavailableError):
                    await client.publish("s", [("k", "v")])
                with pytest.raises(felix_client.InvalidArgumentError):
                    await client.publish_sequenced("s", [("k", "v")], producer=1, sequence=1)
        finally:
            server.close()
        hello = received[0]
        assert isinstance(hello, wire.Hello)
        assert bool(hello.features & wire.FEATURE_PRODUCER) == idempotent
        assert [type(frame) for frame in received[1:]] == [wire.Publish]

    run(scenario())


def test_producer_settings_are_checked_before_connecting() -> None:
    """A producer id that is not a non-zero u64, or negative retry settings, are refused
    before any connection is attempted (the port is never dialled)."""
    for overrides in (
        {"producer_id": 0},
        {"producer_id": 2**64},
        {"publish_retries": -1},
        {"publish_retry_backoff": -0.5},
    ):
        config = felix_client.ClientConfig(port=9, connect_timeout=0.01)
        for name, value in overrides.items():
            setattr(config, name, value)
        with pytest.raises(felix_client.InvalidArgumentError, match=next(iter(overrides))):
            run(Client.connect(config))
