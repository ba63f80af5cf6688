"""What a hook is as it travels the request path, and what the store said of it.

Leaf types shared by the stages: the request path builds an ``Envelope`` for admission
and a ``NewHook`` for the store; the store answers with a ``CommitResult`` that
admission's ``settle`` turns into a promote or a release.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass

from ankusa_shm.shm.layout import MAX_EVENT_KEY

Headers = tuple[tuple[str, str], ...]
"""Header (lower-case name, value) pairs, in the order received."""


def bounded_event_key(raw: bytes) -> bytes:
    """The event key as stored and claimed: keys longer than ``MAX_EVENT_KEY`` bytes are
    replaced by ``sha256:<hex>`` of themselves, so every key fits the index and a claim."""
    if len(raw) <= MAX_EVENT_KEY:
        return raw
    return b"sha256:" + hashlib.sha256(raw).hexdigest().encode()


@dataclass(frozen=True, slots=True)
class Envelope:
    """A verified hook. ``event_key`` is None when its source gives no dedupe key."""

    event_key: bytes | None = None


@dataclass(slots=True)
class NewHook:
    """A verified, admitted hook on its way into the host's store. Not frozen, though
    nothing changes it: a frozen dataclass's ``__init__`` sets each field through
    ``object.__setattr__``, three times the cost, and one is built per hook."""

    id: str
    tenant: str
    source: str
    event_key: bytes | None  # bounded; None: no local dedupe for this hook
    dedupe_ttl_s: int  # how long the local index remembers the key
    received_ms: int  # wall clock, ms since the epoch
    headers: Headers  # the headers worth keeping
    body: bytes


@dataclass(frozen=True, slots=True)
class Committed:
    """The hook is durable under ``hook_id``."""

    hook_id: str


@dataclass(frozen=True, slots=True)
class AlreadyStored:
    """The host's own index knew the event key: durable earlier under ``hook_id``."""

    hook_id: str


@dataclass(frozen=True, slots=True)
class NotStored:
    """Nothing was stored (store unavailable, overloaded, ...)."""

    reason: str


CommitResult = Committed | AlreadyStored | NotStored

Claimed = tuple[str, str, bytes, str, int]
"""A stored keyed hook that holds its key in the dedupe index, as the store lists those a
crash may have left unsettled: tenant, source, event key, hook id, and when its index row
expires (wall ms)."""


_RANDOM_MASK = ~(0xF << 76 | 0x3 << 62)  # every random bit but the version and variant's
_VERSION_7 = 0x7 << 76 | 0x2 << 62  # version 7, RFC 9562 variant 0b10


def new_hook_id(wall_ms: int) -> str:
    """A UUIDv7: 48 bits of Unix milliseconds, then random bits. Sortable by time across
    hosts, unique without coordination. The bits come from ``random``, which is reseeded
    in every forked child, not from ``os.urandom``: an id need not be unguessable, and a
    system call per hook drops the GIL to the store's writer thread."""
    n = (wall_ms & 0xFFFF_FFFF_FFFF) << 80 | random.getrandbits(80) & _RANDOM_MASK | _VERSION_7
    h = n.to_bytes(16).hex()
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
