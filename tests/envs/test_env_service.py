"""The pooled env service against a real uvicorn server in a subprocess, real shop engines.

Invariants: 20 (idempotent /create, /close always returns the env, a dropped parked /create
gives its reservation back, pool conserved (no orphans) under storms, for the shop and for
ALFWorld), 21 (pool members agree on task order; the service refuses to
start otherwise), 22 (the service lives only inside a scope that stops it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import re
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path

import aiohttp
import psutil
import pytest
from env_support import SHOP_PARAMS
from test_alfworld import alf_cache, small_params  # noqa: F401  (alf_cache: a fixture)

from envs.base import task_order_fingerprint
from envs.client import EnvClient, EnvServiceError
from envs.registry import make_env
from envs.service import (
    EnvPool,
    PoolMismatchError,
    ServiceStartError,
    build_pool,
    check_same_task_order,
    create_app,
    serve_in_subprocess,
)

POOL = 8
DOC = Path(__file__).resolve().parents[2] / "docs" / "env-service.md"


@pytest.fixture(scope="module")
def url():
    with serve_in_subprocess("shop", POOL, SHOP_PARAMS) as base_url:
        yield base_url


@pytest.fixture(scope="module")
def offload_url():
    with serve_in_subprocess("shop", POOL, SHOP_PARAMS, offload=True) as base_url:
        yield base_url


def run(coro):
    return asyncio.run(coro)


def raw_post(url: str, path: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(url + path, body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


async def _post_chunked(url: str, body: bytes) -> int:
    async def chunks():
        for i in range(0, len(body), 64 << 10):
            yield body[i : i + (64 << 10)]

    async with aiohttp.ClientSession() as h:
        async with h.post(url, data=chunks()) as r:
            return r.status


async def info(url: str) -> dict:
    async with EnvClient(url) as c:
        return await c.info()


def assert_pool_whole(url: str) -> dict:
    """Every env free, no session live or parked, each env placed exactly once."""
    i = run(info(url))
    assert (i["free"], i["live_sessions"], i["pending_sessions"], i["conserved"]) == (POOL, 0, 0, True), i
    return i


# ------------------------------------------------------------------------------ basics


def test_documented_expert_episode_reaches_reward_one(url, capsys):
    """The docs' snippet, verbatim except for the URL, plays an expert episode to reward 1.0."""
    block = re.search(r"```python\n(.*?)```", DOC.read_text(), re.DOTALL).group(1)
    assert 'URL = "http://127.0.0.1:23456"' in block
    exec(compile(block.replace("http://127.0.0.1:23456", url), str(DOC), "exec"), {})
    assert "click[buy now] -> 1.0" in capsys.readouterr().out
    assert_pool_whole(url)


def test_info_reports_pool_and_full_task_order_fingerprint(url):
    i = assert_pool_whole(url)
    assert i["env"] == "shop" and i["pool_size"] == POOL and i["num_tasks"] == 1000
    assert i["fingerprint"] == task_order_fingerprint(make_env("shop", **SHOP_PARAMS))


def test_error_codes(url):
    assert raw_post(url, "/create", b'{"session_id": "err"}')[0] == 200
    code, body = raw_post(url, "/step", b'{"session_id": "no-such-session", "action": "x"}')
    assert code == 404 and "no-such-session" in body["detail"]
    assert raw_post(url, "/reset", b'{"session_id": "err", "seed":')[0] == 422  # malformed
    assert raw_post(url, "/reset", b'{"session_id": "err"}')[0] == 422  # no seed
    assert raw_post(url, "/reset", b'{"session_id": "err", "seed": "x"}')[0] == 422
    code, body = raw_post(url, "/reset", b'{"session_id": "err", "seed": true}')
    assert code == 422 and "'seed' must be int" in body["detail"]
    code, body = raw_post(url, "/step", b'{"session_id": "err", "action": "x", "extra": 1}')
    assert code == 422 and "unexpected field 'extra'" in body["detail"]
    assert raw_post(url, "/reset", b"[1, 2]")[0] == 422  # not an object
    with pytest.raises(urllib.error.HTTPError) as e:  # wrong method
        urllib.request.urlopen(url + "/step", timeout=30)
    assert e.value.code == 405
    code, body = raw_post(url, "/step", b'{"session_id": "err", "action": "click[x]"}')
    assert code == 409 and "/reset" in body["detail"]  # no episode
    big = json.dumps({"session_id": "err", "seed": 1, "pad": "x" * (1 << 20)}).encode()
    code, body = raw_post(url, "/reset", big)
    assert code == 413 and "limit" in body["detail"]
    assert run(_post_chunked(url + "/reset", big)) == 413  # no Content-Length to trust
    code, first = raw_post(url, "/reset", b'{"session_id": "err", "seed": 5}')
    assert code == 200 and first["info"]["valid_actions"] == ["search[<your query>]"]
    code, out = raw_post(url, "/step", b'{"session_id": "err", "action": "click[not a button]"}')
    assert code == 200 and out["info"]["valid_action"] is False and out["done"] is False
    assert out["observation"] == first["observation"]
    assert raw_post(url, "/close", b'{"session_id": "err"}') == (200, {"ok": True})
    assert raw_post(url, "/close", b'{"session_id": "err"}') == (200, {"ok": True})
    assert_pool_whole(url)


