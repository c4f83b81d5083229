"""Where one builtin policy pass spends its time: wall, MFU and the top GPU (or CPU) ops.

    python -m bench.update_profile --model <model dir> --recipe smollm-shop-grpo --device cuda
    python -m bench.update_profile --model tiny --recipe tiny-shop-grpo --device cpu --rows 40   # smoke

Synthetic rows shaped like a recipe's windowed turns (prompt and reply lengths drawn uniformly
from --prompt-tokens / --reply-tokens, random token ids, one advantage per row), so no env or
rollout is needed: the pass is exactly what a fit runs (old and reference log-probs, then one
AdamW step per mini-batch, `client_app.trainer.loop.policy_pass`). Each `--mini` value is timed
once after a warm-up pass, then profiled once with torch.profiler (the profiled pass runs
slower; its op table says where GPU time goes, and its kernel total over the unprofiled wall
says how busy the GPU was). MFU counts 6 x params x tokens for the update and 2 x params x
tokens for each scoring pass, against --peak TFLOP/s (bench/engines.py measures it).
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
from torch.profiler import ProfilerActivity, profile

from client_app.models import model_dirs
from client_app.rollout import TrainRow
from client_app.trainer import make_engine
from client_app.trainer.loop import loss_specs, policy_pass
from fl_app.config import load_config


def synthetic_rows(n: int, vocab: int, prompt: tuple[int, int], reply: tuple[int, int], seed: int) -> list[TrainRow]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        p = [rng.randrange(vocab) for _ in range(rng.randint(*prompt))]
        r = [rng.randrange(vocab) for _ in range(rng.randint(*reply))]
        rows.append(TrainRow(p, r, [1] * len(r), rng.random(), i // 8, i // 4))
    return rows


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def measure(args: argparse.Namespace, mini: int) -> dict:
    """One warm-up pass, one timed pass, one profiled pass at mini-batch (= micro-batch) `mini`."""
    cuda = args.device == "cuda"
    dotlist = [f"model.path={args.model}", f"run.device={args.device}", f"algo.mini_batch_size={mini}"]
    dotlist += [f"algo.micro_batch_size={mini}", "model.warm_start.episodes=0"]
    cfg = load_config(args.recipe, dotlist=dotlist)
    engine = make_engine(cfg, model_dirs(cfg).policy)
    rows = synthetic_rows(args.rows, len(engine.tokenizer), args.prompt_tokens, args.reply_tokens, seed=0)
    rng = random.Random(1)
    advantages = [torch.full((len(r.response_ids),), rng.gauss(0, 1)) for r in rows]
    policy, _ = loss_specs(cfg)
    params = sum(t.numel() for t in engine.export_weights().values())
    tokens = sum(len(r.prompt_ids) + len(r.response_ids) for r in rows)

    def one_pass() -> tuple[float, dict]:
        engine.begin_fit(reference_from_policy=False)
        _sync(cuda)
        t0 = time.perf_counter()
        metrics = policy_pass(engine, policy, rows, advantages, mini, seed=1)
        _sync(cuda)
        wall = time.perf_counter() - t0
        engine.end_fit()
        return wall, metrics

    one_pass()  # warm-up: allocator, kernels' first launches
    wall, metrics = one_pass()
    scoring = 2 * (1 + (policy.kl_coef > 0))
    row = {
        "rows": len(rows),
        "tokens": tokens,
        "params_m": round(params / 1e6, 1),
        "optimizer_steps": metrics["optimizer_steps"],
        "pass_s": round(wall, 3),
        "mfu_pass": round((6 + scoring) * params * tokens / wall / (args.peak * 1e12), 4),
    }
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        one_pass()
    ops = prof.key_averages()
    if cuda:  # kernels only (the aten:: rows would count the same time twice)
        kernels = sum(e.self_device_time_total for e in ops if not e.key.startswith("aten::")) / 1e6
        row["gpu_kernel_s_in_profiled_pass"] = round(kernels, 3)
        row["gpu_busy_vs_unprofiled_wall"] = round(kernels / wall, 3)
    print(json.dumps({f"mini{mini}": row}), flush=True)
    print(ops.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=args.top))
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", required=True, help="a model directory, or `tiny`")
    ap.add_argument("--recipe", default="smollm-shop-grpo")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument("--rows", type=int, default=540, help="rows per pass (smollm-shop-grpo: ~540 per iteration)")
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=(300, 900))
    ap.add_argument("--reply-tokens", type=int, nargs=2, default=(5, 36))
    ap.add_argument("--mini", type=int, nargs="+", default=[16, 64], help="mini-batch sizes (micro = mini)")
    ap.add_argument("--peak", type=float, default=790.0, help="dense bf16 TFLOP/s of the device")
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args(argv)
    report = {f"mini{mini}": measure(args, mini) for mini in args.mini}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
