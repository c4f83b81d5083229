"""Our env episodes as a verl agent loop, for verl's own trainer (`verl.trainer.main_ppo`).

verl 0.9 plays rollouts through agent loops: `AgentLoopBase.run(sampling_params, **row)` plays
one trajectory against `server_manager` (verl's async client of its vLLM / SGLang replicas) and
returns an `AgentLoopOutput`. `FedAgentEnvLoop` is registered as `fedagent_env` with verl's
`@register`, and this module is a `verl.plugins` entry point (pyproject.toml), so `import verl`
registers it in every process that has this project installed. A verl run selects it with
`actor_rollout_ref.rollout.agent.default_agent_loop=fedagent_env`; its settings come from an
agent-loop config file (`actor_rollout_ref.rollout.agent.agent_loop_config_path`), whose entry
keys are this class's keyword arguments:

    - name: fedagent_env
      _target_: client_app.trainer.verl_agent_loop.FedAgentEnvLoop
      recipe: tiny-shop-grpo            # env, rollout and penalty settings (our recipe) ...
      overrides: [rollout.mode=concat]  # ... with dotted overrides
      env_url: http://127.0.0.1:8000    # a running env service (`python -m envs.service`)

One `run` is one episode of the dataset row's `task_index`, played by the same
`client_app.rollout.run_episodes` as our backends (prompt construction, action parsing, env
sessions), on a worker thread whose generator hands each turn to `server_manager.generate` on
verl's event loop: many episodes run at once and the replicas batch their turns. verl gives the
n rollouts of a task no field that tells them apart, so sampling uses the replicas' own RNG
(our backends seed every turn instead). The episode comes back as concat mode's one sequence
(the first prompt; every reply, with the observation glue between them masked 0) scored with
the training score (env return minus the invalid-action penalty). A windowed episode is several
sequences, which one `AgentLoopOutput` cannot carry: `rollout.mode: windowed` is refused.
A gigpo recipe is refused: verl's trainer has no step-level estimator to hand the anchors to; so
is a `federation.update: lora` one: verl's trainer would train the full model, not our adapters.
verl gives `run` no sign of a validation pass, so its validation scores carry the penalty too;
the unpenalised return and the outcome are in `extra_fields` (`env_reward`, `won`, `outcome`).
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast
from uuid import uuid4

from transformers import PreTrainedTokenizerBase
from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopMetrics, AgentLoopOutput, register

from client_app.rollout import (
    RolloutSettings,
    cut_at_eos,
    episode_metrics,
    group_specs,
    run_episodes,
    training_rows,
    turn_end_ids_of,
)
from envs.client import SyncEnvClient
from envs.registry import system_prompt
from fl_app.config import Config, load_config

# episodes block on their turns in threads (the env client and the episode loop are synchronous);
# verl runs hundreds of trajectories per worker at once, more than the default executor's threads
_EPISODE_THREADS = ThreadPoolExecutor(
    max_workers=int(os.environ.get("FEDAGENT_AGENT_LOOP_THREADS", "256")), thread_name_prefix="fedagent-episode"
)


class _ServerGenerator:
    """`BatchedGenerator`'s contract over verl's async server manager, for one episode's
    worker thread: every prompt is one request on verl's event loop, all under the episode's
    request id (verl routes one id to one replica: its prefix cache keeps the episode). The
    sampling settings are verl's (`sampling_params`), so `temperature` and `seeds` are unused."""

    def __init__(
        self,
        server_manager: Any,
        loop: asyncio.AbstractEventLoop,
        tokenizer: Any,
        eos_ids: Sequence[int],
        sampling_params: dict[str, Any],
        max_new_tokens: int,
    ) -> None:
        self.server, self.loop, self.tokenizer = server_manager, loop, tokenizer
        self.eos_ids = list(eos_ids)
        self.sampling_params = {**sampling_params, "max_tokens": max_new_tokens}
        self.request_id = uuid4().hex

    def generate(self, prompts: Sequence[Sequence[int]], temperature: float, seeds: Sequence[int]) -> list[list[int]]:
        futures = [
            asyncio.run_coroutine_threadsafe(
                self.server.generate(
                    request_id=self.request_id, prompt_ids=list(p), sampling_params=dict(self.sampling_params)
                ),
                self.loop,
            )
            for p in prompts
        ]
        return [cut_at_eos(list(f.result().token_ids), self.eos_ids) for f in futures]


@functools.lru_cache(maxsize=8)
def _recipe(recipe: str, overrides: tuple[str, ...]) -> Config:
    """verl builds an agent loop per trajectory: the recipe is read once per process."""
    return load_config(recipe, dotlist=list(overrides))


