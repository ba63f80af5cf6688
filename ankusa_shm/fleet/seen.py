"""What a drainer last read of the fleet store: which server it was, and the value of
each epoch key there (``epoch``).

Kept in the segment's epoch blob, for the next drainer, and with a clean stop's mark in
the hook store (``store.settled``), for a drainer on a new segment. The server is what
tells a store this host delivered to from one it did not: a replica has the epoch values
of its primary, so they alone cannot.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Seen:
    server: str  # ``RedisStore.server``; "" where an older build kept none
    values: dict[str, str]  # each epoch key's value
    # A drainer began settling into a store the host had not settled into before, and the
    # promote of its window there is not done: the next check promotes it, whichever
    # store that drainer settles into (``epoch.Epoch.claim``).
    owed: bool = False

    def doc(self) -> dict[str, object]:
        return {"server": self.server, "values": self.values, "owed": self.owed}

    @classmethod
    def of(cls, doc: object) -> Seen:
        """From a ``doc``; an older build's is the values alone, and nothing is nothing."""
        if not isinstance(doc, dict):
            return cls("", {})
        values = doc.get("values")
        if isinstance(values, dict):
            values = {str(k): str(v) for k, v in values.items()}
            return cls(str(doc.get("server", "")), values, doc.get("owed") is True)
        return cls("", {str(k): str(v) for k, v in doc.items()})
