"""One round of the published FedAgent protocol on one device, timed by phase, against FedAgent's
~82 H100-minutes a round.

    python -m bench.published_round --synthetic-catalog --json /tmp/round.json            # a whole round
    python -m bench.published_round --synthetic-catalog --clients 1 --iterations 1 \\
        --json /tmp/iteration.json       # one client's local iteration at paper scale, the round computed
    python -m bench.published_round --model <HF model dir> --engine verl --rollout vllm --synthetic-catalog

The recipe (default webshop-grpo-qwen2.5-1.5b) gives the round's shape: M clients sampled by the
published rule, each on its partition shard, E RL iterations of tasks x group episodes of up to
max_turns turns, the prompt and reply caps, then FedAvg and validation on val_tasks tasks. The
round runs on a real lane (`client_app.service.TrainerService`: its env service and ONE
persistent trainer, the recipe's engines or `--engine` / `--rollout`), with the calls the server
sends it and the run dir as the weight channel, as a simulation on one machine runs it: the
lane exports round 0's model (untimed), serves each client's fit (its own load, rollout,
scoring, update and export seconds: reading the global shards, once per round as a lane keeps
its last read, and writing the upload), then the server's streaming FedAvg of the M uploads
into the round's checkpoint (aggregation) and the lane's validation of it. The phases are the
run's own arithmetic (`fl_app.accounting.round_accounting`, metrics.jsonl's `phase_s`):
transport is 0 (the run dir is on this machine: the shards' reads and writes are the lane's
load and export) and the lane's seconds outside its named phases are `other` (`lane_unnamed_s`).
Starting the lane is once per run and reported apart (`setup_s`).

Where the device time cannot hold a whole round, `--clients C` (< M) and `--iterations I` (< E)
measure part of it and the round is computed (`round` says which): each client's rollout,
scoring and update seconds and its lane time outside load and export x E / I, and M clients
cycling through the C measured ones (with C = 1 the second client reads the global again
instead of reusing the lane's read: a slight over-count); aggregation always folds M uploads (the
measured ones repeated) and validation runs once, so both are measured at the round's size. The
first iteration carries a lane's first-fit costs (compilation, CUDA graphs): `--warmup N` runs
an untimed fit of N iterations first.

`--model DIR` trains any Hugging Face model directory; without it a random-weight model of
Qwen2.5-1.5B's shape (bench.rollout.QWEN15B) with the tiny model's tokenizer is written to
`--model-dir`. Random weights rarely emit eos, so every reply runs to the length cap: the worst
case, which the report says (`replies`); a real model's lengths need `--model`. The published
WebShop catalog is not shipped: `--synthetic-catalog` plays the synthetic shop at the published
catalog size (1,000 products) with the recipe's goal count, validation pool and search depth.

Smaller runs (`--tasks`, `--group`, `--turns`, `--val-tasks`, `--device cpu`, recipe overrides
`a.b=c`) keep every phase; the report says whether the shape is the recipe's (`at_recipe_scale`).

`--json` holds what is measured as it is measured (`"complete": false`, the `stage` reached, each
finished fit's numbers and the server's seconds so far), so a run cut short (device time ending
during validation) keeps its fits; the whole report replaces it at the end (`"complete": true`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import platform
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import torch

from bench.report import emit
from bench.rollout import QWEN15B
from bench.trainer_fits import random_qwen_dir
from client_app.service import Dirs, TrainerService
from client_app.tiny_model import build_tiny_model
from client_app.trainer.device import resolve_device
from client_app.trainer.loop import RLTrainer
from fl_app.accounting import client_entry, round_accounting
from fl_app.aggregate import fedavg_manifests
from fl_app.calls import Call, EvalCall, FitCall, InitCall
from fl_app.channel import WeightsRef
from fl_app.config import Config, load_config, recipe_sha256, rollout_engine_dotlist
from partitions.uniform import round_clients, sampling_seed

# FedAgent's WebShop GRPO run: ~24 h wall for T = 70 rounds on 4 x H100 (notes-fedagent-protocol.md
# §1.3, from the repo's docs/reproducing.md "Compute budget"): 24 x 60 x 4 / 70 H100-minutes a round
FEDAGENT = {"wall_h": 24.0, "gpus": 4, "rounds": 70}
FEDAGENT_GPU_MIN_PER_ROUND = FEDAGENT["wall_h"] * 60 * FEDAGENT["gpus"] / FEDAGENT["rounds"]
FIT_PHASES = ("rollout", "scoring", "update")  # per iteration, in the fit's own metrics
PUBLISHED_PRODUCTS = 1000  # use_small: items_shuffle_1000 (notes-fedagent-protocol.md §6.1)
MB = 2**20
C = TypeVar("C", bound=Call)


class PeakMemory:
    """The device's used memory (every process: vLLM's pool, non-PyTorch allocations), sampled
    every `every_s` on a thread, and PyTorch's own peak allocation; nothing on the CPU."""

    def __init__(self, device: torch.device, every_s: float = 0.2) -> None:
        self.cuda, self.every_s, self.device_used = device.type == "cuda", every_s, 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.wait(self.every_s):
            free, total = torch.cuda.mem_get_info()
            self.device_used = max(self.device_used, total - free)

    @contextlib.contextmanager
    def watch(self) -> Iterator[PeakMemory]:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
            self._thread.start()
        try:
            yield self
        finally:
            if self.cuda:
                self._stop.set()
                self._thread.join()

    def report(self) -> dict[str, float] | None:
        if not self.cuda:
            return None
        return {
            "device_used_mb": round(self.device_used / MB),
            "torch_max_allocated_mb": round(torch.cuda.max_memory_allocated() / MB),
            "torch_max_reserved_mb": round(torch.cuda.max_memory_reserved() / MB),
        }


