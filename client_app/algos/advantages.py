"""Advantage estimators on padded [B, T] response batches.

Semantics match `verl.trainer.ppo.core_algos` 0.9.1 (`compute_grpo_outcome_advantage`,
`compute_gae_advantage_return`; tests/trainer/test_algos_parity.py holds them to 1e-6) and
verl-agent's `gigpo/core_gigpo.py` at d0b9724 (`compute_gigpo_outcome_advantage`,
`compute_step_discounted_returns`; tests/trainer/test_gigpo.py holds them to 1e-6 against golden
outputs of verl-agent's own functions).

GiGPO (Feng et al., "Group-in-Group Policy Optimization for LLM Agent Training", arXiv
2505.10978; reference implementation verl-agent, langfengQ/verl-agent @ d0b9724) keeps GRPO's
episode-level group (the n trajectories of one task, scored by their final outcome) and adds a
step-level group inside it: every step of the group's trajectories taken in the same anchor
state (identical environment observation, without the history the prompt adds) is compared with
the others on its discounted return from that step on, G_t = sum_k gamma^k r_{t+k}. The step's
advantage is A_E(trajectory) + w x A_S(step), each level normalised in its group by its mean
(`mean_norm`) or its mean and std (`mean_std_norm`). Two details of the reference are kept: the
episode-level mean and std run over the group's step rows (a trajectory weighs its number of
steps), and a step group of one gets step advantage 0 (its own mean), while an episode group of
one keeps its raw score (mean 0, std 1), as in GRPO.

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


def _relative(
    scores: torch.Tensor, codes: torch.Tensor, n_groups: int, eps: float, norm_by_std: bool, singleton_mean: bool
) -> torch.Tensor:
    """Each score relative to its group: (score - mean) / (std + eps), std unbiased (or only
    centred when not `norm_by_std`). A group of one has std 1 and mean 0 (GRPO, as in verl) or,
    with `singleton_mean`, its own score (GiGPO's step groups: advantage 0). A group of equal
    scores gets exactly 0 (the rounded float mean leaves ~1e-8, which the division by a std as
    small makes ~0.05: 8 x 0.7 -> 0.056)."""
    zeros = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device)
    count = zeros.index_add(0, codes, torch.ones_like(scores))
    mean = zeros.index_add(0, codes, scores) / count
    centered = scores - mean[codes]
    std = (zeros.index_add(0, codes, centered * centered) / (count - 1).clamp(min=1)).sqrt()
    singleton = count == 1
    if not singleton_mean:
        mean = torch.where(singleton, torch.zeros_like(mean), mean)
    std = torch.where(singleton, torch.ones_like(std), std)
    centered = scores - mean[codes]
    hi = zeros.scatter_reduce(0, codes, scores, "amax", include_self=False)
    lo = zeros.scatter_reduce(0, codes, scores, "amin", include_self=False)
    centered = torch.where(((hi == lo) & ~singleton)[codes], torch.zeros_like(centered), centered)
    return centered / (std[codes] + eps) if norm_by_std else centered


def _on_mask(row_adv: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """One value per row, on every token of its mask (0 elsewhere)."""
    return torch.where(response_mask.bool(), row_adv.unsqueeze(-1), row_adv.new_zeros(()))


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
    advantages = _on_mask(_relative(scores, codes, n_groups, eps, norm_by_std, singleton_mean=False), response_mask)
    return advantages, advantages.clone()


@torch.no_grad()
def gigpo_advantage(
    token_level_rewards: torch.Tensor,
    step_returns: torch.Tensor,
    response_mask: torch.Tensor,
    anchors: Sequence[Hashable],
    group_index: Sequence[Hashable],
    step_weight: float = 1.0,
    norm_by_std: bool = False,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GiGPO (arXiv 2505.10978, Eq. 8): the episode-level group advantage plus `step_weight` x the
    step-level one, every row being one step (one action) of a trajectory.

    Args:
        token_level_rewards: [B, T]; a row's sum is its trajectory's score (the same on every step).
        step_returns: [B], the discounted return from the row's step on
            (`discounted_step_returns`).
        response_mask: [B, T] 0/1.
        anchors: [B] hashable anchor states: the env observation the step's action was taken in.
        group_index: [B] episode-group ids (the n trajectories of one task).
        norm_by_std: divide by the group std (verl-agent's `mean_std_norm`) or only centre
            (`mean_norm`), at both levels.

    Returns:
        (advantages, returns), [B, T] and equal, zero on masked tokens. Episode level: GRPO over
        the group's rows (a trajectory counts once per step, as verl-agent computes its mean and
        std across steps). Step level: rows of one episode group whose anchors are identical form a
        step group, scored by their step returns; a step group of one has advantage 0.
    """
    scores = token_level_rewards.sum(dim=-1)
    batch = scores.shape[0]
    if len(anchors) != batch or step_returns.shape != (batch,):
        raise ValueError(
            f"gigpo needs one anchor and one step return per row: got {len(anchors)} anchors and "
            f"step returns of shape {tuple(step_returns.shape)} for {batch} rows"
        )
    # fp64 statistics: a group here is every step row of n trajectories (dozens to hundreds of
    # values), where fp32 sums drift by several ulps; the result is rounded once, to the input dtype
    codes, n_groups = _group_codes(group_index, batch, scores.device)
    episode = _relative(scores.double(), codes, n_groups, eps, norm_by_std, singleton_mean=False)
    step_codes, n_steps = _group_codes(list(zip(group_index, anchors)), batch, scores.device)
    step = _relative(step_returns.double(), step_codes, n_steps, eps, norm_by_std, singleton_mean=True)
    advantages = _on_mask((episode + step_weight * step).to(scores.dtype), response_mask)
    return advantages, advantages.clone()


def discounted_step_returns(rewards: torch.Tensor, traj_index: Sequence[Hashable], gamma: float) -> torch.Tensor:
    """G_t = r_t + gamma * G_{t+1} within each trajectory (GiGPO Eq. 5): `rewards` [B] holds one
    step reward per row, rows of a trajectory (same `traj_index`) in step order, trajectories
    possibly interleaved."""
    codes, n_traj = _group_codes(traj_index, rewards.shape[0], rewards.device)
    running = torch.zeros(n_traj, dtype=rewards.dtype, device=rewards.device)
    out = torch.empty_like(rewards)
    for i, c in reversed(list(enumerate(codes.tolist()))):
        running[c] = rewards[i] + gamma * running[c]
        out[i] = running[c]
    return out


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
