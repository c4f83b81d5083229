"""A lane's fits on one compute thread, next to the same fits with two OpenMP pools in the process.

    python -m bench.lane_threads --json /tmp/lane-threads.json      # the default recipe, CPU

torch's CPU kernels run on OpenMP, and libgomp keeps a pool of worker threads for every thread
that ran a parallel region. Until 2026-12-05 the trainer service built its trainer on its main
thread and served requests from a web server's worker threads: two pools, more pool threads than
cores, and libgomp then sleeps at every barrier instead of spinning. Now every torch call of a
lane runs on one thread (`client_app.service.compute_thread`). Two arms, each a fresh process
that builds the default recipe's trainer on its main thread, then fits round 1's first
`--clients` of the default run (their shards, the initial weights, E local epochs):
- *one thread* (the lane now): the fits run on the thread that built the trainer;
- *two pools* (the lane before): the fits run on a second, long-lived thread.
Arms alternate `--repeats` times. Per fit: wall, CPU seconds of the process, and how often its
threads went to sleep (voluntary context switches, all threads). The fits are bit-identical in
both arms (their training success is printed); the ratio is two pools' wall over one thread's.

    python -m bench.lane_threads --nodes 2 --clients 55 --repeats 1   # two CPU nodes on one host

With `--nodes N`, N such processes (the lanes of N CPU SuperNodes on one host) fit at once, on
one thread each, in two arms: *all cores* (each takes torch's default thread count, the lanes
before `fl_app.host.cpu_threads`) and *shared* (each takes its share of the usable cores, the
lanes now). The ratio is all cores' fit wall over shared's.
"""

from __future__ import annotations

import argparse
import json
import platform
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from fl_app.host import cpu_threads, voluntary_context_switches

ROUND = 1
DEFAULT_CLIENTS = (55, 9)  # round 1 of the default run (seed 0)


def child(mode: str, clients: list[int], overrides: list[str], threads: int) -> list[dict[str, Any]]:
    """One arm in this process: build on the main thread, fit on it or on a second thread; with
    `threads` > 0 torch's CPU ops use that many threads."""
    import torch

    from client_app.trainer import make_trainer
    from client_app.trainer.base import ClientTasks
    from envs.service import serve_in_subprocess
    from fl_app.calls import FitCall
    from fl_app.config import load_config
    from partitions.pool import build_pool
    from partitions.registry import plan_partition

    if threads:
        torch.set_num_threads(threads)
    cfg = load_config("tiny-shop-grpo", overrides=dict(o.split("=", 1) for o in overrides))
    plan = plan_partition(cfg, build_pool(cfg.env.name, cfg.env.params))
    records: list[dict[str, Any]] = []
    with serve_in_subprocess(cfg.env.name, cfg.env.pool_size, cfg.env.params) as url:
        trainer = make_trainer(cfg, url, run_dir=Path(tempfile.mkdtemp(prefix="lane-threads-")))
        initial = {k: v.clone() for k, v in trainer.export_weights().items()}  # parallel copies: a pool

        def fits() -> None:
            for c in clients:
                trainer.load_weights(initial)
                call, tasks = (
                    FitCall(
                        round=ROUND,
                        client_id=c,
                        local_epochs=cfg.federation.local_epochs,
                        seed=cfg.run.seed,
                        proximal_mu=0.0,
                    ),
                    ClientTasks(plan.shard(c)),
                )
                r0, s0, t0 = resource.getrusage(resource.RUSAGE_SELF), voluntary_context_switches(), time.perf_counter()
                m = trainer.fit(call, tasks).metrics
                wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
                cpu = r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime
                records.append(
                    {
                        "client": c,
                        "wall_s": wall,
                        "cpu_s": cpu,
                        "cores": cpu / wall,
                        "sleeps_per_s": (voluntary_context_switches() - s0) / wall,
                        "rollout_s": m["rollout_s"],
                        "update_s": m["update_s"],
                        "train_success": m["train_success"],
                    }
                )

        try:
            if mode == "one-thread":
                fits()
            else:
                worker = threading.Thread(target=fits, name="request-worker")
                worker.start()
                worker.join()
        finally:
            trainer.close()
    return records


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, nargs="+", default=list(DEFAULT_CLIENTS))
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--nodes", type=int, default=1, help="CPU nodes fitting at once on this host")
    ap.add_argument("--child", choices=("one-thread", "two-pools"), help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="recipe overrides, a.b=c")
    args = ap.parse_args()
    if args.child:
        print("RESULT " + json.dumps(child(args.child, args.clients, args.overrides, args.threads)), flush=True)
        return
    if args.nodes > 1:  # arm -> (child mode, torch threads per process)
        import torch

        share = cpu_threads(args.nodes, torch.get_num_threads())
        names, ratio_of = {"all-cores": ("one-thread", 0), "shared": ("one-thread", share)}, ("all-cores", "shared")
    else:
        names, ratio_of = {"one-thread": ("one-thread", 0), "two-pools": ("two-pools", 0)}, ("two-pools", "one-thread")
    arms: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for rep in range(args.repeats):
        order = list(names) if rep % 2 == 0 else list(reversed(names))
        for name in order:
            mode, threads = names[name]
            cmd = [sys.executable, "-m", "bench.lane_threads", "--child", mode, "--threads", str(threads)]
            cmd += ["--clients", *map(str, args.clients), *args.overrides]
            procs = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(args.nodes)]
            outs = [p.communicate()[0] for p in procs]
            if any(p.returncode for p in procs):
                raise SystemExit(f"{name}: a child failed (exit codes {[p.returncode for p in procs]})")
            rows = [r for out in outs for r in json.loads(out.split("RESULT ", 1)[1])]
            arms[name] += rows
            for r in rows:
                print(
                    f"{name:10s} client {r['client']:3d}: {r['wall_s']:5.1f} s (rollout {r['rollout_s']:.1f}, update "
                    f"{r['update_s']:.1f}), {r['cores']:.2f} cores, {r['sleeps_per_s']:7.0f} sleeps/s, "
                    f"train success {r['train_success']:.4f}",
                    flush=True,
                )
    wall = {m: sum(r["wall_s"] for r in rows) for m, rows in arms.items()}
    slow, fast = ratio_of
    ratio = wall[slow] / wall[fast]
    print(f"fits' wall: {fast} {wall[fast]:.1f} s, {slow} {wall[slow]:.1f} s: x{ratio:.2f}")
    if args.json:
        report = {"machine": platform.processor() or platform.machine(), "arms": arms, "ratio": ratio}
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
