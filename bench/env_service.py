"""Env service throughput and latency, side by side with the same engine called in-process.

    python bench/env_service.py [--env shop|alfworld] [--sessions 64,256,512] [--duration S]
                                [--engine-calls inline|offload] [--params JSON] [--json out.json]

Workload, identical in every mode: session i plays the expert trajectory of task
(i + k * sessions) % tasks: reset, its steps, then the next task. Steps are counted; resets are
part of the work. Both processes first reset every task once (ALFWorld caches each game's
translation per process). Rows, each printed with the in-process engine measured just before it
(the machine is shared, so a baseline taken minutes earlier would compare different loads):
  - in-process: `sessions` engines in this process advanced one turn at a time (the ceiling);
  - shop: one engine step inline vs awaited through a threadpool (why the service runs calls
    inline), and the per-session loop at 64 sessions through this project's client, aiohttp and
    httpx (why the client is what it is);
  - per-session verbs, closed loop, at each session count: steps/s, p50/p99 step latency;
  - batched verbs: one /step_batch per turn for all sessions, finished ones reset together in one
    /reset_batch: steps/s, p50/p99 per batch;
  - shop: open loop, the largest session count offering `--open-loop-rate` steps/s in total
    (each session thinks between steps, as a policy does): the latency of those steps.
The service (`python -m envs.service`, pool = the largest session count) runs in a subprocess,
the client in this process on uvloop; they share the machine's cores, and each row gives the CPU
seconds per step that the service and the client spent.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import random
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import httpx
import psutil
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envs.base import Env  # noqa: E402
from envs.client import EnvClient  # noqa: E402
from envs.registry import make_env  # noqa: E402
from envs.service import serve_in_subprocess  # noqa: E402


@dataclasses.dataclass(frozen=True)
class Setup:
    """Per-engine defaults: what a row plays and how long it is measured."""

    params: dict
    tasks: int                 # tasks played (validation tasks come first)
    sessions: tuple[int, ...]
    duration_s: float          # per service row
    baseline_s: float          # in-process, before each row
    offload: bool              # the service's recommended mode for this engine (docs/env-service.md)


SETUPS = {
    "shop": Setup({"num_products": 300, "num_goals": 1000, "val_size": 64, "seed": 0},
                  tasks=200, sessions=(64, 256, 512), duration_s=4.0, baseline_s=1.0, offload=False),
    # ALFWorld: a step ~10 ms, a warm reset ~0.15 s of CPU; the default generated game set
    # (generated on first use, docs/alfworld.md), its 24 validation games.
    "alfworld": Setup({"data_dir": "generated"}, tasks=24, sessions=(64,), duration_s=20.0,
                      baseline_s=10.0, offload=True),
}


def expert_trajectories(env: Env, tasks: int) -> list[list[str]]:
    """The expert's actions for tasks 0..tasks-1 (identical work in every mode)."""
    out = []
    for task in range(tasks):
        env.reset(task)
        actions, done = [], False
        while not done:
            actions.append(env.expert_action())
            _, _, done, _ = env.step(actions[-1])
        out.append(actions)
    return out


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] * 1e3 if xs else float("nan")


# -------------------------------------------------------------------------- in-process

def in_process(envs: list[Env], trajs: list[list[str]], duration: float) -> dict:
    """`len(envs)` sessions played in this process, one turn at a time across all of them."""
    task = [i % len(trajs) for i in range(len(envs))]
    pos = [0] * len(envs)
    for i, env in enumerate(envs):
        env.reset(task[i])
    steps, nxt, lat = 0, len(envs), []
    start, cpu0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - start < duration:
        for i, env in enumerate(envs):
            t = time.perf_counter()
            _, _, done, _ = env.step(trajs[task[i]][pos[i]])
            lat.append(time.perf_counter() - t)
            steps, pos[i] = steps + 1, pos[i] + 1
            if done:
                task[i], pos[i], nxt = nxt % len(trajs), 0, nxt + 1
                env.reset(task[i])
    el, cpu = time.perf_counter() - start, time.process_time() - cpu0
    return {"steps_per_s": steps / el, "p50_ms": pct(lat, .5), "p99_ms": pct(lat, .99),
            "cpu_us_per_step": cpu / steps * 1e6}


