"""The rollout engine, chosen independently of the training engine (`rollout.engine`).

  hf    batched Hugging Face `generate` on the training engine's own live policy
        (`RolloutPolicy.generation_model`): nothing to sync, CPU or GPU.
  vllm  an in-process vLLM engine (`vllm_rollout.VllmGenerator`) that sleeps outside rollouts:
        before each rollout it is woken with the training engine's current weights
        (`RolloutPolicy.policy_tensors`, synced in place) and it is put back to sleep after,
        on every path (invariant 25), so the update and the export have the GPU to themselves.

Either way the same episode loop (`client_app.rollout.run_episodes`) plays the episodes, so
the context a policy acted on is exactly the row it trains on, whichever engine generated.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from client_app.rollout import BatchedGenerator, Episode, EpisodeSpec, RolloutSettings, RolloutStats, run_episodes
from client_app.trainer.engine import RolloutPolicy
from envs.registry import system_prompt
from fl_app.config import Config

# On CPU a padded token costs as much as a real one: group prompts of similar length.
CPU_MAX_PADDING = 0.25


def rollout_settings(cfg: Config) -> RolloutSettings:
    """How the recipe's episodes are played and prompted (every generator alike)."""
    r = cfg.rollout
    return RolloutSettings(
        cfg.env.max_turns, r.history_length, r.max_prompt_tokens, system_prompt(cfg.env.name), mode=r.mode
    )


def hf_generator(
    model: Any, tokenizer: Any, cfg: Config, device: torch.device, amp_dtype: torch.dtype | None
) -> BatchedGenerator:
    """Hugging Face `generate` on `model` (under `amp_dtype` autocast when given); on the CPU
    length-grouped batches."""
    on_cpu = device.type == "cpu"
    return BatchedGenerator(
        model, tokenizer, cfg.rollout.max_response_tokens, amp_dtype, max_padding=CPU_MAX_PADDING if on_cpu else None
    )


class Rollouts:
    """Plays episodes with the policy the training engine holds right now."""

    def __init__(self, cfg: Config, policy: RolloutPolicy, model_path: Path) -> None:
        r = cfg.rollout
        self.policy = policy
        self.settings = rollout_settings(cfg)
        self.generator: Any
        if r.engine == "vllm":
            from client_app.trainer.vllm_rollout import VllmGenerator

            self.generator = VllmGenerator(
                model_path,
                policy.tokenizer,
                r.max_response_tokens,
                max_model_len=r.max_prompt_tokens + r.max_response_tokens,
                gpu_memory_utilization=r.gpu_memory_utilization,
                seed=cfg.run.seed,
            )
        else:
            self.generator = hf_generator(
                policy.generation_model(), policy.tokenizer, cfg, policy.device, policy.amp_dtype
            )

    @property
    def syncs_weights(self) -> bool:
        return not isinstance(self.generator, BatchedGenerator)

    def play(
        self,
        env: Any,
        specs: Sequence[EpisodeSpec],
        temperature: float,
        seed: int,
        max_sessions: int,
        desc: str,
        first_episode: int = 0,
    ) -> tuple[list[Episode], RolloutStats, float]:
        """Play `specs` to the end: (episodes, stats, seconds spent syncing weights); specs[0] is
        episode `first_episode` of its iteration (`run_episodes`)."""
        settings = (self.settings, temperature, seed, max_sessions)
        if not self.syncs_weights:
            self.policy.generation_model()  # eval mode: rollout and update score the same policy
            episodes, stats = run_episodes(self.generator, env, specs, *settings, desc, first_episode)
            return episodes, stats, 0.0
        try:
            sync_s = self.generator.load_weights(self.policy.policy_tensors())
            episodes, stats = run_episodes(self.generator, env, specs, *settings, desc, first_episode)
        finally:
            self.generator.sleep()
        return episodes, stats, sync_s

    def close(self) -> None:
        if self.syncs_weights:
            self.generator.close()
