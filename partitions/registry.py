"""Partition name -> strategy, and the one entry point every process uses: `plan_partition`.

A plan is every client's shard, computed once per process from (config, training pool): the
server computes it before round 1 (partition.json), each trainer lane when it starts; both get
the same shards because every strategy is a pure function of (client, N, |X_i|, pool, labels,
run.seed, knobs) that puts the pool in canonical order first (invariant 11).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from fl_app.config import Config
from partitions.coverage import coverage_shards
from partitions.hardness import hardness_shards
from partitions.labels import LabelMatch, Labels, load_labels, match_labels
from partitions.pool import TaskPool
from partitions.preference import preference_shard
from partitions.uniform import client_shard

Shards = list[list[int]]


def _uniform(cfg: Config, pool: TaskPool, match: LabelMatch | None) -> Shards:
    f = cfg.federation
    return [client_shard(c, f.clients, f.tasks_per_client, pool.indices, cfg.run.seed) for c in range(f.clients)]


def _preference(cfg: Config, pool: TaskPool, match: LabelMatch | None) -> Shards:
    f, p = cfg.federation, cfg.partition.params
    assert p.omega is not None
    return [
        preference_shard(c, pool, f.tasks_per_client, p.omega, cfg.run.seed, p.downsample_category, p.downsample_ratio)
        for c in range(f.clients)
    ]


def _coverage(cfg: Config, pool: TaskPool, match: LabelMatch | None) -> Shards:
    f, p = cfg.federation, cfg.partition.params
    assert p.xi is not None and p.center is not None and p.high is not None
    return coverage_shards(pool, f.clients, f.tasks_per_client, p.center, p.high, p.xi, cfg.run.seed)


def _hardness(cfg: Config, pool: TaskPool, match: LabelMatch | None) -> Shards:
    f, p = cfg.federation, cfg.partition.params
    assert match is not None and p.xi_prime is not None and p.rule is not None
    return hardness_shards(pool, match.easy, f.clients, f.tasks_per_client, p.xi_prime, cfg.run.seed, p.rule)


STRATEGIES: dict[str, Callable[[Config, TaskPool, LabelMatch | None], Shards]] = {
    "uniform": _uniform,
    "preference": _preference,
    "coverage": _coverage,
    "hardness": _hardness,
}


@dataclass(frozen=True)
class PartitionPlan:
    name: str
    params: dict[str, Any]  # the knobs that were set
    seed: int
    pool: TaskPool
    shards: tuple[tuple[int, ...], ...]
    labels: Labels | None = None
    match: LabelMatch | None = None

    def shard(self, client_id: int) -> list[int]:
        if not 0 <= client_id < len(self.shards):
            raise ValueError(f"client_id {client_id} outside [0, {len(self.shards)})")
        return list(self.shards[client_id])

    def digest(self) -> str:
        """sha256 over every shard: equal digests, equal partitions (checked on resume)."""
        return hashlib.sha256(json.dumps([list(s) for s in self.shards]).encode()).hexdigest()


def plan_partition(cfg: Config, pool: TaskPool, labels: Labels | None = None) -> PartitionPlan:
    """Every client's shard under `cfg.partition`. Labels: `labels` if given, else the file
    `partition.labels` names (if any); either way matched against `pool` and the rollout mode."""
    part = cfg.partition
    if labels is None and part.labels:
        labels = load_labels(part.labels)
    match = match_labels(labels, pool, cfg.rollout.mode) if labels is not None else None
    shards = STRATEGIES[part.name](cfg, pool, match)
    if len(shards) != cfg.federation.clients or not all(shards):
        raise ValueError(
            f"partition {part.name!r} produced {len(shards)} shards for {cfg.federation.clients} "
            "clients, or an empty one"
        )
    params = {k: v for k, v in part.params.model_dump().items() if v is not None}
    return PartitionPlan(part.name, params, cfg.run.seed, pool, tuple(tuple(s) for s in shards), labels, match)
