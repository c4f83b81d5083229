"""Pooled environment service: any registered engine behind JSON over HTTP (FastAPI + uvicorn).

Why a pool: an engine instance is expensive to build, so the service pre-warms `pool_size` of
them and every episode (session) borrows one from /create to /close. Three field failures shape
the bookkeeping (invariant 20):
  - /create double-borrow: a client retry of a /create that is still parked on an exhausted
    pool is an *additional* concurrent request (uvicorn does not cancel the first). The session
    is therefore reserved synchronously, before any await, and a duplicate joins the reservation.
  - /create orphans: a parked /create whose client disconnected kept its reservation, so the
    next freed engine went to a session nobody would ever close. A parked /create watches its
    connection; when the last one waiting for a session leaves before being answered, the
    reservation is given back (and the engine, if it had just arrived).
  - /close leaks: /close is idempotent and always puts the env back, also for a session whose
    env has not arrived yet (it simply never receives one) or that is mid-step (the env goes back
    when the step ends, never to a second session while in use).
Trust in clients ends there: a client can vanish right after its /create was answered (or as it
was answered: a /create whose client has already gone gives its engine back at once), and then
nobody will ever close its session. So every session holding an engine has a lease, renewed by
each of its requests: silent longer than `--lease-timeout`, it is closed, its engine goes back
and its later requests get 410 naming the lease. A parked /create waits at most
`--create-timeout` and at most `--max-parked` wait at once; beyond either the answer is 503 with
`Retry-After`, which `EnvClient` honours: an unbounded queue of parked requests held the
clients' connections, so the engines' holders could not send the /close that frees them.
Every state change of the pool is plain synchronous code on the event-loop thread, so no await
can split a check from the action it guards; the conservation check in /info proves it under load
(each engine placed exactly once, and none held by a session nobody can reach: never claimed, or
silent past its lease).

Step retries are made safe by an optional `turn` (steps taken since reset): a retried step whose
first attempt already ran replays the stored result instead of advancing the episode twice.

Slow clients: uvicorn bounds only the idle time between requests, so the service adds a deadline
for a request's head and one for its body (`--header-timeout`, `--body-timeout`); a socket that
trickles bytes is answered 408 and closed instead of being held for as long as it likes.

Run: python -m envs.service --env shop --port 23456 [--pool-size K] [--params JSON] [--relocate]
     [--lease-timeout S] [--create-timeout S] [--max-parked N]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import gc
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import OrderedDict, deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import Any

import orjson
from fastapi import FastAPI
from fastapi.responses import Response
from starlette.requests import ClientDisconnect, Request
from starlette.websockets import WebSocket, WebSocketDisconnect

from envs.base import Env, task_order_fingerprint
from envs.ports import PortError, bind_listener, check_port_allowed, port_is_free
from envs.registry import make_env
from fl_app.http_deadlines import DeadlineProtocol

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_HEADER_TIMEOUT_S = 10.0
DEFAULT_BODY_TIMEOUT_S = 30.0
READY_PREFIX = "ENV-SERVICE READY "
# A rollout holds its sessions while it generates the next turn for all of them: minutes of
# silence per session are normal, so the lease is long; crashed clients cost engines that long.
DEFAULT_LEASE_S = 600.0
DEFAULT_CREATE_WAIT_S = 30.0  # well inside EnvClient's 120 s timeout, so the 503 reaches it
DEFAULT_MAX_PARKED = 256  # half of EnvClient's 512 connections
RETRY_AFTER_S = 1
LAPSED_REMEMBERED = 4096  # sids closed by their lease kept for the 410's message


class PoolMismatchError(RuntimeError):
    """Pool members serve different task orders: a task index would mean different tasks."""


class RequestError(Exception):
    """A request the service answers with `status`, `headers` and `{"detail": message}`."""

    status = 400
    headers: dict[str, str] | None = None


class UnknownSession(RequestError, LookupError):
    """No such session (HTTP 404)."""

    status = 404


class SessionConflict(RequestError):
    """The session exists but cannot take this request now (HTTP 409)."""

    status = 409


class EngineRejected(RequestError):
    """The engine refused the request's arguments (HTTP 422), e.g. a filtered-out task."""

    status = 422


class Malformed(RequestError):
    """The body is not JSON or does not have the verb's fields (HTTP 422)."""

    status = 422


class TooLarge(RequestError):
    """The body exceeds the service's limit (HTTP 413)."""

    status = 413


class LeaseExpired(UnknownSession):
    """The session was closed by its lease: no request for longer than `lease_s` (HTTP 410)."""

    status = 410


class PoolBusy(RequestError):
    """No engine for a /create now: it waited `create_wait_s`, or `max_parked` others already
    wait (HTTP 503 with `Retry-After`; `EnvClient` retries it within its timeout)."""

    status = 503
    headers = {"retry-after": str(RETRY_AFTER_S)}


class ClientGone(RequestError):
    """The client disconnected before its answer was ready (499, nginx's code; nobody reads it)."""

    status = 499


