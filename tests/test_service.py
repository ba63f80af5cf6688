"""The service as a user runs it: ``ankusa-shm serve`` in a subprocess, real HTTP over
real sockets, the store read back from its SQLite file."""

from __future__ import annotations

import fcntl
import gzip
import json
import re
import signal
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from load_client import GITHUB_SOURCE, SECRET, signed
from service import Service

from ankusa_shm.store import readers, schema

GITHUB = (
    """
[rate_limits]
default = { rate = 1000, burst = 1000 }
tenants.tiny = { rate = 0.05, burst = 2 }  # a hook back every 20 s
"""
    + GITHUB_SOURCE
    + """
[[sources]]
id = "tiny"
tenant = "tiny"
verify = { hmac = { header = "x-hub-signature-256", prefix = "sha256=", secret_env = "GH_SECRET" } }
dedupe = { preset = "github" }
"""
)


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Service]:
    s = Service(
        tmp_path,
        GITHUB,
        server={"header_timeout_s": 0.5, "body_timeout_s": 0.5, "max_body_bytes": 4096},
        env={"GH_SECRET": SECRET},
    )
    try:
        yield s.start()
    finally:
        s.close()


def raw(svc: Service, data: bytes, wait_s: float = 5.0) -> bytes:
    """Send bytes as they are and read until the server closes."""
    with socket.create_connection(("127.0.0.1", svc.port), timeout=wait_s) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def signed_request(body: bytes, delivery: str, head: str = "", host: str = "x") -> bytes:
    """A signed POST of ``body`` to the github source, with ``head``'s lines in its head."""
    fields = "".join(f"{k}: {v}\r\n" for k, v in signed(body, delivery).items())
    start = f"POST /hooks/github HTTP/1.1\r\nhost: {host}\r\n{head}"
    return f"{start}content-length: {len(body)}\r\n{fields}\r\n".encode() + body


def statuses(out: bytes) -> list[int]:
    return [int(s) for s in re.findall(rb"HTTP/1\.[01] (\d{3}) ", out)]


def test_a_signed_hook_is_stored_and_its_resend_is_a_duplicate(svc: Service) -> None:
    body = b'{"ref":"refs/heads/main"}'
    headers = signed(body, "delivery-1")
    first = svc.post("github", body, headers)
    assert first.status == 201 and first.body["status"] == "accepted"
    assert "duplicate" not in first.body
    hook = readers.get(svc.store_path, first.body["id"])
    assert hook is not None
    assert (hook.source, hook.tenant, hook.body) == ("github", "acme", body)
    assert hook.event_key == b"delivery-1"
    assert ("x-github-event", "push") in hook.headers
    assert uuid.UUID(first.body["id"]).version == 7

    again = svc.post("github", body, headers)
    assert again.status == 201
    assert again.body == {"status": "accepted", "id": first.body["id"], "duplicate": True}
    assert readers.count(svc.store_path) == 1
    # Admitted (node scope asks no one else), then caught by the store: counted as such.
    metrics = svc.admin("GET", "/metrics")[2].decode()
    assert 'ankusa_admit_total{result="ok"} 2.0' in metrics
    assert "ankusa_store_duplicates_total 1.0" in metrics


def test_a_chunked_hook_is_stored_whole_and_its_trailer_is_not_kept(svc: Service) -> None:
    """A chunked body is verified and stored as one; a trailer field is not a header
    (RFC 9110 6.5.1): not kept with the hook, and no way to smuggle in a signature."""
    body = b'{"ref":"refs/heads/main","chunked":true}'
    head = "".join(f"{k}: {v}\r\n" for k, v in signed(body, "delivery-chunked").items())
    chunks = b"%x\r\n%s\r\n%x\r\n%s\r\n" % (10, body[:10], len(body) - 10, body[10:])
    out = raw(
        svc,
        b"POST /hooks/github HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
        + head.encode()
        + b"transfer-encoding: chunked\r\n\r\n"
        + chunks
        + b"0\r\nx-trailer: sneaky\r\n\r\n",
    )
    assert out.startswith(b"HTTP/1.1 201 "), out
    answer = json.loads(out.partition(b"\r\n\r\n")[2])
    hook = readers.get(svc.store_path, answer["id"])
    assert hook is not None and hook.body == body and hook.event_key == b"delivery-chunked"
    names = [name for name, _ in hook.headers]
    assert "x-github-event" in names and "x-trailer" not in names


