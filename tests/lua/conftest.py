"""Fixtures of the Lua script tests: the Lua versions to run under, and the in-memory shim."""

from __future__ import annotations

from typing import TypeVar

import pytest

from .shim import LUA_VERSIONS, LuaRedis
from .test_scripts import OTHER

_R = TypeVar("_R", bound=LuaRedis)


def with_neighbour(shim: _R) -> _R:
    """``shim`` holding the neighbour store :data:`~tests.lua.test_scripts.OTHER`, which no script may touch."""
    for key, value in OTHER.items():
        shim.data[key] = dict(value) if isinstance(value, dict) else value
    return shim


@pytest.fixture(params=LUA_VERSIONS, ids=[f"lua{v}" for v in LUA_VERSIONS])
def lua_version(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def r() -> LuaRedis:
    """The in-memory shim, with the neighbour store."""
    return with_neighbour(LuaRedis())
