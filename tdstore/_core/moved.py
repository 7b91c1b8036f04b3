"""The module names of tdstore before its layer packages, so that pickles made by them still load.

A pickle names the module of each class and function it holds (``tdstore._store_api._unpickle``,
``tdstore._retry.RetryPolicy``, ...). Those modules moved into ``tdstore._core``, ``tdstore._backend``,
``tdstore.store``, ``tdstore.base``, ``tdstore.lazy``, ``tdstore.server`` and ``tdstore.cli``; this finder answers an
import of an old name with the module at its new place (the same module object, not a copy).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
from types import ModuleType

#: old module name -> the module that holds its code now
MOVED: dict[str, str] = {
    "tdstore._keys": "tdstore._core.keys",
    "tdstore._codec": "tdstore._core.codec",
    "tdstore._values": "tdstore._core.values",
    "tdstore._chunks": "tdstore._core.chunks",
    "tdstore._indexing": "tdstore._core.indexing",
    "tdstore._planner": "tdstore._core.planner",
    "tdstore._progress": "tdstore._core.progress",
    "tdstore._io": "tdstore._backend.loop",
    "tdstore._scripts": "tdstore._backend.scripts",
    "tdstore._connection": "tdstore._backend.connection",
    "tdstore._retry": "tdstore._backend.retry",
    "tdstore._backend": "tdstore._backend.ops",
    "tdstore._run_reads": "tdstore._backend.reads",
    "tdstore._armed_write": "tdstore._backend.armed_write",
    "tdstore._large": "tdstore._backend.large",
    "tdstore._transfer": "tdstore._backend.transfer",
    "tdstore._cluster": "tdstore._backend.cluster",
    "tdstore._credentials": "tdstore._backend.credentials",
    "tdstore._store_api": "tdstore.store.core",
    "tdstore._reads": "tdstore.store.reads",
    "tdstore._index_write": "tdstore.store.index_write",
    "tdstore._ring": "tdstore.store.ring",
    "tdstore._lifetime": "tdstore.store.lifetime",
    "tdstore._compat": "tdstore.base.compat",
    "tdstore._views": "tdstore.base.views",
    "tdstore._unsupported": "tdstore.base.unsupported",
    "tdstore._layout_cache": "tdstore.base.layout_cache",
    "tdstore._lazy_keys": "tdstore.lazy.writes",
    "tdstore._lazy_read": "tdstore.lazy.reads",
    "tdstore._lazy_plan": "tdstore.lazy.plan",
    "tdstore._lazy_write": "tdstore.lazy.index_plan",
    "tdstore._server_find": "tdstore.server.find",
    "tdstore._server_start": "tdstore.server.start",
    "tdstore._server_cluster": "tdstore.server.cluster",
    "tdstore._cli_bench": "tdstore.cli.bench",
    "tdstore._cli_inspect": "tdstore.cli.stores",
    "tdstore._cli_serve": "tdstore.cli.serve",
    "tdstore.demo": "tdstore.cli.demo",
    "tdstore.store.handle": "tdstore.base.handle",
    "tdstore.store.layout_cache": "tdstore.base.layout_cache",
    "tdstore.store.unsupported": "tdstore.base.unsupported",
    "tdstore.store.compat": "tdstore.base.compat",
    "tdstore.store.views": "tdstore.base.views",
    "tdstore.store.host": "tdstore.base.host",
    "tdstore.store.api": "tdstore.store.core",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: object = None, target: object = None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        return importlib.import_module(MOVED[spec.name])

    def exec_module(self, module: ModuleType) -> None:
        pass  # the module at its new place is already executed


def install() -> None:
    """Puts the finder on ``sys.meta_path`` once (``import tdstore`` calls it)."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.append(_MovedModules())
