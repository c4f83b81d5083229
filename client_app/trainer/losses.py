"""The recipe's objectives: the policy's and the critic's loss specs.

The fit loop hands them to every `TrainingEngine.step`; the verl engine composes verl's own
losses from the same recipe when it is built and refuses a step asked for another spec. Both
read them here, so an engine never imports the loop that drives it.
"""

from __future__ import annotations

from client_app.algos import ActorLossSpec, ValueLossSpec
from fl_app.config import Config


def loss_specs(cfg: Config) -> tuple[ActorLossSpec, ValueLossSpec]:
    """The policy and value objectives the recipe asks for (both engines train these)."""
    a, r = cfg.algo, cfg.rollout
    horizon = r.max_prompt_tokens if r.mode == "concat" else r.max_response_tokens
    policy = ActorLossSpec(
        clip_ratio_low=a.clip_ratio,
        clip_ratio_high=a.clip_ratio,
        clip_ratio_c=a.clip_ratio_c,
        entropy_coeff=a.entropy_coeff,
        kl_coef=a.kl_coef,
        kl_type=a.kl_type,
        loss_agg_mode=a.loss_agg_mode,
        horizon=horizon,
    )
    value = ValueLossSpec(
        value_clip=a.critic.value_clip, coef=a.critic.loss_coef, loss_agg_mode=a.loss_agg_mode, horizon=horizon
    )
    return policy, value