@register("fedagent_env")
class FedAgentEnvLoop(AgentLoopBase):
    """One multi-turn env episode per trajectory (concat mode), scored for training."""

    def __init__(
        self, *args: Any, recipe: str = "", overrides: Sequence[str] = (), env_url: str | None = None, **kwargs: Any
    ) -> None:
        super().__init__(*args, **kwargs)
        if not recipe:
            raise ValueError(
                "fedagent_env needs `recipe` (a name in configs/ or a .yaml path) in its agent-loop "
                "config, e.g. recipe: tiny-shop-grpo with overrides: [rollout.mode=concat]"
            )
        cfg = _recipe(str(recipe), tuple(str(o) for o in overrides))
        if cfg.algo.spec.advantage == "step_group_relative":
            raise ValueError(
                f"recipe {recipe!r} has algo.name={cfg.algo.name!r}: step-level advantages need each "
                "action's anchor state and reward, and verl's own trainer scores one sequence per "
                "episode with its own estimator (verl 0.9.1 has no GiGPO); train gigpo with this "
                "project's fit loop (backend: builtin or verl)"
            )
        if cfg.federation.update == "lora":
            raise ValueError(
                f"recipe {recipe!r} has federation.update='lora': our adapters (fixed A, B federated) are "
                "trained by this project's fit loop (backend: builtin or verl), and verl's own trainer would "
                "silently train every weight; remove federation.update here, or use verl's own LoRA "
                "(actor_rollout_ref.model.lora_rank)"
            )
        if cfg.rollout.mode != "concat":
            raise ValueError(
                f"recipe {recipe!r} has rollout.mode={cfg.rollout.mode!r}; verl's AgentLoopOutput carries "
                "one sequence per episode, which is concat mode: set rollout.mode: concat in the recipe"
            )
        self.env_url = env_url or os.environ.get("FEDAGENT_ENV_URL")
        if not self.env_url:
            raise ValueError(
                "fedagent_env needs an env service: set `env_url` in its agent-loop config (or "
                "FEDAGENT_ENV_URL); start one with `python -m envs.service`"
            )
        self.settings = RolloutSettings(
            cfg.env.max_turns,
            cfg.rollout.history_length,
            cfg.rollout.max_prompt_tokens,
            system_prompt(cfg.env.name),
            mode="concat",
        )
        self.max_new_tokens = cfg.rollout.max_response_tokens
        self.penalty = cfg.rollout.invalid_action_penalty
        # the replicas stop on the generation config's eos ids too (Qwen: <|im_end|>, <|endoftext|>);
        # verl types its tokenizer as the AutoTokenizer factory, where it holds the instance
        eos = cast(PreTrainedTokenizerBase, self.tokenizer).eos_token_id
        self.eos_ids = list(turn_end_ids_of(eos, str(self.config.actor_rollout_ref.model.path)))

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> AgentLoopOutput:
        if "task_index" not in kwargs:
            raise KeyError("fedagent_env rows need a `task_index` column (the env task to play)")
        task = int(kwargs["task_index"])
        generator = _ServerGenerator(
            self.server_manager,
            asyncio.get_running_loop(),
            self.tokenizer,
            self.eos_ids,
            sampling_params,
            self.max_new_tokens,
        )
        temperature = float(sampling_params.get("temperature", 1.0))
        episodes, stats = await asyncio.get_running_loop().run_in_executor(
            _EPISODE_THREADS, self._play, generator, task, temperature
        )
        ep = episodes[0]
        row = training_rows([ep], self.penalty)[0]
        # cutting either part would keep the episode's reward on turns the sequence no longer shows
        bound = self.settings.max_prompt_tokens + self.max_new_tokens  # a whole concat episode, at most
        for part, ids, limit in (
            ("prompt", row.prompt_ids, self.rollout_config.prompt_length),
            ("response", row.response_ids, self.rollout_config.response_length),
        ):
            if len(ids) > limit:
                raise ValueError(
                    f"a {len(ep.turns)}-turn episode of task {task} has {len(ids)} {part} tokens but "
                    f"actor_rollout_ref.rollout.{part}_length is {limit}; raise it to {bound} (the "
                    "recipe's rollout.max_prompt_tokens + max_response_tokens bound a concat episode)"
                )
        return AgentLoopOutput(
            prompt_ids=row.prompt_ids,
            response_ids=row.response_ids,
            response_mask=row.mask,
            reward_score=row.score,
            num_turns=2 * len(ep.turns) + 1,
            metrics=AgentLoopMetrics(generate_sequences=stats.generate_s),
            extra_fields={
                "task_id": ep.task_id,
                "won": ep.won,
                "outcome": ep.outcome,
                "env_reward": ep.reward,
                **{f"episode_{k}": v for k, v in episode_metrics([ep], "").items()},
            },
        )

    def _play(self, generator: _ServerGenerator, task: int, temperature: float) -> tuple[list, Any]:
        if self.env_url is None:  # __init__ refused this already
            raise RuntimeError("fedagent_env has no env service URL")
        env = SyncEnvClient(self.env_url)
        try:
            return run_episodes(
                generator,
                env,
                group_specs([task], 1),
                self.settings,
                temperature,
                seed=0,
                max_sessions=1,
                desc=f"fedagent_env task {task}",
            )
        finally:
            env.close()