def test_whitespace_after_a_header_value_is_not_part_of_it(svc: Service) -> None:
    """RFC 9112 5: a proxy padding the fields must not turn a genuine signature into a
    401, nor the event key into another one (the parser drops only leading whitespace)."""
    body = b'{"padded":true}'
    padded = "".join(f"{k}: {v} \t\r\n" for k, v in signed(body, "delivery-padded").items())
    head = f"POST /hooks/github HTTP/1.1\r\nhost: x\r\nconnection: close\r\n{padded}"
    out = raw(svc, f"{head}content-length: {len(body)}\r\n\r\n".encode() + body)
    assert out.startswith(b"HTTP/1.1 201 "), out
    hook = readers.get(svc.store_path, json.loads(out.partition(b"\r\n\r\n")[2])["id"])
    assert hook is not None and hook.event_key == b"delivery-padded"
    assert ("x-github-event", "push") in hook.headers


def test_a_forgery_is_refused_and_costs_the_tenant_nothing(svc: Service) -> None:
    body = b'{"n":1}'
    for _ in range(5):  # more forgeries than the tenant's burst of 2
        bad = svc.post("tiny", body, signed(body, secret="wrong"))
        assert (bad.status, bad.body) == (401, {"error": "bad_signature"})
    assert svc.post("tiny", body, {"x-github-delivery": "unsigned"}).status == 401
    for i in range(2):
        assert svc.post("tiny", body, signed(body, f"ok-{i}")).status == 201
    limited = svc.post("tiny", body, signed(body, "third"))
    assert (limited.status, limited.body) == (429, {"error": "rate_limited"})
    assert int(limited.headers["retry-after"]) >= 1
    assert readers.count(svc.store_path) == 2


def test_a_resend_costs_the_tenant_nothing_and_is_a_duplicate_even_over_its_limit(
    svc: Service,
) -> None:
    """A provider resending a stored event is answered with its first id, never 429, and
    is not charged for it (as the fleet's buckets never are)."""
    a, b, c = (b'{"n":%d}' % n for n in range(3))
    first = svc.post("tiny", a, signed(a, "resend-a"))
    assert first.status == 201
    again = svc.post("tiny", a, signed(a, "resend-a"))
    assert again.body == {"status": "accepted", "id": first.body["id"], "duplicate": True}
    second = svc.post("tiny", b, signed(b, "resend-b"))  # the burst's second: a was refunded
    assert second.status == 201 and "duplicate" not in second.body
    assert svc.post("tiny", c, signed(c, "resend-c")).status == 429
    for body, delivery, hook in ((a, "resend-a", first), (b, "resend-b", second)):
        late = svc.post("tiny", body, signed(body, delivery))  # over the limit now
        assert late.body == {"status": "accepted", "id": hook.body["id"], "duplicate": True}
    assert readers.count(svc.store_path) == 2
    metrics = svc.admin("GET", "/metrics")[2].decode()
    assert "ankusa_store_duplicates_total 3.0" in metrics


def test_routing_errors(svc: Service) -> None:
    assert svc.post("nope", b"{}").status == 404
    c = svc.connection()
    c.request("GET", "/hooks/github")
    r = c.getresponse()
    assert (r.status, r.getheader("allow"), json.loads(r.read())) == (
        405,
        "POST",
        {"error": "method_not_allowed"},
    )
    c.request("POST", "/elsewhere", body=b"x")
    r = c.getresponse()
    assert r.status == 404 and json.loads(r.read()) == {"error": "not_found"}
    c.close()


