"""Secrets are named in the config and read here, from the environment or a file -- never
from the config itself, never into a log line."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ankusa_shm.config import Config


class MissingSecret(Exception):
    pass


def read_secret(env: str = "", file: str = "") -> str:
    """The secret named by ``env`` or ``file``, without the whitespace around it (a
    trailing newline from ``echo`` or a secrets manager is not part of it, and a token a
    client can only send trimmed could never match); "" when neither is given."""
    if env:
        value = os.environ.get(env)
        if value is None:
            raise MissingSecret(f"environment variable {env} is not set")
        return value.strip()
    if file:
        try:
            return Path(file).read_text(encoding="utf-8").strip()
        except OSError as e:
            raise MissingSecret(f"cannot read secret file {file}: {e.strerror}") from None
        except UnicodeDecodeError:
            raise MissingSecret(f"secret file {file} is not UTF-8 text") from None
        except ValueError:  # a NUL in the path: no file can have that name
            raise MissingSecret(f"cannot read secret file {file!r}: not a path") from None
    return ""


def admin_token(env: str = "", file: str = "") -> bytes | None:
    """The admin API's bearer token, or None when none is named (a loopback listener: the
    config refuses any other address without one); an empty one is missing."""
    if not (env or file):
        return None
    token = read_secret(env, file)
    if not token:
        raise MissingSecret("it is empty")
    return token.encode()


def unreadable(cfg: Config) -> list[str]:
    """Each of the admin token and the fleet's password that ``cfg`` needs and that
    cannot be read, said without its value. (A source's secrets are read, and checked,
    by its verifier.) A reload checks these first: it stops the admin process and the
    drainer before their successors start, and one that cannot start took the admin
    API, or the settlements, down until the secret came back."""
    problems = []
    s = cfg.server
    if s.admin_listen:
        try:
            admin_token(s.admin_token_env, s.admin_token_file)
        except MissingSecret as e:
            problems.append(f"server.admin_token: {e}")
    try:
        fleet_password(cfg)
    except MissingSecret as e:
        problems.append(f"fleet.password: {e}")
    return problems


def fleet_password(cfg: Config) -> str:
    """The fleet's Redis password; "" where no scope is fleet: none is read then, so a
    node-scope config's password setting, left from a fleet one, stops nothing."""
    if not cfg.fleet_kinds:
        return ""
    env, file = cfg.fleet.password_env, cfg.fleet.password_file
    password = read_secret(env, file)
    if (env or file) and not password:  # named, so meant: an empty one is a file half written
        raise MissingSecret(
            f"{f'environment variable {env}' if env else f'secret file {file}'} is empty"
        )
    return password
