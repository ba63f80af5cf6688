"""How many client connections a worker holds, and what happens at the most it may: the
real service, real sockets, a real open-file limit."""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from service import Service

DEMO = """
[[sources]]
id = "demo"
tenant = "demo"
"""

# Runs the service under an open-file limit of (soft, hard), as a shell's ulimit would.
LIMITED = (
    "import os, resource, sys; "
    "resource.setrlimit(resource.RLIMIT_NOFILE, (int(sys.argv[1]), int(sys.argv[2]))); "
    "os.execv(sys.argv[3], sys.argv[3:])"
)


def limited(soft: int, hard: int) -> list[str]:
    return [sys.executable, "-c", LIMITED, str(soft), str(hard)]


def shed(svc: Service, closed: str) -> int:
    status, _, body = svc.admin("GET", "/metrics")
    assert status == 200
    text = body.decode()
    m = re.search(rf'^ankusa_connections_shed_total{{closed="{closed}"}} (\S+)$', text, re.M)
    assert m, text
    return int(float(m.group(1)))


def opened(svc: Service, n: int) -> list[socket.socket]:
    """``n`` connections that send nothing, each accepted before the next is made."""
    socks = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", svc.port), timeout=5)
        socks.append(s)
        time.sleep(0.02)
    return socks


def closed_by_server(s: socket.socket, wait_s: float) -> bool:
    s.settimeout(wait_s)
    try:
        return s.recv(1) == b""
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


def post(svc: Service) -> int:
    return svc.post("demo", b'{"n": 1}').status


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Service]:
    s = Service(tmp_path, DEMO, server={"workers": 1, "max_connections": 8})
    try:
        yield s.start()
    finally:
        s.close()


def test_at_the_cap_a_new_connection_closes_the_longest_idle_one(svc: Service) -> None:
    idle = opened(svc, 8)
    try:
        assert post(svc) == 201  # the ninth connection
        assert closed_by_server(idle[0], 2.0)
        assert not any(closed_by_server(s, 0.1) for s in idle[1:])
        assert post(svc) == 201  # seven idle and this one: under the cap
        assert not closed_by_server(idle[1], 0.2)
        idle += opened(svc, 1)
        assert post(svc) == 201
        assert closed_by_server(idle[1], 2.0)
        assert not any(closed_by_server(s, 0.1) for s in idle[2:])
        assert shed(svc, "idle") == 2
        assert shed(svc, "new") == 0
        # said while the one shed still counted: at the cap, not one under it
        assert "8 client connections open, the most this process holds" in svc.log()
    finally:
        for s in idle:
            s.close()


def test_blank_lines_between_requests_leave_a_connection_idle(svc: Service) -> None:
    """A client may send CRLFs before a request (RFC 9112 2.2); they begin none. Counted
    as a request begun, eight such clients held every place and each new one was shed."""
    idle = opened(svc, 8)
    try:
        for s in idle:
            s.sendall(b"\r\n")
        time.sleep(0.2)
        assert post(svc) == 201
        assert closed_by_server(idle[0], 2.0)  # the longest idle, CRLF or not
        assert not any(closed_by_server(s, 0.1) for s in idle[1:])
        assert shed(svc, "idle") == 1 and shed(svc, "new") == 0
    finally:
        for s in idle:
            s.close()


def test_requests_sent_while_their_worker_was_stopped_are_answered(tmp_path: Path) -> None:
    """A worker that did not run for longer than the keep-alive (stopped, the host
    paused) woke to its overdue sweep before it read anything: its kept-alive
    connections were past their deadline, and each was reset with the request its client
    had sent meanwhile unread (all 20 of 5 rounds of 4)."""
    svc = Service(tmp_path, DEMO, server={"workers": 1, "keepalive_timeout_s": 1.0})
    try:
        svc.start()
        (worker,) = svc.pids("worker")
        for _ in range(2):
            clients = [svc.connection() for _ in range(4)]
            for c in clients:
                assert svc.post("demo", b'{"n": 1}', conn=c).status == 201
            os.kill(worker, signal.SIGSTOP)
            try:
                time.sleep(2.5)  # past the keep-alive
                for c in clients:
                    c.request("POST", "/hooks/demo", body=b'{"n": 2}')
                time.sleep(0.1)
            finally:
                os.kill(worker, signal.SIGCONT)
            for c in clients:
                assert c.getresponse().status == 201
                c.close()
    finally:
        svc.close()


def test_at_the_cap_with_none_idle_the_new_connection_is_closed(svc: Service) -> None:
    head = b"POST /hooks/demo HTTP/1.1\r\nhost: x\r\ncontent-length: 8\r\n\r\n"
    busy = opened(svc, 8)
    try:
        for s in busy:
            s.sendall(head)  # a request begun: not idle, so not closed to make room
        time.sleep(0.2)
        late = socket.create_connection(("127.0.0.1", svc.port), timeout=5)
        assert closed_by_server(late, 2.0)
        late.close()
        assert shed(svc, "new") >= 1
        busy[0].sendall(b'{"n": 2}')  # the requests it held were not disturbed
        busy[0].settimeout(5)
        assert busy[0].recv(4096).startswith(b"HTTP/1.1 201 ")
        assert post(svc) == 201  # busy[0] is idle now, and makes room
        assert closed_by_server(busy[0], 2.0)
        assert not any(closed_by_server(s, 0.1) for s in busy[1:])
    finally:
        for s in busy:
            s.close()


def test_a_low_open_file_limit_caps_connections_instead_of_refusing_hooks(
    tmp_path: Path,
) -> None:
    """With 256 files and connections left idle past them, an event loop out of file
    descriptors would take each waiting connection and close it: every hook reset."""
    svc = Service(tmp_path, DEMO, server={"workers": 1})
    try:
        svc.start(argv_prefix=limited(256, 256))
        idle = opened(svc, 300)
        try:
            assert [post(svc) for _ in range(5)] == [201] * 5
        finally:
            for s in idle:
                s.close()
        # room for 192: each of the last 108 idle closed the oldest, and so did the first
        # hook's connection, after which each one closed left room for the next
        assert shed(svc, "idle") == 300 - 192 + 1
        log = svc.log()
        assert "room for 192 client connections per worker" in log
        assert "server.max_connections = 10000" in log
    finally:
        svc.close()


def test_the_soft_open_file_limit_is_raised_to_the_hard_one(tmp_path: Path) -> None:
    svc = Service(tmp_path, DEMO, server={"workers": 1, "max_connections": 1000})
    try:
        svc.start(argv_prefix=limited(256, 4096))
        for pid in [svc.pid, *svc.pids("worker")]:
            limits = Path(f"/proc/{pid}/limits").read_text()
            assert re.search(r"^Max open files\s+4096\s+4096\s", limits, re.M), limits
        assert "open-file limit" not in svc.log()
    finally:
        svc.close()
