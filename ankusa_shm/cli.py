"""The ``ankusa-shm`` command."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Sequence

from ankusa_shm import config, hooks_cli, inspect
from ankusa_shm.shm.segment import DEFAULT_NAME, SegmentError

CONNECT_TIMEOUT_S = 5.0  # check-config --connect: all it does with Redis, at most


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value < math.inf:
        raise argparse.ArgumentTypeError(f"must be positive and finite, not {text}")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ankusa-shm", description="Webhook edge for bare-metal hosts.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the service: supervisor, workers, drainer")
    s.add_argument("--config", help="TOML file (default: embedded defaults)")

    c = sub.add_parser("check-config", help="validate a config file without starting")
    c.add_argument("file", nargs="?", help="TOML file (omit with --list)")
    c.add_argument("--list", action="store_true", help="list every setting with its default")
    c.add_argument(
        "--connect",
        action="store_true",
        help="with a fleet scope, also log in to Redis and run what a host runs there",
    )

    i = sub.add_parser("inspect", help="show a live segment (read-only)")
    i.add_argument("--name", default=DEFAULT_NAME, help=f"segment name (default {DEFAULT_NAME})")
    i.add_argument("--json", action="store_true", help="one JSON document per view")
    i.add_argument("--watch", type=_positive, metavar="SECONDS", help="redraw every SECONDS")
    i.add_argument("--list", action="store_true", help="list every figure and what it means")
    d = sub.add_parser("drainer", help="run the settle drainer alone (the supervisor forks it)")
    d.add_argument("--config", help="TOML file (default: embedded defaults)")
    hooks_cli.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.command == "serve":
        return _serve(args.config)
    if args.command == "check-config":
        return _check_config(args.file, args.list, args.connect)
    if args.command == "drainer":
        return _drainer(args.config)
    if args.command == "hooks":
        return hooks_cli.run(args)
    if args.list:
        return inspect.list_figures()
    return inspect.run(args.name, args.json, args.watch)


def _check_config(file: str | None, list_settings: bool, connect: bool = False) -> int:
    if list_settings:
        rows = config.describe()
        width = max(len(key) for key, _, _ in rows)
        for key, default, doc in rows:
            print(f"{key:<{width}}  {default:<28} {doc}")
        return 0
    if not file:
        print("ankusa-shm check-config: give a FILE (or --list)", file=sys.stderr)
        return 2
    try:
        cfg = config.load(file)
    except config.ConfigError as e:
        print(f"ankusa-shm: {e}", file=sys.stderr)
        return 2
    unreadable = _unreadable_secrets(cfg)
    for why in unreadable:
        print(f"ankusa-shm: {file}: {why}", file=sys.stderr)
    if unreadable:
        print(
            "ankusa-shm: secrets are read as `serve` reads them: check in the service's "
            "environment, as its user",
            file=sys.stderr,
        )
        return 2
    kinds = ", ".join(cfg.fleet_kinds) or "none"
    print(f"{file}: ok ({len(cfg.sources)} sources; fleet kinds: {kinds}; secrets read)")
    if not cfg.sources:  # valid, and surely not meant: a file says which sources exist
        print(f"{file}: warning: no [[sources]]: every hook will be answered 404", file=sys.stderr)
    if connect:
        if cfg.fleet_kinds:
            return _check_redis(cfg)
        print(f"{file}: both scopes node: no Redis to connect to")
    return 0


def _unreadable_secrets(cfg: config.Config) -> list[str]:
    """Every secret ``serve`` would fail to start on, said without its value."""
    from ankusa_shm import credentials
    from ankusa_shm.http.verify import verifier_for

    problems = []
    for source in cfg.sources:
        try:
            verifier_for(source)
        except credentials.MissingSecret as e:
            problems.append(str(e))
    return problems + credentials.unreadable(cfg)


def _check_redis(cfg: config.Config) -> int:
    """``check-config --connect``: 0 if Redis lets a host do its work, 1 if not (said)."""
    import asyncio
    import time

    from ankusa_shm.credentials import MissingSecret, read_secret
    from ankusa_shm.fleet.redis_client import REFUSED_HINT, RedisError, refused
    from ankusa_shm.fleet.redis_store import RedisStore

    where = cfg.fleet.redis_url.rpartition("@")[2]  # never a password in the output
    try:
        password = read_secret(cfg.fleet.password_env, cfg.fleet.password_file)
    except MissingSecret as e:
        print(f"ankusa-shm: {e}", file=sys.stderr)
        return 1

    async def probe() -> str:
        store = RedisStore.from_config(cfg.fleet, password)
        deadline = time.monotonic() + CONNECT_TIMEOUT_S
        try:
            await store.probe(deadline)
            memory = await store.memory(deadline)
        finally:
            await store.close()
        if memory is None:
            return "maxmemory-policy not known (INFO refused)"
        if memory.evicts:
            print(
                f"{where}: warning: maxmemory-policy {memory.policy} evicts fleet keys, and "
                "a resend whose key it evicted is stored again: set noeviction",
                file=sys.stderr,
            )
        return f"maxmemory-policy {memory.policy}"

    try:
        policy = asyncio.run(probe())
    except (TimeoutError, RedisError) as e:
        why = str(e) or f"no answer within {CONNECT_TIMEOUT_S:g} s"
        hint = f"; {REFUSED_HINT}" if refused(e) else ""
        print(f"ankusa-shm: {where}: {why}{hint}", file=sys.stderr)
        return 1
    print(f"{where}: ok (logged in, scripts loaded and run, a key written; {policy})")
    return 0


def _configure_logging() -> None:
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s [%(process)d] %(name)s %(levelname)s %(message)s",
    )


def _serve(file: str | None) -> int:
    import setproctitle

    from ankusa_shm.store.schema import StoreError
    from ankusa_shm.supervisor.arbiter import Arbiter
    from ankusa_shm.supervisor.sockets import BindError

    # setproctitle can take over argv's memory only while the environment is still the one
    # exec laid out after it: start it before the supervisor removes NOTIFY_SOCKET and
    # LISTEN_FDS, or every process title is lost.
    setproctitle.getproctitle()
    _configure_logging()
    try:
        cfg = config.load(file) if file else config.defaults()
        return Arbiter(cfg, file).run()
    except (config.ConfigError, SegmentError, StoreError, BindError) as e:
        print(f"ankusa-shm serve: {e}", file=sys.stderr)
        return 2


def _drainer(file: str | None) -> int:
    from ankusa_shm.child import BootError
    from ankusa_shm.fleet import drainer

    _configure_logging()
    try:
        cfg = config.load(file) if file else config.defaults()
        return drainer.run_alone(cfg)
    except (config.ConfigError, SegmentError, BootError) as e:
        print(f"ankusa-shm drainer: {e}", file=sys.stderr)
        return 2