def test_batched_verbs_answer_bad_items_per_item(url):
    async def go():
        async with EnvClient(url) as c:
            await c.create_many(["b0", "b1"])
            resets = await c.reset_batch([("b0", 1), ("nope", 2), ("b1", 3)])
            assert "nope" in resets[1]["error"]
            assert [r["info"]["task_id"] for r in (resets[0], resets[2])] == [
                make_env("shop", **SHOP_PARAMS).task_ids()[i] for i in (1, 3)
            ]
            body = {
                "items": [
                    {"session_id": "b0", "action": await c.expert("b0")},
                    {"session_id": "b1"},  # malformed item
                    {"session_id": "gone", "action": "search[x]"},
                    {"session_id": "b1", "action": "click[nothing]"},
                ]
            }
            async with aiohttp.ClientSession() as h:
                async with h.post(url + "/step_batch", json=body) as r:
                    assert r.status == 200
                    out = (await r.json())["results"]
            assert out[0]["info"]["valid_action"] is True
            assert "malformed" in out[1]["error"] and "gone" in out[2]["error"]
            assert out[3]["info"]["valid_action"] is False
            await c.close_many(["b0", "b1"])

    run(go())
    assert_pool_whole(url)


def test_step_retry_replays_instead_of_advancing(url):
    """A resent /step (same turn, same action) returns the first result; the episode moves once."""

    async def go():
        async with EnvClient(url) as c:
            await c.create("r")
            await c.reset("r", 11)
            search = await c.expert("r")
            item = {"session_id": "r", "action": search, "turn": 0}
            async with aiohttp.ClientSession() as h:
                outs = []
                for _ in range(2):
                    async with h.post(url + "/step", json=item) as r:
                        outs.append((r.status, await r.json()))
                assert outs[0] == outs[1] and outs[0][0] == 200
                async with h.post(url + "/step", json={**item, "action": "click[back to search]"}) as r:
                    assert r.status == 409  # same turn, different action
                async with h.post(url + "/step", json={**item, "turn": 5}) as r:
                    assert r.status == 409 and "turn 5" in (await r.json())["detail"]
            assert (await c.expert("r")).startswith("click[")  # advanced exactly one step
            await c.close("r")

    run(go())
    assert_pool_whole(url)


# -------------------------------------------------------------------- invariant 20


async def _creates_on_a_full_pool(c: EnvClient, holders: list[str], sid: str, times: int = 1) -> list[asyncio.Future]:
    """`holders` take the whole pool, then `times` concurrent /create of `sid`, given the time to
    park on it (each waits for a free env)."""
    await c.create_many(holders)
    parked = [asyncio.ensure_future(c.create(sid)) for _ in range(times)]
    await asyncio.sleep(0.3)
    return parked


def test_create_is_idempotent_under_concurrent_retries(url):
    """With the pool exhausted, 3 concurrent /create of one session borrow exactly one env."""
    holders = [f"h{i}" for i in range(POOL)]

    async def go():
        async with EnvClient(url) as c:
            dupes = await _creates_on_a_full_pool(c, holders, "dup", times=3)
            i = await c.info()
            assert (i["free"], i["live_sessions"], i["pending_sessions"]) == (0, POOL, 1)
            assert not any(d.done() for d in dupes)  # parked, not failed
            await c.close(holders[0])
            await asyncio.gather(*dupes)
            i = await c.info()
            assert (i["free"], i["live_sessions"], i["pending_sessions"]) == (0, POOL, 0)
            await c.close_many(holders[1:] + ["dup"])

    run(go())
    assert_pool_whole(url)


