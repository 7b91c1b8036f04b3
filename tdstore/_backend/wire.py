"""Commands sent in one packet on one of redis-py's connections, below its command API.

redis-py sends the commands of a WATCHing pipeline one round trip each; the checks a step
makes between its WATCH and its MULTI are sent here at once instead, on the connection the
pipeline holds (``pipe.connection``).
"""

from __future__ import annotations

from typing import Any

import redis.exceptions

__all__ = ["exchange"]


async def exchange(connection: Any, commands: list[tuple[Any, ...]]) -> list[Any]:
    """Sends ``commands`` in one packet and reads their replies; an error reply is returned in
    place. Any other failure (a timeout, a broken connection) disconnects the connection, so
    that no reply of this packet is read as another command's."""
    try:
        await connection.send_packed_command(connection.pack_commands(commands), check_health=False)
        out: list[Any] = []
        for _ in commands:
            try:
                out.append(await connection.read_response())
            except redis.exceptions.ResponseError as err:
                out.append(err)
        return out
    except BaseException:
        await connection.disconnect()
        raise
