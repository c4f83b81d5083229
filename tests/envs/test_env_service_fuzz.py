"""Property-based fuzzing of the env service's request schemas against a real service (uvicorn in
a subprocess, real shop engines), with faults injected on real sockets.

Properties:
  - no 5xx, whatever the body (bytes, any JSON, near-valid bodies with wrong types, huge or
    negative numbers, extra and missing fields, batches of such items) or the raw request;
    an error answer is JSON with a `detail`;
  - pool conservation after every request and every sequence step (`/info`: each engine placed
    once, no orphan, exactly the sessions the model holds), and a whole pool at the end;
  - idempotent retries: a re-sent /create joins, /close twice is a no-op, a re-sent /step (same
    turn and action, its first attempt's connection dropped or answered) replays instead of
    advancing, a re-sent /reset restarts the same task.
The fast variants run in the default test run (derandomized, a few seconds); the `_long` ones
are `-m slow`. Each prints how many requests it sent and faults it injected (docs/reliability.md).
"""

from __future__ import annotations

import http.client
import json
import socket
import time
from collections import Counter
from collections.abc import Iterator

import orjson
import pytest
from env_support import SHOP_PARAMS
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from envs.service import serve_in_subprocess

POOL = 4
VERBS = ["/create", "/close", "/reset", "/step", "/expert", "/reset_batch", "/step_batch"]
COUNTS: Counter[str] = Counter()

