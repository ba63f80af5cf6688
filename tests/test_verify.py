"""Signature verification: published vectors, signatures made here with the stdlib, and
every way a request can be wrong -- each of which is False, never an exception."""

from __future__ import annotations

import base64
import hashlib
import hmac
from pathlib import Path
from typing import Any

import pytest

from ankusa_shm import config
from ankusa_shm.config import ConfigError
from ankusa_shm.credentials import MissingSecret
from ankusa_shm.http.verify import InvalidSecret, Keyed, Verifier, verifier_for

SECRET = "s3cr3t-Th4t-must-n0t-leak"


def source(verify: dict[str, Any]) -> config.Source:
    """One source through the real config path, as a worker would get it."""
    cfg = config.parse({"sources": [{"id": "src", "tenant": "t", "verify": verify}]}, "test.toml")
    return cfg.sources[0]


def verifier(verify: dict[str, Any]) -> Verifier:
    v = verifier_for(source(verify))
    assert v is not None
    return v


@pytest.mark.parametrize("algorithm", ["sha1", "sha256"])
@pytest.mark.parametrize("key_len", [0, 1, 32, 63, 64, 65, 200])
def test_keyed_hmac_is_rfc_2104(algorithm: str, key_len: int) -> None:
    """The precomputed pads give hmac's digest for keys shorter than, equal to and longer
    than the block (a long key is hashed first), and stay reusable across messages."""
    key = bytes(range(256))[:key_len]
    keyed = Keyed(key, algorithm)
    for message in (b"", b"x", b"{}" * 500, bytes(range(256))):
        assert keyed.digest(message) == hmac.digest(key, message, algorithm)


def config_error(verify: dict[str, Any]) -> str:
    with pytest.raises(ConfigError) as e:
        source(verify)
    message = str(e.value)
    assert message.startswith("test.toml: sources[0].verify"), message
    return message


@pytest.fixture(autouse=True)
def secret_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOK_SECRET", SECRET)


def test_no_scheme_verifies_nothing() -> None:
    assert verifier_for(source({})) is None


# -- hmac -------------------------------------------------------------------------------------

GITHUB = {"header": "x-hub-signature-256", "prefix": "sha256=", "secret_env": "HOOK_SECRET"}


def hex_sig(body: bytes, secret: str = SECRET, algorithm: str = "sha256") -> str:
    return hmac.new(secret.encode(), body, algorithm).hexdigest()


def test_github_published_vector(monkeypatch: pytest.MonkeyPatch) -> None:
    # docs.github.com/en/webhooks/using-webhooks/validating-webhook-deliveries,
    # "Testing the webhook payload validation".
    monkeypatch.setenv("HOOK_SECRET", "It's a Secret to Everybody")
    v = verifier({"hmac": GITHUB})
    sig = "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17"
    assert v.verify({"x-hub-signature-256": sig}, b"Hello, World!", 0.0)
    assert not v.verify({"x-hub-signature-256": sig}, b"Hello, World?", 0.0)


@pytest.mark.parametrize("algorithm", ["sha256", "sha1", "sha512"])
def test_hmac_good_signature_passes(algorithm: str) -> None:
    v = verifier({"hmac": {**GITHUB, "algorithm": algorithm, "prefix": f"{algorithm}="}})
    body = b'{"action":"opened"}'
    assert v.verify(
        {"x-hub-signature-256": f"{algorithm}={hex_sig(body, algorithm=algorithm)}"}, body, 0
    )
    upper = f"{algorithm}={hex_sig(body, algorithm=algorithm).upper()}"
    assert v.verify({"x-hub-signature-256": upper}, body, 0)  # hex digits in either case


def test_hmac_header_name_in_config_is_case_insensitive() -> None:
    v = verifier({"hmac": {**GITHUB, "header": "X-Hub-Signature-256"}})
    assert v.verify({"x-hub-signature-256": "sha256=" + hex_sig(b"x")}, b"x", 0)


