"""Our recipe -> verl 0.9.1's trainer config: a Hydra compose of verl's own `ppo_trainer`
config with overrides derived from the recipe keys, validated before anything is built.

The mapping is one table (`recipe_overrides`): every recipe key the verl backend reads becomes
one or more verl keys, and nothing else is changed from verl's defaults except the engineering
settings the backend needs (FSDP2, fp32 master weights and fp32 compute on CPU, a constant LR
with no warmup, our own mini-batch loop). What verl cannot honour is refused by the config
itself (`fl_app.config.Config._check_backend`) or here (`check_resolved`), never defaulted.
docs/verl.md prints the table.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fl_app.config import Config, ConfigError

VERL_VERSION = "0.9.1"
RESOLVED_NAME = "verl_config.yaml"


def has_flash_attn(device: str) -> bool:
    """verl's packed-sequence path (flash-attn varlen kernels) is available."""
    import importlib.util

    return device != "cpu" and importlib.util.find_spec("flash_attn") is not None


def loss_horizon(cfg: Config) -> int:
    """The constant `seq-mean-token-sum-norm` divides by (Dr.GRPO): the generation budget of a
    row, so the loss does not depend on how a mini-batch is cut into micro-batches."""
    r = cfg.rollout
    return r.max_prompt_tokens if r.mode == "concat" else r.max_response_tokens


