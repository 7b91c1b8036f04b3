"""Reads of a store (a mixin of TensorDictStore): whole entries, snapshots, indexed rows, and
the in-memory results and handles made from them (``empty``, ``to``, ``flatten_keys``,
``unflatten_keys``).

Also the read-modify-write path (``_inplace_on_copies``): it reads a snapshot and writes
back with a compare-and-set, so it lives with the snapshot reads.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from tensordict import NonTensorData, NonTensorStack, TensorDict, TensorDictBase

from tdstore._backend import append as _append
from tdstore._backend import large as _large
from tdstore._backend import ops as _backend
from tdstore._backend import reads as _run_reads
from tdstore._backend import step as _step
from tdstore._backend import transfer as _transfer
from tdstore._backend.lease import ReadLease
from tdstore._backend.optimistic import Retry, optimistic
from tdstore._core import codec as _codec
from tdstore._core import values as _values
from tdstore._core.indexing import RowSpans, consumed_dims, contiguous_rows, normalize_index, select_rows
from tdstore._core.keys import as_path as _as_path
from tdstore._core.keys import encode_path
from tdstore._core.progress import Progress
from tdstore._core.values import is_no_default
from tdstore.base.host import DenseBase
from tdstore.errors import CorruptMetadataError, DataLostError, StaleLayoutError, WriteConflictError

if TYPE_CHECKING:
    from tensordict.utils import DeviceType, IndexType

    from tdstore._backend.protocols import AsyncClient
    from tdstore._backend.scripts import ScriptRunner
    from tdstore._backend.step import ReadStep
    from tdstore._core.layout import Command

__all__ = ["StoreReads"]

_MAX_CAS_RETRIES = 1000
#: Optimistic tries of a whole-store read before it reads layout and data in one step
#: (see docs/guarantees.md, "Reads under layout churn").
ONE_STEP_AFTER = 3
#: ... and an indexed read, for stores of at most this many bytes (read whole, then indexed).
ONE_STEP_MAX_BYTES = 64 * 2**20
#: A whole-store read of tensor entries of at most this many bytes in all, none chunked, goes
#: on the direct client (no hop to the IO loop: half of to_tensordict()'s time for small stores)
_DIRECT_SNAPSHOT_MAX = 1 << 20


def _large_sizes(layout: _backend.Layout, paths: list[tuple[str, ...]]) -> dict[tuple[str, ...], int]:
    """The byte size of each tensor entry among ``paths`` as the cached layout tells it."""
    out = {}
    for path in paths:
        meta = layout.entries.get(path)
        if meta is not None and meta.is_tensor:
            out[path] = meta.nbytes
    return out


def _has_large(large: dict[tuple[str, ...], int]) -> bool:
    """Whether an entry is large enough to be read in pieces (see tdstore/_backend/large.py)."""
    return any(n >= _large.READ_MIN for n in large.values())


class StoreReads(DenseBase):
    """Read methods of :class:`~tdstore.TensorDictStore`."""

    def _read_values(self, paths: list[tuple[str, ...]]) -> list[object]:
        conn = self._conn
        # one pass (never retried): the entries come with their metadata, so a layout that
        # changed since the cached one is only refreshed, for the owners' batch sizes.
        # Hints only, without I/O: a stale or missing cached layout just reads whole
        cached = conn.layout  # read once: another thread may drop it meanwhile
        large = _large_sizes(cached, paths) if cached is not None else {}
        device = self._cached_device()

        async def read(c: AsyncClient) -> _backend.EntriesRead:
            return await _backend.read_entries(c, conn.keys, paths, large=large, device=device)

        # on the direct client from the calling thread (large entries received straight into
        # their tensors); None when that try did not settle it: through the IO loop then
        got = conn.read(lambda c, _r: _backend.read_entries_direct(c, conn.keys, paths, False, large=large, device=device), read)
        lv, metas, blobs, _ = got if got is not None else conn.run(read)
        if lv is None:
            raise self._not_found()
        layout = self._layout()
        if lv != layout.lv:
            layout = self._layout(refresh=True)
        out: list[object] = []
        for path, meta, blob in zip(paths, metas, blobs, strict=True):
            if meta is None:
                raise self._key_error(path)
            meta = _values.check_meta(path, meta, self._where())
            if meta.is_node:
                out.append(self._sub(path))
                continue
            out.append(
                _values.decode_value(
                    path,
                    meta,
                    blob,
                    owner_batch_size=self._owner_batch_size(layout, path),
                    device=self.device,
                    owned=conn.owned_replies,
                    where=self._where(),
                    policy=self._conn.pickle_policy,
                )
            )
        return out

    def _cached_device(self) -> torch.device | None:
        """The store's device as known without I/O (for pinned read buffers); None when unknown."""
        if self._device_override is not None:
            return self._device_override
        layout = self._conn.layout
        dev = layout.meta.get("device") if layout is not None else None
        try:
            return torch.device(dev) if dev else None
        except (RuntimeError, TypeError):
            return None

    def to_tensordict(self, *, retain_none: bool | None = None, progress: bool | None = None) -> TensorDict:
        """Reads the whole store (or nested sub-store) into memory, in one consistent snapshot.

        ``progress``: show a progress bar on stderr (True), never (False), or as the store's
        ``progress=`` and the process-wide switch decide (None; see :func:`tdstore.set_progress`).
        """
        return self._snapshot(progress)[0]

    def _snapshot(self, progress: bool | None = None) -> tuple[TensorDict, _backend.Layout]:
        """The store in memory and the layout it was read at."""
        conn = self._conn
        bar: Progress | None = None
        staged_tries = 0
        one_step = True

        def once(attempt: int) -> tuple[TensorDict, _backend.Layout]:
            nonlocal bar, staged_tries, one_step
            if attempt >= ONE_STEP_AFTER and one_step:
                # writers keep changing the layout between the layout read and the data
                # read: read both in one step (bounded wait, whatever the churn); a large or
                # chunked store takes a read lease instead (optimistic(lease=...))
                got = self._snapshot_one_step()
                if got is not None:
                    if bar is not None:
                        bar.update(bar.total - bar.done)
                    return got
                one_step = False
            layout = self._layout()
            leaves = [(p, m) for p, m in self._descendants(layout, self._path) if m.has_data]
            paths = [p for p, _ in leaves]
            if attempt == 0:
                bar, sizes = _transfer.download_bar(self, leaves, progress)
            elif bar is not None:
                sizes = _transfer.leaf_sizes(leaves)
            if bar is not None and staged_tries < _transfer.STAGED_TRIES:
                # read in chunks so the bar moves; a write in between makes it read again,
                # and after a few tries the one-step read below takes over
                staged_tries += 1
                got = conn.run(lambda c: _transfer.read_staged(c, conn.keys, layout.lv, paths, sizes, bar))
                if got is _transfer.STALE:
                    bar.restart("download (again: the store was written meanwhile)")
                    raise Retry()
                snap, blobs = got
            else:
                # read at the layout planned with: its version with the bytes, not the registry
                # (every registry change bumps the version in its step, docs/guarantees.md 2),
                # so the snapshot is that layout when the version read is its own
                large = _large_sizes(layout, paths)
                device = self._cached_device()

                async def read_all(c: AsyncClient) -> _backend.EntriesRead:
                    return await _backend.read_entries(c, conn.keys, paths, large=large, device=device, under=layout)

                got_all = None
                if _has_large(large) or (
                    sum(large.values()) <= _DIRECT_SNAPSHOT_MAX and not any(m.chunk is not None for _, m in leaves)
                ):
                    # small one-string entries: on the direct client, no hop to the IO loop;
                    # large ones: received there straight into their tensors
                    got_all = conn.read(
                        lambda c, _r: _backend.read_entries_direct(
                            c, conn.keys, paths, False, large=large, device=device, under=layout
                        ),
                        read_all,
                    )
                if got_all is None:
                    got_all = conn.run(read_all)
                lv, _, blobs, _ = got_all
                if lv is None:
                    raise self._not_found()
                if lv != layout.lv:
                    if lv < layout.lv:
                        conn.layout = None  # the store was deleted and made again: a lower version is no older
                    self._layout(refresh=True)
                    raise Retry()
                snap = layout
            if snap is None:
                raise self._not_found()
            if snap.lv != layout.lv:
                self._check_layout(snap)
                conn.layout = snap
                raise Retry()
            if bar is not None and staged_tries >= _transfer.STAGED_TRIES:
                bar.update(bar.total - bar.done)  # read in one step
            return self._build_tensordict(layout, dict(zip(paths, blobs, strict=True))), snap

        try:
            # a body that sees the layout changed raises Retry (no backoff: reading again is the wait)
            lease = ReadLease(conn, lambda: self._leaf_bytes(self._layout()))
            return optimistic(once, where=self._where, what="to_tensordict()", retry_on=(), lease=lease)
        finally:
            if bar is not None:
                bar.close()

    def _leaf_bytes(self, layout: _backend.Layout) -> int:
        """The bytes of the tensor entries under this handle (memoized per layout)."""
        key = ("leaf_bytes", self._path)
        total: int | None = layout.memo.get(key)
        if total is None:
            total = 0
            for _, m in self._descendants(layout, self._path):
                if m.is_tensor:
                    total += m.nbytes
            layout.memo[key] = total
        return total

    def _snapshot_one_step(self) -> tuple[TensorDict, _backend.Layout] | None:
        """The store read with its layout in one server step (the ``read_all`` script);
        None when an entry under this handle is chunked (its strings are not read there) or
        the store holds more than ``_backend.READ_ALL_MAX_BYTES`` (64 MiB)."""
        conn = self._conn
        snap, blobs = conn.run(lambda c: _backend.read_all(c, conn.keys, conn.runner))
        if snap is None:
            raise self._not_found()
        self._check_layout(snap)
        conn.layout = snap  # kept only if no newer layout is cached
        leaves = [(p, m) for p, m in self._descendants(snap, self._path) if m.has_data]
        if blobs is None or any(m.chunk is not None for _, m in leaves):
            return None  # too large for one step, or chunked: the optimistic reads go on
        return self._build_tensordict(snap, {p: blobs.get(p) for p, _ in leaves}), snap

    def _build_tensordict(self, layout: _backend.Layout, blobs: Mapping[tuple[str, ...], bytes | torch.Tensor | None]) -> TensorDict:
        node = self._node(layout)
        device = self.device
        root = TensorDict(batch_size=node.batch_size, device=device, names=node.dim_names)
        n = len(self._path)
        for path, meta in self._descendants(layout, self._path):
            rel = path[n:]
            if meta.is_node:
                sub = TensorDict(batch_size=meta.batch_size, device=device, names=meta.dim_names)
                root._set_tuple(rel, sub, inplace=False, validated=True, non_blocking=False)
                continue
            value = _values.decode_value(
                path,
                meta,
                blobs.get(path),
                owner_batch_size=self._owner_batch_size(layout, path),
                device=device,
                owned=self._conn.owned_replies,
                where=self._where(),
                        policy=self._conn.pickle_policy,
            )
            root._set_tuple(rel, value, inplace=False, validated=True, non_blocking=False)
        return root

    def to_local(self) -> TensorDict:
        """Deprecated alias of :meth:`to_tensordict`."""
        import warnings

        warnings.warn(
            "TensorDictStore.to_local() is deprecated; use to_tensordict()",
            DeprecationWarning,
            stacklevel=2,
        )
        return self.to_tensordict()

    def contiguous(self) -> TensorDict:
        return self.to_tensordict()

    def apply_(self, fn: Callable[..., object], *others: object, **kwargs: object) -> object:
        """Applies ``fn`` to every tensor leaf in place, as one compare-and-set (see _inplace_on_copies)."""

        def apply_(td: TensorDictBase) -> TensorDictBase:
            return td.apply_(fn, *others, **kwargs)

        return self._inplace_on_copies(lambda td: (apply_(td), td)[1])

    def _inplace_on_copies(self, method: Callable[..., object], *args: object, **kwargs: object) -> object:
        """Runs an in-place method (``apply_``, ``+=``, ``mul_`` ...) as a compare-and-set.

        The store is read in one snapshot together with its write version; the method runs
        on that copy, and the changed leaves are written back in one commit that the
        server refuses if any process wrote the store in between. The client then reads
        again and retries, so concurrent read-modify-writes never lose an update.
        """
        conn = self._conn

        def once(_attempt: int) -> object:
            # the append counters and the write version, read before the snapshot: see _cas_versions
            before = conn.run(lambda c: _append.append_counters(c, conn.keys))
            snapshot, snap = self._snapshot()
            leaves = TensorDict(batch_size=snapshot.batch_size, device=snapshot.device)
            for key, value in snapshot.items(True, True):
                if isinstance(value, torch.Tensor):
                    leaves._set_tuple(_as_path(key), value, inplace=False, validated=True, non_blocking=False)
            result = method(leaves, *args, **kwargs)
            if result is not leaves:
                return result
            ops = []
            keep = []
            for key, value in leaves.items(True, True):
                path = self._path + _as_path(key)
                meta = snap.entries[path]
                value = value.to(_codec.entry_dtype(meta))
                if tuple(value.shape) != meta.shape:
                    raise RuntimeError(f"{method.__name__} changed the shape of {path!r} in {self._where()}")
                flat, view = _codec.tensor_view(value)
                keep.append(flat)
                ops.append(_backend.Op("put", path, meta, payload=view))
            if not ops:
                return self
            conn.run(
                lambda c: _backend.commit(
                    c, conn.keys, conn.runner, ops, expected=str(snap.lv), bump=False,
                    check_lock=False, expected_cas=self._cas_versions(snap, *before),
                ),
                idempotent=False,  # a re-sent compare-and-set would re-read and apply twice
            )
            return self

        def backoff(attempt: int) -> None:
            time.sleep(random.uniform(0, 0.002 * min(attempt + 1, 10)))

        name = getattr(method, "__name__", "an in-place method")
        return optimistic(
            once, where=self._where, what=f"{name} (its compare-and-set kept conflicting with other writers)",
            tries=_MAX_CAS_RETRIES, retry_on=(WriteConflictError, StaleLayoutError), backoff=backoff,
        )

    def _cas_versions(self, snap: _backend.Layout, counters: Mapping[bytes | str, bytes | str], wv: bytes | str | int | None) -> str:
        """What the compare-and-set of :meth:`_inplace_on_copies` checks (ARGV[10] of lua/commit.lua).

        Every write but an append, and the appends that wrote entries of this sub-store: those
        into it, into a store above it, or into a sub-store inside it (``extend`` writes every
        tensor entry of the store it is called on). Appends to other sub-stores do not conflict.

        ``counters`` (the append counters, ``keys.appends``) and ``wv`` (the write version)
        are read in one step before the snapshot: both counts only grow, so finding them
        unchanged at the commit means that no write but an append, and no append into the
        entries read, came in since, nor so before the snapshot's bytes.
        """

        def text(x: bytes | str | int) -> str:
            return x.decode() if isinstance(x, bytes) else str(x)

        got = {text(k): text(v) for k, v in counters.items()}
        writes = int(text(wv or 0)) - sum(int(v) for v in got.values())  # less every append
        under = [p for p, m in snap.entries.items() if m.is_node and p[: len(self._path)] == self._path]
        subs = [self._path[:i] for i in range(len(self._path) + 1)] + under
        fields = {f"a:{encode_path(p)}": got.get(f"a:{encode_path(p)}", "") for p in subs}
        return json.dumps({"w": str(writes), "f": fields}, separators=(",", ":"))

    def _read_plan(self, layout: _backend.Layout, only: tuple[str, ...] | None, nb: int) -> list[tuple[Any, ...]]:
        """Per entry read by an index: ``(path, meta, dtype, feature shape, row bytes)``; memoized per layout.

        Tensor entries only carry dtype, feature shape and row bytes (None for non-tensor ones).
        """
        key = ("read_plan", self._path, only, nb)
        plan = layout.memo.get(key)
        if plan is not None:
            return plan
        items = [(only, layout.entries[only])] if only is not None else self._descendants(layout, self._path)
        plan = []
        for path, meta in items:
            if meta.is_tensor:
                dtype = _codec.entry_dtype(meta)
                feat = tuple((meta.shape or ())[nb:])
                plan.append((path, meta, dtype, feat, _codec.tensor_nbytes(feat, dtype)))
            elif meta.is_non_tensor:
                plan.append((path, meta, None, None, None))
        layout.memo[key] = plan
        return plan

    def _read_index(
        self, index: IndexType, only: tuple[str, ...] | None = None,
        prefix: Sequence[Command] = (), sink: Callable[[list[object]], None] | None = None,
        bracket: tuple[Sequence[Command], Callable[[list[object], list[object]], bool]] | None = None,
    ) -> TensorDictBase | torch.Tensor:
        """``self[index]`` (or, ``only``, one entry of it). ``prefix``: read commands sent first
        in the same snapshot as the rows, their replies given to ``sink``; ``bracket``: the
        rows may be read between two MULTIs instead of in one (see
        :func:`~tdstore._backend.step.with_prefix`; a read that ends up another way, such as
        a small store read whole under churn, does not call ``sink``)."""
        conn = self._conn
        asked = index
        index = normalize_index(index)
        device = self.device
        one_step = [True]

        def once(attempt: int) -> TensorDictBase | torch.Tensor:
            if attempt >= ONE_STEP_AFTER and one_step[0] and only is None and self._leaf_bytes(self._layout()) <= ONE_STEP_MAX_BYTES:
                # the layout keeps changing between the plan and the read: a small store is
                # read whole in one step and indexed in memory (bounded wait under churn);
                # a larger one takes a read lease (optimistic(lease=...))
                got = self._snapshot_one_step()
                if got is not None:
                    return got[0][asked]
                one_step[0] = False
            layout = self._layout()
            batch_size = list(self._node(layout).batch_size or ())
            if only is not None and layout.entries[only].is_tensor:
                # get_at may index past the batch dims, into the entry's own dims
                shape = list(layout.entries[only].shape or ())
                batch_size = shape[: max(len(batch_size), consumed_dims(index, len(shape)))]
            nb = len(batch_size)
            block = contiguous_rows(index, batch_size)
            if block is not None:
                # an int or a slice over dim 0: one run of rows, no tensor index math
                rows = None
                spans = RowSpans.block(block[0], block[1])
                nrows, new_bs = block[1], torch.Size(block[2])
            else:
                rows = select_rows(index, torch.Size(batch_size))
                spans = RowSpans(rows)
                nrows, new_bs = rows.numel(), rows.shape
            plan = self._read_plan(layout, only, nb)
            plans: list[tuple[tuple[str, ...], Sequence[tuple[int, int | None]]]] = []
            gathers: list[tuple[int, str] | None] = []
            rows_arg: str | None = None
            for path, _meta, dtype, _feat, row_bytes in plan:
                if dtype is None:
                    plans.append((path, [(0, None)]))
                    gathers.append(None)
                elif row_bytes and rows is not None and _run_reads.choose_read_rows(len(spans), nrows * row_bytes) == "gather":
                    if rows_arg is None:
                        flat = rows.reshape(-1).tolist()
                        rows_arg = " ".join(["%d"] * len(flat)) % tuple(flat)
                    plans.append((path, []))  # read by the gather script
                    gathers.append((row_bytes, rows_arg))
                else:
                    plans.append((path, spans.runs(row_bytes)))
                    gathers.append(None)
            sizes = self._entry_sizes(layout, plan)
            place = conn.owned_replies  # (large runs received into their tensor: tdstore/_backend/placed.py)
            def build(runner: ScriptRunner) -> ReadStep[tuple[int | None, list[list[bytes]]]]:
                step = _run_reads.runs_step(conn.keys, runner, plans, gathers, sizes, place)
                if sink is not None:
                    return _step.with_prefix(step, prefix, sink, bracket)
                if step.how != "snapshot" or step.placed is None or len(step.commands) < _step.SPLIT_MIN:
                    return step
                if conn.split_cool > 0:  # (a read found a write between its two MULTIs lately)
                    conn.split_cool -= 1
                    return step
                head, around = _run_reads.unwritten_bracket(conn.keys, lambda: setattr(conn, "split_cool", _run_reads.SPLIT_COOL))
                return _step.with_prefix(step, head, lambda _replies: None, around)

            try:
                lv, parts = conn.read_step(build)
            except _run_reads.SizeMismatch as bad:
                if bad.lv == layout.lv:
                    raise self._size_error(plan[bad.index], bad) from None
                lv = bad.lv  # planned from a stale layout: read it again
            if lv is None:
                raise self._not_found()
            if lv != layout.lv:
                self._layout(refresh=True)
                raise Retry()
            values: dict[tuple[str, ...], torch.Tensor | TensorDictBase] = {}
            lead = tuple(new_bs)
            for (path, meta, dtype, feat, _row_bytes), chunks in zip(plan, parts, strict=True):
                if dtype is not None:
                    shape = lead + feat
                    owned = conn.owned_replies and len(chunks) == 1
                    data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
                    if len(data) != _codec.tensor_nbytes(shape, dtype):
                        raise DataLostError(
                            f"entry {path!r} of {self._where()} is registered but its bytes are gone "
                            "from the server (evicted under a maxmemory policy, or deleted by hand)"
                        )
                    tensor = _codec.tensor_from_reply(data, dtype, shape, owned=owned or len(chunks) > 1)
                    if device is not None and device.type != "cpu":
                        tensor = _values.to_device(tensor, device, path, self._where())
                    values[path] = tensor
                else:
                    full = _values.decode_value(
                        # an empty reply: the key is gone (a stored non-tensor value is never empty)
                        path, meta, chunks[0] or None, owner_batch_size=self._owner_batch_size(layout, path),
                        device=device, owned=False, where=self._where(),
                        policy=self._conn.pickle_policy,
                    )
                    if isinstance(full, NonTensorStack):
                        values[path] = full[index]
                    else:
                        values[path] = NonTensorData(data=full.data, batch_size=new_bs, device=device)
            if only is not None:
                return values[only]
            return self._assemble(layout, new_bs, nb, values)

        return optimistic(once, where=self._where, what="an indexed read", retry_on=(), lease=ReadLease(conn))

    @staticmethod
    def _entry_sizes(layout: _backend.Layout, plan: list[tuple[Any, ...]]) -> list[int | None]:
        """The byte size of each tensor entry of a read plan (None for non-tensor ones)."""
        key = ("sizes", id(plan))
        sizes = layout.memo.get(key)
        if sizes is None:
            sizes = layout.memo[key] = [
                meta.nbytes if dtype is not None else None
                for _path, meta, dtype, _feat, _row in plan
            ]
        return sizes

    def _size_error(self, item: tuple[Any, ...], bad: _run_reads.SizeMismatch) -> Exception:
        """What a whole read says of an entry whose string has another length than its metadata."""
        path, meta, dtype = item[0], item[1], item[2]
        if bad.got == 0:
            return DataLostError(
                f"entry {path!r} of {self._where()} is registered but its bytes are gone "
                "from the server (evicted under a maxmemory policy, or deleted by hand)"
            )
        what = "bytes" if meta.chunk is None else "bytes in its last chunk"
        return CorruptMetadataError(
            f"entry {path!r} of {self._where()}: expected {bad.expected} {what} for {dtype} {list(meta.shape)}, "
            f"got {bad.got}"
        )

    def _assemble(self, layout: _backend.Layout, new_bs: torch.Size, nb: int, values: Mapping[tuple[str, ...], object]) -> TensorDict:
        """The TensorDict of an indexed read, built without per-key validation (shapes are known)."""
        n = len(self._path)
        device = self.device
        out = TensorDict._new_unsafe(batch_size=new_bs, device=device)
        nodes: dict[tuple[str, ...], TensorDict] = {(): out}
        # descendants come parents first (sorted by depth)
        for path, meta in self._descendants(layout, self._path):
            rel = path[n:]
            parent = nodes[rel[:-1]]
            if meta.is_node:
                sub_bs = torch.Size(tuple(new_bs) + tuple((meta.batch_size or ())[nb:]))
                sub = nodes[rel] = TensorDict._new_unsafe(batch_size=sub_bs, device=device)
                parent._tensordict[rel[-1]] = sub
            else:
                parent._tensordict[rel[-1]] = values[path]
        return out

    # ------------------------------------------------------------------ in-memory copies and handles
    def empty(
        self, recurse: bool = False, *, batch_size: Sequence[int] | None = None, device: DeviceType | None = None,
        names: Sequence[str | None] | None = None,
    ) -> TensorDictBase:
        """An empty in-memory ``TensorDict`` with this store's batch size, device and names.

        The results of ``apply``, arithmetic (``store + 1``) and the other methods that
        build a new tensordict are filled into it, so they are in-memory ``TensorDict``
        objects: nothing is created on the server behind the user's back. Use
        ``clone()`` for a copy on the server.
        """
        from tensordict import TensorDict as _TD

        if is_no_default(device) or device is None:
            device = self.device
        if is_no_default(names):
            names = None
        if is_no_default(batch_size) or batch_size is None:
            batch_size = self.batch_size
        if names is None and batch_size == self.batch_size and self._has_names():
            names = self.names
        out = _TD(batch_size=batch_size, device=device, names=names)
        if recurse:
            layout = self._layout()
            n = len(self._path)
            for path, meta in self._descendants(layout, self._path):
                if meta.is_node:
                    out._set_tuple(path[n:], _TD(batch_size=meta.batch_size, device=device), inplace=False, validated=True, non_blocking=False)
        return out

    def to(self, *args: object, **kwargs: Any) -> TensorDictBase:
        """``to(device)`` gives a handle that reads onto ``device``; other casts give a TensorDict."""
        device = kwargs.pop("device", None)
        rest = []
        for arg in args:
            if isinstance(arg, (str, torch.device, int)) and device is None and not isinstance(arg, bool):
                device = torch.device(arg)
            else:
                rest.append(arg)
        if rest or kwargs:
            return self.to_tensordict().to(*rest, **({"device": device} if device is not None else {}), **kwargs)
        if device is None:
            return self
        return type(self)._handle(self._conn, self._path, torch.device(device), self._cache_metadata, self._backend_label)

    def flatten_keys(self, separator: str = ".", inplace: bool = False, is_leaf: Callable[[type], bool] | None = None) -> TensorDictBase:
        """An in-memory copy with nested keys joined by ``separator`` (read with to_tensordict())."""
        if inplace:
            raise ValueError(
                "flatten_keys(inplace=True) is not supported on a TensorDictStore; "
                "use store.to_tensordict().flatten_keys(...)"
            )
        return self.to_tensordict().flatten_keys(separator, is_leaf=is_leaf)

    def unflatten_keys(self, separator: str = ".", inplace: bool = False, is_leaf: Callable[[type], bool] | None = None) -> TensorDictBase:
        """An in-memory copy with keys split on ``separator`` into nested ones."""
        if inplace:
            raise ValueError(
                "unflatten_keys(inplace=True) is not supported on a TensorDictStore; "
                "use store.to_tensordict().unflatten_keys(...)"
            )
        return self.to_tensordict().unflatten_keys(separator)
