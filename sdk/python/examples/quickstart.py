"""Quick start: connect to the broker `make run` starts (127.0.0.1:7400, development
certificate), create a stream, subscribe, publish, read the records back.

    python examples/quickstart.py [HOST [PORT]]
"""

from __future__ import annotations

import asyncio
import contextlib
import sys

import felix_client
from felix_client import Client, ClientConfig, Start


async def main(host: str, port: int) -> None:
    config = ClientConfig(host=host, port=port, ca=felix_client.dev_cert_path())
    async with await Client.connect(config) as client:
        # A second run reuses the stream.
        with contextlib.suppress(felix_client.StreamExistsError):
            await client.create_stream("quickstart", 4)
        async with await client.subscribe("quickstart", start=Start.LATEST) as subscription:
            acks = await client.publish(
                "quickstart", [("customer-7", "hello"), ("customer-8", "world")]
            )
            for ack in acks:
                print(f"acked: shard {ack.shard} offsets {ack.first_offset}..+{ack.count}")
            received = 0
            async for record in subscription:
                key, payload = record.key.decode(), record.payload.decode()
                print(f"{record.shard}:{record.offset} {key} {payload}")
                received += 1
                if received == 2:
                    break


if __name__ == "__main__":
    host = sys.argv[1] if len(sys.argv) > 1 else "127.0.0.1"
    port = int(sys.argv[2]) if len(sys.argv) > 2 else 7400
    try:
        asyncio.run(main(host, port))
    except felix_client.FelixError as error:
        sys.exit(f"felix: {error}")
