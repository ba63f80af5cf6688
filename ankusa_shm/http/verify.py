"""Signature verification: is this hook from the provider that holds the source's secret?

One verifier per source is built when a worker starts (``verifier_for``): the secret is
read then, decoded into the HMAC key once, and never shown -- every verifier's ``repr``
hides it. ``verify`` runs once per request, so it only splits headers, decodes the
signature it was given and makes one HMAC; anything malformed is simply ``False``, never an
exception, because a forged request must not reach an error path.

While a secret is rotated, the one being replaced is accepted too (``previous_secret_env``
or ``previous_secret_file``): a provider that signs with one secret at a time (GitHub,
Shopify) switches at a moment of its own, and a hook it signed either side of that moment
must pass. The current secret is tried first, so only a forged or stale signature pays for
a second HMAC.
"""

from __future__ import annotations

import binascii
import hashlib
import hmac
from collections.abc import Mapping
from typing import Protocol

from ankusa_shm import config
from ankusa_shm.credentials import MissingSecret, read_secret

# Longest timestamp text parsed: seconds since the epoch have 10 digits until 2286, and
# int() of an unbounded string is both slow and, past 4300 digits, an exception.
_MAX_TS_DIGITS = 12


class InvalidSecret(MissingSecret):
    """The secret is there but unusable (empty, or not the base64 its scheme needs).

    A subclass of ``MissingSecret`` so that a worker refuses to start on it the same way.
    """


class Keyed:
    """HMAC (RFC 2104) with the key's two padded blocks hashed once, at start: a request
    then costs copies of the two hash states and two updates. ``hmac.digest`` sets the
    key up again on every call, which here was more than half of its cost."""

    __slots__ = ("_inner", "_outer")

    def __init__(self, key: bytes, algorithm: str) -> None:
        inner, outer = hashlib.new(algorithm), hashlib.new(algorithm)
        if len(key) > inner.block_size:
            key = hashlib.new(algorithm, key).digest()
        key = key.ljust(inner.block_size, b"\0")
        inner.update(key.translate(_IPAD))
        outer.update(key.translate(_OPAD))
        self._inner, self._outer = inner, outer

    def digest(self, message: bytes) -> bytes:
        inner, outer = self._inner.copy(), self._outer.copy()
        inner.update(message)
        outer.update(inner.digest())
        return outer.digest()


_IPAD = bytes(b ^ 0x36 for b in range(256))
_OPAD = bytes(b ^ 0x5C for b in range(256))


class Verifier(Protocol):
    def verify(self, headers: Mapping[str, str], body: bytes, now_s: float) -> bool:
        """True when the request carries a valid signature of ``body``.

        ``headers`` have lower-case names; ``now_s`` is the wall clock in seconds."""
        ...


def verifier_for(source: config.Source) -> Verifier | None:
    """The verifier of ``source``'s scheme, or None when it verifies nothing.

    Reads the secret now; raises ``MissingSecret`` (or ``InvalidSecret``) when it cannot.
    """
    v = source.verify
    if v.hmac is not None:
        h = v.hmac
        return HmacVerifier(_raw_keys(source, h), h.header, h.prefix, h.algorithm, h.encoding)
    if v.standard_webhooks is not None:
        keys = _whsec_keys(source, v.standard_webhooks)
        return StandardWebhooksVerifier(keys, "webhook-", v.standard_webhooks.tolerance_s)
    if v.svix is not None:
        return StandardWebhooksVerifier(_whsec_keys(source, v.svix), "svix-", v.svix.tolerance_s)
    if v.stripe is not None:
        # Stripe keys its HMAC with the secret's text itself, whsec_ prefix included.
        return StripeVerifier(_raw_keys(source, v.stripe), v.stripe.tolerance_s)
    return None


class HmacVerifier:
    """An HMAC of the body in one header: ``<prefix><digest>``, hex (GitHub) or base64
    (Shopify)."""

    __slots__ = ("_algorithm", "_base64", "_header", "_hmacs", "_prefix")

    def __init__(
        self, keys: list[bytes], header: str, prefix: str, digest: str, encoding: str
    ) -> None:
        self._hmacs = [Keyed(key, digest) for key in keys]
        self._header = header.lower()
        self._prefix = prefix
        self._algorithm = digest
        self._base64 = encoding == "base64"

    def verify(self, headers: Mapping[str, str], body: bytes, now_s: float) -> bool:
        value = headers.get(self._header)
        if value is None or not value.startswith(self._prefix):
            return False
        text = value[len(self._prefix) :]
        given = _unbase64(text) if self._base64 else _unhex(text)
        if given is None:
            return False
        return _any_signed(self._hmacs, body, [given])

    def __repr__(self) -> str:
        return (
            f"HmacVerifier(header={self._header!r}, prefix={self._prefix!r}, "
            f"algorithm={self._algorithm!r}, base64={self._base64}, key=<hidden>)"
        )