def test_an_absolute_form_target_is_served_as_its_path(svc: Service) -> None:
    """RFC 9112 3.2.2: a server accepts ``POST http://host/path``, as if sent to the path."""
    body = b'{"n":"absolute"}'
    fields = "".join(f"{k}: {v}\r\n" for k, v in signed(body, "delivery-abs").items())
    head = f"content-length: {len(body)}\r\nconnection: close\r\n{fields}\r\n"
    target = "HTTP://edge.example:8080/hooks/github?x=1"
    out = raw(svc, f"POST {target} HTTP/1.1\r\nhost: edge.example\r\n{head}".encode() + body)
    assert out.startswith(b"HTTP/1.1 201 "), out
    hook = readers.get(svc.store_path, json.loads(out.partition(b"\r\n\r\n")[2])["id"])
    assert hook is not None and hook.body == body
    ftp = f"POST ftp://edge.example/hooks/github HTTP/1.1\r\nhost: x\r\n{head}"
    out = raw(svc, ftp.encode() + body)
    assert out.startswith(b"HTTP/1.1 404 "), out


def test_an_oversized_body_is_refused_before_it_is_read(svc: Service) -> None:
    with socket.create_connection(("127.0.0.1", svc.port), timeout=5) as s:
        # Announce far more than max_body_bytes and send none of it: the answer comes now.
        s.sendall(b"POST /hooks/github HTTP/1.1\r\nhost: x\r\ncontent-length: 100000000\r\n\r\n")
        answer = s.recv(65536)
    assert answer.startswith(b"HTTP/1.1 413 ")
    assert b'{"error":"too_large"}' in answer and b"connection: close" in answer
    chunked = b"".join(
        b"1000\r\n" + b"x" * 4096 + b"\r\n" for _ in range(3)
    )  # 12 KiB in chunks: over the 4 KiB limit as the chunks arrive
    out = raw(
        svc,
        b"POST /hooks/github HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n" + chunked,
    )
    assert out.startswith(b"HTTP/1.1 413 ")
    assert readers.count(svc.store_path) == 0


def test_a_content_length_of_any_length_is_read_as_its_value(svc: Service) -> None:
    """Leading zeros are valid (RFC 9110 8.6) and unbounded: 5,000 digits of them, then
    the length, is that length (``int()`` refuses over 4,300 digits); 19 digits that are
    not zeros are over any limit, without being read as a number."""
    body = b'{"zeros":1}'
    zeros = "0" * 5000 + str(len(body))
    request = signed_request(body, "zeros", "connection: close\r\n")
    out = raw(
        svc,
        request.replace(
            f"content-length: {len(body)}".encode(), b"content-length: " + zeros.encode()
        ),
    )
    assert statuses(out) == [201], out
    huge = b"POST /hooks/github HTTP/1.1\r\nhost: x\r\ncontent-length: 1%s\r\n\r\n" % (b"0" * 18)
    out = raw(svc, huge)
    assert statuses(out) == [413], out
    assert readers.count(svc.store_path) == 1


@pytest.mark.parametrize(
    "request_bytes",
    [
        b"GARBAGE\r\n\r\n",
        b"POST /hooks/github HTTP/1.1\r\nhost: x\r\ncontent-length: x\r\n\r\n",
        b"POST /hooks/github HTTP/1.1\r\nhost: x\r\ntransfer-encoding: chunked\r\n\r\n"
        b"zz\r\nabc\r\n0\r\n\r\n",
        b"POST /hooks/github HTTP/9.9\r\n\r\n",
    ],
    ids=["request-line", "content-length", "chunk-size", "version"],
)
def test_malformed_requests_get_400_and_others_are_unaffected(
    svc: Service, request_bytes: bytes
) -> None:
    keep = svc.connection()  # a client mid-conversation on another connection
    body = b'{"a":1}'
    assert svc.post("github", body, signed(body), conn=keep).status == 201
    out = raw(svc, request_bytes)
    assert out.startswith(b"HTTP/1.1 400 "), out
    assert b"connection: close" in out
    assert svc.post("github", body, signed(body), conn=keep).status == 201
    keep.close()


