"""Rows -> advantages (and value targets): the estimators that `fl_app.config.ALGORITHMS` names.

An estimator takes the rollout's episodes, their training rows, the critic's rollout-time values
(None for an algorithm without a critic) and the algo config, and returns one 1-D advantage
tensor per row (over its response tokens) and, when it trains a critic, the value targets.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable, Sequence

import torch

from client_app.algos import (
    discounted_step_returns,
    gae_advantage_return,
    gigpo_advantage,
    grpo_outcome_advantage,
    masked_mean,
)
from client_app.rollout import Episode, TrainRow
from fl_app.config import ALGORITHMS, AlgoCfg

Targets = tuple[list[torch.Tensor], list[torch.Tensor] | None]


def group_relative(
    episodes: Sequence[Episode], rows: Sequence[TrainRow], values: Sequence[torch.Tensor] | None, algo: AlgoCfg
) -> Targets:
    """GRPO: each episode's score relative to its group's (one score per EPISODE, so long
    episodes do not weigh more in the group statistics), broadcast to every token of the
    episode's rows; divided by the group std unless `algo.grpo_norm_by_std` is off (Dr.GRPO)."""
    scores = torch.zeros(len(episodes), 1, dtype=torch.float32)
    groups = [0] * len(episodes)
    for rw in rows:
        scores[rw.episode, 0] = rw.score
        groups[rw.episode] = rw.group
    adv, _ = grpo_outcome_advantage(scores, torch.ones_like(scores), groups, norm_by_std=algo.grpo_norm_by_std)
    return [torch.full((len(rw.response_ids),), float(adv[rw.episode, 0])) for rw in rows], None


def gae(
    episodes: Sequence[Episode], rows: Sequence[TrainRow], values: Sequence[torch.Tensor] | None, algo: AlgoCfg
) -> Targets:
    """PPO: GAE advantages and value targets from the critic's rollout-time values.

    The row's score is the reward of its last generated token (every windowed turn of an
    episode carries the episode score, as verl-agent does); GAE runs over the padded batch with
    observation tokens skipped (values and advantages carried across them), and the advantages
    are whitened over every generated token of the batch.
    """
    if values is None:
        raise ValueError("GAE needs the critic's values: an algorithm with advantage 'gae' must train a critic")
    mask = pad_rows([torch.tensor(rw.mask, dtype=torch.float32) for rw in rows])
    rewards = torch.zeros_like(mask)
    for b, rw in enumerate(rows):
        generated = [t for t, m in enumerate(rw.mask) if m]
        if generated:
            rewards[b, generated[-1]] = rw.score
    adv, ret = gae_advantage_return(rewards, pad_rows(values, mask.shape[1]), mask, algo.gamma, algo.lam)
    n = [len(rw.response_ids) for rw in rows]
    return [adv[b, : n[b]].clone() for b in range(len(rows))], [ret[b, : n[b]].clone() for b in range(len(rows))]


def _step_advantages(rows: Sequence[TrainRow], algo: AlgoCfg, step_weight: float) -> torch.Tensor:
    """GiGPO's advantage of every action of `rows` (in row order, then step order), with
    verl-agent's inputs: the row's episode score, the action's anchor state, and its step return
    (the discounted env rewards from it on, less its own invalid-action penalty, undiscounted)."""
    steps = [(rw, st) for rw in rows for st in rw.steps]
    if any(not rw.steps for rw in rows):
        raise ValueError(
            "gigpo needs the actions of every training row (rollout.training_rows fills TrainRow.steps); "
            "a row without them cannot get a step-level advantage"
        )
    returns = discounted_step_returns(
        torch.tensor([st.reward for _, st in steps], dtype=torch.float32),
        [rw.episode for rw, _ in steps],
        algo.gigpo.gamma,
    ) - torch.tensor([st.penalty for _, st in steps], dtype=torch.float32)
    adv, _ = gigpo_advantage(
        torch.tensor([[rw.score] for rw, _ in steps], dtype=torch.float32),
        returns,
        torch.ones(len(steps), 1),
        [st.anchor for _, st in steps],
        [rw.group for rw, _ in steps],
        step_weight=step_weight,
        norm_by_std=algo.gigpo.mode == "mean_std_norm",
    )
    return adv[:, 0]


