"""Felix client SDK: a QUIC + TLS publish/subscribe client for the Felix broker, on asyncio.

>>> import asyncio, felix_client
>>> async def main() -> None:
...     config = felix_client.ClientConfig(ca=felix_client.dev_cert_path())
...     async with await felix_client.Client.connect(config) as client:
...         await client.create_stream("orders", 4)
...         print(await client.publish("orders", [("customer-7", "hello")]))
"""

from .client import (
    EARLIEST,
    LATEST,
    Client,
    PendingAck,
    RecordLike,
    StartLike,
    Subscription,
    record,
)
from .config import ClientConfig, data_dir, dev_cert_path
from .errors import (
    ErrorCode,
    FelixConnectionError,
    FelixError,
    FrameTooLargeError,
    IngressBudgetExhaustedError,
    InternalError,
    InvalidArgumentError,
    LimitExceededError,
    MalformedError,
    OutOfSequenceError,
    PermissionDeniedError,
    ProtocolViolationError,
    ShuttingDownError,
    StorageFailedError,
    StorageFullError,
    StreamExistsError,
    StreamNotFoundError,
    SubscriberLaggedError,
    TooOldError,
    UnauthenticatedError,
    UnavailableError,
    UnknownFrameTypeError,
    UnsupportedVersionError,
)
from .hash import fnv1a_64, shard_for_key
from .wire import (
    DeliveredRecord,
    HelloOk,
    Limits,
    Record,
    ShardAck,
    ShardInfo,
    Start,
    StreamInfo,
    StreamKind,
    StreamSummary,
)

__version__ = "0.1.0"

__all__ = [
    "EARLIEST",
    "LATEST",
    "Client",
    "ClientConfig",
    "DeliveredRecord",
    "ErrorCode",
    "FelixConnectionError",
    "FelixError",
    "FrameTooLargeError",
    "HelloOk",
    "IngressBudgetExhaustedError",
    "InternalError",
    "InvalidArgumentError",
    "LimitExceededError",
    "Limits",
    "MalformedError",
    "OutOfSequenceError",
    "PendingAck",
    "PermissionDeniedError",
    "ProtocolViolationError",
    "Record",
    "RecordLike",
    "ShardAck",
    "ShardInfo",
    "ShuttingDownError",
    "Start",
    "StartLike",
    "StorageFailedError",
    "StorageFullError",
    "StreamExistsError",
    "StreamInfo",
    "StreamKind",
    "StreamNotFoundError",
    "StreamSummary",
    "SubscriberLaggedError",
    "Subscription",
    "TooOldError",
    "UnauthenticatedError",
    "UnavailableError",
    "UnknownFrameTypeError",
    "UnsupportedVersionError",
    "__version__",
    "data_dir",
    "dev_cert_path",
    "fnv1a_64",
    "record",
    "shard_for_key",
]
