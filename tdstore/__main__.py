"""``python -m tdstore``: the ``tdstore`` command (see :mod:`tdstore.cli`)."""

from __future__ import annotations

import sys

from tdstore.cli import main

__all__ = ["main"]

if __name__ == "__main__":
    sys.exit(main())
