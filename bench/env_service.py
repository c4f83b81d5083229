"""Env service throughput and latency, side by side with the engine called in-process.

    python bench/env_service.py [--sessions 64,256,512] [--duration 4] [--json out.json]

One run measures, on the same machine and the same workload (every session replays the
expert trajectory of its task: reset, then ~4 steps, then the next task):
  - in-process: the engine's own steps/s (the ceiling);
  - engine call inline vs through a threadpool hop (why the service runs calls inline);
  - HTTP client libraries (httpx vs aiohttp) on /step at 64 sessions (why the client is aiohttp);
  - per-session verbs, closed loop, at each session count: steps/s, p50/p99 step latency;
  - batched verbs (one /step_batch per rollout turn for all sessions): steps/s, p50/p99 per batch;
  - open loop: 512 sessions offering the issue's target of 3,000 steps/s in total (each session
    thinks between steps, as a policy does): the latency of those steps.
The service runs in a subprocess (uvloop + httptools), the client in this process; they share
the machine's cores, and where the service's and client's CPU seconds per step go is printed.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import time
from pathlib import Path

import httpx
import psutil
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envs.client import EnvClient  # noqa: E402
from envs.registry import make_env  # noqa: E402
from envs.service import serve_in_subprocess  # noqa: E402

PARAMS = {"num_products": 300, "num_goals": 1000, "val_size": 64, "seed": 0}
TASKS = 200


def expert_trajectories(n: int) -> list[list[str]]:
    """The expert's actions for tasks 0..n-1 (identical work in every mode)."""
    env, out = make_env("shop", **PARAMS), []
    for seed in range(n):
        env.reset(seed)
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

def in_process(trajs: list[list[str]], duration: float) -> dict:
    env = make_env("shop", **PARAMS)
    steps, lat, k = 0, [], 0
    stop = time.perf_counter() + duration
    start, cpu0 = time.perf_counter(), time.process_time()
    while time.perf_counter() < stop:
        env.reset(k % TASKS)
        for a in trajs[k % TASKS]:
            t = time.perf_counter()
            env.step(a)
            lat.append(time.perf_counter() - t)
        steps += len(trajs[k % TASKS])
        k += 1
    el, cpu = time.perf_counter() - start, time.process_time() - cpu0
    return {"steps_per_s": steps / el, "p50_ms": pct(lat, .5), "p99_ms": pct(lat, .99),
            "cpu_us_per_step": cpu / steps * 1e6}


async def inline_vs_threadpool(trajs: list[list[str]], n: int = 3000) -> dict:
    """Cost of one engine step called inline vs awaited through the default threadpool."""
    env, loop = make_env("shop", **PARAMS), asyncio.get_running_loop()
    out = {}
    for mode in ("inline", "threadpool"):
        total, k = 0.0, 0
        while k < n:
            env.reset(k % TASKS)
            for a in trajs[k % TASKS]:
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


async def per_session(url: str, pid: int, trajs: list[list[str]], sessions: int,
                      duration: float, think_s: float = 0.0) -> dict:
    """Each session: reset, replay its trajectory step by step (+ optional think time)."""
    lat: list[float] = []
    steps = 0
    async with EnvClient(url, max_connections=sessions + 8) as c:
        ids = [f"ps-{sessions}-{i}" for i in range(sessions)]
        await c.create_many(ids)
        rng = random.Random(sessions)

        async def run(i: int, sid: str, stop: float) -> None:
            nonlocal steps
            k = i
            if think_s:
                await asyncio.sleep(rng.uniform(0, think_s))
            while time.perf_counter() < stop:
                await c.reset(sid, k % TASKS)
                for a in trajs[k % TASKS]:
                    t = time.perf_counter()
                    await c.step(sid, a)
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


async def batched(url: str, pid: int, trajs: list[list[str]], sessions: int,
                  duration: float) -> dict:
    """A rollout loop: one /step_batch per turn for all sessions; finished ones are reset
    together in one /reset_batch before the next turn."""
    lat: list[float] = []
    steps = 0
    async with EnvClient(url) as c:
        ids = [f"b-{sessions}-{i}" for i in range(sessions)]
        await c.create_many(ids)
        task = {sid: i % TASKS for i, sid in enumerate(ids)}
        pos = {sid: 0 for sid in ids}
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
                        task[sid], pos[sid], nxt = nxt % TASKS, 0, nxt + 1
                        finished.append((sid, task[sid]))
                if finished:
                    await c.reset_batch(finished)
            el = time.perf_counter() - start
        await c.close_many(ids)
    return {"steps_per_s": steps / el, "p50_ms": pct(lat, .5), "p99_ms": pct(lat, .99),
            **cpu.per_step(steps)}


