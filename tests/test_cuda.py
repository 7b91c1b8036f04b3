"""Stores whose device is CUDA: every read lands on the GPU, exact; GPU values are written as
CPU bytes. Run on a GPU machine with ``python -m pytest -m cuda tests/test_cuda.py``; the
main run deselects them (CI has no GPU). Selected without CUDA, they fail: never a skip.
"""

from __future__ import annotations

import random

import pytest
import torch
from tensordict import TensorDict

from tdstore import TensorDictStore
from tdstore._backend import large as _large
from tdstore.testing.counts import record

pytestmark = pytest.mark.cuda

DTYPES = (torch.bool, torch.uint8, torch.int16, torch.int64, torch.float16, torch.bfloat16, torch.float32,
          torch.float64, torch.complex64)


@pytest.fixture(autouse=True)
def _gpu() -> None:
    assert torch.cuda.is_available(), "these tests need a CUDA GPU (they are deselected from the main run)"


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=gen, dtype=dtype)
    if dtype.is_floating_point:
        return (torch.randn(shape, generator=gen) * 100).to(dtype)
    return torch.randint(0, 120, shape, generator=gen).to(dtype)


def _same(got: TensorDict, want: TensorDict) -> None:
    assert got.batch_size == want.batch_size
    for key, value in want.items(include_nested=True, leaves_only=True):
        mine = got[key]
        assert mine.device.type == "cuda", (key, mine.device)
        assert mine.dtype == value.dtype and mine.shape == value.shape, key
        assert torch.equal(mine.cpu(), value.cpu()), key


def _local(n: int = 64) -> TensorDict:
    gen = torch.Generator().manual_seed(0)
    return TensorDict(
        {
            "x": _random((n, 16, 16), torch.float32, gen),
            "y": torch.arange(n),
            "n": {"z": _random((n, 3), torch.bfloat16, gen), "m": _random((n,), torch.bool, gen)},
        },
        batch_size=[n],
    )


def test_reads_land_on_the_gpu(real_server):
    local = _local()
    store = TensorDictStore.from_tensordict(local, device="cuda", **real_server.connection_kwargs())
    assert store.device.type == "cuda"
    on_gpu = local.to("cuda")
    _same(store.to_tensordict(), on_gpu)
    assert store["x"].device.type == "cuda" and torch.equal(store["x"].cpu(), local["x"])
    assert torch.equal(store["n", "z"].cpu(), local["n", "z"])
    mask = local["y"] % 3 == 0
    indices = [0, -1, slice(3, 9), slice(None, None, 5), [5, 1, 5], torch.tensor([7, 2, 63]), mask,
               torch.tensor([4, 0, 4], device="cuda"), mask.cuda(), (slice(2, 40), ), ...]
    for index in indices:
        _same(store[index], on_gpu[index])
    got = store.get_at("x", (torch.tensor([1, 2], device="cuda"), 3))
    assert got.device.type == "cuda" and torch.equal(got.cpu(), local["x"][torch.tensor([1, 2]), 3])
    again = TensorDictStore.from_store(td_id=store.td_id, **real_server.connection_kwargs())
    assert again.device == store.device  # the device is read back from the store
    _same(again[2:5], on_gpu[2:5])
    cpu = TensorDictStore.from_store(td_id=store.td_id, device="cpu", **real_server.connection_kwargs())
    assert cpu["x"].device.type == "cpu" and torch.equal(cpu["x"], local["x"])
    for s in (cpu, again):
        s.close()
    store.clear_redis()
    store.close()


