"""Shared fixtures: throwaway segments and private redis-servers on free loopback ports.

Never the machine's own Redis on 6379: each server here is started by the test session,
talks only to 127.0.0.1 on a port the kernel picked, and is stopped by its PID.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from typing import NoReturn

import pytest
from redis_server import RedisServer

from ankusa_shm.shm import segment as segmod
from ankusa_shm.shm.segment import Segment

SMALL = segmod.make_params(queue_capacity=1024, gcra_slots=1024, process_slots=64)


@pytest.fixture
def seg_name() -> Iterator[str]:
    name = f"ankusa-test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    yield name
    segmod.unlink(name)


@pytest.fixture
def seg(seg_name: str) -> Iterator[Segment]:
    s = Segment.create(seg_name, SMALL)
    yield s
    s.close()


def cannot_run(why: str) -> NoReturn:
    """A test this machine cannot run: skipped on a developer's machine, a failure in CI
    (``CI=true``), where a skip would hide the behaviour it checks."""
    if os.environ.get("CI") == "true":
        pytest.fail(why)
    pytest.skip(why)


def _need_redis_server() -> None:
    if not shutil.which("redis-server"):
        cannot_run("redis-server is not on PATH (apt install redis-server)")


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    _need_redis_server()
    server = RedisServer()
    yield server
    server.close()
