"""What a hook is as it travels the request path, and what the store said of it.

Leaf types shared by the stages: the worker builds an ``Envelope``, admission reads it,
the store answers with a ``CommitResult`` that admission's ``settle`` turns into a
promote or a release.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Envelope:
    """A verified hook. ``event_key`` is None when its source gives no dedupe key."""

    event_key: bytes | None = None


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
