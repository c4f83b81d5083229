"""Per-task-type success from ONE validation pass.

Why one pass (field log 2026-07-28): the published per-type columns are a partition of a single
validation pass, so each cell is k/n_t on that pass's composition and the pooled cells equal the
"All" column. Running a separate pass per type (filtering the pool to one type and playing the
same number of episodes) repeats games and measures a different quantity that cannot reproduce
the tables. This groups one pass's episodes by the task type of the game each one played.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from envs.alfworld.games import task_type_of
from envs.alfworld.tasks import TASK_TYPES


def _field(episode: Any, name: str) -> Any:
    return episode[name] if isinstance(episode, Mapping) else getattr(episode, name)


def per_type_breakdown(episodes: Iterable[Any]) -> dict[str, dict[str, float]]:
    """{"all": {...}, <task type>: {...}} with `episodes`, `successes` and `success` per group.

    Each episode (a mapping or an object, e.g. the rollout's Episode) needs `won` and either a
    `task_type` or a `task_id` naming its game (ALFWorld task ids carry the task folder). The
    groups partition the pass: their episode counts add up to "all", and the episode-weighted
    mean of their success rates is the "all" success rate. Types absent from the pass are absent.
    """
    counts: dict[str, list[int]] = {}
    for ep in episodes:
        try:
            task_type = _field(ep, "task_type")
        except (KeyError, AttributeError):
            task_type = task_type_of(_field(ep, "task_id"))
        if task_type not in TASK_TYPES:
            raise ValueError(f"episode of unknown task type {task_type!r}")
        c = counts.setdefault(task_type, [0, 0])
        c[0] += 1
        c[1] += bool(_field(ep, "won"))
    if not counts:
        raise ValueError("per_type_breakdown needs the episodes of one validation pass; got none")
    groups = {"all": [sum(c[0] for c in counts.values()), sum(c[1] for c in counts.values())]}
    groups.update((t, counts[t]) for t in TASK_TYPES if t in counts)
    return {name: {"episodes": n, "successes": k, "success": k / n} for name, (n, k) in groups.items()}
