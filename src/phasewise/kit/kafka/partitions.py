"""Which partition a keyed record goes to: Kafka's murmur2 partitioner (:func:`partition_for`).

The same placement as the worker's producer (librdkafka ``murmur2_random``, the Java client's
default), so an actuator reads only its host's decisions partition (docs/security.md, "One partition").
"""

from __future__ import annotations

__all__ = ["PARTITIONER", "murmur2", "partition_for"]

#: librdkafka's name of the partitioner the worker's producer uses for decisions
PARTITIONER = "murmur2_random"

_M = 0x5BD1E995
_SEED = 0x9747B28C
_MASK = 0xFFFFFFFF


def murmur2(data: bytes) -> int:
    """Kafka's 32-bit murmur2 of *data* (``org.apache.kafka.common.utils.Utils.murmur2``), signed."""
    length = len(data)
    h = (_SEED ^ length) & _MASK
    n4 = length // 4
    for i in range(n4):
        k = int.from_bytes(data[4 * i: 4 * i + 4], "little")
        k = (k * _M) & _MASK
        k ^= k >> 24
        k = (k * _M) & _MASK
        h = (h * _M) & _MASK
        h ^= k
    rest = length % 4
    tail = data[4 * n4:]
    if rest == 3:
        h ^= tail[2] << 16
    if rest >= 2:
        h ^= tail[1] << 8
    if rest >= 1:
        h ^= tail[0]
        h = (h * _M) & _MASK
    h ^= h >> 13
    h = (h * _M) & _MASK
    h ^= h >> 15
    return h - (1 << 32) if h & 0x80000000 else h


def partition_for(key: bytes, partitions: int) -> int:
    """The partition of a record keyed *key* among *partitions* (``murmur2_random``, Java's default).

    >>> murmur2(b"21")  # the Java client's test vector
    -973932308
    >>> [partition_for(k, 3) for k in (b"host-a", b"host-b", b"host-c")]
    [1, 0, 1]
    """
    if partitions < 1:
        raise ValueError(f"a topic has at least one partition, got {partitions}")
    return (murmur2(key) & 0x7FFFFFFF) % partitions
