"""The only place where server key names are built.

Every key of one store shares the hash tag ``{td_id}``, so that all of them live in one
Redis Cluster slot and every script and transaction over them stays legal::

    <prefix>:{<td_id>}:meta          hash: batch size, device, names, layout version, lock ...
                                     (a store being deleted holds "clearing" in place of "lv")
    <prefix>:{<td_id>}:reg           hash: one field per entry path -> JSON entry metadata
    <prefix>:{<td_id>}:wv            string: write version, bumped by every write (compare-and-set)
    <prefix>:{<td_id>}:ring          string: ring-buffer cursor, rows ever reserved by extend()
    <prefix>:{<td_id>}:rf            string: one byte per ring row, 1 once an append wrote it whole
    <prefix>:{<td_id>}:rif           hash: appends in flight, of earlier versions (the flags record them now)
    <prefix>:{<td_id>}:fence         string: bumped when a reservation in flight is taken over
    <prefix>:{<td_id>}:ac            hash: append counters, "a:<path>" per sub-store
    <prefix>:{<td_id>}:rl            hash: readers' leases on the layout (see tdstore/_backend/lease.py)
    <prefix>:{<td_id>}:pl            string: prioritized replay, one priority value per ring row
    <prefix>:{<td_id>}:pt            string: prioritized replay, the inner levels of the sum/min tree
    <prefix>:{<td_id>}:pg            string: prioritized replay, the generation of each ring row
    <prefix>:{<td_id>}:pm            string: prioritized replay, the max priority given so far
                                     (the four: lua/lib/prio.lua, tdstore/replay/priorities.py)
    <prefix>:{<td_id>}:d:<path>      string: the raw bytes of one entry
    <prefix>:{<td_id>}:c:<k>:<path>  string: chunk k of a chunked entry (see tdstore._core.chunks)
    <prefix>:{<td_id>}:tmp:<nonce>   string: bytes in flight inside one MULTI (never outlives it)

An entry path is the tuple of its nested keys. Each component is escaped (``%`` and ``.``
percent-encoded) and the components are joined with ``.``, so ``("a.b",)`` and
``("a", "b")`` never collide, and ``redis-cli`` still shows readable names.
"""

from __future__ import annotations

import re
import uuid
from typing import TYPE_CHECKING

from tdstore.errors import KeyTypeError  # defined there with the other errors; importable here too

if TYPE_CHECKING:
    from tdstore._core.chunks import Chunking

#: The largest ring cursor (rows ever reserved) tdstore accepts: lua/reserve.lua and
#: lua/ring_total.lua do their arithmetic in doubles, exact up to 2**53 only (a cursor of
#: 2**62 gave two appends the same rows). The scripts hold the same bound.
CURSOR_MAX = 2**52

__all__ = ["CURSOR_MAX", "StoreKeys", "as_path", "encode_path", "decode_path", "validate_prefix", "validate_td_id"]

_TD_ID_RE = re.compile(r"^[A-Za-z0-9_\-.:]{1,200}$")


_SURROGATE = re.compile("[\ud800-\udfff]")
_SURROGATE_ESCAPE = re.compile("%u([0-9A-F]{4})")


def _escape(component: str) -> str:
    out = component.replace("%", "%25").replace(".", "%2E")
    if not out.isascii():
        # a lone surrogate (which TensorDict accepts in a key) has no UTF-8 form: "%uD800"
        # (never written otherwise: every "%" of a key is written "%25")
        out = _SURROGATE.sub(lambda m: f"%u{ord(m.group()):04X}", out)
    return out


def _unescape(component: str) -> str:
    if "%u" in component:
        component = _SURROGATE_ESCAPE.sub(lambda m: chr(int(m.group(1), 16)), component)
    return component.replace("%2E", ".").replace("%25", "%")


def as_path(key: object) -> tuple[str, ...]:
    if isinstance(key, str):
        return (key,)
    if isinstance(key, tuple) and key and all(isinstance(k, str) for k in key):
        return key
    if isinstance(key, tuple) and key:
        out: list[str] = []
        for part in key:
            out.extend(as_path(part))
        return tuple(out)
    raise KeyTypeError(f"a key must be a str or a non-empty tuple of str, got {key!r}")


def encode_path(path: tuple[str, ...]) -> str:
    """Encodes a nested key (a tuple of str) as one registry field name."""
    return ".".join(_escape(part) for part in path)


def decode_path(field: str | bytes) -> tuple[str, ...]:
    """Inverse of :func:`encode_path`."""
    if isinstance(field, bytes):
        field = field.decode()
    return tuple(_unescape(part) for part in field.split("."))


def validate_prefix(prefix: str) -> str:
    """Checks that a key prefix keeps the store's hash tag the first one in every key."""
    if not isinstance(prefix, str):
        raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
    if "{" in prefix or "}" in prefix:
        raise ValueError(
            f"prefix {prefix!r} contains a brace: tdstore puts the td_id in braces as the "
            "Redis Cluster hash tag, and a brace in the prefix would take its place. "
            "Use a prefix without '{' and '}'."
        )
    return prefix


