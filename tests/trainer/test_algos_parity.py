"""Parity of client_app.algos with verl 0.9.1, the implementation the verl backend trains with.

Every function is compared with its verl counterpart on random batches (several seeds and
shapes, masks with interior zeros and fully masked rows), values and gradients, to 1e-6.
verl is imported at module level on purpose: this test must run (not skip) wherever the test
extra is installed. Run with `-s` to print the largest difference measured per function.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest
import torch
import verl  # noqa: F401  (fails loudly if verl/ray are missing: no importorskip)
from tensordict import TensorDict
from verl.trainer.ppo import core_algos
from verl.utils import tensordict_utils as tu
from verl.utils import torch_functional as verl_F
from verl.workers.config import ActorConfig, CriticConfig
from verl.workers.utils.losses import ppo_loss as verl_ppo_loss
from verl.workers.utils.losses import value_loss as verl_value_loss

from client_app import algos

TOL = 1e-6
SEEDS = [0, 1, 2, 3]
SHAPES = [(2, 3), (8, 17), (32, 64)]
AGG_MODES = list(algos.LOSS_AGG_MODES)
MAX_DIFF: dict[str, float] = defaultdict(float)


@pytest.fixture(scope="module", autouse=True)
def _print_max_differences():
    yield
    print("\nmax |ours - verl| per function:")
    for name, diff in sorted(MAX_DIFF.items()):
        print(f"  {name:40s} {diff:.3e}")


def assert_matches(name: str, ours: torch.Tensor | float, ref: torch.Tensor | float) -> None:
    ours_t, ref_t = torch.as_tensor(ours, dtype=torch.float64), torch.as_tensor(ref, dtype=torch.float64)
    assert ours_t.shape == ref_t.shape, f"{name}: shape {tuple(ours_t.shape)} vs verl {tuple(ref_t.shape)}"
    assert torch.isfinite(ref_t).all(), f"{name}: verl produced a non-finite value; the case is outside verl's domain"
    diff = (ours_t - ref_t).abs().max().item() if ours_t.numel() else 0.0
    MAX_DIFF[name] = max(MAX_DIFF[name], diff)
    assert diff <= TOL, f"{name}: max |ours - verl| = {diff:.3e} > {TOL}"


def make_batch(seed: int, batch: int, horizon: int) -> dict[str, torch.Tensor]:
    """A padded response batch: right-padded rows with interior zeros (observation tokens),
    at least one fully masked row when batch > 2, log-prob gaps large enough to hit every clip."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, horizon + 1, (batch,), generator=g)
    positions = torch.arange(horizon).unsqueeze(0)
    mask = (positions < lengths.unsqueeze(1)) & (torch.rand(batch, horizon, generator=g) < 0.8)
    mask[:, 0] = True
    if batch > 2:
        mask[1] = False
    old_log_prob = -3.0 * torch.rand(batch, horizon, generator=g)
    jump = torch.randn(batch, horizon, generator=g) * torch.where(
        torch.rand(batch, horizon, generator=g) < 0.2, 2.0, 0.15
    )
    advantages = torch.randn(batch, horizon, generator=g)
    if batch > 2:  # token 0 is always valid: one dual-clip hit (A < 0, ratio e^3) and one ratio-clip hit
        jump[0, 0], advantages[0, 0] = 3.0, -1.0
        jump[2, 0], advantages[2, 0] = 0.5, 1.0
    return {
        "mask": mask,
        "lengths": lengths,
        "old_log_prob": old_log_prob,
        "log_prob": old_log_prob + jump,
        "ref_log_prob": old_log_prob + 0.5 * torch.randn(batch, horizon, generator=g),
        "advantages": advantages,
        "entropy": 3.0 * torch.rand(batch, horizon, generator=g),
        "values": torch.randn(batch, horizon, generator=g),
        "returns": torch.randn(batch, horizon, generator=g),
        "rewards": torch.randn(batch, horizon, generator=g),
    }


def actor_config(**overrides) -> ActorConfig:
    """The minimal ActorConfig verl's loss functions read (strategy/rollout_n are required fields)."""
    return ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, **overrides)