async def httpx_per_session(url: str, trajs: list[list[str]], sessions: int,
                            duration: float) -> dict:
    """The per-session loop with httpx.AsyncClient instead of aiohttp (library comparison)."""
    lat: list[float] = []
    steps = 0
    limits = httpx.Limits(max_connections=sessions, max_keepalive_connections=sessions)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=120) as h:
        ids = [f"hx-{i}" for i in range(sessions)]
        await asyncio.gather(*[h.post("/create", json={"session_id": s}) for s in ids])

        async def run(i: int, sid: str, stop: float) -> None:
            nonlocal steps
            k = i
            while time.perf_counter() < stop:
                (await h.post("/reset", json={"session_id": sid, "seed": k % TASKS})).raise_for_status()
                for a in trajs[k % TASKS]:
                    t = time.perf_counter()
                    (await h.post("/step", json={"session_id": sid, "action": a})).raise_for_status()
                    lat.append(time.perf_counter() - t)
                    steps += 1
                k += sessions

        start = time.perf_counter()
        await asyncio.gather(*[run(i, s, start + duration) for i, s in enumerate(ids)])
        el = time.perf_counter() - start
        await asyncio.gather(*[h.post("/close", json={"session_id": s}) for s in ids])
    return {"steps_per_s": steps / el, "p50_ms": pct(lat, .5), "p99_ms": pct(lat, .99)}


# ---------------------------------------------------------------------------------- main

def row(name: str, r: dict, base: dict) -> str:
    """One measurement, with the ratio to the in-process engine measured just before it (the
    machine is shared, so a baseline taken minutes earlier would compare different loads)."""
    cpu = ""
    if "server_cpu_us_per_step" in r:
        cpu = (f"  cpu/step: service {r['server_cpu_us_per_step']:4.0f} us, client "
               f"{r['client_cpu_us_per_step']:4.0f} us (engine {base['cpu_us_per_step']:3.0f})")
    return (f"{name:<32} {r['steps_per_s']:6.0f} steps/s = x{r['steps_per_s'] / base['steps_per_s']:5.3f}"
            f" of in-process ({base['steps_per_s']:5.0f})  p50 {r['p50_ms']:7.1f} ms"
            f"  p99 {r['p99_ms']:7.1f} ms{cpu}")


async def bench(args: argparse.Namespace, url: str, pid: int, trajs: list[list[str]]) -> dict:
    res: dict = {}

    async def measure(key: str, name: str, coro) -> None:
        base = in_process(trajs, 1.0)
        res[key] = {**await coro, "in_process": base}
        print(row(name, res[key], base), flush=True)

    res["engine_call"] = await inline_vs_threadpool(trajs)
    print(f"engine step inline {res['engine_call']['inline_us']:.0f} us vs through a threadpool "
          f"{res['engine_call']['threadpool_us']:.0f} us", flush=True)
    if not args.skip_httpx:
        await measure("httpx_64", "per-session httpx, 64",
                      httpx_per_session(url, trajs, 64, args.duration))
    for n in args.sessions:
        await measure(f"per_session_{n}", f"per-session aiohttp, {n}",
                      per_session(url, pid, trajs, n, args.duration))
    for n in args.sessions:
        await measure(f"batched_{n}", f"batched (1 request/turn), {n}",
                      batched(url, pid, trajs, n, args.duration))
    n = max(args.sessions)
    await measure(f"open_loop_{n}", f"open loop {n} @ {args.open_loop_rate:.0f}/s offered",
                  per_session(url, pid, trajs, n, args.duration, think_s=n / args.open_loop_rate))
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", default="64,256,512",
                    type=lambda s: [int(x) for x in s.split(",")])
    ap.add_argument("--duration", type=float, default=4.0, help="seconds per measurement")
    ap.add_argument("--open-loop-rate", type=float, default=3000.0)
    ap.add_argument("--skip-httpx", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    trajs = expert_trajectories(TASKS)
    print(f"{platform.node()}: {psutil.cpu_count()} cores, load avg "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; trajectories: "
          f"{sum(map(len, trajs)) / TASKS:.2f} steps/episode", flush=True)
    with serve_in_subprocess("shop", max(args.sessions), PARAMS) as url:
        pid = asyncio.run(_pid(url))
        res = uvloop.run(bench(args, url, pid, trajs))
    res["load_avg_after"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


async def _pid(url: str) -> int:
    async with EnvClient(url) as c:
        return (await c.info())["pid"]


if __name__ == "__main__":
    main()
