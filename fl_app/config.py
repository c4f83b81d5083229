"""Recipe YAML + run-config overrides -> one validated, typed config.

Every config key is documented here, in the field descriptions; `docs/config.md` is generated
from this module (`python -m fl_app.config --doc`). Unknown keys and bad values fail with a
message that names the key and the fix, before any process or service starts.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Literal

from omegaconf import OmegaConf
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

CONFIGS_DIR = Path(__file__).resolve().parent.parent / "configs"
DEFAULT_RECIPE = "tiny-shop-grpo"


class ConfigError(ValueError):
    """A recipe or override is invalid; the message names the key and the fix."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def default_model_cache() -> str:
    return str(Path(os.environ.get("FEDAGENT_CACHE_DIR", "~/.cache/fedagent-flower")) / "models")


class TinyModelCfg(_Strict):
    """The locally built default model (used when `model.path` is `tiny`)."""

    hidden_size: int = Field(96, gt=0, description="Width of the tiny Qwen2 model.")
    layers: int = Field(2, gt=0, description="Decoder layers of the tiny model.")
    heads: int = Field(4, gt=0, description="Attention heads (KV heads = heads / 2).")
    vocab_size: int = Field(4096, ge=300, description="BPE vocabulary trained on env text.")
    sft_episodes: int = Field(768, ge=0, description="Expert episodes used for the SFT warm start.")
    sft_epochs: int = Field(3, ge=0, description="Passes over the SFT demonstrations.")
    sft_noise: float = Field(0.1, ge=0, le=1, description="Fraction of demonstration actions replaced by a random valid action, so the warm start is imperfect.")
    sft_shortcut: float = Field(0.5, ge=0, le=1, description="Fraction of SFT episodes that demonstrate a bad habit (buying without choosing the goal's options), a defect RL can fix from reward.")
    seed: int = Field(0, description="Seed of tokenizer training, init and SFT (the build is a pure function of it).")
    cache_dir: str = Field(default_factory=default_model_cache, description="Where built tiny models are cached (keyed by a hash of this section and the env); default `$FEDAGENT_CACHE_DIR/models`, else ~/.cache/fedagent-flower/models.")


class WarmStartCfg(_Strict):
    """SFT warm start of the model at `model.path` on the env's expert (client_app/warm_start.py,
    docs/models.md): demonstrations rendered with the RL prompts, fine-tuned, cached by content hash."""

    episodes: int = Field(0, ge=0, description="Expert episodes demonstrated (training tasks only); 0 = no warm start, round 0 starts from `model.path` as is.")
    epochs: int = Field(2, gt=0, description="Passes over the demonstrated (prompt, reply) rows.")
    lr: float = Field(2e-5, gt=0, description="AdamW peak learning rate (5% linear warmup, then linear decay to 0), loss on reply tokens only.")
    batch_size: int = Field(8, gt=0, description="Demonstrated rows per optimizer step (batches of similar length, seeded order).")
    noise: float = Field(0.1, ge=0, le=1, description="Fraction of demonstrated actions replaced by a random valid action (and played), so the imitation is imperfect and the expert's recoveries are shown.")
    shortcut: float = Field(0.0, ge=0, le=1, description="Fraction of episodes that demonstrate the shop's buy-now habit (buying without choosing the goal's options), a defect RL can fix from reward; shop only.")
    seed: int = Field(0, description="Seed of the demonstrations and the SFT data order (the warmed weights are a pure function of it on CPU).")
    cache_dir: str = Field(default_factory=default_model_cache, description="Where warmed models are cached, keyed by a hash of the model files, the env, the prompt-shaping rollout keys and this section (not `cache_dir`); default `$FEDAGENT_CACHE_DIR/models`, else ~/.cache/fedagent-flower/models.")


