"""ALFWorld sessions through the pooled env service (envs/service.py), real uvicorn subprocess.

Invariants 20 (pool conserved under create/step/close storms with dropped connections) and 21
(the service's full task-order fingerprint is the in-process env's). The service runs with
`offload` (engine calls in worker threads, as recommended for ALFWorld's millisecond steps), so
the engine lock is what keeps concurrent sessions' engine calls apart.
"""
from __future__ import annotations

import asyncio
import random

import aiohttp

from envs.base import task_order_fingerprint
from envs.client import EnvClient
from envs.registry import make_env
from envs.service import serve_in_subprocess
from test_alfworld import alf_cache, small_params  # noqa: F401

POOL = 4


async def _doomed(h: aiohttp.ClientSession, url: str, path: str, body: dict, rng: random.Random):
    """A request whose connection the client drops after 0-30 ms, mid-flight or not."""
    try:
        await asyncio.wait_for(h.post(url + path, json=body), timeout=rng.uniform(0, 0.03))
    except (asyncio.TimeoutError, aiohttp.ClientError):
        pass


def test_alfworld_pool_conserved_under_storm(alf_cache):
    """100 sessions through a pool of 4: duplicated concurrent creates while the pool is
    exhausted, requests dropped mid-flight on every verb, episodes on two games (a cold game
    costs seconds to translate); afterwards every env is back and none was ever held twice."""
    params = small_params(alf_cache)
    sessions, in_flight = 100, 12
    seen_bad: list[dict] = []
    won_steps: list[int] = []

    async def episode(c: EnvClient, h: aiohttp.ClientSession, url: str, sid: str, rng: random.Random):
        await _doomed(h, url, "/create", {"session_id": sid}, rng)
        await asyncio.gather(*[c.create(sid) for _ in range(rng.randint(2, 3))])
        try:
            out = await c.reset(sid, rng.choice([0, 1]))
            for turn in range(rng.randint(0, 3)):
                action = rng.choice(out["info"]["valid_actions"] + ["fly to the moon"])
                if rng.random() < 0.3:     # may or may not run; the real step then replays
                    await _doomed(h, url, "/step", {"session_id": sid, "action": action,
                                                    "turn": turn}, rng)
                out = await c.step(sid, action)
                assert out["info"]["valid_action"] == (action != "fly to the moon")
        finally:
            if rng.random() < 0.5:
                await _doomed(h, url, "/close", {"session_id": sid}, rng)
            await c.close(sid)

    async def watch(c: EnvClient, stop: asyncio.Event):
        while not stop.is_set():
            i = await c.info()
            if not i["conserved"] or i["live_sessions"] > POOL:
                seen_bad.append(i)
            await asyncio.sleep(0.05)

    async def expert_episode(c: EnvClient, sid: str) -> None:
        await c.create(sid)
        await c.reset(sid, 0)
        for turn in range(40):
            out = await c.step(sid, await c.expert(sid))
            if out["done"]:
                won_steps.append(turn + 1)
                break
        await c.close(sid)

    async def go(url: str):
        rng = random.Random(0)
        gate = asyncio.Semaphore(in_flight)
        async with EnvClient(url, timeout_s=120) as c, aiohttp.ClientSession() as h:
            async def one(k: int):
                async with gate:
                    await episode(c, h, url, f"storm-{k}", random.Random(rng.random()))
            stop = asyncio.Event()
            watcher = asyncio.ensure_future(watch(c, stop))
            await asyncio.gather(*[one(k) for k in range(sessions)], expert_episode(c, "expert"))
            stop.set()
            await watcher
            return await c.info()

    with serve_in_subprocess("alfworld", POOL, params, offload=True) as url:
        info = asyncio.run(go(url))
    assert not seen_bad, seen_bad[:3]
    assert (info["free"], info["live_sessions"], info["pending_sessions"], info["conserved"]) == \
        (POOL, 0, 0, True), info
    assert info["num_tasks"] == 12 and info["val_size"] == 6
    assert info["fingerprint"] == task_order_fingerprint(make_env("alfworld", **params))
    assert len(won_steps) == 1          # the expert's session, interleaved with the storm, won
