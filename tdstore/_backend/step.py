"""A read as data, and the two drivers that send it.

A :class:`ReadStep` is one server step of a read-only operation: the commands to send, how
they go (one script call, one packet, or one consistent snapshot), and the parser of their
replies. It does no I/O. Two drivers send any step: :func:`run_async`, on the asyncio client of
the IO loop, and :func:`run_blocking`, on the blocking client from the calling thread
(``Connection.read_step`` tries the second, then the first). Both send the same commands; the
asyncio driver also deals with what the blocking one gives up on (a script the server forgot,
a MULTI refused over maxmemory), so a failed blocking try is simply sent again the other way.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import redis.exceptions

from tdstore._backend import placed as _placed
from tdstore._backend.blocking import exchange, transaction
from tdstore._backend.protocols import AsyncClient, AsyncPipeline, SyncClient
from tdstore._backend.scripts import ScriptRunner
from tdstore._backend.translate import translate
from tdstore._core.keys import StoreKeys
from tdstore._core.layout import Arg, Command

__all__ = ["ReadStep", "Split", "SPLIT_MIN", "with_prefix", "run_async", "run_blocking", "read_snapshot"]

T = TypeVar("T")


@dataclass(frozen=True)
class ReadStep(Generic[T]):
    """One server step of a read: ``how`` it goes, its ``commands`` and ``parse`` of their replies.

    - ``"script"``: one EVALSHA of the script ``script`` = (name, keys, args); ``commands`` is
      empty and ``parse`` gets ``[the script's reply]``.
    - ``"packet"``: ``commands`` in one packet, no transaction (reads whose order is enough:
      a version read after the data, which only grows).
    - ``"snapshot"``: ``commands`` in one MULTI/EXEC (on a server over its maxmemory, which
      refuses a MULTI, a pipeline bracketed by the store's versions: see ``read_snapshot``).

    ``parse`` gets the replies with errors as values, in the order of ``commands``.

    ``placed`` (a packet or a snapshot), when given, makes where large replies may be
    received for one sending: ``(targets, parse)``, ``targets[i]`` the memory of command
    ``i``'s reply, and ``parse`` the parser of the replies of that sending, where a reply
    received into its target is :data:`~tdstore._backend.placed.PLACED` (the blocking
    driver's :func:`~tdstore._backend.placed.exchange`; the asyncio driver uses ``parse``).
    """

    how: Literal["script", "packet", "snapshot"]
    parse: Callable[[list[Any]], T]
    commands: Sequence[Command] = ()
    script: tuple[str, list[str], list[Arg]] | None = None
    placed: Callable[[], tuple[Mapping[int, memoryview], Callable[[list[object]], T]]] | None = None
    split: Split | None = None


@dataclass(frozen=True)
class Split:
    """How a snapshot of many commands may go without queueing them all in a MULTI: its
    first ``head`` commands in one MULTI, its last ``tail`` in another, those between them
    plain, in the same packet (the blocking driver's placed read alone; MULTI's queueing
    costs the server about 3 us a command, a third of a 21 KB GETRANGE's time). ``holds``
    gets the replies (as one MULTI's would be) and says whether the two MULTIs show that
    nothing those between read was written meanwhile; if not, the snapshot is read again
    in one MULTI. Only for steps of at least :data:`SPLIT_MIN` commands between."""

    head: int
    tail: int
    holds: Callable[[list[object]], bool]


#: The fewest commands between the two MULTIs of a :class:`Split` step: below, one MULTI
#: costs the server about what the two do.
SPLIT_MIN = 32


def with_prefix(
    step: ReadStep[T], prefix: Sequence[Command], sink: Callable[[list[object]], None],
    bracket: tuple[Sequence[Command], Callable[[list[object], list[object]], bool]] | None = None,
) -> ReadStep[T]:
    """``step`` with the read commands ``prefix`` first, in the same snapshot: ``sink`` gets
    their replies (errors as values) before ``step`` parses its own. A ``"packet"`` step
    becomes a snapshot (a stronger guarantee than its order); a ``"script"`` one stays as it
    is, without the prefix, and ``sink`` is then not called.

    ``bracket`` ``(suffix, holds)``: the read commands ``suffix`` go last, and the step may be
    sent as a :class:`Split`, ``prefix`` and ``suffix`` each in a MULTI of its own and
    ``step``'s commands plain between them, when ``holds(prefix replies, suffix replies)``
    says that nothing ``step`` reads was written in between (else it goes again in one
    MULTI). ``sink`` then gets the prefix's replies and the suffix's after them."""
    if not prefix or step.how == "script":
        return step
    count = len(prefix)
    suffix, holds = bracket if bracket is not None and step.placed is not None else ((), None)
    tail = len(suffix)

    def prefixed(inner: Callable[[list[object]], T]) -> Callable[[list[object]], T]:
        def parse(replies: list[object]) -> T:
            sink(replies[:count] + replies[len(replies) - tail :])
            return inner(replies[count : len(replies) - tail])

        return parse

    placed = None
    inner_placed = step.placed
    if inner_placed is not None:

        def placed() -> tuple[Mapping[int, memoryview], Callable[[list[object]], T]]:
            assert inner_placed is not None
            targets, parse = inner_placed()
            return {i + count: view for i, view in targets.items()}, prefixed(parse)

    split = None
    if holds is not None:
        check = holds

        def bracketed(replies: list[object]) -> bool:
            return check(replies[:count], replies[len(replies) - tail :])

        split = Split(count, tail, bracketed)
    return ReadStep("snapshot", prefixed(step.parse), [*prefix, *step.commands, *suffix], placed=placed, split=split)


async def _exec(pipe: AsyncPipeline) -> list[Any]:
    try:
        return await pipe.execute(raise_on_error=False)
    except redis.exceptions.ResponseError as err:
        exc = translate(err)
        if exc is err:
            raise
        raise exc from err


async def read_snapshot(client: AsyncClient, keys: StoreKeys, build: Callable[[AsyncPipeline], None]) -> list[Any]:
    """Runs the read commands that ``build(pipe)`` queues as one consistent snapshot.

    Normally one MULTI/EXEC. A server over its ``maxmemory`` refuses to queue any command
    in a MULTI (Redis 7 and Valkey do, reads included); the reads then run as a plain
    pipeline bracketed by the store's write and layout versions, and are retried until
    both are the same before and after, so no write came in between.
    """
    from tdstore.errors import StaleLayoutError

    try:
        async with client.pipeline(transaction=True) as pipe:
            build(pipe)
            return await _exec(pipe)
    except (redis.exceptions.OutOfMemoryError, redis.exceptions.ExecAbortError):
        # the refused transaction can leave its EXEC reply unread: start from fresh connections
        await client.connection_pool.disconnect()
    for _ in range(50):
        async with client.pipeline(transaction=False) as pipe:
            pipe.get(keys.wv)
            pipe.hget(keys.meta, "lv")
            build(pipe)
            pipe.get(keys.wv)
            pipe.hget(keys.meta, "lv")
            replies = await pipe.execute(raise_on_error=False)
        if replies[:2] == replies[-2:]:
            return replies[2:-2]
    raise StaleLayoutError(f"the store at {keys.base} kept changing during a read")


async def run_async(client: AsyncClient, keys: StoreKeys, runner: ScriptRunner | None, step: ReadStep[T]) -> T:
    """``step`` on an asyncio client: a script reloaded and called again after NOSCRIPT, a
    snapshot's scripts too (``runner.run_pipeline``; ``runner`` None for a snapshot that calls
    no script)."""
    if step.how == "script":
        assert step.script is not None and runner is not None
        name, script_keys, args = step.script
        return step.parse([await runner.call(client, name, script_keys, args)])

    def build(pipe: AsyncPipeline) -> None:
        for command in step.commands:
            pipe.execute_command(*command)

    if step.how == "packet":
        async with client.pipeline(transaction=False) as pipe:
            build(pipe)
            return step.parse(await _exec(pipe))
    if runner is None:
        return step.parse(await read_snapshot(client, keys, build))
    # reads: nothing to undo before a NOSCRIPT retry
    return step.parse(await runner.run_pipeline(client, lambda: read_snapshot(client, keys, build)))


def run_blocking(client: SyncClient, runner: ScriptRunner | None, step: ReadStep[T]) -> T:
    """``step`` on a blocking client, from the calling thread. Anything unusual (a script the
    server forgot, a MULTI refused) raises: the caller then sends the step through
    :func:`run_async`, which deals with it."""
    if step.how == "script":
        assert step.script is not None and runner is not None
        name, script_keys, args = step.script
        return step.parse([client.evalsha(runner.sha(name), len(script_keys), *script_keys, *args)])
    if step.placed is not None and _placed.usable(client):
        targets, parse = step.placed()
        commands = list(step.commands)
        split = step.split
        if step.how == "snapshot" and split is not None and len(commands) - split.head - split.tail >= SPLIT_MIN:
            replies = _placed.exchange(client, commands, targets, transaction=True, split=(split.head, split.tail))
            if split.holds(replies):
                return parse(replies)
            targets, parse = step.placed()  # (something was written meanwhile: again, in one MULTI)
        return parse(_placed.exchange(client, commands, targets, transaction=step.how == "snapshot"))
    if step.how == "packet":
        return step.parse(exchange(client, list(step.commands)))
    return step.parse(transaction(client, list(step.commands)))