def recipe_overrides(cfg: Config, model_path: Path, device: str) -> list[str]:
    """Hydra overrides of verl's `ppo_trainer` config that carry the recipe (docs/verl.md)."""
    a, r = cfg.algo, cfg.rollout
    on_cpu = device == "cpu"
    packed = has_flash_attn(device)
    per_layer = cfg.run.lane_devices > 1
    one_unit = None if per_layer else _one_unit_class(model_path)
    actor = "actor_rollout_ref.actor"
    out = [
        # model
        f"actor_rollout_ref.model.path={model_path}",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        # packed (rmpad) sequences need flash-attn's varlen kernels: only on a GPU that has them
        # (the flash-attn package; not on the H200 image, where SDPA on padded rows runs instead)
        f"actor_rollout_ref.model.use_remove_padding={packed}",
        f"+actor_rollout_ref.model.override_config.attn_implementation={'flash_attention_2' if packed else 'sdpa'}",
        # engine: FSDP2, fp32 master weights; fp32 compute on CPU (bf16 params on GPU, verl's default)
        f"{actor}.strategy=fsdp2",
        f"{actor}.fsdp_config.model_dtype=fp32",
        f"{actor}.use_torch_compile={not on_cpu}",
        f"{actor}.fsdp_config.use_torch_compile={not on_cpu}",
        *_wrap(f"{actor}.fsdp_config", one_unit),  # the reference is built from the actor's config
        # one rank: its one unit stays gathered over a phase's passes (VerlEngine reshards it at
        # the end); k ranks: each decoder layer is gathered for its pass and freed after it
        f"{actor}.fsdp_config.reshard_after_forward={per_layer}",
        # optimizer: AdamW, constant LR, no warmup, rebuilt per fit by the backend (invariant 3)
        f"{actor}.optim.lr={a.lr}",
        f"{actor}.optim.weight_decay={a.weight_decay}",
        f"{actor}.optim.clip_grad={a.grad_clip}",
        f"{actor}.grad_clip={a.grad_clip}",
        f"{actor}.optim.lr_scheduler_type=constant",
        f"{actor}.optim.lr_warmup_steps=0",
        f"{actor}.optim.lr_warmup_steps_ratio=0.0",
        # one fused AdamW kernel per step on CUDA, as builtin steps (verl's default, foreach over
        # DTensors, dispatches every op through DTensor); the CPU keeps torch's default
        f"{actor}.optim.override_optimizer_config={_fused(on_cpu)}",
        # objective
        f"{actor}.policy_loss.loss_mode=vanilla",
        f"{actor}.loss_agg_mode={a.loss_agg_mode}",
        f"{actor}.loss_scale_factor={loss_horizon(cfg)}",
        f"{actor}.clip_ratio={a.clip_ratio}",
        f"{actor}.clip_ratio_low={a.clip_ratio}",
        f"{actor}.clip_ratio_high={a.clip_ratio}",
        f"{actor}.clip_ratio_c={a.clip_ratio_c}",
        f"{actor}.entropy_coeff={a.entropy_coeff}",
        # builtin reports entropy always; verl computes it only when asked
        f"{actor}.calculate_entropy=True",
        f"{actor}.use_kl_loss={a.kl_coef > 0}",
        f"{actor}.kl_loss_coef={a.kl_coef}",
        f"{actor}.kl_loss_type={a.kl_type}",
        # batches, in ROWS (a windowed turn or a concat episode); the backend drives one
        # optimizer step per mini-batch itself, one pass (ppo_epochs 1), seeded order
        f"{actor}.ppo_mini_batch_size={a.mini_batch_size}",
        f"{actor}.ppo_micro_batch_size_per_gpu={a.micro_batch_size}",
        f"{actor}.ppo_epochs=1",
        f"actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu={a.micro_batch_size}",
        f"actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu={a.micro_batch_size}",
        # algo.micro_batch_tokens: verl's token-count micro-batches (the budget counts real tokens)
        *_dynamic_bsz(a.micro_batch_tokens, f"{actor}.", f"{actor}.ppo_"),
        *_dynamic_bsz(a.micro_batch_tokens, "actor_rollout_ref.ref.log_prob_"),
        *_dynamic_bsz(a.micro_batch_tokens, "actor_rollout_ref.rollout.log_prob_"),
        # rollout: the trained log-probs use the sampling temperature, as verl's actor does
        f"actor_rollout_ref.rollout.temperature={r.temperature}",
        f"actor_rollout_ref.rollout.val_kwargs.temperature={r.val_temperature}",
        f"actor_rollout_ref.rollout.prompt_length={r.max_prompt_tokens}",
        f"actor_rollout_ref.rollout.response_length={r.max_response_tokens}",
        "actor_rollout_ref.rollout.top_p=1.0",
        "actor_rollout_ref.rollout.top_k=-1",
        f"actor_rollout_ref.rollout.n={a.rollouts_per_task}",
        "actor_rollout_ref.rollout.name=vllm",
        f"actor_rollout_ref.rollout.gpu_memory_utilization={r.gpu_memory_utilization}",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        # advantages are ours (client_app.algos, verl parity tested); recorded for the reader
        f"algorithm.adv_estimator={'grpo' if a.spec.advantage == 'group_relative' else 'gae'}",
        f"algorithm.gamma={a.gamma}",
        f"algorithm.lam={a.lam}",
        f"algorithm.norm_adv_by_std_in_grpo={a.grpo_norm_by_std}",
        "algorithm.use_kl_in_reward=False",
        f"data.train_batch_size={a.tasks_per_step}",
        f"data.max_prompt_length={r.max_prompt_tokens}",
        f"data.max_response_length={r.max_response_tokens}",
        f"trainer.device={'cpu' if on_cpu else 'cuda'}",
        "trainer.n_gpus_per_node=1",
        "trainer.nnodes=1",
        "trainer.resume_mode=disable",
        "trainer.save_freq=-1",
        "trainer.val_before_train=False",
        "trainer.logger=[console]",
        "trainer.project_name=fedagent",
        f"trainer.experiment_name={cfg.run.name}",
    ]
    fp32_compute = "{param_dtype:fp32,reduce_dtype:fp32,buffer_dtype:fp32}"
    if on_cpu:
        # fp32 compute: verl's MixedPrecisionPolicy defaults to bf16 params
        out.append(f"+{actor}.fsdp_config.mixed_precision={fp32_compute}")
    if a.spec.critic:
        c = a.critic
        out += [
            # the value model: the policy's architecture + a one-output head (verl's
            # FSDPEngineWithValueHead, AutoModelForTokenClassification, as builtin's critic)
            "critic.strategy=fsdp2",
            f"critic.model.path={model_path}",
            "critic.model.enable_gradient_checkpointing=False",
            f"critic.model.use_remove_padding={packed}",
            *_wrap("critic.fsdp", one_unit),
            "critic.fsdp.reshard_after_forward=False",
            f"+critic.model.override_config.attn_implementation={'flash_attention_2' if packed else 'sdpa'}",
            "critic.fsdp.model_dtype=fp32",
            f"critic.fsdp.use_torch_compile={not on_cpu}",
            f"critic.optim.lr={c.lr}",
            f"critic.optim.weight_decay={c.weight_decay}",
            f"critic.optim.clip_grad={c.grad_clip}",
            f"critic.grad_clip={c.grad_clip}",
            "critic.optim.lr_scheduler_type=constant",
            "critic.optim.lr_warmup_steps=0",
            "critic.optim.lr_warmup_steps_ratio=0.0",
            f"critic.optim.override_optimizer_config={_fused(on_cpu)}",
            f"critic.cliprange_value={c.value_clip}",
            f"critic.loss_agg_mode={a.loss_agg_mode}",
            f"critic.loss_scale_factor={loss_horizon(cfg)}",
            f"critic.ppo_mini_batch_size={c.mini_batch_size}",
            f"critic.ppo_micro_batch_size_per_gpu={c.micro_batch_size}",
            "critic.ppo_epochs=1",
            *_dynamic_bsz(a.micro_batch_tokens, "critic.", "critic.ppo_"),
        ]
        if on_cpu:
            out.append(f"+critic.fsdp.mixed_precision={fp32_compute}")
    return out


