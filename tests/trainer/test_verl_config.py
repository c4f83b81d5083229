"""Selecting the verl backend and mapping the recipe onto verl's own (Hydra) trainer config:
every mapped recipe key lands in the composed config, verl's validation runs on it, what verl
cannot honour is a config error, and the default stays builtin. No engine is built here."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from fl_app.config import ConfigError, load_config, save_config

pytest.importorskip("verl")

from trainer_support import model_dir  # noqa: E402,F401

from client_app.trainer import verl_config  # noqa: E402


def test_default_backend_is_builtin_and_verl_is_selectable():
    assert load_config().backend == "builtin"
    assert load_config(dotlist=["backend=verl"]).backend == "verl"
    assert load_config(overrides={"backend": "verl"}).backend == "verl"  # flwr --run-config backend=verl
    with pytest.raises(ConfigError, match="backend"):
        load_config(dotlist=["backend=megatron"])


@pytest.mark.parametrize(
    "dotlist, message",
    [
        (["verl.rollout_engine=vllm"], "the `verl` section is gone.*rollout.engine"),  # a moved key, named
        (["backend=verl", "rollout.gpu_memory_utilization=0.8"], "only applies to rollout.engine=vllm"),
        (["backend=verl", "rollout.engine=vllm", "run.device=cpu"], "needs a GPU"),
        (["backend=verl", "algo.grpo_norm_by_std=false", "algo.name=ppo"], "grpo_norm_by_std"),
    ],
)
def test_what_cannot_be_honoured_is_a_config_error(dotlist, message):
    with pytest.raises(ConfigError, match=message):
        load_config(dotlist=dotlist)


@pytest.mark.parametrize("backend", ["builtin", "verl"])
def test_saved_config_loads_again(tmp_path, backend):
    """A saved config is complete (every key written out): it must load back."""
    cfg = load_config(dotlist=[f"backend={backend}"])
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(str(tmp_path / "config.yaml"))
    assert again.model_dump() == cfg.model_dump() | {"extends": ""}


RECIPE = [
    "backend=verl",
    "algo.lr=3e-5",
    "algo.weight_decay=0.05",
    "algo.clip_ratio=0.28",
    "algo.clip_ratio_c=4.0",
    "algo.entropy_coeff=0.002",
    "algo.kl_coef=0.03",
    "algo.kl_type=k3",
    "algo.mini_batch_size=24",
    "algo.micro_batch_size=6",
    "algo.micro_batch_tokens=null",  # the default's CPU token budget off: fixed-size micro-batches
    "algo.grad_clip=0.7",
    "rollout.temperature=0.9",
    "rollout.val_temperature=0.2",
    "rollout.max_response_tokens=48",
    "rollout.max_prompt_tokens=640",
    "algo.group_size=4",
    "algo.tasks_per_step=6",
    "algo.gamma=0.99",
    "algo.lam=0.95",
]


def _composed(model_dir, dotlist=RECIPE, device="cpu"):
    cfg = load_config(dotlist=dotlist)
    return cfg, verl_config.compose(cfg, model_dir, device)


def test_recipe_keys_land_in_the_composed_verl_config(model_dir):  # noqa: F811
    cfg, c = _composed(model_dir)
    verl_config.check_resolved(cfg, c)
    actor, rollout = c.actor_rollout_ref.actor, c.actor_rollout_ref.rollout
    assert (actor.optim.lr, actor.optim.weight_decay, actor.optim.clip_grad) == (3e-5, 0.05, 0.7)
    assert actor.optim.lr_scheduler_type == "constant" and actor.optim.lr_warmup_steps == 0
    assert (actor.clip_ratio_low, actor.clip_ratio_high, actor.clip_ratio_c) == (0.28, 0.28, 4.0)
    assert (actor.entropy_coeff, actor.use_kl_loss, actor.kl_loss_coef, actor.kl_loss_type) == (0.002, True, 0.03, "k3")
    assert (actor.ppo_mini_batch_size, actor.ppo_micro_batch_size_per_gpu, actor.ppo_epochs) == (24, 6, 1)
    assert actor.loss_agg_mode == "token-mean" and actor.policy_loss.loss_mode == "vanilla"
    assert actor.loss_scale_factor == 48  # the Dr.GRPO horizon: the turn budget
    assert actor.strategy == "fsdp2" and actor.fsdp_config.model_dtype == "fp32"
    assert actor.fsdp_config.mixed_precision.param_dtype == "fp32"  # fp32 compute on CPU
    assert (rollout.temperature, rollout.val_kwargs.temperature, rollout.n) == (0.9, 0.2, 4)
    assert (rollout.response_length, rollout.prompt_length) == (48, 640)
    assert (c.algorithm.adv_estimator, c.algorithm.gamma, c.algorithm.lam) == ("grpo", 0.99, 0.95)
    assert c.data.train_batch_size == 6 and c.algorithm.norm_adv_by_std_in_grpo is True
    assert c.actor_rollout_ref.model.use_remove_padding is False  # no varlen kernels on CPU


def test_ppo_critic_keys_land_in_the_composed_verl_config(model_dir):  # noqa: F811
    cfg, c = _composed(
        model_dir,
        RECIPE
        + [
            "algo.name=ppo",
            "algo.critic.lr=2e-4",
            "algo.critic.value_clip=0.3",
            "algo.critic.mini_batch_size=12",
            "algo.critic.micro_batch_size=3",
            "algo.critic.grad_clip=0.9",
            "algo.critic.weight_decay=0.02",
        ],
    )
    verl_config.check_resolved(cfg, c)
    critic = c.critic
    assert (critic.optim.lr, critic.optim.weight_decay, critic.optim.clip_grad) == (2e-4, 0.02, 0.9)
    assert critic.optim.lr_scheduler_type == "constant" and critic.cliprange_value == 0.3
    assert (critic.ppo_mini_batch_size, critic.ppo_micro_batch_size_per_gpu, critic.ppo_epochs) == (12, 3, 1)
    assert critic.strategy == "fsdp2" and critic.fsdp.model_dtype == "fp32" and critic.loss_agg_mode == "token-mean"
    assert critic.model.path == str(model_dir) and c.algorithm.adv_estimator == "gae"
    assert critic.fsdp.mixed_precision.param_dtype == "fp32"  # fp32 compute on CPU


def test_a_token_budget_becomes_verls_dynamic_batch_size_everywhere(model_dir):  # noqa: F811
    """algo.micro_batch_tokens arms verl's use_dynamic_bsz for the actor, the reference and
    rollout log-prob passes and the critic, each with the same budget; unset, none is armed."""
    cfg, c = _composed(model_dir, RECIPE + ["algo.name=ppo", "algo.micro_batch_tokens=1500"])
    verl_config.check_resolved(cfg, c)
    ref, rollout = c.actor_rollout_ref.ref, c.actor_rollout_ref.rollout
    assert (c.actor_rollout_ref.actor.use_dynamic_bsz, c.actor_rollout_ref.actor.ppo_max_token_len_per_gpu) == (
        True,
        1500,
    )
    assert (ref.log_prob_use_dynamic_bsz, ref.log_prob_max_token_len_per_gpu) == (True, 1500)
    assert (rollout.log_prob_use_dynamic_bsz, rollout.log_prob_max_token_len_per_gpu) == (True, 1500)
    assert (c.critic.use_dynamic_bsz, c.critic.ppo_max_token_len_per_gpu, c.critic.forward_max_token_len_per_gpu) == (
        True,
        1500,
        1500,
    )
    _cfg, plain = _composed(model_dir, RECIPE + ["algo.name=ppo"])
    assert not plain.actor_rollout_ref.actor.use_dynamic_bsz and not plain.critic.use_dynamic_bsz
    assert not plain.actor_rollout_ref.ref.log_prob_use_dynamic_bsz


def test_gpu_composition_keeps_verl_defaults_for_compute(model_dir):  # noqa: F811
    _cfg, c = _composed(model_dir, device="cuda")
    # packed sequences only where flash-attn's varlen kernels exist (not on the H200 image)
    assert c.actor_rollout_ref.model.use_remove_padding is verl_config.has_flash_attn("cuda")
    assert c.actor_rollout_ref.model.override_config.attn_implementation == (
        "flash_attention_2" if verl_config.has_flash_attn("cuda") else "sdpa"
    )
    assert "mixed_precision" not in c.actor_rollout_ref.actor.fsdp_config  # verl's bf16 compute, fp32 master
    assert c.actor_rollout_ref.actor.fsdp_config.model_dtype == "fp32"


def test_kl_off_turns_the_kl_loss_off(model_dir):  # noqa: F811
    cfg, c = _composed(model_dir, ["backend=verl", "algo.kl_coef=0"])
    verl_config.check_resolved(cfg, c)
    assert c.actor_rollout_ref.actor.use_kl_loss is False


def test_a_composed_config_that_drifted_from_the_recipe_is_refused(model_dir, tmp_path):  # noqa: F811
    cfg, c = _composed(model_dir)
    c.actor_rollout_ref.actor.optim.lr = 1e-6  # e.g. an override that did not take
    with pytest.raises(ConfigError, match="optim.lr"):
        verl_config.check_resolved(cfg, c)
    _cfg, c = _composed(model_dir)
    c.actor_rollout_ref.actor.ppo_micro_batch_size = 2  # verl's own validation runs too
    with pytest.raises(ConfigError, match="verl rejects"):
        verl_config.check_resolved(cfg, c)
    _cfg, c = _composed(model_dir)
    c.actor_rollout_ref.model.path = str(tmp_path / "no-model")  # a model dir verl cannot read
    with pytest.raises(ConfigError, match="verl rejects"):
        verl_config.check_resolved(cfg, c)


def test_resolved_config_is_written_to_the_run_dir(model_dir, tmp_path):  # noqa: F811
    _cfg, c = _composed(model_dir)
    path = verl_config.write_resolved(c, tmp_path / "run")
    assert path == tmp_path / "run" / "verl" / "verl_config.yaml"
    back = OmegaConf.load(path)
    assert back.actor_rollout_ref.actor.optim.lr == 3e-5 and back.actor_rollout_ref.actor.kl_loss_type == "k3"
    assert "${" not in path.read_text()  # resolved: no interpolation left


@pytest.mark.parametrize("ranks", [1, 2])
def test_one_rank_keeps_one_gathered_unit_and_k_ranks_get_verls_per_layer_units(model_dir, ranks):  # noqa: F811
    """One rank names the rotary embedding as the wrapped class (one unit with work, gathered
    over a phase); over k ranks verl's per-decoder-layer wrap stays and each unit reshards
    after its forward, so a rank never holds the whole gathered model in a training pass."""
    cfg, c = _composed(model_dir, [*RECIPE, f"run.lane_devices={ranks}", "rollout.engine=hf"])
    verl_config.check_resolved(cfg, c)
    fsdp = c.actor_rollout_ref.actor.fsdp_config
    assert fsdp.reshard_after_forward is (ranks > 1)
    wrapped = fsdp.get("wrap_policy", {}).get("transformer_layer_cls_to_wrap")
    assert wrapped == (None if ranks > 1 else ["Qwen2RotaryEmbedding"])