@pytest.mark.parametrize(
    "host",
    [b"", b"host: a\r\nhost: a\r\n", b"host: a b\r\n", b"host: a/b\r\n", b"host: [::1\r\n"],
    ids=["missing", "twice", "space", "slash", "bracket"],
)
def test_a_request_without_one_good_host_is_400_after_the_answers_before_it(
    svc: Service, host: bytes
) -> None:
    """RFC 9112 3.2: an HTTP/1.1 request without a Host field, or with two or a malformed
    one, is 400; one pipelined before it is answered and stored, none after it is read.
    (Whitespace after a value is not part of it, RFC 9110 5.5.)"""
    first, second, third = (b'{"n":%d}' % n for n in (1, 2, 3))
    keys = [f"host-{uuid.uuid4()}" for _ in range(3)]
    out = raw(
        svc,
        signed_request(first, keys[0], host="edge.example:8080 \t")  # not the value's: OWS
        + signed_request(second, keys[1]).replace(b"host: x\r\n", host)
        + signed_request(third, keys[2]),
    )
    assert statuses(out) == [201, 400], out
    assert b'{"error":"bad_host"}' in out and b"connection: close" in out
    stored = {h.event_key for h in readers.page(svc.store_path, 0, 10)}
    assert stored == {keys[0].encode()}


def test_an_http_1_0_request_may_leave_host_out(svc: Service) -> None:
    body = b'{"old":true}'
    fields = "".join(f"{k}: {v}\r\n" for k, v in signed(body, "delivery-1.0").items())
    head = f"POST /hooks/github HTTP/1.0\r\ncontent-length: {len(body)}\r\n{fields}\r\n"
    out = raw(svc, head.encode() + body)
    assert out.startswith(b"HTTP/1.1 201 "), out
    assert readers.count(svc.store_path) == 1


def test_http_1_0_is_kept_alive_only_when_asked_and_told_so(svc: Service) -> None:
    """An HTTP/1.0 client closes unless the answer says the connection stays open."""
    body = b'{"old":true}'
    fields = "".join(f"{k}: {v}\r\n" for k, v in signed(body, "kept-1.0").items())
    head = f"POST /hooks/github HTTP/1.0\r\nconnection: keep-alive\r\n{fields}"
    kept = f"{head}content-length: {len(body)}\r\n\r\n".encode() + body
    last = b"GET /hooks/github HTTP/1.0\r\n\r\n"
    out = raw(svc, kept + last)
    first, _, second = out.partition(b"HTTP/1.1 405 ")
    assert first.startswith(b"HTTP/1.1 201 ") and b"connection: keep-alive\r\n" in first, out
    assert second and b"connection: close\r\n" in second, out


def test_http_1_0_with_a_transfer_coding_and_other_versions_are_refused(svc: Service) -> None:
    """HTTP/1.0 has no chunked framing: a 1.0 proxy in front would take the chunks for
    requests of their own (RFC 9112 6.1). HTTP/2 and later over this socket are 505, the
    bare request line of 0.9 is 400; each closes the connection unread."""
    body = b'{"chunks":true}'
    fields = "".join(f"{k}: {v}\r\n" for k, v in signed(body, "chunked-1.0").items())
    chunked = (
        f"POST /hooks/github HTTP/1.0\r\nconnection: keep-alive\r\n{fields}"
        "transfer-encoding: chunked\r\n\r\n"
    ).encode() + b"%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
    after = signed_request(b'{"after":1}', "after-refusal", "connection: close\r\n")
    out = raw(svc, chunked + after)
    assert statuses(out) == [400] and out.endswith(b'{"error":"bad_request"}'), out
    two = f"POST /hooks/github HTTP/2.0\r\ncontent-length: {len(body)}\r\n{fields}\r\n"
    out = raw(svc, two.encode() + body + after)
    assert statuses(out) == [505], out
    assert out.endswith(b'{"error":"http_version_not_supported"}'), out
    out = raw(svc, b"POST /hooks/github\r\n\r\n" + after)
    assert statuses(out) == [400], out
    assert readers.count(svc.store_path) == 0


