"""A seqlocked JSON document in the segment: one writer, any number of readers.

The configuration snapshot, the source table and the tenant overrides are each one blob
(``layout``): the writer makes the generation odd, copies the bytes, stores the length and
makes the generation even again; a reader keeps a copy only if the generation was the
same even number before and after it. Readers poll ``generation`` to learn of a change
without parsing anything.
"""

from __future__ import annotations

import json
import time
from typing import Any

from ankusa_shm._atomics import AtomicView
from ankusa_shm.shm import layout as L

_RETRIES = 100


class BlobTooLarge(ValueError):
    pass


class Blob:
    def __init__(self, view: AtomicView, buf: memoryview, lay: L.Layout, region: str) -> None:
        self._view = view
        self._buf = buf
        self._base = lay.offset(region)
        self.capacity = L.BLOB_BYTES[region] - L.BLOB_DATA
        self.region = region

    def generation(self) -> int:
        return self._view.load(self._base + L.BLOB_GENERATION)

    def write(self, doc: Any) -> None:
        """Publish ``doc`` (JSON-able). Only the region's one writer may call this."""
        data = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
        if len(data) > self.capacity:
            raise BlobTooLarge(f"{self.region}: {len(data)} bytes, room for {self.capacity}")
        v, base = self._view, self._base
        gen = v.load(base + L.BLOB_GENERATION)
        v.store(base + L.BLOB_GENERATION, gen | 1)
        self._buf[base + L.BLOB_DATA : base + L.BLOB_DATA + len(data)] = data
        v.store(base + L.BLOB_LENGTH, len(data))
        v.store(base + L.BLOB_GENERATION, (gen | 1) + 1)

    def read(self) -> Any:
        """The published document; None if none was ever written, or it cannot be read
        whole (a writer died mid-write, or the bytes are not JSON)."""
        v, base = self._view, self._base
        for _ in range(_RETRIES):
            gen = v.load(base + L.BLOB_GENERATION)
            n = min(max(v.load(base + L.BLOB_LENGTH), 0), self.capacity)
            data = bytes(self._buf[base + L.BLOB_DATA : base + L.BLOB_DATA + n])
            if gen & 1 == 0 and v.load(base + L.BLOB_GENERATION) == gen:
                if not data:
                    return None
                try:
                    return json.loads(data)
                except (ValueError, RecursionError):  # nested past the parser's depth
                    return None
            time.sleep(0.001)
        return None
