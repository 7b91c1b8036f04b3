"""The ``tdstore`` command (also ``python -m tdstore``)."""

from __future__ import annotations

import sys

USAGE = """\
usage: python -m tdstore <command> [options]

commands:
  demo    start a private server and run a shared replay-buffer demo on it
          (python -m tdstore demo --help for its options)
"""


def main(argv: list[str] | None = None) -> int:
    """Runs the command named in ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help", "help"):
        print(USAGE, end="")
        return 0
    if not args:
        print(USAGE, end="", file=sys.stderr)
        return 2
    command, rest = args[0], args[1:]
    if command == "demo":
        from tdstore.demo import main as demo_main

        return demo_main(rest)
    print(f"tdstore: unknown command {command!r}", file=sys.stderr)
    print(USAGE, end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
