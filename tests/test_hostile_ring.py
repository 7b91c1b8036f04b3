"""Hostile or damaged ring, lease and version keys: the cursor (``:ring``), the row flags
(``:rf``), the append counters (``:ac``), the fence, the appends in flight (``:rif``), the
readers' leases (``:rl``), the write version (``:wv``) and the meta hash's layout version
(``lv``), each edited by hand to garbage bytes, another type, an empty string, a huge or a
negative number.

Every operation on such a store either works (and gives what an undamaged store would) or
raises one :mod:`tdstore.errors` error naming the store, within a time bound; one that raises
leaves every key of the store exactly as it was (checked with a plain redis client, by DUMP).
"""

from __future__ import annotations

import time

import pytest
import torch
from tensordict import TensorDict

from tdstore import TensorDictStore
from tdstore.errors import CorruptMetadataError, DataLostError, TDStoreError

#: the longest one operation may take (seconds)
TIME_BOUND = 10.0
CAPACITY = 8
APPENDED = 6


def _set(suffix, value):
    def edit(r, base):
        r.set(f"{base}:{suffix}", value)

    return edit


def _hset(suffix, field, value):
    def edit(r, base):
        r.delete(f"{base}:{suffix}")
        r.hset(f"{base}:{suffix}", field, value)

    return edit


def _list(suffix):
    def edit(r, base):
        r.delete(f"{base}:{suffix}")
        r.rpush(f"{base}:{suffix}", b"x")

    return edit


def _meta_lv(value):
    def edit(r, base):
        r.hset(f"{base}:meta", "lv", value)

    return edit


STRINGS = {"ring": "cursor", "rf": "flags", "fence": "fence", "wv": "wv"}
HASHES = {"ac": "counters", "rif": "inflight", "rl": "lease"}
VALUES = {"garbage": b"\xffabc", "empty": b"", "huge": str(2**62), "negative": "-5", "float": "2.5"}

EDITS = {}
for suffix, name in STRINGS.items():
    for kind, value in VALUES.items():
        EDITS[f"{name}-{kind}"] = _set(suffix, value)
    EDITS[f"{name}-list"] = _list(suffix)
EDITS["flags-twos"] = _set("rf", b"\x02" * 16)
EDITS["flags-long"] = _set("rf", b"\x01" * 64)
for suffix, name in HASHES.items():
    field = {"ac": "a:", "rif": "1", "rl": "nonce"}[suffix]
    for kind, value in VALUES.items():
        EDITS[f"{name}-{kind}"] = _hset(suffix, field, value)
    EDITS[f"{name}-list"] = _list(suffix)
    EDITS[f"{name}-string"] = _set(suffix, "abc")
for kind, value in VALUES.items():
    EDITS[f"lv-{kind}"] = _meta_lv(value)


def _ring(stores, server):
    """A ring of ``CAPACITY`` rows, ``APPENDED`` of them appended (made with ``stores``)."""
    s = stores(server, "from_schema", {"x": ([2], torch.float32)}, batch_size=[CAPACITY])
    s.extend(TensorDict(x=torch.arange(2.0 * APPENDED).reshape(APPENDED, 2), batch_size=[APPENDED]))
    return s


def _ops(open_):
    """name -> thunk; each on a fresh handle (opening it is part of the operation)."""

    def check_state(s):
        state = s.ring_state()
        assert 0 <= state.valid <= min(state.total, state.capacity), state
        assert state.capacity == CAPACITY and state.cursor == state.total % CAPACITY, state
        return state

    def sample(s):
        rows = s.sample(16)
        assert rows.batch_size == torch.Size([16])
        return rows

    def extend(s):
        idx = s.extend(TensorDict(x=torch.full((2, 2), 7.0), batch_size=[2]))
        assert len(set(idx.tolist())) == 2
        assert (s[idx]["x"] == 7).all()
        return idx

    return {
        "from_store": lambda: open_(),
        "len": lambda: len(open_()),
        "keys": lambda: list(open_().keys()),
        "ring_state": lambda: check_state(open_()),
        "sample": lambda: sample(open_()),
        "read-index": lambda: open_()[1].to_dict(),
        "read-slice": lambda: open_()[1:3].to_dict(),
        "read-list": lambda: open_()[[0, 3]].to_dict(),
        "read-entry": lambda: open_()["x"],
        "to_tensordict": lambda: open_().to_tensordict(),
        "write-slice": lambda: open_().__setitem__(slice(1, 3), TensorDict(x=torch.ones(2, 2), batch_size=[2])),
        "write-entry": lambda: open_().__setitem__("x", torch.zeros(CAPACITY, 2)),
        "write-new-key": lambda: open_().__setitem__("y", torch.zeros(CAPACITY)),
        "apply_": lambda: open_().apply_(lambda t: t + 1),
        "extend": lambda: extend(open_()),
        "extend-twice": lambda: (extend(open_()), extend(open_())),
    }