class ModelCfg(_Strict):
    path: str = Field("tiny", description="`tiny` builds the local default; otherwise a local Hugging Face model directory (e.g. Qwen2.5-1.5B-Instruct, or a GGUF import: `python -m client_app.models import-gguf`, docs/models.md). It gives the architecture, the tokenizer and the KL reference model, also when `init_from` is set.")
    init_from: str = Field("", description="Warm start: a weights dir of an earlier run (e.g. `runs/x/rounds/round-0007/actor`) loaded over `path` before round 0. For ppo its sibling `critic` dir is picked up as the critic (see `algo.critic.path`). It must be readable by the node that builds round 0.")
    warm_start: WarmStartCfg = WarmStartCfg()
    reference: Literal["warmed", "backbone"] = Field("warmed", description="KL reference under `algo.ref_anchor: base` when `warm_start` is on: `warmed` = the warm-started model round 0 starts from (default: the policy RL starts from, as verl-agent's reference is its initial actor; a zero-shot backbone that never emits a valid action would pull the policy back to invalid actions), `backbone` = `model.path` before the warm start. Without a warm start both are `model.path`.")
    tiny: TinyModelCfg = TinyModelCfg()


class EnvCfg(_Strict):
    name: Literal["shop", "alfworld"] = Field("shop", description="Environment engine (see envs/registry.py): `shop` (WebShop-compatible, docs/shop.md) or `alfworld` (ALFWorld on the real engine, docs/alfworld.md).")
    params: dict[str, Any] = Field(default_factory=dict, description="Engine keyword arguments, checked against the engine when it is built. shop: num_products, num_goals, val_size, search_return_n, seed, data_dir, human_goals, ranking, ... (envs/shop/env.py). alfworld: num_games (default 120 generated), val_size (24), seed (0), data_dir (None: $ALFWORLD_DATA if set, else generated games; `generated`: generated regardless), cache_dir, task_types (subset of the six), val_split (valid_seen | valid_unseen), max_steps, manifest_dir (docs/alfworld.md).")
    pool_size: int = Field(16, gt=0, description="Pre-warmed env instances per env service.")
    max_turns: int = Field(15, gt=0, description="Step budget per episode (WebShop 15, ALFWorld 50).")


class RolloutCfg(_Strict):
    mode: Literal["windowed", "concat"] = Field("windowed", description="`windowed` (the published runs): one prompt and one training row per turn, the task + the last `history_length` (observation, action) turns. `concat`: one growing token sequence and one training row per episode (prompt + actions + observations, observation tokens masked out of the loss); the text between turns comes from diffs of rendered chat-template strings.")
    history_length: int = Field(2, ge=0, description="Turns of history in a windowed prompt (unused in concat mode, where the whole episode is the context).")
    max_prompt_tokens: int = Field(1024, gt=0, description="Context budget per generation. windowed: longer prompts lose their oldest history turns, then their head, identically for generation and training. concat: the growing sequence must fit; an episode that would outgrow it ends there (not done).")
    max_response_tokens: int = Field(32, gt=0, description="Generated tokens per turn.")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature for training rollouts.")
    val_temperature: float = Field(0.4, ge=0, description="Sampling temperature for validation (0 = greedy).")
    invalid_action_penalty: float = Field(0.1, ge=0, description="Subtracted from a training episode's reward per invalid action; never applied to validation.")


