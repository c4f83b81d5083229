"""Advantage estimators on padded [B, T] response batches.

Semantics match `verl.trainer.ppo.core_algos` 0.9.1 (`compute_grpo_outcome_advantage`,
`compute_gae_advantage_return`); tests/trainer/test_algos_parity.py holds them to 1e-6.
Advantages are targets, not functions of the parameters being trained: no autograd graph.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch

from client_app.algos.masked import masked_whiten


def _group_codes(group_index: Sequence[Hashable], batch: int, device: torch.device) -> tuple[torch.Tensor, int]:
    """Map arbitrary group ids (uids, task ids) to 0..G-1 in first-seen order."""
    if len(group_index) != batch:
        raise ValueError(f"group_index has {len(group_index)} ids for a batch of {batch} rows; give one id per row")
    codes: dict[Hashable, int] = {}
    inverse = [codes.setdefault(g, len(codes)) for g in group_index]
    return torch.tensor(inverse, dtype=torch.long, device=device), len(codes)


@torch.no_grad()
def grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_index: Sequence[Hashable],
    eps: float = 1e-6,
    norm_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GRPO: each row's score relative to the other rows of its group, on every response token.

    Args:
        token_level_rewards: [B, T]; a row's score is the sum of its entries (the trainer puts the
            episode reward on the row's last response token).
        response_mask: [B, T] 0/1, the tokens the policy generated.
        group_index: one hashable group id per row (e.g. a numpy array of uids). Rows sharing an id
            are one GRPO group: n rollouts of the same task (and, in multi-turn, all their step rows).
        eps: added to the group std before dividing.
        norm_by_std: False gives Dr.GRPO (mean-centred, unscaled).

    Returns:
        (advantages, returns), both [B, T] and equal, zero on masked tokens:
        (score - group mean) / (group std + eps), std unbiased. A group of one row has
        mean 0 and std 1 (so its advantage is its raw score scaled by 1/(1+eps)), as in verl.
        A group of equal scores gets exactly 0 (verl's float mean leaves a rounding residue
        that its std division amplifies for some scores and group sizes).
    """
    scores = token_level_rewards.sum(dim=-1)
    codes, n_groups = _group_codes(group_index, scores.shape[0], scores.device)
    zeros = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    count = zeros.index_add(0, codes, torch.ones_like(scores))
    mean = zeros.index_add(0, codes, scores) / count
    centered = scores - mean[codes]
    std = (zeros.index_add(0, codes, centered * centered) / (count - 1).clamp(min=1)).sqrt()
    singleton = count == 1
    mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)
    centered = scores - mean[codes]
    # A group whose scores are all equal carries no signal: exactly 0. The rounded float mean
    # leaves ~1e-8, which the division by a std as small makes ~0.05 (8 x 0.7 -> 0.056).
    hi = zeros.scatter_reduce(0, codes, scores, "amax", include_self=False)
    lo = zeros.scatter_reduce(0, codes, scores, "amin", include_self=False)
    centered = torch.where(((hi == lo) & ~singleton)[codes], torch.zeros_like(centered), centered)
    row_adv = centered / (std[codes] + eps) if norm_by_std else centered
    advantages = torch.where(response_mask.bool(), row_adv.unsqueeze(-1), scores.new_zeros(()))
    return advantages, advantages.clone()


@torch.no_grad()
def gae_advantage_return(
    token_level_rewards: torch.Tensor,
    values: torch.Tensor,
    response_mask: torch.Tensor,
    gamma: float,
    lam: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized Advantage Estimation over response tokens, then whitened over the mask.

    Tokens outside the mask (e.g. environment observation tokens spliced into a multi-turn
    response) are skipped: the TD recursion jumps over them, carrying the next value and the
    running advantage through unchanged. Masked positions receive the carried advantage.

    Returns:
        advantages [B, T] whitened over `response_mask` (zero mean, unit variance), and
        returns [B, T] = un-whitened advantages + values (the value-function targets).
    """
    batch, horizon = token_level_rewards.shape
    valid = response_mask.bool()
    next_value = torch.zeros(batch, dtype=values.dtype, device=values.device)
    running = torch.zeros_like(next_value)
    advantages = torch.empty_like(values)
    for t in range(horizon - 1, -1, -1):
        delta = token_level_rewards[:, t] + gamma * next_value - values[:, t]
        running = torch.where(valid[:, t], delta + gamma * lam * running, running)
        next_value = torch.where(valid[:, t], values[:, t], next_value)
        advantages[:, t] = running
    returns = advantages + values
    return masked_whiten(advantages, response_mask), returns
