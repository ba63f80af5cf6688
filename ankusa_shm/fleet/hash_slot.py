"""The Redis Cluster hash slot of a key, without importing a Redis library for it.

A key's slot is CRC16 (the XMODEM variant: polynomial 0x1021, initial value 0, no bit
reflection, no final xor) of the key, modulo 16384. If the key holds a ``{`` followed
later by a ``}`` with at least one byte between them, only the bytes between the first
``{`` and the first ``}`` after it are hashed: that *hash tag* is how the fleet keeps one
tenant's keys on one node. An empty tag (``{}``) does not count and the whole key is hashed.

``binascii.crc_hqx`` is that CRC, written in C and part of the standard library.
"""

from __future__ import annotations

from binascii import crc_hqx

SLOTS = 16384


def hash_tag(key: bytes) -> bytes:
    """The part of ``key`` that decides its slot."""
    start = key.find(b"{")
    if start < 0:
        return key
    end = key.find(b"}", start + 1)
    if end <= start + 1:  # no closing brace, or an empty tag
        return key
    return key[start + 1 : end]


def key_slot(key: bytes) -> int:
    return crc_hqx(hash_tag(key), 0) % SLOTS


def spread_tags(n: int) -> list[str]:
    """``n`` short hash tags whose slots fall one in each of ``n`` equal ranges of the
    slot space, the same on every host: keys tagged with them lie on every node of a
    cluster whose nodes each serve at least one whole range (``SLOTS / n`` slots in a
    row)."""
    width = -(-SLOTS // n)
    tags: list[str | None] = [None] * n
    left, i = n, 0
    while left:
        tag = str(i)
        bucket = key_slot(tag.encode()) // width
        if tags[bucket] is None:
            tags[bucket] = tag
            left -= 1
        i += 1
    return [t for t in tags if t is not None]