def verl_actor_config(spec: algos.ActorLossSpec) -> ActorConfig:
    """verl's ActorConfig for the actor objective `spec` (verl's names for the same knobs)."""
    return actor_config(
        clip_ratio=spec.clip_ratio_low,
        clip_ratio_low=spec.clip_ratio_low,
        clip_ratio_high=spec.clip_ratio_high,
        clip_ratio_c=spec.clip_ratio_c,
        entropy_coeff=spec.entropy_coeff,
        use_kl_loss=spec.kl_coef > 0,
        kl_loss_coef=spec.kl_coef,
        kl_loss_type=spec.kl_type,
        loss_agg_mode=spec.loss_agg_mode,
    )


# ---------------------------------------------------------------- advantages


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("norm_by_std", [True, False])
def test_grpo_advantage_matches_verl(seed: int, norm_by_std: bool) -> None:
    g = torch.Generator().manual_seed(seed)
    group_sizes = [8, 8, 1, 3, 2, 1, 5]  # includes singleton groups
    batch, horizon = sum(group_sizes), 12
    uids = np.array([f"task-{seed}-{k}" for k, n in enumerate(group_sizes) for _ in range(n)], dtype=object)
    order = torch.randperm(batch, generator=g).numpy()  # groups interleaved, as after shuffling
    uids = uids[order]
    data = make_batch(seed, batch, horizon)
    rewards = torch.zeros(batch, horizon)
    last = (data["mask"].cumsum(-1) == data["mask"].sum(-1, keepdim=True)) & data["mask"]
    outcome = torch.where(torch.rand(batch, generator=g) < 0.5, 1.0, 0.0) - 0.1 * torch.randint(
        0, 3, (batch,), generator=g
    )
    rewards[last] = outcome.repeat_interleave(last.sum(-1))
    rewards[0, -1] += 0.25  # a reward outside the mask still counts, as in verl
    for mask in (data["mask"], data["mask"].float()):
        ours_adv, ours_ret = algos.grpo_outcome_advantage(rewards, mask, uids, eps=1e-6, norm_by_std=norm_by_std)
        ref_adv, ref_ret = core_algos.compute_grpo_outcome_advantage(
            rewards.clone(), mask, uids, epsilon=1e-6, norm_adv_by_std_in_grpo=norm_by_std
        )
        assert_matches("grpo_outcome_advantage.advantages", ours_adv, ref_adv)
        assert_matches("grpo_outcome_advantage.returns", ours_ret, ref_ret)


def test_grpo_advantage_matches_verl_with_tied_and_integer_groups() -> None:
    """All-equal groups (std 0) and integer group ids."""
    rewards = torch.zeros(6, 4)
    rewards[:, -1] = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.5])
    mask = torch.ones(6, 4, dtype=torch.bool)
    index = np.array([7, 7, 7, 3, 3, 9])
    ours, _ = algos.grpo_outcome_advantage(rewards, mask, index)
    ref, _ = core_algos.compute_grpo_outcome_advantage(rewards.clone(), mask, index)
    assert_matches("grpo_outcome_advantage.advantages", ours, ref)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("gamma,lam", [(1.0, 1.0), (0.99, 0.95)])
def test_gae_matches_verl(seed: int, shape: tuple[int, int], gamma: float, lam: float) -> None:
    d = make_batch(seed, *shape)
    mask = d["mask"].float()
    ours_adv, ours_ret = algos.gae_advantage_return(d["rewards"], d["values"], mask, gamma, lam)
    ref_adv, ref_ret = core_algos.compute_gae_advantage_return(d["rewards"], d["values"], mask, gamma, lam)
    assert_matches("gae_advantage_return.advantages", ours_adv, ref_adv)
    assert_matches("gae_advantage_return.returns", ours_ret, ref_ret)


# ---------------------------------------------------------------- masked statistics


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_masked_statistics_match_verl(seed: int, shape: tuple[int, int]) -> None:
    d = make_batch(seed, *shape)
    x, mask = d["values"], d["mask"]
    assert_matches("masked_sum", algos.masked_sum(x, mask), verl_F.masked_sum(x, mask))
    assert_matches("masked_mean", algos.masked_mean(x, mask), verl_F.masked_mean(x, mask))
    assert_matches("masked_mean(dim=-1)", algos.masked_mean(x, mask, dim=-1), verl_F.masked_mean(x, mask, axis=-1))
    assert_matches("masked_var", algos.masked_var(x, mask), verl_F.masked_var(x, mask))
    for shift in (True, False):
        assert_matches("masked_whiten", algos.masked_whiten(x, mask, shift), verl_F.masked_whiten(x, mask, shift))