FAST = settings(
    max_examples=150, derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck)
)
LONG = settings(max_examples=4000, database=None, deadline=None, suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def wire() -> Iterator[Wire]:
    with serve_in_subprocess("shop", POOL, SHOP_PARAMS) as url:
        w = Wire(url)
        yield w
        w.conn.close()
        print(f"\nenv-service fuzz: {COUNTS['requests']} requests, {COUNTS['faults']} faults injected ({dict(COUNTS)})")


class Wire:
    """Requests over one keep-alive connection (reopened after the service closes it), raw
    socket faults, and the pool check."""

    def __init__(self, url: str):
        host, port = url.removeprefix("http://").split(":")
        self.addr = (host, int(port))
        self.conn = http.client.HTTPConnection(*self.addr, timeout=30)

    def request(
        self, method: str, path: str, body: bytes | None = None, headers: dict | None = None
    ) -> tuple[int, object]:
        COUNTS["requests"] += 1
        for attempt in (0, 1):
            try:
                self.conn.request(method, path, body, headers or {"Content-Type": "application/json"})
                resp = self.conn.getresponse()
                raw = resp.read()
                break
            except (ConnectionError, http.client.HTTPException):
                self.conn.close()
                if attempt:
                    raise
        assert resp.status < 500, (method, path, body, resp.status, raw)
        answer = orjson.loads(raw)
        if resp.status >= 400:
            assert isinstance(answer, dict) and isinstance(answer.get("detail"), str), answer
        return resp.status, answer

    def post(self, path: str, **body: object) -> tuple[int, dict]:
        return self.request("POST", path, orjson.dumps(body))

    def drop(self, path: str, body: dict, after_s: float = 0.0) -> None:
        """Send a whole request on a raw socket and close it after `after_s`, unread."""
        COUNTS["faults"] += 1
        data = orjson.dumps(body)
        with socket.create_connection(self.addr) as s:
            s.sendall(
                b"POST %b HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n%b" % (path.encode(), len(data), data)
            )
            time.sleep(after_s)

    def raw(self, data: bytes) -> bytes:
        """Bytes on a fresh socket; what the service answered before closing (or 2 s)."""
        COUNTS["faults"] += 1
        with socket.create_connection(self.addr, timeout=2) as s:
            s.sendall(data)
            s.shutdown(socket.SHUT_WR)
            out = b""
            try:
                while chunk := s.recv(65536):
                    out += chunk
            except TimeoutError:
                pass
        return out

    def info(self) -> dict:
        return self.request("GET", "/info")[1]

    def assert_conserved(self, live: int | None = None) -> dict:
        i = self.info()
        assert i["conserved"] and i["orphaned"] == 0 and i["returning"] == 0, i
        if live is not None:
            assert (i["live_sessions"], i["pending_sessions"], i["free"]) == (live, 0, POOL - live), i
        return i


# ------------------------------------------------------------------------ malformed bodies

JSON_SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats() | st.text()
JSON = st.recursive(
    JSON_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
SIDS = st.one_of(st.just("held"), st.just("held"), st.sampled_from(["nope", ""]), st.text(max_size=12))
ODD = JSON_SCALARS | st.lists(JSON_SCALARS, max_size=2)


def _item(fields: dict) -> st.SearchStrategy[dict]:
    """Objects with each of `fields` present or absent, well-typed or not, plus stray keys;
    most of them complete and well-typed, so the engine paths get fuzzed too."""
    good = st.fixed_dictionaries(fields)
    odd = st.builds(
        lambda d, keep, extra: {**{k: v for k, v in d.items() if k in keep}, **extra},
        st.fixed_dictionaries({name: st.one_of(value, ODD) for name, value in fields.items()}),
        st.sets(st.sampled_from(sorted(fields))),
        st.dictionaries(st.sampled_from(["turn", "extra", "seed", "items"]), ODD, max_size=1),
    )
    return st.one_of(good, good, odd)


STEP_ITEM = _item(
    {
        "session_id": SIDS,
        "action": st.sampled_from(["search[shoes]", "click[back to search]"]) | st.text(max_size=30),
        "turn": st.integers(-3, 3) | st.none(),
    }
)
RESET_ITEM = _item({"session_id": SIDS, "seed": st.integers(-(2**63), 2**63 - 1)})


def _encode(obj: object) -> bytes:
    """The stdlib's JSON: big integers, `Infinity` and lone surrogates (escaped) stay in."""
    return json.dumps(obj).encode()


SESSION_ITEM = _item({"session_id": SIDS})
BATCH = _item({"items": st.lists(STEP_ITEM | RESET_ITEM | ODD, max_size=6)})
ANY_BODY = st.one_of(st.binary(max_size=200), JSON, STEP_ITEM, RESET_ITEM, BATCH).map(
    lambda b: b if isinstance(b, bytes) else _encode(b)
)
# Each path is mostly sent a body made for it (near-valid), otherwise anything.
MADE_FOR = {
    "/create": SESSION_ITEM,
    "/close": SESSION_ITEM,
    "/expert": SESSION_ITEM,
    "/reset": RESET_ITEM,
    "/step": STEP_ITEM,
    "/reset_batch": BATCH,
    "/step_batch": BATCH,
}
REQUESTS = st.sampled_from([*VERBS, "/info", "/nope"]).flatmap(
    lambda path: st.tuples(
        st.just(path), st.one_of(*[MADE_FOR[path].map(_encode)] * 3, ANY_BODY) if path in MADE_FOR else ANY_BODY
    )
)


def _bodies(wire: Wire):
    @given(request=REQUESTS, content_type=st.sampled_from(["application/json", "text/plain", ""]))
    def prop(request: tuple[str, bytes], content_type: str) -> None:
        path, body = request
        status, answer = wire.request("POST", path, body, {"Content-Type": content_type})
        sid = orjson.loads(body)["session_id"] if status == 200 and path in ("/create", "/close") else None
        if path == "/create" and sid != "held":  # never let a fuzzed session hold an engine
            wire.post("/close", session_id=sid)
        elif path == "/close" and sid == "held":  # the fuzzer closed it: it comes back
            _hold(wire)
        if status == 200 and path.endswith("_batch"):
            assert len(answer["results"]) == len(orjson.loads(body)["items"])
        wire.assert_conserved(live=1)  # only "held" holds an engine

    return prop


def _hold(wire: Wire) -> None:
    assert wire.post("/create", session_id="held")[0] == 200
    assert wire.post("/reset", session_id="held", seed=3)[0] == 200


def _with_held(wire: Wire, run) -> None:
    _hold(wire)
    try:
        run()
    finally:
        wire.post("/close", session_id="held")
    wire.assert_conserved(live=0)


def test_malformed_bodies_get_4xx_never_5xx_and_the_pool_stays_whole(wire):
    _with_held(wire, FAST(_bodies(wire)))


@pytest.mark.slow
def test_malformed_bodies_long(wire):
    _with_held(wire, LONG(_bodies(wire)))


# Batch-channel messages: mostly a verb and near-valid items, otherwise anything.
CHANNEL_MESSAGES = st.one_of(
    *[
        st.tuples(
            st.sampled_from(["/reset_batch", "/step_batch"]), st.lists(STEP_ITEM | RESET_ITEM | ODD, max_size=6)
        ).map(lambda m: _encode({"verb": m[0], "items": m[1]}))
    ]
    * 3,
    ANY_BODY,
    JSON.map(lambda v: _encode({"verb": "/step_batch", "items": v})),
)


def _channel(wire: Wire, ws):
    @given(message=CHANNEL_MESSAGES, as_text=st.booleans())
    def prop(message: bytes, as_text: bool) -> None:
        COUNTS["requests"] += 1
        ws.send(message.decode(errors="replace") if as_text else message)
        answer = orjson.loads(ws.recv())
        if "results" in answer:
            assert len(answer["results"]) == len(orjson.loads(message)["items"])
        else:  # a bad message: a 4xx named, and the channel goes on
            assert 400 <= answer["status"] < 500 and isinstance(answer["detail"], str), answer
        wire.assert_conserved(live=1)

    return prop


def test_batch_channel_messages_get_an_answer_never_a_drop(wire):
    """Every message on the WebSocket batch channel is answered in order, a bad one with a 4xx
    status, on the same open channel; the pool stays whole."""
    from websockets.sync.client import connect

    host, port = wire.addr
    with connect(f"ws://{host}:{port}/batch", max_size=None) as ws:
        _with_held(wire, FAST(_channel(wire, ws)))


# ------------------------------------------------------------------------- raw HTTP bytes


def _raw(wire: Wire):
    @given(
        head=st.sampled_from(
            [
                b"POST /step HTTP/1.1\r\n",
                b"GET /info HTTP/1.1\r\n",
                b"PUT /create HTTP/1.0\r\n",
                b"POST /step_batch HTTP/1.1\r\nTransfer-Encoding: chunked\r\n",
                b"",
            ]
        ),
        rest=st.binary(max_size=300),
    )
    def prop(head: bytes, rest: bytes) -> None:
        answer = wire.raw(head + rest)
        status = answer[9:12]
        assert not answer or (answer.startswith(b"HTTP/1.") and status[:1] in (b"2", b"4")), answer[:200]
        wire.assert_conserved(live=0)

    return prop


def test_raw_garbage_requests_never_get_5xx(wire):
    settings(FAST, max_examples=40)(_raw(wire))()


@pytest.mark.slow
def test_raw_garbage_requests_long(wire):
    settings(LONG, max_examples=1000)(_raw(wire))()


# --------------------------------------------------------------- sequences with faults


class Episodes(RuleBasedStateMachine):
    """Sessions through the pool against a model of what the service holds; faults: dropped
    /create (also parked ones), /step, /reset and /close requests, duplicate requests."""

    wire: Wire
    NAMES = [f"m{i}" for i in range(POOL + 2)]

    def __init__(self) -> None:
        super().__init__()
        self.turn: dict[str, int | None] = {}  # held sessions -> steps since reset (None: no episode)
        self.actions: dict[str, list[str]] = {}
        self.ended: set[str] = set()  # episodes that reported done

    def teardown(self) -> None:
        for sid in self.NAMES:
            self.wire.post("/close", session_id=sid)
        self.wire.assert_conserved(live=0)

    @invariant()
    def pool_conserved(self) -> None:
        self.wire.assert_conserved(live=len(self.turn))

    def _playable(self) -> list[str]:
        return sorted(s for s, t in self.turn.items() if t is not None and s not in self.ended)

    @precondition(lambda self: len(self.turn) < POOL)
    @rule(sid=st.sampled_from(NAMES), dropped_first=st.booleans())
    def create(self, sid: str, dropped_first: bool) -> None:
        if dropped_first:  # a lost first attempt, then the retry joins
            self.wire.drop("/create", {"session_id": sid}, after_s=0.01)
        assert self.wire.post("/create", session_id=sid) == (200, {"ok": True})
        assert self.wire.post("/create", session_id=sid) == (200, {"ok": True})  # duplicate
        self.turn.setdefault(sid, None)
        self.actions.setdefault(sid, [])

    @precondition(lambda self: len(self.turn) == POOL)
    @rule(sid=st.sampled_from(NAMES))
    def parked_create_dropped(self, sid: str) -> None:
        """A /create parked on the full pool whose client leaves: the reservation goes back."""
        if sid in self.turn:
            return
        COUNTS["faults"] += 1
        data = orjson.dumps({"session_id": sid})
        with socket.create_connection(self.wire.addr) as sock:
            sock.sendall(b"POST /create HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%b" % (len(data), data))
            assert _poll(lambda: self.wire.info()["pending_sessions"] == 1)
        assert _poll(lambda: self.wire.info()["pending_sessions"] == 0)

    @precondition(lambda self: bool(self.turn))
    @rule(data=st.data(), seed=st.integers(-(2**40), 2**40), dropped_first=st.booleans())
    def reset(self, data: st.DataObject, seed: int, dropped_first: bool) -> None:
        sid = data.draw(st.sampled_from(sorted(self.turn)))
        if dropped_first:
            self.wire.drop("/reset", {"session_id": sid, "seed": seed})
        status, out = self.wire.post("/reset", session_id=sid, seed=seed)
        again = self.wire.post("/reset", session_id=sid, seed=seed)[1]  # a retry: same task
        assert status == 200 and again["observation"] == out["observation"]
        assert again["info"]["task_id"] == out["info"]["task_id"]
        self.turn[sid], self.actions[sid] = 0, out["info"]["valid_actions"]
        self.ended.discard(sid)

    @precondition(lambda self: bool(self._playable()))
    @rule(data=st.data(), fault=st.sampled_from(["none", "dropped", "resent"]))
    def step(self, data: st.DataObject, fault: str) -> None:
        sid = data.draw(st.sampled_from(self._playable()))
        action = data.draw(st.sampled_from([*self.actions[sid], "click[nonsense]"]) | st.text(max_size=20))
        item = {"session_id": sid, "action": action, "turn": self.turn[sid]}
        if fault == "dropped":  # may or may not run; the retry must not step twice
            self.wire.drop("/step", item, after_s=0.01)
        status, out = self.wire.request("POST", "/step", orjson.dumps(item))
        assert status == 200, out
        if fault == "resent":  # a retry of a step that ran: the same answer
            assert self.wire.request("POST", "/step", orjson.dumps(item)) == (200, out)
        self.turn[sid] += 1
        self.actions[sid] = out["info"]["valid_actions"]
        ahead = {**item, "turn": self.turn[sid] + 1}
        assert self.wire.request("POST", "/step", orjson.dumps(ahead))[0] == 409  # moved exactly once
        if out["done"]:
            self.ended.add(sid)

    @precondition(lambda self: bool(self.turn))
    @rule(data=st.data())
    def step_batch(self, data: st.DataObject) -> None:
        sids = data.draw(st.lists(st.sampled_from([*sorted(self.turn), "ghost"]), min_size=1, max_size=6))
        items = [{"session_id": s, "action": "click[nonsense]"} for s in sids]
        status, out = self.wire.request("POST", "/step_batch", orjson.dumps({"items": items}))
        assert status == 200 and len(out["results"]) == len(items)
        for s, r in zip(sids, out["results"]):
            if s == "ghost" or self.turn[s] is None:
                assert "error" in r, r  # unknown session, or no episode yet
            elif "error" not in r:
                assert r["info"]["valid_action"] is False or s in self.ended, r
                self.turn[s] += 1
            else:
                assert s in self.ended, r  # only a finished episode may refuse a step

    @precondition(lambda self: bool(self.turn))
    @rule(data=st.data(), dropped_first=st.booleans())
    def close(self, data: st.DataObject, dropped_first: bool) -> None:
        sid = data.draw(st.sampled_from(sorted(self.turn)))
        if dropped_first:
            self.wire.drop("/close", {"session_id": sid})
        assert self.wire.post("/close", session_id=sid) == (200, {"ok": True})
        assert self.wire.post("/close", session_id=sid) == (200, {"ok": True})  # idempotent
        del self.turn[sid], self.actions[sid]
        self.ended.discard(sid)


def _poll(check, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _machine(wire: Wire, **kw: object) -> None:
    Episodes.wire = wire
    run_state_machine_as_test(
        Episodes, settings=settings(database=None, deadline=None, suppress_health_check=list(HealthCheck), **kw)
    )


def test_sequences_with_dropped_and_repeated_requests_conserve_the_pool(wire):
    _machine(wire, max_examples=12, stateful_step_count=25, derandomize=True)


@pytest.mark.slow
def test_sequences_long(wire):
    _machine(wire, max_examples=300, stateful_step_count=60)
