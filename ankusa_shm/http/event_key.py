"""Event keys: what makes two deliveries of one event the same hook, for dedupe.

A source names its key by preset, by header or by a dotted path into a JSON body; one
finder per source is built when a worker starts (``key_finder_for``). ``find`` never
raises: a hook whose key is missing or unreadable gets None -- no dedupe for that hook --
because refusing it would lose an event to protect against a duplicate. Keys are bounded
(``hooks.bounded_event_key``) before they leave here.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Protocol

from ankusa_shm import config
from ankusa_shm.hooks import bounded_event_key


class KeyFinder(Protocol):
    def find(self, headers: Mapping[str, str], body: bytes) -> bytes | None:
        """The hook's bounded event key, or None when it has none.

        ``headers`` have lower-case names, and values that are their bytes read as
        latin-1, as ``protocol`` decodes them."""
        ...


class HeaderKey:
    """The key is a header's value, without surrounding whitespace: the first of
    ``names`` the hook carries (a provider's newer id, then the one it sent before)."""

    __slots__ = ("_names",)

    def __init__(self, *names: str) -> None:
        self._names = tuple(n.lower() for n in names)

    def find(self, headers: Mapping[str, str], body: bytes) -> bytes | None:
        for name in self._names:
            value = headers.get(name)
            if value is not None and (value := value.strip()):
                return _as_sent(value)
        return None

    def __repr__(self) -> str:
        return f"HeaderKey({', '.join(map(repr, self._names))})"


class GitHubKey:
    """GitHub's delivery GUID names the event, and every webhook and App the event goes to
    gets the same one: keyed on it alone, the second webhook's hook would be taken for a
    duplicate of the first's. The webhook's id, which a redelivery also keeps, is put in
    front of it when the hook carries one."""

    __slots__ = ()

    def find(self, headers: Mapping[str, str], body: bytes) -> bytes | None:
        delivery = headers.get("x-github-delivery", "").strip()
        if not delivery:
            return None
        hook = headers.get("x-github-hook-id", "").strip()
        return _as_sent(f"{hook}:{delivery}" if hook else delivery)

    def __repr__(self) -> str:
        return "GitHubKey()"


class JsonPathKey:
    """The key is a string or an integer at a dotted path into a JSON object body.

    A segment of digits also indexes an array (``items.0.id``); on an object it is just
    a name. The body is parsed only for sources keyed this way."""

    __slots__ = ("_path", "_steps")

    def __init__(self, path: str) -> None:
        self._path = path
        self._steps = tuple(
            (name, int(name) if name.isascii() and name.isdigit() else -1)
            for name in path.split(".")
        )

    def find(self, headers: Mapping[str, str], body: bytes) -> bytes | None:
        try:
            node = json.loads(body)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, or nested too deep
            return None
        if not isinstance(node, dict):
            return None
        for name, index in self._steps:
            if isinstance(node, dict):
                node = node.get(name)
            elif isinstance(node, list) and 0 <= index < len(node):
                node = node[index]
            else:
                return None
        if isinstance(node, str):
            return _encode(node) if node else None
        if type(node) is int:  # not bool, which JSON's true and false also are
            return bounded_event_key(str(node).encode())
        return None

    def __repr__(self) -> str:
        return f"JsonPathKey({self._path!r})"


PRESETS: Mapping[config.DedupePreset, KeyFinder] = {
    "github": GitHubKey(),
    "standard_webhooks": HeaderKey("webhook-id"),
    "svix": HeaderKey("svix-id"),
    # The event's id, which Shopify names as the mark of a duplicate (one event sent to
    # several subscriptions, or sent again); its webhook id where it sends none.
    "shopify": HeaderKey("x-shopify-event-id", "x-shopify-webhook-id"),
    "stripe": JsonPathKey("id"),
}
"""Where each provider puts the id that stays the same when it delivers an event again."""


def key_finder_for(source: config.Source) -> KeyFinder | None:
    """The key finder of ``source``, or None when it has no dedupe spec."""
    d = source.dedupe
    if d is None:
        return None
    if d.preset:
        return PRESETS[d.preset]
    if d.header:
        return HeaderKey(d.header)
    return JsonPathKey(d.json_path)


def _as_sent(value: str) -> bytes:
    # A header's text is its bytes read as latin-1 (``protocol``): the same bytes back.
    return bounded_event_key(value.encode("latin-1"))


def _encode(text: str) -> bytes:
    # surrogatepass: any str has an encoding (a JSON "\ud800" escape included), and the
    # same text always the same one, which is all a dedupe key needs.
    return bounded_event_key(text.encode("utf-8", "surrogatepass"))
