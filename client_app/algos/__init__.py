"""The builtin trainer's RL algorithms: advantages, losses, per-token logit quantities, FedProx.

All batch tensors are padded [B, T] over response tokens with a 0/1 `response_mask` marking the
tokens the policy generated. Semantics match verl 0.9.1's `core_algos` (held to 1e-6 by
tests/trainer/test_algos_parity.py), so a run on the builtin backend and one on the verl backend
optimise the same objective.

A GRPO update step, in order:
  1. `grpo_outcome_advantage(rewards, mask, group_ids)` on the whole rollout batch;
  2. per mini-batch `norm = AggNorm.of(mini_mask)`; per micro-batch
     `log_prob = token_log_probs(logits / T, labels)`, `entropy = entropy_from_logits(logits / T)`,
     `actor_loss(spec, log_prob, old_log_prob, adv, mask, entropy=..., ref_log_prob=..., norm=norm)`
     and backward;
  3. FedProx (if mu > 0): `anchor.add_grad_(actor.named_parameters(), mu)`; then clip, step.
"""

from client_app.algos.advantages import (
    discounted_step_returns,
    gae_advantage_return,
    gigpo_advantage,
    grpo_outcome_advantage,
)
from client_app.algos.fedprox import FedProxAnchor, fedprox_term
from client_app.algos.logits import entropy_from_logits, token_log_probs
from client_app.algos.losses import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    ActorLoss,
    ActorLossSpec,
    AggNorm,
    LossAggMode,
    PolicyLoss,
    ValueLossSpec,
    actor_loss,
    agg_loss,
    clipped_value_loss,
    kl_penalty,
    ppo_clip_policy_loss,
)
from client_app.algos.masked import masked_mean, masked_sum, masked_var, masked_whiten

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "ActorLoss",
    "ActorLossSpec",
    "AggNorm",
    "FedProxAnchor",
    "LossAggMode",
    "PolicyLoss",
    "ValueLossSpec",
    "actor_loss",
    "agg_loss",
    "clipped_value_loss",
    "entropy_from_logits",
    "fedprox_term",
    "discounted_step_returns",
    "gae_advantage_return",
    "gigpo_advantage",
    "grpo_outcome_advantage",
    "kl_penalty",
    "masked_mean",
    "masked_sum",
    "masked_var",
    "masked_whiten",
    "ppo_clip_policy_loss",
    "token_log_probs",
]