# ----------------------------------------------------------------------------------- the pool


@dataclasses.dataclass(eq=False)
class _Session:
    sid: str
    seen: float  # when a request of this session last arrived or ended (its lease runs from here)
    env: Env | None = None
    closed: bool = False
    waiters: int = 0  # /create requests of it still waiting for their answer
    claimed: bool = False  # a /create was answered, or another verb used it
    turn: int | None = None  # steps since the last reset; None before any reset
    last_step: tuple[str, dict] | None = None  # (action, result) of step `turn - 1`, for retries
    ready: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)
    lock: asyncio.Lock = dataclasses.field(default_factory=asyncio.Lock)

    @property
    def engine(self) -> Env:
        """The engine an engine call runs on (verbs reach a session only once it holds one)."""
        if self.env is None:
            raise SessionConflict(f"session {self.sid!r} holds no env engine")
        return self.env


@dataclasses.dataclass(frozen=True)
class PoolLimits:
    """How long the pool waits for its clients, and for how many.

    `lease_s`: a session holding an engine with no request for this long is closed and its
    engine goes back (its client crashed, or never heard its /create answered).
    `create_wait_s`: a /create parked on an exhausted pool longer than this is answered 503.
    `max_parked`: with this many /create parked, one more that would park is answered 503 at
    once (parked requests hold their clients' connections: an unbounded queue starved the
    engines' holders of connections for their /close)."""

    lease_s: float = DEFAULT_LEASE_S
    create_wait_s: float = DEFAULT_CREATE_WAIT_S
    max_parked: int = DEFAULT_MAX_PARKED

    def __post_init__(self) -> None:
        for flag, value in (("--lease-timeout", self.lease_s), ("--create-timeout", self.create_wait_s)):
            if not 0 < value < float("inf"):
                raise ValueError(f"{flag} must be a positive number of seconds, got {value}")
        if type(self.max_parked) is not int or self.max_parked < 0:
            raise ValueError(f"--max-parked must be an integer >= 0, got {self.max_parked!r}")