#: a "no row appended yet" ValueError of sample() is what an undamaged store says when the
#: flags record no written row
def _acceptable(name, err):
    if isinstance(err, TDStoreError):
        return True
    return name == "sample" and isinstance(err, ValueError) and "no row was appended" in str(err)


def _dump(r, td_id):
    return {k: r.dump(k) for k in sorted(r.scan_iter(match=f"*{td_id}*"))}


CASES = sorted(EDITS)


@pytest.mark.parametrize("case", CASES)
def test_damaged_ring_keys(stores, server, case):
    writer = _ring(stores, server)
    td_id = writer.td_id
    r = server.sync_client()
    EDITS[case](r, f"tensordict:{{{td_id}}}")

    def open_():
        return TensorDictStore.from_store(td_id=td_id, **server.connection_kwargs())

    leaks = []
    for name, thunk in _ops(open_).items():
        before = _dump(r, td_id)
        t0 = time.perf_counter()
        try:
            thunk()
        except Exception as err:  # noqa: BLE001 - classified below
            if not _acceptable(name, err):
                leaks.append(f"{name}: {type(err).__name__}: {str(err)[:200]}")
                continue
            if isinstance(err, TDStoreError):
                assert td_id in str(err), (case, name, str(err))
            assert _dump(r, td_id) == before, f"{case}/{name}: refused, but changed the store's keys"
        finally:
            elapsed = time.perf_counter() - t0
            assert elapsed < TIME_BOUND, f"{case}/{name} took {elapsed:.1f} s"
    assert not leaks, f"{case}: " + "; ".join(leaks)
    writer.clear_redis()
    assert not list(r.scan_iter(match=f"*{td_id}*")), case


@pytest.mark.parametrize("cursor", [2**62, 2**53 + 1, 2**52 + 1])
def test_cursor_lua_cannot_hold_is_refused(stores, server, cursor):
    """A cursor past 2**52: two extend() calls both got rows [0, 1] (Lua doubles lost the low
    bits). Each is refused before any write, armed (one packet) or not."""

    s = _ring(stores, server)
    r = server.sync_client()
    s.extend(TensorDict(x=torch.ones(1, 2), batch_size=[1]))  # arms the handle's connection
    r.set(f"tensordict:{{{s.td_id}}}:ring", str(cursor))
    before = _dump(r, s.td_id)
    for _ in range(2):
        with pytest.raises(CorruptMetadataError, match="2\\*\\*52|2\\^52"):
            s.extend(TensorDict(x=torch.ones(2, 2), batch_size=[2]))
    assert _dump(r, s.td_id) == before
    with pytest.raises(CorruptMetadataError, match="ring cursor"):
        s.ring_state()
    s.clear_redis()


def test_extend_into_a_data_key_of_another_type(server):
    """The one step left that raises after applying the rest (docs/guarantees.md, "Keys edited
    by hand"): an append whose entry's bytes were replaced by a list. Its MULTI's SETRANGE is
    refused at the list, its flags, cursor and counters land (checking every data key's type
    on each append would cost the server more than the append). The error says so, the
    damaged entry stays unreadable (no row of it is ever read back stale), the other entries
    get their rows, and clear_redis() deletes the store."""
    s = TensorDictStore.from_schema(
        {"x": ([2], torch.float32), "y": ([3], torch.int64)}, batch_size=[CAPACITY], **server.connection_kwargs()
    )
    s.extend(TensorDict(x=torch.ones(2, 2), y=torch.ones(2, 3, dtype=torch.int64), batch_size=[2]))
    r = server.sync_client()
    key = f"tensordict:{{{s.td_id}}}:d:x"
    r.delete(key)
    r.rpush(key, b"junk")
    for handle in (s, TensorDictStore.from_store(td_id=s.td_id, **server.connection_kwargs())):
        with pytest.raises(CorruptMetadataError, match="after applying the rest"):
            handle.extend(TensorDict(x=torch.full((2, 2), 7.0), y=torch.full((2, 3), 7), batch_size=[2]))
        for read in (lambda h: h.sample(4), lambda h: h[2], lambda h: h["x"]):
            with pytest.raises((CorruptMetadataError, DataLostError), match=s.td_id):  # (an MGET reads a list as no value)
                read(handle)
    assert (s["y"][2:6] == 7).all()
    assert r.type(key) == b"list"
    s.clear_redis()
    assert not list(r.scan_iter(match=f"*{s.td_id}*"))

