"""PPO-family losses on padded [B, T] response batches: aggregation, clipped policy loss, KL
penalty estimators, clipped value loss, and the composed actor loss.

Semantics match verl 0.9.1 (`verl.trainer.ppo.core_algos.agg_loss`, `compute_policy_loss_vanilla`,
`kl_penalty`, `compute_value_loss`, and the composition in `verl.workers.utils.losses.ppo_loss`);
tests/trainer/test_algos_parity.py holds them to 1e-6. One deliberate difference: a batch with no valid
token aggregates to 0 where verl divides 0 by 0 (NaN would poison the weights).

Gradient accumulation: aggregate every micro-batch with the `AggNorm` of its whole mini-batch and
backward each micro loss; the accumulated gradient is then exactly that of the unsplit mini-batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

from client_app.algos.masked import masked_count, masked_mean, masked_sum

LossAggMode = Literal["token-mean", "token-sum", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)

# Per-token KL estimators of KL(pi || ref) from sampled-token log-probs (Schulman, "Approximating
# KL divergence"). Aliases as in verl. A trailing "+" keeps the forward value but takes the k2
# gradient (straight-through), whose expectation is the gradient of the true KL.
KL_ESTIMATORS: tuple[str, ...] = ("k1", "kl", "abs", "k2", "mse", "k3", "low_var_kl")


@dataclass(frozen=True)
class AggNorm:
    """Loss denominators of a whole mini-batch, shared by all of its micro-batches.

    num_tokens: valid tokens in the mini-batch (token-mean).
    num_seqs: rows with at least one valid token (seq-mean-* modes). verl's engines pass the row
        count here instead; the two differ only when a row is fully masked.
    horizon: the constant seq-mean-token-sum-norm divides by (None: the padded width, which
        depends on the micro-batch; a trainer passes the generation budget).
    """

    num_tokens: float
    num_seqs: float
    horizon: float | None = None

    @classmethod
    def of(cls, response_mask: torch.Tensor) -> AggNorm:
        """The denominators of the mini-batch whose [B, T] mask is given."""
        return cls(
            num_tokens=float(masked_count(response_mask)),
            num_seqs=float((masked_count(response_mask, dim=-1) > 0).sum()),
        )


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    loss_agg_mode: LossAggMode = "token-mean",
    norm: AggNorm | None = None,
    horizon: int | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss [B, T] to a scalar over the valid tokens.

    token-mean: sum over valid tokens / number of valid tokens (long rows weigh more).
    token-sum: sum over valid tokens.
    seq-mean-token-sum: mean over non-empty rows of each row's token sum.
    seq-mean-token-mean: mean over non-empty rows of each row's token mean (rows weigh equally).
    seq-mean-token-sum-norm: seq-mean-token-sum / horizon (default: T), Dr.GRPO's constant scale.
    `norm` replaces the local denominators by the mini-batch ones (see AggNorm).
    """
    if loss_agg_mode == "token-mean":
        denominator = norm.num_tokens if norm is not None else masked_count(loss_mask)
        return _divide_counts(masked_sum(loss_mat, loss_mask), denominator)
    if loss_agg_mode == "token-sum":
        return masked_sum(loss_mat, loss_mask)
    if loss_agg_mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; choose one of {LOSS_AGG_MODES}")
    row_tokens = masked_count(loss_mask, dim=-1)
    per_row = masked_sum(loss_mat, loss_mask, dim=-1)
    if loss_agg_mode == "seq-mean-token-mean":
        per_row = per_row / row_tokens.clamp(min=1)
    nonempty = row_tokens > 0
    denominator = norm.num_seqs if norm is not None else nonempty.sum()
    loss = _divide_counts(masked_sum(per_row, nonempty), denominator)
    if loss_agg_mode == "seq-mean-token-sum-norm":
        steps: float | None = horizon
        if steps is None:
            steps = norm.horizon if norm is not None and norm.horizon is not None else loss_mask.shape[-1]
        loss = loss / steps
    return loss


def _divide_counts(total: torch.Tensor, count: torch.Tensor | float) -> torch.Tensor:
    """total / count for a count of tokens or rows; an empty selection (total 0, count 0) gives 0."""
    return total / (count.clamp(min=1) if isinstance(count, torch.Tensor) else max(count, 1.0))