def test_headers_over_the_limit_get_431(svc: Service) -> None:
    flood = b"".join(b"x-pad-%d: %s\r\n" % (i, b"v" * 1000) for i in range(80))  # ~80 KiB
    out = raw(svc, b"POST /hooks/github HTTP/1.1\r\nhost: x\r\n" + flood + b"\r\n")
    assert out.startswith(b"HTTP/1.1 431 ") and b'{"error":"headers_too_large"}' in out
    assert readers.count(svc.store_path) == 0


def test_a_truncated_body_stores_nothing(svc: Service) -> None:
    with socket.create_connection(("127.0.0.1", svc.port), timeout=5) as s:
        s.sendall(
            b"POST /hooks/github HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n\r\n" + b"x" * 10
        )
        s.shutdown(socket.SHUT_WR)
        assert s.recv(65536) == b""  # closed without an answer: nothing was understood
    assert readers.count(svc.store_path) == 0


def test_pipelined_requests_are_answered_in_order(svc: Service) -> None:
    bodies = [json.dumps({"n": i}).encode() for i in range(20)]
    reqs = b""
    for i, b in enumerate(bodies):
        head = "".join(f"{k}: {v}\r\n" for k, v in signed(b, f"pipe-{i}").items())
        reqs += f"POST /hooks/github HTTP/1.1\r\nhost: x\r\ncontent-length: {len(b)}\r\n".encode()
        reqs += f"{head}\r\n".encode()
        reqs += b
    reqs += b"POST /hooks/github HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
    reqs += b"content-length: 2\r\n\r\n{}"
    out = raw(svc, reqs)
    assert out.count(b"HTTP/1.1 201 ") == 20 and out.count(b"HTTP/1.1 401 ") == 1
    ids = [i.decode() for i in re.findall(rb'"id":"([0-9a-f-]{36})"', out)]
    stored = [readers.get(svc.store_path, i) for i in ids]
    assert [h.event_key for h in stored if h] == [f"pipe-{i}".encode() for i in range(20)]


def test_a_slow_client_is_timed_out_while_others_are_served(svc: Service) -> None:
    with socket.create_connection(("127.0.0.1", svc.port), timeout=5) as slow:
        slow.sendall(b"POST /hooks/github HTTP/1.1\r\nhost: x\r\nx-a: ")  # and then nothing
        started = time.monotonic()
        body = b'{"b":2}'
        for _ in range(3):  # served meanwhile
            assert svc.post("github", body, signed(body)).status == 201
        answer = slow.recv(65536)
        waited = time.monotonic() - started
    assert answer.startswith(b"HTTP/1.1 408 ") and b"header_timeout" in answer
    assert waited < 3.0  # header_timeout_s is 0.5; the sweep runs every 0.25 s
    with socket.create_connection(("127.0.0.1", svc.port), timeout=5) as slow_body:
        slow_body.sendall(
            b"POST /hooks/github HTTP/1.1\r\nhost: x\r\ncontent-length: 50\r\n\r\nabc"
        )
        assert b"body_timeout" in slow_body.recv(65536)


def test_keep_alive_serves_many_requests_on_one_connection(svc: Service) -> None:
    c = svc.connection()
    for i in range(50):
        body = json.dumps({"i": i}).encode()
        assert svc.post("github", body, signed(body), conn=c).status == 201
    c.close()
    assert readers.count(svc.store_path) == 50


def test_expect_100_continue_gets_its_interim_answer(svc: Service) -> None:
    body = b'{"big":"' + b"x" * 2000 + b'"}'
    head = "".join(f"{k}: {v}\r\n" for k, v in signed(body, "expecting").items())
    with socket.create_connection(("127.0.0.1", svc.port), timeout=5) as s:
        s.sendall(
            f"POST /hooks/github HTTP/1.1\r\nhost: x\r\nexpect: 100-continue\r\n"
            f"content-length: {len(body)}\r\n{head}\r\n".encode()
        )
        assert s.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"  # before any body byte
        s.sendall(body)
        assert s.recv(65536).startswith(b"HTTP/1.1 201 ")


