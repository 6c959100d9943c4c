"""The HTTP side of the hops: one aiohttp client session, a deadline on every hop, and the relay of an
instance's answer (SSE streams passed through line by line) to the client."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable

import aiohttp
from aiohttp import web

from kvstore.errors import KVStoreError
from kvstore.router.config import RouterConfig
from kvstore.router.pool import Instance


class HopError(KVStoreError):
    """A hop failed before its answer reached the client: the instance did not answer, timed out, or answered
    5xx. ``reason`` names which (a metrics label). Another instance may succeed."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class InstanceAnswer(KVStoreError):
    """The instance refused the request itself (a 4xx): passed to the client as is. Retrying cannot help."""

    def __init__(self, status: int, body: bytes):
        super().__init__(f"instance answered {status}")
        self.status, self.body = status, body


class Hops:
    def __init__(self, config: RouterConfig):
        self.config = config
        self.session: aiohttp.ClientSession | None = None

    async def start(self) -> None:
        # no connection limit: admission control decides how much each instance gets
        connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=30)
        self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)

    async def close(self) -> None:
        if self.session is not None:
            await self.session.close()

    def timeout(self, total: float) -> aiohttp.ClientTimeout:
        c = self.config
        return aiohttp.ClientTimeout(total=total, sock_connect=c.connect_timeout_s, sock_read=c.idle_timeout_s)

    async def get_json(self, url: str, timeout_s: float) -> dict:
        async with self.session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                raise HopError(f"GET {url}: {resp.status}", "status")
            return await resp.json(content_type=None)

    async def post_json(self, inst: Instance, path: str, body: dict, headers: dict, total_s: float) -> dict:
        """POST and read a whole JSON answer. HopError (unreachable, timeout, 5xx, not JSON), InstanceAnswer
        (4xx)."""
        try:
            async with self.session.post(inst.url + path, json=body, headers=headers,
                                         timeout=self.timeout(total_s)) as resp:
                raw = await resp.read()
        except asyncio.TimeoutError as exc:
            raise HopError(f"{inst.url}{path}: no answer within the deadline ({exc or 'timeout'})", "timeout") from None
        except aiohttp.ClientError as exc:
            raise HopError(f"{inst.url}{path}: {exc}", "connection") from None
        if 400 <= resp.status < 500:
            raise InstanceAnswer(resp.status, raw)
        if resp.status != 200:
            raise HopError(f"{inst.url}{path}: HTTP {resp.status}", "status")
        try:
            return json.loads(raw)
        except ValueError:
            raise HopError(f"{inst.url}{path}: the answer is not JSON", "malformed") from None

    async def relay(self, inst: Instance, path: str, body: dict, headers: dict, request: web.Request,
                    out_headers: dict, on_token: Callable[[float], None]) -> web.StreamResponse:
        """Send the decode hop and relay its answer. ``on_token(t)`` is called at each streamed event (and once
        for a whole answer). HopError only while nothing was sent to the client; after that a failure ends
        the stream with an SSE error event."""
        stream = bool(body.get("stream"))
        try:
            resp = await self.session.post(inst.url + path, json=body, headers=headers,
                                           timeout=self.timeout(self.config.decode_timeout_s))
        except asyncio.TimeoutError:
            raise HopError(f"{inst.url}{path}: no answer within the deadline", "timeout") from None
        except aiohttp.ClientError as exc:
            raise HopError(f"{inst.url}{path}: {exc}", "connection") from None
        try:  # closing resp (here or when the client goes and this task is cancelled) aborts the instance's request
            if resp.status >= 500:
                raise HopError(f"{inst.url}{path}: HTTP {resp.status}", "status")
            if not stream or resp.status != 200:
                return await self._whole(resp, out_headers, on_token)
            return await self._stream(resp, request, out_headers, on_token)
        finally:
            resp.close()

    async def _whole(self, resp: aiohttp.ClientResponse, out_headers: dict,
                     on_token: Callable[[float], None]) -> web.Response:
        try:
            raw = await resp.read()
        except (asyncio.TimeoutError, aiohttp.ClientError) as exc:
            raise HopError(f"{resp.url}: answer cut ({exc or 'timeout'})", "cut") from None
        on_token(time.monotonic())
        return web.Response(status=resp.status, body=raw, headers={**out_headers, "Content-Type": "application/json"})

    async def _stream(self, resp: aiohttp.ClientResponse, request: web.Request, out_headers: dict,
                      on_token: Callable[[float], None]) -> web.StreamResponse:
        out = web.StreamResponse(status=200, headers={**out_headers, "Content-Type": "text/event-stream",
                                                      "Cache-Control": "no-cache"})
        started, lines = False, resp.content.__aiter__()
        while True:
            try:
                line = await lines.__anext__()
            except StopAsyncIteration:
                break
            except (asyncio.TimeoutError, aiohttp.ClientPayloadError, aiohttp.ClientConnectionError) as exc:
                # the instance's side failed; a failed write to the client is not caught here (it ends the task)
                if not started:
                    raise HopError(f"{resp.url}: stream cut before its first event ({exc or 'timeout'})",
                                   "cut") from None
                error = {"error": {"message": f"the decode instance's stream was cut: {exc or 'timeout'}",
                                   "type": "ServiceUnavailableError", "code": 503}}
                await out.write(b"data: " + json.dumps(error).encode() + b"\n\ndata: [DONE]\n\n")
                break
            if not started:
                await out.prepare(request)
                started = True
            if line.startswith(b"data: {"):
                on_token(time.monotonic())
            await out.write(line)
        if not started:
            await out.prepare(request)
        await out.write_eof()
        return out
