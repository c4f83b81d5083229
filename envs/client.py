"""Client of the pooled env service: async (`EnvClient`) and a sync facade (`SyncEnvClient`).

Transport, chosen by measurement (bench/env_service.py, docs/benchmarks.md): a minimal
keep-alive HTTP/1.1 client on asyncio's protocol layer, with httptools' response parser (the C
parser uvicorn uses) and orjson. The client shares the machine's cores with the service, so its
CPU per request is throughput: per /step it costs ~0.1 ms against ~0.4 ms for aiohttp (used
plainly or tuned: orjson bodies, prebuilt URLs, no cookie jar; no difference) and several ms for
httpx's AsyncClient. It speaks just what the env service needs: one request per connection at a
time, JSON bodies, answers framed by Content-Length or chunked.

Every verb, /close included, retries transport failures (dropped connection, timeout) a bounded
number of times with exponential backoff. That is safe because the service makes every verb
idempotent: /create joins an existing reservation, /close of a closed session is a no-op, /reset
replays the same seed, and /step carries the session's `turn` so a step that already ran is
replayed, not taken twice. HTTP errors (404, 409, 422, ...) are answers, not failures: no retry.
"""
from __future__ import annotations

import asyncio
import threading
import urllib.parse
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

import httptools
import orjson
import uvloop

T = TypeVar("T")


class TransportError(ConnectionError):
    """The connection broke, or its answer could not be read; the request may have run."""


# Retried: refused/reset connections (OSError), unreadable answers, timeouts.
_TRANSPORT_ERRORS = (OSError, asyncio.TimeoutError)


class EnvServiceError(RuntimeError):
    """The service answered with an error status (the request itself was wrong)."""

    def __init__(self, status: int, path: str, detail: Any):
        super().__init__(f"{path} -> HTTP {status}: {detail}")
        self.status, self.detail = status, detail


