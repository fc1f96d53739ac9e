"""Key -> shard hash (docs/wire-protocol.md section 8): 64-bit FNV-1a modulo the shard count.

The broker routes with the same function, so a client can compute each record's shard and send
it straight to the core that owns that shard.
"""

from __future__ import annotations

FNV_OFFSET_BASIS = 0xCBF29CE484222325
FNV_PRIME = 0x100000001B3
_MASK_64 = (1 << 64) - 1


def fnv1a_64(key: bytes) -> int:
    """64-bit FNV-1a of `key`."""
    value = FNV_OFFSET_BASIS
    for byte in key:
        value = ((value ^ byte) * FNV_PRIME) & _MASK_64
    return value


def shard_for_key(key: bytes, shard_count: int) -> int:
    """The shard of a stream with `shard_count` shards (at least 1) that `key` belongs to."""
    if shard_count < 1:
        raise ValueError(f"a stream has at least one shard, not {shard_count}")
    return fnv1a_64(key) % shard_count