# ---------------------------------------------------------------- aggregation and losses


def verl_global_info(mask: torch.Tensor) -> dict:
    """What verl's engines pass as global_batch_info for an unsplit mini-batch (dp_size 1)."""
    return {"batch_num_tokens": int(mask.sum()), "global_batch_size": int((mask.sum(-1) > 0).sum())}


def our_norm(info: dict) -> algos.AggNorm:
    return algos.AggNorm(num_tokens=info["batch_num_tokens"], num_seqs=info["global_batch_size"])


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_agg_loss_matches_verl(seed: int, shape: tuple[int, int], mode: str) -> None:
    d = make_batch(seed, *shape)
    x, mask = d["entropy"], d["mask"]
    assert_matches(f"agg_loss[{mode}]", algos.agg_loss(x, mask, mode), core_algos.agg_loss(x, mask, mode))
    info = verl_global_info(mask)
    assert_matches(
        f"agg_loss[{mode}]+norm",
        algos.agg_loss(x, mask, mode, norm=our_norm(info)),
        core_algos.agg_loss(x, mask, mode, **info),
    )
    if mode == "seq-mean-token-sum-norm":
        assert_matches(
            "agg_loss[seq-mean-token-sum-norm]+horizon",
            algos.agg_loss(x, mask, mode, horizon=512),
            core_algos.agg_loss(x, mask, mode, loss_scale_factor=512),
        )


def _policy_loss_pair(d: dict, mode: str, low: float, high: float, c: float, mask: torch.Tensor):
    log_prob_ours = d["log_prob"].clone().requires_grad_(True)
    log_prob_ref = d["log_prob"].clone().requires_grad_(True)
    ours = algos.ppo_clip_policy_loss(
        d["old_log_prob"],
        log_prob_ours,
        d["advantages"],
        mask,
        clip_ratio_low=low,
        clip_ratio_high=high,
        clip_ratio_c=c,
        loss_agg_mode=mode,
    )
    cfg = actor_config(clip_ratio=low, clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c)
    ref_loss, ref_metrics = core_algos.compute_policy_loss_vanilla(
        d["old_log_prob"], log_prob_ref, d["advantages"], mask, loss_agg_mode=mode, config=cfg
    )
    ours.loss.backward()
    ref_loss.backward()
    return ours, log_prob_ours.grad, ref_loss, ref_metrics, log_prob_ref.grad


def _check_policy_loss(seed: int, shape: tuple[int, int], mode: str, low: float, high: float, c: float) -> None:
    d = make_batch(seed, *shape)
    for mask in (d["mask"], d["mask"].float()):
        ours, ours_grad, ref_loss, ref_metrics, ref_grad = _policy_loss_pair(d, mode, low, high, c, mask)
        assert_matches(f"policy_loss[{mode}].loss", ours.loss, ref_loss)
        assert_matches(f"policy_loss[{mode}].grad", ours_grad, ref_grad)
        assert_matches("policy_loss.clipfrac", ours.clipfrac, ref_metrics["actor/pg_clipfrac"])
        assert_matches("policy_loss.ppo_kl", ours.ppo_kl, ref_metrics["actor/ppo_kl"])
        assert_matches("policy_loss.clipfrac_lower", ours.clipfrac_lower, ref_metrics["actor/pg_clipfrac_lower"])
    if shape[0] > 2:  # the random batches really exercise both clips
        assert ours.clipfrac > 0 and ours.clipfrac_lower > 0


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("low,high,c", [(0.2, 0.2, 3.0), (0.2, 0.28, 10.0), (0.1, 0.3, 1.5)])
def test_policy_loss_matches_verl_token_mean(
    seed: int, shape: tuple[int, int], low: float, high: float, c: float
) -> None:
    _check_policy_loss(seed, shape, "token-mean", low, high, c)


@pytest.mark.parametrize("seed", SEEDS[:2])
@pytest.mark.parametrize("mode", [m for m in AGG_MODES if m != "token-mean"])
def test_policy_loss_matches_verl_other_agg_modes(seed: int, mode: str) -> None:
    _check_policy_loss(seed, (16, 40), mode, 0.2, 0.28, 3.0)


