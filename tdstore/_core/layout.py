"""The store's metadata as read from the server: a :class:`Layout` snapshot of the meta hash and
the registry, and the parsing of the raw HGETALL replies into one (pure: no I/O).

The server operations that read them live in :mod:`tdstore._backend.ops`.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple, TypeGuard, TypeVar, cast

from tdstore._core.chunks import MAX_CHUNKS, Chunking
from tdstore._core.keys import decode_path
from tdstore.errors import CorruptMetadataError

_T = TypeVar("_T")

__all__ = [
    "Arg", "Command", "Entry", "Kind", "KINDS", "Layout", "SCRIPT_META_FIELDS", "registry_lost", "parse_layout", "parse_entry",
    "is_dims", "is_names", "MAX_DIMS", "MAX_DIM", "MAX_ENTRY_BYTES", "NONTENSOR_ENCODINGS", "DTYPE_ITEMSIZE", "Op", "ZeroBytes", "byte_view",
]

#: The kinds of registry entries: tensor, non-tensor and nested tensordict of a dense store;
#: tensor leaf and non-tensor leaf of a lazy store (whose nested nodes are "td" too).
Kind = Literal["t", "nt", "td", "lt", "lnt"]
KINDS: tuple[Kind, ...] = ("t", "nt", "td", "lt", "lnt")

#: One argument of a command as tdstore sends it (redis-py sends an int or float as its text).
Arg = str | bytes | memoryview | int | float
#: One command: its name and arguments, as ``execute_command(*command)`` takes them.
Command = tuple[Arg, ...]


class PackedCommand(tuple[Arg, ...]):
    """A :data:`Command` that carries its RESP encoding too (``resp``), made where a command
    of many small arguments is built anyway: tdstore's packer
    (:func:`tdstore._backend.wire.packed`) sends ``resp`` as it is, and redis-py's packs the
    arguments as for any command."""

    resp: bytes

    def __new__(cls, args: tuple[Arg, ...], resp: bytes) -> PackedCommand:
        made = super().__new__(cls, args)
        made.resp = resp
        return made

#: The most dims a shape or batch size read from the server may have.
MAX_DIMS = 64
#: The largest dim read from the server (a larger one is damage, not data).
MAX_DIM = 2**62
#: The most bytes a tensor entry read from the server may have (2**48: 256 TiB).
MAX_ENTRY_BYTES = 2**48
#: The encodings of non-tensor entries.
NONTENSOR_ENCODINGS = ("json", "pickle")
#: The bytes per element of every dtype tdstore stores, by the name written on the server
#: (:mod:`tdstore._core.codec` maps the names this torch knows to torch dtypes). Known here
#: without torch, so that the command line parses a registry without importing it.
DTYPE_ITEMSIZE: dict[str, int] = {
    "bool": 1, "uint8": 1, "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint16": 2, "uint32": 4, "uint64": 8,
    "float16": 2, "bfloat16": 2, "float32": 4, "float64": 8, "complex32": 4, "complex64": 8, "complex128": 16,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1, "float8_e8m0fnu": 1,
}  # fmt: skip


def is_dims(value: object) -> TypeGuard[list[int]]:
    """Whether ``value`` is a plausible shape or batch size: a list of at most
    :data:`MAX_DIMS` non-negative ints (booleans are not ints here) below :data:`MAX_DIM`."""
    return (
        isinstance(value, list)
        and len(value) <= MAX_DIMS
        and all(type(d) is int and 0 <= d <= MAX_DIM for d in value)
    )


def is_names(value: object, ndim: int) -> bool:
    """Whether ``value`` is a plausible list of ``ndim`` dim names (or None: no names)."""
    return value is None or (
        isinstance(value, (list, tuple)) and len(value) == ndim and all(n is None or isinstance(n, str) for n in value)
    )


def _dims(value: Iterable[int] | None) -> tuple[int, ...] | None:
    return None if value is None else tuple(value)


class Entry(NamedTuple):
    """One registry entry: what the JSON object of its registry field says, validated.

    Immutable (a NamedTuple: cheaper to build than a frozen dataclass, and a layout builds one
    per entry each time it is read); ``entry._replace(...)`` makes a changed copy.

    The wire format (one JSON object per entry path; field names are known only to
    :meth:`from_json` and :meth:`to_json`):

    * tensor (``"t"``): ``{"k": "t", "dtype": "float32", "shape": [...], "o": [lv, i]}``, plus
      ``"c"``: the chunk size in bytes when the entry is kept as several strings
      (:mod:`tdstore._core.chunks`);
    * nested tensordict (``"td"``): ``{"k": "td", "batch_size": [...], "names": [...] | null, "o": ...}``;
    * non-tensor (``"nt"``): ``{"k": "nt", "enc": "json" | "pickle", "stack": ndim, "o": ...}``:
      ``stack`` 0 is one value for the whole batch, ``k > 0`` a stack over the first ``k`` dims;
    * lazy tensor leaf (``"lt"``): ``{"k": "lt", "dtype": ..., "shape": [...], "o": ...}``, or
      ``"shapes": [[...], ...]`` (one shape per element) in place of ``"shape"`` when ragged;
    * lazy non-tensor leaf (``"lnt"``): ``{"k": "lnt", "enc": ..., "o": ...}``.

    ``o`` (``order``) orders the keys as they were inserted: a registry hash does not keep order.
    """

    kind: Kind
    order: tuple[int, ...] | None = None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    shapes: tuple[tuple[int, ...], ...] | None = None
    chunk: int | None = None
    batch_size: tuple[int, ...] | None = None
    names: tuple[str | None, ...] | None = None
    enc: str | None = None
    stack: int = 0

    # ------------------------------------------------------------------ constructors
    @classmethod
    def tensor(cls, dtype: str, shape: Iterable[int], order: Iterable[int] | None, chunk: int | None = None) -> Entry:
        return cls("t", _dims(order), dtype=dtype, shape=tuple(shape), chunk=chunk)

    @classmethod
    def node(cls, batch_size: Iterable[int], names: Iterable[str | None] | None, order: Iterable[int] | None) -> Entry:
        return cls("td", _dims(order), batch_size=tuple(batch_size), names=None if names is None else tuple(names))

    @classmethod
    def non_tensor(cls, enc: str, stack: int, order: Iterable[int] | None) -> Entry:
        return cls("nt", _dims(order), enc=enc, stack=stack)

    # ------------------------------------------------------------------ what callers ask
    @property
    def is_node(self) -> bool:
        """A nested tensordict: no data string of its own."""
        return self.kind == "td"

    @property
    def has_data(self) -> bool:
        """Has data strings (every kind but a nested tensordict)."""
        return self.kind != "td"

    @property
    def is_tensor(self) -> bool:
        """A tensor entry of a dense store."""
        return self.kind == "t"

    @property
    def is_non_tensor(self) -> bool:
        """A non-tensor entry of a dense store."""
        return self.kind == "nt"

    @property
    def is_ragged(self) -> bool:
        """A lazy tensor leaf whose elements differ in shape (one shape per element)."""
        return self.kind == "lt" and self.shape is None

    @property
    def dim_names(self) -> list[str | None] | None:
        """The dim names of a nested tensordict, as TensorDict gives them (a list, or None)."""
        return None if self.names is None else list(self.names)

    @property
    def itemsize(self) -> int:
        """The bytes per element of a tensor entry."""
        assert self.dtype is not None, self
        return DTYPE_ITEMSIZE[self.dtype]

    @property
    def nbytes(self) -> int:
        """The bytes of a tensor entry of one shape."""
        assert self.shape is not None, self
        return math.prod(self.shape) * self.itemsize

    @property
    def chunking(self) -> Chunking | None:
        """How a chunked tensor entry is split into strings (None: one string)."""
        if self.chunk is None or self.kind != "t":
            return None
        return Chunking(self.chunk, self.nbytes)

    @property
    def order_key(self) -> tuple[int, ...]:
        """Sorts entries in insertion order (entries without one first)."""
        return self.order or (0, 0)

    # ------------------------------------------------------------------ the wire format
    def to_wire(self) -> dict[str, object]:
        """The JSON object of the registry field (the fields in the order they were always written)."""
        out: dict[str, object] = {"k": self.kind}
        if self.kind in ("t", "lt"):
            out["dtype"] = self.dtype
            if self.shapes is not None:
                out["shapes"] = [list(s) for s in self.shapes]
            else:
                out["shape"] = _list(self.shape)
        elif self.kind == "td":
            out["batch_size"] = _list(self.batch_size)
            out["names"] = _list(self.names)
        else:
            out["enc"] = self.enc
            if self.kind == "nt":
                out["stack"] = self.stack
        out["o"] = _list(self.order)
        if self.chunk is not None:
            out["c"] = self.chunk
        return out

    def to_json(self) -> str:
        """The registry field's value, as written to the server."""
        return json.dumps(self.to_wire(), separators=(",", ":"))

    @classmethod
    def from_json(cls, path: tuple[str, ...], raw: object, where: str = "the store") -> Entry:
        """Parses and validates a registry field's value (bytes, a str, or an already decoded
        JSON object). Raises :class:`~tdstore.errors.CorruptMetadataError` naming the entry,
        the store (``where``) and the field, for every value a hand edit (or damage) may leave:
        JSON that does not parse, wrong JSON types, booleans or floats or negative or huge
        dims, an unknown dtype or encoding, a chunking of implausibly many strings."""
        if isinstance(raw, (bytes, bytearray, str)):
            try:
                meta = json.loads(raw)
            except (ValueError, RecursionError, TypeError):  # UnicodeDecodeError is a ValueError
                raise CorruptMetadataError(
                    f"entry {path!r} of the store {where} has registry metadata that is not JSON: {raw!r:.200}"
                ) from None
        else:
            meta = raw

        def bad(what: str) -> CorruptMetadataError:
            return CorruptMetadataError(f"entry {path!r} of {where} {what}")

        if not isinstance(meta, Mapping) or meta.get("k") not in KINDS:
            raise bad(f"has malformed metadata {meta!r:.200}")
        kind = meta["k"]
        order = meta.get("o")
        if order is not None and not (isinstance(order, list) and all(type(x) is int for x in order)):
            raise bad(f"has a malformed field 'o' (insertion order) {order!r:.200}")
        if kind in ("t", "lt"):
            dtype = meta.get("dtype", "")
            itemsize = DTYPE_ITEMSIZE.get(dtype) if isinstance(dtype, str) else None
            if itemsize is None:
                raise CorruptMetadataError(
                    f"entry {path!r} of {where}: field 'dtype': unknown dtype {dtype!r:.50} in the store's "
                    f"metadata (tdstore stores {', '.join(DTYPE_ITEMSIZE)})"
                )
            shapes = None
            if kind == "lt" and "shape" not in meta:
                raw_shapes = meta.get("shapes")
                if not isinstance(raw_shapes, list) or not all(is_dims(s) for s in raw_shapes):
                    raise bad(f"has a malformed field 'shapes' (one shape per element) {raw_shapes!r:.200}")
                shapes = tuple(tuple(s) for s in raw_shapes)
                shape = None
            else:
                shape = meta.get("shape")
                if not is_dims(shape):
                    raise bad(f"has a malformed shape {shape!r:.200}")
                nbytes = math.prod(shape) * itemsize
                if nbytes > MAX_ENTRY_BYTES:
                    raise bad(f"has a shape {shape} of {nbytes} bytes, more than any server holds")
            chunk = meta.get("c") if kind == "t" else None
            if chunk is not None:
                if not (type(chunk) is int and chunk > 0 and chunk % itemsize == 0):
                    raise bad(f"has a malformed chunk size (field 'c') {chunk!r:.200}")
                if -(-nbytes // chunk) > MAX_CHUNKS:
                    raise CorruptMetadataError(
                        f"entry {path!r} of {where}: its chunk size (field 'c') {chunk} and shape {shape} make "
                        f"{-(-nbytes // chunk)} strings, more than the {MAX_CHUNKS} an entry may have"
                    )
            return cls(kind, _dims(order), dtype=dtype, shape=_dims(shape), shapes=shapes, chunk=chunk)
        if kind == "td":
            bs = meta.get("batch_size")
            if not is_dims(bs):
                raise CorruptMetadataError(f"nested entry {path!r} of {where} has a malformed batch size {bs!r:.200}")
            names = meta.get("names")
            if not is_names(names, len(bs)):
                raise CorruptMetadataError(f"nested entry {path!r} of {where} has malformed names {names!r:.200}")
            return cls(kind, _dims(order), batch_size=tuple(bs), names=None if names is None else tuple(names))
        enc = meta.get("enc")
        if enc not in NONTENSOR_ENCODINGS:
            raise CorruptMetadataError(
                f"non-tensor entry {path!r} of {where} has an unknown encoding (field 'enc') {enc!r:.200}"
            )
        stack = meta.get("stack", 0) if kind == "nt" else 0
        if not (type(stack) is int and 0 <= stack <= MAX_DIMS):
            raise CorruptMetadataError(f"non-tensor entry {path!r} of {where} has a malformed field 'stack' {stack!r:.200}")
        return cls(kind, _dims(order), enc=enc, stack=stack)


def _list(value: tuple[_T, ...] | None) -> list[_T] | None:
    return None if value is None else list(value)


@dataclass
class Layout:
    """A consistent snapshot of a store's metadata, at layout version ``lv``."""

    lv: int
    meta: dict[str, str]
    entries: dict[tuple[str, ...], Entry]
    wv: str = "0"  #: the write version, when read with the snapshot
    #: values derived from this snapshot (sorted key lists, parsed batch sizes), computed
    #: once per layout: a layout is never changed in place, a new one replaces it
    memo: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def batch_size(self) -> list[int]:
        """The store's batch size: the meta field ``batch_size`` (a JSON list; ``[]`` when
        absent), parsed once per layout. Validated by the store class (``_check_layout``);
        JSON that does not parse raises ``ValueError``."""
        value = self.memo.get("batch_size")
        if value is None:
            raw = self.meta.get("batch_size") or "[]"
            try:
                value = json.loads(raw)
            except RecursionError:  # (nested too deep for the parser: damage, as bad JSON is)
                raise ValueError(f"batch size nested too deep to parse: {raw!r:.100}") from None
            self.memo["batch_size"] = value
        return cast("list[int]", value)


#: Meta hash fields that only the scripts write (commit.lua refuses them as metadata updates).
SCRIPT_META_FIELDS = frozenset({"lv", "fmt", "lock", "ne", "exp", "ttl"})


def registry_lost(layout: Layout) -> bool:
    """True when the meta hash counts more registry fields than the registry holds.

    A hash is evicted (or deleted by hand) as a whole, so an entry count kept in the meta
    hash (``ne``, maintained by every step that adds or removes a registry field) tells a
    store with no entries from one whose registry is gone. Stores written before the count
    existed have no ``ne`` and are never reported.
    """
    count = layout.meta.get("ne")
    return count is not None and count.isdigit() and int(count) != len(layout.entries)


def _s(value: bytes | str | None) -> str | None:
    if value is None:
        return None
    return value.decode() if isinstance(value, bytes) else value


#: Registry entries already parsed, by their raw field and value: every read of a layout parses
#: the whole registry, which rarely changes (3-4 us an entry to validate). Entries are
#: immutable, so every layout may share them; only valid ones are kept.
_PARSED: dict[tuple[bytes | str, bytes | str], tuple[tuple[str, ...], Entry]] = {}
_PARSED_MAX = 8192


def parse_layout(
    meta_raw: Mapping[bytes | str, bytes | str] | Exception | None,
    reg_raw: Mapping[bytes | str, bytes | str] | Exception,
    base: str = "the store",
) -> Layout | None:
    """Builds a :class:`Layout` from the raw HGETALL replies of meta and registry.

    Damaged data (a key of the wrong type, bytes that are not UTF-8, a registry value that
    is not JSON, JSON nested too deep, a layout version that is not a number) raises
    :class:`~tdstore.errors.CorruptMetadataError` naming the store (``base``) and the field;
    so does an entry with a damaged field (:meth:`Entry.from_json`). What depends on the kind
    of store (its entry kinds, the tree of entries) is checked by the store class (``_check_layout``).
    """
    if isinstance(meta_raw, Exception) or isinstance(reg_raw, Exception):
        which, err = ("meta", meta_raw) if isinstance(meta_raw, Exception) else ("reg", reg_raw)
        raise CorruptMetadataError(f"the {which} key of the store {base} cannot be read as a hash: {err}")
    if not meta_raw:
        return None
    try:
        meta = {_s(k): _s(v) for k, v in meta_raw.items()}
    except UnicodeDecodeError:
        raise CorruptMetadataError(f"the meta hash of the store {base} holds bytes that are not UTF-8") from None
    if "clearing" in meta and "lv" not in meta:
        return None  # sealed by a clear_redis() (lua/clear.lua): deleted for every reader
    entries: dict[tuple[str, ...], Entry] = {}
    for k, v in reg_raw.items():
        try:
            hit = _PARSED.get((k, v))
        except TypeError:  # not a RESP string: parse_entry says what it is
            hit = None
        if hit is not None:
            entries[hit[0]] = hit[1]
            continue
        try:
            path = decode_path(k)
        except (UnicodeDecodeError, ValueError):
            raise CorruptMetadataError(f"the registry of the store {base} has a malformed field name {k!r:.200}") from None
        entry = entries[path] = parse_entry(path, v, base)
        if isinstance(k, (bytes, str)) and isinstance(v, (bytes, str)):
            if len(_PARSED) >= _PARSED_MAX:
                _PARSED.clear()
            _PARSED[(k, v)] = (path, entry)
    lv = parse_lv(meta.get("lv", "0"), base)
    assert lv is not None
    return Layout(lv, meta, entries)  # type: ignore[arg-type]


def counter_damage(raw: object, key: str, what: str = "the write version") -> CorruptMetadataError | None:
    """None when ``raw`` (a GET reply) is no value or a decimal counter INCR can bump (what
    lib/common.lua's check_counter accepts), else the error naming ``key``."""
    if raw is None:
        return None
    text = raw.encode("utf-8", "surrogateescape") if isinstance(raw, str) else raw
    if isinstance(text, bytes) and len(text) <= 18 and re.fullmatch(rb"-?[0-9]+", text):
        return None
    shown = raw if not isinstance(raw, Exception) else f"a value of another type ({raw})"
    return CorruptMetadataError(f"{what} {key} holds {shown!r:.100}, not a counter")


def data_key_commands(data_keys: list[str]) -> list[Command]:
    """The reads that check the data keys a MULTI is about to SETRANGE, sent before it (in the
    packet of its WATCH): a STRLEN per key (an error reply for a key of another type) and one
    EXISTS of them all. A MULTI is not rolled back: a SETRANGE refused at a key of another type
    would leave the step's other commands applied. :func:`data_key_damage` reads the replies."""
    if not data_keys:
        return []
    return [*(("STRLEN", key) for key in data_keys), ("EXISTS", *data_keys)]


def data_key_damage(data_keys: list[str], replies: Sequence[object], base: str) -> tuple[CorruptMetadataError | None, bool]:
    """(the error for a data key holding another type of value, or None; whether every data
    key exists) from the replies of :func:`data_key_commands`."""
    if not data_keys:
        return None, True
    for key, reply in zip(data_keys, replies, strict=False):
        if isinstance(reply, Exception):
            return CorruptMetadataError(
                f"the data key {key} of the store {base} holds a value of another type ({reply}), not an "
                "entry's bytes: damaged or written by hand? Nothing was written; `tdstore rm` deletes the store"
            ), False
    exists = replies[len(data_keys)] if len(replies) > len(data_keys) else None
    return None, exists == len(data_keys)


def parse_lv(raw: object, base: str = "the store") -> int | None:
    """The layout version of a meta hash's ``lv`` field as read (bytes, str or None: no store);
    anything but a decimal count (empty, garbage, an error reply) raises
    :class:`~tdstore.errors.CorruptMetadataError` naming the store."""
    if raw is None:
        return None
    text = raw.decode("ascii", errors="replace") if isinstance(raw, bytes) else raw
    if not isinstance(text, str) or not (text.isascii() and text.isdigit()):
        raise CorruptMetadataError(f"the store {base} has a malformed layout version (meta field 'lv') {raw!r:.200}")
    return int(text)


def parse_entry(path: tuple[str, ...], raw: object, base: str = "the store") -> Entry:
    """One registry value, parsed and validated (:meth:`Entry.from_json`), or
    :class:`~tdstore.errors.CorruptMetadataError` naming the entry and the field."""
    return Entry.from_json(path, raw, base)


@dataclass
class Op:
    """One change applied by the commit script (see lua/commit.lua)."""

    op: str
    path: tuple[str, ...]
    meta: Entry | None = None
    payload: Any = None  # bytes-like for "put"
    nbytes: int | None = None  # for "zero"
    new_path: tuple[str, ...] | None = None  # for "move"
    has_data: bool = True  # "del"/"move": whether the entry has a data key
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class ZeroBytes:
    """The payload of a zero-filled entry (or chunk) grown on the server in a tmp key: ``n`` zero bytes."""

    n: int


def byte_view(payload: bytes | bytearray | memoryview) -> memoryview:
    """A flat byte view of a bytes-like payload (no copy)."""
    view = memoryview(payload)
    if view.ndim != 1 or view.format != "B":
        view = view.cast("B")
    return view