def _fused(on_cpu: bool) -> str:
    """verl's `optim.override_optimizer_config`: AdamW's `fused` on CUDA, nothing on the CPU."""
    return "null" if on_cpu else "{fused:true}"


def _one_unit_class(model_path: Path) -> str | None:
    """The class verl's FSDP2 `wrap_policy` names so that every parameter is left to one unit, the
    root (None: keep verl's wrap).

    verl makes each decoder layer its own FSDP2 unit: across ranks, that overlaps a layer's gather
    with the previous layer's compute. The engine runs on one rank, where a unit shards nothing
    and costs host time on every pass (gather, cast, free and reduce-scatter hooks, ~50 units a
    forward and backward on a 24-layer model). verl wraps the modules whose class the policy names
    and then the root, so naming the rotary embedding (no parameters, run once per forward)
    leaves one unit with work in it: on an H100 a 0.5B policy pass took 0.79x the time
    (docs/benchmarks.md). verl still wraps untied input and output embeddings as units of their
    own; a model without a rotary embedding, or whose config does not load here, keeps verl's
    per-layer wrap (verl then reports what is wrong with it).

    Not over k ranks (`run.lane_devices` > 1): there one unit would gather the whole model on
    every rank for every pass and hold its whole unsharded gradient, so a model that fits only
    as k shards would not train; verl's per-layer units (`reshard_after_forward: true`) keep one
    layer gathered at a time and reduce-scatter its gradient as its backward ends."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError):
        return None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    names = {
        type(m).__name__
        for name, m in model.named_modules()
        if name.endswith("rotary_emb") and next(m.parameters(), None) is None
    }
    return names.pop() if len(names) == 1 else None


def _wrap(fsdp: str, layer_class: str | None) -> list[str]:
    """The override that names `layer_class` as the FSDP2 units of `fsdp` (none: verl's own)."""
    return [f"+{fsdp}.wrap_policy.transformer_layer_cls_to_wrap=[{layer_class}]"] if layer_class else []


def _dynamic_bsz(tokens: int | None, switch: str, budget: str = "") -> list[str]:
    """verl's `<switch>use_dynamic_bsz` and, when on, `<budget>max_token_len_per_gpu` (the budget
    key's prefix defaults to the switch's)."""
    on = [f"{budget or switch}max_token_len_per_gpu={tokens}"] if tokens is not None else []
    return [f"{switch}use_dynamic_bsz={tokens is not None}", *on]


def compose(cfg: Config, model_path: Path, device: str) -> Any:
    """verl's `ppo_trainer` config (an OmegaConf DictConfig) with the recipe's overrides,
    composed from the installed verl's config directory; Hydra's global state is restored."""
    import verl
    import verl.trainer.config as verl_config_pkg
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    if verl.__version__ != VERL_VERSION:
        raise ConfigError(
            f"backend=verl is built and tested on verl=={VERL_VERSION}, found verl=={verl.__version__}; "
            f"pip install 'verl=={VERL_VERSION}' (or `pip install -e .[verl]`)"
        )
    config_dir = os.path.dirname(verl_config_pkg.__file__)
    was_initialized = GlobalHydra.instance().is_initialized()
    if was_initialized:
        raise RuntimeError("Hydra is already initialised in this process; the verl backend composes its own config")
    try:
        with initialize_config_dir(config_dir=config_dir, version_base=None):
            return hydra_compose(config_name="ppo_trainer", overrides=recipe_overrides(cfg, model_path, device))
    finally:
        GlobalHydra.instance().clear()


def check_resolved(cfg: Config, verl_cfg: Any) -> None:
    """Validate the composed config before anything is built: verl's own dataclass checks
    (ActorConfig, HFModelConfig, ...) and ours: the composed values must be the recipe's."""
    from hydra.errors import InstantiationException
    from verl.utils.config import omega_conf_to_dataclass

    a = cfg.algo
    try:
        actor = omega_conf_to_dataclass(verl_cfg.actor_rollout_ref.actor)
        omega_conf_to_dataclass(verl_cfg.actor_rollout_ref.model)  # reads the model dir's config
        critic = omega_conf_to_dataclass(verl_cfg.critic) if a.spec.critic else None
    except (ValueError, AssertionError, TypeError, OSError, InstantiationException) as e:
        raise ConfigError(f"verl rejects the config derived from this recipe: {e}") from None
    expect = {
        "optim.lr": (actor.optim.lr, a.lr),
        "optim.weight_decay": (actor.optim.weight_decay, a.weight_decay),
        "optim.clip_grad": (actor.optim.clip_grad, a.grad_clip),
        "optim.lr_scheduler_type": (actor.optim.lr_scheduler_type, "constant"),
        "optim.optimizer": (actor.optim.optimizer, "AdamW"),
        "clip_ratio_low": (actor.clip_ratio_low, a.clip_ratio),
        "clip_ratio_high": (actor.clip_ratio_high, a.clip_ratio),
        "clip_ratio_c": (actor.clip_ratio_c, a.clip_ratio_c),
        "entropy_coeff": (actor.entropy_coeff, a.entropy_coeff),
        "use_kl_loss": (actor.use_kl_loss, a.kl_coef > 0),
        "kl_loss_coef": (actor.kl_loss_coef, a.kl_coef),
        "loss_agg_mode": (actor.loss_agg_mode, a.loss_agg_mode),
        "kl_loss_type": (actor.kl_loss_type, a.kl_type),
        "loss_scale_factor": (actor.loss_scale_factor, loss_horizon(cfg)),
        "policy_loss.loss_mode": (actor.policy_loss.loss_mode, "vanilla"),
        "engine.strategy": (actor.engine.strategy, "fsdp2"),
        "engine.model_dtype": (actor.engine.model_dtype, "fp32"),
    }
    if critic is not None:
        c = a.critic
        expect |= {
            "critic.optim.lr": (critic.optim.lr, c.lr),
            "critic.optim.weight_decay": (critic.optim.weight_decay, c.weight_decay),
            "critic.optim.clip_grad": (critic.optim.clip_grad, c.grad_clip),
            "critic.optim.lr_scheduler_type": (critic.optim.lr_scheduler_type, "constant"),
            "critic.cliprange_value": (critic.cliprange_value, c.value_clip),
            "critic.loss_agg_mode": (critic.loss_agg_mode, a.loss_agg_mode),
            "critic.engine.strategy": (critic.engine.strategy, "fsdp2"),
            "critic.engine.model_dtype": (critic.engine.model_dtype, "fp32"),
        }
    wrong = {k: v for k, (v, want) in expect.items() if v != want}
    if wrong:
        raise ConfigError(f"the composed verl config does not carry the recipe: {wrong}")
    if actor.optim.lr_warmup_steps > 0 or actor.optim.lr_warmup_steps_ratio > 0:
        raise ConfigError("the verl backend keeps a constant LR with no warmup (the builtin's schedule)")


def write_resolved(verl_cfg: Any, run_dir: Path) -> Path:
    """The resolved verl config as YAML in the run dir (what this lane's trainer was built from)."""
    from omegaconf import OmegaConf

    path = Path(run_dir) / "verl" / RESOLVED_NAME
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_text(OmegaConf.to_yaml(verl_cfg, resolve=True))
    tmp.replace(path)
    return path
