"""The admin process's two store handles, each on a thread of its own.

The ``Reader`` and the ``Control`` are synchronous and their sqlite connections belong to
one thread; a commit's fsync or a wait for the writers' lock must not stop the event loop,
which also answers ``/metrics`` and heartbeats. Each gets a one-thread executor, so reads
never queue behind a slow write.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from ankusa_shm import config
from ankusa_shm.store.control import Control
from ankusa_shm.store.lock import Queue
from ankusa_shm.store.readers import Reader

T = TypeVar("T")


class StoreCalls:
    def __init__(self, cfg: config.Store, turns: Queue | None = None) -> None:
        self.path = cfg.path
        self._reader = Reader(cfg.path)
        self._control = Control(cfg, turns=turns)
        self._reads = ThreadPoolExecutor(1, thread_name_prefix="admin-read")
        self._writes = ThreadPoolExecutor(1, thread_name_prefix="admin-write")

    async def read(self, call: Callable[[Reader], T]) -> T:
        """``call(reader)`` on the reading thread; a failure is the store's ``StoreError``."""
        return await asyncio.get_running_loop().run_in_executor(self._reads, call, self._reader)

    async def write(self, call: Callable[[Control], T]) -> T:
        """``call(control)`` on the writing thread."""
        return await asyncio.get_running_loop().run_in_executor(self._writes, call, self._control)

    async def close(self) -> None:
        """Close each handle on its own thread, after whatever that thread still runs."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self._reads, self._reader.close)
        await loop.run_in_executor(self._writes, self._control.close)
        self._reads.shutdown()
        self._writes.shutdown()
