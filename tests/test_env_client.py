"""The env-service client against a real service: retries, idempotent replays, the sync facade.

The lossy proxy below is a real TCP hop that forwards a request to the service and then drops
the connection instead of returning the answer: the worst moment for a retry, because the
service has already acted (the field log's lost-response /create and /close cases).
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from envs.client import EnvClient, EnvServiceError, SyncEnvClient, TransportError
from envs.ports import choose_free_port
from envs.service import serve_in_subprocess

PARAMS = {"num_products": 300, "num_goals": 1000, "val_size": 64, "seed": 0}
POOL = 4


@pytest.fixture(scope="module")
def url():
    with serve_in_subprocess("shop", POOL, PARAMS) as base_url:
        yield base_url


async def _read_message(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        (int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:")), 0
    )
    return head + await reader.readexactly(length)


class LossyProxy:
    """Forwards HTTP/1.1 requests; for the first request to each path in `drop`, the service's
    answer is swallowed and the client's connection closed."""

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
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            up_w.close()


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
            with serve_in_subprocess("shop", 1, PARAMS, port=port):
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
                with serve_in_subprocess("shop", 1, PARAMS, port=port):
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
