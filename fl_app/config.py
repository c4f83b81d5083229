"""Recipe YAML + run-config overrides -> one validated, typed config.

Every config key is documented here, in the field descriptions; `docs/config.md` is generated
from this module (`python -m fl_app.config --doc`). Unknown keys and bad values fail with a
message that names the key and the fix, before any process or service starts.

Every recipe key is also a Flower run-config key, dotted (`--run-config 'algo.lr=2e-4
federation.rounds=3'`): Flower accepts only keys declared in pyproject's `[tool.flwr.app.config]`,
and that section is generated from this module (`python -m fl_app.config --run-config-keys`).
A handful of flat aliases (`rounds`, `clients-per-round`, ...) are kept for the common knobs.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import re
import sys
import time
import types
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeVar
from urllib.parse import urlsplit

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic.fields import FieldInfo

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_RECIPE = "tiny-shop-grpo"


@dataclass(frozen=True)
class Algorithm:
    """What an `algo.name` means, in one table instead of checks scattered over the code."""

    members: tuple[str, ...]  # the weights a round federates (invariant 7)
    critic: bool  # trains a value model beside the policy
    default_group_size: int  # rollouts per task when algo.group_size is unset
    advantage: str  # the advantage estimator (client_app.trainer.advantages.ADVANTAGES)


ALGORITHMS: dict[str, Algorithm] = {
    "grpo": Algorithm(members=("actor",), critic=False, default_group_size=8, advantage="group_relative"),
    "ppo": Algorithm(members=("actor", "critic"), critic=True, default_group_size=1, advantage="gae"),
    "gigpo": Algorithm(members=("actor",), critic=False, default_group_size=8, advantage="step_group_relative"),
}
LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
Aggregator = Literal["fedavg", "clipped", "trimmed_mean", "median"]  # fl_app.robust
# what a member's global model is and what a client uploads (federation.update)
Update = Literal["full", "delta-int8", "delta-int4", "lora"]
COMPRESSED: tuple[Update, ...] = ("delta-int8", "delta-int4")  # uploads that are quantized deltas (fl_app.quant)
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KlType = Literal["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "kl+", "abs+", "k3+", "low_var_kl+"]


class ConfigError(ValueError):
    """A recipe or override is invalid; the message names the key and the fix."""


_T = TypeVar("_T")


def resolved(value: _T | None, key: str) -> _T:
    """A value that validation fills when the recipe leaves it unset (algo.group_size,
    algo.critic.mini_batch_size / micro_batch_size, federation.server_lr), for code that runs on a
    validated config."""
    if value is None:
        raise ConfigError(f"{key} is unset: validate the config (fl_app.config.load_config) before using it")
    return value


class _Strict(BaseModel):
    """Unknown keys, inf/nan and booleans where a number belongs are errors (YAML and TOML both
    turn `true` into a value pydantic would otherwise read as 1)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, bool) and info.field_name is not None:
            annotation = cls.model_fields[info.field_name].annotation
            if bool not in _scalar_types(annotation) and _scalar_types(annotation) & {int, float}:
                raise ValueError(f"expects a number, got the boolean {value}")
        return value


def node_cache(sub: str) -> str:
    """This machine's cache dir `sub`: `$FEDAGENT_CACHE_DIR/<sub>`, else ~/.cache/fedagent-flower/<sub>."""
    return str(Path(os.environ.get("FEDAGENT_CACHE_DIR", "~/.cache/fedagent-flower")) / sub)


def default_model_cache() -> str:
    return node_cache("models")


def default_weight_cache() -> str:
    return node_cache("weights")


# the docs show these defaults unexpanded: their value depends on the machine that resolves them
_NODE_DEFAULTS: dict[Any, str] = {
    default_model_cache: "$FEDAGENT_CACHE_DIR/models",
    default_weight_cache: "$FEDAGENT_CACHE_DIR/weights",
}


# Field metadata of a key resolved on each machine (a path there): every node may hold its own
# value, so the key is left out of the recipe digest (`recipe_sha256`, `recipe_leaves`) and
# docs/config.md marks it.
NODE_LOCAL: dict[str, Any] = {"node_local": True}


CACHE_PREFIX = "cache:"


def model_directory(path: str) -> Path:
    """`model.path` as a directory on this machine: `cache:<name>` resolves in the model cache
    here (each node has its own), any other value is a path (`tiny` is the caller's to build)."""
    if path.startswith(CACHE_PREFIX):
        name = path.removeprefix(CACHE_PREFIX)
        if not name or "/" in name or name in (".", ".."):
            raise ConfigError(
                f"model.path={path!r}: name one directory of the model cache, e.g. "
                f"{CACHE_PREFIX}smollm2-135m-instruct.q4_1"
            )
        return Path(default_model_cache()).expanduser() / name
    return Path(path).expanduser()


def require_model_here(path: str, where: str) -> None:
    """Fail closed when `model.path` names no directory on this machine (`tiny` is built here):
    every node builds its lane's model from its own disk, and nothing else tells it why."""
    if path != "tiny" and not model_directory(path).is_dir():
        raise ConfigError(
            f"model.path={path!r}: no model directory at {model_directory(path)} on {where}. Every node needs "
            "the model locally: a plain directory at the same absolute path on every node, or cache:<name> "
            "imported into each node's model cache ($FEDAGENT_CACHE_DIR/models; docs/deployment.md, "
            "'The model on every node')"
        )


class TinyModelCfg(_Strict):
    """The locally built default model (used when `model.path` is `tiny`)."""

    hidden_size: int = Field(96, gt=0, description="Width of the tiny Qwen2 model.")
    layers: int = Field(2, gt=0, description="Decoder layers of the tiny model.")
    heads: int = Field(4, gt=0, description="Attention heads (KV heads = heads / 2).")
    vocab_size: int = Field(4096, ge=300, description="BPE vocabulary trained on env text.")
    sft_episodes: int = Field(768, ge=0, description="Expert episodes used for the SFT warm start.")
    sft_epochs: int = Field(3, ge=0, description="Passes over the SFT demonstrations.")
    sft_noise: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Fraction of demonstration actions replaced by a random valid action, so the warm start is imperfect.",
    )
    sft_shortcut: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Fraction of SFT episodes that demonstrate a bad habit (buying without choosing the goal's options), a defect RL can fix from reward.",
    )
    seed: int = Field(0, description="Seed of tokenizer training, init and SFT (the build is a pure function of it).")
    cache_dir: str = Field(
        default_factory=default_model_cache,
        json_schema_extra=NODE_LOCAL,
        description="Where built tiny models are cached (keyed by a hash of this section and the env); default `$FEDAGENT_CACHE_DIR/models`, else ~/.cache/fedagent-flower/models.",
    )


class WarmStartCfg(_Strict):
    """SFT warm start of the model at `model.path` on the env's expert (client_app/warm_start.py,
    docs/models.md): demonstrations rendered with the RL prompts, fine-tuned, cached by content hash."""

    episodes: int = Field(
        0,
        ge=0,
        description="Expert episodes demonstrated (training tasks only); 0 = no warm start, round 0 starts from `model.path` as is.",
    )
    epochs: int = Field(2, gt=0, description="Passes over the demonstrated (prompt, reply) rows.")
    lr: float = Field(
        2e-5,
        gt=0,
        description="AdamW peak learning rate (5% linear warmup, then linear decay to 0), loss on reply tokens only.",
    )
    batch_size: int = Field(
        8, gt=0, description="Demonstrated rows per optimizer step (batches of similar length, seeded order)."
    )
    noise: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Fraction of demonstrated actions replaced by a random valid action (and played), so the imitation is imperfect and the expert's recoveries are shown.",
    )
    shortcut: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Fraction of episodes that demonstrate the shop's buy-now habit (buying without choosing the goal's options), a defect RL can fix from reward; shop only.",
    )
    seed: int = Field(
        0,
        description="Seed of the demonstrations and the SFT data order (the warmed weights are a pure function of it on CPU).",
    )
    cache_dir: str = Field(
        default_factory=default_model_cache,
        json_schema_extra=NODE_LOCAL,
        description="Where warmed models are cached, keyed by a hash of the model files, the env, the prompt-shaping rollout keys and this section (not `cache_dir`); default `$FEDAGENT_CACHE_DIR/models`, else ~/.cache/fedagent-flower/models.",
    )


class ModelCfg(_Strict):
    path: str = Field(
        "tiny",
        description="`tiny` builds the local default; `cache:<name>` is the model directory `<name>` in this machine's model cache (`$FEDAGENT_CACHE_DIR/models`, where `python -m client_app.models import-gguf` writes; docs/models.md); otherwise a local Hugging Face model directory (e.g. Qwen2.5-1.5B-Instruct). It gives the architecture, the tokenizer and the KL reference model, also when `init_from` is set.",
    )
    init_from: str = Field(
        "",
        description="Warm start: a weights dir of an earlier run (e.g. `runs/x/rounds/round-0007/actor`) loaded over `path` before round 0. For ppo its sibling `critic` dir is picked up as the critic (see `algo.critic.path`). It must be readable by the node that builds round 0.",
    )
    warm_start: WarmStartCfg = Field(default_factory=WarmStartCfg)
    reference: Literal["warmed", "backbone"] = Field(
        "warmed",
        description="KL reference under `algo.ref_anchor: base` when `warm_start` is on: `warmed` = the warm-started model round 0 starts from (default: the policy RL starts from, as verl-agent's reference is its initial actor; a zero-shot backbone that never emits a valid action would pull the policy back to invalid actions), `backbone` = `model.path` before the warm start. Without a warm start both are `model.path`.",
    )
    tiny: TinyModelCfg = Field(default_factory=TinyModelCfg)


class EnvCfg(_Strict):
    name: Literal["shop", "alfworld"] = Field(
        "shop",
        description="Environment engine (see envs/registry.py): `shop` (WebShop-compatible, docs/shop.md) or `alfworld` (ALFWorld on the real engine, docs/alfworld.md).",
    )
    params: dict[str, Any] = Field(
        default_factory=dict,
        description="Engine keyword arguments, checked against the engine when it is built. shop: num_products, num_goals, val_size, search_return_n, seed, data_dir, human_goals, ranking, ... (envs/shop/env.py). alfworld: num_games (default 120 generated), val_size (24), seed (0), data_dir (None: $ALFWORLD_DATA if set, else generated games; `generated`: generated regardless), cache_dir, task_types (subset of the six), val_split (valid_seen | valid_unseen), max_steps, manifest_dir (docs/alfworld.md).",
    )
    pool_size: int = Field(16, gt=0, description="Pre-warmed env instances per env service.")
    max_turns: int = Field(15, gt=0, description="Step budget per episode (WebShop 15, ALFWorld 50).")


# env_partition variants: their environment, pool size (None: not a pool) and the env.params keys
# each one sets per client (partitions/env_variants.py is the implementation; a test keeps the two
# in step: fl_app imports nothing from partitions).
ENV_PARTITIONS: dict[str, tuple[str | None, int | None, tuple[str, ...]]] = {
    "uniform": (None, None, ()),
    "catalog_split": ("shop", None, ("catalog_keep", "protected_tasks")),
    "bm25_fields": ("shop", 8, ("index_fields",)),
    "bm25_weights": ("shop", 8, ("bm25_k1", "bm25_b")),
    "lookalike": ("shop", 4, ("lookalike",)),
    "rank_wrapper": ("shop", 4, ("ranking", "rank_seed")),
    "env_disjoint": ("alfworld", None, ("only_tasks",)),
}