class Replies:
    """Every training turn's prompt and reply length, recorded where the trainer plays episodes
    (`Rollouts.play`, whichever rollout engine), so the trainer itself runs unchanged."""

    def __init__(self, trainer: RLTrainer) -> None:
        assert trainer.rollouts is not None
        self.prompts: list[int] = []
        self.replies: list[int] = []
        self.recording = False
        play = trainer.rollouts.play

        def recorded(*args: Any, **kwargs: Any) -> Any:
            episodes, stats, sync_s = play(*args, **kwargs)
            if self.recording:
                for e in episodes:
                    self.prompts += [len(t.prompt_ids) for t in e.turns]
                    self.replies += [len(t.response_ids) for t in e.turns]
            return episodes, stats, sync_s

        trainer.rollouts.play = recorded  # type: ignore[method-assign]

    def report(self, cfg: Config) -> dict[str, Any]:
        cap, prompt_cap = cfg.rollout.max_response_tokens, cfg.rollout.max_prompt_tokens
        at_cap = sum(n >= cap for n in self.replies) / max(len(self.replies), 1)
        return {
            "turns": len(self.replies),
            "reply_tokens_mean": round(statistics.fmean(self.replies or [0]), 1),
            "reply_tokens_max": max(self.replies or [0]),
            "reply_cap": cap,
            "replies_at_cap": round(at_cap, 3),
            "prompt_tokens_mean": round(statistics.fmean(self.prompts or [0]), 1),
            "prompt_tokens_max": max(self.prompts or [0]),
            "prompt_cap": prompt_cap,
            "note": "worst case: replies run to the cap (random weights rarely emit eos)"
            if at_cap > 0.5
            else "the policy's own reply lengths",
        }


def recipe_dotlist(args: argparse.Namespace) -> list[str]:
    """The bench's knobs as recipe overrides (validated like any recipe), the user's last."""
    knobs = {
        "run.device": args.device,
        "backend": args.engine,
        "algo.tasks_per_step": args.tasks,
        "algo.group_size": args.group,
        "env.max_turns": args.turns,
        "federation.val_tasks": args.val_tasks,
        "model.path": args.model,
    }
    dotlist = [f"{k}={v}" for k, v in knobs.items() if v is not None]
    dotlist += rollout_engine_dotlist(args.rollout) if args.rollout else []
    return [*dotlist, *catalog_dotlist(args.synthetic_catalog), *args.overrides]


def catalog_dotlist(synthetic: bool) -> list[str]:
    """`--synthetic-catalog`: the synthetic shop at the published catalog size, not the WebShop files."""
    return ["env.params.data_dir=null", f"env.params.num_products={PUBLISHED_PRODUCTS}"] if synthetic else []


def check_catalog(cfg: Config, recipe: str) -> None:
    """Fail before any build when the recipe's WebShop catalog is not on this machine."""
    data_dir = cfg.env.params.get("data_dir")
    if data_dir and not Path(data_dir).is_dir():
        raise SystemExit(
            f"recipe {recipe!r} plays the WebShop catalog in {data_dir}, which is not here: "
            "pass --synthetic-catalog (the synthetic shop at the published catalog size)"
        )


