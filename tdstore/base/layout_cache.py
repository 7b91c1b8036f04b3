"""The identity and cached layout of a store handle, shared by TensorDictStore and
LazyStackedTensorDictStore.

A handle keeps the last layout it read on its :class:`~tdstore._backend.connection.Connection`
(shared with its nested sub-handles). :meth:`LayoutCache._layout` returns it, or reads it
again when asked to (or when metadata caching is off); :meth:`LayoutCache._fresh_layout`
first checks it against the server's layout version (one small round trip). Every layout
read from the server goes through the host class's ``_check_layout`` before it is used.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from tdstore._backend import lifecycle as _lifecycle
from tdstore._backend import ops as _backend
from tdstore._backend.optimistic import optimistic
from tdstore._core.layout import Entry
from tdstore.base.host import SharedBase
from tdstore.errors import CorruptMetadataError, DataLostError, EntryNotFoundError, FormatVersionError

__all__ = ["LayoutCache"]

_T = TypeVar("_T")

#: Layout reads a refresh makes while other threads' writes keep dropping the cache under it.
_CACHE_TRIES = 3


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


class LayoutCache(SharedBase):
    """Mixin: the store's identity and layout cache (needs ``_conn``, ``_path``,
    ``_cache_metadata``, ``_not_found()`` and ``_check_layout()`` on the host class)."""

    _cleared_meta: dict[str, str] | None

    @property
    def td_id(self) -> str:
        """The id of this store on the server: pass it to ``from_store`` in another process."""
        return self._conn.keys.td_id

    @property
    def prefix(self) -> str:
        return self._conn.keys.prefix

    def _where(self) -> str:
        where = f"td_id={self.td_id!r}, prefix={self.prefix!r} on {self._conn.describe()}"
        if self._path:
            where += f", nested key {self._path!r}"
        return where

    def _entry(self, path: tuple[str, ...]) -> Entry | None:
        """The registry metadata of ``path``, or None; a miss in the cache is checked against
        the server's layout version first (another client may have added it since)."""
        meta = self._layout().entries.get(path)
        if meta is None and self._cache_metadata:
            meta = self._fresh_layout().entries.get(path)
        return meta

    def _key_error(self, path: tuple[str, ...]) -> EntryNotFoundError:
        rel = path[len(self._path) :]
        shown = rel[0] if len(rel) == 1 else rel
        return EntryNotFoundError(
            f'key "{shown}" not found in {type(self).__name__}({self._where()}) with keys '
            f"{sorted(map(str, self._key_list(False, False, None)))}"
        )

    def _layout(self, refresh: bool = False) -> _backend.Layout:
        conn = self._conn
        cached = conn.layout  # one read: another thread may drop or replace it meanwhile
        if refresh or cached is None or not self._cache_metadata:
            for _ in range(_CACHE_TRIES):
                epoch = conn.layout_epoch
                layout = conn.read_step(lambda _runner: _backend.layout_step(conn.keys))
                if layout is None:
                    conn.layout = None
                    raise self._not_found()
                self._check_layout(layout)
                # cached only when no write dropped the cache since the read began (it would
                # be older than that write). Read again when it was not: the key names of
                # chunked entries (StoreKeys.chunks) follow the cached layout
                if conn.cache_layout(layout, epoch):
                    break
            assert layout is not None  # _CACHE_TRIES >= 1, and a missing store raised above
            return layout
        return cached

    def _fresh_layout(self) -> _backend.Layout:
        """The layout, checked against the server's version (one small round trip)."""
        conn = self._conn
        cached = conn.layout
        if self._cache_metadata and cached is not None:
            lv = conn.read_step(lambda _runner: _backend.layout_version_step(conn.keys))
            if lv is None:
                conn.layout = None
                raise self._not_found()
            if lv == cached.lv:
                return cached
            if lv < cached.lv:
                conn.layout = None  # the store was deleted and made again meanwhile
        return self._layout(refresh=True)

    def _replan_if_stale(self, plan: Callable[[_backend.Layout], _T], layout: _backend.Layout) -> tuple[_T, _backend.Layout]:
        """``plan(layout)``; when it refuses (a missing key, a shape that does not fit), the
        refusal is checked against the server's layout version first (one small round trip):
        a layout changed by another client meanwhile is read again and planned with instead,
        so a stale cache never refuses an operation the store accepts."""
        try:
            return plan(layout), layout
        except (KeyError, ValueError, RuntimeError, TypeError):
            conn = self._conn
            lv = conn.read_step(lambda _runner: _backend.layout_version_step(conn.keys))
            if lv is None or lv == layout.lv:
                raise
        layout = self._layout(refresh=True)
        return plan(layout), layout

    def _check_store_meta(self, layout: _backend.Layout, what: str) -> None:
        """The checks every kind of store makes: the format version, and a registry that is
        still all there (see :func:`tdstore._backend.ops.registry_lost`). ``what`` names the store."""
        fmt = layout.meta.get("fmt")
        if fmt != _backend.FORMAT_VERSION:
            raise FormatVersionError(
                f"store {what} was written in format {fmt!r}; this tdstore reads format {_backend.FORMAT_VERSION!r}"
            )
        if _backend.registry_lost(layout):
            raise DataLostError(
                f"the entry registry of {what} is gone from the server (evicted under a maxmemory policy, "
                f"or deleted by hand): it held {layout.meta['ne']} entries, {len(layout.entries)} remain"
            )

    def _check_on_cleared(self, check: Callable[[_backend.Layout], object]) -> None:
        """After clear_redis() on this handle: runs ``check(layout)`` (a write's planning) against
        the empty store that the write would re-create, so that a write that fails validation
        raises before the store is re-created (nothing is sent). When another handle has
        re-created the store meanwhile, the write plans against that one instead."""
        meta = self._cleared_meta
        if meta is None or self._path:
            return
        try:
            check(_backend.Layout(0, dict(meta), {}))
        except Exception:
            conn = self._conn
            if conn.read_step(lambda _runner: _backend.layout_version_step(conn.keys)) is None:
                raise
            self._cleared_meta = None

    def _clear_store(self) -> dict[str, str] | None:
        """Deletes every key of the store in one step (the clear script, retried while the
        layout changes under it); returns the meta hash it deleted, or None when there was
        no store.

        It works on a store whose bookkeeping is damaged too (evicted or edited by hand; no
        format check either): the store's keys are found with SCAN, or on a Redis Cluster
        with ``CLUSTER GETKEYSINSLOT`` in the store's one slot
        (:func:`tdstore._backend.lifecycle.wipe`), so that users can always clean up."""
        conn = self._conn

        def once(_attempt: int) -> dict[str, str] | None:
            layout: _backend.Layout | None
            try:
                layout = conn.read_step(lambda _runner: _backend.layout_step(conn.keys))
            except (CorruptMetadataError, DataLostError, ValueError, TypeError, KeyError, AttributeError):
                # metadata that does not parse or is implausible: wipe() finds the keys itself
                layout = None
            cluster_node = conn.cluster_route is not None
            deleted = conn.run(lambda c: _lifecycle.wipe(c, conn.keys, conn.runner, cluster_node=cluster_node))
            conn.layout = None
            if layout is None or "lv" not in layout.meta or not deleted:
                return None
            return dict(layout.meta)

        return optimistic(once, where=self._where, what="clear_redis()")