def check_clip_ratios(clip_ratio_low: float, clip_ratio_high: float, clip_ratio_c: float) -> None:
    """Raise on clip settings that make the PPO objective meaningless."""
    if not 0.0 <= clip_ratio_low < 1.0 or clip_ratio_high < 0.0:
        raise ValueError(
            f"clip ratios must satisfy 0 <= clip_ratio_low < 1 and clip_ratio_high >= 0, "
            f"got low={clip_ratio_low}, high={clip_ratio_high}"
        )
    if clip_ratio_c <= 1.0:
        raise ValueError(
            f"dual-clip constant clip_ratio_c must be > 1 (it bounds -A * ratio for A < 0), got {clip_ratio_c}"
        )


@dataclass(frozen=True)
class PolicyLoss:
    """Output of `ppo_clip_policy_loss`; the statistics are detached micro-batch means."""

    loss: torch.Tensor  # scalar, carries the graph
    clipfrac: torch.Tensor  # valid tokens where the ratio clip bound the objective
    ppo_kl: torch.Tensor  # mean(old_log_prob - log_prob): how far the policy moved
    clipfrac_lower: torch.Tensor  # valid tokens with A < 0 where the dual-clip bound was active


def ppo_clip_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    clip_ratio_low: float,
    clip_ratio_high: float,
    clip_ratio_c: float = 3.0,
    loss_agg_mode: LossAggMode = "token-mean",
    norm: AggNorm | None = None,
) -> PolicyLoss:
    """PPO clipped surrogate with dual clip, per token, aggregated by `agg_loss`.

    Per token, with r = exp(clamp(log_prob - old_log_prob, -20, 20)):
      loss = max(-A r, -A clip(r, 1 - low, 1 + high)), and for A < 0 additionally
      loss = min(loss, -A c), so a huge ratio on a bad action cannot blow up the update.
    """
    check_clip_ratios(clip_ratio_low, clip_ratio_high, clip_ratio_c)
    log_ratio = torch.clamp(log_prob - old_log_prob, min=-20.0, max=20.0)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pessimistic = torch.maximum(unclipped, clipped)
    dual_bound = -advantages * clip_ratio_c
    negative = advantages < 0
    per_token = torch.where(negative, torch.minimum(pessimistic, dual_bound), pessimistic)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > unclipped).float(), response_mask)
        clipfrac_lower = masked_mean(((pessimistic > dual_bound) & negative).float(), response_mask)
        ppo_kl = masked_mean(-log_ratio, response_mask)
    return PolicyLoss(
        loss=agg_loss(per_token, response_mask, loss_agg_mode, norm),
        clipfrac=clipfrac,
        ppo_kl=ppo_kl,
        clipfrac_lower=clipfrac_lower,
    )


def kl_penalty(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, kind: str) -> torch.Tensor:
    """Per-token estimate of KL(pi || ref) from the sampled tokens' log-probs ([B, T] -> [B, T]).

    k1 / kl: log_prob - ref_log_prob (unbiased, high variance, can be negative).
    abs: |log_prob - ref_log_prob|.
    k2 / mse: 0.5 (log_prob - ref_log_prob)^2.
    k3 / low_var_kl: exp(d) - d - 1 with d = ref_log_prob - log_prob clamped to [-20, 20], the
        result clamped to [-10, 10] (non-negative, low variance).
    A "+" suffix (e.g. "k3+") keeps the value and takes the k2 gradient.
    """
    base = kl_estimator_base(kind)
    diff = log_prob - ref_log_prob
    if base in ("k1", "kl"):
        value = diff
    elif base == "abs":
        value = diff.abs()
    elif base in ("k2", "mse"):
        value = 0.5 * diff.square()
    else:
        d = torch.clamp(-diff, min=-20.0, max=20.0)
        value = torch.clamp(torch.exp(d) - d - 1.0, min=-10.0, max=10.0)
    if base == kind or base in ("k2", "mse"):
        return value
    k2 = 0.5 * diff.square()
    return value.detach() + (k2 - k2.detach())


def kl_estimator_base(kind: str) -> str:
    """The estimator name without its optional "+" suffix; raises on an unknown name."""
    base = kind[:-1] if kind.endswith("+") else kind
    if base not in KL_ESTIMATORS:
        raise ValueError(f"unknown KL estimator {kind!r}; choose one of {KL_ESTIMATORS} (optionally with a '+' suffix)")
    return base