def test_requests_before_a_malformed_one_are_answered_before_its_400(svc: Service) -> None:
    """A client pairs answers with its requests by their order (RFC 9112 9.3.2): the
    requests queued before bytes that do not parse are answered first, then the 400; the
    request after them is not read. Whether the first is still queued or in its commit."""
    bad = b"XXXX\r\n\r\n"
    body = b'{"n":1}'
    pipelined = [signed_request(body, f"before-bad-{i}") for i in range(3)]
    out = raw(svc, pipelined[0] + pipelined[1] + bad + pipelined[2])
    assert statuses(out) == [201, 201, 400] and out.endswith(b'{"error":"bad_request"}'), out
    assert readers.count(svc.store_path) == 2
    for i, pause in enumerate([0.0, 0.0005, 0.002, 0.01]):  # the 400 as the hook commits
        with socket.create_connection(("127.0.0.1", svc.port), timeout=5) as s:
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            s.sendall(signed_request(body, f"racing-bad-{i}"))
            time.sleep(pause)
            s.sendall(bad)
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        assert statuses(out) == [201, 400], (pause, out)
    assert readers.count(svc.store_path) == 6


def test_a_connection_refused_behind_a_request_does_not_hold_up_a_graceful_stop(
    tmp_path: Path,
) -> None:
    """After its answers and its 400, a connection whose client keeps its socket open is
    closed by the server within ``LINGER_S``; a graceful stop does not wait on it."""
    svc = Service(tmp_path, GITHUB, server={"graceful_timeout_s": 8}, env={"GH_SECRET": SECRET})
    try:
        svc.start()
        body = b'{"n":1}'
        held, answers = [], []
        for i in range(2):
            s = socket.create_connection(("127.0.0.1", svc.port), timeout=5)
            s.sendall(signed_request(body, f"held-{i}") + b"XXXX\r\n\r\n")
            out = b""
            while chunk := s.recv(65536):  # until the server's end of its answers
                out += chunk
            answers.append(statuses(out))
            held.append(s)
        started = time.monotonic()
        svc.send(signal.SIGTERM)
        assert svc.proc is not None and svc.proc.wait(30) == 0
        assert time.monotonic() - started < 5.0
        assert "graceful timeout" not in svc.log()
        assert answers == [[201, 400]] * 2
        assert readers.count(svc.store_path) == 2
        for s in held:
            s.close()
    finally:
        svc.close()


def test_a_request_asking_to_upgrade_is_answered_over_http_1_1(svc: Service) -> None:
    """What ``curl --http2`` sends to an http:// URL: the Upgrade is ignored (RFC 9110
    7.8) and the request answered as if it had not asked, its body whole, whether framed by
    length or in chunks, its 100 Continue sent once; the requests after it are read as
    before. CONNECT is refused."""
    h2c = "connection: Upgrade, HTTP2-Settings\r\nupgrade: h2c\r\nhttp2-settings: AAMAAABk\r\n"
    bodies = [json.dumps({"upgrade": i}).encode() for i in range(3)]
    fields = "".join(f"{k}: {v}\r\n" for k, v in signed(bodies[1], "h2c-1").items())
    chunked = (
        f"POST /hooks/github HTTP/1.1\r\nhost: x\r\n{h2c}{fields}"
        "transfer-encoding: chunked\r\n\r\n".encode()
        + b"%x\r\n%s\r\n0\r\n\r\n" % (len(bodies[1]), bodies[1])
    )
    expecting = signed_request(bodies[0], "h2c-0", h2c + "expect: 100-continue\r\n")
    with socket.create_connection(("127.0.0.1", svc.port), timeout=5) as s:
        s.sendall(expecting[: -len(bodies[0])])  # its body once it is asked for
        out = s.recv(65536)
        assert out == b"HTTP/1.1 100 Continue\r\n\r\n"
        s.sendall(bodies[0] + chunked + signed_request(bodies[2], "h2c-2", "connection: close\r\n"))
        while chunk := s.recv(65536):
            out += chunk
    assert statuses(out) == [100, 201, 201, 201], out
    ids = re.findall(rb'"id":"([0-9a-f-]{36})"', out)
    stored = [readers.get(svc.store_path, i.decode()) for i in ids]
    assert [(h.body, h.event_key) for h in stored if h] == [
        (b, f"h2c-{i}".encode()) for i, b in enumerate(bodies)
    ]
    out = raw(svc, b"CONNECT 127.0.0.1:22 HTTP/1.1\r\nhost: 127.0.0.1:22\r\n\r\n")
    assert statuses(out) == [400] and b'{"error":"upgrade_not_supported"}' in out


