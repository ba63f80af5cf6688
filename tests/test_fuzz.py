"""Bad input in bulk, a bounded and deterministic share of ``scripts/fuzz.py``'s campaign:
every case gets a clear error or a correct answer -- no crash, no hang, no restart, no lost
hook. The bugs the campaign found are pinned below by tests of their exact input; a bug
found and not yet fixed is listed in ``fuzz_cases.KNOWN_BUGS`` with a strict-xfail test."""

from __future__ import annotations

import io
import json
import os
import socket
import uuid
from collections.abc import Iterator
from contextlib import redirect_stderr
from pathlib import Path

import fuzz_cases as F
import pytest
from service import Service

from ankusa_shm import config, inspect
from ankusa_shm.shm import layout as L
from ankusa_shm.shm import segment as segmod
from ankusa_shm.store import readers

SEED = 20240601
HTTP_CASES = 1500
CONFIG_CASES = 2000
SEGMENT_CASES = 2000
SEGMENT_CLI_EVERY = 250  # of which these many also as the real command


def _assert_clean(t: F.Tally, minimum: int) -> None:
    assert t.cases >= minimum, t.summary()
    assert not t.bad, "\n".join(t.failures)
    assert set(t.known) <= set(F.KNOWN_BUGS), t.known


def test_http_requests_in_bulk(tmp_path: Path) -> None:
    t = F.Tally("http")
    F.run_http(HTTP_CASES, tmp_path, t, SEED)
    _assert_clean(t, HTTP_CASES)
    assert t.count(F.OK) > HTTP_CASES // 10 and t.count(F.ERROR) > HTTP_CASES // 3, t.summary()


def test_config_documents_in_bulk(tmp_path: Path) -> None:
    t = F.Tally("config")
    F.run_config(CONFIG_CASES, tmp_path, t, derandomize=True)
    _assert_clean(t, CONFIG_CASES)
    assert t.count(F.OK) > CONFIG_CASES // 20, t.summary()  # some reach a whole Config


def test_corrupt_segments_in_bulk(seg_name: str) -> None:
    t = F.Tally("segment")
    F.run_segment(SEGMENT_CASES, seg_name, t, SEED, cli_every=SEGMENT_CLI_EVERY)
    _assert_clean(t, SEGMENT_CASES)
    assert t.count(F.OK) > SEGMENT_CASES // 10 and t.count(F.ERROR) > SEGMENT_CASES // 10


# -- the judges judge: a fuzz run that cannot fail proves nothing ------------------------------


def test_the_response_parser_refuses_what_is_not_http() -> None:
    good = b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\n{}"
    assert F.parse(good) == ([F.Response(201, {"content-length": "2"}, b"{}")], "")
    assert F.parse(b"HTTP/1.1 100 Continue\r\n\r\n" + good)[1] == ""
    assert F.parse(good[:-1])[1] == "a 201 without its whole body"
    assert F.parse(b"HTTP/1.0 200 OK\r\n\r\n")[1].startswith("not a status line")
    assert F.parse(good + b"junk")[1].startswith("a partial head")


def test_a_500_or_a_missing_answer_is_a_crash() -> None:
    case = F.HttpCase("c", "github", b"", (F.Expect(frozenset({201})),), all_answered=True)
    five = b"HTTP/1.1 500 Internal Server Error\r\ncontent-length: 2\r\n\r\n{}"
    assert F.judge(case, five, "").outcome.kind == F.CRASH
    assert F.judge(case, b"", "").outcome.kind == F.CRASH
    assert F.judge(case, b"", "hang").outcome.kind == F.HANG