KL_KINDS = ["k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl", "k1+", "k3+", "low_var_kl+", "k2+"]


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("kind", KL_KINDS)
def test_kl_penalty_matches_verl(seed: int, kind: str) -> None:
    d = make_batch(seed, 16, 24)
    ours_lp = d["log_prob"].clone().requires_grad_(True)
    ref_lp = d["log_prob"].clone().requires_grad_(True)
    ours = algos.kl_penalty(ours_lp, d["ref_log_prob"], kind)
    ref = core_algos.kl_penalty(ref_lp, d["ref_log_prob"], kind)
    weights = torch.randn(ours.shape, generator=torch.Generator().manual_seed(seed))
    (ours * weights).sum().backward()
    (ref * weights).sum().backward()
    assert_matches(f"kl_penalty[{kind}]", ours, ref)
    assert_matches(f"kl_penalty[{kind}].grad", ours_lp.grad, ref_lp.grad)


def test_kl_low_var_matches_verl() -> None:
    """k3 at and beyond both clamps: |ref - logp| > 20 and estimates above 10."""
    gaps = torch.tensor(
        [-40.0, -25.0, -20.0, -12.0, -11.0, -5.0, -1e-4, 0.0, 1e-4, 0.5, 2.0, 2.5, 3.0, 11.0, 25.0, 40.0]
    )
    log_prob = torch.zeros_like(gaps).requires_grad_(True)
    ref_lp = log_prob.detach().clone().requires_grad_(True)
    for kind in ("k3", "low_var_kl"):
        ours = algos.kl_penalty(log_prob, gaps, kind)
        ref = core_algos.kl_penalty(ref_lp, gaps, kind)
        assert_matches("kl_penalty[k3].clamped", ours, ref)
        assert ours.max() == 10.0 and ours.min() >= 0.0
        (g_ours,) = torch.autograd.grad(ours.sum(), log_prob)
        (g_ref,) = torch.autograd.grad(ref.sum(), ref_lp)
        assert_matches("kl_penalty[k3].clamped.grad", g_ours, g_ref)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", AGG_MODES)
def test_value_loss_matches_verl(seed: int, mode: str) -> None:
    d = make_batch(seed, 16, 30)
    vpreds_ours = (d["values"] + 0.8 * d["advantages"]).requires_grad_(True)
    vpreds_ref = vpreds_ours.detach().clone().requires_grad_(True)
    ours, ours_frac = algos.clipped_value_loss(vpreds_ours, d["returns"], d["values"], d["mask"], 0.5, mode)
    ref, ref_frac = core_algos.compute_value_loss(vpreds_ref, d["returns"], d["values"], d["mask"], 0.5, mode)
    ours.backward()
    ref.backward()
    assert_matches(f"value_loss[{mode}]", ours, ref)
    assert_matches("value_loss.clipfrac", ours_frac, ref_frac)
    assert_matches(f"value_loss[{mode}].grad", vpreds_ours.grad, vpreds_ref.grad)
    info = verl_global_info(d["mask"])
    ours_g, _ = algos.clipped_value_loss(
        vpreds_ours, d["returns"], d["values"], d["mask"], 0.5, mode, norm=our_norm(info)
    )
    ref_g, _ = core_algos.compute_value_loss(vpreds_ref, d["returns"], d["values"], d["mask"], 0.5, mode, **info)
    assert_matches(f"value_loss[{mode}]+norm", ours_g, ref_g)


