"""Secrets are named in the config and read here, from the environment or a file -- never
from the config itself, never into a log line."""

from __future__ import annotations

import os
from pathlib import Path


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
