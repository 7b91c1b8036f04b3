"""The ``tdstore`` command (also ``python -m tdstore``): see :mod:`tdstore.cli.commands`."""

from __future__ import annotations

from tdstore.cli.commands import CliError, ConnOptions, build_parser, conn_options, main

__all__ = ["CliError", "ConnOptions", "build_parser", "conn_options", "main"]
