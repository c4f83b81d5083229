"""One policy pass in each arm (engine, `run.precision`, compile, token budget), side by side:
wall, trained tokens/s, MFU, and (with --profile) the top GPU (or CPU) ops.

    python -m bench.update_profile --make-qwen05b /tmp/q05 --device cuda --recipe smollm-shop-grpo
    python -m bench.update_profile --model <model dir> --recipe smollm-shop-grpo --device cuda --profile
    python -m bench.update_profile --model tiny --recipe tiny-shop-grpo --device cpu --rows 40 --mini 8 \
        --precision fp32 bf16   # smoke
    python -m bench.update_profile --model tiny --recipe tiny-shop-grpo --device cpu --rows 248 --mini 16 \
        --rows-from demos --precision fp32 fp32@2048 --repeats 3 --peak 1   # the CPU default's token budget
    python -m bench.update_profile --model <model dir> --device cuda --mini 16 --profile \
        --precision bf16 verl:auto bf16+compile verl:auto+compile   # where verl's update loses to builtin's

Synthetic rows shaped like a recipe's windowed turns (prompt and reply lengths drawn uniformly
from --prompt-tokens / --reply-tokens, random token ids, one advantage per row), or with
`--rows-from demos` the env expert's windowed turns (real lengths), so no rollout is needed:
the pass is exactly what a fit runs (old and reference log-probs, then one AdamW step per
mini-batch, `client_app.trainer.loop.policy_pass`). For each `--mini`, one engine per arm
(precision, compile, token budget) is built on the same weights; after a warm-up pass each,
the arms take turns for --repeats timed passes from the same starting weights, and the best
pass of each counts. With --profile each arm is then profiled once with torch.profiler (the
profiled pass runs slower; its op table says where GPU time goes, and its kernel total over the
unprofiled wall says how busy the GPU was). With --syncs (CUDA), one more pass per arm runs under
torch's sync debug mode and counts the host-device synchronisations (`.item()`, blocking copies,
boolean indexing) by where they come from: the innermost frame outside torch, and the first
frame in this project. MFU counts 6 x params x tokens for the update and
2 x params x tokens for each scoring pass, against the dense bf16 matmul rate measured at the
start (`--peak` overrides).
"""

from __future__ import annotations

import argparse
import json
import random
import time
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.autograd import DeviceType
from torch.profiler import ProfilerActivity, profile

from bench.engines import peak_tflops
from client_app.models import model_dirs
from client_app.rollout import TrainRow
from client_app.trainer import make_engine
from client_app.trainer.device import resolve_device
from client_app.trainer.loop import policy_pass
from client_app.trainer.losses import loss_specs
from fl_app.config import Config, load_config