def random_policy(args: argparse.Namespace, device: torch.device) -> Path:
    """A random Qwen2.5-1.5B-shaped model with the tiny default's tokenizer (as bench.trainer_fits
    builds its 0.5B; the prompts' token counts are that tokenizer's), written once to `--model-dir`."""
    tiny = load_config("tiny-shop-grpo")
    tokenizer = build_tiny_model(tiny.model.tiny, tiny.env, tiny.rollout)
    return random_qwen_dir(args.model_dir, tokenizer, device, QWEN15B)


def _call(svc: TrainerService, kind: type[C], **fields: Any) -> C:
    """A call as the server sends it to a lane: its run, its recipe's digest, a ref for the actor
    (the service reads the local dirs it is handed, as after the ClientApp's `Channel.get`)."""
    refs = {} if kind is InitCall else {"actor": WeightsRef(inline=False, nbytes=0)}
    return kind(run_id=svc.run_id, recipe_sha256=recipe_sha256(svc.cfg), weights=refs, **fields)


Progress = Callable[[str, dict[int, dict[str, float]], dict[str, float]], None]  # stage, fit metrics, server s


def play_round(
    svc: TrainerService, args: argparse.Namespace, replies: Replies, progress: Progress | None = None
) -> dict[str, Any]:
    """Round 1 as the server and one lane play it: round 0's model exported by the lane (untimed),
    the measured clients' fits (the service's own load, fit and export, the uploads in the run
    dir as a shared-disk run keeps them), the FedAvg of M uploads into the round's checkpoint,
    the validation of the new model; the lane's metrics per client, the server's timings and
    the measured wall (the timed fits' turns recorded in `replies`); `progress` hears of each
    stage with what is measured so far."""
    cfg, work = svc.cfg, svc.run_dir
    fed = cfg.federation
    start = {"actor": str(work / "round-0")}
    svc.init(_call(svc, InitCall), Dirs(weights_out=start))
    clients = round_clients(sampling_seed(cfg.run.seed, fed.sampling_seed), 1, fed.clients, fed.clients_per_round)

    def fit(cid: int, epochs: int, out: str) -> dict[str, Any]:
        call = _call(svc, FitCall, round=1, client_id=cid, local_epochs=epochs, seed=cfg.run.seed)
        return svc.fit(call, Dirs(weights_in=start, weights_out={"actor": str(work / out)}))

    if args.warmup:  # the first client's fit, shorter and untimed
        fit(clients[0], args.warmup, "warm-up")
        svc._last_read.clear()  # a round's first fit reads its global model: not the warm-up's kept read
    replies.recording = True
    server = {"transport": 0.0, "checkpoint": 0.0}  # the run dir is the channel; FedAvg writes the checkpoint
    t_round = time.perf_counter()
    per_client: dict[int, dict[str, float]] = {}
    uploads: list[tuple[Path, float]] = []

    def report(stage: str) -> None:
        if progress is not None:
            progress(stage, per_client, server)

    for cid in clients[: args.clients]:
        report(f"fitting client {cid}")
        reply = fit(cid, args.iterations, f"upload-{cid}")
        per_client[cid] = reply["metrics"]
        uploads.append((work / f"upload-{cid}", float(reply["num_examples"])))
    server["train"] = time.perf_counter() - t_round
    report("aggregation")
    replies.recording = False
    inputs = [uploads[i % len(uploads)] for i in range(fed.clients_per_round)]  # M uploads, as the server folds
    t0 = time.perf_counter()
    fedavg_manifests(inputs, work / "round-1", int(cfg.run.shard_max_mb * MB))
    server["aggregation"] = time.perf_counter() - t0
    report("validation")
    t0 = time.perf_counter()
    val = svc.evaluate(
        _call(svc, EvalCall, round=1, seed=cfg.run.seed), Dirs(weights_in={"actor": str(work / "round-1")})
    )
    server["validation"] = time.perf_counter() - t0
    wall = time.perf_counter() - t_round
    return {"clients": clients, "per_client": per_client, "server": server, "wall_s": wall, "val": val["metrics"]}


def scaled_entry(metrics: dict[str, float], fit_scale: float) -> dict[str, Any]:
    """A client's `per_client` entry (`client_entry`) with its fit's iterations scaled by
    `fit_scale`: the rollout, scoring and update seconds, and the lane's time outside load and
    export (the fit's unnamed rest scales with its iterations too)."""
    entry = client_entry(metrics)
    ph = entry["phases"]
    in_fit = entry["lane_s"] - ph["load"] - ph["export"]
    for p in FIT_PHASES:
        ph[p] *= fit_scale
    entry["lane_s"] = ph["load"] + ph["export"] + in_fit * fit_scale
    return entry


