"""Shared-buffer primitives: an atomic ring-buffer append and sampling of valid rows.

``extend`` reserves rows through a cursor kept on the server and writes them in the same
script (``lua/extend.lua``): many processes can append to one preallocated buffer
(``from_schema``) at once and never get the same rows, never leave a gap, and never
expose a half-written row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch
from tensordict import TensorDictBase
from tensordict.utils import is_non_tensor, is_tensorclass

from tdstore._backend import ops as _backend
from tdstore._backend.optimistic import optimistic
from tdstore._core import codec as _codec
from tdstore._core.keys import as_path as _as_path
from tdstore._core.keys import encode_path
from tdstore.errors import SchemaError
from tdstore.store.host import DenseBase

if TYPE_CHECKING:
    from tdstore.store import TensorDictStore

__all__ = ["RingState", "RingBufferAPI"]


class RingState(NamedTuple):
    """The ring buffer's counters, read from the server in one step."""

    valid: int  #: rows holding appended data: min(total, capacity)
    total: int  #: rows ever appended
    capacity: int  #: the size of the first batch dim
    cursor: int  #: the row the next append starts at (total % capacity)


async def _extend(
    client: Any, conn: Any, groups: list[tuple[tuple[str, ...], int, Any]], lv: int, n: int, capacity: int,
    sub: tuple[str, ...] = (),
) -> int:
    keys = [conn.keys.meta, conn.keys.wv, conn.keys.ring]
    args: list[Any] = [str(lv), str(n), str(capacity)]
    for path, row_bytes, payload in groups:
        chunking = conn.keys.chunks.get(path)
        keys.extend(conn.keys.entry_keys(path, chunking))
        args.append(str(row_bytes))
        args.append(str(chunking.size) if chunking is not None else "0")
        args.append(payload)
    args.append("a:" + encode_path(sub))  # counts the appends into this sub-store (see lua/extend.lua)
    return int(await conn.runner.call(client, "extend", keys, args))


