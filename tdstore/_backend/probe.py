"""What ``tdstore doctor`` asks a server: a few read-only commands, returned as plain facts.

:func:`probe_server` sends them (PING, INFO, two EVALs, CONFIG GET of each name asked, and
the timed PINGs) on one blocking connection and returns a :class:`ServerFacts`;
``tdstore/cli/doctor.py`` judges the facts and formats them, and sends nothing itself.
A refused command (an ACL user without ``@dangerous``, a managed service) is a fact too:
its field says None and, where it matters, why.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tdstore._backend.protocols import SyncClient

__all__ = ["ServerFacts", "probe_server", "DOCTOR_CONFIG"]

#: the CONFIG GET names tdstore doctor judges
DOCTOR_CONFIG = (
    "maxmemory-policy", "maxmemory", "proto-max-bulk-len", "client-query-buffer-limit", "save", "appendonly",
)

_SHEBANG_PROBE = "#!lua flags=no-writes\nreturn 1"


@dataclass
class ServerFacts:
    """What one server answered (decoded to str)."""

    #: INFO (every section); empty when refused
    info: dict[str, Any] = field(default_factory=dict)
    #: why INFO was refused (None: it answered)
    info_refused: str | None = None
    #: ``_VERSION`` of the server's Lua; None when EVAL is refused
    lua: str | None = None
    #: why EVAL was refused (None: scripts run)
    eval_refused: str | None = None
    #: whether the server takes script flags (``#!lua``); False when EVAL is refused
    script_flags: bool = False
    #: CONFIG GET of each name asked; None when refused or unknown to the server
    config: dict[str, str | None] = field(default_factory=dict)
    #: seconds each timed PING took
    ping_times: list[float] = field(default_factory=list)


def probe_server(
    redis_kwargs: dict[str, Any], *, pings: int = 20, config: Sequence[str] = DOCTOR_CONFIG
) -> ServerFacts:
    """Asks the server of ``redis_kwargs`` (``redis.Redis`` keywords) what ``tdstore doctor`` judges.

    Raises what redis-py raises when the server cannot be reached or refuses the
    credentials (the first PING); every later refusal is recorded in the facts.
    """
    import redis

    client = redis.Redis(**{**redis_kwargs, "decode_responses": True})
    try:
        return _probe(client, pings, config)
    finally:
        client.close()


def _probe(client: SyncClient, pings: int, config: Sequence[str]) -> ServerFacts:
    import redis.exceptions

    facts = ServerFacts()
    client.ping()
    try:
        facts.info = client.info()
    except redis.exceptions.ResponseError as err:  # e.g. an ACL user without @dangerous
        facts.info_refused = str(err)
    try:
        facts.lua = str(client.eval("return _VERSION", 0))
    except redis.exceptions.ResponseError as err:
        facts.eval_refused = str(err)
    if facts.eval_refused is None:
        try:
            facts.script_flags = client.eval(_SHEBANG_PROBE, 0) == 1
        except redis.exceptions.ResponseError:
            facts.script_flags = False
    for name in config:
        facts.config[name] = _config(client, name)
    for _ in range(max(1, pings)):
        start = time.perf_counter()
        client.ping()
        facts.ping_times.append(time.perf_counter() - start)
    return facts


def _config(client: SyncClient, name: str) -> str | None:
    """``CONFIG GET name``, or None when the server refuses CONFIG or does not know ``name``."""
    import redis.exceptions

    try:
        reply = client.config_get(name)
    except redis.exceptions.ResponseError:
        return None
    value = reply.get(name) if isinstance(reply, dict) else None
    return None if value is None else str(value)
