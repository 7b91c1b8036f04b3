"""Reads of a LazyStackedTensorDictStore (a mixin): elements, leaves and the whole stack.

Every read of one call comes from one snapshot: the bytes are read in one MULTI (or one
script call) with the layout version, and decoded only if that is the version they were
planned with; otherwise the layout is refreshed and the read planned again.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, TypeVar

import torch
from tensordict import LazyStackedTensorDict, TensorDict, TensorDictBase

from tdstore._backend import ops as _backend
from tdstore._backend import reads as _run_reads
from tdstore._backend.lease import ReadLease
from tdstore._backend.optimistic import Retry, optimistic
from tdstore._core import codec as _codec
from tdstore._core.indexing import leaf_dims, normalize_index
from tdstore._core.keys import as_path as _as_path
from tdstore._core.layout import Entry
from tdstore._core.tdcompat import KeyThroughLeafError, default_covers_leaf
from tdstore._core.values import NO_DEFAULT, is_no_default
from tdstore.base.host import LazyBase
from tdstore.errors import DataLostError, UnsupportedOperationError
from tdstore.lazy import plan

if TYPE_CHECKING:
    from typing import TypeAlias

    from tensordict import NestedKey
    from tensordict.utils import IndexType

    #: how a leaf was read: None (a non-tensor leaf, whole), "gather" or the byte runs read
    _How: TypeAlias = "str | list[tuple[int, int | None]] | None"
    #: ``{path: {element: value}}`` of the leaves read
    _Values: TypeAlias = "dict[tuple[str, ...], Mapping[int, object]]"

__all__ = ["LazyReads"]

_T = TypeVar("_T")

#: Optimistic tries of a whole-stack read before it reads layout and bytes in one step.
ONE_STEP_AFTER = 3


class _Stale(Exception):
    """The bytes were read at another layout version than the one planned with."""


class LazyReads(LazyBase):
    """Read methods of :class:`~tdstore.lazy.LazyStackedTensorDictStore`."""

    # ------------------------------------------------------------------ reads
    def _read_members(
        self, layout: _backend.Layout, paths: list[tuple[str, ...]], members: list[int]
    ) -> _Values:
        """The values of leaves ``paths`` in elements ``members``, read in one snapshot at ``layout``.

        Raises:
            _Stale: the server's layout version is not ``layout.lv``.
        """
        conn = self._conn
        plans: list[tuple[tuple[str, ...], list[tuple[int, int | None]]]] = []
        gathers: list[tuple[int, str] | None] = []
        spans: list[_How] = []
        for path in paths:
            meta = layout.entries[path]
            if meta.kind == "lnt":
                plans.append((path, [(0, None)]))
                gathers.append(None)
                spans.append(None)
                continue
            offsets, sizes = self._spans(layout, path)
            if not meta.is_ragged and sizes[0] and _run_reads.choose_read_rows(len(members), sizes[0] * len(members)) == "gather":
                plans.append((path, []))
                gathers.append((sizes[0], " ".join(map(str, members))))
                spans.append("gather")
                continue
            runs: list[tuple[int, int | None]] = []
            for j in members:
                if not sizes[j]:
                    continue
                last = runs[-1] if runs else None
                if last is not None and last[0] + last[1] == offsets[j]:  # type: ignore[operator]
                    runs[-1] = (last[0], last[1] + sizes[j])  # type: ignore[operator]
                else:
                    runs.append((offsets[j], sizes[j]))
            plans.append((path, runs))
            gathers.append(None)
            spans.append(runs)
        lv, replies = conn.read_step(  # on the calling thread when the transport allows (see Connection.read_step)
            lambda r: _run_reads.runs_step(conn.keys, r, plans, gathers),
        )
        if lv is None:
            raise self._not_found()
        if lv != layout.lv:
            raise _Stale()
        return self._decode(layout, [(path, how, chunks) for (path, _), how, chunks in zip(plans, spans, replies, strict=True)], members)

    def _decode(
        self, layout: _backend.Layout, items: list[tuple[tuple[str, ...], _How, Sequence[bytes | torch.Tensor | None]]], members: list[int]
    ) -> _Values:
        """Element values from the bytes read: ``(path, how, chunks)`` per leaf, where ``how`` is
        None (a non-tensor leaf, read whole), "gather" (the members' bytes in order) or the runs read."""
        bs, s = self._root(layout)
        n = bs[s]
        conn = self._conn
        device = self.device
        out: _Values = {}
        for path, how, chunks in items:
            meta = layout.entries[path]
            owner = self._elem_bs(layout, path[:-1])
            if how is None:
                if chunks[0] is None or not chunks[0]:
                    raise DataLostError(f"entry {path!r} of {self._where()} is registered but its bytes are gone from the server")
                values = plan.decode_nontensor(meta, chunks[0], n, owner, path, self._where(), conn.pickle_policy, device)
                out[path] = {j: values[j] for j in members}
                continue
            dtype = _codec.entry_dtype(meta)
            shapes = self._shapes(layout, path)
            offsets, sizes = self._spans(layout, path)
            found: dict[int, torch.Tensor] = {}
            if how == "gather":
                buf = self._buffer(chunks[0], sizes[0] * len(members), path)
                stacked = _as_tensor(buf, dtype, [len(members), *shapes[0]])
                found = dict(zip(members, stacked.unbind(0), strict=True))
            else:
                item = dtype.itemsize
                runs_iter = iter(zip(how, chunks, strict=True))
                run: Any = None
                for j in members:
                    if not sizes[j]:
                        found[j] = torch.empty(shapes[j], dtype=dtype)
                        continue
                    if run is None or not run[0] <= offsets[j] < run[0] + run[1]:
                        run, data = next(runs_iter)
                        typed = self._buffer(data, run[1], path)
                        typed = typed.view(dtype) if dtype != torch.uint8 else typed
                    rel = (offsets[j] - run[0]) // item
                    part = typed[rel : rel + sizes[j] // item]
                    shape = shapes[j]
                    found[j] = part if len(shape) == 1 else part.reshape(shape)
            if device is not None and device.type != "cpu":
                found = {j: t.to(device) for j, t in found.items()}
            out[path] = found
        return out

    def _buffer(self, data: bytes | memoryview | bytearray | torch.Tensor | None, expected: int, path: tuple[str, ...]) -> torch.Tensor:
        if data is None or len(data) != expected:
            raise DataLostError(
                f"entry {path!r} of {self._where()}: expected {expected} bytes, the server holds "
                f"{0 if data is None else len(data)} (evicted or changed by hand?)"
            )
        if not self._conn.owned_replies or isinstance(data, memoryview) or len(data) <= 1:
            data = bytearray(data)
        return torch.frombuffer(data, dtype=torch.uint8)

    def _lease_bytes(self) -> int:
        """The bytes of the stack's tensor leaves (the length of a read lease, see optimistic())."""
        layout = self._layout()
        return sum(sum(self._spans(layout, p)[1]) for p, m in self._descendants(layout) if m.kind == "lt")

    def _spans(self, layout: _backend.Layout, path: tuple[str, ...]) -> tuple[list[int], list[int]]:
        return self._per_element(layout, "lazy-spans", path, plan.elem_spans)

    def _shapes(self, layout: _backend.Layout, path: tuple[str, ...]) -> list[list[int]]:
        return self._per_element(layout, "lazy-shapes", path, plan.elem_shapes)

    def _per_element(self, layout: _backend.Layout, what: str, path: tuple[str, ...], build: Callable[[Entry, int], _T]) -> _T:
        """``build(meta, n)`` of the leaf ``path`` (``n``: the number of elements), kept in the layout's memo."""
        key = (what, path)
        memo = layout.memo.get(key)
        if memo is None:
            bs, s = self._root(layout)
            memo = layout.memo[key] = build(layout.entries[path], bs[s])
        return memo

    def _memory_stack(self, paths: list[tuple[str, ...]] | None, members: list[int] | None) -> tuple[list[TensorDict], int]:
        """The elements ``members`` (default all) in memory, with leaves ``paths`` (default all)."""

        def once(_attempt: int) -> tuple[list[TensorDict], int]:
            nonlocal members
            layout = self._layout()
            bs, s = self._root(layout)
            if members is None:
                members = list(range(bs[s]))
            entries = self._descendants(layout)
            leaves = [p for p, m in entries if m.has_data] if paths is None else paths
            values = self._read_members(layout, leaves, members)  # _Stale: read again
            if paths is not None:
                wanted = set(paths)
                entries = [(p, m) for p, m in entries if p in wanted or (m.is_node and any(q[: len(p)] == p for q in wanted))]
            tds = plan.decode_members(entries, values, members, self._elem_bs(layout), self._path, self.device)
            return tds, s

        return optimistic(
            once, where=self._where, what="a read", on_stale=lambda: self._layout(refresh=True), retry_on=(_Stale,),
            lease=ReadLease(self._conn, self._lease_bytes),
        )

    def _snapshot(self) -> tuple[LazyStackedTensorDict, _backend.Layout, str]:
        """The stack in memory, its layout and the write version, all read in one snapshot."""
        conn = self._conn

        def once(attempt: int) -> tuple[LazyStackedTensorDict, _backend.Layout, str]:
            by_path: dict[tuple[str, ...], bytes | None] | None = None
            snap: _backend.Layout | None = None
            if attempt >= ONE_STEP_AFTER:
                # writers keep changing the layout between the layout read and the data read:
                # read both in one step (see docs/guarantees.md, "Reads under layout churn");
                # a store of more than READ_ALL_MAX_BYTES keeps to optimistic reads
                snap, by_path = conn.run(lambda c: _backend.read_all(c, conn.keys, conn.runner))
                if snap is None:
                    raise self._not_found()
                self._check_layout(snap)
                conn.layout = snap  # kept only if no newer layout is cached
            if by_path is not None and snap is not None:
                layout = snap
                bs, s = self._root(layout)
                paths = [p for p, m in self._descendants(layout) if m.has_data]
                blobs: list[bytes | torch.Tensor | None] = [by_path.get(p) for p in paths]
            else:
                layout = self._layout()
                bs, s = self._root(layout)
                paths = [p for p, m in self._descendants(layout) if m.has_data]
                _, _, blobs, snap = conn.run(lambda c: _backend.read_entries(c, conn.keys, paths, with_layout=True))
                if snap is None:
                    raise self._not_found()
                if snap.lv != layout.lv:
                    raise Retry(stale=True)  # back off, refresh, read again
            items: list[tuple[tuple[str, ...], _How, Sequence[bytes | torch.Tensor | None]]] = []
            for path, blob in zip(paths, blobs, strict=True):
                if layout.entries[path].kind == "lnt":
                    items.append((path, None, [blob]))
                else:
                    total = sum(self._spans(layout, path)[1])
                    items.append((path, [(0, total)] if total else [], [blob] if total else []))
            members = list(range(bs[s]))
            values = self._decode(layout, items, members)
            tds = plan.decode_members(self._descendants(layout), values, members, self._elem_bs(layout), self._path, self.device)
            return LazyStackedTensorDict(*tds, stack_dim=s), layout, snap.wv

        return optimistic(
            once, where=self._where, what="a read", on_stale=lambda: self._layout(refresh=True), retry_on=(),
            lease=ReadLease(self._conn, self._lease_bytes),
        )

    def to_tensordict(self, *, retain_none: bool | None = None) -> TensorDictBase:
        """Reads the whole stack into memory (one consistent snapshot).

        Returns what ``LazyStackedTensorDict.to_tensordict()`` returns (a dense ``TensorDict``)
        when every element has the same shapes; a ragged stack stays a ``LazyStackedTensorDict``
        (a dense TensorDict cannot hold it).
        """
        tds, s = self._memory_stack(None, None)
        stack = LazyStackedTensorDict(*tds, stack_dim=s)
        if any(m.is_ragged for _, m in self._descendants(self._layout())):
            return stack  # ragged
        try:
            return stack.to_tensordict(retain_none=retain_none)
        except RuntimeError:
            return stack  # shapes that a dense TensorDict cannot hold

    def to_local(self) -> TensorDictBase:
        warnings.warn(
            "LazyStackedTensorDictStore.to_local() is deprecated; use to_tensordict()", DeprecationWarning, stacklevel=2
        )
        return self.to_tensordict()

    def contiguous(self) -> TensorDictBase:
        return self.to_tensordict().contiguous()

    @property
    def tensordicts(self) -> list[TensorDict]:
        """The elements, read into memory (one snapshot)."""
        return self._memory_stack(None, None)[0]

    def __len__(self) -> int:
        bs = self.batch_size
        return bs[0] if bs else 0

    def __getitem__(self, index: Any) -> Any:
        if isinstance(index, str) or (isinstance(index, tuple) and index and all(isinstance(i, str) for i in index)):
            path = self._path + _as_path(index)
            meta = self._entry(path)
            if meta is None:
                raise self._key_error(path)
            if meta.kind == "lnt":
                tds, s = self._memory_stack([path], None)
                return LazyStackedTensorDict(*tds, stack_dim=s)[path[len(self._path) :]]
            return self._get_path(path, NO_DEFAULT)
        if index is Ellipsis or (isinstance(index, tuple) and index == ()):
            return self
        return self._read_index(index)

    def _read_index(self, index: IndexType, view: bool = True) -> TensorDictBase:
        layout = self._layout()
        bs, s = self._root(layout)
        full = self._full_bs(self._elem_bs(layout), layout)
        members, remapped, pick = plan.split_index(index, len(full), s, bs[s])
        tds, _ = self._memory_stack(None, members)
        if isinstance(pick, int):
            if not view:
                return tds[0]
            from tdstore.lazy.element import LazyElement  # one element: reads and writes go to the server

            return LazyElement._attach(tds[0], self, members[0])
        if pick is not None:
            by_id = dict(zip(members, tds, strict=True))
            return LazyStackedTensorDict(*[by_id[j] for j in pick], stack_dim=s)
        return LazyStackedTensorDict(*tds, stack_dim=s)[remapped]

    def get(self, key: NestedKey, *args: object, **kwargs: object) -> object:
        """``get(key)``; ``as_list``, ``as_padded_tensor`` and ``as_nested_tensor`` read ragged leaves."""
        passed = bool(args) or "default" in kwargs
        default = args[0] if args else kwargs.pop("default", None)
        path = self._path + _as_path(key)
        if not kwargs:
            try:
                return self._get_path(path, default)
            except KeyThroughLeafError:
                if passed and default_covers_leaf():  # as TensorDict.get: a default passed is returned instead
                    return default
                raise
        meta = self._entry(path)
        if meta is None:
            return default
        tds, s = self._memory_stack([p for p, m in self._descendants(self._layout(), path) if m.has_data] or [path], None)
        return LazyStackedTensorDict(*tds, stack_dim=s).get(path[len(self._path) :], **kwargs)

    def _get_str(self, key: NestedKey, default: object, **kwargs: object) -> object:
        return self._get_path(self._path + _as_path(key), default)

    _get_tuple = _get_str

    def _get_path(self, path: tuple[str, ...], default: object, fresh: bool = False) -> object:
        meta = self._entry(path)
        if not fresh and (meta is None or meta.is_node or meta.is_ragged):
            # no bytes are read on these paths to carry the layout version: check it first
            self._fresh_layout()
            return self._get_path(path, default, fresh=True)
        if meta is None:
            self._check_not_through_leaf(path)
            if is_no_default(default):
                raise self._key_error(path)
            return default
        if meta.is_node:
            return type(self)._handle(self._conn, path, self._device_override, self._cache_metadata)
        if meta.kind == "lnt":
            tds, s = self._memory_stack([path], None)
            return LazyStackedTensorDict(*tds, stack_dim=s).get(path[len(self._path) :])
        if meta.is_ragged:
            raise UnsupportedOperationError(
                f"entry {_shown(path[len(self._path):])!r} of {self._where()} is ragged (its elements differ in shape: "
                f"{_shape_summary(meta)}), so it is not one tensor. Read it with "
                f"store.get({_shown(path[len(self._path):])!r}, as_list=True) (or as_nested_tensor=True / "
                "as_padded_tensor=True), element by element with store[j], or as a whole with "
                "store.to_tensordict()"
            )

        def once(_attempt: int) -> object:
            layout = self._layout()
            meta = layout.entries.get(path)
            if meta is None or meta.kind != "lt" or meta.shape is None:
                return self._get_path(path, default)
            bs, s = self._root(layout)
            conn = self._conn
            lv, replies = conn.run(lambda c: _run_reads.read_runs(c, conn.keys, conn.runner, [(path, [(0, None)])]))
            if lv != layout.lv:
                if lv is None:
                    raise self._not_found()
                raise Retry(stale=True)  # back off, refresh, read again
            dtype = _codec.entry_dtype(meta)
            nbytes = meta.nbytes * bs[s]
            raw = self._buffer(replies[0][0], nbytes, path) if nbytes else torch.empty(0, dtype=torch.uint8)
            tensor = _as_tensor(raw, dtype, [bs[s], *meta.shape]).movedim(0, s)
            if s:
                tensor = tensor.contiguous()
            device = self.device
            return tensor.to(device) if device is not None and device.type != "cpu" else tensor

        return optimistic(
            once, where=self._where, what="a read", on_stale=lambda: self._layout(refresh=True), retry_on=(),
            lease=ReadLease(self._conn, self._lease_bytes),
        )

    def _get_at_str(self, key: NestedKey, idx: IndexType, default: object = NO_DEFAULT, **kwargs: object) -> object:
        path = self._path + _as_path(key)
        meta = self._entry_or_default(path, default)
        if meta is None:
            return default
        if meta.kind == "lt" and meta.shape is not None:
            nb = self.batch_dims
            if leaf_dims(normalize_index(idx), nb, 1 + len(meta.shape)) > nb:
                # the index reaches the leaf's own dims (`...` expands over all of them), as
                # LazyStackedTensorDict.get_at does: index the leaf, not the stack
                tds, s = self._memory_stack([path], None)
                return LazyStackedTensorDict(*tds, stack_dim=s).get_at(path[len(self._path) :], idx)
        return self._read_index(idx)[key]

    _get_at_tuple = _get_at_str


def _as_tensor(raw: torch.Tensor, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
    if math.prod(shape) == 0:
        return torch.empty(tuple(shape), dtype=dtype)
    return (raw.view(dtype) if dtype != torch.uint8 else raw).reshape(tuple(shape))


def _shape_summary(meta: Entry) -> str:
    shapes = meta.shapes or ()
    shown = ", ".join(str(list(s)) for s in shapes[:4])
    return shown + (f", ... ({len(shapes)} elements)" if len(shapes) > 4 else "")


def _shown(rel: tuple[str, ...]) -> str | tuple[str, ...]:
    return rel[0] if len(rel) == 1 else rel
