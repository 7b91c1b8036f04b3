"""Unit tests of the server-side Lua scripts (``lua/*.lua``), run under lupa.

This directory is a package so that its module names (``lua.test_scripts``, ...) cannot
collide with test modules of the same base name elsewhere under ``tests/``.
"""
