"""The work a recipe implies, computed from the config alone (no model, no env): what
`python -m fl_app.config --check <recipe>` prints before anyone spends a GPU-day on it.

Per round: clients x local epochs x tasks x rollouts per task = episodes, the training rows they
become (windowed: one per turn, so a range; concat: one per episode), the optimizer steps those
rows give at the configured mini-batch sizes, and upper bounds on generated and context tokens.
A wrong multiplier (an 8x rollout volume from a group size a PPO recipe inherited, a
centralized baseline chopped into T optimizer resets) shows up here as a wrong number.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from fl_app.config import Config


@dataclass(frozen=True)
class RoundWork:
    clients: int  # M: clients trained per round
    epochs: int  # E: RL iterations per client per round
    tasks: int  # distinct tasks per iteration
    rollouts: int  # rollouts per task (n)
    episodes_per_iteration: int
    episodes: int  # per round, all clients
    rows_per_iteration: tuple[int, int]  # (fewest, most) training rows of one iteration
    actor_steps: tuple[int, int]  # per round, all clients
    critic_steps: tuple[int, int]  # per round, all clients (0 without a critic)
    generated_tokens_max: int  # per round
    context_tokens_max: int  # per round: prompt tokens fed to generation
    validation_episodes: int  # per validated round
    rounds: int
    fresh_optimizers: int  # per run: one per client fit

    def as_dict(self) -> dict[str, object]:
        return asdict(self)


def round_work(cfg: Config) -> RoundWork:
    a, f, turns = cfg.algo, cfg.federation, cfg.env.max_turns
    group = int(a.group_size or 1)
    per_iter = a.tasks_per_step * group
    rows = (per_iter, per_iter) if cfg.rollout.mode == "concat" else (per_iter, per_iter * turns)

    def steps(mini: int) -> tuple[int, int]:
        return tuple(f.clients_per_round * f.local_epochs * math.ceil(r / mini) for r in rows)  # type: ignore[return-value]

    episodes = f.clients_per_round * f.local_epochs * per_iter
    has_critic = "critic" in cfg.weight_members()
    return RoundWork(
        clients=f.clients_per_round,
        epochs=f.local_epochs,
        tasks=a.tasks_per_step,
        rollouts=group,
        episodes_per_iteration=per_iter,
        episodes=episodes,
        rows_per_iteration=rows,
        actor_steps=steps(a.mini_batch_size),
        critic_steps=steps(int(a.critic.mini_batch_size or a.mini_batch_size)) if has_critic else (0, 0),
        generated_tokens_max=episodes * turns * cfg.rollout.max_response_tokens,
        context_tokens_max=episodes * turns * cfg.rollout.max_prompt_tokens,
        validation_episodes=f.val_tasks,
        rounds=f.rounds,
        fresh_optimizers=f.rounds * f.clients_per_round,
    )


def _span(lo_hi: tuple[int, int]) -> str:
    lo, hi = lo_hi
    return f"{lo:,}" if lo == hi else f"{lo:,}..{hi:,}"


def format_work(cfg: Config) -> str:
    """The human-readable report printed by the recipe check."""
    w, f, a = round_work(cfg), cfg.federation, cfg.algo
    row_rule = (
        "one per episode (concat)"
        if cfg.rollout.mode == "concat"
        else f"one per turn (windowed, 1..{cfg.env.max_turns} turns per episode)"
    )
    lines = [
        f"algorithm {a.name}, rollout mode {cfg.rollout.mode}, env {cfg.env.name}, model {cfg.model.path}",
        f"per round: {w.clients} clients x {w.epochs} epochs x {w.tasks} tasks x {w.rollouts} rollouts"
        f" = {w.episodes:,} episodes ({w.episodes_per_iteration} per iteration)",
        f"  training rows per iteration: {_span(w.rows_per_iteration)}, {row_rule}",
        f"  actor optimizer steps per round: {_span(w.actor_steps)} (mini-batch {a.mini_batch_size} rows)",
    ]
    if w.critic_steps != (0, 0):
        lines.append(
            f"  critic optimizer steps per round: {_span(w.critic_steps)} (mini-batch {a.critic.mini_batch_size} rows)"
        )
    lines += [
        f"  generated tokens per round <= {w.generated_tokens_max:,} "
        f"({w.episodes:,} episodes x {cfg.env.max_turns} turns x {cfg.rollout.max_response_tokens})",
        f"  generation context tokens per round <= {w.context_tokens_max:,} "
        f"(x {cfg.rollout.max_prompt_tokens} per turn)",
        f"  validation: {w.validation_episodes} episodes on the fixed set, "
        + (
            "every round"
            if f.eval_every == 1
            else f"every {f.eval_every} rounds"
            if f.eval_every
            else "at round 0 and the last round"
        ),
        f"run: {w.rounds} rounds -> {w.rounds * w.episodes:,} training episodes, "
        f"{w.rounds * f.local_epochs} local iterations along the global trajectory, "
        f"{w.fresh_optimizers} client fits (a fresh optimizer each)",
    ]
    if f.only_clients:
        lines.append(f"clients fixed to {f.only_clients} every round (no sampling)")
    if a.spec.critic and w.rollouts > 1:
        lines.append(
            f"note: ppo with {w.rollouts} rollouts per task: {w.rollouts}x the rollout volume of "
            "ungrouped PPO (the published recipe uses 1)"
        )
    return "\n".join(lines)