class CriticCfg(_Strict):
    """The PPO value model: the policy's architecture with a one-output value head (`score`)."""

    path: str = Field("", description="Where the starting critic comes from. Empty: the `critic` dir beside `model.init_from` when that is a round of an earlier run; without `model.init_from`, a fresh value head on the backbone (logged); with `model.init_from` but no sibling critic, an error, so a warm-started policy never silently gets a random value baseline. `fresh`: a fresh value head on the starting policy's backbone, deliberately. Otherwise a weights dir holding a value head (e.g. `runs/x/rounds/round-0007/critic`). Resume always restores the run's own critic. summary.json records the choice.")
    lr: float = Field(1e-5, gt=0, description="Critic learning rate (constant, AdamW).")
    weight_decay: float = Field(0.01, ge=0, description="Critic AdamW weight decay.")
    value_clip: float = Field(0.5, gt=0, description="Value clipping: a prediction may move at most this far from the rollout-time value before its loss is clipped (verl cliprange_value).")
    loss_coef: float = Field(1.0, gt=0, description="Critic loss = loss_coef x the token mean, over the WHOLE mini-batch, of max((V - R)^2, (clip(V) - R)^2). Normalised by the mini-batch token count, so it does not depend on micro_batch_size (field log 2026-07-22). 1.0 is the FedAgent fork's coefficient (the executed runs); 0.5 is verl's convention.")
    mini_batch_size: int | None = Field(None, gt=0, description="Rows per critic optimizer step; unset = algo.mini_batch_size (the published critic inherits it).")
    micro_batch_size: int | None = Field(None, gt=0, description="Rows per critic forward/backward (gradient accumulation; does not change the loss); unset = algo.micro_batch_size.")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip of the critic.")


class AlgoCfg(_Strict):
    name: Literal["grpo", "ppo"] = Field("grpo", description="`grpo`: group-relative outcome advantages, no critic. `ppo`: GAE advantages from a critic that is federated beside the policy (see `critic`).")
    tasks_per_step: int = Field(8, gt=0, description="Distinct tasks per RL iteration (train_batch_size).")
    group_size: int | None = Field(None, gt=0, description="Rollouts per task (n). Unset: 8 for grpo (one GRPO group per task), 1 for ppo (ungrouped, as published); PPO with n > 1 multiplies the rollout volume by n.")
    lr: float = Field(1e-6, gt=0, description="Actor learning rate (constant, AdamW).")
    weight_decay: float = Field(0.01, ge=0, description="AdamW weight decay.")
    clip_ratio: float = Field(0.2, gt=0, description="PPO clip epsilon (low = high).")
    clip_ratio_c: float = Field(3.0, gt=1, description="Dual-clip constant c.")
    entropy_coeff: float = Field(0.001, ge=0, description="Entropy bonus coefficient.")
    kl_coef: float = Field(0.01, ge=0, description="KL loss coefficient against the reference model (0 disables the reference).")
    kl_type: Literal["k1", "k3", "low_var_kl"] = Field("low_var_kl", description="KL estimator.")
    ref_anchor: Literal["base", "round"] = Field("base", description="Reference model: `base` = the original backbone (published runs), `round` = the round-start global weights.")
    mini_batch_size: int = Field(64, gt=0, description="Rows per optimizer step.")
    micro_batch_size: int = Field(16, gt=0, description="Rows per forward/backward pass (gradient accumulation; does not change the loss).")
    grad_clip: float = Field(1.0, gt=0, description="Global gradient-norm clip.")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount (ppo), per generated token; observation tokens are skipped.")
    lam: float = Field(1.0, ge=0, le=1, description="GAE lambda (ppo).")
    critic: CriticCfg = CriticCfg()

    @model_validator(mode="after")
    def _inherited(self) -> "AlgoCfg":
        """Fill the unset keys from the algorithm and the actor's batch sizes."""
        if self.group_size is None:
            self.group_size = 8 if self.name == "grpo" else 1
        if self.critic.mini_batch_size is None:
            self.critic.mini_batch_size = self.mini_batch_size
        if self.critic.micro_batch_size is None:
            self.critic.micro_batch_size = self.micro_batch_size
        return self


