"""Properties of client_app.algos that parity with verl does not cover: group statistics,
masking, gradient accumulation, numerical guards, and FedProx (invariant 4)."""

from __future__ import annotations

import math
import weakref

import numpy as np
import pytest
import torch
from torch import nn
from transformers import Qwen2Config, Qwen2ForCausalLM

from client_app import algos

VOCAB, PROMPT, RESPONSE = 48, 5, 7


def rand(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def ragged_mask(batch: int, horizon: int, seed: int = 0) -> torch.Tensor:
    """Right-padded rows with interior holes (observation tokens); row 1 fully masked."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(2, horizon + 1, (batch,), generator=g)
    mask = (torch.arange(horizon) < lengths.unsqueeze(1)) & (torch.rand(batch, horizon, generator=g) < 0.75)
    mask[:, 0] = True
    mask[1] = False
    return mask


# ---------------------------------------------------------------- GRPO


@pytest.mark.parametrize("score,n", [(0.7, 8), (0.35, 8), (0.9, 3), (-0.3, 8), (1.0, 8), (0.0, 2)])
def test_a_group_of_equal_scores_gets_exactly_zero_advantage(score: float, n: int) -> None:
    """Before: the float mean of 8 x 0.7 missed 0.7 by ~1e-8 and the division by a std as small
    gave every episode of the group 0.056, a signal from nowhere (the invalid-action penalty
    makes such scores common). A neighbouring group with signal keeps its advantages."""
    rewards = torch.tensor([[score]] * n + [[1.0], [0.0]] * 2)
    adv, _ = algos.grpo_outcome_advantage(rewards, torch.ones_like(rewards), [0] * n + [1] * 4)
    assert torch.equal(adv[:n], torch.zeros(n, 1))
    assert torch.allclose(adv[n:, 0], torch.tensor([1.0, -1.0, 1.0, -1.0]) * 0.866025, atol=1e-5)


def test_grpo_advantages_have_zero_group_mean_and_unit_std() -> None:
    rewards = torch.zeros(12, 6)
    rewards[:, -1] = rand(12)
    mask = torch.ones(12, 6, dtype=torch.bool)
    groups = np.array(["a", "b", "c"] * 4)
    adv, _ = algos.grpo_outcome_advantage(rewards, mask, groups)
    row_adv = adv[:, 0]
    for g in "abc":
        members = row_adv[torch.from_numpy(groups == g)]
        assert abs(members.mean().item()) < 1e-6
        assert members.std().item() == pytest.approx(1.0, abs=1e-5)
    unscaled, _ = algos.grpo_outcome_advantage(rewards, mask, groups, norm_by_std=False)
    for g in "abc":
        members = torch.from_numpy(groups == g)
        assert torch.allclose(unscaled[members, 0], rewards[members, -1] - rewards[members, -1].mean(), atol=1e-6)


def test_grpo_advantage_fills_valid_tokens_only() -> None:
    mask = ragged_mask(6, 9)
    rewards = torch.zeros(6, 9)
    rewards[:, 0] = torch.tensor([1.0, 0.0, 0.5, 1.0, 0.0, 0.25])
    adv, returns = algos.grpo_outcome_advantage(rewards, mask, [0, 0, 0, 1, 1, 1])
    assert torch.equal(adv, returns) and adv.data_ptr() != returns.data_ptr()
    assert (adv[~mask] == 0).all()
    for row in range(6):
        valid = adv[row][mask[row]]
        assert torch.all(valid == valid[:1]), "one advantage per row, on every valid token"


def test_grpo_tied_group_gets_zero_advantage() -> None:
    rewards = torch.ones(4, 3)
    adv, _ = algos.grpo_outcome_advantage(rewards, torch.ones(4, 3), ["g"] * 4)
    assert torch.equal(adv, torch.zeros(4, 3))


def test_grpo_rejects_a_group_index_of_the_wrong_length() -> None:
    with pytest.raises(ValueError, match="one id per row"):
        algos.grpo_outcome_advantage(torch.zeros(4, 3), torch.ones(4, 3), [0, 0, 1])


# ---------------------------------------------------------------- masking and aggregation


def test_masked_tokens_contribute_nothing_to_loss_or_gradient() -> None:
    """Garbage (NaN, inf, huge) at masked positions changes neither the loss nor any gradient."""
    batch, horizon = 6, 10
    mask = ragged_mask(batch, horizon, seed=3)
    clean = {
        k: rand(batch, horizon, seed=i) for i, k in enumerate(["log_prob", "old_log_prob", "ref_log_prob", "entropy"])
    }
    clean["advantages"] = rand(batch, horizon, seed=9)
    dirty = {k: v.clone() for k, v in clean.items()}
    dirty["log_prob"][~mask] = float("nan")
    dirty["old_log_prob"][~mask] = float("inf")
    dirty["ref_log_prob"][~mask] = -float("inf")
    dirty["entropy"][~mask] = float("nan")
    dirty["advantages"][~mask] = 1e30
    for mode in algos.LOSS_AGG_MODES:
        spec = algos.ActorLossSpec(entropy_coeff=0.01, kl_coef=0.1, loss_agg_mode=mode)
        results = []
        for d in (clean, dirty):
            lp, ent = d["log_prob"].clone().requires_grad_(True), d["entropy"].clone().requires_grad_(True)
            out = algos.actor_loss(
                spec, lp, d["old_log_prob"], d["advantages"], mask, entropy=ent, ref_log_prob=d["ref_log_prob"]
            )
            out.loss.backward()
            results.append((out.loss, lp.grad, ent.grad))
        (loss_c, glp_c, gent_c), (loss_d, glp_d, gent_d) = results
        assert torch.isfinite(loss_d) and loss_d == loss_c, mode
        assert torch.equal(glp_d, glp_c) and torch.equal(gent_d, gent_c), mode
        assert (glp_d[~mask] == 0).all() and (gent_d[~mask] == 0).all(), mode


def test_empty_batch_aggregates_to_zero_not_nan() -> None:
    """Deliberate difference from verl (0/0 = NaN there): no valid token means no signal."""
    loss_mat = rand(3, 4).requires_grad_(True)
    empty = torch.zeros(3, 4, dtype=torch.bool)
    for mode in algos.LOSS_AGG_MODES:
        loss = algos.agg_loss(loss_mat, empty, mode)
        assert loss.item() == 0.0, mode
        (grad,) = torch.autograd.grad(loss, loss_mat)
        assert torch.equal(grad, torch.zeros(3, 4)), mode
    assert algos.masked_mean(loss_mat, empty).item() == 0.0


def test_seq_mean_modes_weigh_rows_not_tokens() -> None:
    loss_mat = torch.tensor([[1.0, 1.0, 1.0, 1.0], [3.0, 0.0, 0.0, 0.0], [5.0, 5.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0]])
    assert algos.agg_loss(loss_mat, mask, "token-mean").item() == pytest.approx(7 / 5)
    assert algos.agg_loss(loss_mat, mask, "token-sum").item() == pytest.approx(7.0)
    assert algos.agg_loss(loss_mat, mask, "seq-mean-token-mean").item() == pytest.approx((1 + 3) / 2)
    assert algos.agg_loss(loss_mat, mask, "seq-mean-token-sum").item() == pytest.approx((4 + 3) / 2)
    assert algos.agg_loss(loss_mat, mask, "seq-mean-token-sum-norm").item() == pytest.approx((4 + 3) / 2 / 4)
    with pytest.raises(ValueError, match="loss_agg_mode"):
        algos.agg_loss(loss_mat, mask, "mean")


@pytest.mark.parametrize("mode", algos.LOSS_AGG_MODES)
def test_micro_batches_with_aggnorm_sum_to_the_mini_batch_loss(mode: str) -> None:
    """micro_batch_size does not change the loss or its gradient (config: AlgoCfg.micro_batch_size)."""
    batch, horizon = 12, 8
    mask = ragged_mask(batch, horizon, seed=5)
    old = -rand(batch, horizon, seed=1).abs()
    lp = (old + 0.5 * rand(batch, horizon, seed=2)).requires_grad_(True)
    adv, ref, ent = (
        rand(batch, horizon, seed=3),
        old + 0.3 * rand(batch, horizon, seed=4),
        rand(batch, horizon, seed=6).abs(),
    )
    spec = algos.ActorLossSpec(entropy_coeff=0.01, kl_coef=0.05, loss_agg_mode=mode)
    full = algos.actor_loss(spec, lp, old, adv, mask, entropy=ent, ref_log_prob=ref)
    (full_grad,) = torch.autograd.grad(full.loss, lp)
    norm = algos.AggNorm.of(mask)
    total = torch.zeros(())
    for rows in torch.arange(batch).split(5):  # uneven micro-batches: 5, 5, 2
        micro = algos.actor_loss(
            spec, lp[rows], old[rows], adv[rows], mask[rows], entropy=ent[rows], ref_log_prob=ref[rows], norm=norm
        )
        total = total + micro.loss
    (micro_grad,) = torch.autograd.grad(total, lp)
    assert total.item() == pytest.approx(full.loss.item(), abs=1e-6)
    assert torch.allclose(micro_grad, full_grad, atol=1e-7)


# ---------------------------------------------------------------- policy loss, KL, value loss


def test_policy_loss_at_ratio_one_is_minus_mean_advantage() -> None:
    mask = ragged_mask(5, 6)
    lp = -rand(5, 6).abs().requires_grad_(True)
    adv = rand(5, 6, seed=1)
    out = algos.ppo_clip_policy_loss(lp.detach(), lp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2)
    assert out.loss.item() == pytest.approx(-algos.masked_mean(adv, mask).item(), abs=1e-6)
    assert out.clipfrac.item() == 0.0 and out.clipfrac_lower.item() == 0.0 and out.ppo_kl.item() == 0.0
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert torch.allclose(grad, torch.where(mask, -adv / mask.sum(), 0.0), atol=1e-7)


def test_clips_stop_the_gradient_where_they_bind() -> None:
    """A>0 and ratio above 1+high: clipped, no gradient. A<0 and ratio above c: loss = -A*c, no gradient."""
    old = torch.zeros(1, 4)
    lp = torch.tensor([[0.5, 0.5, 2.0, 0.05]], requires_grad=True)  # ratios 1.65, 1.65, 7.39, 1.05
    adv = torch.tensor([[1.0, -1.0, -2.0, 1.0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    out = algos.ppo_clip_policy_loss(
        old, lp, adv, mask, clip_ratio_low=0.2, clip_ratio_high=0.2, clip_ratio_c=3.0, loss_agg_mode="token-sum"
    )
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert grad[0, 0] == 0.0 and grad[0, 2] == 0.0  # ratio clip (A>0) and dual clip (A<0)
    assert grad[0, 1] != 0.0 and grad[0, 3] != 0.0  # A<0 below c: unclipped side is the max
    expected = -1.2 + math.exp(0.5) + 2.0 * 3.0 - math.exp(0.05)
    assert out.loss.item() == pytest.approx(expected, rel=1e-6)
    assert out.clipfrac.item() == pytest.approx(0.25) and out.clipfrac_lower.item() == pytest.approx(0.25)


def test_clip_settings_are_validated() -> None:
    with pytest.raises(ValueError, match="clip_ratio_c"):
        algos.ActorLossSpec(clip_ratio_c=1.0)
    with pytest.raises(ValueError, match="clip ratios"):
        algos.ActorLossSpec(clip_ratio_low=1.0)
    with pytest.raises(ValueError, match="kl"):
        algos.ActorLossSpec(kl_type="k4")
    with pytest.raises(ValueError, match="ref_log_prob"):
        algos.actor_loss(algos.ActorLossSpec(kl_coef=0.1), rand(2, 3), rand(2, 3), rand(2, 3), torch.ones(2, 3))


def test_kl_estimators_vanish_at_equal_policies_and_k3_is_nonnegative() -> None:
    lp = -rand(4, 5).abs()
    for kind in algos.KL_ESTIMATORS:
        assert torch.equal(algos.kl_penalty(lp, lp, kind), torch.zeros(4, 5)), kind
    k3 = algos.kl_penalty(lp, lp + 3 * rand(4, 5, seed=1), "k3")
    assert (k3 >= 0).all()
    with pytest.raises(ValueError, match="KL estimator"):
        algos.kl_penalty(lp, lp, "full")


def test_k3_plus_has_the_k3_value_and_the_k2_gradient() -> None:
    ref = -rand(3, 4, seed=1).abs()
    lp = (ref + rand(3, 4, seed=2)).requires_grad_(True)
    value = algos.kl_penalty(lp, ref, "k3+")
    assert torch.equal(value, algos.kl_penalty(lp, ref, "k3"))
    (grad,) = torch.autograd.grad(value.sum(), lp)
    assert torch.allclose(grad, (lp - ref).detach(), atol=1e-7)


def test_value_loss_clip_keeps_the_pessimistic_side() -> None:
    old = torch.zeros(1, 3)
    returns = torch.tensor([[2.0, 2.0, -1.0]])
    vpreds = torch.tensor([[1.0, 3.0, 0.1]], requires_grad=True)
    loss, clipfrac = algos.clipped_value_loss(vpreds, returns, old, torch.ones(1, 3), 0.5, "token-sum")
    # token 0: clipped to 0.5 -> (1.5)^2 > 1^2, gradient cut; token 1: clipped 0.5 -> 2.25 > 1; token 2: inside the clip
    assert loss.item() == pytest.approx(0.5 * (2.25 + 2.25 + 1.21))
    (grad,) = torch.autograd.grad(loss, vpreds)
    assert grad[0, 0] == 0.0 and grad[0, 1] == 0.0 and grad[0, 2].item() == pytest.approx(1.1)
    assert clipfrac.item() == pytest.approx(2 / 3)


# ---------------------------------------------------------------- GAE


def test_gae_with_unit_gamma_lambda_returns_reward_to_go() -> None:
    rewards, values = rand(3, 6), rand(3, 6, seed=1)
    _, returns = algos.gae_advantage_return(rewards, values, torch.ones(3, 6), gamma=1.0, lam=1.0)
    reward_to_go = rewards.flip(-1).cumsum(-1).flip(-1)
    assert torch.allclose(returns, reward_to_go, atol=1e-5)


def test_gae_skips_observation_tokens() -> None:
    """Splicing masked observation tokens into a response leaves the valid tokens' targets unchanged."""
    rewards, values = rand(2, 5), rand(2, 5, seed=1)
    _, plain = algos.gae_advantage_return(rewards, values, torch.ones(2, 5), gamma=0.9, lam=0.8)
    keep = torch.tensor([0, 1, 2, 2, 2, 3, 4, 4])  # duplicate slots become observations
    spliced_mask = torch.tensor([1, 1, 1, 0, 0, 1, 1, 0], dtype=torch.bool).expand(2, 8)
    spliced_rewards = torch.where(spliced_mask, rewards[:, keep], 99.0)
    spliced_values = torch.where(spliced_mask, values[:, keep], -7.0)
    _, spliced = algos.gae_advantage_return(spliced_rewards, spliced_values, spliced_mask, gamma=0.9, lam=0.8)
    assert torch.allclose(spliced[spliced_mask].view(2, 5), plain, atol=1e-6)


# ---------------------------------------------------------------- logits


def test_entropy_and_log_probs_agree_with_fp64_truth() -> None:
    logits = 4 * rand(3, 5, 257)
    labels = torch.randint(0, 257, (3, 5), generator=torch.Generator().manual_seed(1))
    truth_logp = torch.log_softmax(logits.double(), -1)
    truth_entropy = -(truth_logp.exp() * truth_logp).sum(-1)
    assert torch.allclose(algos.entropy_from_logits(logits).double(), truth_entropy, atol=1e-5)
    assert torch.allclose(
        algos.token_log_probs(logits, labels).double(),
        truth_logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1),
        atol=1e-5,
    )
    assert algos.entropy_from_logits(torch.zeros(1000)).item() == pytest.approx(math.log(1000), rel=1e-6)


