"""The env-service client against a real service: retries, idempotent replays, the sync facade.

The lossy proxy below is a real TCP hop that forwards a request to the service and then drops
the connection instead of returning the answer: the worst moment for a retry, because the
service has already acted (the field log's lost-response /create and /close cases). It speaks
the batch channel too: after a WebSocket upgrade it forwards one frame each way at a time and
can swallow the answer to a batched verb the same way.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import aiohttp
import orjson
import pytest
from env_support import SHOP_PARAMS

from envs.client import EnvClient, EnvServiceError, SyncEnvClient, TransportError
from envs.ports import choose_free_port
from envs.service import serve_in_subprocess

POOL = 4


@pytest.fixture(scope="module")
def url():
    with serve_in_subprocess("shop", POOL, SHOP_PARAMS) as base_url:
        yield base_url


async def _read_message(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0
    )
    return head + await reader.readexactly(length)


async def _read_frame(reader: asyncio.StreamReader) -> tuple[bytes, bytes]:
    """One WebSocket frame: its raw bytes and its (unmasked) payload."""
    head = await reader.readexactly(2)
    n, ext = head[1] & 0x7F, b""
    if n in (126, 127):
        ext = await reader.readexactly(2 if n == 126 else 8)
        n = int.from_bytes(ext, "big")
    mask = await reader.readexactly(4) if head[1] & 0x80 else b""
    data = await reader.readexactly(n)
    payload = bytes(b ^ mask[i % 4] for i, b in enumerate(data)) if mask else data
    return head + ext + mask + data, payload


class LossyProxy:
    """Forwards HTTP/1.1 requests; for the first request to each path in `drop`, the service's
    answer is swallowed and the client's connection closed. On the batch channel, a batched
    verb in `drop` (its message's `verb`) loses its first answer the same way."""

    def __init__(self, upstream: str, drop: set[str]):
        self.host, self.port = upstream.removeprefix("http://").split(":")
        self.drop, self.dropped = set(drop), []

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_r, up_w = await asyncio.open_connection(self.host, int(self.port))
        try:
            while True:
                request = await _read_message(reader)
                up_w.write(request)
                answer = await _read_message(up_r)
                path = request.split(b" ", 2)[1].decode()
                if path in self.drop:
                    self.drop.discard(path)
                    self.dropped.append(path)
                    return
                writer.write(answer)
                if answer.startswith(b"HTTP/1.1 101"):
                    return await self._channel(reader, writer, up_r, up_w)
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            up_w.close()

    async def _channel(self, reader, writer, up_r, up_w) -> None:
        while True:
            frame, payload = await _read_frame(reader)
            up_w.write(frame)
            answer, _ = await _read_frame(up_r)
            verb = orjson.loads(payload).get("verb") if frame[0] & 0x0F == 2 else None
            if verb in self.drop:
                self.drop.discard(verb)
                self.dropped.append(verb)
                return
            writer.write(answer)


def test_every_verb_survives_a_lost_response(url):
    """Each verb's first answer is lost after the service acted; the client's retry must land
    on the same state: one env for the session, the step taken once, the env returned."""
    verbs = {"/create", "/reset", "/step", "/expert", "/step_batch", "/reset_batch", "/close"}

    async def go():
        proxy = LossyProxy(url, verbs)
        async with proxy as via, EnvClient(via, backoff_s=0.01) as c, EnvClient(url) as direct:
            await c.create("lost")
            assert (await direct.info())["live_sessions"] == 1
            first = await c.reset("lost", 21)
            action = await c.expert("lost")
            taken = await c.step("lost", action)  # answer lost, then retried
            assert taken["info"]["valid_action"]  # a 2nd search would be invalid
            # reset_batch/step_batch: a retried batch replays, it does not advance twice
            [again] = await c.reset_batch([("lost", 21)])
            assert again["observation"] == first["observation"]
            [searched] = await c.step_batch([("lost", action)])
            assert searched["info"]["valid_action"] and searched["observation"] == taken["observation"]
            # the service is at turn 1: the client's next step (turn 1) runs, it is not refused
            nxt = await c.step("lost", await c.expert("lost"))
            assert nxt["info"]["valid_action"]
            await c.close("lost")
            assert sorted(proxy.dropped) == sorted(verbs)
            info = await direct.info()
            assert (info["free"], info["live_sessions"], info["conserved"]) == (POOL, 0, True)

    asyncio.run(go())


def test_transport_errors_are_retried_with_backoff_until_the_service_is_up():
    port = choose_free_port()
    with SyncEnvClient(f"http://127.0.0.1:{port}", retries=8, backoff_s=0.1) as c:
        with ThreadPoolExecutor(1) as ex:
            pending = ex.submit(c.info)
            time.sleep(0.5)
            assert not pending.done()  # refused connections, retrying
            with serve_in_subprocess("shop", 1, SHOP_PARAMS, port=port):
                assert pending.result(timeout=60)["pool_size"] == 1


def test_a_restarted_service_is_reached_on_fresh_connections():
    """Keep-alive connections to a service that went away are dropped, not reused: the same
    client reaches its successor on the same port."""
    port = choose_free_port()

    async def pid(c: EnvClient) -> int:
        return (await c.info())["pid"]

    async def go():
        async with EnvClient(f"http://127.0.0.1:{port}", backoff_s=0.1) as c:
            pids = []
            for _ in range(2):
                with serve_in_subprocess("shop", 1, SHOP_PARAMS, port=port):
                    pids.append(await pid(c))
                    await asyncio.gather(*[pid(c) for _ in range(8)])  # several pooled connections
            assert pids[0] != pids[1]

    asyncio.run(go())


def test_retries_are_bounded():
    async def go():
        async with EnvClient(f"http://127.0.0.1:{choose_free_port()}", retries=2, backoff_s=0.01) as c:
            with pytest.raises(TransportError, match="failed 3 time"):
                await c.info()

    asyncio.run(go())


def test_http_errors_are_answers_not_retried(url):
    async def go():
        async with EnvClient(url, backoff_s=5.0) as c:
            start = time.perf_counter()
            with pytest.raises(EnvServiceError) as e:
                await c.step("never-created", "search[x]")
            assert e.value.status == 404 and "never-created" in str(e.value)
            assert time.perf_counter() - start < 2.0  # a retry would have slept 5 s

    asyncio.run(go())


def test_sync_client_plays_batched_expert_episodes(url):
    ids = [f"sync-{i}" for i in range(POOL)]
    c = SyncEnvClient(url)
    try:
        c.create_many(ids)
        results = c.reset_batch([(sid, 100 + k) for k, sid in enumerate(ids)])
        assert len({r["info"]["task_id"] for r in results}) == POOL
        live = dict(zip(ids, results))
        for _ in range(20):
            live = {sid: r for sid, r in live.items() if not r.get("done")}
            if not live:
                break
            batch = [(sid, c.expert(sid)) for sid in live]
            for (sid, _), r in zip(batch, c.step_batch(batch)):
                live[sid] = r
                if r["done"]:
                    assert r["reward"] == 1.0 and r["info"]["won"]
        assert not live
        c.close_many(ids)
        info = c.info()
        assert (info["free"], info["live_sessions"]) == (POOL, 0)
    finally:
        c.close()
    assert not c._thread.is_alive() and c._loop.is_closed()
    c.close()  # idempotent


def test_the_batch_channel_answers_what_the_post_routes_answer(url):
    """The batched verbs travel over the WebSocket channel; the POST routes stay for tools.
    Replaying the same episode through both gives the same pages, rewards and turn bookkeeping."""

    async def go():
        async with EnvClient(url) as c, aiohttp.ClientSession() as http:

            async def post(verb: str, items: list[dict]) -> list[dict]:
                async with http.post(f"{url}{verb}", data=orjson.dumps({"items": items})) as r:
                    assert r.status == 200
                    return orjson.loads(await r.read())["results"]

            await c.create_many(["ws", "post"])
            [via_ws] = await c.reset_batch([("ws", 7)])
            [via_post] = await post("/reset_batch", [{"session_id": "post", "seed": 7}])
            assert via_ws == via_post
            for turn in range(3):
                action = await c.expert("ws")
                [via_ws] = await c.step_batch([("ws", action)])
                [via_post] = await post("/step_batch", [{"session_id": "post", "action": action, "turn": turn}])
                assert via_ws == via_post and via_ws["info"]["valid_action"]
            await c.close_many(["ws", "post"])

    asyncio.run(go())


def test_a_bad_batch_message_gets_a_status_and_the_channel_stays_open(url):
    async def go():
        async with aiohttp.ClientSession() as http, http.ws_connect(f"{url}/batch") as ws:
            for bad, why in (
                (b"not json", "not valid JSON"),
                (orjson.dumps({"verb": "/step", "items": []}), "one of"),
                (orjson.dumps({"verb": "/step_batch"}), "items"),
                (orjson.dumps({"verb": "/step_batch", "items": [{"session_id": 3}]}), None),
            ):
                await ws.send_bytes(bad)
                answer = orjson.loads((await ws.receive()).data)
                if why is None:  # a bad item fails alone, as on the POST route
                    assert answer["results"][0]["error"].startswith("malformed item")
                else:
                    assert answer["status"] == 422 and why in answer["detail"], answer
            await ws.send_bytes(orjson.dumps({"verb": "/reset_batch", "items": []}))
            assert orjson.loads((await ws.receive()).data) == {"results": []}
        async with EnvClient(url) as c:
            with pytest.raises(EnvServiceError, match="/expert_batch -> HTTP 422"):  # answered, not retried
                await c._batch("/expert_batch", [])

    asyncio.run(go())


def test_the_batch_channel_outlives_the_http_deadlines():
    """The request deadlines (DeadlineProtocol) guard HTTP heads and bodies; a channel idle far
    longer than both is still served, because the upgrade hands the connection over."""

    async def go(base: str):
        async with EnvClient(base) as c:
            await c.create("idle")
            await c.reset_batch([("idle", 3)])
            await asyncio.sleep(1.5)
            [r] = await c.step_batch([("idle", await c.expert("idle"))])
            assert r["info"]["valid_action"]

    with serve_in_subprocess("shop", 1, SHOP_PARAMS, header_timeout_s=0.5, body_timeout_s=0.5) as base:
        asyncio.run(go(base))


def test_a_batch_channel_to_a_restarted_service_is_replaced():
    """A pooled channel whose service went away fails once; the retry opens a new one."""
    port = choose_free_port()

    async def go():
        async with EnvClient(f"http://127.0.0.1:{port}", backoff_s=0.1) as c:
            tasks = []
            for _ in range(2):
                with serve_in_subprocess("shop", 1, SHOP_PARAMS, port=port):
                    await c.create("s")
                    [r] = await c.reset_batch([("s", 5)])
                    tasks.append(r["info"]["task_id"])
            assert tasks[0] == tasks[1]

    asyncio.run(go())