class FederationCfg(_Strict):
    clients: int = Field(100, gt=0, description="N: clients in the federation (virtual clients in simulation).")
    clients_per_round: int = Field(2, gt=0, description="M: clients sampled per round, a pure function of (seed, round).")
    rounds: int = Field(70, gt=0, description="T: federated rounds.")
    local_epochs: int = Field(3, gt=0, description="E: RL iterations per sampled client per round (one rollout batch + one update each).")
    tasks_per_client: int = Field(100, gt=0, description="|X_i|: training tasks in each client's shard.")
    strategy: Literal["fedavg", "fedprox"] = Field("fedavg", description="Aggregation strategy.")
    proximal_mu: float = Field(0.01, ge=0, description="FedProx mu (only used by `fedprox`; applies to the policy only).")
    eval_every: int = Field(1, ge=0, description="Validate the global model every k rounds (and at round 0); 0 = only round 0 and the last round.")
    val_tasks: int = Field(64, gt=0, description="Size of the fixed validation set (the env's first tasks).")
    only_clients: list[int] = Field(default_factory=list, description="Train exactly these client ids every round instead of sampling (the local-only baseline: one client, one round of T*E epochs). Its length must equal `clients_per_round`; empty = sample.")


class RunCfg(_Strict):
    name: str = Field("tiny-shop-grpo", description="Run name; the run dir is `<run_dir>` if set, else `runs/<name>`.")
    run_dir: str = Field("", description="Run directory (resume happens when it already holds rounds).")
    seed: int = Field(0, description="Master seed: client sampling, task draws, rollouts.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Trainer device: `auto` = CUDA when visible, else CPU.")
    inline_max_mb: float = Field(64.0, ge=0, description="Models up to this size travel inline in Flower messages; larger ones through the weight store.")
    shard_max_mb: float = Field(512.0, gt=0, description="Upper bound on one safetensors shard.")
    service_idle_timeout_s: float = Field(900.0, gt=0, description="A trainer service with no request for this long exits.")


class VerlCfg(_Strict):
    """Settings only the verl backend reads (`backend: verl`; docs/verl.md). Setting any of them
    with another backend is an error. Every other verl setting is derived from the recipe keys
    (client_app/trainer/verl_config.py holds the mapping); a recipe key verl cannot honour fails
    the config instead of silently training something else."""

    rollout_engine: Literal["hf", "vllm"] = Field("hf", description="Who generates the rollouts. `hf`: batched Hugging Face `generate` on the verl engine's own live module (CPU and small GPUs; the same rollout loop as the builtin backend). `vllm`: vLLM 0.24 inside the lane service, woken with the actor's weights before each rollout and asleep otherwise (GPU only, needs vllm installed: docs/offline-gpu.md).")
    gpu_memory_utilization: float = Field(0.5, gt=0, lt=1, description="Fraction of GPU memory vLLM may take (verl `actor_rollout_ref.rollout.gpu_memory_utilization`); `rollout_engine: vllm` only.")
    tensor_parallel_size: int = Field(1, gt=0, description="vLLM tensor parallel size (verl `actor_rollout_ref.rollout.tensor_model_parallel_size`); `rollout_engine: vllm` only.")