def synthetic_rows(n: int, vocab: int, prompt: tuple[int, int], reply: tuple[int, int], seed: int) -> list[TrainRow]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        p = [rng.randrange(vocab) for _ in range(rng.randint(*prompt))]
        r = [rng.randrange(vocab) for _ in range(rng.randint(*reply))]
        rows.append(TrainRow(p, r, [1] * len(r), rng.random(), i // 8, i // 4))
    return rows


def demo_rows(cfg: Config, tokenizer: Any, n: int) -> list[TrainRow]:
    """The first `n` windowed turns of the env's expert on training tasks, rendered and cut as the
    rollouts cut them: the recipe's real prompt lengths. Every episode has a turn, so `n`
    episodes are enough."""
    from client_app import sft

    demos = sft.collect_demonstrations(cfg.env, cfg.rollout.history_length, n, 0.0, seed=1)[:n]
    turns = sft.demo_rows(tokenizer, demos, cfg.rollout)
    return [TrainRow(p, r, [1] * len(r), 0.0, i // 8, i) for i, (p, r) in enumerate(turns)]


def _sync(cuda: bool) -> None:
    if cuda:
        torch.cuda.synchronize()


def build(args: argparse.Namespace, mini: int, arm: str) -> tuple[Any, Config]:
    """The engine of one arm: `[verl:]precision[+compile][@tokens]` (the verl engine instead of
    builtin, run.precision, run.compile, algo.micro_batch_tokens; without `@`, one micro-batch per
    mini-batch)."""
    backend, _, arm = arm.rpartition(":")
    arm, _, tokens = arm.partition("@")
    precision, _, compiled = arm.partition("+")
    dotlist = [f"model.path={args.model}", f"run.device={args.device}", f"run.precision={precision}"]
    # no rollouts here; verl on a GPU is built for vLLM's (with hf it refuses a model whose
    # output rows outnumber its tokenizer's ids, as a random 0.5B with the tiny tokenizer does)
    verl_on_gpu = backend == "verl" and args.device == "cuda"
    dotlist += [f"backend={backend or 'builtin'}", f"rollout.engine={'vllm' if verl_on_gpu else 'hf'}"]
    dotlist += [f"run.compile={compiled == 'compile'}", f"algo.micro_batch_tokens={tokens or 'null'}"]
    dotlist += [f"algo.mini_batch_size={mini}", f"algo.micro_batch_size={mini}", "model.warm_start.episodes=0"]
    cfg = load_config(args.recipe, dotlist=dotlist)
    return make_engine(cfg, model_dirs(cfg).policy), cfg


def measure(args: argparse.Namespace, mini: int) -> dict:
    """Every --precision at mini-batch (= micro-batch) `mini`, side by side: one warm-up pass
    each, then --repeats timed passes taking turns (A B A B ...: drift hits every arm alike),
    the best kept; then, with --profile, one profiled pass each."""
    cuda = args.device == "cuda"
    engines = {p: build(args, mini, p) for p in args.precision}
    first, cfg = engines[args.precision[0]]
    if args.rows_from == "demos":
        rows = demo_rows(cfg, first.tokenizer, args.rows)
    else:
        rows = synthetic_rows(args.rows, len(first.tokenizer), args.prompt_tokens, args.reply_tokens, seed=0)
    rng = random.Random(1)
    advantages = [torch.full((len(r.response_ids),), rng.gauss(0, 1)) for r in rows]
    policy, _ = loss_specs(cfg)
    start = first.export_weights()
    params = sum(t.numel() for t in start.values())
    tokens = sum(len(r.prompt_ids) + len(r.response_ids) for r in rows)

    def one_pass(engine: Any) -> tuple[float, dict]:
        engine.load_weights(start)  # every pass from the same weights
        engine.begin_fit(reference_from_policy=False)
        _sync(cuda)
        t0 = time.perf_counter()
        metrics = policy_pass(engine, policy, rows, advantages, mini, seed=1)
        _sync(cuda)
        wall = time.perf_counter() - t0
        engine.end_fit()
        return wall, metrics

    first_pass = {p: one_pass(engine)[0] for p, (engine, _) in engines.items()}  # warm-up (and compilation)
    walls: dict[str, list[float]] = {p: [] for p in engines}
    steps: dict[str, float] = {}
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    for _ in range(args.repeats):
        for p, (engine, _) in engines.items():
            wall, metrics = one_pass(engine)
            walls[p].append(wall)
            steps[p] = metrics["optimizer_steps"]
    scoring = 2 * (1 + (policy.kl_coef > 0))
    out: dict[str, Any] = {"rows": len(rows), "tokens": tokens, "params_m": round(params / 1e6, 1)}
    for p, w in walls.items():
        best = min(w)
        out[p] = {
            "first_pass_s": round(first_pass[p], 1),
            "optimizer_steps": steps[p],
            "pass_s": [round(x, 3) for x in w],
            "trained_tok_per_s": round(tokens / best),
            "mfu_pass": round((6 + scoring) * params * tokens / best / (args.peak * 1e12), 4),
        }
    if len(walls) > 1:
        base = args.precision[0]
        out["speedup_vs_" + base] = {p: round(min(walls[base]) / min(w), 2) for p, w in walls.items() if p != base}
    if cuda:
        out["peak_allocated_gb_all_arms"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
    print(json.dumps({f"mini{mini}": out}), flush=True)
    if args.profile:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        for p, (engine, _) in engines.items():
            with profile(activities=activities) as prof:
                one_pass(engine)
            ops = prof.key_averages()
            if cuda:  # device activity (kernels, copies), as the profiler's own total counts it:
                # not the aten:: rows (the same time again) nor the ranges verl and FSDP annotate
                kernels = (
                    sum(
                        e.self_device_time_total
                        for e in ops
                        if e.device_type == DeviceType.CUDA and not e.is_user_annotation
                    )
                    / 1e6
                )
                out[p]["gpu_kernel_s_in_profiled_pass"] = round(kernels, 3)
                out[p]["gpu_busy_vs_unprofiled_wall"] = round(kernels / min(walls[p]), 3)
            print(f"--- {p}, mini {mini}")
            print(ops.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=args.top))
            if cuda:  # what the host spends while the GPU waits (launches, syncs, Python-side work)
                print(f"--- {p}, mini {mini}, by host time")
                print(ops.table(sort_by="self_cpu_time_total", row_limit=args.top))
    if args.syncs:
        for p, (engine, _) in engines.items():
            census = sync_census(lambda engine=engine: one_pass(engine))
            out[p]["syncs_per_pass"] = sum(census.values())
            print(f"--- {p}, mini {mini}: {sum(census.values())} synchronisations in one pass, by origin")
            for (inner, ours), n in census.most_common(args.top):
                print(f"{n:6d}  {inner}  <-  {ours}")
    for engine, _ in engines.values():
        engine.close()
    return out


def sync_census(run: Any) -> Counter[tuple[str, str]]:
    """Host-device synchronisations while `run()` runs, counted by (innermost frame outside torch,
    first frame in this project): torch's sync debug mode warns at each one, and the warning
    hook sees the Python stack as it is at that moment."""
    root = str(Path(__file__).resolve().parents[1])
    torch_dir = str(Path(torch.__file__).parent)
    census: Counter[tuple[str, str]] = Counter()

    def where(frame: traceback.FrameSummary) -> str:
        return f"{frame.filename.rsplit('site-packages/', 1)[-1].removeprefix(root + '/')}:{frame.lineno} {frame.name}"

    def count(*_: Any, **__: Any) -> None:
        stack = traceback.extract_stack()[:-1]
        outside = [f for f in stack if not f.filename.startswith(torch_dir) and "warnings" not in f.filename]
        ours = [f for f in stack if f.filename.startswith(root) and "bench/" not in f.filename]
        census[(where(outside[-1]) if outside else "?", where(ours[-1]) if ours else "?")] += 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown, warnings.showwarning = warnings.showwarning, count
        torch.cuda.set_sync_debug_mode("warn")
        try:
            run()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = shown
    return census


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    ap.add_argument("--model", type=Path, help="a model directory, or `tiny`")
    ap.add_argument("--make-qwen05b", type=Path, help="write a random Qwen2.5-0.5B-shaped model here and use it")
    ap.add_argument("--recipe", default="smollm-shop-grpo")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    ap.add_argument(
        "--precision",
        nargs="+",
        default=["autocast", "bf16", "bf16+compile"],
        help="arms, side by side: a run.precision, `+compile` for run.compile, `@N` for "
        "algo.micro_batch_tokens=N; `verl:` first for the verl engine (`verl:auto`, `verl:auto+compile`)",
    )
    ap.add_argument("--rows", type=int, default=540, help="rows per pass (smollm-shop-grpo: ~540 per iteration)")
    ap.add_argument(
        "--rows-from",
        choices=("synthetic", "demos"),
        default="synthetic",
        help="synthetic: random ids, uniform lengths (--prompt-tokens, --reply-tokens); demos: the env expert's turns",
    )
    ap.add_argument("--prompt-tokens", type=int, nargs=2, default=(300, 900))
    ap.add_argument("--reply-tokens", type=int, nargs=2, default=(5, 36))
    ap.add_argument("--mini", type=int, nargs="+", default=[16, 64], help="mini-batch sizes (micro = mini)")
    ap.add_argument("--repeats", type=int, default=2, help="timed passes per arm (taking turns)")
    ap.add_argument("--profile", action="store_true", help="also profile one pass per arm (slow)")
    ap.add_argument("--syncs", action="store_true", help="also count one pass's host-device syncs by origin (CUDA)")
    ap.add_argument("--peak", type=float, default=0.0, help="dense bf16 TFLOP/s (0: measure it here)")
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args(argv)
    if args.syncs and args.device != "cuda":
        ap.error("--syncs counts host-device synchronisations: it needs --device cuda")
    device = resolve_device(args.device)
    if args.make_qwen05b:
        from bench.trainer_fits import random_qwen_dir
        from client_app.tiny_model import build_tiny_model

        tiny = load_config("tiny-shop-grpo")
        tokenizer = build_tiny_model(tiny.model.tiny, tiny.env, tiny.rollout)
        args.model = random_qwen_dir(args.make_qwen05b, tokenizer, device)
    if args.model is None:
        ap.error("--model or --make-qwen05b is required")
    args.peak = args.peak or peak_tflops(device)
    report: dict[str, Any] = {"model": str(args.model), "peak_tflops": round(args.peak, 1)}
    print(json.dumps(report), flush=True)
    report.update({f"mini{mini}": measure(args, mini) for mini in args.mini})
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