def test_a_transfer_coding_other_than_chunked_is_not_implemented(svc: Service) -> None:
    """Chunked is the only transfer coding read (RFC 9112 6.1): another before it is 501
    and the connection closed, not a body stored still coded. Framing that cannot be
    trusted stays 400: chunked not last, twice, or with a Content-Length."""
    body = b'{"coded":true}'
    coded = gzip.compress(body)

    def framed(*fields: str, payload: bytes = coded) -> bytes:
        head = "".join(f"{k}: {v}\r\n" for k, v in signed(payload, "coded").items())
        head += "".join(f"{f}\r\n" for f in fields)
        chunks = b"%x\r\n%s\r\n0\r\n\r\n" % (len(payload), payload)
        return f"POST /hooks/github HTTP/1.1\r\nhost: x\r\n{head}\r\n".encode() + chunks

    for fields in [
        ["transfer-encoding: gzip, chunked"],
        ["transfer-encoding: GZIP , Chunked"],
        ["transfer-encoding: gzip", "transfer-encoding: chunked"],
        ["transfer-encoding: identity, chunked"],
    ]:
        out = raw(svc, framed(*fields) + signed_request(body, "after", "connection: close\r\n"))
        assert statuses(out) == [501], (fields, out)
        assert out.endswith(b'{"error":"not_implemented"}') and b"connection: close" in out
    for fields in [
        ["transfer-encoding: chunked, gzip"],
        ["transfer-encoding: gzip"],
        ["transfer-encoding: chunked", "transfer-encoding: chunked"],
        ["transfer-encoding: chunked", f"content-length: {len(coded)}"],
    ]:
        out = raw(svc, framed(*fields))
        assert statuses(out) == [400], (fields, out)
    assert readers.count(svc.store_path) == 0
    out = raw(svc, framed("transfer-encoding: Chunked", "connection: close", payload=body))
    assert statuses(out) == [201], out
    assert readers.count(svc.store_path) == 1


def _send_queue(local_port: int, remote_port: int) -> int | None:
    """The kernel's send queue of the socket ``local_port`` -> ``remote_port`` on
    127.0.0.1 (``/proc/net/tcp``'s tx_queue), or None once there is none."""
    ends = (f"0100007F:{local_port:04X}", f"0100007F:{remote_port:04X}")
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        if (f[1], f[2]) == ends and f[3] == "01":  # ESTABLISHED
            return int(f[4].partition(":")[0], 16)
    return None


def test_answers_left_unread_below_the_pause_mark_still_time_out(svc: Service) -> None:
    """Answers left unread that fill the kernel's buffers and then wait in the worker's
    own, short of the mark where it stops reading: the worker drops the client after
    ``body_timeout_s`` (0.5 s) all the same, not held for ever by a close waiting to
    flush. The client never reads: reading would let the answers out."""
    batch = b"GET /nope HTTP/1.1\r\nhost: x\r\n\r\n" * 250  # about 25 KB of answers
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", svc.port))
        port = s.getsockname()[1]
        queued: int | None = -1
        while (now := _send_queue(svc.port, port)) != queued:  # the kernel took no more
            queued = now
            s.sendall(batch)
            time.sleep(0.03)
        deadline = time.monotonic() + 5.0
        while _send_queue(svc.port, port) is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _send_queue(svc.port, port) is None, "the worker still holds the connection"


