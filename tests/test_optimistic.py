"""The one optimistic retry loop (tdstore._backend.optimistic): tries, backoff, give-up message."""

from __future__ import annotations

import pytest
import torch

from tdstore import TensorDictStore
from tdstore._backend.optimistic import Retry, optimistic
from tdstore.errors import StaleLayoutError, WriteConflictError


def _recorder() -> tuple[list[tuple[str, int]], object, object]:
    events: list[tuple[str, int]] = []

    def backoff(attempt: int) -> None:
        events.append(("backoff", attempt))

    def on_stale() -> None:
        events.append(("refresh", -1))

    return events, backoff, on_stale


def test_returns_first_success_and_passes_attempt_numbers() -> None:
    events, backoff, on_stale = _recorder()
    seen: list[int] = []

    def body(attempt: int) -> str:
        seen.append(attempt)
        if attempt < 2:
            raise StaleLayoutError("stale")
        return "done"

    assert optimistic(body, where="store 'x'", what="a write", on_stale=on_stale, backoff=backoff) == "done"
    assert seen == [0, 1, 2]
    assert events == [("backoff", 0), ("refresh", -1), ("backoff", 1), ("refresh", -1)]


def test_retry_signal_now_or_stale() -> None:
    events, backoff, on_stale = _recorder()

    def body(attempt: int) -> int:
        if attempt == 0:
            raise Retry()  # again at once: no backoff, no refresh
        if attempt == 1:
            raise Retry(stale=True)  # as a StaleLayoutError
        return attempt

    assert optimistic(body, where="s", what="w", on_stale=on_stale, backoff=backoff) == 2
    assert events == [("backoff", 1), ("refresh", -1)]


def test_gives_up_with_one_message() -> None:
    calls = []

    def body(attempt: int) -> None:
        calls.append(attempt)
        raise StaleLayoutError("stale")

    with pytest.raises(StaleLayoutError) as info:
        optimistic(body, where=lambda: "store 'abc'", what="an indexed write", tries=5, backoff=lambda a: None)
    assert calls == [0, 1, 2, 3, 4]
    assert str(info.value) == "the layout of store 'abc' kept changing during an indexed write; gave up after 5 tries"
    assert info.value.gave_up  # type: ignore[attr-defined]


def test_give_up_error_class_and_retry_on() -> None:
    def body(attempt: int) -> None:
        raise WriteConflictError("lost")

    with pytest.raises(WriteConflictError, match=r"kept changing during add_\(\); gave up after 3 tries"):
        optimistic(body, where="s", what="add_()", tries=3, retry_on=(WriteConflictError,), error=WriteConflictError,
                   backoff=lambda a: None)
    # not in retry_on: raised at once
    calls = []

    def other(attempt: int) -> None:
        calls.append(attempt)
        raise StaleLayoutError("stale")

    with pytest.raises(StaleLayoutError, match="^stale$"):
        optimistic(other, where="s", what="a read", retry_on=())
    assert calls == [0]


def test_inner_give_up_is_not_retried() -> None:
    calls = []

    def inner(attempt: int) -> None:
        raise StaleLayoutError("stale")

    def outer(attempt: int) -> None:
        calls.append(attempt)
        optimistic(inner, where="s", what="a read", tries=2, backoff=lambda a: None)

    with pytest.raises(StaleLayoutError, match="during a read; gave up after 2 tries"):
        optimistic(outer, where="s", what="a write", tries=50, backoff=lambda a: None)
    assert calls == [0]


def test_other_errors_pass_through() -> None:
    calls = []

    def body(attempt: int) -> None:
        calls.append(attempt)
        raise KeyError("k")

    with pytest.raises(KeyError):
        optimistic(body, where="s", what="a write")
    assert calls == [0]


def _stale_forever(store: TensorDictStore) -> None:
    """The handle keeps planning with a layout one version behind the server's (as if every
    refresh lost a race with another writer): the server refuses each commit as stale."""
    layout = store._layout(refresh=True)
    stale = type(layout)(layout.lv - 1, layout.meta, layout.entries)
    store._layout = lambda refresh=False: stale  # type: ignore[method-assign]


def test_write_gives_up_naming_store_and_operation(server) -> None:  # type: ignore[no-untyped-def]
    conn = server.connection_kwargs()
    store = TensorDictStore.from_dict({"a": torch.arange(4.0)}, batch_size=[4], **conn)
    other = TensorDictStore.from_store(td_id=store._td_id, **conn)
    store["b"] = torch.zeros(4)  # the layout is now at a newer version than the first one
    _stale_forever(other)
    with pytest.raises(StaleLayoutError) as info:
        other["a"] = torch.ones(4)
    msg = str(info.value)
    assert store._where() in msg and "during a write" in msg and "gave up after 200 tries" in msg, msg
    with pytest.raises(StaleLayoutError, match="during an indexed write; gave up after 200 tries"):
        other[1:3] = {"a": torch.ones(2), "b": torch.ones(2)}
    fresh = store.to_tensordict()
    assert torch.equal(fresh["a"], torch.arange(4.0)) and torch.equal(fresh["b"], torch.zeros(4))
    other.close()
    store.close()


def test_lazy_writes_give_up_naming_store_and_operation(server) -> None:  # type: ignore[no-untyped-def]
    from tensordict import LazyStackedTensorDict, TensorDict

    from tdstore import LazyStackedTensorDictStore

    conn = server.connection_kwargs()
    ref = LazyStackedTensorDict(*[TensorDict({"a": torch.full((j + 1,), float(j))}, []) for j in range(3)], stack_dim=0)
    store = LazyStackedTensorDictStore.from_lazy_stack(ref, **conn)
    other = LazyStackedTensorDictStore.from_store(td_id=store.td_id, **conn)
    store.rename_key_("a", "b")  # the layout is now at a newer version than the first one
    _stale_forever(other)  # type: ignore[arg-type]
    with pytest.raises(StaleLayoutError) as info:
        other.del_("b")
    msg = str(info.value)
    assert other._where() in msg and "during a write; gave up after 200 tries" in msg, msg
    got = store.tensordicts
    assert [td["b"].tolist() for td in got] == [[0.0], [1.0, 1.0], [2.0, 2.0, 2.0]]
    other.close()
    store.close()


def test_lease_wait_is_bounded_by_the_clock(monkeypatch: pytest.MonkeyPatch) -> None:
    """A writer refused by a reader's lease waits at most WRITER_WAIT_MAX by the clock: the
    attempts' own time counts (before, only the sleeps were summed, so slow attempts stretched
    the wait well past the bound)."""
    import time

    from tdstore._backend import lease as _lease

    monkeypatch.setattr(_lease, "WRITER_WAIT_MAX", 0.3)
    attempts = []

    def attempt(n: int) -> None:
        attempts.append(n)
        time.sleep(0.05)  # a slow round trip
        err = StaleLayoutError("a read lease holds the layout")
        err.lease_busy = 60_000  # type: ignore[attr-defined]
        raise err

    t0 = time.monotonic()
    with pytest.raises(StaleLayoutError):
        optimistic(attempt, where="s", what="w", tries=2, backoff=lambda _n: None)
    took = time.monotonic() - t0
    assert took < 0.3 + 0.05 * 2 + 0.1, took  # the bound, the last attempts, slack
    assert len(attempts) >= 3  # it did wait on the lease (attempts past the 2 tries)