def test_close_of_pending_create_returns_env_to_pool(url):
    """Closing a session still parked on the exhausted pool: it never takes the next env."""
    holders = [f"p{i}" for i in range(POOL)]

    async def go():
        async with EnvClient(url) as c:
            (parked,) = await _creates_on_a_full_pool(c, holders, "late")
            await c.close("late")
            with pytest.raises(EnvServiceError) as e:
                await parked
            assert e.value.status == 409
            await c.close(holders[0])
            assert (await c.info())["free"] == 1
            await c.close_many(holders[1:])

    run(go())
    assert_pool_whole(url)


async def _parked_create(url: str, sid: str) -> asyncio.StreamWriter:
    """A /create of `sid` sent on a raw socket, left parked; closing the writer drops it."""
    host, port = url.removeprefix("http://").split(":")
    _, writer = await asyncio.open_connection(host, int(port))
    body = json.dumps({"session_id": sid}).encode()
    writer.write(
        b"POST /create HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
    )
    await writer.drain()
    return writer


async def _until(c: EnvClient, check, timeout_s: float = 5.0) -> dict:
    """Poll /info until `check(info)` holds; the last info either way."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        i = await c.info()
        if check(i) or asyncio.get_running_loop().time() > deadline:
            return i
        await asyncio.sleep(0.05)


def test_dropped_parked_creates_give_their_reservations_back(url):
    """Issue 18 item 6: fill the pool, drop 3 parked /create clients, close the holders: every
    engine is back (the old service handed the first 3 freed engines to the dropped sessions,
    orphans nobody closes, and still said `conserved`)."""
    holders = [f"fill{i}" for i in range(POOL)]

    async def go():
        async with EnvClient(url) as c:
            await c.create_many(holders)
            parked = [await _parked_create(url, f"gone{i}") for i in range(3)]
            i = await _until(c, lambda i: i["pending_sessions"] == 3)
            assert (i["free"], i["live_sessions"], i["pending_sessions"]) == (0, POOL, 3), i
            for w in parked:
                w.close()
            i = await _until(c, lambda i: i["pending_sessions"] == 0)
            assert i["pending_sessions"] == 0, i  # the reservations were given back
            await c.close_many(holders)
            i = await c.info()
            assert (i["free"], i["live_sessions"], i["orphaned"], i["conserved"]) == (POOL, 0, 0, True), i

    run(go())
    assert_pool_whole(url)


def test_a_dropped_duplicate_create_keeps_the_reservation_of_the_one_still_waiting(url):
    """Two /create of one session parked; the one whose client leaves does not cancel the
    other's reservation: it gets the next engine, exactly one."""
    holders = [f"keep{i}" for i in range(POOL)]

    async def go():
        async with EnvClient(url) as c:
            await c.create_many(holders)
            dropped = await _parked_create(url, "twice")
            waiting = asyncio.ensure_future(c.create("twice"))
            await _until(c, lambda i: i["pending_sessions"] == 1)
            dropped.close()
            await asyncio.sleep(0.3)
            assert (await c.info())["pending_sessions"] == 1 and not waiting.done()
            await c.close(holders[0])
            await asyncio.wait_for(waiting, 10)
            i = await c.info()
            assert (i["free"], i["live_sessions"], i["orphaned"]) == (0, POOL, 0), i
            await c.close_many(holders[1:] + ["twice"])

    run(go())
    assert_pool_whole(url)


def test_conserved_is_false_while_an_engine_sits_with_an_unreachable_session():
    """`conserved` counts orphans: an engine handed to a reservation that no waiting /create,
    answered /create or other verb ever reached (the old service's state after a parked
    client left) is not conserved, though it is placed exactly once."""

    async def go():
        pool = EnvPool(build_pool("shop", 2, SHOP_PARAMS))
        for sid in ("a", "b"):
            pool.reserve(sid)
            pool.get(sid)  # used by its client: reachable
        pool.reserve("nobody")  # parked on the empty pool, its requester gone
        assert pool.stats()["conserved"]  # parked, it holds nothing yet
        await pool.close("a")  # the freed engine goes to the parked reservation
        stats = pool.stats()
        assert (stats["free"], stats["live_sessions"], stats["conserved"]) == (0, 2, False), stats
        assert stats["orphaned"] == 1
        pool.get("nobody")  # a client reached it after all: no longer an orphan
        assert pool.stats()["conserved"] and pool.stats()["orphaned"] == 0

    run(go())


@dataclasses.dataclass(frozen=True)
class StormCase:
    env: str
    sessions: int  # episodes through the pool
    in_flight: int  # episodes at once (the pool holds fewer: creates park)
    tasks: int  # resets draw their seed from range(tasks)
    invalid: str  # an action no state accepts
    offload: bool = False  # engine calls in worker threads: /close meets in-flight steps


