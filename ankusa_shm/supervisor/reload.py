"""What a HUP reads: the new config, as this running service can apply it.

A reload replaces the workers one at a time, each new one serving before an old one
stops, so a worker that cannot start on the new config leaves the old one serving. The
admin process and the drainer are replaced the other way round, the old one gone before
the new one starts (one writer of the overrides, one consumer of the settle queue), so
what they need is read here first: a config they could not start on is refused, and the
running one keeps serving. What only a restart can change is carried over, and said.
"""

from __future__ import annotations

import dataclasses
import logging

from ankusa_shm import config, credentials, fds
from ankusa_shm.config import Config

log = logging.getLogger("ankusa_shm.supervisor")


def read(path: str, running: Config, ring: int) -> Config | None:
    """The config at ``path``, with what a restart alone can change kept from ``running``;
    None, said in the log, if it cannot be applied. ``ring``: the settle queue's capacity,
    made at start."""
    try:
        new = config.load(path)
    except config.ConfigError as e:
        log.error("HUP: %s; the running configuration keeps serving", e)
        return None
    new = keep_restart_only(running, new)
    if new.settle_capacity > ring:  # a fleet scope on a service started without one
        log.warning(
            "HUP: a fleet scope on a service started without one: its settle queue holds "
            "%d operations until the next restart gives it fleet.settle_queue_size (%d); "
            "what it drops meanwhile is promoted again from the store",
            ring,
            new.settle_capacity,
        )
    try:  # e.g. a token dropped while the kept admin address is not loopback
        config.check(new)
    except config.ConfigError as e:
        log.error(
            "HUP: %s (with the settings kept until a restart); the running "
            "configuration keeps serving",
            e,
        )
        return None
    if problems := credentials.unreadable(new):
        log.error("HUP: %s; the running configuration keeps serving", "; ".join(problems))
        return None
    fds.say_if_short(new.server.max_connections)
    if not new.sources:  # valid, and surely not meant (check-config says the same)
        log.warning("HUP: no [[sources]] in %s: every hook will be answered 404", path)
    return new


def keep_restart_only(old: Config, new: Config) -> Config:
    """What a running service cannot change -- the segment and its sizes, the listening
    addresses, the store's file -- is carried over from ``old``, with a warning naming it.
    (Workers replaced one at a time would write two stores at once, the admin process read
    only the new one, and its cursors start again at 1.)"""
    server = dataclasses.replace(
        new.server,
        segment=old.server.segment,
        listen=old.server.listen,
        admin_listen=old.server.admin_listen,
    )
    fleet = dataclasses.replace(new.fleet, settle_queue_size=old.fleet.settle_queue_size)
    store = dataclasses.replace(new.store, path=old.store.path)
    for name, before, after in (
        ("server.segment", old.server.segment, new.server.segment),
        ("server.listen", old.server.listen, new.server.listen),
        ("server.admin_listen", old.server.admin_listen, new.server.admin_listen),
        ("fleet.settle_queue_size", old.fleet.settle_queue_size, new.fleet.settle_queue_size),
        ("store.path", old.store.file, new.store.file),
    ):
        if before != after:
            log.warning("HUP: %s changed; it takes effect at the next restart", name)
    return dataclasses.replace(new, server=server, fleet=fleet, store=store)