class EnvPool:
    """Borrow/return bookkeeping for a fixed set of engines.

    Invariant: every engine is in exactly one place: the free list, one live session, or a
    closed session that is finishing its last engine call (`_returning`); and no live session
    holding an engine is unreachable: an orphan (no /create of it was answered or is still
    waiting, and no other verb has used it) or lapsed (no request of it for longer than its
    lease, and no engine call in flight). `reap` closes lapsed sessions; until it runs, `stats`
    counts them as orphaned. Methods that change that state never await, so they are atomic on
    the event loop. `clock` is the time the leases are measured in (monotonic seconds).
    """

    def __init__(self, envs: list[Env], limits: PoolLimits | None = None, clock: Callable[[], float] = time.monotonic):
        self.envs = list(envs)
        self.limits = limits or PoolLimits()
        self.clock = clock
        self._free: deque[Env] = deque(self.envs)
        self._waiting: deque[_Session] = deque()  # FIFO of live sessions parked on an empty pool
        self._returning: list[Env] = []
        self.sessions: dict[str, _Session] = {}
        self._lapsed: OrderedDict[str, float] = OrderedDict()  # sids closed by their lease -> idle s
        self.leases_expired = 0
        self.creates_refused = 0  # 503s: parked too long, or too many parked

    def reserve(self, sid: str) -> _Session:
        """The session for `sid`, created (and handed an env if one is free, else parked) if
        absent; PoolBusy when a /create of it would park while `max_parked` already are (a
        duplicate counts: it holds a connection too)."""
        s = self.sessions.get(sid)
        if s.env is None if s is not None else not self._free:
            parked = sum(p.waiters for p in self._waiting)
            if parked >= self.limits.max_parked:
                self.creates_refused += 1
                raise PoolBusy(
                    f"all {len(self.envs)} engines are lent and {parked} /create already wait "
                    f"(--max-parked {self.limits.max_parked}); retry later"
                )
        if s is None:
            self._lapsed.pop(sid, None)
            s = self.sessions[sid] = _Session(sid, self.clock())
            if self._free:
                self._hand(s, self._free.popleft())
            else:
                self._waiting.append(s)
        s.seen = self.clock()
        return s

    async def create(self, sid: str, client_gone: Callable[[], Awaitable[object]]) -> None:
        """Reserve `sid` and wait for its env (at most `create_wait_s`, else PoolBusy).
        `client_gone()` resolves when the requesting client disconnects; if it has by the time
        the env is there (at once or after parking), and no other /create of the session is
        waiting and nothing used it, the reservation is given back (`abandon`), engine included:
        nobody would ever close it."""
        s = self.reserve(sid)
        s.waiters += 1
        ready = asyncio.ensure_future(s.ready.wait())
        gone = asyncio.ensure_future(client_gone())
        done: set[asyncio.Future] = set()
        try:
            done, _ = await asyncio.wait(
                (ready, gone), timeout=self.limits.create_wait_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            s.waiters -= 1
            ready.cancel()
            gone.cancel()
            if ready not in done or gone in done:  # not answerable (both done: it left as the env came)
                self.abandon(s)
        if gone in done:
            raise ClientGone(f"the client of /create {sid!r} disconnected before its answer")
        if not done:
            self.creates_refused += 1
            raise PoolBusy(
                f"no pooled env became free within {self.limits.create_wait_s:g} s (--create-timeout); "
                f"all {len(self.envs)} engines are lent; retry later"
            )
        if s.closed:
            raise SessionConflict(f"session {sid!r} was closed before a pooled env became free")
        s.claimed = True
        s.seen = self.clock()

    def abandon(self, s: _Session) -> None:
        """Give `s` back if nobody can reach it: its last waiting /create left unanswered and
        no other verb used it (an env that just arrived goes straight back)."""
        if s.waiters == 0 and not s.claimed and self.sessions.get(s.sid) is s:
            del self.sessions[s.sid]
            self._retire(s)

    def get(self, sid: str) -> _Session:
        """The session a verb runs on; using it claims it and renews its lease."""
        s = self.sessions.get(sid)
        if s is None:
            raise self.unknown(sid)
        if s.env is None:
            raise SessionConflict(
                f"session {sid!r} is still waiting for a pooled env; wait for its /create to return before using it"
            )
        s.claimed = True
        s.seen = self.clock()
        return s

    def unknown(self, sid: str) -> UnknownSession:
        """The error for a session that is not (or no longer) in the pool: 410 if its lease closed it."""
        idle = self._lapsed.get(sid)
        if idle is not None:
            return LeaseExpired(
                f"session {sid!r} was closed after {idle:.0f} s without a request: its lease "
                f"(--lease-timeout {self.limits.lease_s:g} s) expired and its engine went back to the pool; "
                "/create it again"
            )
        return UnknownSession(f"unknown session {sid!r}: /create it first (or it was closed)")

    def touch(self, s: _Session) -> None:
        """Renew `s`'s lease (an engine call on it just ended)."""
        s.seen = self.clock()

    async def close(self, sid: str) -> None:
        """Idempotent: unknown or already-closed sessions are a no-op."""
        s = self.sessions.pop(sid, None)
        if s is not None and self._retire(s):
            # The env goes back only once the in-flight engine call on it has finished; shielded
            # so a cancelled /close request cannot strand it.
            await asyncio.shield(self._return_after_lock(s))

    def _lapsed_sessions(self, now: float) -> list[_Session]:
        """Sessions holding an engine, with no request for longer than the lease and no engine
        call in flight (a call in flight is use: a slow offloaded step does not lose its env)."""
        lease = self.limits.lease_s
        return [s for s in self.sessions.values() if s.env is not None and now - s.seen > lease and not s.lock.locked()]

    def reap(self) -> int:
        """Close every lapsed session (its engine goes back); later requests of one get 410."""
        now = self.clock()
        lapsed = self._lapsed_sessions(now)
        for s in lapsed:
            del self.sessions[s.sid]
            self._retire(s)
            self._lapsed[s.sid] = now - s.seen
            if len(self._lapsed) > LAPSED_REMEMBERED:
                self._lapsed.popitem(last=False)
        self.leases_expired += len(lapsed)
        return len(lapsed)

    async def reap_forever(self) -> None:
        """`reap` every quarter lease (at most every second): a lapsed session is closed
        between 1 and 1.25 leases after its last request."""
        while True:
            await asyncio.sleep(min(self.limits.lease_s / 4, 1.0))
            self.reap()

    def _retire(self, s: _Session) -> bool:
        """Mark a session (already removed from `sessions`) closed and give its env back now;
        True when an engine call is in flight on it, so the env must wait for the lock."""
        s.closed = True
        s.ready.set()  # wakes parked /create duplicates (they report closed)
        if s.env is None:
            self._waiting.remove(s)  # still parked: it never receives one
            return False
        if s.lock.locked():
            self._returning.append(s.env)
            return True
        self._give(s.env)
        return False

    async def _return_after_lock(self, s: _Session) -> None:
        async with s.lock:
            self._returning.remove(s.engine)
            self._give(s.engine)

    def _give(self, env: Env) -> None:
        if self._waiting:
            self._hand(self._waiting.popleft(), env)
        else:
            self._free.append(env)

    @staticmethod
    def _hand(s: _Session, env: Env) -> None:
        s.env = env
        s.ready.set()

    def stats(self) -> dict[str, Any]:
        holders = [s for s in self.sessions.values() if s.env is not None]
        lapsed = self._lapsed_sessions(self.clock())
        orphaned = len({s.sid for s in holders if not s.claimed and s.waiters == 0} | {s.sid for s in lapsed})
        placed = list(self._free) + [s.env for s in holders] + self._returning
        return {
            "pool_size": len(self.envs),
            "free": len(self._free),
            "live_sessions": len(holders),
            "pending_sessions": len(self._waiting),
            "returning": len(self._returning),
            "orphaned": orphaned,
            "lapsed": len(lapsed),
            "leases_expired": self.leases_expired,
            "creates_refused": self.creates_refused,
            **dataclasses.asdict(self.limits),
            # Conservation: each engine placed exactly once (no leak, no double hold), and none
            # held by a session nobody can reach (never claimed, or silent past its lease).
            "conserved": orphaned == 0 and len(placed) == len(self.envs) == len({id(e) for e in placed}),
        }


def build_pool(env_name: str, pool_size: int, env_params: dict, variant: dict[str, Any] | None = None) -> list[Env]:
    """Build the engines concurrently (as production does) so construction races would show.
    `variant`: one client's env variant (partitions.env_variants), applied to every engine."""
    if pool_size < 1:
        raise ValueError(f"pool_size must be >= 1, got {pool_size}")
    with ThreadPoolExecutor(max_workers=min(pool_size, 8), thread_name_prefix="env-build") as ex:
        return list(ex.map(lambda _: make_env(env_name, variant=variant, **env_params), range(pool_size)))


def check_same_task_order(envs: list[Env]) -> str:
    """The pool's full-length task-order fingerprint; raises if any member disagrees (inv. 21)."""
    prints = [task_order_fingerprint(e) for e in envs]
    if len(set(prints)) != 1:
        detail = ", ".join(f"member {i}: {p[:12]}" for i, p in enumerate(prints))
        raise PoolMismatchError(
            f"pool members serve different task orders ({detail}); engine construction is not "
            f"deterministic (a shared RNG or unordered input?) - refusing to start"
        )
    return prints[0]


# -------------------------------------------------------------------------------- the wire
#
# The POST verbs are plain Starlette routes of the FastAPI app whose endpoints take the raw
# Request: bodies are decoded with orjson and checked against a `_Shape`, answers encoded with
# orjson: FastAPI's body parameters (pydantic models, the stdlib json module, its response
# encoder) cost more per request than a shop step (~25-50 us); this way the app costs ~20 us of
# CPU per /step outside uvicorn (measured in process) and ~2 us per batch item.


@dataclasses.dataclass(frozen=True)
class _Shape:
    """The fields of one verb's body (or batch item): `required` must be present with exactly
    their type (JSON `true` is not an int, `"5"` is not a seed); `optional` may be absent or
    null; any other field is an error."""

    required: dict[str, type]
    optional: dict[str, type] = dataclasses.field(default_factory=dict)

    def check(self, obj: Any) -> dict:
        if type(obj) is not dict:
            raise Malformed(f"expected a JSON object with {self._names()}, got {type(obj).__name__}")
        for name, typ in self.required.items():
            value = obj.get(name)
            if type(value) is not typ:
                if name not in obj:
                    raise Malformed(f"missing field {name!r} (expected {self._names()})")
                raise Malformed(f"field {name!r} must be {typ.__name__}, got {type(value).__name__}")
        if len(obj) > len(self.required):
            for name, value in obj.items():
                if name in self.required:
                    continue
                opt = self.optional.get(name)
                if opt is None:
                    raise Malformed(f"unexpected field {name!r} (expected {self._names()})")
                if value is not None and type(value) is not opt:
                    raise Malformed(f"field {name!r} must be {opt.__name__} or null, got {type(value).__name__}")
        return obj

    def _names(self) -> str:
        return ", ".join([*self.required, *(f"{n}?" for n in self.optional)])


SESSION = _Shape({"session_id": str})
RESET = _Shape({"session_id": str, "seed": int})
STEP = _Shape({"session_id": str, "action": str}, {"turn": int})
BATCH = _Shape({"items": list})


def _jsonable(o: Any) -> Any:
    """What orjson cannot encode by itself in engine results (sets, other scalar types)."""
    if isinstance(o, (set, frozenset)):
        return sorted(o)
    if hasattr(o, "item") and callable(o.item):
        return o.item()
    raise TypeError(f"{type(o).__name__} in an engine result is not JSON serializable")


def _dumps(payload: Any) -> bytes:
    # dataclasses (e.g. reward terms) and numpy scalars are native to orjson
    return orjson.dumps(payload, default=_jsonable, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS)


def _json(payload: Any, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(_dumps(payload), status_code=status, headers=headers, media_type="application/json")


async def _read_body(request: Request, limit: int) -> bytes:
    """The request body, or TooLarge when it exceeds `limit`.

    An oversized body is still read (and discarded) up to 8x the limit before answering:
    a server that answers and closes while the client is still sending makes the client see a
    broken pipe instead of the 413. Beyond that it answers at once.
    """
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > 8 * limit:
        raise TooLarge(f"request body of {declared} bytes exceeds the {limit}-byte limit")
    chunks: list[bytes] = []
    size = 0
    try:
        async for chunk in request.stream():
            size += len(chunk)
            if size <= limit:
                chunks.append(chunk)
            elif size > 8 * limit:
                break
    except ClientDisconnect:
        raise ClientGone("the client disconnected before sending the whole body") from None
    if size > limit:
        raise TooLarge(f"request body exceeds the {limit}-byte limit")
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _disconnect(request: Request) -> None:
    """Returns once the client of `request` (whose body was read) has disconnected."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


Verb = Callable[[dict, Request], Awaitable[Any]]


def _json_verb(handler: Verb, shape: _Shape, limit: int) -> Callable[[Request], Awaitable[Response]]:
    """One POST verb as a Starlette endpoint: JSON body -> checked dict -> `handler` -> JSON.

    A `RequestError` becomes its status with `{"detail": message}`; anything else propagates
    to the app's error middleware (HTTP 500).
    """

    async def endpoint(request: Request) -> Response:
        try:
            body = await _read_body(request, limit)
            try:
                obj = orjson.loads(body)
            except orjson.JSONDecodeError as e:
                raise Malformed(f"the body is not valid JSON: {e}") from None
            return _json(await handler(shape.check(obj), request))
        except RequestError as e:
            return _json({"detail": str(e)}, e.status, e.headers)

    return endpoint


def _ignoring_request(run: Callable[[dict], Awaitable[dict]]) -> Verb:
    return lambda body, _request: run(body)


async def _channel_answer(batched: dict[str, Callable[[dict], Awaitable[dict]]], data: bytes) -> dict:
    """One batch-channel message -> its answer; a bad message gets `{"status", "detail"}`."""
    try:
        try:
            obj = orjson.loads(data)
        except orjson.JSONDecodeError as e:
            raise Malformed(f"the message is not valid JSON: {e}") from None
        if type(obj) is not dict or obj.get("verb") not in batched:
            raise Malformed(f'a message is {{"verb": one of {sorted(batched)}, "items": [...]}}')
        run = batched[obj.pop("verb")]
        return await run(BATCH.check(obj))
    except RequestError as e:
        return {"status": e.status, "detail": str(e)}


def create_app(
    env_name: str,
    pool_size: int,
    env_params: dict,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    offload: bool = False,
    variant: dict[str, Any] | None = None,
    limits: PoolLimits | None = None,
) -> FastAPI:
    """Build the pool (refusing mismatched task orders) and the app serving it.

    The pool is built here, not in a lifespan hook, so a bad configuration fails before any port
    is bound (invariant 22).

    `offload`: where engine calls run. Default (False) is inline on the event loop, because
    measured on the shop (bench/env_service.py, docs/benchmarks.md) a step costs ~25-80 us,
    while a threadpool hop alone costs several times that and buys no parallelism
    (pure-Python engine, one GIL). True runs them in worker threads, for engines whose calls take
    milliseconds (the loop then stays responsive to /create, /close and /health meanwhile); the
    per-session lock keeps one call at a time per session either way.

    `variant`: serve one client's env variant (its hash and label are in `/info`, so a client
    can check it talks to the variant it asked for); None serves the unperturbed env.

    `limits`: the sessions' lease and the parked /create's deadline and bound (`PoolLimits`);
    the app reaps lapsed sessions while it runs.
    """
    limits = limits or PoolLimits()  # checked before the (slow) pool build
    pool = EnvPool(build_pool(env_name, pool_size, env_params, variant), limits)
    fingerprint = check_same_task_order(pool.envs)
    first = pool.envs[0]

    @asynccontextmanager
    async def reaping(_: FastAPI) -> AsyncIterator[None]:
        reaper = asyncio.ensure_future(pool.reap_forever())
        try:
            yield
        finally:
            reaper.cancel()

    app = FastAPI(title=f"{env_name} env service", docs_url=None, redoc_url=None, openapi_url=None, lifespan=reaping)
    app.state.pool = pool
    ok = {"ok": True}

    def do_reset(s: _Session, b: dict) -> dict:
        obs, info = s.engine.reset(b["seed"])
        s.turn, s.last_step = 0, None
        return {"observation": obs, "info": info}

    def do_step(s: _Session, b: dict) -> dict:
        action, turn = b["action"], b.get("turn")
        if s.turn is None:
            raise SessionConflict(f"session {s.sid!r} has no episode: /reset it before /step")
        if turn is not None and turn != s.turn:
            if turn == s.turn - 1 and s.last_step is not None and s.last_step[0] == action:
                return s.last_step[1]  # a retry of a step that already ran
            raise SessionConflict(f"step turn {turn} out of order: session {s.sid!r} is at turn {s.turn}")
        obs, reward, done, info = s.engine.step(action)
        s.turn += 1
        result = {"observation": obs, "reward": reward, "done": done, "info": info}
        s.last_step = (action, result)
        return result

    def do_expert(s: _Session, b: dict) -> dict:
        return {"action": s.engine.expert_action()}

    def engine_call(fn: Callable[[_Session, dict], dict], s: _Session, b: dict) -> dict:
        try:
            return fn(s, b)
        except ValueError as e:  # the engine's "bad request" (e.g. a filtered-out task)
            raise EngineRejected(f"engine rejected the request for {s.sid!r}: {e}") from e

    async def on_session(fn: Callable[[_Session, dict], dict], b: dict) -> dict:
        """`fn` on the body's session, one engine call at a time per session."""
        s = pool.get(b["session_id"])
        if not offload and not s.lock.locked():
            return engine_call(fn, s, b)  # inline: nothing can interleave, the lock is moot
        async with s.lock:
            if s.closed:
                raise pool.unknown(s.sid)
            try:
                if offload:
                    return await asyncio.to_thread(engine_call, fn, s, b)
                return engine_call(fn, s, b)
            finally:
                pool.touch(s)  # a call longer than the lease leaves it a whole lease

    async def per_item(fn: Callable[[_Session, dict], dict], shape: _Shape, items: list[Any]) -> dict:
        """A batched verb: `fn` on each item's session, in order; a bad item gets its own
        `{"error": ...}` and never fails the batch."""
        out = []
        for item in items:
            try:
                out.append(await on_session(fn, shape.check(item)))
            except Malformed as e:
                out.append({"error": f"malformed item: {e}"})
            except RequestError as e:
                out.append({"error": str(e)})
            except Exception as e:  # noqa: BLE001  (an engine failure on one item must not fail its batch)
                out.append({"error": f"{type(e).__name__}: {e}"})
        return {"results": out}

    async def create(b: dict, request: Request) -> dict:
        await pool.create(b["session_id"], functools.partial(_disconnect, request))
        return ok

    async def close(b: dict, _: Request) -> dict:
        await pool.close(b["session_id"])
        return ok

    batched: dict[str, Callable[[dict], Awaitable[dict]]] = {
        "/reset_batch": lambda b: per_item(do_reset, RESET, b["items"]),
        "/step_batch": lambda b: per_item(do_step, STEP, b["items"]),
    }
    verbs: dict[str, tuple[Verb, _Shape]] = {
        "/create": (create, SESSION),
        "/close": (close, SESSION),
        "/reset": (lambda b, _: on_session(do_reset, b), RESET),
        "/step": (lambda b, _: on_session(do_step, b), STEP),
        "/expert": (lambda b, _: on_session(do_expert, b), SESSION),
        **{path: (_ignoring_request(run), BATCH) for path, run in batched.items()},
    }
    for path, (handler, shape) in verbs.items():
        app.add_route(path, _json_verb(handler, shape, max_body_bytes), methods=["POST"])

    async def batch_channel(ws: WebSocket) -> None:
        """The batched verbs over one WebSocket (`/batch`): each message `{"verb":
        "/step_batch", "items": [...]}` is answered, in order, with what that POST route answers
        (`{"results": [...]}`), or `{"status": 4xx, "detail": ...}` for a bad message, which
        leaves the channel open. Cheaper per call than a POST on both ends (docs/env-service.md)."""
        await ws.accept()
        while True:
            message = await ws.receive()
            if message["type"] == "websocket.disconnect":
                return
            data = message.get("bytes") or (message.get("text") or "").encode()
            try:
                await ws.send_bytes(orjson.dumps(await _channel_answer(batched, data)))
            except WebSocketDisconnect:  # the client left before its answer: it retries elsewhere
                return

    app.router.add_websocket_route("/batch", batch_channel)

    async def health(_: Request) -> Response:
        return _json(ok)

    async def info(_: Request) -> Response:
        return _json(
            {
                "env": env_name,
                "params": env_params,
                "pid": os.getpid(),
                "fingerprint": fingerprint,
                "variant": variant
                and {"hash": variant.get("hash"), "label": variant.get("label"), "client_id": variant.get("client_id")},
                "num_tasks": first.num_tasks,
                "val_size": first.val_size,
                **pool.stats(),
            }
        )

    app.add_route("/info", info, methods=["GET"])
    app.add_route("/health", health, methods=["GET"])
    return app


# ---------------------------------------------------------------------------- running it


def serve(
    app: FastAPI,
    host: str,
    port: int | None,
    relocate: bool = False,
    parent_pid: int | None = None,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
) -> None:
    """Bind (one clean retry on a collision), print the ready line, serve until SIGTERM/SIGINT,
    or until `parent_pid` is gone: a launcher killed with SIGKILL runs no cleanup, and an
    orphaned service would hold its port and engines forever. Requests whose head or body
    arrives slower than the timeouts are answered 408 (`DeadlineProtocol`)."""
    for name, value in (("header timeout", header_timeout_s), ("body timeout", body_timeout_s)):
        if not 0 < value < float("inf"):
            raise ValueError(f"the {name} must be a positive number of seconds, got {value}")
    import uvicorn

    # Garbage collection was 10-13% of the service's CPU at 512 sessions (profiled,
    # docs/benchmarks.md). Everything built so far (catalog, search index, the pool's engines)
    # lives as long as the process, so it leaves the collector's reach; and a young generation
    # of 20,000 objects instead of 700 collects every few hundred requests, not every ~45 (a
    # request's own objects are freed by reference counting; few form cycles).
    gc.collect()
    gc.freeze()
    gc.set_threshold(20_000, 10, 10)
    sock = bind_listener(host, port, relocate)
    bound = sock.getsockname()[1]
    protocol = functools.partial(DeadlineProtocol, header_timeout_s=header_timeout_s, body_timeout_s=body_timeout_s)
    config = uvicorn.Config(
        app,
        loop="uvloop",
        http=protocol,  # type: ignore[arg-type]  # uvicorn takes any protocol factory; its stub names classes
        access_log=False,
        log_level="warning",
        timeout_keep_alive=120,
        proxy_headers=False,
        server_header=False,
        date_header=False,
        timeout_graceful_shutdown=5,
        ws="websockets-sansio",  # the `websockets` library's maintained core (its legacy protocol is deprecated)
        ws_max_size=max_body_bytes,  # a batch-channel message is bounded like a POST body
    )
    server = uvicorn.Server(config)
    ready = READY_PREFIX + json.dumps({"url": f"http://{host}:{bound}", "port": bound, "pid": os.getpid()})

    async def run() -> None:
        task = asyncio.ensure_future(server.serve(sockets=[sock]))
        while not server.started and not task.done():
            await asyncio.sleep(0.02)
        if server.started:
            print(ready, flush=True)
        while parent_pid is not None and not task.done():
            if os.getppid() != parent_pid:
                server.should_exit = True
                break
            await asyncio.sleep(0.5)
        await task

    with asyncio.Runner(loop_factory=config.get_loop_factory()) as runner:
        runner.run(run())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m envs.service", description=__doc__.split("\n")[0])
    ap.add_argument("--env", required=True, help="engine name (envs/registry.py)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument(
        "--port",
        type=int,
        default=None,
        help="listen port, outside the ephemeral range; omitted: a free private-band port",
    )
    ap.add_argument(
        "--relocate", action="store_true", help="move to a free private-band port if --port is busy or ephemeral"
    )
    ap.add_argument("--pool-size", type=int, default=16)
    ap.add_argument("--params", default="{}", help="engine parameters as a JSON object")
    ap.add_argument(
        "--variant-file",
        default=None,
        help="a JSON file holding one client's env variant (partitions.env_variants "
        "EnvVariant.to_dict()); omitted: the unperturbed env",
    )
    ap.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    ap.add_argument(
        "--parent-pid", type=int, default=None, help="exit when this process is no longer our parent (set by launchers)"
    )
    ap.add_argument(
        "--offload", action="store_true", help="run engine calls in worker threads (for engines with millisecond steps)"
    )
    ap.add_argument(
        "--header-timeout",
        type=float,
        default=DEFAULT_HEADER_TIMEOUT_S,
        help="seconds a request's head may take to arrive (from the connection's "
        "opening or the request's first byte); slower gets 408",
    )
    ap.add_argument(
        "--body-timeout",
        type=float,
        default=DEFAULT_BODY_TIMEOUT_S,
        help="seconds a request's body may take to arrive after its head; slower gets 408",
    )
    ap.add_argument(
        "--lease-timeout",
        type=float,
        default=DEFAULT_LEASE_S,
        help="seconds a session holding an engine may go without a request before it is closed "
        "and its engine goes back to the pool (its later requests get 410)",
    )
    ap.add_argument(
        "--create-timeout",
        type=float,
        default=DEFAULT_CREATE_WAIT_S,
        help="seconds a /create may wait for an engine on an exhausted pool; then 503 + Retry-After",
    )
    ap.add_argument(
        "--max-parked",
        type=int,
        default=DEFAULT_MAX_PARKED,
        help="/create requests that may wait on an exhausted pool at once; more get 503 + Retry-After at once",
    )
    args = ap.parse_args(argv)
    try:
        params = json.loads(args.params)
    except json.JSONDecodeError as e:
        ap.error(f"--params is not valid JSON ({e}); example: --params '{{\"seed\": 0}}'")
    if not isinstance(params, dict):
        ap.error("--params must be a JSON object, e.g. '{\"seed\": 0}'")
    variant = None
    if args.variant_file is not None:
        try:
            variant = json.loads(Path(args.variant_file).read_text())
        except (OSError, json.JSONDecodeError) as e:
            ap.error(f"--variant-file {args.variant_file}: {e}")
        if not isinstance(variant, dict):
            ap.error(f"--variant-file {args.variant_file} must hold a JSON object (EnvVariant.to_dict())")
    try:
        if args.port is not None and not args.relocate:
            # Fail in milliseconds, before the (slow) pool build; the bind re-checks for real.
            check_port_allowed(args.port)
            if not port_is_free(args.port, args.host):
                raise PortError(
                    f"port {args.port} on {args.host} is already in use; stop whatever "
                    f"listens there, pick another port, or pass --relocate"
                )
        for flag, value in (("--header-timeout", args.header_timeout), ("--body-timeout", args.body_timeout)):
            if not 0 < value < float("inf"):
                ap.error(f"{flag} must be a positive number of seconds, got {value}")
        limits = PoolLimits(args.lease_timeout, args.create_timeout, args.max_parked)
        app = create_app(args.env, args.pool_size, params, args.max_body_bytes, args.offload, variant, limits)
        serve(
            app,
            args.host,
            args.port,
            args.relocate,
            args.parent_pid,
            args.header_timeout,
            args.body_timeout,
            args.max_body_bytes,
        )
    except (PortError, PoolMismatchError, ValueError, TypeError) as e:
        print(f"envs.service: error: {e}", file=sys.stderr, flush=True)
        return 2
    return 0


class ServiceStartError(RuntimeError):
    pass


def stop_process(proc: subprocess.Popen, timeout_s: float = 10.0) -> None:
    """SIGTERM `proc`, SIGKILL it if it has not exited `timeout_s` later, and reap it: a child
    that hangs in its shutdown never outlives the one who started it."""
    proc.terminate()
    try:
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def serve_in_subprocess(
    env_name: str,
    pool_size: int,
    env_params: dict,
    port: int | None = None,
    host: str = "127.0.0.1",
    offload: bool = False,
    startup_timeout_s: float = 180.0,
    stop_timeout_s: float = 10.0,
    header_timeout_s: float = DEFAULT_HEADER_TIMEOUT_S,
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S,
    variant: dict[str, Any] | None = None,
    limits: PoolLimits | None = None,
) -> Iterator[str]:
    """Run the service CLI in a child process for the `with` block; yields its base URL.

    The child exists only inside this scope (invariant 22): whatever happens, on exit exactly
    this PID gets SIGTERM, then SIGKILL after `stop_timeout_s`; and if this process dies
    without cleanup (SIGKILL), the child notices its parent is gone and exits by itself.
    `port=None` lets the child pick a free private-band port (with its one clean retry); the
    URL comes from its ready line. `variant` (one client's env variant) travels in a private
    temporary file (a catalog split's product list can outgrow a command-line argument), removed
    once the child has read it. `limits`: the pool's lease and parked-/create limits (defaults
    if None).
    """
    limits = limits or PoolLimits()
    cmd = [
        sys.executable,
        "-m",
        "envs.service",
        "--env",
        env_name,
        "--pool-size",
        str(pool_size),
        "--params",
        json.dumps(env_params),
        "--host",
        host,
        "--parent-pid",
        str(os.getpid()),
        "--header-timeout",
        str(header_timeout_s),
        "--body-timeout",
        str(body_timeout_s),
        "--lease-timeout",
        str(limits.lease_s),
        "--create-timeout",
        str(limits.create_wait_s),
        "--max-parked",
        str(limits.max_parked),
    ]
    if port is not None:
        cmd += ["--port", str(port)]
    if offload:
        cmd.append("--offload")
    variant_file = None
    if variant is not None:
        fd, variant_file = tempfile.mkstemp(prefix="env-variant-", suffix=".json")  # mode 0600
        with os.fdopen(fd, "w") as f:
            json.dump(variant, f)
        cmd += ["--variant-file", variant_file]
    root = str(Path(__file__).resolve().parents[1])
    child_env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])}
    try:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env)
    except BaseException:
        if variant_file is not None:
            os.unlink(variant_file)
        raise
    tail: deque[str] = deque(maxlen=50)
    url: list[str] = []
    got_ready = threading.Event()

    def drain() -> None:  # keep reading so the child never blocks on a full pipe
        for line in proc.stdout or ():
            if line.startswith(READY_PREFIX) and not url:
                url.append(json.loads(line[len(READY_PREFIX) :])["url"])
                got_ready.set()
            else:
                tail.append(line.rstrip())
        got_ready.set()

    reader = threading.Thread(target=drain, name=f"env-service-{proc.pid}-stdout", daemon=True)
    reader.start()
    try:
        ready = got_ready.wait(startup_timeout_s)
        if variant_file is not None:  # read (or failed) by now; never left behind
            os.unlink(variant_file)
            variant_file = None
        if not ready or not url:
            raise ServiceStartError(
                f"env service (pid {proc.pid}, rc {proc.poll()}) did not become ready within "
                f"{startup_timeout_s:.0f}s; its output:\n" + "\n".join(tail)
            )
        with urllib.request.urlopen(url[0] + "/health", timeout=10) as resp:
            if resp.status != 200:
                raise ServiceStartError(f"{url[0]}/health answered {resp.status}")
        yield url[0]
    finally:
        if variant_file is not None:
            os.unlink(variant_file)
        stop_process(proc, stop_timeout_s)
        reader.join(5)


if __name__ == "__main__":
    sys.exit(main())