class StandardWebhooksVerifier:
    """Standard Webhooks (and Svix, its origin, under ``svix-`` names): HMAC-SHA256 of
    ``{id}.{timestamp}.{body}``, base64, in a space-separated list of ``v1,<sig>``
    entries so a sender can sign with an old and a new secret while rotating."""

    __slots__ = ("_hmacs", "_id", "_signature", "_timestamp", "_tolerance_s")

    def __init__(self, keys: list[bytes], header_prefix: str, tolerance_s: float) -> None:
        self._hmacs = [Keyed(key, "sha256") for key in keys]
        self._id = header_prefix + "id"
        self._timestamp = header_prefix + "timestamp"
        self._signature = header_prefix + "signature"
        self._tolerance_s = tolerance_s

    def verify(self, headers: Mapping[str, str], body: bytes, now_s: float) -> bool:
        msg_id = headers.get(self._id)
        ts = headers.get(self._timestamp)
        signatures = headers.get(self._signature)
        if msg_id is None or ts is None or signatures is None or not msg_id.isascii():
            return False
        if not _fresh(ts, now_s, self._tolerance_s):
            return False
        given = []
        for entry in signatures.split(" "):
            version, _, text = entry.partition(",")
            if version == "v1" and (sig := _unbase64(text)) is not None:
                given.append(sig)
        return _any_signed(self._hmacs, b"%b.%b.%b" % (msg_id.encode(), ts.encode(), body), given)

    def __repr__(self) -> str:
        return (
            f"StandardWebhooksVerifier(signature={self._signature!r}, "
            f"tolerance_s={self._tolerance_s}, key=<hidden>)"
        )


class StripeVerifier:
    """Stripe: ``Stripe-Signature: t=<ts>,v1=<hex>[,v1=<hex>...]``, HMAC-SHA256 hex of
    ``{t}.{body}``. Other schemes in the header (v0, ...) are ignored, as Stripe asks."""

    __slots__ = ("_hmacs", "_tolerance_s")

    def __init__(self, keys: list[bytes], tolerance_s: float) -> None:
        self._hmacs = [Keyed(key, "sha256") for key in keys]
        self._tolerance_s = tolerance_s

    def verify(self, headers: Mapping[str, str], body: bytes, now_s: float) -> bool:
        value = headers.get("stripe-signature")
        if value is None:
            return False
        items = value.split(",")
        ts = next((item[2:] for item in items if item.startswith("t=")), None)
        if ts is None or not _fresh(ts, now_s, self._tolerance_s):
            return False
        given = []
        for item in items:
            if item.startswith("v1=") and (sig := _unhex(item[3:])) is not None:
                given.append(sig)
        return _any_signed(self._hmacs, b"%b.%b" % (ts.encode(), body), given)

    def __repr__(self) -> str:
        return f"StripeVerifier(tolerance_s={self._tolerance_s}, key=<hidden>)"


def _any_signed(hmacs: list[Keyed], signed: bytes, given: list[bytes]) -> bool:
    """Whether any of ``given`` is the HMAC of ``signed`` under any of the keys: a sender
    may list several signatures (one per secret it holds), and we may hold two secrets."""
    if not given:
        return False
    for keyed in hmacs:
        expected = keyed.digest(signed)
        for sig in given:
            if hmac.compare_digest(expected, sig):
                return True
    return False


def _fresh(ts: str, now_s: float, tolerance_s: float) -> bool:
    """``ts`` is whole seconds (ASCII digits only) within ``tolerance_s`` of now: a replayed
    old request fails, and so does one stamped by a sender's clock far ahead."""
    if not (0 < len(ts) <= _MAX_TS_DIGITS and ts.isascii() and ts.isdigit()):
        return False
    return abs(now_s - int(ts)) <= tolerance_s


def _unhex(text: str) -> bytes | None:
    # binascii, not bytes.fromhex, which would skip whitespace inside the digest.
    try:
        return binascii.a2b_hex(text)
    except ValueError:  # odd length, a non-hex digit, a non-ASCII character
        return None


def _unbase64(text: str) -> bytes | None:
    try:
        return binascii.a2b_base64(text, strict_mode=True)
    except ValueError:  # binascii.Error, or a non-ASCII character
        return None


def _secrets(source: config.Source, spec: config.SignatureScheme) -> list[tuple[str, str]]:
    """The secret, then the one it replaces if a rotation is under way: (the secret, where
    it came from -- its name, never its value -- for an error message)."""
    where = [(spec.secret_env, spec.secret_file)]
    if spec.previous_secret_env or spec.previous_secret_file:
        where.append((spec.previous_secret_env, spec.previous_secret_file))
    found = []
    for env, file in where:
        origin = f"environment variable {env}" if env else f"file {file}"
        try:
            secret = read_secret(env, file)
        except MissingSecret as e:  # which source's, for the worker's boot error too
            raise MissingSecret(f"source {source.id}: {e}") from None
        if not secret:
            raise InvalidSecret(f"source {source.id}: the secret from {origin} is empty")
        found.append((secret, origin))
    return found


def _raw_keys(source: config.Source, spec: config.SignatureScheme) -> list[bytes]:
    # surrogateescape: an environment variable's bytes come back as they were set.
    return [secret.encode("utf-8", "surrogateescape") for secret, _ in _secrets(source, spec)]


def _whsec_keys(source: config.Source, spec: config.StandardWebhooks) -> list[bytes]:
    """The keys of Standard Webhooks secrets: the base64 after ``whsec_`` (or the whole
    secret, when given without the prefix), decoded."""
    keys = []
    for secret, origin in _secrets(source, spec):
        key = _unbase64(secret.removeprefix("whsec_"))
        if not key:
            raise InvalidSecret(
                f"source {source.id}: the secret from {origin} is not whsec_<base64>"
            )
        keys.append(key)
    return keys
