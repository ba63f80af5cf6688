"""``ankusa-shm hooks``: list, show, tail and tail --follow over a real store file.

Through the command's own entry point: ``cli.main`` in this process, and for ``--follow``
``python -m ankusa_shm`` in a separate one, stopped by SIGTERM.
"""

from __future__ import annotations

import base64
import json
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_store import hook, run, started, store_cfg

from ankusa_shm import cli, config
from ankusa_shm.hooks import Committed, NewHook

COMMAND = [sys.executable, "-m", "ankusa_shm"]


def commit(cfg: config.Store, hooks: list[NewHook]) -> None:
    async def body() -> None:
        async with started(cfg) as w:
            for h in hooks:
                assert await w.commit(h) == Committed(h.id)

    run(body)


def config_file(tmp_path: Path) -> tuple[str, config.Store]:
    cfg = store_cfg(tmp_path)
    toml = tmp_path / "ankusa.toml"
    toml.write_text(f"[store]\npath = {json.dumps(cfg.path)}\n")
    return str(toml), cfg


def hooks_cmd(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[str], str]:
    """Run ``ankusa-shm hooks ARGV``: exit status, stdout lines, stderr."""
    status = cli.main(["hooks", *argv])
    out, err = capsys.readouterr()
    return status, out.splitlines(), err


@pytest.fixture
def stored(tmp_path: Path) -> tuple[str, list[NewHook]]:
    """A config file and the hooks its store holds: two sources, one binary body, one
    keyless hook, one event key carrying a terminal escape."""
    toml, cfg = config_file(tmp_path)
    hooks = [
        hook(b"evt-1", source="github"),
        hook(b"evt-2", source="stripe", body=b'{"amount":42}'),
        hook(None, source="github", body=b"\xff\xfe\x00binary"),
        hook(b"evil\x1b[2J", source="stripe", body=b"line one\nline two\x1b[31m"),
    ]
    commit(cfg, hooks)
    return toml, hooks


def test_list_in_commit_order_with_after_limit_and_source(
    stored: tuple[str, list[NewHook]], capsys: pytest.CaptureFixture[str]
) -> None:
    toml, hooks = stored
    status, lines, err = hooks_cmd(capsys, "list", "--config", toml)
    assert (status, err) == (0, "")
    assert [line.split()[1] for line in lines] == [h.id for h in hooks]
    assert lines[0].split()[0] == "1" and "evt-1" in lines[0] and "github" in lines[0]
    assert " - " in lines[2]  # no event key
    assert "\x1b" not in "".join(lines) and "evil\\x1b[2J" in lines[3]
    _, lines, _ = hooks_cmd(capsys, "--config", toml, "list", "--after", "1", "--limit", "2")
    assert [line.split()[1] for line in lines] == [hooks[1].id, hooks[2].id]
    _, lines, _ = hooks_cmd(capsys, "list", "--config", toml, "--source", "stripe")
    assert [line.split()[1] for line in lines] == [hooks[1].id, hooks[3].id]


def test_list_json_is_one_object_per_hook(
    stored: tuple[str, list[NewHook]], capsys: pytest.CaptureFixture[str]
) -> None:
    toml, hooks = stored
    status, lines, _ = hooks_cmd(capsys, "list", "--config", toml, "--json")
    docs = [json.loads(line) for line in lines]
    assert status == 0 and len(docs) == 4
    assert docs[0] == {
        "id": hooks[0].id,
        "seq": 1,
        "tenant": "acme",
        "source": "github",
        "event_key": "evt-1",
        "received_ms": hooks[0].received_ms,
        "headers": [["content-type", "application/json"], ["x-github-event", "push"]],
        "body": '{"ok":true}',
    }
    assert docs[2]["event_key"] is None and "body" not in docs[2]
    assert base64.b64decode(docs[2]["body_base64"]) == hooks[2].body
    assert docs[3]["event_key"] == "evil\x1b[2J"  # JSON escapes it; a script gets it as is


def test_show_text_and_json(
    stored: tuple[str, list[NewHook]], capsys: pytest.CaptureFixture[str]
) -> None:
    toml, hooks = stored
    status, lines, _ = hooks_cmd(capsys, "show", hooks[1].id, "--config", toml)
    assert status == 0
    assert f"id:        {hooks[1].id}" in lines and "seq:       2" in lines
    assert "  x-github-event: push" in lines
    assert lines[-2:] == ["body (13 bytes):", '{"amount":42}']
    _, lines, _ = hooks_cmd(capsys, "show", hooks[2].id, "--config", toml)
    assert lines[-2] == "body (9 bytes, base64):"
    assert base64.b64decode(lines[-1]) == hooks[2].body
    _, lines, _ = hooks_cmd(capsys, "show", hooks[3].id, "--config", toml)
    assert lines[-2:] == ["line one", "line two\\x1b[31m"]  # the newline kept, the escape not
    _, lines, _ = hooks_cmd(capsys, "show", hooks[1].id, "--config", toml, "--json")
    (doc,) = map(json.loads, lines)
    assert (doc["id"], doc["body"], doc["seq"]) == (hooks[1].id, '{"amount":42}', 2)


def test_tail_prints_the_last_n(
    stored: tuple[str, list[NewHook]], capsys: pytest.CaptureFixture[str]
) -> None:
    toml, hooks = stored
    _, lines, _ = hooks_cmd(capsys, "tail", "-n", "2", "--config", toml)
    assert [line.split()[1] for line in lines] == [hooks[2].id, hooks[3].id]
    _, lines, _ = hooks_cmd(capsys, "tail", "--config", toml, "--json")
    assert [json.loads(line)["id"] for line in lines] == [h.id for h in hooks]
    assert hooks_cmd(capsys, "tail", "-n", "0", "--config", toml)[:2] == (0, [])


