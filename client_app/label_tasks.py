"""Label every training task of a recipe's env as solved / not solved by a reference policy: the
labels the hardness partition splits the pool with.

    python -m client_app.label_tasks --recipe tiny-shop-grpo --out labels/tiny-shop.json
    python -m client_app.label_tasks --recipe webshop-grpo-qwen2.5-1.5b --weights runs/x/rounds/round-0070/actor \\
        --out labels/webshop.json

The rollouts go through the trainer's own `evaluate` (the same rollout loop, prompt rendering,
rollout mode and env service as training and validation): one episode per task at
rollout.val_temperature, decoding seed --seed (default run.seed). The reference policy is
--weights (an fp32 weights dir, e.g. a round's actor) or else the recipe's initial model
(model.path, plus model.init_from). The file records its provenance: the sha256 of the weights
actually rolled out, the env fingerprint (its whole served task order), rollout mode, history
length, temperature, seed and date; a run whose env or rollout mode differs refuses it
(partitions/labels.py).
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from fl_app.config import Config, cli_config
from partitions.labels import write_labels
from partitions.pool import build_pool


def weights_sha256(state: Mapping[str, torch.Tensor]) -> str:
    """sha256 over (name, dtype, shape, bytes) of every tensor, in name order."""
    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name}\0{t.dtype}\0{tuple(t.shape)}\0".encode())
        h.update(t.view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def label_tasks(
    cfg: Config, out: Path, weights: str = "", seed: int | None = None, limit: int = 0, recipe: str = ""
) -> dict[str, Any]:
    """Roll the reference policy out once on each training task; write and return the labels body."""
    from client_app.trainer import make_trainer
    from envs.service import serve_in_subprocess
    from fl_app.calls import EvalCall
    from fl_app.weights import load_shards

    pool = build_pool(cfg.env.name, cfg.env.params)
    tasks = list(pool.indices[: limit or None])
    seed = cfg.run.seed if seed is None else seed
    t0 = time.perf_counter()
    with serve_in_subprocess(cfg.env.name, cfg.env.pool_size, cfg.env.params) as url:
        trainer = make_trainer(cfg, url)
        try:
            if weights:
                trainer.load_weights(load_shards(Path(weights)), "actor")
            digest = weights_sha256(trainer.export_weights("actor"))
            print(
                f"labelling {len(tasks)} of {len(pool)} training tasks of {cfg.env.name} "
                f"(weights {digest[:12]}, {cfg.rollout.mode}, T={cfg.rollout.val_temperature}, seed {seed})",
                flush=True,
            )
            res = trainer.evaluate(EvalCall(seed=seed), tasks)
        finally:
            trainer.close()
    if set(res.outcomes) != set(tasks):
        raise RuntimeError(
            f"the trainer returned outcomes for {len(res.outcomes)} tasks, not the {len(tasks)} "
            "asked for; its evaluate must fill EvalResult.outcomes"
        )
    ids = dict(zip(pool.indices, pool.task_ids))
    success = {ids[t]: bool(res.outcomes[t]) for t in tasks}
    init = f"{cfg.model.path}" + (f" + init_from {cfg.model.init_from}" if cfg.model.init_from else "")
    solved = sum(success.values())
    provenance = {
        "recipe": recipe,
        "env": cfg.env.name,
        "env_params": cfg.env.params,
        "env_fingerprint": pool.fingerprint,
        "rollout_mode": cfg.rollout.mode,
        "history_length": cfg.rollout.history_length,
        "max_turns": cfg.env.max_turns,
        "temperature": cfg.rollout.val_temperature,
        "seed": seed,
        "weights": str(Path(weights).resolve()) if weights else f"initial model: {init}",
        "weights_sha256": digest,
        "backend": cfg.backend,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "pool_size": len(pool),
        "tasks_labelled": len(tasks),
        "successes": solved,
        "wall_s": round(time.perf_counter() - t0, 1),
    }
    write_labels(out, success, provenance)
    n = len(success)
    print(
        f"labelled {n} tasks: {solved} solved ({solved / n:.1%}) in {provenance['wall_s']:.0f} s; wrote {out}",
        flush=True,
    )
    return {"provenance": provenance, "labels": success}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m client_app.label_tasks", description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="tiny-shop-grpo", help="recipe name in configs/ or a YAML path")
    ap.add_argument("--out", required=True, type=Path, help="the labels file to write (JSON)")
    ap.add_argument(
        "--weights", default="", help="reference policy: an fp32 weights dir (default: the recipe's initial model)"
    )
    ap.add_argument("--seed", type=int, default=None, help="decoding seed (default: run.seed)")
    ap.add_argument(
        "--limit",
        type=int,
        default=0,
        help="label only the first N training tasks (a smoke test; a "
        "run refuses labels that miss more than half its pool)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    ap.add_argument("overrides", nargs="*", help="recipe overrides as a.b=c, e.g. rollout.val_temperature=0")
    args = ap.parse_args(argv)
    if args.limit < 0:
        ap.error("--limit must be >= 0")
    if (cfg := cli_config(args.recipe, args.overrides)) is None:
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    label_tasks(cfg, args.out, args.weights, args.seed, args.limit, args.recipe)
    return 0


if __name__ == "__main__":
    sys.exit(main())