# ---------------------------------------------------------------- logits


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("vocab,scale", [(50, 1.0), (1000, 5.0), (4096, 20.0)])
def test_entropy_matches_verl(seed: int, vocab: int, scale: float) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(4, 9, vocab, generator=g)
    ours_in = logits.clone().requires_grad_(True)
    ref_in = logits.clone().requires_grad_(True)
    ours = algos.entropy_from_logits(ours_in)
    ref = verl_F.entropy_from_logits(ref_in)
    assert_matches("entropy_from_logits", ours, ref)
    ours.sum().backward()
    ref.sum().backward()
    assert_matches("entropy_from_logits.grad", ours_in.grad, ref_in.grad)
    mask = make_batch(seed, 4, 9)["mask"]
    assert_matches(
        "entropy agg (compute_entropy_loss)",
        algos.agg_loss(ours.detach(), mask),
        core_algos.compute_entropy_loss(logits, mask),
    )


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("vocab,scale", [(50, 1.0), (1000, 5.0), (4096, 20.0)])
def test_token_log_probs_match_verl(seed: int, vocab: int, scale: float) -> None:
    g = torch.Generator().manual_seed(seed)
    logits = scale * torch.randn(4, 9, vocab, generator=g)
    labels = torch.randint(0, vocab, (4, 9), generator=g)
    ours_in = logits.clone().requires_grad_(True)
    ref_in = logits.clone().requires_grad_(True)
    ours = algos.token_log_probs(ours_in, labels)
    ref = verl_F.logprobs_from_logits(ref_in, labels)
    assert_matches("token_log_probs", ours, ref)
    ours.sum().backward()
    ref.sum().backward()
    assert_matches("token_log_probs.grad", ours_in.grad, ref_in.grad)


# ---------------------------------------------------------------- the composed actor loss


def verl_layout(resp_lens: torch.Tensor, horizon: int, fields: dict[str, torch.Tensor], info: dict | None):
    """verl's loss input for padded [B, T] response tensors: the TensorDict (with the engine's
    global batch info) and `flatten`, which scatters a [B, T] model output into verl's no-padding
    layout (all sequences' prompt+response tokens concatenated; the output for response token j
    sits at the position before it), differentiably."""
    batch = len(resp_lens)
    g = torch.Generator().manual_seed(batch)
    prompt_lens = torch.randint(1, 5, (batch,), generator=g)
    max_prompt = int(prompt_lens.max())
    attention = torch.zeros(batch, max_prompt + horizon, dtype=torch.long)
    for i in range(batch):
        attention[i, max_prompt - prompt_lens[i] : max_prompt] = 1
        attention[i, max_prompt : max_prompt + resp_lens[i]] = 1
    seq_ends = (prompt_lens + resp_lens).cumsum(0)
    slots = torch.cat([torch.arange(int(resp_lens[i])) + int(seq_ends[i] - resp_lens[i] - 1) for i in range(batch)])
    rows = torch.cat([torch.full((int(resp_lens[i]),), i) for i in range(batch)])
    cols = torch.cat([torch.arange(int(resp_lens[i])) for i in range(batch)])
    total = int(seq_ends[-1])

    def flatten(x: torch.Tensor) -> torch.Tensor:
        return torch.zeros(total, dtype=x.dtype).index_copy(0, slots, x[rows, cols])

    data = TensorDict(
        {
            "prompts": torch.ones(batch, max_prompt, dtype=torch.long),
            "responses": torch.ones(batch, horizon, dtype=torch.long),
            "attention_mask": attention,
            **fields,
        },
        batch_size=[batch],
    )
    info = info or {"batch_num_tokens": None, "global_batch_size": None}
    tu.assign_non_tensor(data, dp_size=1, **info)
    return data, flatten


