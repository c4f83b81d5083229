"""A lane over k ranks against one rank: one fit's wall per phase, and the gradient sum's cost.

    python -m bench.lane_ranks                          # the default recipe on the CPU
    python -m bench.lane_ranks --arms 1x1,2x1,4x1 algo.tasks_per_step=4
    python -m bench.lane_ranks --arms 1x1,2x1 --no-grad-sync backend=verl   # verl's FSDP2 over the ranks

*fit*: the recipe (tiny-shop-grpo, CPU; trailing `a.b=c` arguments override it), one lane
trainer per arm, each in a process of its own (rank 0 of a verl lane holds torch's default
process group), the same initial weights, one fit of client 0 in round 1. An arm `KxT` is a
lane of K ranks with T torch threads each (a CPU lane's service gives each rank its share of
the cores divided by K). Per arm: build (rank processes included), the fit's wall and its phases
(rollout, scoring, the wait for the slowest rank, update) as the fit reports them, and the rows
and tokens it trained on (equal in every arm: the same episodes).

*grad-sync*: 2 gloo ranks, the recipe's model, one fixed micro-batch of rows: forward + backward
+ summing the gradients over the ranks, `--steps` times, with the lane's bucketed all_reduce after
backward (`Ranks.sum_`) against DistributedDataParallel's (its reducer overlaps the all_reduce
with backward); milliseconds per step, and the gradient sum alone.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import json
import multiprocessing
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from client_app.models import model_dirs
from client_app.trainer import make_trainer
from client_app.trainer.base import ClientTasks
from client_app.trainer.ranks import Ranks
from envs.service import serve_in_subprocess
from fl_app.calls import FitCall
from fl_app.config import Config, load_config

PHASES = ("rollout_s", "scoring_s", "rank_wait_s", "update_s")


def bench_config(overrides: list[str], ranks: int) -> Config:
    return load_config("tiny-shop-grpo", dotlist=["run.device=cpu", f"run.lane_devices={ranks}", *overrides])


def fit_arm(overrides: list[str], ranks: int, threads: int, env_url: str, initial_path: str, out: str) -> None:
    """One fit arm, in its own process: its metrics as JSON in `out`."""
    cfg = bench_config(overrides, ranks)
    initial = torch.load(initial_path)
    torch.set_num_threads(threads)  # rank 0's; the fit hands it to the other ranks
    t0 = time.perf_counter()
    trainer = make_trainer(cfg, env_url)
    build_s = time.perf_counter() - t0
    try:
        trainer.load_weights(initial)
        val = int(cfg.env.params.get("val_size", 64))  # training tasks follow the validation split
        shard = list(range(val, val + 100))
        call = FitCall(round=1, client_id=0, local_epochs=cfg.federation.local_epochs, seed=cfg.run.seed)
        t0 = time.perf_counter()
        m = trainer.fit(call, ClientTasks(shard)).metrics
        fit_s = time.perf_counter() - t0
    finally:
        trainer.close()
    result = {
        "backend": cfg.backend,
        "ranks": ranks,
        "threads_per_rank": threads,
        "build_s": build_s,
        "fit_s": fit_s,
        **{k: m.get(k, 0.0) for k in PHASES},
        "rows": m["rows"],
        "tokens": m["rollout_tokens"],
    }
    Path(out).write_text(json.dumps(result))


def in_process(target: Any, *args: Any) -> dict[str, Any]:
    """`target(*args, out)` in a spawned process; what it wrote to `out`."""
    out = Path(tempfile.mkdtemp()) / "arm.json"
    proc = multiprocessing.get_context("spawn").Process(target=target, args=(*args, str(out)))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"{target.__name__}{args[1:3]} exited with code {proc.exitcode}")
    return json.loads(out.read_text())


def grad_sync_rank(rank: int, port: int, model_dir: str, steps: int, out: str) -> None:
    """One rank of the grad-sync arm (2 ranks, one thread each)."""
    from client_app.tiny_model import load_causal_lm

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)  # DDP's
    model, _ = load_causal_lm(model_dir, "cpu")
    ids = torch.randint(0, model.config.vocab_size, (16, 128), generator=torch.Generator().manual_seed(rank))
    params = [p for p in model.parameters() if p.requires_grad]
    ddp = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(model))  # its own hooks, its own grads

    def backward(m: torch.nn.Module) -> None:
        m(input_ids=ids, labels=ids).loss.backward()

    times: dict[str, float] = {}
    ranks = Ranks(rank, 2, torch.device("cpu"))
    ranks.connect(dist.PrefixStore("lane", store), 120)
    for name in ("bucketed all_reduce", "DDP", "bucketed all_reduce", "DDP"):  # alternate: fair warm-up
        total = reduce_s = 0.0
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            ddp.zero_grad(set_to_none=True)
            dist.barrier()
            t0 = time.perf_counter()
            if name == "DDP":
                backward(ddp)
            else:
                backward(model)
                t1 = time.perf_counter()
                ranks.sum_(params, [])
                reduce_s += time.perf_counter() - t1
            total += time.perf_counter() - t0
        times[name] = 1e3 * total / steps
        if name != "DDP":
            times["gradient sum alone"] = 1e3 * reduce_s / steps
    if rank == 0:
        nbytes = sum(p.numel() * 4 for p in params)
        Path(out).write_text(json.dumps({"ms_per_step": times, "grad_mb": nbytes / 2**20}))
    dist.destroy_process_group()


def grad_sync(cfg: Config, steps: int) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = Path(tempfile.mkdtemp()) / "grad_sync.json"
    ctx = multiprocessing.get_context("spawn")
    model_dir = str(model_dirs(cfg).policy)
    procs = [ctx.Process(target=grad_sync_rank, args=(r, port, model_dir, steps, str(out))) for r in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arms", default="1x1,1x2,2x1", help="the fit arms, KxT: K ranks of T torch threads each")
    ap.add_argument("--steps", type=int, default=20, help="grad-sync steps per arm")
    ap.add_argument("--no-grad-sync", action="store_true", help="skip the grad-sync arms (builtin's gradient sum)")
    ap.add_argument("--json", default="", help="also write the results here")
    ap.add_argument("overrides", nargs="*", help="recipe overrides a.b=c")
    args = ap.parse_args()
    base = bench_config(args.overrides, 1)
    results: dict[str, Any] = {"fit": []}
    if not args.no_grad_sync:
        results["grad_sync"] = grad_sync(base, args.steps)
        print(json.dumps(results["grad_sync"]))
    with serve_in_subprocess(base.env.name, base.env.pool_size, base.env.params) as env_url:
        initial = Path(tempfile.mkdtemp()) / "initial.pt"
        first = make_trainer(base, env_url)
        torch.save(first.export_weights(), initial)
        first.close()
        for arm in args.arms.split(","):
            k, t = (int(x) for x in arm.split("x"))
            results["fit"].append(in_process(fit_arm, args.overrides, k, t, env_url, str(initial)))
            print(json.dumps(results["fit"][-1]))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