class EnvPartitionCfg(_Strict):
    """Environment heterogeneity (docs/env-heterogeneity.md; FedAgent §3): each client trains in its
    own variant of the environment, a pure, recorded function of (client id, these knobs); the task
    partition stays uniform, and validation always runs on the unperturbed environment."""

    name: Literal[
        "uniform", "catalog_split", "bm25_fields", "bm25_weights", "lookalike", "rank_wrapper", "env_disjoint"
    ] = Field(
        "uniform",
        description="`uniform`: every client sees the same environment. shop: `catalog_split` (each client's catalog = its goals' targets + the keep_ratio share of the other products with the smallest mix of a shared and a private draw, env_div weighting the private one), `bm25_fields` (which product fields the search index sees), `bm25_weights` (BM25 k1, b), `lookalike` (lookalike products that copy a target and fail one reward term: price, color, size, price+color), `rank_wrapper` (results as scored, shuffled, inverted, or random for half the searches). alfworld: `env_disjoint` (each client trains on the games of its own share of each task spec's scenes). Shop variants need `env.params.search_return_n` set explicitly (200 in the published runs).",
    )
    num_variants: int | None = Field(
        None,
        gt=0,
        description="N: the first N entries of the variant pool (bm25_fields, bm25_weights: up to 8; lookalike, rank_wrapper: up to 4); client c gets entry RandomState(seed + c).randint(N). Required by those variants, refused by the others.",
    )
    env_div: float | None = Field(
        None,
        ge=0,
        le=1,
        description="catalog_split, env_disjoint: 0 = every client gets the same catalog / scenes, 1 = independent draws per client (required by them, refused by the others).",
    )
    keep_ratio: float | None = Field(
        None,
        gt=0,
        le=1,
        description="catalog_split: the share of the non-target products each client's catalog keeps (published 0.7; required).",
    )
    fallback: Literal["skip", "shared", "trial-only"] = Field(
        "skip",
        description="env_disjoint: a task spec whose games all share one scene is left out (`skip`, the published default), given to every client (`shared`), or split by trial instead of scene (`trial-only`).",
    )
    holdout: bool = Field(
        False,
        description="env_disjoint: drop the published holdout scenes (FloorPlans 15, 25, 213, 221, 319, 321, 416, 418) first.",
    )
    seed: int = Field(
        42,
        description="Seed of the variant draws: assignment RandomState(seed + client id), catalog and scene draws, the rank wrappers' seed + client id. 42 = the published constant, which every published run used whatever its run seed.",
    )


class RolloutCfg(_Strict):
    mode: Literal["windowed", "concat"] = Field(
        "windowed",
        description="`windowed` (the published runs): one prompt and one training row per turn, the task + the last `history_length` (observation, action) turns. `concat`: one growing token sequence and one training row per episode (prompt + actions + observations, observation tokens masked out of the loss); the text between turns comes from diffs of rendered chat-template strings.",
    )
    history_length: int = Field(
        2,
        ge=0,
        description="Turns of history in a windowed prompt (unused in concat mode, where the whole episode is the context).",
    )
    max_prompt_tokens: int = Field(
        1024,
        gt=0,
        description="Context budget per generation. windowed: longer prompts lose their oldest history turns, then their head, identically for generation and training. concat: the growing sequence must fit; an episode that would outgrow it ends there (not done).",
    )
    max_response_tokens: int = Field(32, gt=0, description="Generated tokens per turn.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature for training rollouts.")
    val_temperature: float = Field(0.4, ge=0, description="Sampling temperature for validation (0 = greedy).")
    invalid_action_penalty: float = Field(
        0.1,
        ge=0,
        description="Subtracted from a training episode's reward per invalid action; never applied to validation.",
    )
    engine: Literal["hf", "vllm"] = Field(
        "hf",
        description="Who generates the rollouts, whichever training engine (`backend`) trains. `hf`: batched Hugging Face `generate` on the training engine's own live policy (CPU and GPU). `vllm`: vLLM 0.24 inside the lane service, woken with the policy's current weights before each rollout (synced in place from the training engine) and asleep otherwise (GPU only; docs/offline-gpu.md installs it).",
    )
    gpu_memory_utilization: float = Field(
        0.5,
        gt=0,
        lt=1,
        description="Fraction of the GPU's memory vLLM may take for its weights and KV cache while awake (`engine: vllm` only).",
    )


def rollout_engine_dotlist(engine: str) -> list[str]:
    """Overrides that switch a recipe's rollout engine; switching to hf also puts vLLM's memory share
    back to its default, which a vLLM recipe (the published ones) sets and hf would refuse."""
    default = RolloutCfg.model_fields["gpu_memory_utilization"].default
    return [f"rollout.engine={engine}"] + ([] if engine == "vllm" else [f"rollout.gpu_memory_utilization={default}"])


class CriticCfg(_Strict):
    """The PPO value model: the policy's architecture with a one-output value head (`score`)."""

    path: str = Field(
        "",
        description="Where the starting critic comes from. Empty: the `critic` dir beside `model.init_from` when that is a round of an earlier run; without `model.init_from`, a fresh value head on the backbone (logged); with `model.init_from` but no sibling critic, an error, so a warm-started policy never silently gets a random value baseline. `fresh`: a fresh value head on the starting policy's backbone, deliberately. Otherwise a weights dir holding a value head (e.g. `runs/x/rounds/round-0007/critic`). Resume always restores the run's own critic. summary.json records the choice.",
    )
    lr: float = Field(1e-5, gt=0, description="Critic learning rate (constant, AdamW).")
    weight_decay: float = Field(0.01, ge=0, description="Critic AdamW weight decay.")
    value_clip: float = Field(
        0.5,
        gt=0,
        description="Value clipping: a prediction may move at most this far from the rollout-time value before its loss is clipped (verl cliprange_value).",
    )
    loss_coef: float = Field(
        1.0,
        gt=0,
        description="Critic loss = loss_coef x the token mean, over the WHOLE mini-batch, of max((V - R)^2, (clip(V) - R)^2). Normalised by the mini-batch token count, so it does not depend on micro_batch_size (field log 2026-07-22). 1.0 is the FedAgent fork's coefficient (the executed runs); 0.5 is verl's convention.",
    )
    mini_batch_size: int | None = Field(
        None,
        gt=0,
        description="Rows per critic optimizer step; unset = algo.mini_batch_size (the published critic inherits it).",
    )
    micro_batch_size: int | None = Field(
        None,
        gt=0,
        description="Rows per critic forward/backward (gradient accumulation; does not change the loss); unset = algo.micro_batch_size.",
    )
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip of the critic.")

    @property
    def mini(self) -> int:
        """Rows per critic optimizer step, as validation filled them."""
        return resolved(self.mini_batch_size, "algo.critic.mini_batch_size")

    @property
    def micro(self) -> int:
        """Rows per critic forward/backward, as validation filled them."""
        return resolved(self.micro_batch_size, "algo.critic.micro_batch_size")


class GigpoCfg(_Strict):
    """GiGPO's step-level credit (arXiv 2505.10978; verl-agent `algorithm.gigpo`, docs/trainer.md)."""

    gamma: float = Field(
        0.95,
        ge=0,
        le=1,
        description="Discount of the step returns that rank the actions taken in one anchor state (per env step; the published runs' `algorithm.gamma`).",
    )
    step_weight: float = Field(
        1.0,
        ge=0,
        description="w in A = A_episode + w x A_step (verl-agent `step_advantage_w`; 1 in the published runs, 0 is GRPO with verl-agent's per-step episode statistics).",
    )
    mode: Literal["mean_norm", "mean_std_norm"] = Field(
        "mean_norm",
        description="Normalisation of both levels' groups: `mean_norm` centres on the group mean (verl-agent's default, its WebShop runs), `mean_std_norm` also divides by the group std (its ALFWorld runs).",
    )


class AlgoCfg(_Strict):
    name: Literal["grpo", "ppo", "gigpo"] = Field(
        "grpo",
        description="`grpo`: group-relative outcome advantages, no critic. `ppo`: GAE advantages from a critic that is federated beside the policy (see `critic`). `gigpo`: GRPO's episode-level group advantage plus a step-level one among the actions a group's trajectories took in identical env states (see `gigpo`), no critic. What each name implies (members, critic, default group size, advantage) is the `ALGORITHMS` table in fl_app/config.py.",
    )
    tasks_per_step: int = Field(8, gt=0, description="Distinct tasks per RL iteration (train_batch_size).")
    group_size: int | None = Field(
        None,
        gt=0,
        description="Rollouts per task (n). Unset: 8 for grpo and gigpo (one group per task), 1 for ppo (ungrouped, as published); PPO with n > 1 multiplies the rollout volume by n.",
    )
    lr: float = Field(1e-6, gt=0, description="Actor learning rate (constant, AdamW).")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    clip_ratio: float = Field(0.2, gt=0, description="PPO clip epsilon (low = high).")
    clip_ratio_c: float = Field(3.0, gt=1, description="Dual-clip constant c.")
    entropy_coeff: float = Field(0.001, ge=0, description="Entropy bonus coefficient.")
    kl_coef: float = Field(
        0.01, ge=0, description="KL loss coefficient against the reference model (0 disables the reference)."
    )
    kl_type: KlType = Field(
        "low_var_kl",
        description="Per-token estimator of KL(policy || reference) in the KL loss: `k1`/`kl` (log-ratio), `abs`, `k2`/`mse` (half squared log-ratio), `k3`/`low_var_kl` (clamped, non-negative, the published runs'). A `+` suffix keeps the estimator's value but takes the k2 gradient (straight-through, unbiased for the KL's gradient).",
    )
    loss_agg_mode: LossAggMode = Field(
        "token-mean",
        description="How per-token losses are reduced over a mini-batch, for the policy loss, its entropy and KL terms and the critic's value loss: `token-mean` (the published runs: every generated token weighs the same), `token-sum`, `seq-mean-token-sum`, `seq-mean-token-mean` (every row weighs the same), `seq-mean-token-sum-norm` (Dr.GRPO: token sums over a constant horizon, the per-turn generation budget `rollout.max_response_tokens`, or `rollout.max_prompt_tokens` in concat mode).",
    )
    grpo_norm_by_std: bool = Field(
        True,
        description="GRPO advantages divide each group's centred scores by the group's std (the published runs); false = Dr.GRPO's mean-centred, unscaled advantages. grpo only.",
    )
    filter_uniform_groups: bool = Field(
        False,
        description="grpo: leave out of the policy update every row of a group whose episodes all scored the same (their advantages are exactly 0, so only the KL and entropy terms would move them), as DAPO's dynamic sampling filters groups (without drawing more). The update then costs in proportion to the groups that carry signal, and its loss is normalised over the rows that remain; an iteration with no such group takes no step. The fit's `rows` counts the rows trained; FedAvg still weighs the client by the episodes it played (its data, not what the filter kept). The share of such groups is reported either way (`uniform_groups`). Off in the published runs.",
    )
    ref_anchor: Literal["base", "round"] = Field(
        "base",
        description="Reference model: `base` = the original backbone (published runs), `round` = the round-start global weights.",
    )
    mini_batch_size: int = Field(64, gt=0, description="Rows per optimizer step.")
    micro_batch_size: int = Field(
        16, gt=0, description="Rows per forward/backward pass (gradient accumulation; does not change the loss)."
    )
    micro_batch_tokens: int | None = Field(
        None,
        gt=0,
        description="Token budget of one forward/backward pass (policy, reference and critic), as verl's use_dynamic_bsz / ppo_max_token_len_per_gpu: rows sorted by length are cut into micro-batches of at most this many tokens (padded tokens: rows x the longest row, and at most micro_batch_size rows a pass; both engines cut every pass so, verl's training steps included, where verl's own budget would mix long and short rows in every pass). Short rows then share a pass and long rows pay no padding (docs/benchmarks.md, \"The CPU default's update\"). Must hold the longest row, rollout.max_prompt_tokens + max_response_tokens. Unset: micro_batch_size rows per pass. Changes memory and speed, not the loss.",
    )
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    gamma: float = Field(
        1.0, ge=0, le=1, description="GAE discount (ppo), per generated token; observation tokens are skipped."
    )
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda (ppo).")
    critic: CriticCfg = Field(default_factory=CriticCfg)
    gigpo: GigpoCfg = Field(default_factory=GigpoCfg, description="gigpo only: its step-level keys.")

    @property
    def spec(self) -> Algorithm:
        """What `name` means (the ALGORITHMS table)."""
        return ALGORITHMS[self.name]

    @property
    def rollouts_per_task(self) -> int:
        """group_size, as validation filled it."""
        return resolved(self.group_size, "algo.group_size")

    @model_validator(mode="after")
    def _inherited(self) -> "AlgoCfg":
        """Fill the unset keys from the algorithm and the actor's batch sizes."""
        if self.group_size is None:
            self.group_size = self.spec.default_group_size
        if self.critic.mini_batch_size is None:
            self.critic.mini_batch_size = self.mini_batch_size
        if self.critic.micro_batch_size is None:
            self.critic.micro_batch_size = self.micro_batch_size
        return self


