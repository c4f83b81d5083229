"""Centralized training (GRPO or PPO): one client, no Flower, the lane's trainer (either
training engine, either rollout engine) on the whole training pool.

    python -m client_app.train_central --recipe tiny-shop-grpo --iterations 30 --out runs/central-x
    python -m client_app.train_central --recipe webshop-grpo-qwen2.5-1.5b-centralized --eval-every 5 --out ...

It is the single-client reference a federated run is compared against, and the quickest check
that the trainer learns: it validates on the fixed validation set (tasks [0, val_tasks)) before
training and every `--eval-every` iterations. All iterations are ONE fit, so the optimizer is
built once (invariant 3: a centralized baseline is one round of T*E epochs, not T resets).

Outputs in --out: config.yaml (resolved), metrics.jsonl (one line per iteration; validation
lines carry `val_*` keys), summary.json, curve.png.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from client_app.trainer.base import ClientTasks
from fl_app.calls import EvalCall, FitCall
from fl_app.config import ConfigError, cli_config, save_config


def _plot(lines: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    val = [x for x in lines if "val_success" in x]
    train = [x for x in lines if "train_success" in x]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([x["iteration"] for x in val], [x["val_success"] for x in val], "o-", label="validation success")
    ax.plot(
        [x["iteration"] for x in train],
        [x["train_success"] for x in train],
        ".-",
        alpha=0.5,
        label="training success (T=1.0)",
    )
    ax.set_xlabel("RL iteration")
    ax.set_ylabel("success rate")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m client_app.train_central", description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="tiny-shop-grpo", help="recipe name in configs/ or a YAML path")
    ap.add_argument(
        "--iterations",
        type=int,
        default=0,
        help="RL iterations (rollout batch + update each); 0 = the recipe's rounds x local_epochs "
        "(210 for the *-centralized baselines)",
    )
    ap.add_argument("--out", required=True, help="output directory")
    ap.add_argument("--eval-every", type=int, default=5, help="validate every k iterations (and before training)")
    ap.add_argument(
        "--tasks", type=int, default=0, help="use only the first N training tasks (after the validation split); 0 = all"
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch intra-op threads (0 = torch's default; 1 is fastest for the tiny model on shared cores)",
    )
    ap.add_argument("overrides", nargs="*", help="recipe overrides as a.b=c, e.g. algo.lr=1e-4")
    args = ap.parse_args(argv)
    if args.iterations < 0 or args.eval_every < 1:
        ap.error("--iterations must be >= 0 and --eval-every >= 1")
    if (cfg := cli_config(args.recipe, args.overrides)) is None:
        return 2
    args.iterations = args.iterations or cfg.federation.rounds * cfg.federation.local_epochs

    import torch

    from client_app.trainer import make_trainer
    from envs.service import serve_in_subprocess

    if args.threads:
        torch.set_num_threads(args.threads)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    lines: list[dict[str, Any]] = []
    t_start = time.perf_counter()
    with (
        serve_in_subprocess(cfg.env.name, cfg.env.pool_size, cfg.env.params) as url,
        open(out / "metrics.jsonl", "w") as sink,
    ):
        trainer = make_trainer(cfg, url, run_dir=out)
        try:
            if trainer.env is None:
                raise RuntimeError(f"the trainer did not connect to the env service at {url}")
            info = trainer.env.info()
            val_size, num_tasks = int(info["val_size"]), int(info["num_tasks"])
            if cfg.federation.val_tasks > val_size:
                raise ConfigError(
                    f"federation.val_tasks={cfg.federation.val_tasks} exceeds the env's validation "
                    f"split val_size={val_size}; lower val_tasks or raise env.params.val_size"
                )
            shard = list(range(val_size, num_tasks))[: args.tasks or None]
            val, val_tasks = EvalCall(seed=cfg.run.seed), range(cfg.federation.val_tasks)

            def record(line: dict[str, Any]) -> None:
                line["elapsed_s"] = round(time.perf_counter() - t_start, 2)
                lines.append(line)
                sink.write(json.dumps(line) + "\n")
                sink.flush()

            def validate(iteration: int) -> None:
                res = trainer.evaluate(val, val_tasks)
                record({"iteration": iteration, **{f"val_{k}": v for k, v in res.metrics.items()}})
                print(
                    f"iter {iteration:4d}  val success {res.metrics['success']:.3f}  "
                    f"reward {res.metrics['reward']:.3f}  ({lines[-1]['elapsed_s']:.0f} s)",
                    flush=True,
                )

            def on_iteration(epoch: int, metrics: dict[str, float]) -> None:
                record({"iteration": epoch + 1, **metrics})
                print(
                    f"iter {epoch + 1:4d}  train success {metrics['train_success']:.3f}  "
                    f"reward {metrics['train_reward']:.3f}  invalid {metrics['train_invalid_action_rate']:.3f}  "
                    f"rollout {metrics['rollout_s']:.1f} s  update {metrics['update_s']:.1f} s",
                    flush=True,
                )
                if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.iterations:
                    validate(epoch + 1)

            validate(0)
            trainer.fit(
                FitCall(round=1, client_id=0, local_epochs=args.iterations, seed=cfg.run.seed),
                ClientTasks(shard),
                on_iteration=on_iteration,
            )
        finally:
            trainer.close()
    val_lines = [x for x in lines if "val_success" in x]
    summary = {
        "recipe": args.recipe,
        "overrides": args.overrides,
        "iterations": args.iterations,
        "train_tasks": len(shard),
        "val_tasks": cfg.federation.val_tasks,
        "val_success_before": val_lines[0]["val_success"],
        "val_success_after": val_lines[-1]["val_success"],
        "val_success_best": max(x["val_success"] for x in val_lines),
        "val_curve": [[x["iteration"], x["val_success"]] for x in val_lines],
        "wall_s": round(time.perf_counter() - t_start, 1),
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _plot(lines, out / "curve.png")
    print(
        f"validation success {summary['val_success_before']:.3f} -> {summary['val_success_after']:.3f} "
        f"(best {summary['val_success_best']:.3f}) in {summary['wall_s']:.0f} s; {out}/metrics.jsonl"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