def _fit_numbers(m: dict[str, float]) -> dict[str, float]:
    """What a lane's fit reply says of its phases, rollout and update (the rest is its metrics)."""
    keys = (
        *("fit_total_s", "load_s", "load_reused", "rollout_s", "rollout_sync_s", "rollout_generate_s"),
        *("rollout_env_s", "scoring_s", "update_s", "export_s", "rollout_tokens", "rows", "optimizer_steps"),
    )
    return {k: round(float(m[k]), 3) for k in keys if k in m}


def round_summary(cfg: Config, measured: dict[str, Any], clients: int, iterations: int) -> dict[str, Any]:
    """The round's phases by the run's own arithmetic (`round_accounting`, metrics.jsonl's
    `phase_s`): as measured, and for the recipe's round, computed where only C clients x I
    iterations ran: each client's fit phases x E / I, the M clients cycling through the measured
    ones (aggregation and validation as measured: they ran at the round's size)."""
    m_, e_ = cfg.federation.clients_per_round, cfg.federation.local_epochs
    server, wall = measured["server"], measured["wall_s"]
    per_client = measured["per_client"]
    entries = {cid: client_entry(m) for cid, m in per_client.items()}
    as_measured = round_accounting(entries, server, {}, wall)["phase_s"]
    lane_rest = sum(e["lane_s"] - sum(e["phases"].values()) for e in entries.values())
    ids = list(per_client)
    full = {k: scaled_entry(per_client[ids[k % len(ids)]], e_ / iterations) for k in range(m_)}
    busy = sum(e["lane_s"] + e["phases"]["transport"] for e in full.values())
    glue = as_measured["other"] - lane_rest + as_measured["dispatch"]  # the bench's own seconds between phases
    round_wall = busy + sum(server[p] for p in ("transport", "aggregation", "checkpoint", "validation")) + glue
    computed = round_accounting(full, server | {"train": busy}, {}, round_wall)["phase_s"]
    whole = clients == m_ and iterations == e_
    return {
        "round": "measured"
        if whole
        else f"computed from {clients} client(s) x {iterations} iteration(s) of {m_} x {e_}",
        "measured_wall_s": round(wall, 3),
        "measured_phase_s": {p: round(v, 3) for p, v in as_measured.items()},
        "lane_unnamed_s": round(lane_rest, 3),
        "round_s": round(round_wall, 3),
        "phase_s": {p: round(v, 3) for p, v in computed.items()},
    }


def at_scale(cfg: Config, recipe: Config) -> bool:
    """Whether the round's shape is the recipe's: federation, tasks, group, turns, caps, validation."""

    def shape(c: Config) -> tuple:
        r, f = c.rollout, c.federation
        return (
            f.clients,
            f.clients_per_round,
            f.local_epochs,
            f.tasks_per_client,
            c.algo.tasks_per_step,
            c.algo.rollouts_per_task,
            c.env.max_turns,
            r.max_prompt_tokens,
            r.max_response_tokens,
            c.federation.val_tasks,
        )

    return shape(cfg) == shape(recipe)