class QuantCfg(_Strict):
    block: int = Field(
        64,
        ge=8,
        le=4096,
        description="Values per quantization block of `federation.update: delta-int8 | delta-int4`: each block of "
        "a tensor's update keeps one fp32 scale (its largest magnitude / 127, or / 7 for int4), so a value's error "
        "is at most half a scale, and the scales cost 32 / block bits per value (0.5 at 64: int8 moves 8.5 bits "
        "a value, int4 4.5). A power of two from 8 to 4096 (a block never straddles the aggregator's pieces).",
    )

    @field_validator("block")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ValueError(f"federation.quant.block={v} is not a power of two; use 8, 16, ..., 4096 (e.g. 64)")
        return v


class LoraCfg(_Strict):
    """`federation.update: lora`: the adapters a member federates (client_app/trainer/lora.py,
    docs/trainer.md "LoRA federation")."""

    rank: int = Field(
        8,
        gt=0,
        description="r: the rank of every adapter. Each target linear of shape out x in trains one factor, B (out x r) or A (r x in) as `trained` picks, and travels as it; the other is fixed.",
    )
    trained: Literal["B", "smaller"] = Field(
        "B",
        description="The factor each adapter trains and sends, the other drawn once from the run's seed and fixed (so the server's mean of the trained factors is exactly the mean of the clients' products). `B`: B (out x r) over a fixed A on every layer (FFA-LoRA). `smaller`: per layer the factor with fewer numbers, A (r x in) where in < out (the MLP's gate and up projections) over a fixed B, else B: the same bytes buy a higher rank (the tiny default's rank 8 moves what rank 4 moves with `B`).",
    )
    alpha: float = Field(
        16.0, gt=0, description="The adapter's scale is alpha / rank (LoRA's, as PEFT's `lora_alpha`)."
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS),
        min_length=1,
        description="The linear layers that get an adapter, by the last part of their module name (PEFT's `target_modules`); default every attention and MLP projection of a Llama/Qwen2 decoder. Each must name at least one `torch.nn.Linear` of the model (checked when the lane builds it); the embeddings and the LM head are never adapted.",
    )


