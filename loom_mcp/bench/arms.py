"""The server's end of a connection to a benchmark process (the timer, the proof process):
one JSON object a line each way, and nothing the other end sends is trusted."""

from __future__ import annotations

import json

import anyio
from anyio.abc import SocketStream
from anyio.streams.buffered import BufferedByteReceiveStream


class ArmConnection:
    def __init__(self, stream: SocketStream, role: str) -> None:
        self.stream = stream
        self.reader = BufferedByteReceiveStream(stream)
        self.role = role

    async def ask(self, command: dict, timeout_s: float) -> dict:
        await self.send(command)
        return await self.receive(timeout_s)

    async def send(self, command: dict) -> None:
        try:
            await self.stream.send((json.dumps(command) + "\n").encode())
        except (anyio.BrokenResourceError, anyio.ClosedResourceError) as exc:
            raise ArmError(self.role, f"its connection is gone ({type(exc).__name__})") from exc

    async def receive(self, timeout_s: float) -> dict:
        """The next reply. What the other end sends is not trusted (the arms and the proof process
        run candidate code): a connection that ends, or a reply that is not a JSON object, is
        that process's failure (ArmError), never the server's."""
        with anyio.fail_after(timeout_s):
            try:
                line = await self.reader.receive_until(b"\n", max_bytes=1 << 20)
            except (
                anyio.EndOfStream,
                anyio.IncompleteRead,
                anyio.BrokenResourceError,
                anyio.ClosedResourceError,
                anyio.DelimiterNotFound,
            ) as exc:
                raise ArmError(self.role, f"its connection ended ({type(exc).__name__})") from exc
        try:
            reply = json.loads(line)
        except ValueError as exc:
            raise ArmError(self.role, "it sent a reply that is not JSON") from exc
        if not isinstance(reply, dict):
            raise ArmError(self.role, "it sent a reply that is not an object")
        if reply.get("error"):
            # The timer relays its arms' failures with the arm's role.
            raise ArmError(str(reply.get("arm") or self.role), reply["error"])
        return reply


async def farewell(conn: ArmConnection) -> dict:
    """Send quit and read its reply, past any reply a failed timing left unread (the proof
    process answers trace_start and load only when asked for them after the timing)."""
    try:
        await conn.send({"op": "quit"})
    except Exception:
        return {}
    for _ in range(4):
        try:
            reply = await conn.receive(5)
        except ArmError:
            continue
        except Exception:
            return {}
        if reply.get("bye"):
            return reply
    return {}


class ArmError(Exception):
    def __init__(self, role: str, message: str) -> None:
        super().__init__(f"{role}: {message}")
        self.role = role