def clipped_value_loss(
    vpreds: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    response_mask: torch.Tensor,
    clip_range: float,
    loss_agg_mode: LossAggMode = "token-mean",
    norm: AggNorm | None = None,
    coef: float = 0.5,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO value loss: coef * agg(max((v - R)^2, (clip(v, v_old -+ clip_range) - R)^2)).

    coef 0.5 is verl 0.9.1's convention (the parity default); the FedAgent fork used 1.0 (the
    field log's 2026-07-22 critic-loss entry; `algo.critic.loss_coef`). Returns (loss, clipfrac),
    clipfrac detached.
    """
    vclipped = torch.clamp(vpreds, min=old_values - clip_range, max=old_values + clip_range)
    plain = (vpreds - returns).square()
    clipped = (vclipped - returns).square()
    loss = coef * agg_loss(torch.maximum(plain, clipped), response_mask, loss_agg_mode, norm)
    with torch.no_grad():
        clipfrac = masked_mean((clipped > plain).float(), response_mask)
    return loss, clipfrac


@dataclass(frozen=True)
class ActorLossSpec:
    """Hyper-parameters of the actor objective; build once per trainer from the algo config."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    entropy_coeff: float = 0.0
    kl_coef: float = 0.0
    kl_type: str = "low_var_kl"
    loss_agg_mode: LossAggMode = "token-mean"
    horizon: int | None = None  # seq-mean-token-sum-norm's constant (see AggNorm)

    def __post_init__(self) -> None:
        check_clip_ratios(self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c)
        if self.entropy_coeff < 0 or self.kl_coef < 0:
            raise ValueError(f"entropy_coeff and kl_coef must be >= 0, got {self.entropy_coeff}, {self.kl_coef}")
        kl_estimator_base(self.kl_type)
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"unknown loss_agg_mode {self.loss_agg_mode!r}; choose one of {LOSS_AGG_MODES}")


@dataclass(frozen=True)
class ValueLossSpec:
    """Hyper-parameters of the critic objective (see `clipped_value_loss`)."""

    value_clip: float
    coef: float
    loss_agg_mode: LossAggMode = "token-mean"
    horizon: int | None = None

    def __post_init__(self) -> None:
        if self.value_clip <= 0 or self.coef <= 0:
            raise ValueError(f"value_clip and coef must be > 0, got {self.value_clip}, {self.coef}")
        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"unknown loss_agg_mode {self.loss_agg_mode!r}; choose one of {LOSS_AGG_MODES}")


@dataclass(frozen=True)
class ActorLoss:
    """The scalar to backward, and detached metrics.

    metrics: pg_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower, plus entropy (when entropy was
    given) and kl_loss (when ref_log_prob was given). With an `AggNorm`, pg_loss / entropy /
    kl_loss are this micro-batch's share (sum them over micro-batches); the fractions and
    ppo_kl are micro-batch means (average them).
    """

    loss: torch.Tensor
    metrics: dict[str, torch.Tensor]


def actor_loss(
    spec: ActorLossSpec,
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    *,
    entropy: torch.Tensor | None = None,
    ref_log_prob: torch.Tensor | None = None,
    norm: AggNorm | None = None,
) -> ActorLoss:
    """pg_loss - entropy_coeff * agg(entropy) + kl_coef * agg(kl_penalty(log_prob, ref_log_prob)).

    The same composition as verl's actor `ppo_loss`: every term uses the same mask, aggregation
    mode and `norm`. `entropy` is the per-token entropy [B, T] (with its graph when
    entropy_coeff > 0). The FedProx term is not part of this loss: see `client_app.algos.fedprox`.
    """
    if spec.kl_coef > 0 and ref_log_prob is None:
        raise ValueError("kl_coef > 0 needs ref_log_prob (the reference model's log-probs); pass it or set kl_coef=0")
    pg = ppo_clip_policy_loss(
        old_log_prob,
        log_prob,
        advantages,
        response_mask,
        clip_ratio_low=spec.clip_ratio_low,
        clip_ratio_high=spec.clip_ratio_high,
        clip_ratio_c=spec.clip_ratio_c,
        loss_agg_mode=spec.loss_agg_mode,
        norm=norm,
    )
    loss = pg.loss
    metrics = {
        "pg_loss": pg.loss.detach(),
        "pg_clipfrac": pg.clipfrac,
        "ppo_kl": pg.ppo_kl,
        "pg_clipfrac_lower": pg.clipfrac_lower,
    }
    if entropy is not None:
        entropy_term = agg_loss(entropy, response_mask, spec.loss_agg_mode, norm)
        loss = loss - spec.entropy_coeff * entropy_term
        metrics["entropy"] = entropy_term.detach()
    if ref_log_prob is not None:
        kl_term = agg_loss(kl_penalty(log_prob, ref_log_prob, spec.kl_type), response_mask, spec.loss_agg_mode, norm)
        loss = loss + spec.kl_coef * kl_term
        metrics["kl_loss"] = kl_term.detach()
    return ActorLoss(loss=loss, metrics=metrics)
