"""Per-fit overhead of the persistent trainer next to a fresh trainer process per client.

    python -m bench.fit_overhead --fits 4 --json /tmp/fit-overhead.json               # verl, CPU
    python -m bench.fit_overhead --fits 4 backend=builtin                              # builtin, CPU
    python -m bench.fit_overhead --fits 2 --device cuda model.path=/tmp/qwen05b-random \
        rollout.engine=vllm rollout.gpu_memory_utilization=0.4      # GPU with vLLM (docs/benchmarks.md)

One run, two arms on the same config (the tiny-shop-grpo recipe with `backend: verl` unless an
override says otherwise; trailing `a.b=c` arguments override it):
- *persistent* (what a lane service does): ONE trainer, then per fit of a different client
  load the global weights in place, reset the optimizers, train, export fp32 copies. Reported
  per fit: load, optimizer reset, export and the whole fit; overhead = load + reset + export.
- *fresh process* (what a trainer started per client would pay before its first rollout):
  a subprocess that starts Python, imports torch / transformers (/ verl), builds the trainer
  (engines for actor and reference, and the vLLM engine with `rollout.engine=vllm`) and loads
  the global weights, then exits; measured once, from spawn to exit.
The ratio printed last is the fresh process's start-up over the persistent trainer's mean
per-fit overhead.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from client_app.trainer import make_trainer
from client_app.trainer.base import ClientTasks
from envs.service import serve_in_subprocess
from fl_app.calls import FitCall
from fl_app.config import Config, load_config
from fl_app.weights import load_shards, save_shards

TASKS_PER_CLIENT = 100


def bench_config(overrides: list[str], device: str) -> Config:
    return load_config("tiny-shop-grpo", dotlist=["backend=verl", f"run.device={device}", *overrides])


def startup_only(overrides: list[str], device: str, env_url: str, weights: Path) -> None:
    """The fresh-process arm's body: build the trainer, load the global weights, exit."""
    trainer = make_trainer(bench_config(overrides, device), env_url)
    try:
        trainer.load_weights(load_shards(weights))
    finally:
        trainer.close()


def fresh_process_s(overrides: list[str], device: str, env_url: str, weights: Path) -> float:
    cmd = [
        sys.executable,
        "-m",
        "bench.fit_overhead",
        "--startup-only",
        "--env-url",
        env_url,
        "--weights",
        str(weights),
        "--device",
        device,
        *overrides,
    ]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"the fresh-process arm failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    return wall


def persistent_fits(cfg: Config, env_url: str, fits: int, weights: Path) -> tuple[float, list[dict[str, float]]]:
    t0 = time.perf_counter()
    trainer = make_trainer(cfg, env_url)
    build_s = time.perf_counter() - t0
    resets: list[float] = []
    begin = trainer.engine.begin_fit

    def timed_begin(reference_from_policy: bool) -> None:
        t = time.perf_counter()
        begin(reference_from_policy)
        resets.append(time.perf_counter() - t)

    # fit() resets the optimizers once per fit; time that call (a deliberate monkeypatch of this instance's method)
    trainer.engine.begin_fit = timed_begin  # type: ignore[method-assign]
    val = int(cfg.env.params.get("val_size", 64))
    records = []
    try:
        global_w = load_shards(weights)
        for i in range(fits):
            start = val + i * TASKS_PER_CLIENT
            call, tasks = (
                FitCall(round=i // 2 + 1, client_id=i, local_epochs=cfg.federation.local_epochs, seed=cfg.run.seed),
                ClientTasks(list(range(start, start + TASKS_PER_CLIENT))),
            )
            t0 = time.perf_counter()
            trainer.load_weights(global_w)
            t1 = time.perf_counter()
            res = trainer.fit(call, tasks)
            t2 = time.perf_counter()
            global_w = trainer.export_weights()  # the next client starts from this one's result
            t3 = time.perf_counter()
            rec = {
                "fit": i,
                "load_s": t1 - t0,
                "reset_s": resets[-1],
                "train_s": t2 - t1 - resets[-1],
                "export_s": t3 - t2,
                "fit_total_s": t3 - t0,
                "episodes": float(res.num_examples),
            }
            rec["overhead_s"] = rec["load_s"] + rec["reset_s"] + rec["export_s"]
            rec["overhead_frac"] = rec["overhead_s"] / rec["fit_total_s"]
            records.append(rec)
            print(json.dumps({k: round(v, 4) for k, v in rec.items()}), flush=True)
    finally:
        trainer.close()
    return build_s, records


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.verl_overhead", description=__doc__.split("\n")[0])
    ap.add_argument("--fits", type=int, default=4)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--json", type=Path, help="write the report here")
    ap.add_argument("--startup-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--env-url", help=argparse.SUPPRESS)
    ap.add_argument("--weights", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("overrides", nargs="*", help="recipe overrides, a.b=c")
    args = ap.parse_args(argv)
    if args.startup_only:
        startup_only(args.overrides, args.device, args.env_url, args.weights)
        return 0
    if args.fits < 1:
        ap.error("--fits must be >= 1")
    cfg = bench_config(args.overrides, args.device)
    with (
        serve_in_subprocess(cfg.env.name, cfg.env.pool_size, cfg.env.params) as url,
        tempfile.TemporaryDirectory() as tmp,
    ):
        # the global weights both arms load: the recipe's initial model, as fp32 shards
        seed = make_trainer(cfg, None)
        try:
            save_shards(seed.export_weights(), Path(tmp) / "global", 64 * 2**20)
        finally:
            seed.close()
        weights = Path(tmp) / "global"
        fresh = fresh_process_s(args.overrides, args.device, url, weights)
        build_s, records = persistent_fits(cfg, url, args.fits, weights)
    steady = records[1:] or records
    mean = {
        k: sum(r[k] for r in steady) / len(steady)
        for k in ("load_s", "reset_s", "export_s", "overhead_s", "fit_total_s", "overhead_frac")
    }
    report = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "overrides": args.overrides,
        "fits": records,
        "persistent_build_s": round(build_s, 3),
        "fresh_process_startup_s": round(fresh, 3),
        "mean_after_first_fit": {k: round(v, 5) for k, v in mean.items()},
        "fresh_over_persistent_overhead": round(fresh / mean["overhead_s"], 1),
        "fresh_startup_over_fit": round(fresh / mean["fit_total_s"], 3),
    }
    print(
        f"persistent trainer, mean over fits 1..{len(records) - 1 or 1}: load {mean['load_s'] * 1e3:.1f} ms + "
        f"optimizer reset {mean['reset_s'] * 1e3:.1f} ms + export {mean['export_s'] * 1e3:.1f} ms = "
        f"{mean['overhead_s'] * 1e3:.1f} ms per fit, {100 * mean['overhead_frac']:.2f}% of a "
        f"{mean['fit_total_s']:.1f} s fit"
    )
    print(
        f"fresh {cfg.backend} process per client: {fresh:.1f} s to start, build and load "
        f"({100 * fresh / mean['fit_total_s']:.0f}% of the same fit) -> x{report['fresh_over_persistent_overhead']} "
        f"the persistent trainer's per-fit overhead"
    )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
