"""Node-scope rate limits: a GCRA table in the segment, one bucket per tenant.

Open addressing on a 64-bit hash of the tenant id, probing ``GCRA_PROBE`` slots from the
tenant's home slot. A slot's key word is claimed by compare-and-swap from 0 and never
emptied again, so a lookup may stop at the first empty slot. When every slot it may use is
taken, a slot whose bucket has drained (TAT in the past: the same as a fresh bucket) is
taken over for the new tenant. When none has drained, the hook is admitted unmetered and
counted: a full table never refuses a hook.

The TAT word carries a tag of its tenant's hash (see layout.py): a word with another tag
is a fresh bucket for whoever now owns the key, and a process still updating the old
tenant's bucket fails its compare-and-swap instead of charging the new one.

``take`` -- the lookup, the claim of a slot and the compare-and-swap -- runs in the C
extension (``AtomicView.gcra_take``): as Python it cost ~720 ns a hook, in C ~100 ns
(scripts/bench_shm.py). The Python below reads the same format for ``usage`` and
``reset``; ``GCRA_FORMAT`` is checked at import so the two cannot drift apart. ``usage``
(every scrape and ``inspect``) finds the few slots in use by a plain scan of the key
words in C -- 65,536 atomic loads from Python took 10-16 ms -- and reads those atomically.
"""

from __future__ import annotations

import functools
import hashlib
import itertools

from ankusa_shm._atomics import GCRA_FORMAT, AtomicView
from ankusa_shm.limits import MAX_SPAN_US, Limit, retry_ms
from ankusa_shm.shm import layout as L
from ankusa_shm.shm.counters import Counter, CounterRow

_HALF = (L.GCRA_TAT_MASK + 1) >> 1

_FORMAT = (
    L.GCRA_SLOT_BYTES,
    L.GS_KEY,
    L.GS_TAT,
    L.GCRA_TAG_SHIFT,
    L.GCRA_TAG_MASK,
    L.GCRA_TAT_MASK,
    MAX_SPAN_US,
)
if GCRA_FORMAT != _FORMAT:
    raise ImportError(f"_atomics GCRA format {GCRA_FORMAT} is not layout.py's {_FORMAT}")


@functools.lru_cache(maxsize=8192)
def tenant_hash(tenant: str) -> tuple[int, int]:
    """(key, tag): a stable non-zero 63-bit hash (Python's hash() differs per process) and
    its non-zero 14-bit tag."""
    h = int.from_bytes(hashlib.blake2b(tenant.encode(), digest_size=8).digest(), "little")
    h &= (1 << 63) - 1
    h = h or 1
    return h, ((h >> L.GCRA_TAG_SHIFT) & L.GCRA_TAG_MASK) or 1


def _lead(word: int, tag: int, now_us: int) -> int:
    """How far the bucket's TAT is ahead of now (<= 0: drained). Another tag, or a lead no
    limit could produce (a word older than half the 49-bit clock), is a fresh bucket."""
    if word >> L.GCRA_TAG_SHIFT != tag:
        return 0
    d = ((word & L.GCRA_TAT_MASK) - now_us) & L.GCRA_TAT_MASK
    if d >= _HALF:
        return 0  # in the past
    return d if d <= MAX_SPAN_US else 0


class GcraTable:
    def __init__(
        self, view: AtomicView, buf: memoryview, lay: L.Layout, row: CounterRow | None = None
    ) -> None:
        self._view = view
        self._base = lay.offset("gcra")
        self.slots = lay.params.gcra_slots
        self._row = row
        self._buf = buf

    def take(self, tenant: str, limit: Limit, now_us: int) -> int:
        """Charge one hook: 0 if admitted, else milliseconds to wait (>= 1)."""
        key, tag = tenant_hash(tenant)
        over = self._view.gcra_take(
            self._base, self.slots, L.GCRA_PROBE, key, tag, limit.interval_us, limit.span_us, now_us
        )
        if over == 0:
            return 0
        if over < 0:
            if self._row is not None:
                self._row.add(Counter.LIMITER_TABLE_FULL)
            return 0
        return retry_ms(over)

    def refund(self, tenant: str, limit: Limit, now_us: int) -> None:
        """Give back one hook's charge (it was a duplicate, which the fleet's buckets are
        never charged for): the TAT moves back one interval, never behind now."""
        key, tag = tenant_hash(tenant)
        off = self._lookup(key)
        if off < 0:
            return
        at = off + L.GS_TAT
        while True:
            word = self._view.load(at)
            lead = _lead(word, tag, now_us)
            if lead <= 0:
                return
            tat = now_us + max(0, lead - limit.interval_us)
            if self._view.cas(at, word, (tag << L.GCRA_TAG_SHIFT) | (tat & L.GCRA_TAT_MASK)):
                return

    def reset(self, tenant: str) -> bool:
        """Forget the tenant's bucket (its limit changed); False if it had none."""
        key, _ = tenant_hash(tenant)
        off = self._lookup(key)
        if off < 0:
            return False
        self._view.store(off + L.GS_TAT, 0)
        return True

    def usage(self, now_us: int) -> tuple[int, int]:
        """(slots holding a tenant, of which still filling: TAT ahead of now)."""
        used = busy = 0
        end = self._base + self.slots * L.GCRA_SLOT_BYTES
        step = L.GCRA_SLOT_BYTES // 8
        # Views of the segment are released at once: one left open would keep it from closing.
        with (
            self._buf[self._base : end] as table,
            table.cast("Q") as words,
            words[L.GS_KEY // 8 :: step] as key_words,
        ):
            keys = key_words.tolist()
        for i in itertools.compress(range(self.slots), keys):
            off = self._base + i * L.GCRA_SLOT_BYTES
            key = self._view.load(off + L.GS_KEY)
            if key:
                used += 1
                tag = ((key >> L.GCRA_TAG_SHIFT) & L.GCRA_TAG_MASK) or 1
                if _lead(self._view.load(off + L.GS_TAT), tag, now_us) > 0:
                    busy += 1
        return used, busy

    def _lookup(self, key: int) -> int:
        home = key % self.slots
        for i in range(L.GCRA_PROBE):
            off = self._base + ((home + i) % self.slots) * L.GCRA_SLOT_BYTES
            k = self._view.load(off + L.GS_KEY)
            if k == key:
                return off
            if k == 0:
                return -1
        return -1