def test_a_config_error_not_naming_the_file_is_a_crash(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    assert F.check_config(path, b"[server]\nworkers = 2\n").kind == F.OK
    assert F.check_config(path, b"[server]\nworkers = -1\n").kind == F.ERROR
    assert F.check_config(path, b"\xff").kind == F.ERROR
    assert F.crash(TypeError("x")).kind == F.CRASH


def test_a_hang_in_process_is_bounded() -> None:
    with pytest.raises(F.Hang), F.bounded(0.05):
        while True:
            pass


# -- bugs found by fuzzing ------------------------------------------------------------------


@pytest.mark.parametrize("key", ["listen", "admin_listen"])
def test_a_port_of_unicode_digits_is_a_config_error(tmp_path: Path, key: str) -> None:
    path = tmp_path / "c.toml"
    value = '["127.0.0.1:²"]' if key == "listen" else '"127.0.0.1:²"'
    path.write_text(f"[server]\n{key} = {value}\n")
    with pytest.raises(config.ConfigError, match=f"^{path}: server.{key}"):
        config.load(path)


def test_a_config_error_is_one_line_whatever_the_key(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[server]\n"x\\nserve: ok" = 1\n')
    with pytest.raises(config.ConfigError) as e:
        config.load(path)
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("region", ["config", "sources"])
def test_inspect_of_a_deeply_nested_blob_is_one_line(seg_name: str, region: str) -> None:
    with segmod.Segment.create(seg_name, F.SEG_PARAMS) as seg:
        doc = b"[" * 5000
        base = seg.layout.offset(region)
        seg.buf[base + L.BLOB_DATA : base + L.BLOB_DATA + len(doc)] = doc
        seg.view.store(base + L.BLOB_LENGTH, len(doc))
        out, err = io.StringIO(), io.StringIO()
        with redirect_stderr(err):
            code = inspect.run(seg_name, True, None, out=out)
    assert code in (0, inspect.EXIT_UNUSABLE)
    said = out.getvalue() if code == 0 else err.getvalue()
    assert said.count("\n") == 1 and said.endswith("\n"), said[:200]
    if code == 0:
        json.loads(said)  # the snapshot, with the blob shown as unreadable
    else:
        assert said.startswith("ankusa-shm inspect: ") and not out.getvalue()


@pytest.fixture
def svc(tmp_path: Path) -> Iterator[Service]:
    s = F.fuzz_service(tmp_path)
    try:
        yield s.start()
    finally:
        s.close()


def _raw(svc: Service, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", svc.port), timeout=F.HANG_S) as s:
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _demo(key: str, extra: bytes = b"") -> bytes:
    body = json.dumps({"id": key}).encode()
    return b"POST /hooks/demo HTTP/1.1\r\nhost: x\r\ncontent-length: %d\r\n%s\r\n%s" % (
        len(body),
        extra,
        body,
    )


def test_requests_before_a_close_are_answered_whatever_follows(svc: Service) -> None:
    key = f"close-{uuid.uuid4()}"
    out = _raw(
        svc,
        _demo(key + "-1")
        + _demo(key + "-2", b"connection: close\r\n")
        + b"GET / HTTP/1.1\r\nhost: x\r\n\r\n",
    )
    responses, wrong = F.parse(out)
    assert wrong == ""
    assert [r.status for r in responses] == [201, 201]


def test_the_answer_to_head_has_no_body(svc: Service) -> None:
    out = _raw(
        svc,
        b"HEAD /hooks/demo HTTP/1.1\r\nhost: x\r\n\r\nPOST /nowhere HTTP/1.1\r\nhost: x\r\n\r\n",
    )
    head_end = out.index(b"\r\n\r\n") + 4
    assert out.startswith(b"HTTP/1.1 405 ")
    assert out[head_end:].startswith(b"HTTP/1.1 404 ")


def test_a_valid_hook_after_every_kind_of_case_is_stored(svc: Service) -> None:
    """One case of each kind, then a signed hook: the same health check every batch gets."""
    t = F.Tally("http")
    fuzz = F.HttpFuzz(svc, t)
    kinds: dict[str, F.HttpCase] = {}
    i = 0
    while len(kinds) < 12 and i < 2000:
        c = F.http_case(SEED + 1, i)
        kinds.setdefault(c.family.removeprefix("mutated-"), c)
        i += 1
    fuzz.batch(list(kinds.values()))
    assert not t.bad, "\n".join(t.failures)
    assert readers.count(svc.store_path) >= 1  # the probe at least
    assert os.path.exists(f"/dev/shm/{svc.segment}")
