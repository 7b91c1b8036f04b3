"""Progress bars for long transfers, and the switches that turn them on and off.

Uploads and downloads that last more than about a second (``from_tensordict``,
``to_tensordict``, a large ``from_schema``) show a one-line bar on stderr when stderr is a
terminal, and stay quiet otherwise. Whether a transfer shows one is decided, first match
wins, by:

1. the ``progress=`` argument of the call or of the store (``True``: always, ``False``: never);
2. the process-wide switch :func:`set_progress` (``True``, ``False``, or ``None`` to defer);
3. the environment variable ``TDSTORE_PROGRESS`` (``0``/``false``/``off`` or ``1``/``true``/``on``);
4. automatic: on when stderr is a terminal and the transfer moves at least
   :data:`AUTO_MIN_BYTES`; the bar then appears only once the transfer has lasted
   :data:`AUTO_DELAY_S` seconds, so short transfers print nothing.

A transfer with a bar moves its bytes in chunks (see :mod:`tdstore._backend.transfer`) so the bar
can advance; the server still applies it in one atomic step. The bar is drawn by tdstore
itself (no dependency): a ``\\r``-rewritten line, throttled to about 10 updates a second.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, TextIO

__all__ = ["Progress", "set_progress", "get_progress", "enabled", "start", "stderr_is_tty"]

#: Automatic mode: transfers smaller than this never show a bar.
AUTO_MIN_BYTES = 16 * 1024 * 1024
#: Automatic mode: the bar appears only after the transfer has lasted this long.
AUTO_DELAY_S = 1.0
#: Seconds between two redraws of the bar.
REDRAW_S = 0.1

_switch: bool | None = None
_TRUE = {"1", "true", "on", "yes"}
_FALSE = {"0", "false", "off", "no"}


def set_progress(enabled: bool | None) -> None:
    """Turns progress bars on (``True``) or off (``False``) for the whole process.

    ``None`` restores the default: the ``TDSTORE_PROGRESS`` environment variable if set,
    else automatic (a bar on a terminal, for transfers longer than about a second). A
    ``progress=`` argument given to a store or a call still wins over this switch.

    Examples:
        >>> import tdstore
        >>> tdstore.set_progress(False)   # e.g. in a batch job that logs stderr
        >>> tdstore.set_progress(None)    # back to automatic
    """
    global _switch
    if enabled is not None and not isinstance(enabled, bool):
        raise TypeError(f"set_progress expects True, False or None, got {enabled!r}")
    _switch = enabled


def get_progress() -> bool | None:
    """The process-wide switch: ``True``, ``False``, or ``None`` (environment, then automatic)."""
    return _switch


def _from_env() -> bool | None:
    value = os.environ.get("TDSTORE_PROGRESS", "").strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    return None


def enabled(*choices: bool | None) -> bool | None:
    """The first of ``choices``, the switch and the environment that is not None (None: automatic)."""
    for choice in (*choices, _switch, _from_env()):
        if choice is not None:
            if not isinstance(choice, bool):
                raise TypeError(f"progress must be True, False or None, got {choice!r}")
            return choice
    return None


def _is_tty(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def stderr_is_tty() -> bool:
    """Whether ``sys.stderr`` is a terminal (automatic mode shows bars only there)."""
    return sys.stderr is not None and _is_tty(sys.stderr)


def start(total: int, what: str, *choices: bool | None, stream: TextIO | None = None) -> Progress | None:
    """A bar for a transfer of ``total`` bytes, or None when this transfer shows none.

    ``choices``: the ``progress=`` arguments in order of precedence (call, then store).
    """
    choice = enabled(*choices)
    if choice is False:
        return None
    stream = stream if stream is not None else sys.stderr
    if stream is None:
        return None
    if choice is None:
        if total < AUTO_MIN_BYTES or not _is_tty(stream):
            return None
        return Progress(total, what, stream, delay=AUTO_DELAY_S)
    return Progress(total, what, stream, delay=0.0)


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class Progress:
    """A one-line progress bar of a transfer of ``total`` bytes, drawn on ``stream``.

    :meth:`update` may be called from any thread (the IO loop calls it); the line is drawn
    at most every :data:`REDRAW_S` seconds, and not before ``delay`` seconds have passed.
    :meth:`close` draws the final state (when anything was drawn) and ends the line.
    """

    WIDTH = 24

    def __init__(self, total: int, what: str, stream: TextIO, *, delay: float = 0.0) -> None:
        self.total = max(int(total), 0)
        self.what = what
        self.stream = stream
        self.delay = delay
        self.done = 0
        self.started = time.monotonic()
        self.shown = False
        self.closed = False
        self._last_draw = 0.0
        self._lock = threading.Lock()

    def update(self, nbytes: int) -> None:
        """Counts ``nbytes`` more bytes moved; redraws when due."""
        with self._lock:
            self.done += int(nbytes)
            now = time.monotonic()
            if self.closed or now - self.started < self.delay or now - self._last_draw < REDRAW_S:
                return
            self._draw(now)

    def restart(self, what: str) -> None:
        """Starts counting again from 0 under a new label (a read that must be done again)."""
        with self._lock:
            self.done = 0
            self.what = what

    def set_status(self, what: str) -> None:
        """Replaces the label (e.g. "committing"), redrawn at the next update or at close."""
        with self._lock:
            self.what = what

    def close(self) -> None:
        """Draws the final line (when the bar was shown) and ends it with a newline."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            if self.shown or (self.delay == 0.0):
                self._draw(time.monotonic())
                self._write("\n")

    def _draw(self, now: float) -> None:
        self._last_draw = now
        self.shown = True
        elapsed = max(now - self.started, 1e-9)
        frac = min(self.done / self.total, 1.0) if self.total else 1.0
        filled = int(frac * self.WIDTH)
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        line = (
            f"\rtdstore {self.what}: {frac * 100:3.0f}% |{bar}| {_size(self.done)}/{_size(self.total)} "
            f"{_size(self.done / elapsed)}/s {elapsed:.1f}s"
        )
        self._write(line)

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)
            self.stream.flush()
        except (OSError, ValueError):  # a closed or broken stream must not break the transfer
            pass

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
