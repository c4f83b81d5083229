"""The one fit loop: persistent RL training of one lane over any training engine.

`RLTrainer` is what the trainer service holds (`base.Trainer`). It is built once per lane and
serves many client fits in turn; per fit it only swaps weights in (`load_weights`, in place),
starts fresh optimizers (invariant 3), runs E RL iterations on fresh tasks of the client's shard
(invariant 8), and exports fp32 copies. One iteration, phase by phase:

  1. draw tasks      `tasks_per_step` tasks of the shard, a pure function of (seed, round, client, epoch)
  2. rollout         `group_size` episodes per task, one batched rollout (`rollouts.Rollouts`)
  3. rows            windowed: one row per turn; concat: one per episode (observation glue masked)
  4. advantages      the algorithm's estimator (`advantages.ADVANTAGES`); with a critic, its
                     values at rollout time, then one pass of the value loss over the rows;
                     with `algo.filter_uniform_groups`, the rows of all-equal groups leave here
  5. policy update   old (and reference) log-probs, then one pass in seeded mini-batches of the
                     PPO-clip + KL + entropy loss, FedProx's gradient on the policy only (inv. 4)
  6. metrics         per iteration, summed or averaged over the fit

A lane over several ranks (`run.lane_devices` > 1; `ranks.py`) runs this loop on every rank:
each plays its block of the iteration's groups, every step is the 1-rank step on the same
mini-batch with the gradients summed over the ranks, and rank 0 reports the metrics of all
ranks' episodes and rows, as a 1-rank fit of them reports. An engine that shards its weights
over the ranks (`sharded`: verl's FSDP2) also loads, exports and validates on every rank.

Everything a fit allocates (optimizer state, grads, FedProx anchor, rollout buffers) is released
before it returns, so a trainer serving hundreds of fits keeps a flat memory (invariant 24).
The training engine does the tensor work: builtin (torch + transformers) or verl (FSDP2); the
loop uses its training part (`engine.TrainingEngine`), the rollout engine (hf or vllm, chosen
separately) its rollout part (`engine.RolloutPolicy`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch

from client_app.algos import ActorLossSpec, FedProxAnchor, ValueLossSpec
from client_app.critic import CriticStart
from client_app.rollout import (
    Episode,
    RolloutStats,
    TrainRow,
    derive_seed,
    draw_tasks,
    episode_metrics,
    group_specs,
    outcome_shares,
    training_rows,
)
from client_app.trainer.advantages import ADVANTAGES, step_group_stats, token_mean, uniform_groups
from client_app.trainer.base import ClientTasks, EvalResult, FitResult
from client_app.trainer.device import release_memory
from client_app.trainer.engine import Engine, PolicyBatch, StepResult, TrainingEngine, ValueBatch, mini_batch_norm
from client_app.trainer.losses import loss_specs
from client_app.trainer.ranks import Lead, Ranks, RowLayout, trainer_signature
from client_app.trainer.rollouts import Rollouts
from envs.client import SyncEnvClient
from fl_app.calls import EvalCall, FitCall
from fl_app.config import Config
from fl_app.outcomes import outcome_key

log = logging.getLogger("fedagent.trainer")

IterationCallback = Callable[[int, dict[str, float]], None]
T = TypeVar("T")
# Fit metrics that add up over local epochs (with every `*_s` timing); the rest are averaged.
_SUMMED = frozenset(
    {
        "rows",
        "rollout_tokens",
        "rollout_steps",
        "optimizer_steps",
        "skipped_steps",
        "critic_optimizer_steps",
        "critic_skipped_steps",
    }
)


_SHARES = outcome_key("train_", "")  # the fit's outcome shares (outcome_shares(..., "train_"))


def _merged(per_epoch: list[dict[str, float]]) -> dict[str, float]:
    """A fit's metrics from its iterations': counts and timings summed, the rest averaged. An
    outcome share is averaged with 0 where an iteration lacks it (no episode there ended so); a
    step's metric (loss, grad norm) is averaged over the iterations that have it, and must be in
    every iteration that took a step."""
    keys = {k: None for m in per_epoch for k in m}  # every key, in first-seen order
    merged: dict[str, float] = {}
    for k in keys:
        if k.startswith(_SHARES):
            merged[k] = _mean([m.get(k, 0.0) for m in per_epoch])
            continue
        have = [m for m in per_epoch if k in m]
        if len(have) < len(per_epoch) and any(m.get("optimizer_steps", 1.0) > 0 for m in per_epoch if k not in m):
            raise KeyError(f"fit metric {k!r} is missing from an iteration that took optimizer steps")
        merged[k] = (sum if k in _SUMMED or k.endswith("_s") else _mean)([m[k] for m in have])
    return merged


@dataclass
class Played:
    """What an iteration's metrics are computed from: the episodes played (by one rank, or by
    all of them merged in rank order), every row they gave (before the uniform-group filter),
    the rows trained on, the rollout's stats and the phases' seconds."""

    episodes: list[Episode]
    rows: list[TrainRow]
    trained: int
    stats: RolloutStats
    seconds: dict[str, float]
    first: int = 0  # the index of its first episode among the iteration's

    def light(self) -> Played:
        """What rank 0 needs of another rank's share for the metrics: no token ids, prompts or
        observations; rows name their episode by its index in the iteration."""
        episodes = [
            dataclasses.replace(
                e,
                instruction="",
                turns=[
                    dataclasses.replace(t, prompt_ids=[], response_ids=[], observation="", valid_actions=[])
                    for t in e.turns
                ],
            )
            for e in self.episodes
        ]
        rows = [
            dataclasses.replace(rw, prompt_ids=[], response_ids=[], mask=[], episode=rw.episode + self.first)
            for rw in self.rows
        ]
        return Played(episodes, rows, self.trained, self.stats, self.seconds)

    @staticmethod
    def merged(shares: Sequence[Played]) -> Played:
        """The ranks' shares as one iteration's: episodes and rows in rank order (task order),
        counts summed, each phase's seconds the slowest rank's (the fit waits for it)."""
        stats = RolloutStats(
            generate_s=max(p.stats.generate_s for p in shares),
            env_s=max(p.stats.env_s for p in shares),
            tokens=sum(p.stats.tokens for p in shares),
            steps=sum(p.stats.steps for p in shares),
            wall_s=max(p.stats.wall_s for p in shares),
        )
        return Played(
            [e for p in shares for e in p.episodes],
            [rw for p in shares for rw in p.rows],
            sum(p.trained for p in shares),
            stats,
            {k: max(p.seconds[k] for p in shares) for k in shares[0].seconds},
        )


class RLTrainer:
    """`base.Trainer` over a training engine, a rollout engine and an env service client; with
    `ranks`, one rank of a lane over several (rank 0, a `ranks.Lead`, drives the others)."""

    def __init__(
        self, cfg: Config, engine: Engine, model_path: Path, env_url: str | None, ranks: Ranks | None = None
    ) -> None:
        self.cfg, self.engine, self.ranks = cfg, engine, ranks
        self.algorithm = cfg.algo.spec
        self.policy_loss, self.value_loss = loss_specs(cfg)
        self.env: SyncEnvClient | None = None
        self.rollouts: Rollouts | None = None
        try:
            self.rollouts = Rollouts(cfg, engine, model_path)
            if env_url:
                self.env = SyncEnvClient(env_url)
                self.max_sessions = int(self.env.info()["pool_size"])  # the service blocks /create beyond it
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ the Trainer interface

    @property
    def members(self) -> tuple[str, ...]:
        return self.engine.members

    @property
    def critic_start(self) -> CriticStart | None:
        return self.engine.critic_start

    @property
    def base_sha256(self) -> str:
        return self.engine.base_sha256

    @property
    def lost(self) -> str | None:
        return self.ranks.lost if isinstance(self.ranks, Lead) else None

    def load_weights(self, state: Any, member: str = "actor") -> None:
        """Into the engine; over ranks that shard it, every rank takes its shard of rank 0's
        `state` (the others pass none)."""
        self._on_every_rank("load_weights", ({}, member), lambda: self.engine.load_weights(state, member))

    def export_weights(self, member: str = "actor") -> dict[str, torch.Tensor]:
        return self._on_every_rank("export_weights", (member,), lambda: self.engine.export_weights(member))

    def master_weights(self, member: str = "actor") -> dict[str, torch.Tensor]:
        return self._on_every_rank("master_weights", (member,), lambda: self.engine.master_weights(member))

    def _on_every_rank(self, method: str, args: tuple[Any, ...], work: Callable[[], T]) -> T:
        """`work` here; when this is rank 0 of ranks that shard the engine's weights (`sharded`),
        every other rank makes the same call with `args` at once (a load, an export or a
        validation takes all of them: FSDP2 gathers and scatters over the ranks)."""
        if not (isinstance(self.ranks, Lead) and self.engine.sharded):
            return work()
        self.ranks.start()  # running; or the error of a lane whose ranks were lost
        return self.ranks.run(("call", method, args, torch.get_num_threads()), work)

    def fit(self, call: FitCall, tasks: ClientTasks, on_iteration: IterationCallback | None = None) -> FitResult:
        """`call.local_epochs` RL iterations on the client's `tasks` from the loaded weights with
        fresh optimizers. `on_iteration(epoch, metrics)` runs after each iteration (the central
        trainer validates there). Rank 0 of a lane over several ranks sends the fit to the others
        and reports for all of them; after a failure that stopped them it refuses (`ranks.Lead.lost`)."""
        self._need_env()
        if isinstance(self.ranks, Lead):
            lead = self.ranks
            lead.start(trainer_signature(self.cfg, self.engine))
            command = ("fit", call, tasks, torch.get_num_threads())
            return lead.run(command, lambda: self._fit_on_env(call, tasks, on_iteration))
        return self._fit_on_env(call, tasks, on_iteration)

    def _fit_on_env(self, call: FitCall, tasks: ClientTasks, on_iteration: IterationCallback | None) -> FitResult:
        with self._env_for(call, tasks) as (env, sessions):
            return self._fit(call, tasks, env, sessions, on_iteration)

    @contextlib.contextmanager
    def _env_for(self, call: FitCall, tasks: ClientTasks) -> Iterator[tuple[SyncEnvClient, int]]:
        """The env this fit plays on: the client's variant service when its tasks name one
        (checked to serve exactly that variant before any episode), else the trainer's own."""
        assert self.env is not None
        if not tasks.env_url:
            if tasks.env_variant:
                raise ValueError("ClientTasks.env_variant without env_url: which service serves it?")
            yield self.env, self.max_sessions
            return
        with SyncEnvClient(tasks.env_url) as env:
            info = env.info()
            served = (info.get("variant") or {}).get("hash")
            if served != tasks.env_variant:
                raise RuntimeError(
                    f"env service {tasks.env_url} serves variant {served!r}, not client "
                    f"{call.client_id}'s {tasks.env_variant!r}: refusing to train on another env"
                )
            yield env, int(info["pool_size"])

    def _fit(
        self,
        call: FitCall,
        tasks: ClientTasks,
        env: SyncEnvClient,
        sessions: int,
        on_iteration: IterationCallback | None,
    ) -> FitResult:
        self.engine.begin_fit(reference_from_policy=self.cfg.algo.ref_anchor == "round")
        anchor = FedProxAnchor.snapshot(self.engine.parameters("actor")) if call.proximal_mu > 0 else None
        per_epoch: list[dict[str, float]] = []
        episodes_trained = 0
        try:
            for epoch in range(call.local_epochs):
                metrics, n_episodes = self._iteration(call, tasks.task_indices, epoch, anchor, env, sessions)
                per_epoch.append(metrics)
                episodes_trained += n_episodes
                if on_iteration is not None:
                    on_iteration(epoch, metrics)
            if self.ranks is not None and not self.engine.sharded:  # a sharded engine holds one copy
                self.ranks.check_same_weights({m: self.engine.master_weights(m) for m in self.members})
        finally:
            self.engine.end_fit()
            if anchor is not None:
                anchor.release()
            release_memory(self.engine.device)
        if self.ranks is not None and not self.ranks.lead:
            return FitResult(num_examples=0)  # rank 0 reports the fit
        metrics = _merged(per_epoch)
        metrics["tokens_per_s"] = metrics["rollout_tokens"] / max(metrics["rollout_generate_s"], 1e-9)
        metrics["rollout_tokens_per_s"] = metrics["tokens_per_s"]
        metrics["rollout_steps_per_s"] = metrics["rollout_steps"] / max(metrics["rollout_s"], 1e-9)
        return FitResult(num_examples=episodes_trained, metrics=metrics)

    def evaluate(self, call: EvalCall, task_indices: Sequence[int]) -> EvalResult:
        """One episode per validation task at rollout.val_temperature. Scores are the raw env
        rewards: the training-only invalid-action penalty never applies (invariant 10). Over
        ranks that shard the engine every rank plays a block of the tasks (as a fit's), and rank
        0 reports them all; otherwise rank 0 plays them alone."""
        if not task_indices:
            raise ValueError("no validation tasks: pass the fixed validation set")
        return self._on_every_rank("evaluate", (call, task_indices), lambda: self._evaluate(call, task_indices))

    def _evaluate(self, call: EvalCall, task_indices: Sequence[int]) -> EvalResult:
        self._need_env()
        assert self.env is not None
        specs = group_specs(list(task_indices), 1)
        spread = self.ranks if self.ranks is not None and self.engine.sharded else None
        lo, hi = (0, len(specs)) if spread is None else spread.share(len(specs))
        sessions = self.max_sessions if spread is None else max(1, self.max_sessions // spread.world)
        episodes, stats, sync_s = self._play(
            specs[lo:hi],
            self.cfg.rollout.val_temperature,
            derive_seed("eval", call.seed),
            "validate",
            self.env,
            sessions,
            lo,
        )
        if spread is not None:
            shares = spread.gather(Played(episodes, [], 0, stats, {"rollout_sync_s": sync_s}, lo).light())
            if shares is None:
                return EvalResult(num_examples=0)  # rank 0 reports the validation
            played = Played.merged(shares)
            episodes, stats, sync_s = played.episodes, played.stats, played.seconds["rollout_sync_s"]
        return EvalResult(
            num_examples=len(episodes),
            metrics={
                **episode_metrics(episodes, ""),
                **outcome_shares(episodes, ""),
                "eval_s": stats.wall_s,
                "rollout_sync_s": sync_s,
                **stats.as_metrics("rollout_"),
            },
            outcomes={e.spec.task_index: e.won for e in episodes},
        )

    def close(self) -> None:
        """Stop the lane's other ranks (rank 0), close the env client, the rollout engine and the
        training engine (the env service is owned by whoever started it)."""
        if isinstance(self.ranks, Lead):
            self.ranks.stop()
        if self.env is not None:
            self.env.close()
            self.env = None
        if self.rollouts is not None:
            self.rollouts.close()
            self.rollouts = None
        self.engine.close()

    # ------------------------------------------------------------------ one iteration

    def _iteration(
        self,
        call: FitCall,
        shard: Sequence[int],
        epoch: int,
        anchor: FedProxAnchor | None,
        env: SyncEnvClient,
        sessions: int,
    ) -> tuple[dict[str, float], int]:
        a, r = self.cfg.algo, self.cfg.rollout
        seed = (call.seed, call.round, call.client_id, epoch)
        # 1. draw tasks, 2. rollout (over ranks: this rank's block of whole groups, its share of sessions)
        tasks = draw_tasks(shard, a.tasks_per_step, call.seed, call.round, call.client_id, epoch)
        lo, hi = (0, len(tasks)) if self.ranks is None else self.ranks.share(len(tasks))
        first = lo * a.rollouts_per_task
        t0 = time.perf_counter()
        episodes, stats, sync_s = self._play(
            group_specs(tasks, a.rollouts_per_task)[first : hi * a.rollouts_per_task],
            r.temperature,
            derive_seed("sample", *seed),
            f"r{call.round} c{call.client_id} e{epoch}",
            env,
            sessions if self.ranks is None else max(1, sessions // self.ranks.world),
            first,
        )
        rollout_s = time.perf_counter() - t0
        # 3. rows
        rows = training_rows(episodes, r.invalid_action_penalty)
        t0 = time.perf_counter()
        # 4. advantages (+ the critic's pass), then the rows of all-equal groups out if asked
        advantages, critic_metrics = self._advantages(episodes, rows, derive_seed("critic-minibatch", *seed))
        trained = rows
        if a.filter_uniform_groups:
            uniform, _ = uniform_groups(rows)
            keep = [i for i, rw in enumerate(rows) if rw.group not in uniform]
            trained, advantages = [rows[i] for i in keep], [advantages[i] for i in keep]
        scoring_s = time.perf_counter() - t0
        seconds = {"rollout_s": rollout_s, "rollout_sync_s": sync_s, "scoring_s": scoring_s}
        layout = None
        if self.ranks is not None:  # where every rank's rows sit: the first wait for the slowest rank
            t0 = time.perf_counter()
            layout = self.ranks.layout([sum(rw.mask) for rw in trained])
            seconds["rank_wait_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        # 5. policy update (none when no row is left)
        update = (
            self._policy_pass(trained, advantages, anchor, call.proximal_mu, derive_seed("minibatch", *seed), layout)
            if (layout.total if layout is not None else trained)
            else {"optimizer_steps": 0.0, "skipped_steps": 0.0}
        )
        seconds["update_s"] = time.perf_counter() - t0
        played = Played(episodes, rows, len(trained), stats, seconds, first)
        if self.ranks is not None:
            shares = self.ranks.gather(played.light())
            if shares is None:
                return {}, 0  # rank 0 reports the iteration
            played = Played.merged(shares)
        # 6. metrics
        return self._metrics(played, update, critic_metrics), len(played.episodes)

    def _metrics(self, played: Played, update: dict[str, float], critic: dict[str, float]) -> dict[str, float]:
        """An iteration's metrics from what it played and its update's (and critic's) metrics."""
        uniform, n_groups = uniform_groups(played.rows)
        step = self.algorithm.advantage == "step_group_relative"
        seconds = {k: played.seconds[k] for k in ("rollout_s", "rollout_sync_s", "scoring_s", "update_s")}
        return {
            **episode_metrics(played.episodes, "train_"),
            **outcome_shares(played.episodes, "train_"),
            "train_score": sum(rw.score for rw in played.rows) / max(len(played.rows), 1),
            "uniform_groups": len(uniform) / max(n_groups, 1),
            "rows": float(played.trained),
            **seconds,
            **({"rank_wait_s": played.seconds["rank_wait_s"]} if "rank_wait_s" in played.seconds else {}),
            **played.stats.as_metrics("rollout_"),
            **update,
            **critic,
            **(step_group_stats(played.rows, self.cfg.algo) if step else {}),
        }

    def _play(
        self,
        specs: Any,
        temperature: float,
        seed: int,
        desc: str,
        env: SyncEnvClient | None = None,
        sessions: int = 0,
        first_episode: int = 0,
    ) -> tuple[list[Episode], Any, float]:
        """Play `specs` on `env` (default: the trainer's own, unperturbed env, all its sessions)
        in at most `sessions` sessions; `first_episode`: the index of specs[0] among the
        iteration's episodes (its seed)."""
        self._need_env()
        assert self.rollouts is not None and self.env is not None
        if env is None:
            env, sessions = self.env, self.max_sessions
        return self.rollouts.play(env, specs, temperature, seed, sessions, desc, first_episode)

    def _advantages(
        self, episodes: Sequence[Episode], rows: Sequence[TrainRow], seed: int
    ) -> tuple[list[torch.Tensor], dict[str, float]]:
        """The algorithm's advantages; with a critic, its rollout-time values feed the estimator
        and the critic then takes one pass toward the value targets, before the policy update."""
        values = self.engine.score(rows, "critic") if self.algorithm.critic else None
        advantages, returns = ADVANTAGES[self.algorithm.advantage](episodes, rows, values, self.cfg.algo)
        if values is None or returns is None:
            return advantages, {}
        return advantages, critic_pass(
            self.engine,
            self.value_loss,
            rows,
            values,
            returns,
            self.cfg.algo.critic.mini,
            seed,
        )

    def _policy_pass(
        self,
        rows: Sequence[TrainRow],
        advantages: Sequence[torch.Tensor],
        anchor: FedProxAnchor | None,
        mu: float,
        seed: int,
        layout: RowLayout | None = None,
    ) -> dict[str, float]:
        fedprox = (lambda: anchor.add_grad_(self.engine.parameters("actor"), mu)) if anchor is not None else None
        return policy_pass(
            self.engine, self.policy_loss, rows, advantages, self.cfg.algo.mini_batch_size, seed, fedprox, layout
        )

    def _need_env(self) -> None:
        if self.env is None:
            raise RuntimeError("this trainer was built without an env service URL; fit and evaluate need one")


def policy_pass(
    engine: TrainingEngine,
    loss: ActorLossSpec,
    rows: Sequence[TrainRow],
    advantages: Sequence[torch.Tensor],
    mini: int,
    seed: int,
    after_backward: Callable[[], None] | None = None,
    layout: RowLayout | None = None,
) -> dict[str, float]:
    """One pass of the policy over `rows`: rollout-time (and reference) log-probs, then one
    optimizer step per mini-batch in a seeded order; `after_backward` (FedProx) in every step.
    With a `layout` (a lane over several ranks) the pass runs over every rank's rows: each step
    is the 1-rank step's mini-batch, of which this rank trains its own rows, normalised by the
    whole mini-batch."""
    old = engine.score(rows, "policy")
    ref = engine.score(rows, "reference") if loss.kl_coef > 0 else None

    def step(idx: list[int]) -> StepResult:
        own = idx if layout is None else layout.local(idx)
        return engine.step(
            PolicyBatch(
                [rows[i] for i in own],
                [old[i] for i in own],
                [advantages[i] for i in own],
                [ref[i] for i in own] if ref is not None else None,
                norm=None if layout is None else mini_batch_norm([layout.tokens[i] for i in idx], loss.horizon),
            ),
            loss,
            after_backward,
        )

    return _mini_batch_pass(len(rows) if layout is None else layout.total, mini, seed, step)


def critic_pass(
    engine: TrainingEngine,
    loss: ValueLossSpec,
    rows: Sequence[TrainRow],
    values: Sequence[torch.Tensor],
    returns: Sequence[torch.Tensor],
    mini: int,
    seed: int,
) -> dict[str, float]:
    """One pass of the critic toward the value targets, from its rollout-time values; metrics
    prefixed `critic_`, with the value and return means."""
    out = _mini_batch_pass(
        len(rows),
        mini,
        seed,
        lambda idx: engine.step(
            ValueBatch([rows[i] for i in idx], [values[i] for i in idx], [returns[i] for i in idx]), loss
        ),
    )
    metrics = {f"critic_{k}": v for k, v in out.items()}
    metrics["critic_value_mean"] = token_mean(values, rows)
    metrics["critic_return_mean"] = token_mean(returns, rows)
    return metrics


def _mini_batch_pass(n_rows: int, mini: int, seed: int, step: Callable[[list[int]], StepResult]) -> dict[str, float]:
    """One pass over `n_rows` rows in a seeded order, one optimizer step per `mini` rows; the
    steps' metrics averaged, steps taken and skipped (non-finite gradient) counted."""
    order = torch.randperm(n_rows, generator=torch.Generator().manual_seed(seed)).tolist()
    sums: dict[str, float] = defaultdict(float)
    steps = skipped = 0
    for start in range(0, n_rows, mini):
        result = step(order[start : start + mini])
        for k, v in result.metrics.items():
            sums[k] += v
        sums["grad_norm"] += result.grad_norm
        steps += 1
        if not result.stepped:
            skipped += 1
            log.warning("non-finite gradient norm; optimizer step skipped")
    out = {k: v / max(steps, 1) for k, v in sums.items()}
    out["optimizer_steps"] = float(steps)
    out["skipped_steps"] = float(skipped)
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)