def validate_td_id(td_id: str) -> str:
    """Checks that a td_id is a non-empty string of safe characters."""
    if not isinstance(td_id, str) or not _TD_ID_RE.match(td_id):
        raise ValueError(
            f"td_id must be 1-200 characters among letters, digits, '_', '-', '.' and ':', "
            f"got {td_id!r}"
        )
    return td_id


def new_td_id() -> str:
    return str(uuid.uuid4())


class StoreKeys:
    """Builds the server keys of one store."""

    __slots__ = (
        "prefix", "td_id", "base", "meta", "reg", "wv", "ring", "rl", "flags", "inflight", "fence", "appends", "rate",
        "chunks", "prio_leaves", "prio_tree", "prio_gens", "prio_max",
    )

    def __init__(self, prefix: str, td_id: str) -> None:
        self.prefix = validate_prefix(prefix)
        self.td_id = validate_td_id(td_id)
        self.base = f"{prefix}:{{{td_id}}}"
        self.meta = f"{self.base}:meta"
        self.reg = f"{self.base}:reg"
        self.wv = f"{self.base}:wv"
        self.ring = f"{self.base}:ring"
        #: readers' leases on the layout (lua/lease.lua, tdstore/_backend/lease.py)
        self.rl = f"{self.base}:rl"
        #: the appends' keys (see tdstore/_backend/append.py)
        self.flags = f"{self.base}:rf"
        self.inflight = f"{self.base}:rif"
        self.fence = f"{self.base}:fence"
        self.appends = f"{self.base}:ac"
        #: the ring's rate limiter (lua/lib/rate.lua, tdstore/replay/rate_limit.py)
        self.rate = f"{self.base}:rate"
        #: prioritized replay (lua/lib/prio.lua): the leaves, the inner levels, the generations, the max priority
        self.prio_leaves = f"{self.base}:pl"
        self.prio_tree = f"{self.base}:pt"
        self.prio_gens = f"{self.base}:pg"
        self.prio_max = f"{self.base}:pm"
        #: the chunking of each chunked entry of the layout last cached (see tdstore._core.chunks);
        #: replaced as a whole with every new layout
        self.chunks: dict[tuple[str, ...], Chunking] = {}

    def replay_keys(self) -> list[str]:
        """The keys of prioritized replay, in the order of the ``prio_*`` scripts' KEYS."""
        return [self.prio_leaves, self.prio_tree, self.prio_gens, self.prio_max]

    def data(self, path: tuple[str, ...]) -> str:
        """The one string of an entry that is not chunked."""
        if path in self.chunks:
            raise RuntimeError(f"internal error: entry {path!r} of {self.base} is chunked; use entry_keys()")
        return self.plain(path)

    def plain(self, path: tuple[str, ...]) -> str:
        """The ``d:`` key of ``path``, whether or not the entry is chunked."""
        return f"{self.base}:d:{encode_path(path)}"

    def chunk(self, path: tuple[str, ...], k: int) -> str:
        """The key of chunk ``k`` of a chunked entry."""
        return f"{self.base}:c:{k}:{encode_path(path)}"

    def entry_keys(self, path: tuple[str, ...], chunking: Chunking | None) -> list[str]:
        """Every string holding the bytes of the entry at ``path``: its chunks in order, or its one key.

        ``chunking``: the entry's :class:`~tdstore._core.chunks.Chunking`, or None for one string
        (``self.chunks.get(path)`` for the layout last cached).
        """
        if chunking is None:
            return [self.plain(path)]
        return [self.chunk(path, k) for k in range(chunking.count)]

    def tmp(self) -> str:
        return f"{self.base}:tmp:{uuid.uuid4().hex}"

    def pattern(self) -> str:
        """A SCAN pattern matching every key of this store (glob characters escaped)."""
        escaped = re.sub(r"([*?\[\]\\])", r"\\\1", self.base)
        return f"{escaped}:*"

    @staticmethod
    def meta_pattern(prefix: str) -> str:
        """A SCAN pattern matching the meta key of every store under ``prefix``."""
        escaped = re.sub(r"([*?\[\]\\])", r"\\\1", prefix)
        return escaped + ":{*}:meta"

    @staticmethod
    def any_meta_pattern() -> str:
        """A SCAN pattern matching the meta key of every store, whatever its prefix."""
        return "*:{*}:meta"

    @staticmethod
    def parse_meta_key(key: str) -> tuple[str, str] | None:
        """(prefix, td_id) of a store's meta key, or None for a key that is not one.

        The prefix is what comes before the ``{td_id}`` hash tag (prefixes hold no braces); it may
        be empty.
        """
        brace, end = key.find(":{"), key.rfind("}:meta")
        if brace < 0 or end <= brace or not key.endswith("}:meta"):
            return None
        return key[:brace], key[brace + 2 : end]
