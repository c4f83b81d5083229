"""Rollout throughput: our batched engine next to a per-sequence `model.generate` loop, in one run.

    python -m bench.rollout --size tiny --episodes 32 --max-turns 5          # CPU, the tiny model
    python -m bench.rollout --size qwen0.5b --episodes 64 --device cuda      # GPU, Qwen2.5-0.5B shape

All arms play the same episodes (distinct validation tasks, one env-service session each)
through the same rollout loop (`client_app.rollout.run_episodes`); they differ only in how a
turn's prompts are generated: `batched` = all live episodes in one left-padded `generate` call
(the GPU setting), `batched, length-grouped` = longest first, a new call whenever padding would
exceed 25% of a row (the CPU setting), `per-sequence` = one `generate` call per prompt. Decoding
is greedy, so all arms see the same prompts (the report says how many turns agreed token for
token with the per-sequence arm).
`qwen0.5b` is a random-weight model with Qwen2.5-0.5B's shape (24 layers, width 896, 14/2
heads, 151,936-row tied embedding) and the tiny tokenizer: it never stops early, so every
turn generates `--max-new-tokens` tokens; that measures the engine, not the policy.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Any

import torch

from client_app.rollout import BatchedGenerator, RolloutSettings, group_specs, run_episodes
from client_app.trainer.builtin import resolve_device
from envs.client import SyncEnvClient
from envs.registry import system_prompt
from envs.service import serve_in_subprocess
from fl_app.config import load_config

QWEN05B: dict[str, Any] = dict(  # Qwen2Config keyword arguments (ints, floats and a bool)
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    vocab_size=151936,
    tie_word_embeddings=True,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    max_position_embeddings=32768,
)
# Qwen2.5-1.5B(-Instruct)'s shape: 28 layers, width 1536, 12/2 heads, tied 151,936-row embedding
QWEN15B: dict[str, Any] = QWEN05B | dict(
    hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12
)


def build_policy(size: str, model_dir: str, cfg, device: torch.device):
    """(model, tokenizer) for a bench size (`model_dir` overrides the tiny build)."""
    from client_app.tiny_model import build_tiny_model, collect_demonstrations, load_causal_lm, train_tokenizer

    if size == "tiny":
        return load_causal_lm(model_dir or build_tiny_model(cfg.model.tiny, cfg.env, cfg.rollout), device)
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    demos = collect_demonstrations(cfg.env, cfg.rollout.history_length, 64, 0.0, 0)
    texts = sorted({m["content"] for d in demos for m in d.messages} | {d.action for d in demos})
    tok = train_tokenizer(texts, cfg.model.tiny.vocab_size)
    eos, pad = tok.eos_token_id, tok.pad_token_id
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = Qwen2ForCausalLM(Qwen2Config(**QWEN05B, eos_token_id=eos, pad_token_id=pad, bos_token_id=None))
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    return model.float().to(device).eval(), tok


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.rollout", description=__doc__.split("\n")[0])
    ap.add_argument("--size", choices=("tiny", "qwen0.5b"), default="tiny")
    ap.add_argument("--episodes", type=int, default=32)
    ap.add_argument("--max-turns", type=int, default=5)
    ap.add_argument("--max-new-tokens", type=int, default=0, help="0 = the recipe's rollout.max_response_tokens")
    ap.add_argument("--model", default="", help="tiny: use this model directory instead of the cached tiny build")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0 = torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_config("tiny-shop-grpo")
    device = resolve_device(args.device)
    model, tok = build_policy(args.size, args.model, cfg, device)
    amp = torch.bfloat16 if device.type == "cuda" else None
    new_tokens = args.max_new_tokens or cfg.rollout.max_response_tokens
    settings = RolloutSettings(
        args.max_turns, cfg.rollout.history_length, cfg.rollout.max_prompt_tokens, system_prompt(cfg.env.name)
    )
    val_size = int(cfg.env.params.get("val_size", 64))
    specs = group_specs([k % val_size for k in range(args.episodes)], 1)
    arms = {
        "batched": BatchedGenerator(model, tok, new_tokens, amp),
        "batched, length-grouped": BatchedGenerator(model, tok, new_tokens, amp, max_padding=0.25),
        "per-sequence": BatchedGenerator(model, tok, new_tokens, amp, max_batch=1),
    }
    results, turns = {}, {}
    with serve_in_subprocess(cfg.env.name, args.episodes, cfg.env.params) as url, SyncEnvClient(url) as env:
        run_episodes(arms["batched"], env, specs[:2], settings, 0.0, 0, args.episodes, desc="warm-up")
        for name, gen in arms.items():
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            episodes, stats = run_episodes(gen, env, specs, settings, 0.0, 0, args.episodes, desc=name)
            wall = time.perf_counter() - t0
            turns[name] = [t.response_ids for e in episodes for t in e.turns]
            results[name] = {
                "episodes": len(episodes),
                "steps": stats.steps,
                "tokens": stats.tokens,
                "generate_s": round(stats.generate_s, 3),
                "env_s": round(stats.env_s, 3),
                "wall_s": round(wall, 3),
                "tokens_per_s": round(stats.tokens / stats.generate_s, 1),
                "steps_per_s": round(stats.steps / wall, 2),
            }
    b = turns["per-sequence"]
    same = {
        name: f"{sum(x == y for x, y in zip(a, b))}/{max(len(a), len(b))}"
        for name, a in turns.items()
        if name != "per-sequence"
    }
    report = {
        "size": args.size,
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(),
        "threads": torch.get_num_threads(),
        "episodes": args.episodes,
        "max_turns": args.max_turns,
        "max_new_tokens": new_tokens,
        "params_m": round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        **{k: v for k, v in results.items()},
        "ratios_vs_per_sequence": {
            name: {
                "tokens_per_s": round(r["tokens_per_s"] / results["per-sequence"]["tokens_per_s"], 2),
                "steps_per_s": round(r["steps_per_s"] / results["per-sequence"]["steps_per_s"], 2),
            }
            for name, r in results.items()
            if name != "per-sequence"
        },
        "identical_turns_vs_per_sequence": same,
    }
    print(json.dumps(report, indent=2))
    print("\n| arm | tokens/s | env steps/s | wall s | vs per-sequence |\n|---|---|---|---|---|")
    for name, r in results.items():
        ratio = report["ratios_vs_per_sequence"].get(name, {}).get("steps_per_s", 1.0)
        print(f"| {name} | {r['tokens_per_s']} | {r['steps_per_s']} | {r['wall_s']} | x{ratio} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