async def inline_vs_threadpool(env: Env, trajs: list[list[str]], n: int = 3000) -> dict:
    """Cost of one engine step called inline vs awaited through the default threadpool."""
    loop, out = asyncio.get_running_loop(), {}
    for mode in ("inline", "threadpool"):
        total, k = 0.0, 0
        while k < n:
            env.reset(k % len(trajs))
            for a in trajs[k % len(trajs)]:
                t = time.perf_counter()
                if mode == "inline":
                    env.step(a)
                else:
                    await loop.run_in_executor(None, env.step, a)
                total += time.perf_counter() - t
                k += 1
        out[f"{mode}_us"] = total / k * 1e6
    return out


# ------------------------------------------------------------------------------ via HTTP

class CPU:
    """CPU seconds of the service process and of this process over a measured window."""

    def __init__(self, service_pid: int):
        self.procs = [psutil.Process(service_pid), psutil.Process()]

    def __enter__(self) -> CPU:
        self.t0 = [sum(p.cpu_times()[:2]) for p in self.procs]
        return self

    def __exit__(self, *exc: object) -> None:
        self.used = [sum(p.cpu_times()[:2]) - t for p, t in zip(self.procs, self.t0)]

    def per_step(self, steps: int) -> dict:
        return {"server_cpu_us_per_step": self.used[0] / steps * 1e6,
                "client_cpu_us_per_step": self.used[1] / steps * 1e6}


class Verbs(Protocol):
    async def reset(self, session_id: str, seed: int) -> Any: ...

    async def step(self, session_id: str, action: str) -> Any: ...


class PlainHTTP:
    """/reset and /step through a general-purpose HTTP library (the library comparison)."""

    def __init__(self, post: Callable[[str, dict], Awaitable[Any]]):
        self._post = post

    async def reset(self, session_id: str, seed: int) -> Any:
        return await self._post("/reset", {"session_id": session_id, "seed": seed})

    async def step(self, session_id: str, action: str) -> Any:
        return await self._post("/step", {"session_id": session_id, "action": action})


async def per_session(c: EnvClient, pid: int, trajs: list[list[str]], sessions: int,
                      duration: float, verbs: Verbs | None = None, think_s: float = 0.0) -> dict:
    """Each session: reset, replay its trajectory step by step (+ optional think time), through
    `verbs` (default: the client `c`, which also creates and closes the sessions)."""
    verbs = verbs or c
    lat: list[float] = []
    steps = 0
    ids = [f"ps-{sessions}-{i}" for i in range(sessions)]
    await c.create_many(ids)
    rng = random.Random(sessions)

    async def run(i: int, sid: str, stop: float) -> None:
        nonlocal steps
        k = i
        if think_s:
            await asyncio.sleep(rng.uniform(0, think_s))
        while time.perf_counter() < stop:
            await verbs.reset(sid, k % len(trajs))
            for a in trajs[k % len(trajs)]:
                t = time.perf_counter()
                await verbs.step(sid, a)
                lat.append(time.perf_counter() - t)
                steps += 1
                if think_s:
                    await asyncio.sleep(max(0.0, think_s - (time.perf_counter() - t)))
            k += sessions

    with CPU(pid) as cpu:
        start = time.perf_counter()
        await asyncio.gather(*[run(i, s, start + duration) for i, s in enumerate(ids)])
        el = time.perf_counter() - start
    await c.close_many(ids)
    return {"steps_per_s": steps / el, "p50_ms": pct(lat, .5), "p99_ms": pct(lat, .99),
            **cpu.per_step(steps)}