class FederationCfg(_Strict):
    clients: int = Field(100, gt=0, description="N: clients in the federation (virtual clients in simulation).")
    clients_per_round: int = Field(
        2, gt=0, description="M: clients sampled per round, a pure function of (seed, round) (`sampling_seed`)."
    )
    rounds: int = Field(70, gt=0, description="T: federated rounds.")
    local_epochs: int = Field(
        3, gt=0, description="E: RL iterations per sampled client per round (one rollout batch + one update each)."
    )
    tasks_per_client: int = Field(100, gt=0, description="|X_i|: training tasks in each client's shard.")
    strategy: Literal["fedavg", "fedprox"] = Field("fedavg", description="Aggregation strategy.")
    proximal_mu: float = Field(
        0.01, ge=0, description="FedProx mu (only used by `fedprox`; applies to the policy only)."
    )
    server_optimizer: Literal["sgd", "fedavgm", "fedadam", "nesterov"] = Field(
        "sgd",
        description="The server's step from the round's global model w along the pseudo-gradient Delta = avg - w "
        "(avg: the strategy's weighted mean of the clients, every member; formulas in fl_app/server_opt.py). "
        "`sgd`: w + server_lr * Delta, stateless (server_lr 1 = FedAvg bit for bit). `fedavgm`: server momentum, "
        "m = server_momentum * m + Delta, w + server_lr * m (Hsu et al. 2019, arXiv 1909.06335; FedOpt's FedAvgM). "
        "`fedadam`: FedOpt's FedAdam (Reddi et al. 2021, arXiv 2003.00295, Algorithm 2, no bias correction), "
        "m = b1 m + (1 - b1) Delta, v = b2 v + (1 - b2) Delta^2, w + server_lr * m / (sqrt(v) + server_tau). "
        "`nesterov`: DiLoCo's outer step (Douillard et al. 2023, arXiv 2311.08105): SGD with Nesterov momentum "
        "on the outer gradient g = w - avg. The moments are fp32 shards beside each round's global model "
        "(rounds/round-R/server_opt/), zeros before round 1, part of the round: a resumed run steps exactly as "
        "an uninterrupted one. Every transport is supported: the mean is always written as shards (inline "
        "replies are averaged in memory, then saved), and the step streams from there.",
    )
    server_lr: float | None = Field(
        None,
        gt=0,
        le=10,
        description="Server learning rate eta of `server_optimizer` (every optimizer's step is scaled by it). "
        "Unset: 1 for `sgd` and `fedavgm` (FedAvg's step; FedAvgM then moves by about 1 / (1 - momentum) "
        "times the clients' mean step), 0.7 for `nesterov` (DiLoCo's outer learning rate); `fedadam` needs it "
        "set, as FedOpt tunes it per task (its step moves every weight by up to about eta per round). With "
        "`sgd`: the new global model is w + eta * (avg - w); 1 = the mean itself, FedAvg bit for bit; above 1 "
        "extrapolates the clients' mean step (FedOpt's server SGD, Flower's FedAvgM `server_learning_rate` "
        "without momentum).",
    )
    server_momentum: float | None = Field(
        None,
        ge=0,
        lt=1,
        description="Momentum of `fedavgm` (beta; default 0.9, FedOpt's FedAvgM) and `nesterov` (mu; default "
        "0.9, DiLoCo's outer momentum). Unset for the other optimizers.",
    )
    server_beta1: float | None = Field(
        None, ge=0, lt=1, description="`fedadam`'s first-moment decay b1 (default 0.9, as FedOpt fixes it)."
    )
    server_beta2: float | None = Field(
        None, ge=0, lt=1, description="`fedadam`'s second-moment decay b2 (default 0.99, as FedOpt fixes it)."
    )
    server_tau: float | None = Field(
        None,
        gt=0,
        description="`fedadam`'s degree of adaptivity tau, added to sqrt(v) (default 1e-3, the value FedOpt's "
        "experiments fix while tuning the learning rates).",
    )
    update: Update = Field(
        "full",
        description="What a member's global model is and what travels each round. `full`: every fp32 weight, "
        'FedAvg bit for bit. `delta-int8` / `delta-int4` (docs/weight-store.md "Compressed updates", '
        "fl_app/quant.py): a client uploads its update from the round's global model, blockwise absmax-quantized "
        "to 8 / 4 bits with one fp32 scale per `quant.block` values (about 3.8x / 7.1x fewer bytes up at block "
        "64), with error feedback: each client adds what quantization lost last time to its next update, the "
        "residual kept on its node per (run, client, member, round) (a client that another node served before "
        "starts from zeros: `ef_residual_zeros` 1 in its fit metrics); the server decodes each update onto the "
        "global model piece by piece and aggregates in fp32 with every aggregator and server optimizer. The way "
        "down is compressed too (fl_app/downlink.py): the round's global model is the previous one plus the "
        "server's step to the aggregate, quantized the same way with the server's own error feedback (its "
        "residual kept with the round, like a server optimizer's moments), and from round 1's global model on a "
        "call names both by key in the weight store (so such a run needs a store every node reaches: the run dir "
        "on a shared disk, as in simulation, or `run.weight_store`): a lane that holds the previous global model "
        "fetches only the step and checks the model it rebuilds against the round's digests, one that holds the "
        "round's model fetches nothing, any other the fp32 model (`step_fallback` 1 in its metrics when a step "
        "was refused). `lora`: adapters over a frozen base (FFA-LoRA, Sun et "
        "al. 2024, arXiv 2403.12313): each target linear W of `lora.target_modules` computes W x + (alpha / r) "
        "B A x, where one factor (A, r x in, or under `lora.trained: smaller` B, out x r, where A is the "
        "smaller) is drawn once from a generator seeded by (run.seed, member, tensor name, factor), the same "
        "bits on every node, never trained nor sent, and the other (zeros at round 0) is trained; the "
        "critic's value head (ppo) is trained whole. A member's global model IS its trained factors (+ the "
        "value head), fp32, through the same channel, aggregators and server optimizers: with one factor "
        "fixed, the mean of the clients' products is exactly (mean B_i) A or B (mean A_i), which averaging "
        "both factors would not give. Every "
        "round records the frozen base's digest (`base_sha256`), and a node whose base differs is refused. "
        "Both engines train the same adapters (same names, same fixed bits, same base digest: a lane of either "
        "engine loads the other's factors); on `backend: verl` a vLLM rollout is synced the merged weights W + s B A "
        "(docs/verl.md). PPO's critic follows the mode in each case.",
    )
    lora: LoraCfg = Field(default_factory=LoraCfg, description="`update: lora` only: its adapters.")
    aggregator: Aggregator = Field(
        "fedavg",
        description="How a round combines the clients' updates d_i = x_i - w (w the round's global model; fl_app/robust.py, docs/architecture.md \"Robust aggregation\"). `fedavg`: the num-examples-weighted mean, FedAvg bit for bit. `clipped`: FedAvg of the updates, each scaled down to norm at most `clip_multiple` x the round's median update norm (two streaming passes: norms, then the fold). `trimmed_mean`: per coordinate, the clients' values sorted, `trim_fraction` of them dropped from each end, the rest averaged. `median`: per coordinate, the clients' median. The coordinate-wise two are unweighted, as the literature defines them (Yin et al. 2018). All stream shard by shard in fp32 and are deterministic; `server_lr` composes with each (w + eta * (agg - w)), and so does a `server_optimizer`: it steps from w along the aggregate. Every aggregator records each client's update norm and cosines in the round's metrics row (`update_scores`, `flagged`).",
    )
    trim_fraction: float = Field(
        0.25,
        gt=0,
        lt=0.5,
        description="`trimmed_mean`: the share of a round's clients dropped from each end of every coordinate, floor(trim_fraction x clients); it must drop at least one even from a round of `min_clients_per_round` (checked at load). 0.25 drops one of 4 per side (the tiny fault recipes' one poisoned client of 4).",
    )
    clip_multiple: float = Field(
        1.0,
        gt=0,
        description="`clipped`: the bound C on an update's norm, as a multiple of the round's median update norm. Relative, not absolute, because update norms scale with the model, the learning rate and the local epochs, and a bound must move with them (adaptive clipping: Andrew et al. 2021 clip at the median norm, target quantile 0.5, which 1.0 is).",
    )
    flag_norm_ratio: float = Field(
        3.0,
        gt=1,
        description="Anomaly flag: a client whose update norm exceeds this multiple of the round's median norm is flagged (the metrics row's `flagged`; recorded; dropped only with `drop_flagged`). Needs 3 or more clients.",
    )
    flag_cosine_z: float | None = Field(
        None,
        gt=0,
        description="Anomaly flag by direction, off unless set: a client whose median cosine to the other clients' updates (`cos_peers`) is below flag_cosine_z / sqrt(parameters) is flagged (a random direction's cosine to an update is ~N(0, 1/parameters): such an update is no more aligned with its peers than noise; a sign-flipped one points away from them). Off by default because clean updates need not agree: on the tiny default (4 clients a round, 7 rounds, 3 seeds) 20 of 84 clean updates of clean runs had cos_peers below 4 / sqrt(parameters), 17 of them below 0 (docs/architecture.md, \"Robust aggregation and anomaly scores\"). Set it (4 is the usual bound) where a recipe's clean updates are measured to agree. The norm rule (`flag_norm_ratio`) always flags. Needs 3 or more clients.",
    )
    flag_unrelated_z: float | None = Field(
        5.0,
        gt=0,
        description="Anomaly flag for an update unrelated to every peer, on by default: a client whose largest |cosine| to another client's update, times sqrt(parameters) (`peer_z` in the metrics row), is below this, and from round 2 also its |cosine| to the server's last step (the global model's change over the previous round, times sqrt(parameters): `step_z`), is flagged. A random direction's cosine to an update is ~N(0, 1/parameters), so such an update is neither aligned nor opposed to any peer by more than chance (noise sent in place of an update). On the tiny default (4 clients a round) noise of an update's norm scored 0.3-2.7 and clean updates 8.8 or more in 5 rounds, but over 9 rounds x 3 seeds 6 of 270 clean updates scored 1.9-4.7 and were flagged (docs/architecture.md, \"What the scores can tell apart\"). null turns it off. Needs 3 or more clients and a member of at least (4 x flag_unrelated_z)^2 parameters (below that no cosine can tell an update from noise); with fewer clients, or null, the server's last step is not read (one model less a round) and `step_z` is null.",
    )
    flag_shrink_z: float | None = Field(
        None,
        gt=0,
        description="Anomaly flag for an update that grows the model's rows, off unless set: a client whose `shrink_z` (metrics row) is below minus this is flagged. Each row of every matrix votes whether the update moved most of its coordinates toward 0 (shrank) or away (grew); shrink_z = (shrank - grew) / sqrt(shrank + grew). AdamW's decoupled weight decay shrinks the rows a round's gradient barely touches (most token embeddings), so a clean update's rows mostly shrink and a sign-flipped one's grow. On the tiny default (4 clients a round, 3 seeds x 5 rounds) 59 of 60 clean updates had shrink_z 12.3 or more, but one, whose gradient moved every token's row, grew them (-29.3): at 5 it is flagged and its flip is not (docs/architecture.md, \"Telling a sign flip apart\"). Off by default for that, and because it reads how the clients' training moves the weights: it needs a weight decay on every trained member (refused at load otherwise). Needs no peers: it applies with any number of clients.",
    )
    drop_flagged: bool = Field(
        False,
        description="Leave the round's flagged clients out of its aggregate (off: flags are recorded, not acted on). A first, read-only pass scores every update; the aggregator then runs over the unflagged ones: `fedavg` and `clipped` over their num-examples weights, `trimmed_mean` with its trim first spent on the clients dropped whole (floor(trim_fraction x clients) - dropped per side, 0: their plain mean), `median` over the rest. Each member is scored and filtered on its own; the metrics row names the clients left out (`excluded`, and `excluded` in each one's `update_scores`). A round whose every client is flagged fails. Costs one more read of the uploads. Needs 3 or more clients a round (the peer rules' minimum).",
    )
    quant: QuantCfg = Field(default_factory=QuantCfg)
    eval_every: int = Field(
        1,
        ge=0,
        description="Validate the global model every k rounds (and at round 0); 0 = only round 0 and the last round.",
    )
    val_tasks: int = Field(64, gt=0, description="Size of the fixed validation set (the env's first tasks).")
    sampling_seed: int | None = Field(
        None,
        description="Seed of the per-round client draw, FedAgent's rule `Random(sampling_seed + round - 1)`. Unset = derived from `run.seed` by a hash, so runs of different seeds draw independent client sequences (fed to the rule directly, seeds s and s + 1 would draw the same clients one round apart). The paper recipes set 42, the published constant every published seed arm drew with.",
    )
    only_clients: list[int] = Field(
        default_factory=list,
        description="Train exactly these client ids every round instead of sampling (the local-only baseline: one client, one round of T*E epochs). Its length must equal `clients_per_round`; empty = sample.",
    )
    min_clients_per_round: int | None = Field(
        None,
        gt=0,
        description="Failure tolerance: a round completes with the sampled clients that replied if at least this many did; a failed client (its node lost, timed out, raised, or uploaded non-finite weights) is then dropped and named in the round's metrics row. Unset = all of `clients_per_round` (fail closed: a failed client is re-dispatched once to another node, else the round fails).",
    )
    client_timeout_s: float = Field(
        86400.0,
        gt=0,
        description="A sampled client whose reply has not arrived this long after its message was sent counts as failed (timed out). A lost SuperNode is reported sooner by Flower itself (Node Unavailable, after two missed heartbeats).",
    )
    over_select: int = Field(
        0,
        ge=0,
        description="Over-selection: each round also sends this many more clients, drawn after the round's `clients_per_round` from a stream of their own (so the first `clients_per_round` are the draw of a run without it). The round aggregates the first `clients_per_round` clients in sample order among those that replied when it closes: it closes as soon as the first `clients_per_round` clients that have not failed all replied, so a run without faults aggregates exactly the clients (and bits) of a run without over-selection, and an over-selected client steps in for a failed one in sample order. Over-selected clients not needed are named `spare` in the metrics row; their replies and uploads are discarded. 0 = off.",
    )
    round_deadline_s: float | None = Field(
        None,
        gt=0,
        description="Round deadline: this long after a round's messages were sent, the round closes as soon as at least `min_clients_per_round` clients replied; the clients still pending are dropped as stragglers (metrics row `failed`: client, node, `straggler: no reply at the N s deadline`), never waited for nor re-dispatched, and their late replies and uploads are discarded. Which clients beat the deadline depends on timing: only a round in which every needed client replied before it has the bits of a run without it. Needs a client the round can afford to drop (`min_clients_per_round` below `clients_per_round`, or `over_select` > 0) and must be shorter than `client_timeout_s`. Unset = wait for every client as the failure rules say.",
    )

    @model_validator(mode="after")
    def _server_optimizer(self) -> "FederationCfg":
        """Fill the chosen server optimizer's unset knobs; fail closed on another optimizer's knob
        and on `fedadam` without a learning rate."""
        owned = SERVER_OPT_KNOBS[self.server_optimizer]
        for knob in ("server_momentum", "server_beta1", "server_beta2", "server_tau"):
            if getattr(self, knob) is not None and knob not in owned:
                owners = [n for n, ks in SERVER_OPT_KNOBS.items() if knob in ks]
                raise ValueError(
                    f"federation.{knob} is a knob of server_optimizer {' / '.join(owners)}, but "
                    f"federation.server_optimizer={self.server_optimizer!r}; remove it or change the optimizer"
                )
        if self.server_optimizer == "fedadam" and self.server_lr is None:
            raise ValueError(
                "federation.server_optimizer=fedadam needs federation.server_lr: its step moves every weight by "
                "up to about server_lr per round, and FedOpt (arXiv 2003.00295) tunes it per task (e.g. 1e-2); "
                "set it explicitly"
            )
        for knob, default in SERVER_OPT_DEFAULTS[self.server_optimizer].items():
            if getattr(self, knob) is None:
                setattr(self, knob, default)
        return self

    def fold_lr(self) -> float:
        """The eta of the aggregation's own fold: server_lr for the stateless `sgd`; 1 (the clients'
        mean) when a server optimizer steps from that mean."""
        if self.server_optimizer != "sgd":
            return 1.0
        return resolved(self.server_lr, "federation.server_lr")


# The server optimizers' knobs (fl_app/server_opt.py) and their published defaults: FedOpt
# (Reddi et al. 2021) for fedavgm/fedadam, DiLoCo (Douillard et al. 2023) for nesterov.
SERVER_OPT_KNOBS: dict[str, tuple[str, ...]] = {
    "sgd": ("server_lr",),
    "fedavgm": ("server_lr", "server_momentum"),
    "fedadam": ("server_lr", "server_beta1", "server_beta2", "server_tau"),
    "nesterov": ("server_lr", "server_momentum"),
}
SERVER_OPT_DEFAULTS: dict[str, dict[str, float]] = {
    "sgd": {"server_lr": 1.0},
    "fedavgm": {"server_lr": 1.0, "server_momentum": 0.9},
    "fedadam": {"server_beta1": 0.9, "server_beta2": 0.99, "server_tau": 1e-3},
    "nesterov": {"server_lr": 0.7, "server_momentum": 0.9},
}

# Which partition owns which knob (partitions/registry.py implements them; docs/heterogeneity.md).
PARTITION_KNOBS: dict[str, tuple[str, ...]] = {
    "uniform": (),
    "preference": ("omega", "downsample_category", "downsample_ratio"),
    "coverage": ("xi", "center", "high"),
    "hardness": ("xi_prime", "rule"),
}
PARTITION_REQUIRED = {"preference": "omega", "coverage": "xi", "hardness": "xi_prime"}
# Filled in when unset: [code] the published hard-coded pool-size bounds, and the documented hardness rule.
PARTITION_DEFAULTS: dict[str, dict[str, Any]] = {
    "coverage": {"center": 500, "high": 1000},
    "hardness": {"rule": "intended"},
}