@pytest.mark.parametrize(
    ("headers", "body"),
    [
        ({"x-hub-signature-256": "sha256=" + hex_sig(b"body", secret="other")}, b"body"),
        ({"x-hub-signature-256": "sha256=" + hex_sig(b"body")}, b"bodY"),
        ({}, b"body"),
        ({"x-hub-signature": "sha256=" + hex_sig(b"body")}, b"body"),
        ({"x-hub-signature-256": hex_sig(b"body")}, b"body"),  # no prefix
        ({"x-hub-signature-256": "sha1=" + hex_sig(b"body")}, b"body"),  # wrong prefix
        ({"x-hub-signature-256": "sha256=" + hex_sig(b"body")[:-2]}, b"body"),  # truncated
        ({"x-hub-signature-256": "sha256=" + hex_sig(b"body")[:-1]}, b"body"),  # odd length
        ({"x-hub-signature-256": "sha256=" + "zz" * 32}, b"body"),
        ({"x-hub-signature-256": "sha256=" + hex_sig(b"body")[:-2] + "é0"}, b"body"),
        ({"x-hub-signature-256": "sha256= " + hex_sig(b"body")}, b"body"),
        ({"x-hub-signature-256": "sha256=" + " ".join(hex_sig(b"body"))}, b"body"),
        ({"x-hub-signature-256": ""}, b"body"),
        ({"x-hub-signature-256": "sha256="}, b"body"),
    ],
)
def test_hmac_bad_requests_fail(headers: dict[str, str], body: bytes) -> None:
    assert verifier({"hmac": GITHUB}).verify(headers, body, 0) is False


SHOPIFY = {"header": "x-shopify-hmac-sha256", "encoding": "base64", "secret_env": "HOOK_SECRET"}


def b64_sig(body: bytes, secret: str = SECRET) -> str:
    return base64.b64encode(hmac.new(secret.encode(), body, hashlib.sha256).digest()).decode()


def test_hmac_base64_shopify_style() -> None:
    v = verifier({"hmac": SHOPIFY})
    body = b'{"id":820982911946154508}'
    assert v.verify({"x-shopify-hmac-sha256": b64_sig(body)}, body, 0)
    assert not v.verify({"x-shopify-hmac-sha256": b64_sig(body)}, body + b" ", 0)
    assert not v.verify({"x-shopify-hmac-sha256": b64_sig(body, "other")}, body, 0)
    assert not v.verify({"x-shopify-hmac-sha256": hex_sig(body)}, body, 0)  # hex is not base64
    assert not v.verify({"x-shopify-hmac-sha256": b64_sig(body).rstrip("=")}, body, 0)
    assert not v.verify({"x-shopify-hmac-sha256": "!!" + b64_sig(body)}, body, 0)
    assert not v.verify({"x-shopify-hmac-sha256": "é"}, body, 0)
    assert not v.verify({}, body, 0)


def test_hmac_secret_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n", encoding="utf-8")
    v = verifier({"hmac": {**GITHUB, "secret_env": "", "secret_file": str(path)}})
    assert v.verify({"x-hub-signature-256": "sha256=" + hex_sig(b"x")}, b"x", 0)


def test_missing_or_empty_secret_fails_at_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HOOK_SECRET")
    with pytest.raises(MissingSecret, match="HOOK_SECRET"):
        verifier_for(source({"hmac": GITHUB}))
    monkeypatch.setenv("HOOK_SECRET", "")
    with pytest.raises(InvalidSecret, match="HOOK_SECRET is empty"):
        verifier_for(source({"hmac": GITHUB}))
    nul = {"hmac": {**GITHUB, "secret_env": "", "secret_file": "/tmp/a\x00b"}}
    with pytest.raises(MissingSecret, match="not a path"):  # not a ValueError: a boot error
        verifier_for(source(nul))


# -- standard webhooks and svix --------------------------------------------------------------

# The Standard Webhooks reference vector: github.com/standard-webhooks/standard-webhooks,
# libraries/go/webhook_test.go, TestWebhookSign (the same one Svix's libraries test with).
SW_SECRET = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
SW_ID = "msg_p5jXN8AQM9LWM0D4loKWxJek"
SW_TS = 1614265330
SW_BODY = b'{"test": 2432232314}'
SW_SIG = "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="


def sw_headers(
    sig: str, prefix: str = "webhook-", msg_id: str = SW_ID, ts: str = str(SW_TS)
) -> dict[str, str]:
    return {f"{prefix}id": msg_id, f"{prefix}timestamp": ts, f"{prefix}signature": sig}