def test_gpu_values_are_written_exactly(real_server):
    local = _local()
    store = TensorDictStore.from_tensordict(local, device="cuda", **real_server.connection_kwargs())
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(64, 5, generator=gen)
    store["w"] = w.cuda()  # a new entry from GPU memory
    local["w"] = w
    rows = TensorDict(x=_random((6, 16, 16), torch.float32, gen), y=torch.arange(100, 106), batch_size=[6])
    store[3:9] = rows.cuda()
    local[3:9] = rows
    idx = torch.tensor([10, 20, 10, 30])
    more = TensorDict(x=_random((4, 16, 16), torch.float32, gen), y=torch.arange(200, 204), batch_size=[4])
    store[idx.cuda()] = more.cuda()
    local[idx] = more
    mask = torch.zeros(64, dtype=torch.bool)
    mask[40:50:2] = True
    store[mask.cuda()] = TensorDict(y=torch.full((5,), -1, device="cuda"), batch_size=[5])
    local[mask] = TensorDict(y=torch.full((5,), -1), batch_size=[5])
    store.update_(TensorDict(w=(w * 2).cuda(), batch_size=[64]))
    local["w"] = w * 2
    _same(store.to_tensordict(), local.to("cuda"))
    store.clear_redis()
    store.close()


@pytest.mark.parametrize("chunk_bytes", [None, 8 * 1024 * 1024])
def test_large_entry_reads_into_pinned_memory(real_server, chunk_bytes, monkeypatch, request):
    """Entries past READ_MIN are read in pieces into a pinned buffer, then copied to the GPU."""
    pinned: list[bool] = []
    empty_buffer = _large.empty_buffer

    def watched(nbytes, device):
        buf = empty_buffer(nbytes, device)
        pinned.append(buf.is_pinned())
        return buf

    monkeypatch.setattr(_large, "empty_buffer", watched)
    n = _large.READ_MIN // 4096 + 512  # rows of 1024 float32: past READ_MIN
    value = torch.randn(n, 1024, generator=torch.Generator().manual_seed(2))
    kw = {} if chunk_bytes is None else {"chunk_bytes": chunk_bytes}
    store = TensorDictStore(batch_size=[n], device="cuda", **real_server.connection_kwargs(), **kw)
    store["big"] = value.cuda()
    got = store["big"]
    assert got.device.type == "cuda" and torch.equal(got.cpu(), value)
    whole = store.to_tensordict()
    assert torch.equal(whole["big"].cpu(), value)
    record(request, reads=len(pinned), pinned=sum(pinned))
    assert pinned and all(pinned)
    rows = store[1000:1000 + 4096]["big"]  # an indexed read of many rows
    assert rows.device.type == "cuda" and torch.equal(rows.cpu(), value[1000:1000 + 4096])
    store.clear_redis()
    store.close()


def test_random_reads_and_writes_match_a_gpu_tensordict(real_server, request):
    """Seeded random shapes, dtypes and indices: the store (device cuda) against a TensorDict on the GPU."""
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    cases = 0
    for _ in range(12):
        bs = tuple(rng.randint(1, 6) for _ in range(rng.randint(1, 2)))
        local = TensorDict(
            {f"k{i}": _random(bs + tuple(rng.randint(1, 3) for _ in range(rng.randint(0, 2))), rng.choice(DTYPES), gen)
             for i in range(3)},
            batch_size=bs,
        ).to("cuda")
        store = TensorDictStore.from_tensordict(local, device="cuda", **real_server.connection_kwargs())
        for _ in range(25):
            dim0 = bs[0]
            kind = rng.randrange(4)
            if kind == 0:
                index = rng.randrange(-dim0, dim0)
            elif kind == 1:
                a = rng.randrange(dim0)
                index = slice(a, rng.randrange(a, dim0 + 1), rng.randint(1, 3))
            elif kind == 2:
                index = torch.tensor([rng.randrange(dim0) for _ in range(rng.randint(1, 5))], device="cuda")
            else:
                index = torch.rand(bs, generator=gen).cuda() > 0.5
            want = local[index]
            _same(store[index], want)
            if want.numel():
                new = TensorDict(
                    {k: _random(tuple(v.shape), v.dtype, gen).cuda() for k, v in want.items()}, batch_size=want.batch_size
                )
                if kind == 2:  # duplicate indices: the last one wins, in torch and in the store
                    index = torch.unique(index)
                    new = new[: len(index)]
                store[index] = new
                local[index] = new
                _same(store.to_tensordict(), local)
            cases += 1
        store.clear_redis()
        store.close()
    record(request, cases=cases)
    assert cases == 12 * 25
