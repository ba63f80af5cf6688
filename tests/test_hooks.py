"""Hook ids: UUIDv7 with the receiving millisecond in front."""

from __future__ import annotations

import uuid

from ankusa_shm.hooks import new_hook_id


def test_hook_ids_are_uuid7_carrying_their_millisecond() -> None:
    for ms in (0, 1_733_356_800_123, (1 << 48) - 1):
        for _ in range(500):
            u = uuid.UUID(new_hook_id(ms))
            assert u.version == 7
            assert u.variant == uuid.RFC_4122
            assert u.int >> 80 == ms


def test_hook_ids_sort_by_time_and_do_not_repeat() -> None:
    ids = [new_hook_id(1_733_356_800_000 + i // 100) for i in range(5_000)]
    assert len(set(ids)) == len(ids)
    by_ms = [i[:13] for i in ids]
    assert by_ms == sorted(by_ms)