STORMS = {
    "shop": StormCase("shop", 1000, 48, 1000, "click[nonsense]"),
    "shop-offload": StormCase("shop", 200, 48, 1000, "click[nonsense]", offload=True),
    # ALFWorld: two games only (a cold game costs seconds to translate), offloaded as recommended
    "alfworld": StormCase("alfworld", 100, 12, 2, "fly to the moon", offload=True),
}


@pytest.fixture(
    params=[
        pytest.param("shop", marks=pytest.mark.timeout(120)),
        pytest.param("shop-offload", marks=pytest.mark.timeout(120)),
        pytest.param("alfworld", marks=pytest.mark.timeout(600)),
    ]
)
def storm_service(request) -> Iterator[tuple[StormCase, str, dict, int]]:
    """(case, url, engine params, pool size) of a live service for each storm case."""
    case = STORMS[request.param]
    if case.env == "alfworld":
        params = small_params(request.getfixturevalue("alf_cache"))
        with serve_in_subprocess("alfworld", 4, params, offload=True) as base_url:
            yield case, base_url, params, 4
    else:
        yield case, request.getfixturevalue("offload_url" if case.offload else "url"), SHOP_PARAMS, POOL


async def _doomed(h: aiohttp.ClientSession, url: str, path: str, body: dict, rng: random.Random):
    """A request whose connection the client drops after 0-30 ms, mid-flight or not."""
    try:
        await asyncio.wait_for(h.post(url + path, json=body), timeout=rng.uniform(0, 0.03))
    except (asyncio.TimeoutError, aiohttp.ClientError):
        pass


def test_pool_conserved_under_storm(storm_service):
    """Episodes through the pool with duplicated concurrent creates while it is exhausted,
    requests dropped mid-flight on every verb and closes racing in-flight steps, plus one expert
    episode that must win meanwhile; afterwards every env is back, no session is left behind,
    no env was ever held twice (checked while the storm runs), and the task order is the
    in-process engine's."""
    case, url, params, pool = storm_service
    seen_bad: list[dict] = []
    won: list[float] = []

    async def episode(c: EnvClient, h: aiohttp.ClientSession, sid: str, rng: random.Random):
        await _doomed(h, url, "/create", {"session_id": sid}, rng)
        await asyncio.gather(*[c.create(sid) for _ in range(rng.randint(2, 3))])
        try:
            out = await c.reset(sid, rng.randrange(case.tasks))
            for turn in range(rng.randint(0, 3)):
                action = rng.choice(out["info"]["valid_actions"] + [case.invalid])
                if rng.random() < 0.3:  # may or may not run; the real step then replays
                    await _doomed(h, url, "/step", {"session_id": sid, "action": action, "turn": turn}, rng)
                out = await c.step(sid, action)
                assert out["info"]["valid_action"] == (action != case.invalid), (action, out)
                if out["done"]:
                    break
            if rng.random() < 0.2:  # close while a step on the same env is in flight
                step, _ = await asyncio.gather(c.step(sid, case.invalid), c.close(sid), return_exceptions=True)
                assert isinstance(step, dict) or getattr(step, "status", None) == 404, step
        finally:
            if rng.random() < 0.5:
                await _doomed(h, url, "/close", {"session_id": sid}, rng)
            await c.close(sid)

    async def expert_episode(c: EnvClient) -> None:
        await c.create("expert")
        await c.reset("expert", 0)
        for _ in range(40):
            out = await c.step("expert", await c.expert("expert"))
            if out["done"]:
                won.append(out["reward"])
                break
        await c.close("expert")

    async def watch(c: EnvClient, stop: asyncio.Event):
        while not stop.is_set():
            i = await c.info()
            if not i["conserved"] or i["live_sessions"] > pool:
                seen_bad.append(i)
            await asyncio.sleep(0.05)

    async def go() -> dict:
        rng = random.Random(0)
        gate = asyncio.Semaphore(case.in_flight)
        async with EnvClient(url, timeout_s=120) as c, aiohttp.ClientSession() as h:

            async def one(k: int):
                async with gate:
                    await episode(c, h, f"storm-{k}", random.Random(rng.random()))

            stop = asyncio.Event()
            watcher = asyncio.ensure_future(watch(c, stop))
            try:
                await asyncio.gather(*[one(k) for k in range(case.sessions)], expert_episode(c))
            finally:
                stop.set()
                await watcher
            return await c.info()

    info = run(go())
    assert not seen_bad, seen_bad[:3]
    assert (info["free"], info["live_sessions"], info["pending_sessions"], info["conserved"]) == (pool, 0, 0, True), (
        info
    )
    assert won == [1.0]
    assert info["fingerprint"] == task_order_fingerprint(make_env(case.env, **params))