def step_group_relative(
    episodes: Sequence[Episode], rows: Sequence[TrainRow], values: Sequence[torch.Tensor] | None, algo: AlgoCfg
) -> Targets:
    """GiGPO: each action's episode-level plus weighted step-level group advantage
    (`client_app.algos.gigpo_advantage`) on the tokens of its reply; concat rows get one value
    per reply, and the observation glue between replies (masked) gets 0."""
    per_step = iter(_step_advantages(rows, algo, algo.gigpo.step_weight).tolist())
    out = []
    for rw in rows:
        adv = torch.zeros(len(rw.response_ids))
        for st in rw.steps:
            adv[st.start : st.end] = next(per_step)
        out.append(adv)
    return out, None


def step_group_stats(rows: Sequence[TrainRow], algo: AlgoCfg) -> dict[str, float]:
    """How much step-level signal a GiGPO batch had: the share of actions whose anchor state
    another action of their episode group shares (a step group of one has step advantage 0), and
    the mean |w x step advantage| over actions."""
    keys = Counter((rw.group, st.anchor) for rw in rows for st in rw.steps)
    n = max(sum(keys.values()), 1)
    step_part = _step_advantages(rows, algo, algo.gigpo.step_weight) - _step_advantages(rows, algo, 0.0)
    return {
        "step_grouped_share": sum(c for c in keys.values() if c > 1) / n,
        "step_advantage_abs": float(step_part.abs().mean()) if len(step_part) else 0.0,
    }


def uniform_groups(rows: Sequence[TrainRow]) -> tuple[set[int], int]:
    """The GRPO groups of two or more episodes that all scored the same (every advantage in them
    is 0), and the number of groups."""
    scores: dict[int, dict[int, float]] = defaultdict(dict)
    for rw in rows:
        scores[rw.group][rw.episode] = rw.score
    return {g for g, s in scores.items() if len(s) > 1 and len(set(s.values())) == 1}, len(scores)


Estimator = Callable[[Sequence[Episode], Sequence[TrainRow], Sequence[torch.Tensor] | None, AlgoCfg], Targets]
ADVANTAGES: dict[str, Estimator] = {
    "group_relative": group_relative,
    "gae": gae,
    "step_group_relative": step_group_relative,
}
_missing = {a.advantage for a in ALGORITHMS.values()} - set(ADVANTAGES)
if _missing:  # the table and the estimators must agree (import-time, so it cannot ship broken)
    raise ImportError(f"fl_app.config.ALGORITHMS names advantage estimators {sorted(_missing)} that do not exist")


def pad_rows(
    seqs: Sequence[torch.Tensor], width: int | None = None, device: torch.device | None = None
) -> torch.Tensor:
    """Right-pad 1-D per-row CPU tensors to [B, width] with zeros (fp32), on `device`: padded
    on the CPU and moved in one copy (a copy per row cost a tenth of a GPU update, benchmarks.md)."""
    width = max((len(s) for s in seqs), default=0) if width is None else width
    out = torch.zeros((len(seqs), width), dtype=torch.float32)
    for b, s in enumerate(seqs):
        out[b, : len(s)] = s
    return out if device is None else out.to(device)


def token_mean(per_row: Sequence[torch.Tensor], rows: Sequence[TrainRow]) -> float:
    """Mean of per-token values over the generated tokens of all rows."""
    mask = pad_rows([torch.tensor(rw.mask, dtype=torch.float32) for rw in rows])
    return float(masked_mean(pad_rows(per_row, mask.shape[1]), mask))