def sw_sig(key: bytes, msg_id: str, ts: int, body: bytes) -> str:
    mac = hmac.new(key, f"{msg_id}.{ts}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


@pytest.fixture
def sw_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOK_SECRET", SW_SECRET)


@pytest.mark.usefixtures("sw_secret")
@pytest.mark.parametrize(
    ("scheme", "prefix"), [("standard_webhooks", "webhook-"), ("svix", "svix-")]
)
def test_standard_webhooks_published_vector(scheme: str, prefix: str) -> None:
    v = verifier({scheme: {"secret_env": "HOOK_SECRET"}})
    assert v.verify(sw_headers(SW_SIG, prefix), SW_BODY, SW_TS)
    other = "svix-" if prefix == "webhook-" else "webhook-"
    assert not v.verify(sw_headers(SW_SIG, other), SW_BODY, SW_TS)  # the other scheme's names


def test_standard_webhooks_secret_without_prefix(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOOK_SECRET", SW_SECRET.removeprefix("whsec_"))
    v = verifier({"standard_webhooks": {"secret_env": "HOOK_SECRET"}})
    assert v.verify(sw_headers(SW_SIG), SW_BODY, SW_TS)


def test_standard_webhooks_independent_signature(monkeypatch: pytest.MonkeyPatch) -> None:
    key = hashlib.sha256(b"some key").digest()
    monkeypatch.setenv("HOOK_SECRET", "whsec_" + base64.b64encode(key).decode())
    v = verifier({"standard_webhooks": {"secret_env": "HOOK_SECRET"}})
    body = b'{"type":"invoice.paid"}'
    now = 1_700_000_000
    assert v.verify(
        sw_headers(sw_sig(key, "evt_1", now, body), ts=str(now), msg_id="evt_1"), body, now
    )


@pytest.mark.usefixtures("sw_secret")
def test_standard_webhooks_any_one_of_several_signatures_passes() -> None:
    v = verifier({"standard_webhooks": {"secret_env": "HOOK_SECRET"}})
    wrong = "v1,Ceo5qEr07ixe2NLpvHk3FH9bwy/WavXrAFQ/9tdO6mc="
    good = SW_SIG.removeprefix("v1,")
    assert v.verify(sw_headers(f"{wrong} v2,{good} {SW_SIG} {wrong}"), SW_BODY, SW_TS)
    assert v.verify(sw_headers(f"{wrong}  {SW_SIG}"), SW_BODY, SW_TS)  # a doubled space
    assert not v.verify(sw_headers(f"{wrong} v2,{good}"), SW_BODY, SW_TS)  # only v1 counts
    assert not v.verify(sw_headers(f"{wrong} {wrong}"), SW_BODY, SW_TS)


@pytest.mark.usefixtures("sw_secret")
@pytest.mark.parametrize(
    ("headers", "body", "now"),
    [
        (sw_headers(SW_SIG), SW_BODY + b" ", SW_TS),  # tampered body
        (sw_headers(SW_SIG, msg_id="msg_other"), SW_BODY, SW_TS),  # the id is signed
        (sw_headers(SW_SIG, ts=str(SW_TS + 1)), SW_BODY, SW_TS),  # so is the timestamp
        (sw_headers(SW_SIG), SW_BODY, SW_TS + 301),  # expired
        (sw_headers(SW_SIG), SW_BODY, SW_TS - 301),  # from the future
        ({"webhook-timestamp": str(SW_TS), "webhook-signature": SW_SIG}, SW_BODY, SW_TS),
        ({"webhook-id": SW_ID, "webhook-signature": SW_SIG}, SW_BODY, SW_TS),
        ({"webhook-id": SW_ID, "webhook-timestamp": str(SW_TS)}, SW_BODY, SW_TS),
        (sw_headers(SW_SIG, ts="soon"), SW_BODY, SW_TS),
        (sw_headers(SW_SIG, ts=""), SW_BODY, SW_TS),
        (sw_headers(SW_SIG, ts=f"{SW_TS}.0"), SW_BODY, SW_TS),
        (sw_headers(SW_SIG, ts=f"-{SW_TS}"), SW_BODY, SW_TS),
        (sw_headers(SW_SIG, ts="١٦١٤٢٦٥٣٣٠"), SW_BODY, SW_TS),  # Arabic-Indic digits
        (sw_headers(SW_SIG, ts="9" * 5000), SW_BODY, SW_TS),
        (sw_headers(SW_SIG, msg_id="msg_é"), SW_BODY, SW_TS),
        (sw_headers(""), SW_BODY, SW_TS),
        (sw_headers("v1,"), SW_BODY, SW_TS),
        (sw_headers("v1"), SW_BODY, SW_TS),
        (sw_headers("v1,!!not base64!!"), SW_BODY, SW_TS),
        (sw_headers(SW_SIG.rstrip("=")), SW_BODY, SW_TS),
        (sw_headers(SW_SIG + "é"), SW_BODY, SW_TS),
        (sw_headers("v1," + hashlib.sha256(b"x").hexdigest()), SW_BODY, SW_TS),
    ],
)
def test_standard_webhooks_bad_requests_fail(
    headers: dict[str, str], body: bytes, now: int
) -> None:
    v = verifier({"standard_webhooks": {"secret_env": "HOOK_SECRET"}})
    assert v.verify(headers, body, now) is False


@pytest.mark.usefixtures("sw_secret")
def test_standard_webhooks_tolerance_is_both_ways_and_configurable() -> None:
    v = verifier({"standard_webhooks": {"secret_env": "HOOK_SECRET"}})
    assert v.verify(sw_headers(SW_SIG), SW_BODY, SW_TS + 300)
    assert v.verify(sw_headers(SW_SIG), SW_BODY, SW_TS - 300)
    assert not v.verify(sw_headers(SW_SIG), SW_BODY, SW_TS + 300.5)
    tight = verifier({"svix": {"secret_env": "HOOK_SECRET", "tolerance_s": 10}})
    assert tight.verify(sw_headers(SW_SIG, "svix-"), SW_BODY, SW_TS + 10)
    assert not tight.verify(sw_headers(SW_SIG, "svix-"), SW_BODY, SW_TS + 11)


@pytest.mark.parametrize("secret", ["whsec_not*base64", "whsec_", "whsec_YWJ"])
def test_standard_webhooks_unusable_secret_fails_at_build(
    monkeypatch: pytest.MonkeyPatch, secret: str
) -> None:
    monkeypatch.setenv("HOOK_SECRET", secret)
    with pytest.raises(InvalidSecret) as e:
        verifier_for(source({"standard_webhooks": {"secret_env": "HOOK_SECRET"}}))
    message = str(e.value)
    assert (
        message
        == "source src: the secret from environment variable HOOK_SECRET is not whsec_<base64>"
    )


# -- stripe -----------------------------------------------------------------------------------

STRIPE_SECRET = "whsec_test_4eC39HqLyjWDarjtT1zdp7dc"
NOW = 1_700_000_000


def stripe_sig(ts: int, body: bytes, secret: str = STRIPE_SECRET) -> str:
    # Stripe's scheme (docs.stripe.com/webhooks, "Verify signatures manually"): HMAC-SHA256
    # keyed with the secret's text, over "<t>.<body>", in hex.
    return hmac.new(secret.encode(), f"{ts}.".encode() + body, hashlib.sha256).hexdigest()


@pytest.fixture
def stripe(monkeypatch: pytest.MonkeyPatch) -> Verifier:
    monkeypatch.setenv("HOOK_SECRET", STRIPE_SECRET)
    return verifier({"stripe": {"secret_env": "HOOK_SECRET"}})


BODY = b'{"id":"evt_1","object":"event"}'


def test_stripe_good_signature_passes(stripe: Verifier) -> None:
    sig = stripe_sig(NOW, BODY)
    assert stripe.verify({"stripe-signature": f"t={NOW},v1={sig}"}, BODY, NOW)
    # Other schemes and a second v1 (during a secret roll) are allowed; any v1 may match.
    header = f"t={NOW},v1={stripe_sig(NOW, BODY, 'old')},v1={sig},v0={'0' * 64}"
    assert stripe.verify({"stripe-signature": header}, BODY, NOW + 299)


@pytest.mark.parametrize(
    ("header", "now"),
    [
        (f"t={NOW},v1={stripe_sig(NOW, BODY, 'whsec_other')}", NOW),  # wrong secret
        (f"t={NOW},v1={stripe_sig(NOW, BODY + b'x')}", NOW),  # tampered body
        (f"t={NOW + 1},v1={stripe_sig(NOW, BODY)}", NOW),  # the timestamp is signed
        (f"t={NOW},v1={stripe_sig(NOW, BODY)}", NOW + 301),  # expired
        (f"t={NOW},v1={stripe_sig(NOW, BODY)}", NOW - 301),  # from the future
        (f"v1={stripe_sig(NOW, BODY)}", NOW),  # no t
        (f"t={NOW}", NOW),  # no v1
        (f"t={NOW},v0={stripe_sig(NOW, BODY)}", NOW),  # only v1 counts
        (f"t=now,v1={stripe_sig(NOW, BODY)}", NOW),
        (f"t=,v1={stripe_sig(NOW, BODY)}", NOW),
        (f"t={NOW},v1={stripe_sig(NOW, BODY)[:-1]}", NOW),
        (f"t={NOW},v1={'g' * 64}", NOW),
        (f"t={NOW},v1={base64.b64encode(bytes.fromhex(stripe_sig(NOW, BODY))).decode()}", NOW),
        (f"t={NOW}, v1={stripe_sig(NOW, BODY)}", NOW),
        ("", NOW),
        ("garbage", NOW),
        ("t=é,v1=é", NOW),
    ],
)
def test_stripe_bad_requests_fail(stripe: Verifier, header: str, now: int) -> None:
    assert stripe.verify({"stripe-signature": header}, BODY, now) is False


def test_stripe_missing_header_fails(stripe: Verifier) -> None:
    assert stripe.verify({}, BODY, NOW) is False


# -- secrets stay secret ----------------------------------------------------------------------


SW_KEY = base64.b64decode(SW_SECRET.removeprefix("whsec_"))


@pytest.mark.parametrize(
    ("verify", "secret", "key"),
    [
        ({"hmac": GITHUB}, SECRET, SECRET.encode()),
        ({"standard_webhooks": {"secret_env": "HOOK_SECRET"}}, SW_SECRET, SW_KEY),
        ({"svix": {"secret_env": "HOOK_SECRET"}}, SW_SECRET, SW_KEY),
        ({"stripe": {"secret_env": "HOOK_SECRET"}}, STRIPE_SECRET, STRIPE_SECRET.encode()),
    ],
)
def test_secret_never_in_repr_or_str(
    monkeypatch: pytest.MonkeyPatch, verify: dict[str, Any], secret: str, key: bytes
) -> None:
    monkeypatch.setenv("HOOK_SECRET", secret)
    v = verifier(verify)
    for text in (repr(v), str(v), f"{v}", repr([v])):
        assert "key=<hidden>" in text
        assert secret.removeprefix("whsec_") not in text
        assert repr(key) not in text and key.hex() not in text
    assert not hasattr(v, "__dict__")  # no vars(v) to dump the key through


# -- config -----------------------------------------------------------------------------------


def test_config_reads_every_scheme() -> None:
    src = source({"hmac": {**SHOPIFY, "algorithm": "sha512"}})
    assert src.verify.hmac is not None and src.verify.hmac.encoding == "base64"
    github = source({"hmac": GITHUB}).verify.hmac
    assert github == config.Hmac("x-hub-signature-256", "HOOK_SECRET", prefix="sha256=")
    assert (github.algorithm, github.encoding) == ("sha256", "hex")
    sw = source({"standard_webhooks": {"secret_file": "/run/s"}}).verify.standard_webhooks
    assert sw is not None and sw.tolerance_s == 300 and sw.secret_file == "/run/s"
    svix = source({"svix": {"secret_env": "S", "tolerance_s": 60}}).verify.svix
    assert svix is not None and svix.tolerance_s == 60
    st = source({"stripe": {"secret_env": "S"}}).verify.stripe
    assert st is not None and st.tolerance_s == 300


def test_config_more_than_one_scheme_is_an_error() -> None:
    message = config_error({"hmac": GITHUB, "stripe": {"secret_env": "S"}})
    assert message.startswith("test.toml: sources[0].verify: ")
    assert "hmac" in message and "stripe" in message


@pytest.mark.parametrize("scheme", ["hmac", "standard_webhooks", "svix", "stripe"])
@pytest.mark.parametrize("secrets", [{}, {"secret_env": "A", "secret_file": "B"}])
def test_config_needs_exactly_one_secret(scheme: str, secrets: dict[str, str]) -> None:
    spec: dict[str, str] = {"header": "x-sig"} if scheme == "hmac" else {}
    message = config_error({scheme: {**spec, **secrets}})
    assert message == (
        f"test.toml: sources[0].verify.{scheme}: give exactly one of secret_env, secret_file"
    )


@pytest.mark.parametrize(
    ("verify", "key"),
    [
        ({"hmac": {**GITHUB, "encoding": "base32"}}, "verify.hmac.encoding: must be"),
        ({"hmac": {**GITHUB, "algorithm": "md5"}}, "verify.hmac.algorithm: must be"),
        ({"hmac": {**GITHUB, "header": "x hub"}}, "verify.hmac.header: 'x hub' is not a header"),
        ({"hmac": {**GITHUB, "header": ""}}, "verify.hmac.header: '' is not a header"),
        ({"svix": {"secret_env": "S", "tolerance_s": 0}}, "verify.svix.tolerance_s: must be"),
        ({"stripe": {"secret_env": "S", "secret": "x"}}, "verify.stripe.secret: unknown key"),
        ({"ed25519": {}}, "verify.ed25519: unknown key"),
    ],
)
def test_config_errors_name_the_key(verify: dict[str, Any], key: str) -> None:
    assert f"test.toml: sources[0].{key}" in config_error(verify)


# -- rotating a secret -------------------------------------------------------------------------

OLD_SW = "whsec_" + base64.b64encode(b"the-old-key-0123456789").decode()


@pytest.mark.parametrize("scheme", ["hmac", "standard_webhooks", "svix", "stripe"])
def test_during_a_rotation_either_secret_passes_and_no_other(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, scheme: str
) -> None:
    """GitHub and Shopify sign with one secret at a time and switch when they are told:
    a hook signed either side of that moment passes while both are configured."""
    new, old = (SW_SECRET, OLD_SW) if scheme in ("standard_webhooks", "svix") else ("new", "old")
    monkeypatch.setenv("HOOK_SECRET", new)
    (tmp_path / "old").write_text(old)
    spec: dict[str, str] = {"header": "x-sig"} if scheme == "hmac" else {}
    v = verifier(
        {
            scheme: {
                **spec,
                "secret_env": "HOOK_SECRET",
                "previous_secret_file": str(tmp_path / "old"),
            }
        }
    )

    def signed_with(secret: str) -> dict[str, str]:
        if scheme == "hmac":
            return {"x-sig": hex_sig(BODY, secret)}
        if scheme == "stripe":
            return {"stripe-signature": f"t={NOW},v1={stripe_sig(NOW, BODY, secret)}"}
        key = base64.b64decode(secret.removeprefix("whsec_"))
        prefix = "webhook-" if scheme == "standard_webhooks" else "svix-"
        return sw_headers(sw_sig(key, SW_ID, NOW, BODY), prefix, ts=str(NOW))

    other = "whsec_" + base64.b64encode(b"neither-of-them").decode() if "whsec" in new else "x"
    assert v.verify(signed_with(new), BODY, NOW)
    assert v.verify(signed_with(old), BODY, NOW)
    assert not v.verify(signed_with(other), BODY, NOW)


def test_a_previous_secret_that_cannot_be_read_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(MissingSecret, match=r"source src: .*OLD_HOOK_SECRET"):
        verifier_for(source({"hmac": {**GITHUB, "previous_secret_env": "OLD_HOOK_SECRET"}}))
    monkeypatch.setenv("OLD_HOOK_SECRET", "")
    with pytest.raises(InvalidSecret, match="OLD_HOOK_SECRET is empty"):
        verifier_for(source({"hmac": {**GITHUB, "previous_secret_env": "OLD_HOOK_SECRET"}}))
    both = {"previous_secret_env": "A", "previous_secret_file": "B"}
    assert config_error({"hmac": {**GITHUB, **both}}) == (
        "test.toml: sources[0].verify.hmac: "
        "give at most one of previous_secret_env, previous_secret_file"
    )
