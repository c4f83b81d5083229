"""Client of the pooled env service: async (`EnvClient`) and a sync facade (`SyncEnvClient`).

Transport: aiohttp with orjson bodies. The per-session verbs are POSTs on a keep-alive
connection pool. The batched verbs, which the trainer sends once per rollout turn for all its
episodes, go over the service's WebSocket batch channel (`/batch`): one binary message each
way. That costs about half the client CPU of a POST (docs/benchmarks.md).

Every verb, /close included, retries transport failures (refused or dropped connection, a
truncated answer, timeout) a bounded number of times with exponential backoff. That is safe
because the service makes every verb idempotent: /create joins an existing reservation, /close
of a closed session is a no-op, /reset replays the same seed, and /step carries the session's
`turn` so a step that already ran is replayed, not taken twice. HTTP errors (404, 409, 422, ...)
are answers, not failures: no retry. Except one: 503 with `Retry-After` (a /create the exhausted
pool could not serve in time, or could not park) is asked again after that many seconds, with
+-50% jitter so refused clients do not come back in step, for as long as the verb's `timeout_s`
allows; then it is raised like any other answer.
"""

from __future__ import annotations

import asyncio
import random
import threading
from collections.abc import Awaitable, Callable, Coroutine, Iterable
from typing import Any, TypeVar

import aiohttp
import orjson
import uvloop
from yarl import URL

T = TypeVar("T")

_JSON = {"Content-Type": "application/json"}
# Retried: refused/reset/dropped connections and truncated answers (aiohttp's connection and
# payload errors, OSError), timeouts.
_TRANSPORT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError, asyncio.TimeoutError)
# Idle keep-alive connections are closed by the client before the service would close them
# (its keep-alive timeout is 120 s), so a reused connection is never one the service is closing.
_KEEPALIVE_S = 60.0
# A batched answer is ~1.3 KB per session (0.7 MB at 512): with aiohttp's default 64 KiB read
# buffer the connection is paused and resumed several times per answer (measured: 13.1 -> 10.6 us
# of client CPU per step at 512 sessions with this buffer).
_READ_BUFFER = 4 << 20


class TransportError(ConnectionError):
    """The service could not be reached or its answer not read, on every attempt; the request
    may have run (every verb is idempotent, so calling it again is safe)."""


class EnvServiceError(RuntimeError):
    """The service answered with an error status (the request itself was wrong)."""

    def __init__(self, status: int, path: str, detail: Any):
        super().__init__(f"{path} -> HTTP {status}: {detail}")
        self.status, self.detail = status, detail


