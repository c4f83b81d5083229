"""Client of the pooled env service: async (`EnvClient`) and a sync facade (`SyncEnvClient`).

Library choice, measured (bench/env_service.py, docs/benchmarks.md): on the 2-core machine, 64
sessions stepping through the service did 519 steps/s with aiohttp and 38 with httpx's
AsyncClient (14x), and this is the rollout hot path, so it uses aiohttp (on uvloop).

Every verb, /close included, retries transport failures (dropped connection, timeout) a bounded
number of times with exponential backoff. That is safe because the service makes every verb
idempotent: /create joins an existing reservation, /close of a closed session is a no-op, /reset
replays the same seed, and /step carries the session's `turn` so a step that already ran is
replayed, not taken twice. HTTP errors (404, 409, 422, ...) are answers, not failures: no retry.
"""
from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Coroutine, Iterable
from typing import Any, TypeVar

import aiohttp
import uvloop

T = TypeVar("T")
_TRANSPORT_ERRORS = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError)


class EnvServiceError(RuntimeError):
    """The service answered with an error status (the request itself was wrong)."""

    def __init__(self, status: int, path: str, detail: Any):
        super().__init__(f"{path} -> HTTP {status}: {detail}")
        self.status, self.detail = status, detail


class EnvClient:
    """Async client; use as `async with EnvClient(url) as env: ...` inside one event loop."""

    def __init__(self, base_url: str, *, max_connections: int = 512, timeout_s: float = 120.0,
                 retries: int = 4, backoff_s: float = 0.05):
        self.base_url = base_url.rstrip("/")
        self.max_connections, self.timeout_s = max_connections, timeout_s
        self.retries, self.backoff_s = retries, backoff_s
        self._http: aiohttp.ClientSession | None = None
        self._turns: dict[str, int] = {}   # steps taken since reset, per session (retry safety)

    async def __aenter__(self) -> EnvClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if self._http is not None:
            http, self._http = self._http, None
            await http.close()

    def _session(self) -> aiohttp.ClientSession:
        if self._http is None:
            self._http = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.max_connections),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s))
        return self._http

    async def _call(self, method: str, path: str, payload: dict | None = None) -> Any:
        for attempt in range(self.retries + 1):
            try:
                async with self._session().request(method, self.base_url + path, json=payload) as r:
                    body = await r.read()
                    if r.status >= 400:
                        try:
                            detail = json.loads(body).get("detail", body)
                        except (ValueError, AttributeError):
                            detail = body.decode(errors="replace")
                        raise EnvServiceError(r.status, path, detail)
                    return json.loads(body)
            except _TRANSPORT_ERRORS:
                if attempt == self.retries:
                    raise
                await asyncio.sleep(self.backoff_s * 2 ** attempt)
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