class PartitionParams(_Strict):
    """The knobs of the task-heterogeneity partitions. Each is a plain scalar (reachable as
    `partition.params.<knob>` from the run config); a knob of another partition is an error."""

    omega: float | None = Field(
        None,
        ge=1e-3,
        le=0.999,
        description="preference: Dirichlet dispersion omega in [0.001, 0.999] (the published clip range); client category mixtures q_i ~ Dirichlet(pi (1 - omega) / omega), so tr Cov(q_i) = omega (1 - ||pi||^2). ~0: IID shards, ~1: one category per client. Published sweep: 0.01, 0.99.",
    )
    downsample_category: str | None = Field(
        None,
        min_length=1,
        description="preference: a category thinned before the draw, per client (published WebShop: `fashion`, which dominates its pool). Unset: none.",
    )
    downsample_ratio: float | None = Field(
        None,
        gt=0,
        le=1,
        description="preference: fraction of `downsample_category` kept (at least 1 task; published 0.2), drawn per client.",
    )
    xi: float | None = Field(
        None,
        ge=2e-3,
        description="coverage: Beta concentration of the client pool sizes (not a standard deviation: larger = more uniform sizes; size variance (high - low)^2 mu (1 - mu) / (xi + 1) before rescaling). Published sweep: 256, 1.",
    )
    center: int | None = Field(
        None,
        gt=0,
        description="coverage: mean client pool size (default: the published 500); sizes run from federation.tasks_per_client to `high` and sum to clients x center, so each task sits in about clients x center / |pool| shards.",
    )
    high: int | None = Field(
        None,
        gt=0,
        description="coverage: largest client pool size (default: the published 1000); must not exceed the training pool.",
    )
    xi_prime: float | None = Field(
        None,
        ge=2e-3,
        description="hardness: Beta concentration of the clients' easy-task quotas k_i (mean tasks_per_client / 2); realized success-rate variance 0.25 / (xi_prime + 1). Published sweep: 256, 1. Needs `partition.labels`.",
    )
    rule: Literal["intended", "executed"] | None = Field(
        None,
        description="hardness: how a shard is filled around its quota. `intended` (default; the published docs and algorithm): k_i easy tasks placed by the coverage primitive on the easy pool + tasks_per_client - k_i hard tasks. `executed`: what the published code ran: k_i easy + k_i hard + random rest, cut to tasks_per_client (success rates floored near the pool's rate). Both draw fills from one global stream in client order.",
    )


class PartitionCfg(_Strict):
    name: Literal["uniform", "preference", "coverage", "hardness"] = Field(
        "uniform",
        description="How the training pool is split into client shards (partitions/, docs/heterogeneity.md): `uniform` (one seeded permutation, equal blocks), `preference` (Dirichlet category mixtures, knob omega), `coverage` (Beta-sized overlapping pools, knob xi), `hardness` (Beta-sized easy-task quotas under success labels, knob xi_prime). All are pure functions of (client, clients, tasks_per_client, training pool, run.seed, knobs); the server writes every client's realized shard statistics to `partition.json` before round 1.",
    )
    params: PartitionParams = PartitionParams()
    labels: str = Field(
        "",
        description="Success labels of the training pool (written by `python -m client_app.label_tasks`). Required by `hardness`; with another partition it adds the easy/hard counts to partition.json. A labels file made on another task order (env fingerprint) or rollout mode is refused, as is one that misses more than half the pool; misses count as hard and are reported.",
    )

    @model_validator(mode="after")
    def _knobs(self) -> "PartitionCfg":
        """Fail closed on knobs the chosen partition does not read, and on its missing knob."""
        owned = PARTITION_KNOBS[self.name]
        for knob, value in self.params.model_dump().items():
            if value is not None and knob not in owned:
                owner = next(n for n, ks in PARTITION_KNOBS.items() if knob in ks)
                raise ValueError(
                    f"partition.params.{knob} is a knob of partition {owner!r}, but partition.name="
                    f"{self.name!r} (its knobs: {', '.join(owned) or 'none'}); remove it or set "
                    f"partition.name={owner}"
                )
        required = PARTITION_REQUIRED.get(self.name)
        if required and getattr(self.params, required) is None:
            raise ValueError(f"partition.name={self.name!r} needs partition.params.{required}")
        for knob, default in PARTITION_DEFAULTS.get(self.name, {}).items():
            if getattr(self.params, knob) is None:
                setattr(self.params, knob, default)
        if (self.params.downsample_category is None) != (self.params.downsample_ratio is None):
            raise ValueError(
                "partition.params.downsample_category and downsample_ratio go together; set both or neither"
            )
        if self.name == "hardness" and not self.labels:
            raise ValueError(
                "partition.name='hardness' needs partition.labels: a labels file from "
                "`python -m client_app.label_tasks --recipe <recipe> --out labels.json`"
            )
        return self


class RunCfg(_Strict):
    name: str = Field("tiny-shop-grpo", description="Run name; the run dir is `<run_dir>` if set, else `runs/<name>`.")
    run_dir: str = Field("", description="Run directory (resume happens when it already holds rounds).")
    seed: int = Field(0, description="Master seed: client sampling, task draws, rollouts.")
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto", description="Trainer device: `auto` = CUDA when visible, else CPU."
    )
    precision: Literal["auto", "fp32", "autocast", "bf16"] = Field(
        "auto",
        description="How the builtin engine computes its forward and backward passes (and `rollout.engine: hf` generation); the weights it loads, optimizes, exports and averages are fp32 masters in every mode (invariant 1). `bf16`: on a bf16 copy of the masters, gradients summed into fp32, the copy refreshed after every step (the fast GPU mode, docs/benchmarks.md). `autocast`: bf16 autocast over the fp32 weights (slower: fp32 norms, residuals and casts). `fp32`: plain fp32. `auto` = `bf16` on CUDA, `fp32` on the CPU (exactly reproducible there). verl computes in bf16 over fp32 masters itself: `auto` or `bf16` only.",
    )
    lane_devices: int = Field(
        1,
        ge=1,
        json_schema_extra=NODE_LOCAL,
        description="Devices per lane, one rank each: a lane is the device set of one trainer service (`CUDA_VISIBLE_DEVICES`: this many GPUs), and it serves one fit at a time. Above 1 the lane's fit is data parallel over that many ranks (either engine; docs/trainer.md, \"A lane over k ranks\"): NCCL over the lane's GPUs, or on a CPU lane (`run.device: cpu`, no GPU) that many gloo processes sharing the lane's cores. Each rank plays a block of whole task groups and every optimizer step sums the ranks' gradients, so the fit equals the 1-rank fit up to fp32 summation order (invariant 43); the verl engine shards each model's fp32 masters and AdamW state over the ranks (FSDP2), the builtin engine holds whole weights on each. In simulation give each virtual client this many GPUs with `--federation-config \"client-resources-num-gpus=N\"`; in deployment start one SuperNode per lane with its `CUDA_VISIBLE_DEVICES` (docs/deployment.md). Above 1 it needs an algorithm without a critic, `rollout.engine: hf`, full weights on the verl engine (no `federation.update: lora`) and `algo.tasks_per_step` >= it (refused at load otherwise).",
    )
    cpu_lanes: int = Field(
        1,
        ge=1,
        json_schema_extra=NODE_LOCAL,
        description="CPU lanes per host: without a GPU, this many trainer services (lanes `cpu0`, `cpu1`, ...; 1 = the one lane `cpu`) share the host's cores, each fit leasing a free lane and queueing while all are busy. Concurrent fits need as many simulation actors: `--federation-config \"client-resources-num-cpus=C\"` with C = cores / lanes. A fit's result does not depend on which lane served it (invariant 39).",
    )
    compile: bool = Field(
        False,
        description="Compile the decoder layers (policy, reference, critic) with torch.compile for scoring and training, dynamic shapes (generation stays eager), on either engine (verl: inside its FSDP2 modules, whose hooks stay eager). The first fit of a lane pays the compilation; it fuses norms, rotary, SwiGLU and residual adds between the matmuls (docs/benchmarks.md). Needs a Llama/Qwen2-style decoder (`base_model.layers`).",
    )
    inline_max_mb: float = Field(
        64.0,
        ge=0,
        description="Models up to this size travel inline in Flower messages; larger ones through the weight store.",
    )
    shard_max_mb: float = Field(512.0, gt=0, description="Upper bound on one safetensors shard.")
    service_idle_timeout_s: float = Field(
        900.0, gt=0, description="A trainer service with no request for this long exits."
    )
    weight_cache_dir: str = Field(
        default_factory=default_weight_cache,
        json_schema_extra=NODE_LOCAL,
        description="Root for weights a node fetched from or stages for a remote weight store (no shared disk); the trainer service reads and writes weights only inside the run dir and this root. Default `$FEDAGENT_CACHE_DIR/weights`, else ~/.cache/fedagent-flower/weights.",
    )
    weight_store: str = Field(
        "",
        description="How weights above `inline_max_mb` travel (docs/weight-store.md): `''` = through the run dir, which every node must see at the same path (simulation, a shared disk); `http` = the built-in store the ServerApp serves over its run dir (no shared disk: nodes fetch and upload shards over HTTP(S) with a per-call credential); `file:///abs/path` = a disk every machine mounts; `s3://bucket/prefix` (or another fsspec URL) = your object store, credentials and endpoint from the environment (`AWS_*`), never from the config.",
    )
    weight_store_host: str = Field(
        "127.0.0.1",
        description="`weight_store: http`: the address the store binds (loopback unless configured; `0.0.0.0` serves other machines and then needs `weight_store_url`).",
    )
    weight_store_port: int = Field(
        0,
        ge=0,
        le=65535,
        description="`weight_store: http`: its port; 0 = a free port of the private band (a fixed one must lie outside the ephemeral range).",
    )
    weight_store_url: str = Field(
        "",
        description="`weight_store: http`: the URL nodes reach the store at (e.g. `https://10.0.0.1:9400`), when it differs from the bound address; its host is advertised, the port is the bound one.",
    )
    weight_store_certfile: str = Field(
        "",
        description="`weight_store: http`: TLS certificate (PEM) of the store; with `weight_store_keyfile` the store serves HTTPS (use the SuperLink's when it runs TLS).",
    )
    weight_store_keyfile: str = Field("", description="`weight_store: http`: the TLS certificate's private key (PEM).")
    weight_store_ca_file: str = Field(
        "",
        json_schema_extra=NODE_LOCAL,
        description="The CA file (PEM) nodes verify the store's certificate with, when the system does not trust it.",
    )
    weight_store_parallel: int = Field(
        4, ge=1, le=64, description="Shards in flight per transfer to or from a remote weight store."
    )
    tensorboard: bool = Field(
        True,
        description="Mirror every metrics.jsonl row into TensorBoard event files in `<run dir>/tb/` as it is written (tensorboardX; `tensorboard --logdir runs/`): the row's numbers, `phase_s/<phase>`, `bytes_down/<member>`, `bytes_up/<member>`. About 4 ms a row of 73 numbers (2-core CPU box, loaded).",
    )

    @model_validator(mode="after")
    def _weight_store(self) -> RunCfg:
        """Refuse, before anything starts, a weight store nobody could open."""
        spec, scheme = self.weight_store.strip(), urlsplit(self.weight_store.strip()).scheme
        if spec not in ("", "http") and not scheme:
            raise ValueError(
                f"run.weight_store={spec!r} is none of '' (the run dir), 'http' (the built-in store) "
                "or a URL such as file:///shared/dir or s3://bucket/prefix"
            )
        if scheme in ("http", "https"):
            raise ValueError(
                f"run.weight_store={spec!r}: the built-in store is `http` (the ServerApp serves it and "
                "tells the nodes its URL and token); set run.weight_store_url for the address nodes use"
            )
        if scheme == "file" and (
            urlsplit(spec).netloc not in ("", "localhost") or not urlsplit(spec).path.startswith("/")
        ):
            raise ValueError(f"run.weight_store={spec!r}: a shared disk is file:///absolute/path")
        served = ("weight_store_url", "weight_store_certfile", "weight_store_keyfile")
        if spec != "http" and any(getattr(self, k) for k in served):
            raise ValueError(
                f"run.{'/'.join(served)} configure the built-in store: set run.weight_store=http, or drop them"
            )
        if bool(self.weight_store_certfile) != bool(self.weight_store_keyfile):
            raise ValueError("run.weight_store_certfile and run.weight_store_keyfile go together (TLS needs both)")
        if self.weight_store_host in ("0.0.0.0", "::") and not self.weight_store_url:
            raise ValueError(
                f"run.weight_store_host={self.weight_store_host} listens on every interface: set "
                "run.weight_store_url to the address nodes reach it at"
            )
        if self.weight_store_url and urlsplit(self.weight_store_url).scheme not in ("http", "https"):
            raise ValueError(f"run.weight_store_url={self.weight_store_url!r} must be an http(s):// URL")
        return self

    @model_validator(mode="after")
    def _lanes(self) -> RunCfg:
        """Refuse, before anything starts, CPU lanes on GPUs."""
        if self.cpu_lanes > 1 and self.device == "cuda":
            raise ValueError(
                f"run.cpu_lanes={self.cpu_lanes} with run.device=cuda: CPU lanes split a host without a GPU; "
                "on GPUs a lane is run.lane_devices GPUs, so leave run.cpu_lanes at 1 (or set run.device=cpu)"
            )
        return self

    @field_validator("run_dir")
    @classmethod
    def _sane_run_dir(cls, value: str) -> str:
        """A run dir holds checkpoints that resume renames aside: never `/`, a top-level system
        dir, or the home dir (or an ancestor of it) itself."""
        if value:
            p = Path(value).expanduser().resolve()
            home = Path.home().resolve()
            if len(p.parts) < 3 or p == home or p in home.parents:
                raise ValueError(
                    f"run.run_dir={value!r} resolves to {p}, which is not a dedicated directory; "
                    "use one of its own, e.g. runs/<name> or ~/fedagent-runs/<name>"
                )
        return value


