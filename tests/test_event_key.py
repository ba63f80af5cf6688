"""Event keys: found by preset, header or JSON path, bounded, and None -- never an
exception -- whenever a hook does not carry one."""

from __future__ import annotations

import hashlib
import json
import typing
from typing import Any

import pytest

from ankusa_shm import config
from ankusa_shm.config import ConfigError
from ankusa_shm.http.event_key import PRESETS, KeyFinder, key_finder_for


def as_wire(text: str) -> str:
    """``text`` sent in UTF-8, as the protocol hands a header's value on."""
    return text.encode().decode("latin-1")


def source(dedupe: dict[str, Any] | None) -> config.Source:
    spec: dict[str, Any] = {"id": "src", "tenant": "t"}
    if dedupe is not None:
        spec["dedupe"] = dedupe
    return config.parse({"sources": [spec]}, "test.toml").sources[0]


def finder(dedupe: dict[str, Any]) -> KeyFinder:
    f = key_finder_for(source(dedupe))
    assert f is not None
    return f


def test_no_dedupe_spec_no_finder() -> None:
    assert key_finder_for(source(None)) is None


@pytest.mark.parametrize(
    ("preset", "header"),
    [
        ("github", "x-github-delivery"),  # without the webhook's id: see below
        ("standard_webhooks", "webhook-id"),
        ("svix", "svix-id"),
        ("shopify", "x-shopify-event-id"),
        ("shopify", "x-shopify-webhook-id"),  # sent without an event id
    ],
)
def test_header_presets(preset: str, header: str) -> None:
    f = finder({"preset": preset})
    assert f.find({header: "72d3162e-cc78-11e3-81ab-4c9367dc0958"}, b"{}") == (
        b"72d3162e-cc78-11e3-81ab-4c9367dc0958"
    )
    assert f.find({"x-other": "1"}, b'{"id": "evt_1"}') is None


def test_shopify_keys_on_the_event_id_before_the_webhook_id() -> None:
    """Shopify's guide to duplicates names ``X-Shopify-Event-Id``: the same event sent to
    two subscriptions carries two webhook ids and one event id."""
    f = finder({"preset": "shopify"})
    one = {"x-shopify-event-id": "ev-42", "x-shopify-webhook-id": "wh-1"}
    two = {"x-shopify-event-id": "ev-42", "x-shopify-webhook-id": "wh-2"}
    assert f.find(one, b"{}") == f.find(two, b"{}") == b"ev-42"
    assert f.find({"x-shopify-event-id": " ", "x-shopify-webhook-id": "wh-1"}, b"{}") == b"wh-1"


def test_github_keys_on_the_webhook_and_the_delivery() -> None:
    """GitHub sends one event to each webhook and App under one delivery GUID, each with
    its own payload; a redelivery keeps both the GUID and the webhook's id."""
    f = finder({"preset": "github"})
    guid = "72d3162e-cc78-11e3-81ab-4c9367dc0958"
    one = {"x-github-delivery": guid, "x-github-hook-id": "101"}
    two = {"x-github-delivery": guid, "x-github-hook-id": "202"}
    assert f.find(one, b"{}") == f"101:{guid}".encode()
    assert f.find(two, b"{}") == f"202:{guid}".encode()
    assert f.find({"x-github-hook-id": "101"}, b"{}") is None


def test_stripe_preset_is_the_event_id_in_the_body() -> None:
    f = finder({"preset": "stripe"})
    body = b'{"id": "evt_1NG8Du2eZvKYlo2CUI79vXWy", "object": "event", "data": {"object": {}}}'
    assert f.find({}, body) == b"evt_1NG8Du2eZvKYlo2CUI79vXWy"
    assert f.find({"x-github-delivery": "d"}, b'{"object": "event"}') is None


def test_every_preset_the_config_accepts_has_a_finder() -> None:
    assert set(PRESETS) == set(typing.get_args(config.DedupePreset))


