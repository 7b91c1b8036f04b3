"""A sample's rows read between two MULTIs (tdstore/_backend/step.py ``Split``).

A sample of many large rows reads them plain, between a MULTI that reads the cursor, the
flags, the layout and write versions and the append counters, and a MULTI that reads those
again (``_append.draw_check_bracket``). The rows are kept only where the two show that
nothing but appends wrote in between; rows an append reserved in between are drawn again;
any other write, or a layout change, sends the read again in one MULTI.

These tests put a real write in between: the packet is sent in two parts, with another
client's write between them, which the server runs between the first part's commands and
the rest. The rows of the store each hold one tag in every entry, so a row read half
before and half after a write shows two tags.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from tensordict import TensorDict

from tdstore import TensorDictStore
from tdstore._backend import append as _append
from tdstore._backend import step as _step
from tdstore._backend import wire as _wire

CAP = 64
OBS = 4096  # (bytes a row: read by GETRANGE, received into the batch: a placed read)
N = 64  # (rows a sample: more GETRANGEs than step.SPLIT_MIN)


def rows(tags: list[int]) -> TensorDict:
    t = torch.tensor(tags, dtype=torch.int64)
    return TensorDict(obs=(t % 251).to(torch.uint8)[:, None].expand(-1, OBS).clone(), tag=t, batch_size=[len(tags)])


def torn(batch: TensorDict) -> int:
    """Rows whose entries hold different tags."""
    want = (batch["tag"] % 251).to(torch.uint8)[:, None]
    return int((batch["obs"] != want).any(dim=1).sum())


@pytest.fixture
def store(real_server):
    s = TensorDictStore.from_schema({"obs": ([OBS], torch.uint8), "tag": ([], torch.int64)}, batch_size=[CAP],
                                    **real_server.connection_kwargs())
    s.extend(rows(list(range(CAP))))
    yield s
    s.clear_redis()
    s.close()


@pytest.fixture
def spies(monkeypatch):
    """Counts the split reads sent and what their brackets showed."""
    seen = {"split": 0, "held": 0, "broken": 0, "exchanges": 0}
    real_exchange = _step._placed.exchange
    real_holds = _append.bracket_holds

    def exchange(*args, **kwargs):
        seen["split"] += kwargs.get("split") is not None
        seen["exchanges"] += 1
        return real_exchange(*args, **kwargs)

    def holds(*args):
        got = real_holds(*args)
        seen["held" if got else "broken"] += 1
        return got

    monkeypatch.setattr(_step._placed, "exchange", exchange)
    monkeypatch.setattr(_append, "bracket_holds", holds)
    return seen


def write_between(monkeypatch, action) -> list[int]:
    """The next split read's packet goes in two parts, cut before the read of its last
    entry's rows (or, that not found, before the second MULTI), with ``action()`` run in
    between; returns a list that gets 1 when that happened."""
    real = _wire.send_sync
    done: list[int] = []

    def send(connection, pieces):
        data = b"".join(bytes(p) for p in pieces)
        first = data.find(b"EXEC\r\n")
        second = data.find(b"*1\r\n$5\r\nMULTI\r\n", first)
        if done or first < 0 or second < 0:
            return real(connection, pieces)
        cut = data.rfind(b"*", first, second)  # (the last command between: the last entry's rows)
        cut = data.rfind(b"\r\n*", first, cut) + 2 if data[cut - 1 : cut] != b"\n" else cut
        done.append(1)
        real(connection, [data[:cut]])
        time.sleep(0.05)  # (the server runs what it got)
        action()
        real(connection, [data[cut:]])

    monkeypatch.setattr(_wire, "send_sync", send)
    return done


def test_a_plain_sample_of_many_large_rows_is_read_between_two_multis(store, spies):
    batch = store.sample(N, generator=torch.Generator().manual_seed(0))
    assert spies["split"] == 1 and spies["held"] == 1 and spies["broken"] == 0
    assert torn(batch) == 0
    assert batch["tag"].tolist() == [int(store["tag"][i]) for i in batch["tag"].tolist()]


def test_a_write_between_sends_the_read_again_in_one_multi(store, spies, monkeypatch, real_server):
    """Every row rewritten (not appended) between the two MULTIs: the bracket shows it, the
    rows are read again in one MULTI, and none comes back torn or from before the write."""
    other = TensorDictStore.from_store(td_id=store.td_id, **real_server.connection_kwargs())
    try:
        done = write_between(monkeypatch, lambda: other.__setitem__(slice(None), rows(list(range(1000, 1000 + CAP)))))
        batch = store.sample(N, generator=torch.Generator().manual_seed(1))
        assert done == [1]
        assert spies["split"] == 1 and spies["broken"] == 1
        assert torn(batch) == 0
        assert all(t >= 1000 for t in batch["tag"].tolist())
    finally:
        other.close()


def test_rows_an_append_reserves_between_are_drawn_again(store, spies, monkeypatch, real_server):
    """An append of the whole ring between the two MULTIs: the bracket holds (appends
    only), every row read was reserved meanwhile, so each is drawn again; none comes back
    torn, and each holds what the store holds now."""
    other = TensorDictStore.from_store(td_id=store.td_id, **real_server.connection_kwargs())
    try:
        done = write_between(monkeypatch, lambda: other.extend(rows(list(range(2000, 2000 + CAP)))))
        batch = store.sample(N, generator=torch.Generator().manual_seed(2))
        assert done == [1]
        assert spies["split"] >= 1 and spies["broken"] == 0 and spies["held"] >= 2  # (the redraw read too)
        assert torn(batch) == 0
        assert all(t >= 2000 for t in batch["tag"].tolist())
        now = store["tag"]
        assert batch["tag"].tolist() == [int(now[t - 2000]) for t in batch["tag"].tolist()]
    finally:
        other.close()


def test_prioritized_rows_an_append_reserves_between_are_drawn_again(store, spies, monkeypatch, real_server):
    """The same for a prioritized sample: the rows reached between the two MULTIs are drawn
    again, and every row returned holds the generation returned with it."""
    from tdstore.replay import priorities as P

    store.enable_priorities(alpha=1.0, beta=1.0, eps=0.0)
    other = TensorDictStore.from_store(td_id=store.td_id, **real_server.connection_kwargs())
    try:
        done = write_between(monkeypatch, lambda: other.extend(rows(list(range(3000, 3000 + CAP)))))
        batch, info = store.sample(N, prioritized=True, return_info=True, generator=torch.Generator().manual_seed(3))
        assert done == [1]
        assert spies["split"] >= 1 and spies["broken"] == 0
        assert torn(batch) == 0
        assert all(t >= 3000 for t in batch["tag"].tolist())
        assert info["generation"].tolist() == P.generations(store, info["index"]).tolist()
    finally:
        other.close()


def test_threads_rewriting_and_appending_never_give_a_torn_row(store, spies, real_server):
    """Two threads write (one rewrites rows in place, one appends) while a third samples
    through the same handle the appender uses; bounded in count and time."""
    other = TensorDictStore.from_store(td_id=store.td_id, **real_server.connection_kwargs())
    stop = threading.Event()
    errors: list[BaseException] = []

    def rewrite() -> None:
        g = torch.Generator().manual_seed(7)
        tag = 10_000
        try:
            for _ in range(2000):
                if stop.is_set():
                    return
                idx = torch.randint(0, CAP, (8,), generator=g)
                other[idx] = rows(list(range(tag, tag + 8)))
                tag += 8
        except BaseException as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    def append() -> None:
        tag = 100_000
        try:
            for _ in range(2000):
                if stop.is_set():
                    return
                store.extend(rows(list(range(tag, tag + 4))))
                tag += 4
        except BaseException as err:  # noqa: BLE001
            errors.append(err)

    threads = [threading.Thread(target=rewrite), threading.Thread(target=append)]
    for t in threads:
        t.start()
    bad = samples = 0
    deadline = time.monotonic() + 5
    try:
        g = torch.Generator().manual_seed(8)
        while time.monotonic() < deadline and samples < 400:
            bad += torn(store.sample(N, generator=g))
            samples += 1
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
        other.close()
    print(f"split reads under writes: samples={samples} split={spies['split']} held={spies['held']} "
          f"read_again={spies['broken']} torn_rows={bad}")
    assert not errors, errors
    assert samples >= 10 and spies["split"] >= 10
    assert bad == 0


@pytest.mark.parametrize("damage", ["wv", "appends"])
def test_damaged_versions_send_the_read_again_in_one_multi(store, spies, real_server, damage):
    """A write version or append counters that are not counts: the bracket cannot tell, and
    the read goes again in one MULTI, whose rows are a snapshot whatever the versions hold."""
    client = real_server.sync_client()
    keys = store._conn.keys
    try:
        if damage == "wv":
            client.set(keys.wv, b"not a count")
        else:
            client.hset(keys.appends, "a:", b"1.5")
        batch = store.sample(N, generator=torch.Generator().manual_seed(4))
        assert spies["split"] == 1 and spies["broken"] == 1 and spies["held"] == 0
        assert torn(batch) == 0
        assert batch["tag"].tolist() == [int(store["tag"][i]) for i in batch["tag"].tolist()]
    finally:
        client.close()


def test_an_indexed_read_of_many_large_rows_goes_between_two_multis(store, spies):
    """``store[idx]`` of many large rows: the layout and write versions in a MULTI before
    and after the rows; nothing written in between, so one exchange."""
    idx = torch.randperm(CAP, generator=torch.Generator().manual_seed(5))[:N]
    batch = store[idx]
    assert spies["split"] == 1 and spies["exchanges"] == 1
    assert torn(batch) == 0 and batch["tag"].tolist() == idx.tolist()


@pytest.mark.parametrize("write", ["rewrite", "append"])
def test_a_write_between_an_indexed_read_reads_again_in_one_multi_then_cools(store, spies, monkeypatch, real_server, write):
    """Any write between the two MULTIs of ``store[idx]`` (an append too: an indexed read
    does not know which rows appends reached) sends the read again in one MULTI: the rows
    are all from after the write, none torn. The handle's next SPLIT_COOL indexed reads go
    in one MULTI, the one after between two again."""
    from tdstore._backend import reads as _reads

    other = TensorDictStore.from_store(td_id=store.td_id, **real_server.connection_kwargs())
    try:
        if write == "rewrite":
            action = lambda: other.__setitem__(slice(None), rows(list(range(1000, 1000 + CAP))))  # noqa: E731
        else:
            action = lambda: other.extend(rows(list(range(1000, 1000 + CAP))))  # noqa: E731
        done = write_between(monkeypatch, action)
        idx = torch.randperm(CAP, generator=torch.Generator().manual_seed(6))[:N]
        batch = store[idx]
        assert done == [1]
        assert spies["split"] == 1 and spies["exchanges"] == 2  # (the split read, then one MULTI)
        assert torn(batch) == 0 and batch["tag"].tolist() == [1000 + i for i in idx.tolist()]
        assert store._conn.split_cool == _reads.SPLIT_COOL
        for _ in range(_reads.SPLIT_COOL):
            store[idx]
        assert spies["split"] == 1 and store._conn.split_cool == 0
        store[idx]
        assert spies["split"] == 2
    finally:
        other.close()
