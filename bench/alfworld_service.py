"""ALFWorld env throughput at 64 concurrent sessions: in-process vs through the env service.

    python bench/alfworld_service.py [--sessions 64] [--duration 20] [--tasks 24] [--json out.json]

Workload (identical in every mode): session i plays the expert walkthrough of validation task
(i + k * sessions) % tasks: reset, then its ~7 steps, then the next task. Engines are warmed
first (one reset per task in each process), so the numbers are the steady state in which every
game's PDDL translation is cached; resets are part of the work, steps are what is counted.
  - in-process: `sessions` AlfworldEnv instances in this process, advanced one turn at a time
    (what a local batched rollout does);
  - service, per-session verbs: one aiohttp request per step, `sessions` in flight;
  - service, batched verbs: one /step_batch per turn for all sessions, finished ones reset
    together in one /reset_batch.
The service (`python -m envs.service --env alfworld --offload`, pool = sessions) runs in a
subprocess; engine calls run in its worker threads, serialised by the engine lock (`--inline`:
on its event loop instead).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import sys
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from envs.client import EnvClient  # noqa: E402
from envs.registry import make_env  # noqa: E402
from envs.service import serve_in_subprocess  # noqa: E402


def walkthroughs(params: dict, tasks: int) -> list[list[str]]:
    env = make_env("alfworld", **params)
    return [json.loads(env.game(t).path.read_text())["walkthrough"] for t in range(tasks)]


def in_process(envs: list, trajs: list[list[str]], duration: float) -> dict:
    sessions = len(envs)
    task = {i: i % len(trajs) for i in range(sessions)}
    pos = dict.fromkeys(range(sessions), 0)
    for i, env in enumerate(envs):
        env.reset(task[i])
    steps, resets, nxt = 0, 0, sessions
    start, cpu0 = time.perf_counter(), time.process_time()
    while time.perf_counter() - start < duration:
        for i, env in enumerate(envs):
            _, _, done, _ = env.step(trajs[task[i]][pos[i]])
            steps, pos[i] = steps + 1, pos[i] + 1
            if done:
                task[i], pos[i], nxt = nxt % len(trajs), 0, nxt + 1
                env.reset(task[i])
                resets += 1
    el, cpu = time.perf_counter() - start, time.process_time() - cpu0
    return {"steps_per_s": steps / el, "resets_per_s": resets / el, "cpu_ms_per_step": cpu / steps * 1e3}


async def warm(url: str, tasks: int) -> None:
    async with EnvClient(url) as c:
        await c.create("warm")
        for t in range(tasks):
            await c.reset("warm", t)
        await c.close("warm")


async def per_session(url: str, trajs: list[list[str]], sessions: int, duration: float) -> dict:
    steps = resets = 0
    lat: list[float] = []
    async with EnvClient(url, max_connections=sessions + 8, timeout_s=600) as c:
        ids = [f"ps-{i}" for i in range(sessions)]
        await c.create_many(ids)

        async def run(i: int, sid: str, stop: float) -> None:
            nonlocal steps, resets
            k = i
            while time.perf_counter() < stop:
                await c.reset(sid, k % len(trajs))
                resets += 1
                for a in trajs[k % len(trajs)]:
                    t = time.perf_counter()
                    await c.step(sid, a)
                    lat.append(time.perf_counter() - t)
                    steps += 1
                k += sessions

        start = time.perf_counter()
        await asyncio.gather(*[run(i, s, start + duration) for i, s in enumerate(ids)])
        el = time.perf_counter() - start
        await c.close_many(ids)
    lat.sort()
    return {"steps": steps, "steps_per_s": steps / el, "resets_per_s": resets / el,
            "p50_ms": lat[len(lat) // 2] * 1e3, "p99_ms": lat[int(0.99 * len(lat))] * 1e3}


async def batched(url: str, trajs: list[list[str]], sessions: int, duration: float) -> dict:
    steps = resets = 0
    async with EnvClient(url, timeout_s=600) as c:
        ids = [f"b-{i}" for i in range(sessions)]
        await c.create_many(ids)
        task = {sid: i % len(trajs) for i, sid in enumerate(ids)}
        pos = dict.fromkeys(ids, 0)
        await c.reset_batch([(sid, task[sid]) for sid in ids])
        nxt = sessions
        start = time.perf_counter()
        while time.perf_counter() - start < duration:
            out = await c.step_batch([(sid, trajs[task[sid]][pos[sid]]) for sid in ids])
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
                resets += len(finished)
        el = time.perf_counter() - start
        await c.close_many(ids)
    return {"steps": steps, "steps_per_s": steps / el, "resets_per_s": resets / el}


def service_cpu(pid: int) -> float:
    return sum(psutil.Process(pid).cpu_times()[:2])


async def info_pid(url: str) -> int:
    async with EnvClient(url) as c:
        return (await c.info())["pid"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sessions", type=int, default=64)
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per measurement")
    ap.add_argument("--tasks", type=int, default=24, help="validation tasks played (warmed first)")
    ap.add_argument("--cache-dir", default=None, help="generated games (default: the env's default)")
    ap.add_argument("--inline", action="store_true",
                    help="run engine calls on the service's event loop (no --offload)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    params = {"data_dir": "generated", **({"cache_dir": args.cache_dir} if args.cache_dir else {})}
    trajs = walkthroughs(params, args.tasks)
    print(f"{platform.node()}: {psutil.cpu_count()} cores, load avg "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.sessions} sessions, "
          f"{args.tasks} tasks, {sum(map(len, trajs)) / len(trajs):.2f} steps/episode", flush=True)
    envs = [make_env("alfworld", **params) for _ in range(args.sessions)]
    for t in range(args.tasks):               # warm the translation cache: one reset per task
        envs[0].reset(t)
    res: dict = {}
    with serve_in_subprocess("alfworld", args.sessions, params, offload=not args.inline,
                             startup_timeout_s=600) as url:
        pid = asyncio.run(info_pid(url))
        asyncio.run(warm(url, args.tasks))
        for name, run in (("per_session", per_session), ("batched", batched)):
            base = in_process(envs, trajs, args.duration / 2)
            cpu0 = service_cpu(pid)
            r = asyncio.run(run(url, trajs, args.sessions, args.duration))
            r["service_cpu_ms_per_step"] = (service_cpu(pid) - cpu0) / r["steps"] * 1e3
            res[name] = {**r, "in_process": base}
            extra = f"  p50 {r['p50_ms']:.0f} ms  p99 {r['p99_ms']:.0f} ms" if "p50_ms" in r else ""
            print(f"{name:<12} {r['steps_per_s']:6.1f} steps/s ({r['resets_per_s']:.1f} resets/s) = "
                  f"x{r['steps_per_s'] / base['steps_per_s']:.2f} of in-process "
                  f"({base['steps_per_s']:.1f} steps/s, {base['cpu_ms_per_step']:.1f} ms CPU/step); "
                  f"service {r['service_cpu_ms_per_step']:.1f} ms CPU/step{extra}", flush=True)
    res["load_avg_after"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