class PoisonCfg(_Strict):
    """A test fault: chosen clients send a poisoned update instead of their own."""

    kind: Literal["none", "scale", "sign_flip", "noise"] = Field(
        "none",
        description="Fault injection (testing and the robustness experiments): what a poisoned client sends instead of its update d = x - w (every member). `scale`: w + factor x d; `sign_flip`: w - d; `noise`: w + Gaussian noise with d's norm, seeded by (run.seed, round, client, member). Applied by the ClientApp to the trainer's export, before the upload. `none`: no fault.",
    )
    factor: float = Field(100.0, description="`scale`: the multiple of the update a poisoned client sends.")
    clients: list[int] = Field(
        default_factory=list,
        description="Client ids that poison every round they are sampled in; empty = the first sampled client of every round (one poisoned client per round).",
    )

    @model_validator(mode="after")
    def _armed(self) -> PoisonCfg:
        """Poisoned clients without a poison are a mistake: refuse them."""
        if self.kind == "none" and self.clients:
            raise ValueError("faults.poison.clients is set but faults.poison.kind=none; set a kind or remove it")
        return self


class FaultsCfg(_Strict):
    """Faults injected on purpose, to show and test the failure rules (docs/reliability.md)."""

    straggler_clients: list[int] = Field(
        default_factory=list,
        description="Logical client ids made slow on purpose: their fit call sleeps `straggler_s` in the ClientApp before it reaches the trainer lane (the lane stays free for other clients). Empty = none.",
    )
    straggler_rounds: list[int] = Field(
        default_factory=list,
        description="The rounds in which `straggler_clients` are slow; empty = every round.",
    )
    straggler_s: float = Field(
        0.0,
        ge=0,
        description="How long a straggler's fit sleeps before it starts; must be > 0 with `straggler_clients`.",
    )
    poison: PoisonCfg = Field(default_factory=PoisonCfg)

    @model_validator(mode="after")
    def _armed(self) -> FaultsCfg:
        """A straggler that would not sleep, or a sleep nobody takes, is a mistake: refuse it."""
        if bool(self.straggler_clients) != (self.straggler_s > 0):
            raise ValueError(
                f"faults.straggler_clients={self.straggler_clients} and faults.straggler_s={self.straggler_s} "
                "go together: name the slow clients and give them a sleep > 0, or neither"
            )
        if self.straggler_rounds and not self.straggler_clients:
            raise ValueError("faults.straggler_rounds needs faults.straggler_clients (whom to slow down)")
        if any(r < 1 for r in self.straggler_rounds):
            raise ValueError(f"faults.straggler_rounds={self.straggler_rounds}: rounds count from 1")
        return self

    def straggles(self, client: int, server_round: int) -> float:
        """The seconds client `client`'s fit of `server_round` sleeps (0 = none)."""
        slow = client in self.straggler_clients and (not self.straggler_rounds or server_round in self.straggler_rounds)
        return self.straggler_s if slow else 0.0

    def straggle(self, client: int | None, server_round: int) -> None:
        """Sleep as long as client `client`'s fit of `server_round` straggles (None: not a fit).
        The ClientApp calls it before it forwards the call, so the lane stays free for others."""
        if client is not None:
            time.sleep(self.straggles(client, server_round))