def verl_actor_loss(cfg: ActorConfig, d: dict, log_prob: torch.Tensor, entropy: torch.Tensor, info: dict | None):
    """Call verl's real actor loss (`verl.workers.utils.losses.ppo_loss`)."""
    data, flatten = verl_layout(
        d["lengths"],
        log_prob.shape[1],
        {
            "response_mask": d["mask"].long(),
            "old_log_probs": d["old_log_prob"],
            "advantages": d["advantages"],
            "ref_log_prob": d["ref_log_prob"],
        },
        info,
    )
    return verl_ppo_loss(cfg, {"log_probs": flatten(log_prob), "entropy": flatten(entropy)}, data)


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
@pytest.mark.parametrize("kl_type", ["low_var_kl", "k1"])
@pytest.mark.parametrize("global_norm", [False, True])
def test_actor_loss_matches_verl_ppo_loss(seed: int, mode: str, kl_type: str, global_norm: bool) -> None:
    d = make_batch(seed, 12, 20)
    # verl's padded layout zeroes everything past a row's response length; give both sides that view.
    beyond = torch.arange(20).unsqueeze(0) >= d["lengths"].unsqueeze(1)
    for key in ("log_prob", "old_log_prob", "advantages", "ref_log_prob", "entropy"):
        d[key] = d[key].masked_fill(beyond, 0.0)
    spec = algos.ActorLossSpec(
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
        clip_ratio_c=3.0,
        entropy_coeff=0.01,
        kl_coef=0.05,
        kl_type=kl_type,
        loss_agg_mode=mode,
    )
    cfg = verl_actor_config(spec)
    info = verl_global_info(d["mask"]) if global_norm else None
    lp_ours, ent_ours = d["log_prob"].clone().requires_grad_(True), d["entropy"].clone().requires_grad_(True)
    lp_ref, ent_ref = d["log_prob"].clone().requires_grad_(True), d["entropy"].clone().requires_grad_(True)
    ours = algos.actor_loss(
        spec,
        lp_ours,
        d["old_log_prob"],
        d["advantages"],
        d["mask"],
        entropy=ent_ours,
        ref_log_prob=d["ref_log_prob"],
        norm=our_norm(info) if info else None,
    )
    ref_loss, ref_metrics = verl_actor_loss(cfg, d, lp_ref, ent_ref, info)
    ours.loss.backward()
    ref_loss.backward()
    assert_matches(f"actor_loss[{mode}]", ours.loss, ref_loss)
    assert_matches("actor_loss.grad(log_prob)", lp_ours.grad, lp_ref.grad)
    assert_matches("actor_loss.grad(entropy)", ent_ours.grad, ent_ref.grad)
    for ours_key, ref_key in [
        ("pg_loss", "actor/pg_loss"),
        ("entropy", "actor/entropy_loss"),
        ("kl_loss", "kl_loss"),
        ("pg_clipfrac", "actor/pg_clipfrac"),
        ("ppo_kl", "actor/ppo_kl"),
        ("pg_clipfrac_lower", "actor/pg_clipfrac_lower"),
    ]:
        assert_matches(f"actor_loss.metrics.{ours_key}", ours.metrics[ours_key], ref_metrics[ref_key].aggregate())


# ---------------------------------------------------------------- the critic loss over micro-batches


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("micro", [1, 3, 12])
def test_critic_loss_over_micro_batches_matches_verl_value_loss(seed: int, micro: int) -> None:
    """The builtin critic's gradient accumulation (every micro loss normalised by the WHOLE
    mini-batch's token count) against verl's engine path (`workers.utils.losses.value_loss` fed
    the global batch info per micro-batch): equal per micro-batch, so equal summed, and the sum
    is the unsplit mini-batch loss whatever the split (field log 2026-07-22)."""
    d = make_batch(seed, 12, 20)
    beyond = torch.arange(20).unsqueeze(0) >= d["lengths"].unsqueeze(1)
    for key in ("values", "returns", "advantages"):
        d[key] = d[key].masked_fill(beyond, 0.0)
    vpreds = (d["values"] + 0.8 * d["advantages"]).masked_fill(beyond, 0.0)
    cfg = CriticConfig(
        strategy="fsdp", ppo_micro_batch_size_per_gpu=1, rollout_n=1, cliprange_value=0.5, loss_agg_mode="token-mean"
    )
    info = verl_global_info(d["mask"])
    ours_in, ref_in = vpreds.clone().requires_grad_(True), vpreds.clone().requires_grad_(True)
    ours_total = ref_total = 0.0
    for start in range(0, 12, micro):
        part = slice(start, start + micro)
        ours, _ = algos.clipped_value_loss(
            ours_in[part],
            d["returns"][part],
            d["values"][part],
            d["mask"][part],
            0.5,
            "token-mean",
            norm=our_norm(info),
        )
        data, flatten = verl_layout(
            d["lengths"][part],
            20,
            {"response_mask": d["mask"][part].long(), "values": d["values"][part], "returns": d["returns"][part]},
            info,
        )
        ref, _ = verl_value_loss(cfg, {"values": flatten(ref_in[part])}, data)
        assert_matches("critic_loss.micro", ours, ref)
        ours.backward()
        ref.backward()
        ours_total, ref_total = ours_total + float(ours), ref_total + float(ref)
    whole, _ = algos.clipped_value_loss(vpreds, d["returns"], d["values"], d["mask"], 0.5, "token-mean")
    assert_matches("critic_loss.sum_of_micros", ours_total, ref_total)
    assert ours_total == pytest.approx(float(whole), rel=1e-6)
    assert_matches("critic_loss.grad", ours_in.grad, ref_in.grad)