class EnvClient:
    """Async client; use as `async with EnvClient(url) as env: ...` inside one event loop.

    `max_connections` bounds the requests in flight (one per connection), `timeout_s` each
    attempt and the time a verb keeps asking again after 503 + Retry-After, `retries` the extra
    attempts after a transport failure (backoff `backoff_s`, doubling)."""

    def __init__(
        self,
        base_url: str,
        *,
        max_connections: int = 512,
        timeout_s: float = 120.0,
        retries: int = 4,
        backoff_s: float = 0.05,
    ):
        url = URL(base_url.rstrip("/"))
        if url.scheme != "http" or not url.host:
            raise ValueError(f"env service URL must look like http://host:port, got {base_url!r}")
        self.base_url = str(url)
        self.retries, self.backoff_s = retries, backoff_s
        self._url = url
        self._urls: dict[str, URL] = {}
        self._max_connections, self._timeout_s = max_connections, timeout_s
        self._http: aiohttp.ClientSession | None = None  # opened in the loop, on first use
        self._channels: list[aiohttp.ClientWebSocketResponse] = []  # idle batch channels
        self._turns: dict[str, int] = {}  # steps taken since reset, per session (retry safety)
        self._jitter = random.Random()  # Retry-After jitter: clients must not come back in step

    async def __aenter__(self) -> EnvClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        channels, self._channels = self._channels, []
        for ws in channels:
            await ws.close()
        if self._http is not None:
            await self._http.close()
            self._http = None

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections, keepalive_timeout=_KEEPALIVE_S),
                timeout=aiohttp.ClientTimeout(total=self._timeout_s),
                cookie_jar=aiohttp.DummyCookieJar(),
                auto_decompress=False,
                skip_auto_headers=("User-Agent", "Accept-Encoding"),
                read_bufsize=_READ_BUFFER,
            )
        return self._http

    def _url_of(self, path: str) -> URL:
        return self._urls.get(path) or self._urls.setdefault(
            path, self._url.with_path(self._url.path.rstrip("/") + path)
        )

    async def _retrying(self, what: str, once: Callable[[], Awaitable[T]]) -> T:
        """`once()`, attempted again after each transport failure (backoff doubling)."""
        for attempt in range(self.retries + 1):
            try:
                return await once()
            except _TRANSPORT_ERRORS as e:
                if attempt == self.retries:
                    raise TransportError(
                        f"{what} failed {attempt + 1} time(s), last: {type(e).__name__}: {e}; "
                        "is the env service running there?"
                    ) from e
                await asyncio.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    async def _call(self, method: str, path: str, payload: dict | None = None) -> Any:
        url = self._url_of(path)
        body = None if payload is None else orjson.dumps(payload)
        http = self._session()

        async def once() -> tuple[int, bytes, str | None]:
            async with http.request(method, url, data=body, headers=None if body is None else _JSON) as resp:
                return resp.status, await resp.read(), resp.headers.get("Retry-After")

        loop = asyncio.get_running_loop()
        give_up = loop.time() + self._timeout_s
        while True:
            status, answer, retry_after = await self._retrying(f"{method} {url}", once)
            pause = self._retry_pause(status, retry_after)
            if pause is None or loop.time() + pause > give_up:
                break
            await asyncio.sleep(pause)
        if status >= 400:
            try:
                detail = orjson.loads(answer)["detail"]
            except (ValueError, TypeError, KeyError):
                detail = answer.decode(errors="replace")
            raise EnvServiceError(status, path, detail)
        return orjson.loads(answer)

    def _retry_pause(self, status: int, retry_after: str | None) -> float | None:
        """Seconds to wait before asking again: a 503's `Retry-After` (delay-seconds) with +-50%
        jitter; None for any other answer."""
        if status != 503 or retry_after is None:
            return None
        try:
            delay = float(retry_after)
        except ValueError:  # an HTTP-date: the service never sends one
            return None
        return max(delay, 0.0) * self._jitter.uniform(0.5, 1.5)

    async def _batch(self, verb: str, items: list[dict]) -> list[dict]:
        """A batched verb over a batch channel: an idle one, else a new one (so concurrent calls
        never wait for each other). A channel that failed mid-call is closed, never reused: its
        answer may still be in flight. Retried like `_call`, which the verbs' idempotence makes
        safe (a replayed step is answered from the session's last step)."""
        body = orjson.dumps({"verb": verb, "items": items})

        async def once() -> dict:
            ws = self._channels.pop() if self._channels else await self._open_channel()
            try:
                async with asyncio.timeout(self._timeout_s):
                    await ws.send_bytes(body)
                    msg = await ws.receive()
                if msg.type is not aiohttp.WSMsgType.BINARY:
                    raise aiohttp.ServerDisconnectedError(f"the batch channel ended ({msg.type.name})")
            except BaseException:
                await ws.close()
                raise
            self._channels.append(ws)
            return orjson.loads(msg.data)

        answer = await self._retrying(f"{verb} over {self._url_of('/batch')}", once)
        if "status" in answer:
            raise EnvServiceError(answer["status"], verb, answer["detail"])
        return answer["results"]

    async def _open_channel(self) -> aiohttp.ClientWebSocketResponse:
        try:
            return await self._session().ws_connect(
                self._url_of("/batch"), max_msg_size=0, compress=0, timeout=aiohttp.ClientWSTimeout(ws_close=5.0)
            )
        except aiohttp.WSServerHandshakeError as e:  # an answer, not a transport failure
            raise EnvServiceError(e.status, "/batch", e.message) from None

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
        out = await self._batch("/reset_batch", [{"session_id": s, "seed": seed} for s, seed in items])
        for (sid, _), res in zip(items, out):
            if "error" not in res:
                self._turns[sid] = 0
        return out

    async def step_batch(self, items: Iterable[tuple[str, str]]) -> list[dict]:
        items = list(items)
        out = await self._batch("/step_batch", [self._step_item(s, a) for s, a in items])
        for (sid, _), res in zip(items, out):
            if "error" not in res:
                self._advance(sid)
        return out

    async def create_many(self, session_ids: Iterable[str]) -> None:
        """All or nothing: if any /create fails, every session of the call is closed (those
        that got an engine too), then the first failure is raised."""
        ids = list(session_ids)
        try:
            await _all(self.create(s) for s in ids)
        except BaseException:
            await asyncio.shield(asyncio.gather(*(self.close(s) for s in ids), return_exceptions=True))
            raise

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
    errors = [r for r in await asyncio.gather(*coros, return_exceptions=True) if isinstance(r, BaseException)]
    if errors:
        raise errors[0]


class SyncEnvClient:
    """Blocking facade for the synchronous (torch) rollout loop: an event loop in a thread."""

    def __init__(self, base_url: str, **client_kwargs: Any):
        self._client = EnvClient(base_url, **client_kwargs)  # validates the URL first
        self._loop = uvloop.new_event_loop()  # cheaper per request than asyncio's loop
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="env-client-loop")
        self._thread.start()

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