def test_header_key_is_stripped_and_empty_is_none() -> None:
    f = finder({"header": "X-Request-Key"})  # config names are matched lower-case
    assert f.find({"x-request-key": "  abc \t"}, b"") == b"abc"
    assert f.find({"x-request-key": "   "}, b"") is None
    assert f.find({"x-request-key": ""}, b"") is None
    assert f.find({}, b"") is None
    # Header text is its bytes read as latin-1 (as the protocol decodes it): the key is
    # those bytes, not their UTF-8 re-encoding, so 200 bytes sent stay 200 bytes.
    assert f.find({"x-request-key": as_wire("café")}, b"") == "café".encode()
    assert f.find({"x-request-key": as_wire("é" * 100)}, b"") == ("é" * 100).encode()


NESTED = {
    "id": "evt_top",
    "data": {"object": {"id": "pi_3MtwBw", "number": 1234567890123, "flag": True}},
    "items": [{"id": "first"}, {"id": 2}],
    "0": {"id": "a name, not an index"},
}


@pytest.mark.parametrize(
    ("path", "key"),
    [
        ("id", b"evt_top"),
        ("data.object.id", b"pi_3MtwBw"),
        ("data.object.number", b"1234567890123"),  # integers as their decimal text
        ("items.0.id", b"first"),
        ("items.1.id", b"2"),
        ("0.id", b"a name, not an index"),
        ("data.object.flag", None),  # a boolean is not a key
        ("data.object", None),  # nor an object
        ("items", None),  # nor an array
        ("data.object.missing", None),
        ("data.object.id.deeper", None),
        ("items.2.id", None),
        ("items.-1.id", None),
        ("items.first.id", None),
        ("missing.id", None),
    ],
)
def test_json_path(path: str, key: bytes | None) -> None:
    assert finder({"json_path": path}).find({}, json.dumps(NESTED).encode()) == key


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b'{"id": "evt_1"',  # cut short
        b"\xff\xfe\x00garbage",
        b'["evt_1"]',  # not an object
        b'"evt_1"',
        b"12",
        b"null",
        b'{"id": null}',
        b'{"id": 1.5}',
        b'{"id": ""}',
        b'{"id": ["evt_1"]}',
        b"[" * 100_000 + b"]" * 100_000,  # nested past the parser's recursion limit
        b'{"id": ' + b"9" * 5000 + b"}",  # past Python's int-from-text limit
    ],
)
def test_json_path_without_a_usable_key_is_none(body: bytes) -> None:
    assert finder({"json_path": "id"}).find({}, body) is None


def test_json_body_in_utf16_and_escaped_text() -> None:
    f = finder({"json_path": "id"})
    assert f.find({}, '{"id": "ключ"}'.encode("utf-16")) == "ключ".encode()
    assert f.find({}, b'{"id": "caf\\u00e9"}') == "café".encode()
    assert f.find({}, b'{"id": "\\ud800"}') is not None  # a lone surrogate still has a key


def test_long_keys_are_bounded() -> None:
    long = "k" * 201
    digest = b"sha256:" + hashlib.sha256(long.encode()).hexdigest().encode()
    assert finder({"header": "x-key"}).find({"x-key": long}, b"") == digest
    body = json.dumps({"id": long}).encode()
    assert finder({"json_path": "id"}).find({}, body) == digest
    exact = "k" * 200
    assert finder({"header": "x-key"}).find({"x-key": exact}, b"") == exact.encode()


@pytest.mark.parametrize(
    ("dedupe", "key"),
    [
        ({"preset": "gitlab"}, "sources[0].dedupe.preset: must be 'github' or"),
        ({"json_path": "data..id"}, "sources[0].dedupe.json_path: 'data..id' is not a dotted"),
        ({"json_path": ".id"}, "sources[0].dedupe.json_path: "),
        ({"header": "x key"}, "sources[0].dedupe.header: 'x key' is not a header name"),
        ({"preset": "github", "header": "x-key"}, "sources[0].dedupe: give exactly one of"),
        ({"ttl_seconds": 60}, "sources[0].dedupe: give exactly one of"),
    ],
)
def test_config_errors_name_the_key(dedupe: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError) as e:
        source(dedupe)
    assert str(e.value).startswith(f"test.toml: {key}"), str(e.value)


def test_unknown_preset_error_lists_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as e:
        source({"preset": "standard-webhooks"})
    for name in typing.get_args(config.DedupePreset):
        assert repr(name) in str(e.value)