class _Connection(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection carrying one request at a time.

    `reusable` is True only between a complete answer that allows keep-alive and the next
    request; a connection whose request failed, timed out or was cancelled is never reused
    (its answer could still arrive and be read as the next request's).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._parser = httptools.HttpResponseParser(self)
        self._transport: asyncio.Transport | None = None
        self._waiter: asyncio.Future[tuple[int, bytes]] | None = None
        self._chunks: list[bytes] = []
        self._status = 0
        self.reusable = False

    async def request(self, data: bytes, timeout_s: float) -> tuple[int, bytes]:
        """Send one whole request; (status, body) of its answer."""
        if self._transport is None or self._transport.is_closing():
            raise TransportError("connection closed")
        self.reusable = False
        self._waiter = waiter = self._loop.create_future()
        timer = self._loop.call_later(timeout_s, self._fail, asyncio.TimeoutError(
            f"no answer within {timeout_s:g} s"))
        try:
            self._transport.write(data)
            return await waiter
        finally:
            timer.cancel()

    def close(self) -> None:
        self.reusable = False
        if self._transport is not None:
            self._transport.close()

    def _fail(self, exc: BaseException) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_exception(exc)
        self.close()

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._fail(TransportError(f"malformed HTTP answer: {e}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(TransportError(f"connection closed by the service{f': {exc}' if exc else ''}"))

    # httptools callbacks
    def on_headers_complete(self) -> None:
        self._status = self._parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)

    def on_message_complete(self) -> None:
        waiter, self._waiter = self._waiter, None
        body, self._chunks = b"".join(self._chunks), []
        if waiter is None or waiter.done():       # an answer nobody is waiting for
            self.close()
            return
        self.reusable = self._parser.should_keep_alive()
        waiter.set_result((self._status, body))


class _ConnectionPool:
    """Keep-alive connections to one service; at most `limit` requests in flight."""

    def __init__(self, base_url: str, limit: int, timeout_s: float):
        url = urllib.parse.urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"env service URL must look like http://host:port, got {base_url!r}")
        self._host, self._port = url.hostname, url.port or 80
        self._prefix, self._netloc = url.path.rstrip("/"), url.netloc
        self._timeout_s = timeout_s
        self._slots = asyncio.Semaphore(limit)
        self._idle: list[_Connection] = []
        self._open: set[_Connection] = set()

    async def request(self, method: str, path: str, body: bytes | None) -> tuple[int, bytes]:
        head = f"{method} {self._prefix}{path} HTTP/1.1\r\nHost: {self._netloc}\r\n"
        if body is None:
            data = (head + "\r\n").encode()
        else:
            data = (head + f"Content-Type: application/json\r\nContent-Length: {len(body)}"
                    "\r\n\r\n").encode() + body
        async with self._slots:
            conn = await self._connection()
            try:
                return await conn.request(data, self._timeout_s)
            finally:
                if conn.reusable:
                    self._idle.append(conn)
                else:
                    conn.close()
                    self._open.discard(conn)

    async def _connection(self) -> _Connection:
        while self._idle:
            conn = self._idle.pop()               # most recently used: least likely stale
            if conn.reusable:
                return conn
            self._open.discard(conn)
        loop = asyncio.get_running_loop()
        _, conn = await asyncio.wait_for(
            loop.create_connection(lambda: _Connection(loop), self._host, self._port),
            self._timeout_s)
        self._open.add(conn)
        return conn

    def close(self) -> None:
        for conn in self._open:
            conn.close()
        self._open.clear()
        self._idle.clear()


class EnvClient:
    """Async client; use as `async with EnvClient(url) as env: ...` inside one event loop."""

    def __init__(self, base_url: str, *, max_connections: int = 512, timeout_s: float = 120.0,
                 retries: int = 4, backoff_s: float = 0.05):
        self.base_url = base_url.rstrip("/")
        self.retries, self.backoff_s = retries, backoff_s
        self._http = _ConnectionPool(self.base_url, max_connections, timeout_s)
        self._turns: dict[str, int] = {}   # steps taken since reset, per session (retry safety)

    async def __aenter__(self) -> EnvClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._http.close()

    async def _call(self, method: str, path: str, payload: dict | None = None) -> Any:
        body = None if payload is None else orjson.dumps(payload)
        for attempt in range(self.retries + 1):
            try:
                status, answer = await self._http.request(method, path, body)
            except _TRANSPORT_ERRORS:
                if attempt == self.retries:
                    raise
                await asyncio.sleep(self.backoff_s * 2 ** attempt)
                continue
            if status >= 400:
                try:
                    detail = orjson.loads(answer)["detail"]
                except (ValueError, TypeError, KeyError):
                    detail = answer.decode(errors="replace")
                raise EnvServiceError(status, path, detail)
            return orjson.loads(answer)
        raise AssertionError("unreachable")

    # ---- per-session verbs
    async def create(self, session_id: str) -> None:
        await self._call("POST", "/create", {"session_id": session_id})

    async def reset(self, session_id: str, seed: int) -> dict:
        out = await self._call("POST", "/reset", {"session_id": session_id, "seed": seed})
        self._turns[session_id] = 0
        return out

    async def step(self, session_id: str, action: str) -> dict:
        out = await self._call("POST", "/step", self._step_item(session_id, action))
        self._advance(session_id)
        return out

    async def expert(self, session_id: str) -> str:
        return (await self._call("POST", "/expert", {"session_id": session_id}))["action"]

    async def close(self, session_id: str) -> None:
        try:
            await self._call("POST", "/close", {"session_id": session_id})
        finally:
            self._turns.pop(session_id, None)

    # ---- batched verbs (one request per rollout step); per-item {"error": ...} results
    async def reset_batch(self, items: Iterable[tuple[str, int]]) -> list[dict]:
        items = list(items)
        out = (await self._call("POST", "/reset_batch", {
            "items": [{"session_id": s, "seed": seed} for s, seed in items]}))["results"]
        for (sid, _), res in zip(items, out):
            if "error" not in res:
                self._turns[sid] = 0
        return out

    async def step_batch(self, items: Iterable[tuple[str, str]]) -> list[dict]:
        items = list(items)
        out = (await self._call("POST", "/step_batch", {
            "items": [self._step_item(s, a) for s, a in items]}))["results"]
        for (sid, _), res in zip(items, out):
            if "error" not in res:
                self._advance(sid)
        return out

    async def create_many(self, session_ids: Iterable[str]) -> None:
        await _all(self.create(s) for s in session_ids)

    async def close_many(self, session_ids: Iterable[str]) -> None:
        """Attempts every close even if some fail, then raises the first failure."""
        await _all(self.close(s) for s in session_ids)

    async def info(self) -> dict:
        return await self._call("GET", "/info")

    def _step_item(self, session_id: str, action: str) -> dict:
        item: dict[str, Any] = {"session_id": session_id, "action": action}
        if session_id in self._turns:
            item["turn"] = self._turns[session_id]
        return item

    def _advance(self, session_id: str) -> None:
        if session_id in self._turns:
            self._turns[session_id] += 1


async def _all(coros: Iterable[Coroutine[Any, Any, Any]]) -> None:
    errors = [r for r in await asyncio.gather(*coros, return_exceptions=True)
              if isinstance(r, BaseException)]
    if errors:
        raise errors[0]


class SyncEnvClient:
    """Blocking facade for the synchronous (torch) rollout loop: an event loop in a thread."""

    def __init__(self, base_url: str, **client_kwargs: Any):
        self._loop = uvloop.new_event_loop()   # ~2x cheaper per request than asyncio's loop
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="env-client-loop")
        self._thread.start()
        self._client = EnvClient(base_url, **client_kwargs)

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    def create_many(self, session_ids: Iterable[str]) -> None:
        self._run(self._client.create_many(list(session_ids)))

    def reset_batch(self, items: Iterable[tuple[str, int]]) -> list[dict]:
        return self._run(self._client.reset_batch(list(items)))

    def step_batch(self, items: Iterable[tuple[str, str]]) -> list[dict]:
        return self._run(self._client.step_batch(list(items)))

    def close_many(self, session_ids: Iterable[str]) -> None:
        self._run(self._client.close_many(list(session_ids)))

    def expert(self, session_id: str) -> str:
        return self._run(self._client.expert(session_id))

    def info(self) -> dict:
        return self._run(self._client.info())

    def close(self) -> None:
        """Close the HTTP connections, then stop and join the loop thread (always both)."""
        if self._loop.is_closed():
            return
        try:
            self._run(self._client.aclose())
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()

    def __enter__(self) -> SyncEnvClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
