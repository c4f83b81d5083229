"""The training pool a partition cuts: served task indices with their ids and categories.

Read from the engine itself (invariant 11): `indices` are the env's served order (what
`reset(i)` plays), `fingerprint` pins that order, and everything downstream works on the
ascending index list, so no caller's listing order can change a shard.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from envs.base import Env, task_order_fingerprint


@dataclass(frozen=True)
class TaskPool:
    env: str  # engine name
    indices: tuple[int, ...]  # training tasks, ascending served indices
    task_ids: tuple[str, ...]  # task_ids[k] is the id of indices[k]
    categories: tuple[str, ...]  # categories[k] is the category of indices[k]
    fingerprint: str  # sha256 over the env's whole served order (envs.base)

    def __post_init__(self) -> None:
        if not self.indices:
            raise ValueError("empty training pool: the environment serves no training tasks")
        if not len(self.indices) == len(self.task_ids) == len(self.categories):
            raise ValueError("TaskPool fields must have one entry per task")
        if list(self.indices) != sorted(set(self.indices)):
            raise ValueError("TaskPool.indices must be ascending and distinct")

    @classmethod
    def from_env(cls, env: Env) -> TaskPool:
        """The training split [val_size, num_tasks) of a built engine."""
        ids, cats = env.task_ids(), env.task_categories()
        train = range(env.val_size, env.num_tasks)
        return cls(
            env.name,
            tuple(train),
            tuple(ids[i] for i in train),
            tuple(cats[i] for i in train),
            task_order_fingerprint(env),
        )

    def __len__(self) -> int:
        return len(self.indices)

    def category_names(self) -> list[str]:
        """Categories present, in canonical (sorted) order."""
        return sorted(set(self.categories))

    def category_counts(self) -> dict[str, int]:
        counts = Counter(self.categories)
        return {c: counts[c] for c in self.category_names()}


def build_pool(env_name: str, params: dict[str, Any]) -> TaskPool:
    """Build the engine once (read-only) and take its training pool."""
    from envs.registry import make_env

    return TaskPool.from_env(make_env(env_name, **params))


def pool_from_counts(counts: dict[str, int], name: str = "counts") -> TaskPool:
    """A stand-in pool with the given category counts (e.g. a published pool whose data is not on
    this machine): tasks 0..n-1, categories in blocks. Its fingerprint names the counts, so
    labels from a real env never match it."""
    if not counts or min(counts.values()) < 1:
        raise ValueError(f"category counts must be positive, got {counts}")
    cats = [c for c in sorted(counts) for _ in range(counts[c])]
    tag = ",".join(f"{c}={counts[c]}" for c in sorted(counts))
    return TaskPool(
        name, tuple(range(len(cats))), tuple(f"{name}-{i:06d}" for i in range(len(cats))), tuple(cats), f"{name}:{tag}"
    )