def test_a_client_that_does_not_read_its_answers_is_dropped(svc: Service) -> None:
    """A client that pipelines requests and never reads our answers holds its connection
    for ``body_timeout_s`` (0.5 s here) once they stop fitting, then it is reset; the
    requests it queued that were not begun are dropped (no answer: it sends them again)."""
    one = b"GET /nope HTTP/1.1\r\nhost: x\r\n\r\n"
    blob = one * 2000
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        s.connect(("127.0.0.1", svc.port))
        s.setblocking(False)
        sent, stalled, out, ended = 0, 0.0, b"", ""
        while not stalled or time.monotonic() - stalled < 0.3:  # until it stops reading
            try:
                sent += s.send(blob[sent % len(blob) :])
                stalled = 0.0
            except BlockingIOError:
                stalled = stalled or time.monotonic()
                time.sleep(0.02)
            except (ConnectionResetError, BrokenPipeError):
                break
        time.sleep(2.0)
        deadline = time.monotonic() + 5.0
        while not ended and time.monotonic() < deadline:
            s.settimeout(max(0.01, deadline - time.monotonic()))
            try:
                chunk = s.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                ended = "reset"
            else:
                ended = "" if chunk else "closed"
                out += chunk
    assert ended, f"still answering after 5 s: {out.count(b'HTTP/1.1 404 ')} answers"
    assert out.count(b"HTTP/1.1 404 ") < sent // len(one)
    body = b'{"after":1}'
    assert svc.post("github", body, signed(body)).status == 201


def test_a_body_asked_for_late_has_its_whole_timeout(svc: Service) -> None:
    """A request expecting 100 Continue behind an answer slower than ``body_timeout_s``
    (the store's lock held for 1.5 s; the timeout is 0.5 s): its client sends the body
    only once asked, so the timeout starts with the 100, not with the request's head."""
    body = b'{"late":1}'
    first = signed_request(body, "before-late")
    head = signed_request(body, "late", "expect: 100-continue\r\n")[: -len(body)]
    with open(schema.lock_path(svc.store_path), "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        s = socket.create_connection(("127.0.0.1", svc.port), timeout=5)
        s.sendall(first + head)
        time.sleep(1.5)
        fcntl.flock(lock, fcntl.LOCK_UN)
    with s:
        got = b""
        while b"100 Continue" not in got:
            got += s.recv(65536)
        # A client taking its time, well within the 0.5 s timeout: the 1.5 s above already
        # shows the timeout did not start with the head; a loaded machine eats the margin.
        time.sleep(0.1)
        s.sendall(body + signed_request(body, "after-late", "connection: close\r\n"))
        while chunk := s.recv(65536):
            got += chunk
    assert statuses(got) == [201, 100, 201, 201], got


def test_100_continue_follows_earlier_answers_and_is_not_sent_to_http_1_0(svc: Service) -> None:
    """The interim answer is written when its request is next to be answered, never
    before the answers to requests pipelined ahead of it; an HTTP/1.0 client cannot know
    it, so its expectation is ignored (RFC 9110 10.1.1)."""
    body = b'{"expect":1}'
    first = signed_request(body, "ahead")
    expecting = signed_request(body, "expecting", "expect: 100-continue\r\n")
    head, _, _ = expecting.partition(b"\r\n\r\n")
    with socket.create_connection(("127.0.0.1", svc.port), timeout=5) as s:
        s.sendall(first + head + b"\r\n\r\n")
        got = b""
        while b"100 Continue" not in got:
            got += s.recv(65536)
        assert statuses(got) == [201, 100], got
        s.sendall(body + signed_request(body, "last", "connection: close\r\n"))
        while chunk := s.recv(65536):
            got += chunk
    assert statuses(got) == [201, 100, 201, 201], got
    old = head.replace(b"HTTP/1.1", b"HTTP/1.0", 1).replace(b"expecting", b"old-client")
    with socket.create_connection(("127.0.0.1", svc.port), timeout=5) as s:
        s.sendall(old + b"\r\n\r\n")
        s.settimeout(0.5)
        with pytest.raises(TimeoutError):
            s.recv(65536)
        s.settimeout(5)
        s.sendall(body)
        got = b""
        while chunk := s.recv(65536):
            got += chunk
    assert statuses(got) == [201], got