async def batched(c: EnvClient, pid: int, trajs: list[list[str]], sessions: int,
                  duration: float) -> dict:
    """A rollout loop: one /step_batch per turn for all sessions; finished ones are reset
    together in one /reset_batch before the next turn."""
    lat: list[float] = []
    steps = 0
    ids = [f"b-{sessions}-{i}" for i in range(sessions)]
    await c.create_many(ids)
    task = {sid: i % len(trajs) for i, sid in enumerate(ids)}
    pos = dict.fromkeys(ids, 0)
    await c.reset_batch([(sid, task[sid]) for sid in ids])
    nxt = sessions
    with CPU(pid) as cpu:
        start = time.perf_counter()
        while time.perf_counter() - start < duration:
            t = time.perf_counter()
            out = await c.step_batch([(sid, trajs[task[sid]][pos[sid]]) for sid in ids])
            lat.append(time.perf_counter() - t)
            steps += len(ids)
            finished = []
            for sid, r in zip(ids, out):
                assert "error" not in r, r
                pos[sid] += 1
                if r["done"]:
                    task[sid], pos[sid], nxt = nxt % len(trajs), 0, nxt + 1
                    finished.append((sid, task[sid]))
            if finished:
                await c.reset_batch(finished)
        el = time.perf_counter() - start
    await c.close_many(ids)
    return {"steps_per_s": steps / el, "p50_ms": pct(lat, .5), "p99_ms": pct(lat, .99),
            "serial": True, **cpu.per_step(steps)}


async def library_rows(c: EnvClient, url: str, pid: int, trajs: list[list[str]], sessions: int,
                       duration: float, measure: Callable[..., Awaitable[None]]) -> None:
    """The per-session loop through aiohttp and httpx, next to this project's client."""
    await measure(f"client_ours_{sessions}", f"per-session, our client, {sessions}", sessions,
                  per_session(c, pid, trajs, sessions, duration))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=sessions)) as a:
        async def post_aiohttp(path: str, body: dict) -> Any:
            async with a.post(url + path, json=body) as r:
                r.raise_for_status()
                return await r.json()

        await measure(f"client_aiohttp_{sessions}", f"per-session, aiohttp, {sessions}",
                      sessions,
                      per_session(c, pid, trajs, sessions, duration, PlainHTTP(post_aiohttp)))
    limits = httpx.Limits(max_connections=sessions, max_keepalive_connections=sessions)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as h:
        async def post_httpx(path: str, body: dict) -> Any:
            return (await h.post(path, json=body)).raise_for_status().json()

        await measure(f"client_httpx_{sessions}", f"per-session, httpx, {sessions}", sessions,
                      per_session(c, pid, trajs, sessions, duration, PlainHTTP(post_httpx)))


# ---------------------------------------------------------------------------------- main

def row(name: str, r: dict, base: dict) -> str:
    """One measurement, with the ratio to the in-process engine measured just before it.

    `cores`: CPU seconds per second the service and the client got together; `ceiling`: the
    steps/s their CPU per step would allow with the machine to themselves: two cores where
    many requests overlap, one for the batched loop, whose service and client take turns (on a
    shared machine the gap to the measured steps/s is other tenants' load)."""
    cpu = ""
    if "server_cpu_us_per_step" in r:
        per_step = r["server_cpu_us_per_step"] + r["client_cpu_us_per_step"]
        cpu = (f"  cpu/step: service {r['server_cpu_us_per_step']:5.0f} us, client "
               f"{r['client_cpu_us_per_step']:5.0f} us (engine {base['cpu_us_per_step']:5.0f});"
               f" cores {r['steps_per_s'] * per_step / 1e6:4.2f}, ceiling "
               f"{(1e6 if r.get('serial') else 2e6) / per_step:6.0f}/s")
    return (f"{name:<34} {r['steps_per_s']:7.1f} steps/s = x{r['steps_per_s'] / base['steps_per_s']:5.3f}"
            f" of in-process ({base['steps_per_s']:7.1f})  p50 {r['p50_ms']:7.1f} ms"
            f"  p99 {r['p99_ms']:7.1f} ms{cpu}")