class Config(_Strict):
    extends: str = Field("", description="The recipe this one starts from: a name in configs/ or a .yaml path relative to this file. Its keys are merged under this file's (lists are replaced, not appended); chains are allowed, cycles are an error. A saved (resolved) config has it empty.")
    backend: Literal["builtin", "verl"] = Field("builtin", description="Trainer backend: `builtin` (torch + transformers, CPU or one GPU) or `verl` (verl 0.9.1's FSDP2 training engine behind the same trainer interface; `pip install -e .[verl]`; docs/verl.md). verl refuses recipe keys it cannot honour (see `verl`).")
    verl: VerlCfg = VerlCfg()
    model: ModelCfg = ModelCfg()
    env: EnvCfg = EnvCfg()
    rollout: RolloutCfg = RolloutCfg()
    algo: AlgoCfg = AlgoCfg()
    federation: FederationCfg = FederationCfg()
    run: RunCfg = RunCfg()

    @model_validator(mode="after")
    def _consistent(self) -> "Config":
        f = self.federation
        if f.clients_per_round > f.clients:
            raise ValueError(
                f"federation.clients_per_round={f.clients_per_round} exceeds federation.clients={f.clients}; "
                "lower clients-per-round or raise clients"
            )
        if f.only_clients:
            if len(f.only_clients) != f.clients_per_round or len(set(f.only_clients)) != len(f.only_clients):
                raise ValueError(f"federation.only_clients={f.only_clients} must list clients_per_round="
                                 f"{f.clients_per_round} distinct ids; fix one or the other")
            if not all(0 <= c < f.clients for c in f.only_clients):
                raise ValueError(f"federation.only_clients={f.only_clients} holds ids outside [0, {f.clients})")
        tiny = self.model.tiny
        if self.model.path == "tiny" and tiny.sft_shortcut > 0 and self.env.name != "shop":
            # Fail closed: the habit is the shop's buy-now action; elsewhere it would silently do nothing.
            raise ValueError(f"model.tiny.sft_shortcut={tiny.sft_shortcut} demonstrates the shop's buy-now habit, "
                             f"and env {self.env.name!r} has no such action; set model.tiny.sft_shortcut: 0")
        self._check_model()
        self._check_backend()
        if self.algo.name != "ppo" and self.algo.critic.path:
            raise ValueError(f"algo.critic.path={self.algo.critic.path!r} is set but algo.name={self.algo.name!r} "
                             "has no critic; remove it or set algo.name=ppo")
        return self

    def _check_model(self) -> None:
        """Fail closed on warm-start settings that would silently do nothing (docs/models.md)."""
        ws, m = self.model.warm_start, self.model
        if ws.episodes and m.path == "tiny":
            raise ValueError("model.warm_start is set but model.path=tiny already warm-starts with model.tiny.sft_*; "
                             "set model.warm_start.episodes: 0 or point model.path at a model directory")
        if ws.episodes and ws.shortcut > 0 and self.env.name != "shop":
            raise ValueError(f"model.warm_start.shortcut={ws.shortcut} demonstrates the shop's buy-now habit, and env "
                             f"{self.env.name!r} has no such action; set model.warm_start.shortcut: 0")
        if m.reference == "backbone" and (self.algo.kl_coef == 0 or self.algo.ref_anchor == "round"):
            raise ValueError("model.reference=backbone picks the KL reference, but there is none to pick (algo.kl_coef=0 "
                             "or algo.ref_anchor=round); remove model.reference")

    def _check_backend(self) -> None:
        """Fail closed on what the chosen backend cannot honour (docs/verl.md)."""
        if self.backend != "verl":
            changed = [k for k, v in self.verl.model_dump().items() if v != VerlCfg.model_fields[k].default]
            if changed:   # compared with the defaults: a saved (complete) config still loads
                raise ValueError(f"verl.{changed[0]} is set but backend={self.backend!r}; "
                                 "remove the `verl` section or set backend: verl")
            return
        refused = []
        vllm_only = ("gpu_memory_utilization", "tensor_parallel_size")
        if self.verl.rollout_engine != "vllm" and any(getattr(self.verl, k) != VerlCfg.model_fields[k].default
                                                       for k in vllm_only):
            refused.append("verl.gpu_memory_utilization / verl.tensor_parallel_size only apply to "
                           "verl.rollout_engine=vllm; remove them")
        if self.verl.tensor_parallel_size != 1:
            refused.append(f"verl.tensor_parallel_size={self.verl.tensor_parallel_size}: a lane service is one rank "
                           "on one GPU (multi-rank lanes are not built, docs/verl.md); use tensor_parallel_size: 1")
        if self.verl.rollout_engine == "vllm" and self.run.device == "cpu":
            refused.append("verl.rollout_engine=vllm needs a GPU but run.device=cpu; use rollout_engine: hf")
        if refused:
            raise ValueError("backend=verl cannot honour: " + "; ".join(refused))

    def weight_members(self) -> tuple[str, ...]:
        """The weights a round federates: the policy, plus the critic for PPO (invariant 7)."""
        return ("actor", "critic") if self.algo.name == "ppo" else ("actor",)

    def resolved_run_dir(self) -> Path:
        return Path(self.run.run_dir or f"runs/{self.run.name}").expanduser().resolve()