def test_unknown_id_missing_store_and_bad_config_are_one_line(
    stored: tuple[str, list[NewHook]], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    toml, _ = stored
    status, lines, err = hooks_cmd(capsys, "show", "no-such-id", "--config", toml)
    assert (status, lines) == (1, [])
    assert err.endswith("no hook 'no-such-id'\n") and err.count("\n") == 1
    status, lines, err = hooks_cmd(capsys, "show", "\udcff", "--config", toml)  # argv's \xff
    assert (status, lines) == (1, []) and err.count("\n") == 1
    status, lines, err = hooks_cmd(capsys, "list", "--source", "\udcff", "--config", toml)
    assert (status, lines, err) == (0, [], "")  # no source has such bytes
    with pytest.raises(SystemExit) as e:  # argparse's own one line, exit 2
        hooks_cmd(capsys, "list", "--limit", "9" * 30, "--config", toml)
    assert e.value.code == 2 and "must be 1 to" in capsys.readouterr().err

    elsewhere = tmp_path / "elsewhere.toml"
    elsewhere.write_text(f"[store]\npath = {json.dumps(str(tmp_path / 'none.db'))}\n")
    for command in ("list", "tail", "show"):
        argv = [command, *(["some-id"] if command == "show" else []), "--config", str(elsewhere)]
        status, lines, err = hooks_cmd(capsys, *argv)
        assert (status, lines) == (1, [])
        assert err == f"ankusa-shm hooks: {tmp_path / 'none.db'}: cannot read: no such file" + (
            " (the service creates it when it starts)\n"
        )

    bad = tmp_path / "bad.toml"
    bad.write_text("[store]\nretention = '7w'\n")
    status, _, err = hooks_cmd(capsys, "list", "--config", str(bad))
    assert status == 2 and "store.retention: must be" in err and err.count("\n") == 1


def test_embedded_defaults_read_var_hooks_db(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)
    h = hook()
    commit(config.Store(path="var/hooks.db"), [h])
    status, lines, _ = hooks_cmd(capsys, "list")
    assert status == 0 and [line.split()[1] for line in lines] == [h.id]


class Lines:
    """The lines a process writes to its stdout, read with a deadline."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        self.fd = proc.stdout.fileno()
        self.buf = b""

    def take(self, n: int, timeout: float = 10.0) -> list[str]:
        deadline = time.monotonic() + timeout
        while self.buf.count(b"\n") < n:
            left = deadline - time.monotonic()
            got = self.buf.count(b"\n")
            assert left > 0, f"only {got} of {n} lines in {timeout} s"
            if select.select([self.fd], [], [], left)[0]:
                chunk = os.read(self.fd, 1 << 16)
                assert chunk, "the process closed its stdout"
                self.buf += chunk
        *lines, self.buf = self.buf.split(b"\n", n)
        return [line.decode() for line in lines]


def test_tail_follow_prints_each_new_hook_once_in_order(tmp_path: Path) -> None:
    toml, cfg = config_file(tmp_path)
    first = [hook() for _ in range(3)]
    commit(cfg, first)
    argv = ["hooks", "tail", "-n", "2", "-f", "--json", "--config", toml]
    proc = subprocess.Popen(
        [*COMMAND, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    try:
        out = Lines(proc)
        assert [json.loads(x)["id"] for x in out.take(2)] == [h.id for h in first[1:]]
        later: list[NewHook] = []
        for round_ in range(4):  # some while it sleeps, some in a batch bigger than a poll
            batch = [hook(body=b"%d" % round_) for _ in range(1 + 300 * (round_ == 2))]
            commit(cfg, batch)
            later += batch
            time.sleep(0.3)
        docs = [json.loads(x) for x in out.take(len(later))]
        assert [d["id"] for d in docs] == [h.id for h in later]
        assert [d["seq"] for d in docs] == list(range(4, 4 + len(later)))
        time.sleep(0.5)  # nothing more comes: each hook was printed once
        assert not select.select([out.fd], [], [], 0)[0]

        # The store replaced: its seqs start again, and its hooks are printed all the same.
        for suffix in ("", "-wal", "-shm"):
            os.rename(cfg.path + suffix, f"{cfg.path}{suffix}.old")
        anew = [hook() for _ in range(2)]
        commit(cfg, anew)
        assert [json.loads(x)["id"] for x in out.take(2)] == [h.id for h in anew]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
        assert proc.stderr is not None and proc.stderr.read() == b""
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)
        for pipe in (proc.stdout, proc.stderr):
            if pipe is not None:
                pipe.close()


def test_tail_follow_stops_with_one_line_when_the_store_is_missing(tmp_path: Path) -> None:
    toml, _ = config_file(tmp_path)
    done = subprocess.run(
        [*COMMAND, "hooks", "tail", "-f", "--config", toml],
        capture_output=True,
        timeout=30,
    )
    assert done.returncode == 1 and done.stdout == b""
    assert done.stderr.decode().count("\n") == 1 and b"no such file" in done.stderr


def test_a_relative_store_path_missing_says_where_it_was_looked_for(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The embedded default (var/hooks.db) is relative: run from another directory, the
    error says which one it looked in."""
    monkeypatch.chdir(tmp_path)
    status, lines, err = hooks_cmd(capsys, "list")
    assert (status, lines) == (1, [])
    assert f"var/hooks.db is relative to {tmp_path}" in err
