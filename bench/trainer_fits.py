"""Consecutive fits of different clients on ONE trainer (either backend), as a lane service runs them.

    python -m bench.trainer_fits --size tiny --fits 12 --json /tmp/fits-tiny.json
    python -m bench.trainer_fits --size qwen0.5b --fits 12 --device cuda --json /tmp/fits-05b.json \\
        federation.local_epochs=1 env.max_turns=5

Per fit (client i, round i // clients_per_round + 1, its own 100-task shard): load the global
fp32 weights in place, `fit` (E RL iterations: batched rollout against a real env service in a
subprocess, GRPO update), export fp32 copies; after each round the global becomes the plain
mean of that round's exports, so every fit starts from new weights. Reported per fit: phase
timings, rollout tokens/s, and memory at one fixed phase (after export, before the next load):
`torch.cuda.memory_allocated`, the fit's `max_memory_allocated` (peak stats reset before each
load), reserved memory, the device's used memory (all processes, non-PyTorch allocations too:
what `nvidia-smi` shows) and process RSS; then the growth per fit over the fits after warm-up
(least-squares slope), which a leak of one weight copy per fit would show as +model size. The
bench's own copies (the global weights and the round's running sum) are two buffers allocated
once and written in place, so they weigh the same at every phase point and never show as growth.

`qwen0.5b` writes a random-weight model with Qwen2.5-0.5B's shape (bench.rollout.QWEN05B:
24 layers, width 896, 14/2 heads, 151,936-row tied embedding) and the tiny model's tokenizer
(its 4,585 ids fit the embedding; ids beyond the tokenizer are masked in sampling) to
`--model-dir`, then trains it like any local Hugging Face directory (`model.path`).
`--recipe` picks the recipe (default tiny-shop-grpo; `tiny-shop-grpo-verl-vllm` runs the verl
backend with vLLM rollouts, whose weight-sync seconds are reported per fit); trailing `a.b=c`
arguments override it.

    python -m bench.trainer_fits --recipe tiny-shop-grpo-verl-vllm --size qwen0.5b --fits 10 --device cuda
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import psutil
import torch

from bench.rollout import QWEN05B
from client_app.tiny_model import build_tiny_model
from client_app.trainer import make_trainer
from client_app.trainer.base import ClientTasks
from client_app.trainer.device import resolve_device
from envs.service import serve_in_subprocess
from fl_app.calls import FitCall
from fl_app.config import Config, load_config

MB = 2**20
TASKS_PER_CLIENT = 100


def random_qwen_dir(out: Path, tokenizer_dir: Path, device: torch.device, shape: Mapping[str, Any] = QWEN05B) -> Path:
    """A Hugging Face directory: random Qwen2 weights (seed 0) of `shape` (Qwen2Config keywords,
    default Qwen2.5-0.5B's) + `tokenizer_dir`'s tokenizer; an existing one is reused."""
    from transformers import AutoTokenizer, GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    if (out / "config.json").exists():
        return out
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    eos, pad = tok.eos_token_id, tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if len(tok) > shape["vocab_size"]:
        raise ValueError(
            f"the tokenizer in {tokenizer_dir} has {len(tok)} ids; the embedding has {shape['vocab_size']} rows"
        )
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**shape, eos_token_id=eos, pad_token_id=pad, bos_token_id=None))
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    model.float().save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _slope(ys: list[float]) -> float:
    """Least-squares growth per step of a series (0 for fewer than two points)."""
    n = len(ys)
    if n < 2:
        return 0.0
    mx, my = (n - 1) / 2, sum(ys) / n
    return sum((x - mx) * (y - my) for x, y in enumerate(ys)) / sum((x - mx) ** 2 for x in range(n))


def _memory(device: torch.device) -> dict[str, float]:
    out = {"rss_mb": psutil.Process().memory_info().rss / MB}
    if device.type == "cuda":
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info()
        out |= {
            "device_used_mb": (total - free) / MB,  # every process, non-PyTorch memory too
            "allocated_mb": torch.cuda.memory_allocated() / MB,
            "max_allocated_mb": torch.cuda.max_memory_allocated() / MB,
            "reserved_mb": torch.cuda.memory_reserved() / MB,
        }
    return out


def run_fits(cfg: Config, fits: int, warmup: int) -> dict:
    """`fits` consecutive client fits on one trainer; per-fit records and the growth summary."""
    device = resolve_device(cfg.run.device)
    per_round = cfg.federation.clients_per_round
    val = int(cfg.env.params.get("val_size", 64))
    n_train = int(cfg.env.params.get("num_goals", 1000)) - val
    records = []
    with serve_in_subprocess(cfg.env.name, cfg.env.pool_size, cfg.env.params) as url:
        t0 = time.perf_counter()
        trainer = make_trainer(cfg, url, run_dir=Path(tempfile.mkdtemp(prefix="trainer-fits-")))
        build_s = time.perf_counter() - t0
        try:
            global_w = trainer.export_weights()
            model_mb = sum(t.numel() * t.element_size() for t in global_w.values()) / MB
            total = {k: torch.zeros_like(t) for k, t in global_w.items()}  # this round's running sum
            in_round = 0
            for i in range(fits):
                start = (i * TASKS_PER_CLIENT) % max(n_train - TASKS_PER_CLIENT, 1)
                call, tasks = (
                    FitCall(
                        round=i // per_round + 1,
                        client_id=i,
                        local_epochs=cfg.federation.local_epochs,
                        seed=cfg.run.seed,
                        proximal_mu=0.0,
                    ),
                    ClientTasks([val + start + k for k in range(TASKS_PER_CLIENT)]),
                )
                if device.type == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                t0 = time.perf_counter()
                trainer.load_weights(global_w)
                t1 = time.perf_counter()
                res = trainer.fit(call, tasks)
                t2 = time.perf_counter()
                export = trainer.export_weights()
                t3 = time.perf_counter()
                for k, t in total.items():
                    t.add_(export[k])
                del export  # the phase point holds global + sum, every fit
                in_round += 1
                m = res.metrics
                records.append(
                    {
                        "fit": i,
                        "client": i,
                        "round": call.round,
                        "episodes": res.num_examples,
                        "load_s": t1 - t0,
                        "fit_s": t2 - t1,
                        "export_s": t3 - t2,
                        "rollout_s": m["rollout_s"],
                        "rollout_generate_s": m["rollout_generate_s"],
                        "rollout_env_s": m["rollout_env_s"],
                        "rollout_sync_s": m.get("rollout_sync_s", 0.0),
                        "update_s": m["update_s"],
                        "rollout_tokens": m["rollout_tokens"],
                        "rollout_steps": m["rollout_steps"],
                        "tokens_per_s": m["tokens_per_s"],
                        "rows": m["rows"],
                        "optimizer_steps": m["optimizer_steps"],
                        "train_success": m["train_success"],
                        **_memory(device),
                    }
                )
                print(
                    json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in records[-1].items()}),
                    flush=True,
                )
                if in_round == per_round:  # FedAvg (equal weights) -> next round's global, in place
                    for k, t in global_w.items():
                        torch.div(total[k], in_round, out=t)
                        total[k].zero_()
                    in_round = 0
        finally:
            trainer.close()
    steady = records[warmup:]
    growth = {
        key: _slope([r[key] for r in steady])
        for key in ("allocated_mb", "max_allocated_mb", "reserved_mb", "device_used_mb", "rss_mb")
        if key in records[0]
    }
    return {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
        "params_m": round(sum(t.numel() for t in global_w.values()) / 1e6, 1),
        "model_mb": round(model_mb, 1),
        "trainer_build_s": round(build_s, 2),
        "fits": records,
        "warmup_fits": warmup,
        "growth_mb_per_fit": {k: round(v, 3) for k, v in growth.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.trainer_fits", description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="tiny-shop-grpo")
    ap.add_argument("--size", choices=("tiny", "qwen0.5b"), default="tiny")
    ap.add_argument("--model", default="", help="use this model directory as the policy (overrides --size)")
    ap.add_argument(
        "--model-dir",
        type=Path,
        default=Path(tempfile.gettempdir()) / "qwen05b-random",
        help="where --size qwen0.5b writes (or finds) its model directory",
    )
    ap.add_argument("--fits", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="fits left out of the growth slope")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--json", type=Path, help="write the report here")
    ap.add_argument("overrides", nargs="*", help="recipe overrides, a.b=c")
    args = ap.parse_args(argv)
    cfg = load_config(args.recipe, dotlist=[*args.overrides, f"run.device={args.device}"])
    if args.model:
        cfg.model.path = args.model
    elif args.size == "qwen0.5b":
        tiny = build_tiny_model(cfg.model.tiny, cfg.env, cfg.rollout)
        cfg.model.path = str(random_qwen_dir(args.model_dir, tiny, resolve_device(args.device)))
    report = {
        "recipe": args.recipe,
        "size": args.size,
        "model": cfg.model.path,
        "overrides": args.overrides,
        **run_fits(cfg, args.fits, args.warmup),
    }
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))
    fits = report["fits"]
    print(
        f"\n{report['device']}, {report['params_m']} M params, {len(fits)} fits, growth per fit after "
        f"{args.warmup} warm-up fits: {report['growth_mb_per_fit']}"
    )
    print(
        "| fit | load s | rollout s (sync / generate / env) | update s | export s | tokens/s | allocated MB | "
        "max allocated MB | device used MB | RSS MB |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in fits:
        print(
            f"| {r['fit']} | {r['load_s']:.2f} | {r['rollout_s']:.1f} ({r['rollout_sync_s']:.1f} / "
            f"{r['rollout_generate_s']:.1f} / {r['rollout_env_s']:.1f}) | {r['update_s']:.1f} | {r['export_s']:.2f} | "
            f"{r['tokens_per_s']:.0f} | {r.get('allocated_mb', 0):.1f} | {r.get('max_allocated_mb', 0):.1f} | "
            f"{r.get('device_used_mb', 0):.0f} | {r['rss_mb']:.0f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
