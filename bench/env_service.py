"""Env service throughput and latency: this checkout's service and client ("after") side by side
with a baseline commit's ("before") and with the same engine called in-process, in one run.

    python bench/env_service.py [--env shop|alfworld] [--sessions 64,256,512] [--duration S]
                                [--rounds R] [--modes batched,per_session]
                                [--baseline-ref REV | --no-baseline]
                                [--engine-calls inline|offload] [--params JSON] [--json out.json]

Workload, identical in every mode: session i plays the expert trajectory of task
(i + k * sessions) % tasks: reset, its steps, then the next task. Steps are counted; resets are
part of the work. Every process first resets every task once (ALFWorld caches each game's
translation per process).

Before: `envs/service.py` and `envs/client.py` of `--baseline-ref` (default: the last commit
with the hand-written HTTP/1.1 client and the bare-ASGI verbs), taken from git into a temporary
package and run against this checkout's engines, so only the wire differs.

Rows, for each session count, measured in `--rounds` interleaved rounds (the machine may be
shared, so every ratio is taken within one round: in-process, then before and after in
alternating order) and reported as medians over the rounds:
  - batched verbs: one step_batch per turn for all sessions, finished ones reset together in
    one reset_batch (what the trainer does; each client's own transport: POSTs before, the
    /batch WebSocket channel after): steps/s, p50/p99 per batch;
  - per-session verbs, closed loop: steps/s, p50/p99 step latency;
and once: (shop) one engine step inline vs awaited through a threadpool (why the service runs
calls inline), and an open loop of the after-code at the largest session count offering
`--open-loop-rate` steps/s in total (each session thinks between steps, as a policy does).
In-process = `sessions` engines in this process advanced one turn at a time (the ceiling). Each
service runs in a subprocess (pool = the largest session count), its client in this process on
uvloop; each row also gives the CPU seconds per step that the service and the client spent.
This process's engines and trajectories are frozen out of the cyclic garbage collector's reach
before measuring (as the service freezes its pool), so a client's collections cost what they
would in a process without 512 engines in it.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import importlib.util
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

import psutil
import uvloop

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from envs.base import Env  # noqa: E402
from envs.client import EnvClient  # noqa: E402
from envs.registry import make_env  # noqa: E402
from envs.service import READY_PREFIX, serve_in_subprocess, stop_process  # noqa: E402

# The last commit with the hand-written HTTP/1.1 client and the bare-ASGI verbs.
DEFAULT_BASELINE = "110ee4d153ed92ebe138a994e795fd8e5c4030da"


@dataclasses.dataclass(frozen=True)
class Setup:
    """Per-engine defaults: what a row plays and how long it is measured."""

    params: dict
    tasks: int  # tasks played (validation tasks come first)
    sessions: tuple[int, ...]
    duration_s: float  # per service row
    baseline_s: float  # in-process, before each round
    offload: bool  # the service's recommended mode for this engine (docs/env-service.md)


SETUPS = {
    "shop": Setup(
        {"num_products": 300, "num_goals": 1000, "val_size": 64, "seed": 0},
        tasks=200,
        sessions=(64, 256, 512),
        duration_s=3.0,
        baseline_s=1.0,
        offload=False,
    ),
    # ALFWorld: a step ~10 ms, a warm reset ~0.15 s of CPU; the default generated game set
    # (generated on first use, docs/alfworld.md), its 24 validation games.
    "alfworld": Setup(
        {"data_dir": "generated"}, tasks=24, sessions=(64,), duration_s=20.0, baseline_s=10.0, offload=True
    ),
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
    return {
        "steps_per_s": steps / el,
        "p50_ms": pct(lat, 0.5),
        "p99_ms": pct(lat, 0.99),
        "cpu_us_per_step": cpu / steps * 1e6,
    }


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
        return {
            "server_cpu_us_per_step": self.used[0] / steps * 1e6,
            "client_cpu_us_per_step": self.used[1] / steps * 1e6,
        }


async def per_session(
    c: Any, pid: int, trajs: list[list[str]], sessions: int, duration: float, think_s: float = 0.0
) -> dict:
    """Each session: reset, replay its trajectory step by step (+ optional think time)."""
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
            await c.reset(sid, k % len(trajs))
            for a in trajs[k % len(trajs)]:
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
    return {"steps_per_s": steps / el, "p50_ms": pct(lat, 0.5), "p99_ms": pct(lat, 0.99), **cpu.per_step(steps)}


async def batched(c: Any, pid: int, trajs: list[list[str]], sessions: int, duration: float) -> dict:
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
    return {
        "steps_per_s": steps / el,
        "p50_ms": pct(lat, 0.5),
        "p99_ms": pct(lat, 0.99),
        "serial": True,
        **cpu.per_step(steps),
    }


# ---------------------------------------------------------------------------- the baseline


@dataclasses.dataclass
class Target:
    """One service and the client class that talks to it."""

    name: str
    url: str
    pid: int
    client: Callable[..., Any]


def baseline_code(ref: str, into: Path) -> ModuleType:
    """`envs/service.py` and `envs/client.py` of `ref` as the package `envsvc_baseline` under
    `into` (they import the engines, ports and registry of this checkout); its client module."""
    pkg = into / "envsvc_baseline"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    for name in ("service.py", "client.py"):
        try:
            code = subprocess.run(
                ["git", "-C", str(ROOT), "show", f"{ref}:envs/{name}"], check=True, capture_output=True
            ).stdout
        except (OSError, subprocess.CalledProcessError) as e:
            raise SystemExit(
                f"cannot read envs/{name} at {ref!r} from git ({e}); pass "
                f"--baseline-ref with a commit of this repository, or --no-baseline"
            ) from e
        (pkg / name).write_bytes(code)
    spec = importlib.util.spec_from_file_location("envsvc_baseline.client", pkg / "client.py")
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load the baseline client from {pkg / 'client.py'}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def baseline_service(
    into: Path, env: str, pool: int, params: dict, offload: bool, timeout_s: float = 600.0
) -> Iterator[str]:
    """The baseline service (`python -m envsvc_baseline.service`) for the `with` block; its URL.
    Stopped by PID on every path; it also exits by itself if this process dies."""
    cmd = [
        sys.executable,
        "-m",
        "envsvc_baseline.service",
        "--env",
        env,
        "--pool-size",
        str(pool),
        "--params",
        json.dumps(params),
        "--parent-pid",
        str(os.getpid()),
    ]
    if offload:
        cmd.append("--offload")
    path = os.pathsep.join([str(into), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env={**os.environ, "PYTHONPATH": path}
    )
    url: list[str] = []
    ready = threading.Event()

    stdout = proc.stdout
    assert stdout is not None  # Popen(stdout=PIPE) always gives a pipe

    def drain() -> None:
        for line in stdout:
            if line.startswith(READY_PREFIX) and not url:
                url.append(json.loads(line[len(READY_PREFIX) :])["url"])
                ready.set()
        ready.set()

    reader = threading.Thread(target=drain, daemon=True)
    reader.start()
    try:
        if not ready.wait(timeout_s) or not url:
            raise SystemExit(f"the baseline service (pid {proc.pid}) did not start")
        yield url[0]
    finally:
        stop_process(proc)
        reader.join(5)


async def _pid(client: Callable[..., Any], url: str) -> int:
    async with client(url) as c:
        return (await c.info())["pid"]


# ---------------------------------------------------------------------------------- main


def cpu_note(r: dict) -> str:
    if "server_cpu_us_per_step" not in r:
        return ""
    return f"cpu/step service {r['server_cpu_us_per_step']:4.0f} + client {r['client_cpu_us_per_step']:4.0f} us"


async def measure_rows(
    args: argparse.Namespace, setup: Setup, targets: list[Target], envs: list[Env], trajs: list[list[str]]
) -> dict:
    """Every (mode, sessions) row: `args.rounds` rounds of in-process + each target."""
    res: dict = {}
    clients = {t.name: t.client(t.url, max_connections=max(args.sessions) + 8, timeout_s=600) for t in targets}
    try:
        for t in targets:
            c = clients[t.name]
            await c.create("warm")
            for task in range(len(trajs)):
                await c.reset("warm", task)
            await c.close("warm")
        modes = {"batched": batched, "per_session": per_session}
        for mode, fn in ((m, modes[m]) for m in args.modes):
            for n in args.sessions:
                rounds = []
                for r in range(args.rounds):
                    row = {"in_process": in_process(envs[:n], trajs, setup.baseline_s)}
                    for t in targets if r % 2 == 0 else targets[::-1]:
                        row[t.name] = await fn(clients[t.name], t.pid, trajs, n, args.duration)
                    rounds.append(row)
                res[f"{mode}_{n}"] = summary = summarize(rounds, [t.name for t in targets])
                print(
                    f"{mode:<11} {n:4d}  "
                    + "  |  ".join(
                        f"{name} {s['steps_per_s']:7.0f}/s x{s['of_in_process']:.2f} p50 {s['p50_ms']:5.1f} "
                        f"p99 {s['p99_ms']:6.1f} ms {cpu_note(s)}"
                        for name, s in summary.items()
                        if name != "ratios"
                    )
                    + "  |  "
                    + "  ".join(f"{k} x{v:.2f}" for k, v in summary["ratios"].items()),
                    flush=True,
                )
        if args.env == "shop" and "per_session" in args.modes:
            n, after = max(args.sessions), targets[-1]
            out = await per_session(
                clients[after.name], after.pid, trajs, n, args.duration, think_s=n / args.open_loop_rate
            )
            res[f"open_loop_{n}"] = out
            print(
                f"open loop, {after.name}, {n} sessions @ {args.open_loop_rate:.0f}/s offered: "
                f"{out['steps_per_s']:.0f}/s p50 {out['p50_ms']:.1f} p99 {out['p99_ms']:.1f} ms "
                f"{cpu_note(out)}",
                flush=True,
            )
    finally:
        for c in clients.values():
            await c.aclose()
    return res


def summarize(rounds: list[dict], names: list[str]) -> dict:
    """Medians over rounds; each ratio is taken within its round first."""

    def med(key: str, name: str) -> float:
        return statistics.median(r[name][key] for r in rounds)

    out: dict[str, Any] = {}
    for name in ["in_process", *names]:
        out[name] = {k: med(k, name) for k in rounds[0][name] if k != "serial"}
        out[name]["of_in_process"] = statistics.median(
            r[name]["steps_per_s"] / r["in_process"]["steps_per_s"] for r in rounds
        )
        out[name]["per_round"] = [r[name]["steps_per_s"] for r in rounds]
    if len(names) == 2:
        out["ratios"] = {
            f"{names[1]}/{names[0]}": statistics.median(
                r[names[1]]["steps_per_s"] / r[names[0]]["steps_per_s"] for r in rounds
            )
        }
    else:
        out["ratios"] = {}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--env", choices=sorted(SETUPS), default="shop")
    ap.add_argument(
        "--sessions",
        default=None,
        type=lambda s: [int(x) for x in s.split(",")],
        help="session counts (default: shop 64,256,512; alfworld 64)",
    )
    ap.add_argument("--duration", type=float, default=None, help="seconds per service row")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds per row (medians)")
    ap.add_argument(
        "--modes",
        default="batched,per_session",
        help="which rows, comma-separated: batched, per_session (default both)",
    )
    ap.add_argument(
        "--baseline-ref",
        default=DEFAULT_BASELINE,
        help="git revision whose envs/service.py + envs/client.py are 'before'",
    )
    ap.add_argument("--no-baseline", action="store_true", help="measure this checkout only")
    ap.add_argument(
        "--engine-calls",
        choices=("inline", "offload"),
        default=None,
        help="where the services run engine calls (default: shop inline, alfworld "
        "offload, as docs/env-service.md recommends)",
    )
    ap.add_argument(
        "--params",
        type=json.loads,
        default={},
        help='engine parameters over the defaults, e.g. \'{"cache_dir": "/x"}\'',
    )
    ap.add_argument("--open-loop-rate", type=float, default=3000.0)
    ap.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    args.modes = args.modes.split(",")
    if not set(args.modes) <= {"batched", "per_session"}:
        ap.error(f"--modes takes batched and/or per_session, got {','.join(args.modes)}")
    setup = SETUPS[args.env]
    args.sessions = args.sessions or list(setup.sessions)
    args.duration = args.duration or setup.duration_s
    offload = setup.offload if args.engine_calls is None else args.engine_calls == "offload"
    params = {**setup.params, **args.params}
    pool = max(args.sessions)

    envs = [make_env(args.env, **params) for _ in range(pool)]
    trajs = expert_trajectories(envs[0], setup.tasks)
    # The in-process engines are this process's apparatus, not part of a client's heap: out of
    # the cyclic collector's reach, so the clients' collections do not traverse them (left in,
    # they made the client's CPU per step 1.5x at 64 sessions, for the client that allocates
    # more per request; the env service freezes its own engines the same way).
    gc.collect()
    gc.freeze()
    print(
        f"{platform.node()}: {psutil.cpu_count()} cores, load avg "
        f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.env}, {len(trajs)} tasks, "
        f"{sum(map(len, trajs)) / len(trajs):.2f} steps/episode; engine calls "
        f"{'offloaded' if offload else 'inline'}; before = "
        f"{'none' if args.no_baseline else args.baseline_ref}",
        flush=True,
    )
    res: dict = {"baseline_ref": None if args.no_baseline else args.baseline_ref, "load_avg_before": os.getloadavg()}
    with ExitStack() as stack:
        url = stack.enter_context(serve_in_subprocess(args.env, pool, params, offload=offload, startup_timeout_s=600))
        targets = []
        if not args.no_baseline:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="envsvc-before-")))
            old = baseline_code(args.baseline_ref, tmp)
            old_url = stack.enter_context(baseline_service(tmp, args.env, pool, params, offload))
            targets.append(Target("before", old_url, uvloop.run(_pid(old.EnvClient, old_url)), old.EnvClient))
        targets.append(Target("after", url, uvloop.run(_pid(EnvClient, url)), EnvClient))
        if args.env == "shop":
            res["engine_call"] = uvloop.run(inline_vs_threadpool(envs[0], trajs))
            print(
                f"engine step inline {res['engine_call']['inline_us']:.0f} us vs through a "
                f"threadpool {res['engine_call']['threadpool_us']:.0f} us",
                flush=True,
            )
        res.update(uvloop.run(measure_rows(args, setup, targets, envs, trajs)))
    res["load_avg_after"] = os.getloadavg()
    print(f"load avg after: {' '.join(f'{x:.2f}' for x in res['load_avg_after'])}")
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