class Config(_Strict):
    extends: str = Field(
        "",
        description="The recipe this one starts from: a name in configs/ or a .yaml path relative to this file. Its keys are merged under this file's (lists are replaced, not appended); chains are allowed, cycles are an error. A saved (resolved) config has it empty.",
    )
    backend: Literal["builtin", "verl"] = Field(
        "builtin",
        description="Training engine: `builtin` (torch + transformers, CPU or one GPU) or `verl` (verl 0.9.1's FSDP2 training engine; `pip install -e .[verl]`; docs/verl.md). Both run the same fit loop (client_app/trainer/loop.py) and either can roll out with `rollout.engine`.",
    )
    model: ModelCfg = Field(default_factory=ModelCfg)
    env: EnvCfg = Field(default_factory=EnvCfg)
    env_partition: EnvPartitionCfg = Field(default_factory=EnvPartitionCfg)
    rollout: RolloutCfg = Field(default_factory=RolloutCfg)
    algo: AlgoCfg = Field(default_factory=AlgoCfg)
    federation: FederationCfg = Field(default_factory=FederationCfg)
    partition: PartitionCfg = Field(default_factory=PartitionCfg)
    run: RunCfg = Field(default_factory=RunCfg)
    faults: FaultsCfg = Field(default_factory=FaultsCfg)

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if isinstance(data, dict) and "verl" in data:
            raise ValueError(
                "the `verl` section is gone: the rollout engine is chosen for either backend now; "
                "write verl.rollout_engine as rollout.engine and verl.gpu_memory_utilization as "
                "rollout.gpu_memory_utilization (tensor_parallel_size was always 1)"
            )
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "Config":
        f = self.federation
        if f.clients_per_round > f.clients:
            raise ValueError(
                f"federation.clients_per_round={f.clients_per_round} exceeds federation.clients={f.clients}; "
                "lower clients-per-round or raise clients"
            )
        if f.min_clients_per_round is not None and f.min_clients_per_round > f.clients_per_round:
            raise ValueError(
                f"federation.min_clients_per_round={f.min_clients_per_round} exceeds "
                f"federation.clients_per_round={f.clients_per_round}; lower it or leave it unset (= all)"
            )
        self._check_dispatch()
        if f.only_clients:
            if len(f.only_clients) != f.clients_per_round or len(set(f.only_clients)) != len(f.only_clients):
                raise ValueError(
                    f"federation.only_clients={f.only_clients} must list clients_per_round="
                    f"{f.clients_per_round} distinct ids; fix one or the other"
                )
            if not all(0 <= c < f.clients for c in f.only_clients):
                raise ValueError(f"federation.only_clients={f.only_clients} holds ids outside [0, {f.clients})")
        self._check_aggregator()
        self._check_partition()
        tiny = self.model.tiny
        if self.model.path == "tiny" and tiny.sft_shortcut > 0 and self.env.name != "shop":
            # Fail closed: the habit is the shop's buy-now action; elsewhere it would silently do nothing.
            raise ValueError(
                f"model.tiny.sft_shortcut={tiny.sft_shortcut} demonstrates the shop's buy-now habit, "
                f"and env {self.env.name!r} has no such action; set model.tiny.sft_shortcut: 0"
            )
        self._check_model()
        self._check_lane_ranks()
        self._check_rollout_engine()
        self._check_compute()
        self._check_env_partition()
        algo = self.algo
        if not algo.spec.critic and algo.critic.path:
            raise ValueError(
                f"algo.critic.path={algo.critic.path!r} is set but algo.name={algo.name!r} "
                "has no critic; remove it or set algo.name=ppo"
            )
        longest = self.rollout.max_prompt_tokens + self.rollout.max_response_tokens
        if algo.micro_batch_tokens is not None and algo.micro_batch_tokens < longest:
            raise ValueError(
                f"algo.micro_batch_tokens={algo.micro_batch_tokens} cannot hold the longest training row, "
                f"rollout.max_prompt_tokens + max_response_tokens = {longest} tokens; raise it to at least "
                f"{longest} or leave it unset (micro_batch_size rows per pass)"
            )
        if algo.spec.advantage != "group_relative" and algo.filter_uniform_groups:
            raise ValueError(
                f"algo.filter_uniform_groups=true filters GRPO groups, and algo.name={algo.name!r} "
                "has none (its advantages come from a critic); remove it"
            )
        if algo.filter_uniform_groups and algo.rollouts_per_task < 2:
            raise ValueError(
                f"algo.filter_uniform_groups=true needs groups of two or more episodes to compare, and "
                f"algo.group_size={algo.rollouts_per_task}; raise algo.group_size or remove it"
            )
        self._check_update()
        if algo.name != "gigpo" and algo.gigpo != GigpoCfg():
            raise ValueError(
                f"algo.gigpo sets GiGPO's step-level keys, and algo.name={algo.name!r} does not use them; "
                "remove them or set algo.name=gigpo"
            )
        if algo.spec.advantage != "group_relative" and not algo.grpo_norm_by_std:
            raise ValueError(
                f"algo.grpo_norm_by_std=false changes GRPO's advantages, and algo.name={algo.name!r} "
                "does not use them; remove it"
            )
        return self

    def _check_update(self) -> None:
        """Fail closed on LoRA knobs without LoRA (both engines train adapters)."""
        f = self.federation
        if f.update != "lora" and f.lora != LoraCfg():
            raise ValueError(
                f"federation.lora sets adapter keys, and federation.update={f.update!r} trains no adapters; "
                "remove them or set federation.update=lora"
            )

    def _check_aggregator(self) -> None:
        """Fail closed on a robust aggregator the round's clients cannot feed."""
        f = self.federation
        least = self.min_clients()
        if f.aggregator == "trimmed_mean" and math.floor(f.trim_fraction * least) < 1:
            raise ValueError(
                f"federation.aggregator=trimmed_mean trims floor(trim_fraction x clients) per side, and with "
                f"federation.trim_fraction={f.trim_fraction} a round of {least} clients (clients_per_round="
                f"{f.clients_per_round}, min_clients_per_round={f.min_clients_per_round}) trims none: raise "
                f"trim_fraction to at least {1 / least:.3g} (below 0.5) or clients_per_round"
            )
        if f.aggregator == "median" and least < 3:
            raise ValueError(
                f"federation.aggregator=median over a round of {least} clients is their mean (clients_per_round="
                f"{f.clients_per_round}, min_clients_per_round={f.min_clients_per_round}): it needs 3 or more"
            )
        if f.drop_flagged and least < 3:
            raise ValueError(
                f"federation.drop_flagged drops what the peer rules flag, and they need 3 or more clients a round "
                f"(clients_per_round={f.clients_per_round}, min_clients_per_round={f.min_clients_per_round}): "
                "raise them or set drop_flagged=false"
            )
        if f.aggregator == "clipped" and least < 2:
            raise ValueError(
                "federation.aggregator=clipped bounds each update by a multiple of the round's median norm, "
                "which one client sets alone: it needs clients_per_round (and min_clients_per_round) >= 2"
            )

    def _check_lane_ranks(self) -> None:
        """Fail closed on a lane over several ranks (`run.lane_devices` > 1) that no engine here
        trains as one fit: a critic (GAE whitens over the whole batch), vLLM rollouts, verl's
        LoRA adapters (not run over ranks), or fewer task groups than ranks."""
        k, algo = self.run.lane_devices, self.algo
        if k == 1:
            return
        lane = f"run.lane_devices={k}"
        if self.backend == "verl" and self.federation.update == "lora":
            raise ValueError(
                f"{lane} with backend: verl and federation.update: lora: the verl engine spans a lane's ranks "
                "with full weights only; set backend: builtin, or run.lane_devices: 1"
            )
        if algo.spec.critic:
            raise ValueError(
                f"{lane} with algo.name={algo.name!r}: a lane over several ranks trains algorithms without a "
                "critic (grpo, gigpo: advantages per task group); set run.lane_devices: 1"
            )
        if self.rollout.engine != "hf":
            raise ValueError(f"{lane} rolls out with rollout.engine: hf on every rank; set rollout.engine: hf")
        if algo.tasks_per_step < k:
            raise ValueError(
                f"{lane}: each rank plays whole task groups, and algo.tasks_per_step={algo.tasks_per_step} "
                f"gives fewer than {k}; raise algo.tasks_per_step to at least {k} or lower run.lane_devices"
            )

    def _check_compute(self) -> None:
        """Fail closed on compute settings the training engine would not honour."""
        if self.backend != "verl":
            return
        if self.run.precision == "fp32" or self.run.precision == "autocast":
            raise ValueError(
                f"run.precision={self.run.precision} is a builtin-engine mode; verl computes in bf16 over "
                "fp32 masters on a GPU and in fp32 on the CPU by itself: set run.precision=auto"
            )
        if self.run.precision == "bf16" and self.run.device == "cpu":
            raise ValueError("run.precision=bf16 with backend=verl needs a GPU (verl computes in fp32 on the CPU)")

    def _check_rollout_engine(self) -> None:
        """Fail closed on a rollout engine that cannot run here, or a vLLM knob it would ignore."""
        r = self.rollout
        if r.engine == "vllm" and self.run.device == "cpu":
            raise ValueError("rollout.engine=vllm needs a GPU but run.device=cpu; use rollout.engine: hf")
        if r.engine != "vllm" and r.gpu_memory_utilization != RolloutCfg.model_fields["gpu_memory_utilization"].default:
            raise ValueError("rollout.gpu_memory_utilization only applies to rollout.engine=vllm; remove it")

    def _check_env_partition(self) -> None:
        """Fail closed on env_partition knobs its variant does not read or needs and lacks."""
        part, params = self.env_partition, self.env.params
        env, pool, keys = ENV_PARTITIONS[part.name]
        if "variant" in params:
            raise ValueError("env.params.variant is set per client from env_partition; remove it from env.params")
        if env not in (None, self.env.name):
            raise ValueError(
                f"env_partition.name={part.name} is for the {env} environment, not env.name={self.env.name!r}"
            )
        needs = {
            "num_variants": pool is not None,
            "env_div": part.name in ("catalog_split", "env_disjoint"),
            "keep_ratio": part.name == "catalog_split",
        }
        for knob, needed in needs.items():
            value = getattr(part, knob)
            if needed and value is None:
                raise ValueError(f"env_partition.name={part.name} needs env_partition.{knob}")
            if not needed and value is not None:
                raise ValueError(
                    f"env_partition.{knob}={value} is not read by env_partition.name={part.name}; remove it"
                )
        if part.name != "env_disjoint" and (part.fallback != "skip" or part.holdout):
            raise ValueError(
                f"env_partition.fallback / holdout only apply to env_disjoint, not {part.name}; remove them"
            )
        if pool is not None and part.num_variants is not None and part.num_variants > pool:
            raise ValueError(f"env_partition.num_variants={part.num_variants} exceeds the {part.name} pool ({pool})")
        clash = sorted(set(keys) & set(params))
        if clash:
            raise ValueError(
                f"env.params sets {clash}, which env_partition.name={part.name} sets per client; remove them"
            )
        if env == "shop" and "search_return_n" not in params:
            # invariant 14 / field log 2026-07-23: the pool size must be the recipe's explicit choice
            raise ValueError(
                f"env_partition.name={part.name} needs env.params.search_return_n set explicitly "
                "(the published environment-heterogeneity runs used 200)"
            )

    def _check_partition(self) -> None:
        """Coverage's size bounds against |X_i| (the pool-size checks run once the pool is known)."""
        p, low = self.partition.params, self.federation.tasks_per_client
        center, high = p.center, p.high  # filled from PARTITION_DEFAULTS when unset
        if self.partition.name == "coverage" and (
            center is None or high is None or not (low <= center <= high and high > low)
        ):
            raise ValueError(
                f"partition coverage needs federation.tasks_per_client={low} <= partition.params."
                f"center={p.center} <= partition.params.high={p.high}, with high > tasks_per_client"
            )

    def _check_model(self) -> None:
        """Fail closed on warm-start settings that would silently do nothing (docs/models.md)."""
        ws, m = self.model.warm_start, self.model
        if ws.episodes and m.path == "tiny":
            raise ValueError(
                "model.warm_start is set but model.path=tiny already warm-starts with model.tiny.sft_*; "
                "set model.warm_start.episodes: 0 or point model.path at a model directory"
            )
        if ws.episodes and ws.shortcut > 0 and self.env.name != "shop":
            raise ValueError(
                f"model.warm_start.shortcut={ws.shortcut} demonstrates the shop's buy-now habit, and env "
                f"{self.env.name!r} has no such action; set model.warm_start.shortcut: 0"
            )
        if m.reference == "backbone" and (self.algo.kl_coef == 0 or self.algo.ref_anchor == "round"):
            raise ValueError(
                "model.reference=backbone picks the KL reference, but there is none to pick (algo.kl_coef=0 "
                "or algo.ref_anchor=round); remove model.reference"
            )

    def weight_members(self) -> tuple[str, ...]:
        """The weights a round federates: the policy, plus the critic for PPO (invariant 7)."""
        return self.algo.spec.members

    def resolved_run_dir(self) -> Path:
        return Path(self.run.run_dir or f"runs/{self.run.name}").expanduser().resolve()

    def _check_dispatch(self) -> None:
        """Over-selection, the round deadline and injected faults (stragglers, poison) that can be
        armed, or an error."""
        f, faults = self.federation, self.faults
        if f.over_select and f.only_clients:
            raise ValueError(
                "federation.over_select draws more clients, federation.only_clients fixes them: drop one of the two"
            )
        if f.clients_per_round + f.over_select > f.clients:
            raise ValueError(
                f"federation.clients_per_round={f.clients_per_round} + federation.over_select={f.over_select} "
                f"exceeds federation.clients={f.clients}; lower over_select or raise clients"
            )
        if f.round_deadline_s is not None:
            if f.round_deadline_s >= f.client_timeout_s:
                raise ValueError(
                    f"federation.round_deadline_s={f.round_deadline_s:g} is not shorter than "
                    f"federation.client_timeout_s={f.client_timeout_s:g}: every client would time out first; "
                    "lower the deadline or raise the timeout"
                )
            if self.min_clients() >= f.clients_per_round + f.over_select:
                raise ValueError(
                    f"federation.round_deadline_s can drop no straggler: all {f.clients_per_round} clients of a "
                    "round must reply; set federation.min_clients_per_round below federation.clients_per_round, "
                    "or federation.over_select > 0"
                )
        decays = [self.algo.weight_decay] + ([self.algo.critic.weight_decay] if self.algo.spec.critic else [])
        if f.flag_shrink_z is not None and not all(decays):
            raise ValueError(
                "federation.flag_shrink_z reads the rows AdamW's weight decay shrinks, but a trained member has "
                "none (algo.weight_decay or algo.critic.weight_decay is 0): clean updates' rows need not shrink "
                'then (docs/architecture.md, "Telling a sign flip apart"); set a weight decay or drop the flag'
            )
        if f.update in COMPRESSED and faults.poison.kind != "none":
            raise ValueError(
                f"faults.poison rewrites a client's fp32 export, but federation.update={f.update!r} uploads a "
                "compressed update; poison with federation.update: full"
            )
        for key, ids in (("straggler_clients", faults.straggler_clients), ("poison.clients", faults.poison.clients)):
            if not all(0 <= c < f.clients for c in ids):
                raise ValueError(f"faults.{key}={ids} holds ids outside [0, {f.clients})")
        if any(r > f.rounds for r in faults.straggler_rounds):
            raise ValueError(
                f"faults.straggler_rounds={faults.straggler_rounds} names a round after federation.rounds={f.rounds}"
            )

    def min_clients(self) -> int:
        """How many of a round's sampled clients must reply (federation.min_clients_per_round)."""
        f = self.federation
        return f.clients_per_round if f.min_clients_per_round is None else f.min_clients_per_round


# Flat Flower run-config aliases for the common knobs -> recipe paths. Every recipe key is also
# reachable under its own dotted name (`run_config_keys()`).
RUN_CONFIG_ALIASES: dict[str, str] = {
    "rounds": "federation.rounds",
    "seed": "run.seed",
    "run-dir": "run.run_dir",
    "clients": "federation.clients",
    "clients-per-round": "federation.clients_per_round",
    "local-epochs": "federation.local_epochs",
    "eval-every": "federation.eval_every",
    "strategy": "federation.strategy",
    "proximal-mu": "federation.proximal_mu",
    "server-lr": "federation.server_lr",
    "device": "run.device",
}


