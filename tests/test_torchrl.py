"""TorchRL replay buffers on a TensorDictStore (``tdstore.torchrl``).

TorchRL 0.14.1 pins tensordict<0.15, so these tests run in the tensordict 0.14.3
environment that ``.ci/run`` builds (``-m torchrl``); the main run deselects them with
``-m "not torchrl"``. Only ``test_missing_torchrl_gives_a_clear_error`` is unmarked: it
runs in both environments.

Each buffer is compared with TorchRL's in-memory ``LazyTensorStorage`` given the same
operations, and what the store holds is read back through a second handle.
"""

from __future__ import annotations

import pickle
import re
import subprocess
import sys
import textwrap
from typing import Any

import _torchrl_workers as w
import pytest
import torch
from fixtures import PoolSpec
from tensordict import TensorDict

from tdstore import TensorDictStore
from tdstore.errors import SchemaError
from tdstore.testing.counts import record as _record

NPROC = 3  # writers; one more process samples


def test_missing_torchrl_gives_a_clear_error():
    code = textwrap.dedent(
        """
        import sys
        sys.modules["torchrl"] = None  # as if torchrl were not installed
        import tdstore
        try:
            import tdstore.torchrl
        except ImportError as exc:
            print(exc)
        else:
            print("imported")
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "pip install 'tdstore[torchrl]'" in out.stdout and "tensordict<0.15" in out.stdout


@pytest.fixture
def rl():
    """The torchrl names the tests use (imported here: the main environment has no torchrl)."""
    import torchrl.data as data

    import tdstore.torchrl as tds

    return {
        "ReplayBuffer": data.ReplayBuffer,
        "TensorDictReplayBuffer": data.TensorDictReplayBuffer,
        "SamplerWithoutReplacement": data.SamplerWithoutReplacement,
        "LazyTensorStorage": data.LazyTensorStorage,
        "RoundRobinWriter": data.RoundRobinWriter,
        "Storage": tds.TensorDictStoreStorage,
        "Writer": tds.TensorDictStoreWriter,
    }


def _batch(start: int, n: int) -> TensorDict:
    x = torch.arange(start, start + n, dtype=torch.float32)
    return TensorDict(
        obs=x[:, None].expand(n, 3).clone(),
        action=(x.long() % 4),
        next=TensorDict(reward=x * 0.5, batch_size=[n]),
        batch_size=[n],
    )


def _reread(server: Any, storage: Any) -> TensorDict:
    return TensorDictStore.from_store(td_id=storage.store.td_id, **server.connection_kwargs()).to_tensordict()


@pytest.mark.torchrl
@pytest.mark.parametrize("writer", ["store", "round_robin"])
def test_matches_lazy_tensor_storage(server, rl, writer):
    capacity = 10
    make_writer = rl["Writer"] if writer == "store" else rl["RoundRobinWriter"]
    rb = rl["ReplayBuffer"](storage=rl["Storage"](capacity, **server.connection_kwargs()), writer=make_writer(), batch_size=4)
    ref = rl["ReplayBuffer"](storage=rl["LazyTensorStorage"](capacity), batch_size=4)
    start = 0
    for n in (3, 4, 5, 1, 7):  # wraps around twice
        got, want = rb.extend(_batch(start, n)), ref.extend(_batch(start, n))
        assert torch.equal(got, want)
        start += n
        assert len(rb) == len(ref)
        assert (rb[:] == ref[:]).all()
    assert rb.add(_batch(100, 1)[0]) == ref.add(_batch(100, 1)[0])
    assert (rb[:] == ref[:]).all()
    assert (rb[[0, 3, 9]] == ref[[0, 3, 9]]).all() and (rb[-1] == ref[-1]).all()
    assert (_reread(server, rb.storage) == ref.storage._storage).all()
    sample = rb.sample()
    assert sample.batch_size == torch.Size([4]) and type(sample) is TensorDict
    rows = sample["obs"][:, 0].long().tolist()
    assert all(r in _reread(server, rb.storage)["obs"][:, 0].long().tolist() for r in rows)


@pytest.mark.torchrl
def test_partial_buffer_reads_only_valid_rows(server, rl):
    rb = rl["ReplayBuffer"](storage=rl["Storage"](8, **server.connection_kwargs()), writer=rl["Writer"](), batch_size=64)
    rb.extend(_batch(10, 3))
    assert len(rb) == 3 and rb[:].batch_size == torch.Size([3])
    sample = rb.sample()
    assert set(sample["obs"][:, 0].tolist()) <= {10.0, 11.0, 12.0}
    with pytest.raises(IndexError):
        rb[5]
    assert rb.storage.contains(2) and not rb.storage.contains(3)


@pytest.mark.torchrl
def test_uniform_sample_reads_its_rows_once_and_never_one_unwritten(server, rl, monkeypatch):
    """TorchRL's RandomSampler on rows appended by the store's writer: the draw is the store's
    sample() (rows read in one snapshot with their flags), whose rows go to get() without a
    second read; a row unwritten after the flags were read (flag cleared, bytes zeroed, as on
    a promoted replica that lacks its write) is drawn again, never returned. Before, get()
    read the drawn rows in a step of their own, without their flags."""
    from tdstore.store import ring as _ring

    rb = rl["ReplayBuffer"](storage=rl["Storage"](8, **server.connection_kwargs()), writer=rl["Writer"](), batch_size=64)
    rb.extend(_batch(1, 6))  # rows 0-5 hold obs 1..6
    hits = rb.storage.handoff_hits
    sample = rb.sample()
    assert rb.storage.handoff_hits == hits + 1, "get() read the sampled rows again"
    assert set(sample["obs"][:, 0].tolist()) <= {1.0, 2.0, 3.0, 4.0, 5.0, 6.0}
    client = server.sync_client()
    keys = rb.storage.store._conn.keys
    real = _ring.draw_written
    hit: list[int] = []

    def draw_then_unwrite(target, n, generator, read=None):
        idx = real(target, n, generator, read)
        if not hit:
            row = int(idx[0])
            hit.append(row)
            client.setrange(keys.flags, row, b"\x00")
            for path, width in ((("obs",), 12), (("action",), 8), (("next", "reward"), 4)):
                client.setrange(keys.data(path), row * width, b"\x00" * width)
        return idx

    monkeypatch.setattr(_ring, "draw_written", draw_then_unwrite)
    try:
        sample = rb.sample()
    finally:
        client.close()
    assert len(hit) == 1
    assert bool((sample["obs"] > 0).all()), sample["obs"][:, 0].tolist()
    assert torch.equal(sample["action"], sample["obs"][:, 0].long() % 4)


@pytest.mark.torchrl
def test_tensordict_buffer_and_other_samplers(server, rl):
    conn = server.connection_kwargs()
    trb = rl["TensorDictReplayBuffer"](storage=rl["Storage"](16, **conn), writer=rl["Writer"](), batch_size=4)
    idx = trb.extend(_batch(0, 6))
    assert torch.equal(idx, torch.arange(6))
    sample = trb.sample()
    assert torch.equal(sample["obs"][:, 0].long(), sample["index"])
    # (PrioritizedSampler needs torchrl's C++ extension, which torchrl 0.14.1 cannot load with torch 2.13)
    srb = rl["ReplayBuffer"](
        storage=rl["Storage"](16, **conn), writer=rl["Writer"](), batch_size=3,
        sampler=rl["SamplerWithoutReplacement"](),
    )
    srb.extend(_batch(0, 6))
    seen = torch.cat([srb.sample()["obs"][:, 0] for _ in range(2)])
    assert sorted(seen.tolist()) == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]  # one epoch: every row once


@pytest.mark.torchrl
def test_buffers_sharing_a_td_id_see_each_other(server, rl):
    conn = server.connection_kwargs()
    a = rl["ReplayBuffer"](storage=rl["Storage"](12, td_id="shared-rb", **conn), writer=rl["Writer"](), batch_size=2)
    a.extend(_batch(0, 5))
    b = rl["ReplayBuffer"](storage=rl["Storage"](td_id="shared-rb", **conn), writer=rl["Writer"](), batch_size=2)
    assert b.storage.max_size == 12 and len(b) == 5
    assert torch.equal(b.extend(_batch(5, 4)), torch.arange(5, 9))
    assert len(a) == 9 and (a[:] == b[:]).all()
    assert torch.equal(a[:]["obs"][:, 0], torch.arange(9, dtype=torch.float32))
    a.empty()
    assert len(b) == 0 and len(a) == 0
    assert torch.equal(b.extend(_batch(0, 1)), torch.tensor([0]))


@pytest.mark.torchrl
def test_two_lazy_storages_on_one_td_id_share_the_first_store(server, rl):
    """Both built before any store exists: the second write finds the store the first created."""
    conn = server.connection_kwargs()
    first = rl["Storage"](8, td_id="lazy-race", **conn)
    second = rl["Storage"](8, td_id="lazy-race", **conn)
    assert torch.equal(first.extend(_batch(0, 3)), torch.arange(3))
    assert torch.equal(second.extend(_batch(3, 2)), torch.arange(3, 5))
    assert len(first) == len(second) == 5
    with pytest.raises(SchemaError, match="missing"):
        second.extend(TensorDict(other=torch.zeros(2), batch_size=[2]))


@pytest.mark.torchrl
def test_storage_pickles_by_td_id(real_server, rl):
    """What a spawned process receives: the same store, not a copy of its rows."""
    rb = rl["ReplayBuffer"](storage=rl["Storage"](12, **real_server.connection_kwargs()), writer=rl["Writer"]())
    rb.extend(_batch(0, 5))
    clone = pickle.loads(pickle.dumps(rb.storage))
    assert len(clone) == 5 and clone.store.td_id == rb.storage.store.td_id
    clone.extend(_batch(5, 2))
    assert len(rb) == 7 and rb[6]["obs"][0] == 6.0


@pytest.mark.torchrl
def test_state_dict_round_trip(server, rl):
    conn = server.connection_kwargs()
    rb = rl["ReplayBuffer"](storage=rl["Storage"](6, **conn), writer=rl["Writer"](), batch_size=2)
    rb.extend(_batch(0, 8))  # wrapped: cursor at 2
    state = rb.state_dict()
    other = rl["ReplayBuffer"](storage=rl["Storage"](6, **conn), writer=rl["Writer"](), batch_size=2)
    other.load_state_dict(state)
    assert len(other) == 6 and (other[:] == rb[:]).all()
    assert other.storage.store.td_id != rb.storage.store.td_id
    assert torch.equal(other.extend(_batch(50, 1)), torch.tensor([2]))  # the cursor came back too
    assert _reread(server, other.storage)["obs"][2, 0] == 50.0


@pytest.mark.torchrl
def test_dumps_and_loads(server, rl, tmp_path):
    conn = server.connection_kwargs()
    rb = rl["ReplayBuffer"](storage=rl["Storage"](6, **conn), writer=rl["Writer"](), batch_size=2)
    rb.extend(_batch(0, 4))
    rb.dumps(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "storage" / "storage.pt").is_file()
    other = rl["ReplayBuffer"](storage=rl["Storage"](6, **conn), writer=rl["Writer"](), batch_size=2)
    other.loads(tmp_path / "ckpt")
    assert len(other) == 4 and (other[:] == rb[:]).all()
    assert torch.equal(other.extend(_batch(9, 1)), torch.tensor([4]))


@pytest.mark.torchrl
def test_given_store_and_bad_arguments(server, rl, wire):
    conn = server.connection_kwargs()
    store = TensorDictStore.from_schema({"obs": ([3], torch.float32)}, batch_size=[5], **conn)
    storage = rl["Storage"](store=store)
    assert storage.max_size == 5 and len(storage) == 0
    with pytest.raises(ValueError, match="max_size=4 does not match"):
        rl["Storage"](4, store=store)
    with pytest.raises(ValueError, match="max_size >= 1"):
        rl["Storage"](**conn)
    rb = rl["ReplayBuffer"](storage=storage, writer=rl["Writer"](), batch_size=2)
    rb.extend(TensorDict(obs=torch.ones(2, 3), batch_size=[2]))
    before = wire(server)
    with pytest.raises(TypeError, match="takes a TensorDict"):
        rb.extend(torch.zeros(2, 3))
    with pytest.raises(SchemaError, match="missing"):
        rb.extend(TensorDict(other=torch.ones(2, 3), batch_size=[2]))
    with pytest.raises(SchemaError, match="rows of shape"):
        rb.extend(TensorDict(obs=torch.ones(2, 4), batch_size=[2]))
    assert wire(server) == before and len(rb) == 2  # nothing written
    with pytest.raises(TypeError, match="TensorDictStoreStorage"):
        rl["ReplayBuffer"](storage=rl["LazyTensorStorage"](4), writer=rl["Writer"]())
    lazy = rl["Storage"](4, **conn)
    with pytest.raises(SchemaError, match="tensor entries only"):
        lazy.extend(TensorDict(obs=torch.ones(2), text=["a", "b"], batch_size=[2]))


#: the module's ``pool`` (tests/fixtures.py)
POOL = PoolSpec(workers=NPROC + 1, warm_up=w.warm_up, warm_up_arg=0.5)


@pytest.mark.torchrl
@pytest.mark.multiprocess
@pytest.mark.parametrize("layout", ["room", "wrap"])
def test_processes_share_one_buffer(redis_server, rl, pool, request, tmp_path, layout):
    """3 spawned writers append through their own ReplayBuffer while a 4th samples.

    ``room``: the buffer holds every row, so none may be lost. ``wrap``: it holds a fifth of
    them and wraps around 5 times; every row left must be intact and sit where the buffer
    said it put it.
    """
    conn = redis_server.connection_kwargs()
    steps, rows = 40, 4
    total = NPROC * steps * rows
    capacity = total if layout == "room" else total // 5
    store = TensorDictStore.from_schema(
        {"tag": ([3], torch.int64), "obs": ([6], torch.float32)}, batch_size=[capacity], **conn
    )
    store["obs"] = torch.full((capacity, 6), -1.0)
    go = str(tmp_path / "go")  # the sampler creates it once its buffer is open; then the writers start
    reader = pool.submit(w.sampler, conn, store.td_id, total, 20.0, 20000, go)
    writers = [pool.submit(w.extender, conn, store.td_id, p, steps, rows, 20.0, go) for p in range(NPROC)]
    per_writer = [f.result(timeout=60) for f in writers]
    samples, torn_samples, unwritten_samples = reader.result(timeout=60)
    indices = [i for got in per_writer for i in got]
    placed = {(p, k // rows, k % rows): index for p, got in enumerate(per_writer) for k, index in enumerate(got)}
    final = _reread(redis_server, rl["Storage"](store=store))
    tags = [tuple(t) for t in final["tag"].tolist()]
    duplicates = len(tags) - len(set(tags))
    misplaced = sum(placed.get(t) != r for r, t in enumerate(tags))  # also counts a tag never appended
    lost = len(set(placed) - set(tags)) if layout == "room" else 0
    tag = final["tag"]
    expected_obs = (tag[:, 0] * 1000 + tag[:, 1] * 10 + tag[:, 2]).float()
    torn = int((final["obs"] != expected_obs[:, None]).any(dim=1).sum())
    ring = store.ring_state()
    _record(
        request, rows_appended=len(indices), duplicate_rows=duplicates, lost_rows=lost, misplaced_rows=misplaced,
        torn_rows=torn, samples=samples, torn_samples=torn_samples, unwritten_samples=unwritten_samples,
    )
    assert len(indices) == total
    assert sorted(indices) == sorted(list(range(capacity)) * (total // capacity))  # each row reserved equally
    assert (duplicates, lost, misplaced, torn, torn_samples, unwritten_samples) == (0, 0, 0, 0, 0, 0)
    assert samples > 0
    assert ring.valid == capacity and ring.total == total
    store.clear_redis()
    store.close()


@pytest.mark.torchrl
def test_docs_example_runs(redis_server, monkeypatch):
    """The example of docs/torchrl.md, as written (default host and port, via TDSTORE_URL)."""
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "torchrl.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) == 1
    monkeypatch.setenv("TDSTORE_URL", redis_server.url)
    exec(compile(blocks[0], "docs/torchrl.md", "exec"), {})
    assert redis_server.sync_client().dbsize() == 0  # the example cleans up after itself