async def bench(args: argparse.Namespace, setup: Setup, url: str, pid: int, envs: list[Env],
                trajs: list[list[str]]) -> dict:
    res: dict = {}

    async def measure(key: str, name: str, sessions: int, coro: Awaitable[dict]) -> None:
        base = in_process(envs[:sessions], trajs, setup.baseline_s)
        res[key] = {**await coro, "in_process": base, "load_avg": os.getloadavg()}
        print(row(name, res[key], base), flush=True)

    async with EnvClient(url, max_connections=max(args.sessions) + 8, timeout_s=600) as c:
        await c.create("warm")
        for task in range(len(trajs)):
            await c.reset("warm", task)
        await c.close("warm")
        if args.env == "shop":
            res["engine_call"] = await inline_vs_threadpool(envs[0], trajs)
            print(f"engine step inline {res['engine_call']['inline_us']:.0f} us vs through a "
                  f"threadpool {res['engine_call']['threadpool_us']:.0f} us", flush=True)
            if not args.skip_libraries:
                await library_rows(c, url, pid, trajs, 64, args.duration, measure)
        for n in args.sessions:
            await measure(f"per_session_{n}", f"per-session verbs, {n}", n,
                          per_session(c, pid, trajs, n, args.duration))
        for n in args.sessions:
            await measure(f"batched_{n}", f"batched (1 request/turn), {n}", n,
                          batched(c, pid, trajs, n, args.duration))
        if args.env == "shop":
            n = max(args.sessions)
            await measure(f"open_loop_{n}", f"open loop {n} @ {args.open_loop_rate:.0f}/s offered",
                          n,
                          per_session(c, pid, trajs, n, args.duration,
                                      think_s=n / args.open_loop_rate))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", choices=sorted(SETUPS), default="shop")
    ap.add_argument("--sessions", default=None, type=lambda s: [int(x) for x in s.split(",")],
                    help="session counts (default: shop 64,256,512; alfworld 64)")
    ap.add_argument("--duration", type=float, default=None, help="seconds per service row")
    ap.add_argument("--engine-calls", choices=("inline", "offload"), default=None,
                    help="where the service runs engine calls (default: shop inline, alfworld "
                         "offload, as docs/env-service.md recommends)")
    ap.add_argument("--params", type=json.loads, default={},
                    help="engine parameters over the defaults, e.g. '{\"cache_dir\": \"/x\"}'")
    ap.add_argument("--open-loop-rate", type=float, default=3000.0)
    ap.add_argument("--skip-libraries", action="store_true",
                    help="shop: skip the aiohttp/httpx comparison rows")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    setup = SETUPS[args.env]
    args.sessions = args.sessions or list(setup.sessions)
    args.duration = args.duration or setup.duration_s
    offload = setup.offload if args.engine_calls is None else args.engine_calls == "offload"
    params = {**setup.params, **args.params}

    envs = [make_env(args.env, **params) for _ in range(max(args.sessions))]
    trajs = expert_trajectories(envs[0], setup.tasks)
    print(f"{platform.node()}: {psutil.cpu_count()} cores, load avg "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.env}, {len(trajs)} tasks, "
          f"{sum(map(len, trajs)) / len(trajs):.2f} steps/episode; service engine calls "
          f"{'offloaded' if offload else 'inline'}", flush=True)
    with serve_in_subprocess(args.env, max(args.sessions), params, offload=offload,
                             startup_timeout_s=600) as url:
        pid = uvloop.run(_pid(url))
        res = uvloop.run(bench(args, setup, url, pid, envs, trajs))
    res["load_avg_after"] = os.getloadavg()
    print(f"load avg after: {' '.join(f'{x:.2f}' for x in res['load_avg_after'])}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


async def _pid(url: str) -> int:
    async with EnvClient(url) as c:
        return (await c.info())["pid"]


if __name__ == "__main__":
    main()