# -------------------------------------------------------------------- invariant 21


def test_pool_members_built_concurrently_share_task_order():
    envs = build_pool("shop", 4, SHOP_PARAMS)
    assert len({id(e) for e in envs}) == 4
    assert check_same_task_order(envs) == task_order_fingerprint(make_env("shop", **SHOP_PARAMS))


def test_refuses_start_on_fingerprint_mismatch(monkeypatch):
    other = make_env("shop", **{**SHOP_PARAMS, "seed": 1})
    same = make_env("shop", **SHOP_PARAMS)
    assert task_order_fingerprint(other) != task_order_fingerprint(same)
    with pytest.raises(PoolMismatchError, match="member 1"):
        check_same_task_order([same, other])
    # create_app runs that check on what build_pool returns, before serving anything
    monkeypatch.setattr("envs.service.build_pool", lambda *a, **k: [same, same, other])
    with pytest.raises(PoolMismatchError, match="refusing to start"):
        create_app("shop", 3, SHOP_PARAMS)


def test_concurrent_services_report_same_fingerprint():
    """Two services built at once agree on the task order; both are stopped (by PID) when the
    scope exits with an error (invariant 22)."""
    cms = [serve_in_subprocess("shop", 2, SHOP_PARAMS) for _ in range(2)]
    with pytest.raises(RuntimeError, match="boom"):
        with ExitStack() as stack, ThreadPoolExecutor(2) as ex:
            urls = [f.result() for f in [ex.submit(stack.enter_context, cm) for cm in cms]]
            infos = [run(info(u)) for u in urls]
            raise RuntimeError("boom")
    assert urls[0] != urls[1]
    assert infos[0]["fingerprint"] == infos[1]["fingerprint"]
    assert not any(psutil.pid_exists(i["pid"]) for i in infos)


def test_service_exits_when_its_launcher_is_killed():
    """SIGKILL on the launcher runs no `finally`; the service must not outlive it as an orphan."""
    launcher = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from envs.service import serve_in_subprocess\n"
            f"with serve_in_subprocess('shop', 1, {SHOP_PARAMS!r}) as u:\n"
            "    print(u, flush=True); time.sleep(600)",
        ],
        cwd=Path(__file__).resolve().parents[2],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        pid = run(info(launcher.stdout.readline().strip()))["pid"]
    finally:
        launcher.kill()
        launcher.wait()
    service = psutil.Process(pid) if psutil.pid_exists(pid) else None
    if service is not None:
        service.wait(timeout=15)  # raises TimeoutExpired if it lingers


def test_service_start_failure_is_reported_and_reaped():
    with pytest.raises(ServiceStartError, match="unknown environment 'nope'"):
        with serve_in_subprocess("nope", 1, {}):
            pass


def test_a_client_that_leaves_before_its_batch_answer_leaves_no_traceback():
    """A batch-channel client that closes (or vanishes) before its answer is an ordinary event:
    the service ends that channel quietly and keeps serving (uvicorn's legacy WebSocket protocol
    logged an 'Exception in ASGI application' for each one)."""
    from envs.ports import choose_free_port
    from envs.service import READY_PREFIX

    port = choose_free_port()
    cmd = [sys.executable, "-m", "envs.service", "--env", "shop", "--port", str(port), "--pool-size", "4"]
    proc = subprocess.Popen(
        [*cmd, "--params", json.dumps(SHOP_PARAMS)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().startswith(READY_PREFIX)
        url = f"http://127.0.0.1:{port}"

        async def leave() -> None:
            batch = json.dumps({"verb": "/reset_batch", "items": [{"session_id": "gone", "seed": 1}] * 200})
            async with aiohttp.ClientSession() as http:
                for _ in range(3):
                    ws = await http.ws_connect(f"{url}/batch")
                    await ws.send_str(batch)
                    await ws.close()  # before the answer
                    ws = await http.ws_connect(f"{url}/batch")
                    await ws.send_str(batch)
                    ws._response.connection.transport.abort()  # gone without a close frame
                async with EnvClient(url) as c:  # still serving
                    await asyncio.sleep(0.5)
                    assert (await c.info())["conserved"]

        asyncio.run(leave())
    finally:
        proc.terminate()
        _, err = proc.communicate(timeout=30)
    assert "Traceback" not in err and "Exception in ASGI application" not in err, err
