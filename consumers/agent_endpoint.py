"""The rollout worker's OpenAI-compatible endpoint: `POST <base_url>/chat/completions`, where
each agent episode gets a base URL of its own.

    AgentEndpoint.serve()                  the stage's "agent endpoint" helper: 127.0.0.1:<port>
    base_url = endpoint.open(episode, handle)   http://127.0.0.1:<port>/episodes/<n>/v1
        agent code (the `openai` client, any framework) -> POST .../chat/completions
            -> handle(request JSON) -> the chat.completion JSON (`consumers.agent_calls`)
    endpoint.close(base_url)               later calls: 404

What is served is the subset of the Chat Completions API an agent loop uses: a JSON body with
`messages` (and `tools`, `max_tokens` / `max_completion_tokens`), one choice, no streaming. A
request the endpoint cannot serve is an OpenAI-shaped error (`{"error": {"message": ...}}`,
status 400 or 404) that the client raises as its own exception, naming the cause.

Why our own HTTP/1.1 handling on asyncio streams, not a web framework: the worker's loop
already runs everything else, the wire is one POST route with keep-alive, and each framework
(aiohttp, starlette + uvicorn) would be a new dependency of every rollout worker for it.
Only the loopback interface is bound: the agent runs in the worker's own process.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

log = logging.getLogger("jetrl.agent_endpoint")

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]
MAX_BODY = 64 << 20
"""Bytes a request body may have (a long conversation with its tools is well under it)."""


class EndpointError(Exception):
    """A request the endpoint refuses: its HTTP status and a one-line message."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class AgentEndpoint:
    """One HTTP server per rollout worker, one route per open episode."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self.port = 0
        self.ready = asyncio.Event()
        self._routes: dict[str, Handler] = {}
        self._opened = 0

    async def serve(self) -> None:
        """Listen until cancelled (a stage helper)."""
        server = await asyncio.start_server(self._connection, self.host, 0)
        self.port = server.sockets[0].getsockname()[1]
        self.ready.set()
        log.info("agent endpoint on http://%s:%d", self.host, self.port)
        async with server:
            await server.serve_forever()

    def open(self, handle: Handler) -> str:
        """A base URL whose `/chat/completions` calls `handle`; `close` it when done."""
        self._opened += 1
        prefix = f"/episodes/{self._opened}/v1"
        self._routes[prefix] = handle
        return f"http://{self.host}:{self.port}{prefix}"

    def close(self, base_url: str) -> None:
        self._routes.pop(base_url.split(f":{self.port}", 1)[-1], None)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while await self._one_request(reader, writer):
                pass
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass  # the client went away mid-request
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()

    async def _one_request(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Serve one request; False when the connection is to close."""
        line = await reader.readline()
        if not line:
            return False
        method, path, _ = (line.decode("latin-1").split(" ", 2) + ["", ""])[:3]
        headers: dict[str, str] = {}
        while (header := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = header.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        length = int(headers.get("content-length", "0") or 0)
        body = await reader.readexactly(length) if 0 < length <= MAX_BODY else b""
        try:
            if length > MAX_BODY:
                raise EndpointError(413, f"a request body of {length} bytes (over {MAX_BODY})")
            status, answer = 200, await self._route(method, path, body)
        except EndpointError as exc:
            status, answer = exc.status, _error(str(exc))
        except Exception as exc:  # the episode's handler failed: the agent's call says why
            log.exception("agent endpoint: %s %s failed", method, path)
            status, answer = 500, _error(f"{type(exc).__name__}: {exc}")
        data = json.dumps(answer).encode()
        keep = headers.get("connection", "").lower() != "close"
        writer.write(
            f"HTTP/1.1 {status} {'OK' if status == 200 else 'Error'}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n"
            f"Connection: {'keep-alive' if keep else 'close'}\r\n\r\n".encode()
            + data
        )
        await writer.drain()
        return keep

    async def _route(self, method: str, path: str, body: bytes) -> dict[str, Any]:
        prefix, _, route = path.split("?", 1)[0].rpartition("/chat/")
        handle = self._routes.get(prefix)
        if method != "POST" or route != "completions" or handle is None:
            raise EndpointError(404, f"no route {method} {path} (episode ended, or a wrong URL)")
        try:
            request = json.loads(body)
        except json.JSONDecodeError as exc:
            raise EndpointError(400, f"the body is not JSON: {exc}") from None
        if not isinstance(request, dict):
            raise EndpointError(400, "the body is not a JSON object")
        return await handle(request)


def _error(message: str) -> dict[str, Any]:
    return {"error": {"message": message, "type": "invalid_request_error", "code": None}}
