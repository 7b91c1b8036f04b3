"""Reconnecting after a lost connection: a bounded, documented retry policy.

redis-py opens a fresh connection on the next command after a broken one (a server
restart, a dropped socket). What it cannot know is whether a command that was in flight
when the connection broke was applied. :class:`RetryPolicy` says how often and how long a
store tries again, and :func:`classify` which failures may be retried (the table is
:data:`tdstore._backend.translate.RETRY_RULES`):

- the connection could not be opened (``connecting to ...`` refused or timed out), the
  server answered ``LOADING`` (still replaying its AOF after a restart) or ``BUSY`` (another
  client's script runs past ``busy-reply-threshold``): nothing was sent or applied, so any
  operation is tried again;
- the connection broke while a command was in flight: the server ran the whole script or
  MULTI/EXEC or none of it, but the client cannot tell which. Idempotent operations (reads,
  whole-entry writes, indexed writes of given values, deletes of the whole store) are sent
  again; the others (``extend``, read-modify-writes such as ``apply_``, ``del_``/``rename``,
  batch size and names changes, creating a store) raise :class:`OutcomeUnknownError` instead of risking a double apply.

See docs/guarantees.md, "Server restarts".
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, fields
from typing import Any

from tdstore._backend.translate import retry_class
from tdstore.errors import OutcomeUnknownError, ServerUnavailableError

__all__ = [
    "RetryPolicy",
    "DEFAULT_RETRY",
    "NO_RETRY",
    "ServerUnavailableError",
    "OutcomeUnknownError",
    "resolve_policy",
    "classify",
]


@dataclass(frozen=True)
class RetryPolicy:
    """How a store retries an operation whose connection failed.

    Args:
        attempts: Tries in all, the first included (``1`` never retries).
        backoff_base: Seconds before the second try; doubled before each later one.
        backoff_cap: The most seconds between two tries.
        deadline: Seconds after the first failure past which no new try starts.

    The wait before try ``k`` (``k >= 2``) is ``min(backoff_cap, backoff_base * 2**(k-2))``
    scaled by a random factor in [0.5, 1] (jitter, so that many clients do not reconnect in
    step). Each try is also bounded by the store's ``timeout``.
    """

    attempts: int = 8
    backoff_base: float = 0.05
    backoff_cap: float = 2.0
    deadline: float = 15.0

    def __post_init__(self) -> None:
        if not isinstance(self.attempts, int) or isinstance(self.attempts, bool) or self.attempts < 1:
            raise ValueError(f"RetryPolicy.attempts must be an int >= 1, got {self.attempts!r}")
        for name in ("backoff_base", "backoff_cap", "deadline"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"RetryPolicy.{name} must be a number >= 0, got {value!r}")

    def delay(self, attempt: int) -> float:
        """Seconds to wait after failed try number ``attempt`` (1-based)."""
        raw = min(self.backoff_cap, self.backoff_base * 2.0 ** (attempt - 1))
        return raw * random.uniform(0.5, 1.0)

    def describe(self) -> str:
        return (
            f"RetryPolicy(attempts={self.attempts}, backoff_base={self.backoff_base}, "
            f"backoff_cap={self.backoff_cap}, deadline={self.deadline})"
        )

    @classmethod
    def from_env(cls, text: str | None = None) -> RetryPolicy:
        """The default policy, with fields overridden by ``TDSTORE_RETRY``.

        ``TDSTORE_RETRY="attempts=3,deadline=5"`` (any fields, comma-separated);
        ``TDSTORE_RETRY=off`` means one try only.
        """
        text = os.environ.get("TDSTORE_RETRY", "") if text is None else text
        text = text.strip()
        if not text:
            return cls()
        if text.lower() in ("off", "0", "none", "no"):
            return cls(attempts=1)
        names = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for part in text.split(","):
            name, sep, raw = part.partition("=")
            name = name.strip()
            if not sep or name not in names:
                raise ValueError(
                    f"TDSTORE_RETRY={text!r}: expected comma-separated name=value with names "
                    f"{sorted(names)}, or 'off'"
                )
            try:
                values[name] = int(raw) if name == "attempts" else float(raw)
            except ValueError:
                raise ValueError(f"TDSTORE_RETRY={text!r}: {name} must be a number, got {raw.strip()!r}") from None
        return cls(**values)


#: The policy of a store created without ``retry=`` (and without ``TDSTORE_RETRY``).
DEFAULT_RETRY = RetryPolicy()
#: One try only: every connection failure reaches the caller at once.
NO_RETRY = RetryPolicy(attempts=1)


def resolve_policy(retry: RetryPolicy | int | bool | None) -> RetryPolicy:
    """``retry=`` of a store: a RetryPolicy, an int (attempts), False/0 (no retry) or None (default)."""
    if retry is None:
        return RetryPolicy.from_env()
    if isinstance(retry, RetryPolicy):
        return retry
    if retry is False:
        return NO_RETRY
    if isinstance(retry, int) and not isinstance(retry, bool):
        return RetryPolicy(attempts=max(1, retry))
    raise TypeError(
        f"retry= takes a tdstore.RetryPolicy, an int (tries in all) or False, got {type(retry).__name__}; "
        "tdstore manages reconnection itself (redis-py's own Retry objects are not used)"
    )


#: Which failures may be retried: the table is :data:`tdstore._backend.translate.RETRY_RULES`.
classify = retry_class


def sleep_before_retry(policy: RetryPolicy, attempt: int, started: float) -> bool:
    """Waits before try ``attempt + 1``; False when the policy allows no further try."""
    if attempt >= policy.attempts:
        return False
    pause = policy.delay(attempt)
    if time.monotonic() + pause - started > policy.deadline:
        return False
    time.sleep(pause)
    return True
