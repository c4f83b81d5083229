"""SFT warm start of any Hugging Face model on an env's expert (`model.warm_start`).

A real instruct model never emits a valid shop action zero-shot (SmolLM2-135M-Instruct:
success 0), so RL from it has no signal. The warm start does for any model what the tiny build
does for its own: expert demonstrations on training tasks, rendered with the RL prompts,
imperfect on purpose (`noise`, `shortcut`), then reply-only SFT (`client_app.sft`, the one SFT
path both use). The result is a plain model directory, cached under
`<warm_start.cache_dir>/<sha256>` where the hash covers the model's files, the env, the
prompt-shaping rollout keys and the warm-start settings (`warm_start_key`).

After the SFT the warmed model plays the validation tasks `[0, federation.val_tasks)` at
`rollout.val_temperature` through the trainer's own rollout loop against an env service, with
the seed the trainers validate with (`derive_seed("eval", run.seed)`), and the outcome
breakdown (`outcome_breakdown`) goes into `warm_start.json` beside the weights and the log.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from client_app.sft import (
    build_host,
    cached_build,
    collect_demonstrations,
    cpu_build_settings,
    demo_rows,
    supervised_finetune,
)
from client_app.tiny_model import load_causal_lm
from client_app.trainer.device import cuda_autocast
from fl_app.config import Config
from fl_app.hashing import sha256_file

if TYPE_CHECKING:
    from client_app.rollout import Episode

log = logging.getLogger(__name__)

# Bump when a change to this module or to client_app/sft.py changes what gets built.
CODE_VERSION = "warm-start-1"
REPORT = "warm_start.json"
# Records written beside a model that its weights and tokenizer do not depend on (dates, timings).
PROVENANCE_FILES = frozenset({"import.json", "tiny_model.json", REPORT})


def model_digest(model_dir: Path) -> str:
    """sha256 over the names and contents of the files a model directory loads from."""
    h = hashlib.sha256()
    files = sorted(p for p in model_dir.rglob("*") if p.is_file() and p.name not in PROVENANCE_FILES)
    if not files:
        raise FileNotFoundError(f"model directory {model_dir} is empty or missing: fix `model.path`")
    for p in files:
        h.update(f"{p.relative_to(model_dir).as_posix()}\0{sha256_file(p)}\n".encode())
    return h.hexdigest()


def warm_start_key(digest: str, cfg: Config) -> str:
    """sha256 over everything the warmed weights depend on (not where the cache lives)."""
    payload = {
        "code": CODE_VERSION,
        "model": digest,
        "warm_start": cfg.model.warm_start.model_dump(mode="json", exclude={"cache_dir"}),
        "env": {"name": cfg.env.name, "params": cfg.env.params, "max_turns": cfg.env.max_turns},
        "rollout": cfg.rollout.model_dump(
            mode="json", include={"mode", "history_length", "max_prompt_tokens", "max_response_tokens"}
        ),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def warm_start(backbone: Path, cfg: Config) -> Path:
    """The cached warm start of the model in `backbone` for this config; built on first use."""
    digest = model_digest(backbone)
    final = Path(cfg.model.warm_start.cache_dir).expanduser() / warm_start_key(digest, cfg)
    return cached_build(final, lambda tmp: build_warm_start(tmp, backbone, digest, cfg), "warm start")


def build_warm_start(out: Path, backbone: Path, digest: str, cfg: Config) -> None:
    """Fine-tune `backbone` on demonstrations, validate it, save it with its report into `out`."""
    from client_app.trainer.builtin import resolve_device

    ws, device = cfg.model.warm_start, resolve_device(cfg.run.device)
    on_cpu = device.type == "cpu"
    with cpu_build_settings("warm start") if on_cpu else contextlib.nullcontext():
        model, tokenizer = load_causal_lm(backbone, device)
        t0 = time.perf_counter()
        demos = collect_demonstrations(cfg.env, cfg.rollout.history_length, ws.episodes, ws.noise, ws.seed, ws.shortcut)
        rows = demo_rows(tokenizer, demos, cfg.rollout)
        loss = supervised_finetune(model, rows, ws.epochs, ws.seed, ws.lr, ws.batch_size, cuda_autocast(device))
        sft_s = time.perf_counter() - t0
        log.info(
            "warm start: SFT on %d rows (%d episodes) x %d epochs in %.0f s, final loss %.4f",
            len(rows),
            ws.episodes,
            ws.epochs,
            sft_s,
            loss,
        )
        t0 = time.perf_counter()
        outcome = validate(model, tokenizer, cfg, device)
        val_s = time.perf_counter() - t0
        built_on = build_host() if on_cpu else {"device": torch.cuda.get_device_name(device)}
    log.info("warm start: %s", format_outcome(outcome))
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / REPORT).write_text(
        json.dumps(
            {
                "code_version": CODE_VERSION,
                "source": {"path": str(backbone), "digest": digest},
                "warm_start": ws.model_dump(mode="json", exclude={"cache_dir"}),
                "env": cfg.env.model_dump(mode="json"),
                "rollout": cfg.rollout.model_dump(mode="json"),
                "device": device.type,
                "built_on": built_on,
                "demonstrations": len(rows),
                "sft_final_loss": round(loss, 6),
                "seconds": {"sft": round(sft_s, 1), "validation": round(val_s, 1)},
                "validation": outcome,
            },
            indent=2,
            sort_keys=True,
        )
        + "\n"
    )


def validate(model: Any, tokenizer: Any, cfg: Config, device: torch.device) -> dict[str, Any]:
    """Play the validation tasks as the trainers validate (rollout loop, env service, seed,
    temperature) and return the outcome breakdown."""
    from client_app.rollout import derive_seed, group_specs, run_episodes
    from client_app.trainer.rollouts import hf_generator, rollout_settings
    from envs.client import SyncEnvClient
    from envs.service import serve_in_subprocess

    # the SFT'd fp32 model, under the autocast it trained with
    generator, settings = hf_generator(model, tokenizer, cfg, device, cuda_autocast(device)), rollout_settings(cfg)
    specs = group_specs(list(range(cfg.federation.val_tasks)), 1)
    with serve_in_subprocess(cfg.env.name, cfg.env.pool_size, cfg.env.params) as url:
        env = SyncEnvClient(url)
        try:
            episodes, _stats = run_episodes(
                generator,
                env,
                specs,
                settings,
                cfg.rollout.val_temperature,
                derive_seed("eval", cfg.run.seed),
                cfg.env.pool_size,
                desc="warm-start validation",
            )
        finally:
            env.close()
    return outcome_breakdown(episodes) | {"temperature": cfg.rollout.val_temperature, "seed": cfg.run.seed}


def outcome_breakdown(episodes: Sequence[Episode]) -> dict[str, Any]:
    """Success and how the episodes ended, one outcome each (`Episode.outcome`: the env's label,
    e.g. the shop's `wrong_options`, or `timeout` when `env.max_turns` ran out), plus the
    invalid-action rate over all turns and the episodes with at least one invalid action."""
    n, turns = len(episodes), sum(len(ep.turns) for ep in episodes)
    counts = Counter(ep.outcome for ep in episodes)
    return {
        "episodes": n,
        "success": counts["won"] / max(n, 1),
        "outcomes": dict(sorted(counts.items())),
        "episodes_with_invalid_action": sum(ep.invalid_actions > 0 for ep in episodes),
        "invalid_action_rate": sum(ep.invalid_actions for ep in episodes) / max(turns, 1),
        "turns": turns / max(n, 1),
    }


def format_outcome(outcome: dict[str, Any]) -> str:
    """One log line: success and the failure counts."""
    parts = ", ".join(f"{k} {v}" for k, v in outcome["outcomes"].items() if k != "won")
    return (
        f"validation success {outcome['success']:.3f} ({outcome['outcomes'].get('won', 0)}/{outcome['episodes']} at "
        f"T={outcome['temperature']}); failures: {parts}; invalid-action rate {outcome['invalid_action_rate']:.3f}"
    )