def _scalar_types(annotation: Any) -> set[Any]:
    """The plain types an annotation admits (`int | None` -> {int, NoneType}; Literal -> its values' types)."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return set().union(*(_scalar_types(a) for a in typing.get_args(annotation)))
    if origin is Literal:
        return {type(v) for v in typing.get_args(annotation)}
    return {origin or annotation}


def _leaf_fields(model: type[BaseModel], prefix: str = "") -> dict[str, FieldInfo]:
    """Dotted recipe key -> its field, for every leaf (a sub-section recurses, anything else is a leaf)."""
    out: dict[str, FieldInfo] = {}
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out.update(_leaf_fields(ann, f"{prefix}{name}."))
        else:
            out[f"{prefix}{name}"] = field
    return out


def run_config_keys() -> dict[str, Any]:
    """Every dotted recipe key a `--run-config` may set, with its annotation (`extends` is not
    one: a run config is already one recipe, nothing to extend)."""
    return {k: f.annotation for k, f in _leaf_fields(Config).items() if k != "extends"}


def _is_node_local(field: FieldInfo) -> bool:
    return isinstance(field.json_schema_extra, dict) and bool(field.json_schema_extra.get("node_local"))


def node_local_keys() -> tuple[str, ...]:
    """The keys declared `NODE_LOCAL`: resolved on each machine, never part of the recipe digest."""
    return tuple(k for k, f in _leaf_fields(Config).items() if _is_node_local(f))


def _recipe_values(cfg: Config) -> dict[str, Any]:
    """Dotted key -> resolved value of every run-config key that is not node-local."""
    data, local = cfg.model_dump(mode="json"), set(node_local_keys())
    out: dict[str, Any] = {}
    for key in run_config_keys():
        if key not in local:
            value = data
            for part in key.split("."):
                value = value[part]
            out[key] = value
    return out


def _sha256_json(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def recipe_sha256(cfg: Config) -> str:
    """sha256 of the resolved recipe without its node-local keys: the server sends it with every
    message and each node checks its own resolution against it, so server and clients provably
    run the same recipe."""
    return _sha256_json(_recipe_values(cfg))


def recipe_leaves(cfg: Config) -> dict[str, str]:
    """Dotted key -> a 16-hex digest of its resolved value (node-local keys left out): sent with
    every call beside `recipe_sha256`, so a node that resolves another recipe names the keys."""
    return {k: _sha256_json(v)[:16] for k, v in _recipe_values(cfg).items()}


def recipe_mismatch(cfg: Config, server: dict[str, str]) -> str:
    """Which keys of this machine's recipe differ from the server's per-key digests, with this
    machine's value and both digests ('' when none differs)."""
    if not server:
        return "the call names no per-key digests (a server of another app version)"
    values, own = _recipe_values(cfg), recipe_leaves(cfg)
    keys = sorted(k for k in own.keys() | server.keys() if own.get(k) != server.get(k))

    def here(key: str) -> str:
        if key not in values:
            return "absent here"
        text = json.dumps(values[key])
        return f"here {text if len(text) <= 80 else text[:77] + '...'} ({own[key]})"

    shown = [f"{k}: {here(k)} vs server {server.get(k, 'absent')}" for k in keys[:8]]
    more = f"; and {len(keys) - 8} more keys" if len(keys) > 8 else ""
    hint = (
        "; model.path: a plain model directory must sit at the same absolute path on every node "
        "(or use cache:<name>, docs/deployment.md)"
        if "model.path" in keys
        else ""
    )
    return "; ".join(shown) + more + hint


def _run_config_value(key: str, value: Any, annotation: Any) -> Any:
    """A run-config value for `key`: a string given for a key that is not a string (a list, a
    mapping) is read as YAML, e.g. `federation.only_clients="[21]"`, `env.params="{val_size: 32}"`."""
    if isinstance(value, str) and str not in _scalar_types(annotation):
        try:
            return yaml.safe_load(value)
        except yaml.YAMLError as e:
            raise ConfigError(f"run-config {key}={value!r}: not valid YAML for a {annotation} value ({e})") from None
    return value


_RESOLVER = re.compile(r"\$\{\s*[\w.\-]+\s*:")


def _refuse_resolvers(node: Any, where: str) -> None:
    """Plain `${a.b}` interpolations are fine; resolvers (`${oc.env:HOME}`, ...) are refused: they
    would read the environment of whichever process loads the recipe into the saved config."""
    if isinstance(node, dict):
        for v in node.values():
            _refuse_resolvers(v, where)
    elif isinstance(node, list):
        for v in node:
            _refuse_resolvers(v, where)
    elif isinstance(node, str) and _RESOLVER.search(node):
        raise ConfigError(
            f"{where}: {node!r} uses an OmegaConf resolver; recipes may only interpolate other keys "
            "(`${section.key}`): write the value itself"
        )


def recipe_path(recipe: str) -> Path:
    """A recipe name in configs/ or a path to a YAML file."""
    p = Path(recipe).expanduser()
    if p.suffix in (".yaml", ".yml") and p.exists():
        return p
    q = CONFIGS_DIR / f"{recipe}.yaml"
    if q.exists():
        return q
    known = ", ".join(sorted(x.stem for x in CONFIGS_DIR.glob("*.yaml")))
    raise ConfigError(f"recipe {recipe!r} not found: pass a name from configs/ ({known}) or a path to a .yaml file")


def _format_errors(err: ValidationError) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(x) for x in e["loc"])
        if e["type"] == "extra_forbidden":
            lines.append(
                f"  {key}: unknown key; remove it or check the spelling (keys are documented in docs/config.md)"
            )
        elif not key:  # a whole-config rule: its message names the keys (the input is the whole config)
            lines.append(f"  {e['msg'].removeprefix('Value error, ')}")
        else:
            lines.append(f"  {key}: {e['msg'].removeprefix('Value error, ')} (got {e.get('input')!r})")
    return "invalid config:\n" + "\n".join(lines)


def _load_recipe(path: Path, chain: tuple[Path, ...] = ()) -> Any:
    """A recipe file merged over the recipe it `extends` (recursively)."""
    path = path.resolve()
    if path in chain:
        raise ConfigError("recipes extend each other in a cycle: " + " -> ".join(p.name for p in (*chain, path)))
    try:
        node = OmegaConf.load(path)
    except (yaml.YAMLError, OmegaConfBaseException, UnicodeDecodeError) as e:
        raise ConfigError(f"recipe {path} is not valid YAML: {str(e).strip()}") from None
    if not isinstance(node, DictConfig) or not node:
        raise ConfigError(
            f"recipe {path} is empty or not a mapping of config sections; see configs/tiny-shop-grpo.yaml"
        )
    _refuse_resolvers(OmegaConf.to_container(node, resolve=False), str(path))
    parent = node.get("extends")
    if not parent:
        return node
    rel = path.parent / parent
    base = rel if Path(parent).suffix in (".yaml", ".yml") and rel.exists() else recipe_path(str(parent))
    return OmegaConf.merge(_load_recipe(base, (*chain, path)), node)


def load_config(
    recipe: str = DEFAULT_RECIPE, overrides: dict[str, Any] | None = None, dotlist: list[str] | None = None
) -> Config:
    """Load a recipe (and what it `extends`), apply Flower run-config overrides and `a.b=c`
    dotlist overrides, validate."""
    base = _load_recipe(recipe_path(recipe))
    extra = list(dotlist or [])
    _refuse_resolvers(extra, "a dotlist override")
    try:
        merged = OmegaConf.merge(base, OmegaConf.from_dotlist(extra))
        data = OmegaConf.to_container(merged, resolve=True) or {}
        if not isinstance(data, dict):
            raise ConfigError(f"recipe {recipe!r} is not a mapping of config sections")
    except OmegaConfBaseException as e:
        raise ConfigError(f"recipe {recipe!r}: {str(e).strip()}") from None
    known = run_config_keys()
    for key, value in (overrides or {}).items():
        if key == "recipe" or (isinstance(value, str) and value == ""):
            continue  # an empty string (pyproject's default) keeps the recipe's value
        path = RUN_CONFIG_ALIASES.get(key, key)
        if path not in known:
            near = difflib.get_close_matches(key, [*known, *RUN_CONFIG_ALIASES], n=3)
            raise ConfigError(
                f"run-config key {key!r} is not a recipe key"
                + (f"; did you mean {near}?" if near else "")
                + " (every key is listed in docs/config.md)"
            )
        value = _run_config_value(key, value, known[path])
        node: dict[Any, Any] = data
        *parents, leaf = path.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        if isinstance(value, dict) and isinstance(node.get(leaf), dict):
            value = {**node[leaf], **value}  # a mapping (env.params) updates the recipe's
        node[leaf] = value
    try:
        return Config.model_validate(data)
    except ValidationError as err:
        raise ConfigError(_format_errors(err)) from None


def save_config(cfg: Config, path: Path) -> None:
    """Write the resolved config as YAML (what the run actually used). It is complete on its own,
    so `extends` is written empty: the file loads as a recipe from anywhere."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(OmegaConf.to_yaml(OmegaConf.create(cfg.model_dump(mode="json") | {"extends": ""})))


def run_config_toml() -> str:
    """pyproject's `[tool.flwr.app.config]`: the recipe, the flat aliases and every recipe key
    (nested tables, which Flower flattens to the dotted keys), each "" = keep the recipe's value."""
    lines = [
        "[tool.flwr.app.config]",
        "# Generated by `python -m fl_app.config --run-config-keys` (tests check it is current).",
        "# \"\" keeps the recipe's value; `--run-config 'algo.lr=2e-4 rounds=3'` overrides it.",
        f'recipe = "{DEFAULT_RECIPE}"',
    ]
    lines += [f'{alias} = ""' for alias in RUN_CONFIG_ALIASES]
    tables: dict[str, list[str]] = {}
    for key in run_config_keys():
        section, _, leaf = key.rpartition(".")
        tables.setdefault(section, []).append(f'{leaf} = ""')
    for section, entries in tables.items():
        lines += ([""] + [f"[tool.flwr.app.config.{section}]"] if section else []) + entries
    return "\n".join(lines) + "\n"


def _describe(model: type[BaseModel]) -> list[str]:
    rows = []
    for key, field in _leaf_fields(model).items():
        default = _NODE_DEFAULTS.get(field.default_factory) or field.get_default(call_default_factory=True)
        kind = re.sub(r"typing\.|<class '([^']+)'>", r"\1", str(field.annotation)).replace("|", "or")
        text = (field.description or "") + (_NODE_LOCAL_DOC if _is_node_local(field) else "")
        rows.append(f"| `{key}` | {kind} | `{default!r}` | {text.replace('|', '/')} |")
    return rows


_NODE_LOCAL_DOC = " **Node-local**: resolved on each machine, not part of the recipe digest."


def config_doc() -> str:
    """docs/config.md: every recipe key with its type, default and description (from this module)."""
    aliases = ", ".join(f"`{a}` = `{p}`" for a, p in RUN_CONFIG_ALIASES.items())
    return (
        "# Configuration keys\n\n"
        "Generated from `fl_app/config.py` by `python -m fl_app.config --doc > docs/config.md` (a test "
        "checks it is current). A recipe (`configs/*.yaml`) sets these keys; every key can also be set "
        "from Flower as a dotted run-config key, e.g. `flwr run . --run-config 'algo.lr=2e-4 "
        'env.params="{val_size: 32}"\'` (strings need TOML quotes; a string given for a list or mapping '
        "key is read as YAML; a mapping updates the recipe's). Flat aliases: " + aliases + ".\n\n"
        "| key | type | default | description |\n| --- | --- | --- | --- |\n" + "\n".join(_describe(Config)) + "\n"
    )


def cli_config(recipe: str, overrides: Sequence[str]) -> Config | None:
    """The recipe a command line names with its `a.b=c` overrides, or None after printing why it
    is bad (the command then exits 2, as for any usage error)."""
    try:
        return load_config(recipe, dotlist=list(overrides))
    except ConfigError as e:
        print(e, file=sys.stderr)
        return None


def main(argv: list[str] | None = None) -> int:
    import argparse

    from fl_app.work import format_work

    ap = argparse.ArgumentParser(
        description="Validate a recipe, print what it resolves to and the work it implies "
        "per round (episodes, optimizer steps, tokens)."
    )
    ap.add_argument("--check", default=DEFAULT_RECIPE, help="recipe name or YAML path")
    ap.add_argument("--work-only", action="store_true", help="print only the work report, not the resolved YAML")
    ap.add_argument("--doc", action="store_true", help="print docs/config.md (every key, documented)")
    ap.add_argument(
        "--run-config-keys",
        action="store_true",
        help="print pyproject's [tool.flwr.app.config] section (every key as a run-config key)",
    )
    ap.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. federation.rounds=5")
    args = ap.parse_args(argv)
    if args.doc or args.run_config_keys:
        print(config_doc() if args.doc else run_config_toml(), end="")
        return 0
    if (cfg := cli_config(args.check, args.overrides)) is None:
        return 2
    if not args.work_only:
        print(OmegaConf.to_yaml(OmegaConf.create(cfg.model_dump(mode="json"))))
    print(format_work(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