# Flower run-config keys (kebab-case, flat) -> recipe paths.
RUN_CONFIG_KEYS: dict[str, str] = {
    "rounds": "federation.rounds",
    "seed": "run.seed",
    "run-dir": "run.run_dir",
    "clients": "federation.clients",
    "clients-per-round": "federation.clients_per_round",
    "local-epochs": "federation.local_epochs",
    "eval-every": "federation.eval_every",
    "strategy": "federation.strategy",
    "proximal-mu": "federation.proximal_mu",
    "model": "model.path",
    "device": "run.device",
    "backend": "backend",
}


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
        key = ".".join(str(x) for x in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden":
            lines.append(f"  {key}: unknown key; remove it or check the spelling (keys are documented in fl_app/config.py)")
        else:
            lines.append(f"  {key}: {e['msg']} (got {e.get('input')!r})")
    return "invalid config:\n" + "\n".join(lines)


def _load_recipe(path: Path, chain: tuple[Path, ...] = ()) -> Any:
    """A recipe file merged over the recipe it `extends` (recursively)."""
    path = path.resolve()
    if path in chain:
        raise ConfigError("recipes extend each other in a cycle: " + " -> ".join(p.name for p in (*chain, path)))
    node = OmegaConf.load(path)
    parent = node.get("extends") if hasattr(node, "get") else None
    if not parent:
        return node
    rel = path.parent / parent
    base = rel if Path(parent).suffix in (".yaml", ".yml") and rel.exists() else recipe_path(str(parent))
    return OmegaConf.merge(_load_recipe(base, (*chain, path)), node)


def load_config(recipe: str = DEFAULT_RECIPE, overrides: dict[str, Any] | None = None,
                dotlist: list[str] | None = None) -> Config:
    """Load a recipe (and what it `extends`), apply Flower run-config overrides and `a.b=c`
    dotlist overrides, validate."""
    base = _load_recipe(recipe_path(recipe))
    merged = OmegaConf.merge(base, OmegaConf.from_dotlist(list(dotlist or [])))
    data = OmegaConf.to_container(merged, resolve=True) or {}
    for key, value in (overrides or {}).items():
        if key == "recipe":
            continue
        if key not in RUN_CONFIG_KEYS:
            raise ConfigError(f"run-config key {key!r} is not known; known keys: {', '.join(sorted(RUN_CONFIG_KEYS))}")
        if isinstance(value, str) and value == "":
            continue  # empty string in pyproject = "keep the recipe's value"
        node = data
        *parents, leaf = RUN_CONFIG_KEYS[key].split(".")
        for part in parents:
            node = node.setdefault(part, {})
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


def main(argv: list[str] | None = None) -> int:
    import argparse

    from fl_app.work import format_work

    ap = argparse.ArgumentParser(description="Validate a recipe, print what it resolves to and the work it implies "
                                             "per round (episodes, optimizer steps, tokens).")
    ap.add_argument("--check", default=DEFAULT_RECIPE, help="recipe name or YAML path")
    ap.add_argument("--work-only", action="store_true", help="print only the work report, not the resolved YAML")
    ap.add_argument("overrides", nargs="*", help="dotlist overrides, e.g. federation.rounds=5")
    args = ap.parse_args(argv)
    try:
        cfg = load_config(args.check, dotlist=args.overrides)
    except ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    if not args.work_only:
        print(OmegaConf.to_yaml(OmegaConf.create(cfg.model_dump(mode="json"))))
    print(format_work(cfg))
    return 0


if __name__ == "__main__":
    sys.exit(main())