class RingBufferAPI(DenseBase):
    """Ring-buffer methods of :class:`~tdstore.TensorDictStore` (a mixin)."""

    def extend(self: TensorDictStore, td: Any) -> torch.Tensor:  # type: ignore[misc]
        """Appends the rows of ``td`` along the first batch dim, atomically; returns their indices.

        The rows go to ``(cursor + i) % capacity``: the buffer wraps around its first batch
        dim. ``td`` must hold every tensor entry of the store, with the store's row shapes
        (dtypes are cast). Concurrent ``extend`` calls from any process get disjoint rows.
        Non-tensor entries are not appended: a ``td`` holding one, or a store with a per-row
        non-tensor entry, is refused with a :class:`~tdstore.errors.SchemaError` and nothing
        is written. An append does not conflict with a read-modify-write (``apply_``, ``+=``)
        on a sub-store whose entries it does not write.

        Examples:
            >>> import torch
            >>> from tensordict import TensorDict
            >>> from tdstore import TensorDictStore
            >>> buf = TensorDictStore.from_schema({"x": ([2], torch.float32)}, batch_size=[4])
            >>> buf.extend(TensorDict(x=torch.ones(3, 2), batch_size=[3]))
            tensor([0, 1, 2])
            >>> buf.extend(TensorDict(x=torch.full((2, 2), 2.0), batch_size=[2]))
            tensor([3, 0])
            >>> buf.ring_state()
            RingState(valid=4, total=5, capacity=4, cursor=1)
            >>> buf.clear_redis()
            >>> buf.close()
        """
        if is_tensorclass(td):
            td = td._tensordict
        if not isinstance(td, TensorDictBase):
            raise TypeError(f"extend() takes a TensorDict, got {type(td).__name__}")
        conn = self._conn

        def once(_attempt: int) -> torch.Tensor:
            layout = self._layout()
            batch = torch.Size(self._node(layout).batch_size or ())
            if not batch:
                raise SchemaError(f"extend() needs a store with a batch dim; {self._where()} has none")
            capacity = batch[0]
            n = td.batch_size[0] if td.batch_dims else 0
            if td.batch_dims == 0 or td.batch_size[1:] != batch[1:]:
                raise SchemaError(
                    f"extend() into {self._where()} takes rows of batch shape [n, {', '.join(map(str, batch[1:]))}]"
                    f"; got batch_size={list(td.batch_size)}"
                )
            if not 1 <= n <= capacity:
                raise SchemaError(f"extend() appends 1 to {capacity} rows at once into {self._where()}, got {n}")
            leaves = {p: m for p, m in self._descendants(layout, self._path) if m.is_tensor}
            # non-tensor columns are not appended: refuse rather than leave old values beside new rows
            non_tensor = [k for k, v in td.items(True, False) if is_non_tensor(v)]
            per_row = [p for p, m in self._descendants(layout, self._path) if m.is_non_tensor and m.stack]
            if non_tensor or per_row:
                key = _as_path(non_tensor[0]) if non_tensor else per_row[0][len(self._path) :]
                name = key[0] if len(key) == 1 else key
                why = (
                    f"td holds the non-tensor entry {name!r}" if non_tensor
                    else f"its non-tensor entry {name!r} holds one value per row, which the new rows would not get"
                )
                raise SchemaError(
                    f"extend() into {self._where()} appends tensor entries only, and {why}. Nothing was "
                    "written; write non-tensor columns with store[rows] = td"
                )
            given = {self._path + (k if isinstance(k, tuple) else (k,)) for k in td.keys(True, True)}
            if set(leaves) != given:
                missing = sorted(map(str, set(leaves) - given))
                extra = sorted(map(str, given - set(leaves)))
                raise SchemaError(
                    f"extend() writes every tensor entry of {self._where()} at once: missing {missing}, unknown {extra}"
                )
            groups = []
            keep = []
            nb = len(batch)
            for path, meta in leaves.items():
                dtype = meta.torch_dtype
                feat = tuple((meta.shape or ())[nb:])
                value = td.get(path[len(self._path) :])
                if tuple(value.shape) != (n,) + tuple(batch[1:]) + feat:
                    raise SchemaError(
                        f"extend(): entry {path!r} of {self._where()} takes rows of shape "
                        f"{list(batch[1:]) + list(feat)}, got {list(value.shape[1:])}"
                    )
                flat, view = _codec.tensor_view(value.to(dtype))
                keep.append(flat)
                row_bytes = _codec.tensor_nbytes(tuple(batch[1:]) + feat, dtype)
                groups.append((path, row_bytes, view))
            # not idempotent: a re-sent extend would take rows twice
            start = conn.run(lambda c: _extend(c, conn, groups, layout.lv, n, capacity, self._path), idempotent=False)
            return (start + torch.arange(n)) % capacity

        return optimistic(once, where=self._where, what="extend()", on_stale=lambda: self._layout(refresh=True))

    def ring_state(self: TensorDictStore) -> RingState:  # type: ignore[misc]
        """How many rows are valid, how many were ever appended, and where the cursor is."""
        conn = self._conn

        async def read(client: Any) -> Any:
            def build(pipe: Any) -> None:
                pipe.get(conn.keys.ring)
                pipe.hget(conn.keys.meta, "lv")

            return await _backend.read_snapshot(client, conn.keys, build)

        cursor, lv = conn.run(read)
        if lv is None:
            raise self._not_found()
        total = int(cursor or 0)
        capacity = self.batch_size[0] if self.batch_dims else 0
        return RingState(min(total, capacity), total, capacity, total % capacity if capacity else 0)

    def sample(self: TensorDictStore, n: int, *, generator: torch.Generator | None = None) -> Any:  # type: ignore[misc]
        """Reads ``n`` random rows (with replacement) among the valid ones; one consistent snapshot.

        Raises:
            ValueError: when no row was appended yet.
        """
        state = self.ring_state()
        if state.valid == 0:
            raise ValueError(f"sample() from {self._where()}: no row was appended yet (extend() first)")
        idx = torch.randint(0, state.valid, (n,), generator=generator)
        return self[idx]
