"""Tenant rate limits set at run time: how they travel from the admin API to every worker.

The admin process validates an override, stores it in the hook store (so it outlives a
restart) and publishes the whole set as the segment's ``overrides`` blob; the supervisor
publishes the stored set before it forks anyone. Each worker checks the blob's generation
every ``POLL_S`` and hands a changed set to its admission. The blob is JSON
``{tenant: [rate, burst]}``.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable

from ankusa_shm.limits import Limit
from ankusa_shm.shm.blob import Blob
from ankusa_shm.store import readers
from ankusa_shm.store.schema import StoreError

log = logging.getLogger("ankusa_shm.overrides")

POLL_S = 0.25  # within the promised second, at four loads of one word a second

Overrides = dict[str, tuple[float, int]]


def publish(blob: Blob, overrides: Overrides) -> None:
    blob.write({t: [rate, burst] for t, (rate, burst) in sorted(overrides.items())})


def publish_stored(blob: Blob, store_path: str) -> None:
    """Publish the set kept in the store: the supervisor before it forks anyone (a restart
    serves the overrides from the first hook), the admin process when it starts (one that
    died between storing a change and publishing it left the two apart). Best effort: the
    store may not exist yet."""
    try:
        stored = readers.overrides(store_path)
    except StoreError as e:
        # No file, or one a worker has created and not yet given its tables: none stored.
        if os.path.exists(store_path) and "no such table" not in str(e):
            log.warning("tenant overrides not published: %s", e)
        return
    publish(blob, stored)


def read(blob: Blob) -> dict[str, Limit]:
    """The published set as limits; an entry that does not validate is logged and left
    out (the tenant keeps its configured limit)."""
    doc = blob.read()
    out: dict[str, Limit] = {}
    if not isinstance(doc, dict):
        return out
    for tenant, spec in doc.items():
        try:
            rate, burst = spec
            out[str(tenant)] = Limit.of(rate, burst)
        except (TypeError, ValueError) as e:
            log.warning("override of %s ignored: %s", tenant, e)
    return out


async def follow(blob: Blob, apply: Callable[[dict[str, Limit]], None]) -> None:
    """Apply the published set now and whenever its generation changes; runs until
    cancelled."""
    seen = -1
    while True:
        gen = blob.generation()
        if gen != seen and gen & 1 == 0:
            seen = gen
            apply(read(blob))
        await asyncio.sleep(POLL_S)
