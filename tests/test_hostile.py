"""Hostile or damaged server data: a store whose metadata or bytes were edited by hand.

Every read of such a store raises :class:`CorruptMetadataError` naming the key and the
field (or :class:`DataLostError` where bytes are gone); none leaks a raw JSONDecodeError,
ValueError, TypeError, AttributeError or RecursionError, none allocates without bound
(checked with tracemalloc), none runs long, none returns an invalid TensorDict. And
``clear_redis()`` deletes the damaged store all the same.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
import tracemalloc

import pytest
import torch
from tensordict import TensorDict

from tdstore import TensorDictStore
from tdstore.errors import CorruptMetadataError, DataLostError, FormatVersionError, TDStoreError

#: what a read of a damaged store may raise
OK_ERRORS = (CorruptMetadataError, DataLostError)
#: the most memory one read of the damaged 4x4 store may take (bytes, Python allocations)
MEM_BOUND = 64 * 2**20
#: the longest one read may take (seconds)
TIME_BOUND = 10.0


def _reg(name, value):
    """Replaces registry field ``name`` with the raw string ``value``."""

    def edit(r, base):
        if r.hset(f"{base}:reg", name, value):
            r.hincrby(f"{base}:meta", "ne", 1)  # a new field: counted, as the scripts do

    return edit


def _entry(name, **changes):
    """Changes fields of one registry entry (a value of ``...`` deletes the field)."""

    def edit(r, base):
        meta = json.loads(r.hget(f"{base}:reg", name))
        for k, v in changes.items():
            if v is ...:
                meta.pop(k, None)
            else:
                meta[k] = v
        r.hset(f"{base}:reg", name, json.dumps(meta))

    return edit


def _meta(field, value):
    def edit(r, base):
        r.hset(f"{base}:meta", field, value)

    return edit


def _data(name, fn):
    def edit(r, base):
        key = f"{base}:d:{name}"
        new = fn(r.get(key))
        if new is None:
            r.delete(key)
        else:
            r.set(key, new)

    return edit


def _wrong_type(suffix):
    def edit(r, base):
        r.delete(f"{base}:{suffix}")
        r.rpush(f"{base}:{suffix}", b"x")

    return edit


DEEP = "[" * 100_000 + "]" * 100_000

CASES = {
    # tensor entry "x": shape
    "shape-bool": _entry("x", shape=[4, True, 4]),
    "shape-float": _entry("x", shape=[4.0, 4]),
    "shape-negative": _entry("x", shape=[-4, -4]),
    "shape-huge": _entry("x", shape=[4, 10**11]),
    "shape-huge-product": _entry("x", shape=[4] + [10**6] * 8),
    "shape-string": _entry("x", shape="4,4"),
    "shape-missing": _entry("x", shape=...),
    "shape-too-many-dims": _entry("x", shape=[4] + [1] * 200),
    "shape-nested-list": _entry("x", shape=[[4], [4]]),
    "shape-batch-mismatch": _entry("x", shape=[3, 4]),
    # tensor entry "x": dtype, kind, chunks, order
    "dtype-unknown": _entry("x", dtype="float99"),
    "dtype-number": _entry("x", dtype=5),
    "dtype-missing": _entry("x", dtype=...),
    "kind-unknown": _entry("x", k="zz"),
    "kind-missing": _entry("x", k=...),
    "chunk-zero": _entry("x", c=0),
    "chunk-negative": _entry("x", c=-16),
    "chunk-misaligned": _entry("x", c=3),
    "chunk-string": _entry("x", c="16"),
    "chunk-bool": _entry("x", c=True),
    "chunk-bomb": _entry("x", c=4, shape=[4, 10**11]),
    "order-string": _entry("x", o="x"),
    "order-dict": _entry("x", o={"a": 1}),
    # registry field values that are not entry objects
    "json-invalid": _reg("x", "{not json"),
    "json-list": _reg("x", "[1, 2]"),
    "json-string": _reg("x", '"t"'),
    "json-null": _reg("x", "null"),
    "json-number": _reg("x", "12"),
    "json-recursive": _reg("x", DEEP),
    "json-not-utf8": _reg("x", b"\xff\xfe"),
    "field-not-utf8": _reg(b"\xff", '{"k":"t","dtype":"float32","shape":[4],"o":[1,9]}'),
    "orphan-entry": _reg("q.z", '{"k":"t","dtype":"float32","shape":[4],"o":[1,9]}'),
    "child-of-tensor": _reg("x.z", '{"k":"t","dtype":"float32","shape":[4],"o":[1,9]}'),
    # non-tensor entry "nt"
    "nt-enc-unknown": _entry("nt", enc="zzz"),
    "nt-stack-string": _entry("nt", stack="x"),
    "nt-stack-huge": _entry("nt", stack=10**9),
    "nt-bad-json": _data("nt", lambda b: b"{not json"),
    "nt-bytes-gone": _data("nt", lambda b: None),
    # nested entry "n"
    "node-bs-bool": _entry("n", batch_size=[True]),
    "node-bs-negative": _entry("n", batch_size=[-4]),
    "node-bs-mismatch": _entry("n", batch_size=[5]),
    "node-bs-huge": _entry("n", batch_size=[4, 10**12]),
    "node-names-number": _entry("n", names=5),
    # the meta hash
    "meta-bs-8": _meta("batch_size", "[8]"),
    "meta-bs-negative": _meta("batch_size", "[-4]"),
    "meta-bs-huge": _meta("batch_size", "[1000000000000]"),
    "meta-bs-bool": _meta("batch_size", "[true]"),
    "meta-bs-float": _meta("batch_size", "[4.0]"),
    "meta-bs-invalid": _meta("batch_size", "[4"),
    "meta-bs-object": _meta("batch_size", '{"a": 4}'),
    "meta-bs-recursive": _meta("batch_size", DEEP),
    "meta-names-invalid": _meta("names", "nope"),
    "meta-names-length": _meta("names", '["a", "b", "c"]'),
    "meta-names-type": _meta("names", "[5]"),
    "meta-device-bogus": _meta("device", "bogus:3"),
    "meta-lv-text": _meta("lv", "abc"),
    "meta-cb-text": _meta("cb", "abc"),
    # the bytes
    "data-short": _data("x", lambda b: b[:-4]),
    "data-long": _data("x", lambda b: b + b"\0\0\0\0"),
    "data-gone": _data("x", lambda b: None),
    "data-nested-gone": _data("n.y", lambda b: None),
    # keys of the wrong type
    "registry-wrong-type": _wrong_type("reg"),
    "data-wrong-type": _wrong_type("d:x"),  # a data key holding a list (issue 24, N7)
    "nt-data-wrong-type": _wrong_type("d:nt"),
    "meta-tensorclass-garbage": _meta("tensorclass", "os.path:nope"),  # imports nothing it names
    "meta-tensorclass-module": _meta("tensorclass", "no_such_module_tds.X"),
    "meta-wrong-type": _wrong_type("meta"),
}

#: cases in which the store still reads (the damage is not in what the reads use)
READS_FINE: set[str] = set()


def _td() -> TensorDict:
    """The content of the store each test damages (made with ``stores(server, "from_tensordict", _td())``)."""
    return TensorDict(
        {"x": torch.arange(16.0).reshape(4, 4), "nt": "hello", "n": TensorDict({"y": torch.ones(4, 2)}, [4])}, [4]
    )


def _reads(store_factory):
    """Each read a user may make of the store: name -> thunk (each on a fresh handle, whose
    opening is part of the read)."""
    return {
        "to_tensordict": lambda: store_factory().to_tensordict(),
        "len": lambda: len(store_factory()),
        "keys": lambda: list(store_factory().keys(include_nested=True)),
        "x": lambda: store_factory()["x"],
        "index": lambda: store_factory()[1].to_dict(),
        "slice": lambda: store_factory()[1:3].to_dict(),
    }


def _bounded(thunk):
    """Runs ``thunk``: its result or exception, checked to stay within time (and within
    memory, when run inside :func:`_traced`)."""
    t0 = time.perf_counter()
    try:
        return thunk(), None
    except Exception as err:  # noqa: BLE001 - classified by the caller
        return None, err
    finally:
        elapsed = time.perf_counter() - t0
        assert elapsed < TIME_BOUND, f"a read took {elapsed:.1f} s"


class _traced:
    """Checks that the Python allocations of the block peak below :data:`MEM_BOUND`."""

    def __enter__(self):
        tracemalloc.start()

    def __exit__(self, *exc):
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        assert peak < MEM_BOUND, f"the reads took {peak / 2**20:.0f} MiB"


@pytest.mark.parametrize("case", sorted(CASES))
def test_damaged_store(stores, server, case):
    writer = stores(server, "from_tensordict", _td())
    td_id = writer.td_id
    r = server.sync_client()
    base = f"tensordict:{{{td_id}}}"
    CASES[case](r, base)

    def factory():
        return TensorDictStore.from_store(td_id=td_id, **server.connection_kwargs())

    refused = 0
    with _traced():
        for name, thunk in _reads(factory).items():
            result, err = _bounded(thunk)
            if err is None:
                if isinstance(result, TensorDict):
                    assert result.batch_size == torch.Size([4]), (case, name)
                continue
            if case.startswith("meta-tensorclass"):
                # a tensorclass this process cannot import: one ImportError that says how to open
                # the store anyway (tensorclass_cls=TensorDictStore)
                assert isinstance(err, OK_ERRORS + (ImportError,)), f"{case}/{name}: {type(err).__name__}: {err}"
                assert isinstance(err, OK_ERRORS) or "tensorclass_cls=TensorDictStore" in str(err), err
                assert td_id in str(err), (case, name, str(err))
                refused += 1
                continue
            assert isinstance(err, OK_ERRORS), f"{case}/{name}: {type(err).__name__}: {err}"
            refused += 1
            assert td_id in str(err), (case, name, str(err))
        # the damaged store can always be deleted, by the handle that wrote it
        _, err = _bounded(writer.clear_redis)
    assert err is None, f"{case}: clear_redis: {type(err).__name__}: {err}"
    if case not in READS_FINE:
        assert refused, f"{case}: every read accepted the damaged store"
    assert not [k for k in r.scan_iter(match=f"*{td_id}*")], case


def test_indexed_reads_check_the_byte_count(stores, server):
    """Data too short or too long: indexed reads say what whole reads say."""
    for fix, word in ((lambda b: b[:-4], "bytes"), (lambda b: b + b"\0" * 4, "bytes")):
        writer = stores(server, "from_tensordict", _td())
        base = f"tensordict:{{{writer.td_id}}}"
        _data("x", fix)(server.sync_client(), base)
        store = TensorDictStore.from_store(td_id=writer.td_id, **server.connection_kwargs())
        with pytest.raises(CorruptMetadataError, match=word) as whole:
            store["x"]
        with pytest.raises(CorruptMetadataError, match=word) as indexed:
            store[1]
        assert "'x'" in str(whole.value) and "'x'" in str(indexed.value)
        writer.clear_redis()


def test_format_version(stores, server):
    writer = stores(server, "from_tensordict", _td())
    _meta("fmt", "99")(server.sync_client(), f"tensordict:{{{writer.td_id}}}")
    with pytest.raises(FormatVersionError):
        TensorDictStore.from_store(td_id=writer.td_id, **server.connection_kwargs())


def test_chunk_bomb_cli(stores, real_server):
    """``tdstore ls`` and ``tdstore rm`` of a store whose chunking would make 10**11 key names,
    in a process limited to 2 GiB of address space."""
    server = real_server
    writer = stores(server, "from_tensordict", _td())
    td_id = writer.td_id
    _entry("x", c=4, shape=[4, 10**11])(server.sync_client(), f"tensordict:{{{td_id}}}")
    kw = server.connection_kwargs()
    url = f"redis://{kw['host']}:{kw['port']}/0"
    script = textwrap.dedent(
        f"""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, 6 * 2**30))
        from tdstore.cli import main
        for argv in (["ls", "--url", {url!r}], ["rm", {td_id!r}, "--url", {url!r}, "--yes"]):
            print("RC", argv[0], main(argv), flush=True)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "RC ls 0" in proc.stdout, proc.stdout + proc.stderr
    assert "RC rm 0" in proc.stdout, proc.stdout + proc.stderr
    assert not [k for k in server.sync_client().scan_iter(match=f"*{td_id}*")]


