"""``ankusa-shm hooks``: list, show and tail the hooks in the host's store.

A thin client of ``store.readers``: every read is a short ``mode=ro`` transaction, so it
runs beside the service without holding up its writers. Text output escapes control
characters, since bodies and keys are whatever the senders chose (a terminal obeys escape
sequences); ``--json`` prints one object per hook per line, for scripts.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from ankusa_shm import config
from ankusa_shm.store import readers
from ankusa_shm.store.readers import StoredHook
from ankusa_shm.store.schema import StoreError

_CONFIG_HELP = "TOML file naming store.path (default: embedded defaults)"
POLL_S = 0.2  # --follow's pause between looks for new hooks
_FOLLOW_PAGE = 500
# C0 controls but newline and tab, DEL and C1 controls, written as \xNN.
_CONTROLS = {c: f"\\x{c:02x}" for c in [*range(32), *range(127, 160)] if c not in (9, 10)}
_ONE_LINE = {**_CONTROLS, 9: "\\t", 10: "\\n"}


_HIGHEST = 2**63 - 1  # SQLite's largest integer


def _at_least(lowest: int) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
        if not lowest <= value <= _HIGHEST:
            raise argparse.ArgumentTypeError(f"must be {lowest} to {_HIGHEST}, not {value}")
        return value

    return parse


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add ``hooks`` and its commands to the ``ankusa-shm`` command's subparsers."""
    common = argparse.ArgumentParser(add_help=False)
    # SUPPRESS: given after the command, it wins; not given, the one before it stays.
    common.add_argument("--config", metavar="FILE", default=argparse.SUPPRESS, help=_CONFIG_HELP)
    common.add_argument("--json", action="store_true", help="one JSON object per hook per line")

    h = sub.add_parser("hooks", help="list, show or tail the stored hooks (read-only)")
    h.add_argument("--config", metavar="FILE", help=_CONFIG_HELP)
    actions = h.add_subparsers(dest="hooks_command", required=True, metavar="COMMAND")

    ls = actions.add_parser("list", parents=[common], help="hooks in commit order")
    ls.add_argument("--after", type=_at_least(0), default=0, metavar="SEQ", help="after this seq")
    ls.add_argument("--limit", type=_at_least(1), default=100, metavar="N", help="at most N")
    ls.add_argument("--source", metavar="S", help="of source S only")

    show = actions.add_parser("show", parents=[common], help="one hook, headers and body")
    show.add_argument("id", help="the hook's id")

    tail = actions.add_parser("tail", parents=[common], help="the last hooks committed")
    tail.add_argument("-n", type=_at_least(0), default=10, metavar="N", help="the last N (10)")
    tail.add_argument(
        "-f", "--follow", action="store_true", help="then print new hooks as they are committed"
    )


def run(args: argparse.Namespace) -> int:
    """Run ``ankusa-shm hooks ...``: 0, 1 for a store or hook that is not there, 2 for a
    bad config file; a one-line message on stderr, never a traceback."""
    try:
        cfg = config.load(args.config) if args.config else config.defaults()
    except config.ConfigError as e:
        return _fail(str(e), 2)
    path = cfg.store.path
    try:
        if args.hooks_command == "list":
            source = args.source
            hooks = [] if _not_utf8(source) else readers.page(path, args.after, args.limit, source)
            _print(hooks, args.json)
        elif args.hooks_command == "show":
            found = None if _not_utf8(args.id) else readers.get(path, args.id)
            if found is None:
                return _fail(f"{path}: no hook {args.id!r}", 1)
            print(_json(found) if args.json else _details(found))
        elif args.follow:
            _follow(path, args.n, args.json)
        else:
            _print(readers.latest(path, args.n), args.json)
        sys.stdout.flush()
    except StoreError as e:
        return _fail(str(e), 1)
    except BrokenPipeError:  # e.g. `| head`: the reader is gone, so is our output
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    return 0


def _not_utf8(arg: str | None) -> bool:
    """Whether ``arg`` came as bytes that are not UTF-8 (kept as surrogates): no hook id or
    source has them, and SQLite cannot be asked for them."""
    if arg is None:
        return False
    try:
        arg.encode()
    except UnicodeEncodeError:
        return True
    return False


def _fail(message: str, status: int) -> int:
    print(f"ankusa-shm hooks: {message}", file=sys.stderr)
    return status


def _follow(path: str, n: int, as_json: bool) -> None:
    """The last ``n`` hooks, then every hook committed after them, each once and in commit
    order (a snapshot holds a prefix of the commit order), until SIGINT or SIGTERM."""
    reader = readers.Reader(path)
    try:
        with _until_signalled() as stop:
            cursor = 0 if n else reader.last_seq()
            hooks = reader.latest(n)
            while not stop.is_set():
                _print(hooks, as_json)
                sys.stdout.flush()
                cursor = hooks[-1].seq if hooks else cursor
                if len(hooks) < _FOLLOW_PAGE:  # caught up: look again in a moment
                    stop.wait(POLL_S)
                    if not stop.is_set() and cursor > reader.last_seq():
                        cursor = 0  # the store was replaced: every hook in it is new
                hooks = [] if stop.is_set() else reader.page(cursor, _FOLLOW_PAGE)
    finally:
        reader.close()


@contextmanager
def _until_signalled() -> Iterator[threading.Event]:
    """An event set by SIGINT or SIGTERM, so the loop ends between two hooks, never in
    the middle of printing one."""
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stop
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _print(hooks: list[StoredHook], as_json: bool) -> None:
    for h in hooks:
        print(_json(h) if as_json else _line(h))


def _key_text(h: StoredHook) -> str | None:
    return None if h.event_key is None else h.event_key.decode("utf-8", "backslashreplace")


def _json(h: StoredHook) -> str:
    return json.dumps(h.doc(), separators=(",", ":"))


def _when(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms // 1000)) + f".{ms % 1000:03d}Z"


def _field(text: str) -> str:
    return text.translate(_ONE_LINE)


def _line(h: StoredHook) -> str:
    key = _key_text(h)
    return (
        f"{h.seq:>8}  {h.id}  {_when(h.received_ms)}  {_field(h.tenant)}  {_field(h.source)}"
        f"  {'-' if key is None else _field(key)}  {len(h.body)} B"
    )


def _details(h: StoredHook) -> str:
    key = _key_text(h)
    lines = [
        f"id:        {h.id}",
        f"seq:       {h.seq}",
        f"tenant:    {_field(h.tenant)}",
        f"source:    {_field(h.source)}",
        f"event key: {'-' if key is None else _field(key)}",
        f"received:  {_when(h.received_ms)} ({h.received_ms})",
        "headers:",
        *(f"  {_field(name)}: {_field(value)}" for name, value in h.headers),
    ]
    text = readers.text(h.body)
    if text is None:
        lines += [f"body ({len(h.body)} bytes, base64):", base64.b64encode(h.body).decode("ascii")]
    else:
        lines += [f"body ({len(h.body)} bytes):", text.translate(_CONTROLS)]
    return "\n".join(lines)