def test_bf16_logits_are_computed_in_fp32() -> None:
    logits = (4 * rand(2, 3, 300)).to(torch.bfloat16)
    labels = torch.randint(0, 300, (2, 3), generator=torch.Generator().manual_seed(1))
    assert algos.token_log_probs(logits, labels).dtype == torch.float32
    assert torch.equal(algos.token_log_probs(logits, labels), algos.token_log_probs(logits.float(), labels))
    assert torch.equal(algos.entropy_from_logits(logits), algos.entropy_from_logits(logits.float()))


# ---------------------------------------------------------------- FedProx (invariant 4)


class ActorCritic(nn.Module):
    """A real tiny causal LM (the policy) and a separate critic that shares nothing with it."""

    def __init__(self) -> None:
        super().__init__()
        with torch.random.fork_rng():
            torch.manual_seed(0)
            self.actor = Qwen2ForCausalLM(
                Qwen2Config(
                    vocab_size=VOCAB,
                    hidden_size=32,
                    intermediate_size=64,
                    num_hidden_layers=2,
                    num_attention_heads=4,
                    num_key_value_heads=2,
                    max_position_embeddings=64,
                )
            )
            self.critic = nn.Sequential(nn.Embedding(VOCAB, 16), nn.Tanh(), nn.Linear(16, 1))

    def losses(self, input_ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A GRPO actor loss through the real forward pass, and a clipped value loss."""
        logits = self.actor(input_ids).logits[:, PROMPT - 1 : -1]
        labels = input_ids[:, PROMPT:]
        log_prob = algos.token_log_probs(logits, labels)
        rewards = torch.zeros_like(log_prob)
        rewards[:, -1] = torch.arange(len(input_ids), dtype=torch.float32) % 3
        adv, returns = algos.grpo_outcome_advantage(rewards, mask, [i // 2 for i in range(len(input_ids))])
        actor = algos.actor_loss(
            algos.ActorLossSpec(entropy_coeff=0.01),
            log_prob,
            log_prob.detach() - 0.05,
            adv,
            mask,
            entropy=algos.entropy_from_logits(logits),
        )
        values = self.critic(labels).squeeze(-1)
        critic, _ = algos.clipped_value_loss(values, returns, values.detach() + 0.1, mask, 0.5)
        return actor.loss, critic


@pytest.fixture(scope="module")
def batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (6, PROMPT + RESPONSE), generator=torch.Generator().manual_seed(2))
    return ids, ragged_mask(6, RESPONSE, seed=4)


def drifted_model() -> tuple[ActorCritic, algos.FedProxAnchor, dict[str, torch.Tensor]]:
    """Load 'global' weights, snapshot the anchor, then drift the whole model as local training would."""
    model = ActorCritic()
    anchor = algos.FedProxAnchor.snapshot(model.actor.named_parameters())
    global_actor = {n: p.detach().clone() for n, p in model.actor.named_parameters()}
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.add_(0.01 * rand(*p.shape, seed=100 + i))
    return model, anchor, global_actor


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_fedprox_gradient_is_plain_plus_mu_delta(batch) -> None:
    mu = 0.37
    model, anchor, global_actor = drifted_model()
    actor_loss, critic_loss = model.losses(*batch)
    (actor_loss + critic_loss).backward()
    plain = grads(model)
    model.zero_grad()

    actor_loss, critic_loss = model.losses(*batch)
    (actor_loss + critic_loss + anchor.term(model.actor.named_parameters(), mu)).backward()
    with_term = grads(model)
    model.zero_grad()

    actor_loss, critic_loss = model.losses(*batch)
    (actor_loss + critic_loss).backward()
    anchor.add_grad_(model.actor.named_parameters(), mu)
    with_add = grads(model)

    for name, p in model.actor.named_parameters():
        expected = plain[f"actor.{name}"] + mu * (p.detach() - global_actor[name])
        assert (p.detach() - global_actor[name]).abs().max() > 0, "the test must drift every actor tensor"
        assert torch.allclose(with_term[f"actor.{name}"], expected, atol=1e-6, rtol=0), name
        assert torch.allclose(with_add[f"actor.{name}"], expected, atol=1e-6, rtol=0), name
    term = anchor.term(model.actor.named_parameters(), mu).item()
    assert term == pytest.approx(
        mu / 2 * sum(((p.detach() - global_actor[n]) ** 2).sum().item() for n, p in model.actor.named_parameters()),
        rel=1e-5,
    )


def test_fedprox_never_touches_critic(batch) -> None:
    model, anchor, _ = drifted_model()
    assert not any(name.startswith("critic") for name in anchor.tensors)
    actor_loss, critic_loss = model.losses(*batch)
    (actor_loss + critic_loss).backward()
    plain = grads(model)
    model.zero_grad()
    actor_loss, critic_loss = model.losses(*batch)
    (actor_loss + critic_loss + anchor.term(model.actor.named_parameters(), 1.0)).backward()
    anchor.add_grad_(model.actor.named_parameters(), 1.0)
    for name, g in grads(model).items():
        if name.startswith("critic."):
            assert torch.equal(g, plain[name]), name
    # Handing the whole model (critic included) to an actor anchor is refused, not silently accepted.
    with pytest.raises(KeyError, match="no entry for parameter"):
        anchor.term(model.named_parameters(), 1.0)
    with pytest.raises(KeyError, match="without a parameter"):
        anchor.add_grad_(list(model.actor.named_parameters())[1:], 1.0)


def test_fedprox_mu_zero_changes_nothing(batch) -> None:
    model, anchor, _ = drifted_model()
    actor_loss, critic_loss = model.losses(*batch)
    (actor_loss + critic_loss).backward()
    plain = grads(model)
    anchor.add_grad_(model.actor.named_parameters(), 0.0)
    assert all(torch.equal(g, plain[n]) for n, g in grads(model).items())
    assert anchor.term(model.actor.named_parameters(), 0.0).item() == 0.0
    with pytest.raises(ValueError, match="mu"):
        anchor.term(model.actor.named_parameters(), -0.1)


def test_fedprox_anchor_is_a_detached_fp32_copy() -> None:
    layer = nn.Linear(4, 3).to(torch.bfloat16)
    anchor = algos.FedProxAnchor.snapshot(layer.named_parameters())
    before = anchor.tensors["weight"].clone()
    with torch.no_grad():
        layer.weight.add_(1.0)
    assert torch.equal(anchor.tensors["weight"], before)
    assert all(t.dtype == torch.float32 and not t.requires_grad for t in anchor.tensors.values())
    assert anchor.tensors["weight"].data_ptr() != layer.weight.data_ptr()


def test_fedprox_release_frees_the_anchor_and_fails_closed() -> None:
    layer = nn.Linear(4, 3)
    anchor = algos.FedProxAnchor.snapshot(layer.named_parameters())
    copy_ref = weakref.ref(anchor.tensors["weight"])
    anchor.release()
    assert anchor.released and copy_ref() is None  # the copy's storage is gone, not merely hidden
    with pytest.raises(RuntimeError, match="released"):
        anchor.term(layer.named_parameters(), 0.1)
    with pytest.raises(RuntimeError, match="released"):
        anchor.add_grad_(layer.named_parameters(), 0.1)
    anchor.release()  # idempotent