# --------------------------------------------------------------------------- odd keys, interpreter exit
def test_lone_surrogate_key(server):
    """TensorDict accepts a key with a lone surrogate; so does a store (it round-trips)."""
    key = "a\ud800b.c"
    store = TensorDictStore(batch_size=[2], **server.connection_kwargs())
    store[key] = torch.arange(2)
    store[("n\udfff", "y")] = torch.ones(2)
    store["%uD800"] = torch.zeros(2)  # the escape's own spelling stays a distinct key
    other = TensorDictStore.from_store(td_id=store.td_id, **server.connection_kwargs())
    assert sorted(other.keys()) == sorted([key, "n\udfff", "%uD800"])
    assert other[key].tolist() == [0, 1] and other["n\udfff", "y"].tolist() == [1, 1]
    assert other.to_tensordict()[key].tolist() == [0, 1]
    other.rename_key_(key, "plain")
    assert store["plain"].tolist() == [0, 1]
    store.clear_redis()


def test_clean_exit_with_a_redis_client_alongside(real_server):
    """No "Exception ignored in BaseEventLoop.__del__" (nor an unclosed loop) at interpreter exit."""
    kw = real_server.connection_kwargs()
    script = textwrap.dedent(
        f"""
        import redis, torch
        from tdstore import TensorDictStore
        r = redis.Redis(host={kw['host']!r}, port={kw['port']})
        s = TensorDictStore(batch_size=[2], host={kw['host']!r}, port={kw['port']})
        s["x"] = torch.zeros(2)
        r.ping()
        s[0]
        t = TensorDictStore.from_store(td_id=s.td_id, host={kw['host']!r}, port={kw['port']})
        t["x"]
        print("done")
        """
    )
    proc = subprocess.run([sys.executable, "-X", "dev", "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "done" in proc.stdout, proc.stderr
    assert "Exception ignored" not in proc.stderr, proc.stderr
    assert "unclosed event loop" not in proc.stderr, proc.stderr


LAZY_CASES = {
    "meta-bs-bool": _meta("batch_size", "[4, true]"),
    "meta-bs-recursive": _meta("batch_size", DEEP),
    "json-invalid": _reg("x", "{bad"),
    "json-recursive": _reg("x", DEEP),
    "shape-bool": _entry("x", shape=[True]),
    "meta-lv-text": _meta("lv", "x"),
    "registry-wrong-type": _wrong_type("reg"),
}


@pytest.mark.parametrize("case", sorted(LAZY_CASES))
def test_damaged_lazy_store(server, case):
    from tensordict import LazyStackedTensorDict

    from tdstore import LazyStackedTensorDictStore

    writer = LazyStackedTensorDictStore.from_lazy_stack(
        LazyStackedTensorDict(*[TensorDict({"x": torch.zeros(3), "s": "hi"}, [3]) for _ in range(4)]),
        **server.connection_kwargs(),
    )
    r = server.sync_client()
    LAZY_CASES[case](r, f"tensordict:{{{writer.td_id}}}")
    with _traced():
        for read in (lambda s: s.to_tensordict(), lambda s: s[1], len):
            _, err = _bounded(lambda read=read: read(LazyStackedTensorDictStore.from_store(td_id=writer.td_id, **server.connection_kwargs())))
            assert isinstance(err, OK_ERRORS), f"{case}: {type(err).__name__}: {err}"
        _, err = _bounded(writer.clear_redis)
    assert err is None, f"{case}: clear_redis: {type(err).__name__}: {err}"
    assert not [k for k in r.scan_iter(match=f"*{writer.td_id}*")]


def _writes():
    """Indexed and whole-entry writes a user may make: name -> write(store)."""
    return {
        "rows-scalar": lambda s: s.__setitem__(slice(1, 3), 1),
        "row-td": lambda s: s.__setitem__(
            1, TensorDict({"x": torch.ones(4), "nt": "a", "n": TensorDict({"y": torch.ones(2)}, [])}, [])
        ),
        "entry": lambda s: s.__setitem__("x", torch.zeros(4, 4)),
        "nt-at": lambda s: s.set_at_("nt", "b", 1),
        "new-key": lambda s: s.__setitem__("z", torch.zeros(4)),
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_damaged_store_writes(stores, server, case):
    """N7: indexed writes into damaged entries leaked JSONDecodeError (a non-tensor's bytes) or
    tried an 8 TB allocation (a huge registered shape). Each write either works or raises one
    error naming the store, in bounded time and memory, and a refused write changes no key."""
    r = server.sync_client()
    for name, write in _writes().items():
        writer = stores(server, "from_tensordict", _td())
        td_id = writer.td_id
        CASES[case](r, f"tensordict:{{{td_id}}}")
        before = {k: r.dump(k) for k in sorted(r.scan_iter(match=f"*{td_id}*"))}
        with _traced():
            _, err = _bounded(lambda write=write, td_id=td_id: write(TensorDictStore.from_store(td_id=td_id, **server.connection_kwargs())))
        if err is not None:
            ok = OK_ERRORS + (ImportError,) if case.startswith("meta-tensorclass") else OK_ERRORS
            # a value that does not fit the (damaged) shape: TensorDict's RuntimeError, naming the store
            ok = ok + (TDStoreError, RuntimeError, KeyError)
            assert isinstance(err, ok), f"{case}/{name}: {type(err).__name__}: {err}"
            assert td_id in str(err), (case, name, str(err))
            after = {k: r.dump(k) for k in sorted(r.scan_iter(match=f"*{td_id}*"))}
            assert after == before, f"{case}/{name}: refused, but changed the store's keys"
        _, err = _bounded(writer.clear_redis)
        assert err is None, f"{case}/{name}: clear_redis: {err}"