def run(cfg: Config, recipe: Config, args: argparse.Namespace) -> dict[str, Any]:
    """Start a lane (`TrainerService`: env service + trainer, `setup_s`), play the round, report."""
    device = resolve_device(cfg.run.device)
    memory = PeakMemory(device)
    with tempfile.TemporaryDirectory(dir=args.work_dir) as tmp, memory.watch():
        svc = TrainerService(cfg, run_id=1, lane="cpu" if device.type == "cpu" else "0", run_dir=Path(tmp))
        try:
            t0 = time.perf_counter()
            svc.start()
            setup_s = time.perf_counter() - t0
            assert isinstance(svc.trainer, RLTrainer)
            replies = Replies(svc.trainer)
            params = sum(p.numel() for _, p in svc.trainer.engine.parameters("actor"))

            def progress(stage: str, fits: dict[int, dict[str, float]], server: dict[str, float]) -> None:
                if args.json:
                    so_far = {"complete": False, "stage": stage, "recipe": args.recipe, "setup_s": round(setup_s, 3)}
                    so_far |= {"fits": {str(c): _fit_numbers(m) for c, m in fits.items()}, "server_s": server}
                    args.json.write_text(json.dumps(so_far, indent=1))

            measured = play_round(svc, args, replies, progress)
        finally:
            svc.close()
    summary = round_summary(cfg, measured, args.clients, args.iterations)
    gpus = cfg.run.lane_devices if device.type == "cuda" else 0
    gpu_min = summary["round_s"] / 60 * gpus
    return {
        "complete": True,
        "recipe": args.recipe,
        "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
        "torch": torch.__version__,
        "model": cfg.model.path,
        "trained_params_m": round(params / 1e6, 1),
        "engine": cfg.backend,
        "rollout_engine": cfg.rollout.engine,
        "overrides": args.overrides,
        "shape": {
            "clients_per_round": cfg.federation.clients_per_round,
            "local_epochs": cfg.federation.local_epochs,
            "tasks": cfg.algo.tasks_per_step,
            "group": cfg.algo.rollouts_per_task,
            "max_turns": cfg.env.max_turns,
            "max_prompt_tokens": cfg.rollout.max_prompt_tokens,
            "max_response_tokens": cfg.rollout.max_response_tokens,
            "val_tasks": cfg.federation.val_tasks,
            "measured_clients": args.clients,
            "measured_iterations": args.iterations,
            "warmup_iterations": args.warmup,
        },
        "at_recipe_scale": at_scale(cfg, recipe),
        "setup_s": round(setup_s, 3),
        **summary,
        "fits": {str(cid): _fit_numbers(m) for cid, m in measured["per_client"].items()},
        "clients": measured["clients"],
        "val_success": measured["val"].get("success"),
        "replies": replies.report(cfg),
        "peak_memory": memory.report(),
        "gpus": gpus,
        "gpu_minutes_per_round": round(gpu_min, 2),
        "fedagent_h100_minutes_per_round": round(FEDAGENT_GPU_MIN_PER_ROUND, 1),
        "vs_fedagent": round(gpu_min / FEDAGENT_GPU_MIN_PER_ROUND, 3) if gpus else None,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.published_round", description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="webshop-grpo-qwen2.5-1.5b")
    ap.add_argument("--model", type=Path, help="a Hugging Face model directory (default: random Qwen2.5-1.5B shape)")
    ap.add_argument("--model-dir", type=Path, default=Path(tempfile.gettempdir()) / "qwen1.5b-random")
    ap.add_argument("--engine", choices=("builtin", "verl"), help="training engine (default: the recipe's backend)")
    ap.add_argument(
        "--rollout", choices=("hf", "vllm"), help="rollout engine (default: the recipe's; hf with --device cpu)"
    )
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="cuda")
    ap.add_argument("--clients", type=int, help="clients measured (default: the recipe's clients_per_round, M)")
    ap.add_argument("--iterations", type=int, help="iterations per measured client (default: local_epochs, E)")
    ap.add_argument("--warmup", type=int, default=0, help="untimed iterations first (a lane's first-fit costs)")
    ap.add_argument("--tasks", type=int, help="algo.tasks_per_step")
    ap.add_argument("--group", type=int, help="algo.group_size")
    ap.add_argument("--turns", type=int, help="env.max_turns")
    ap.add_argument("--val-tasks", type=int, help="federation.val_tasks")
    ap.add_argument("--synthetic-catalog", action="store_true", help="the synthetic shop at 1,000 products")
    ap.add_argument("--work-dir", type=Path, help="where the round's shards go (default: a temp dir)")
    ap.add_argument("--json", type=Path)
    ap.add_argument("overrides", nargs="*", help="recipe overrides, a.b=c")
    args = ap.parse_args(argv)
    if args.device == "cpu" and args.rollout is None:
        args.rollout = "hf"  # vLLM, the published recipes' engine, needs a GPU
    recipe = load_config(args.recipe)
    cfg = load_config(args.recipe, dotlist=recipe_dotlist(args))
    check_catalog(cfg, args.recipe)
    fed = cfg.federation
    args.clients = args.clients or fed.clients_per_round
    args.iterations = args.iterations or fed.local_epochs
    if not (0 < args.clients <= fed.clients_per_round and 0 < args.iterations <= fed.local_epochs):
        ap.error(f"--clients must lie in [1, {fed.clients_per_round}] and --iterations in [1, {fed.local_epochs}]")
    if args.model is None:
        args.model = random_policy(args, resolve_device(cfg.run.device))
        cfg = load_config(args.recipe, dotlist=recipe_dotlist(args))
    return emit(run(cfg, recipe, args), args.json)


if __name__ == "__main__":
    sys.exit(main())
