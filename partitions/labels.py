"""Success labels of a training pool: the file `python -m client_app.label_tasks` writes and the
hardness partition reads.

A labels file records who measured what (provenance: model weights hash, env fingerprint,
rollout mode, temperature, seed, date) and one success flag per task id. It is only as good as
its match with the run that uses it, so matching fails closed (field log 2026-07-21/22/28):
  - another env task order (fingerprint) -> refused: the ids would name other tasks;
  - another rollout mode (windowed vs concat) -> refused: difficulty measured under another
    rendering of the prompt is another difficulty;
  - more than half of the pool unlabelled -> refused; fewer misses count as hard and are
    reported (count and fraction), never silently.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from partitions.pool import TaskPool

FORMAT = "fedagent-task-labels/1"
MAX_MISS_FRACTION = 0.5


class LabelsError(ValueError):
    """A labels file cannot be used for this run; the message names why and the fix."""


@dataclass(frozen=True)
class Labels:
    path: str
    provenance: dict[str, Any]
    success: dict[str, bool]  # task id -> solved by the reference policy


@dataclass(frozen=True)
class LabelMatch:
    """The labels laid over one pool."""

    easy: frozenset[int]  # served indices labelled solved
    misses: int  # pool tasks without a label (counted hard)
    pool_size: int

    @property
    def miss_fraction(self) -> float:
        return self.misses / self.pool_size

    def as_dict(self) -> dict[str, Any]:
        return {
            "easy": len(self.easy),
            "hard": self.pool_size - len(self.easy),
            "misses": self.misses,
            "miss_fraction": self.miss_fraction,
        }


def write_labels(path: Path, success: dict[str, bool], provenance: dict[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"format": FORMAT, "provenance": provenance, "labels": dict(sorted(success.items()))}
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    tmp.replace(path)
    return path


def load_labels(path: str | Path) -> Labels:
    p = Path(path).expanduser()
    if not p.is_file():
        raise LabelsError(
            f"partition.labels={str(path)!r}: no such file; write it with "
            "`python -m client_app.label_tasks --recipe <recipe> --out <file>`"
        )
    try:
        body = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise LabelsError(f"labels file {p} is not JSON ({e})") from None
    found = body.get("format") if isinstance(body, dict) else None
    if found != FORMAT:
        raise LabelsError(
            f"labels file {p} is not a {FORMAT} file (format={found!r}); "
            "regenerate it with `python -m client_app.label_tasks`"
        )
    success = body.get("labels")
    if not isinstance(success, dict) or not all(isinstance(v, bool) for v in success.values()):
        raise LabelsError(f"labels file {p}: `labels` must map task ids to true/false")
    return Labels(str(p.resolve()), dict(body.get("provenance") or {}), success)


def match_labels(labels: Labels, pool: TaskPool, rollout_mode: str) -> LabelMatch:
    """Lay `labels` over `pool`, refusing labels made on another task order or rollout mode, or
    that miss more than half of the pool."""
    prov = labels.provenance
    if prov.get("env_fingerprint") != pool.fingerprint:
        raise LabelsError(
            f"labels {labels.path} were made on env task order {str(prov.get('env_fingerprint'))[:12]} "
            f"({prov.get('env')}, {prov.get('env_params')}), but this run serves {pool.fingerprint[:12]} "
            f"({pool.env}): the task ids would name other tasks. Regenerate them with "
            "`python -m client_app.label_tasks --recipe <this run's recipe>`"
        )
    if prov.get("rollout_mode") != rollout_mode:
        raise LabelsError(
            f"labels {labels.path} were rolled out in {prov.get('rollout_mode')!r} mode, but this run uses "
            f"rollout.mode={rollout_mode!r}: difficulty under another prompt rendering is another difficulty "
            "(field log 2026-07-21). Regenerate them in this mode"
        )
    easy = frozenset(i for i, tid in zip(pool.indices, pool.task_ids) if labels.success.get(tid) is True)
    misses = sum(tid not in labels.success for tid in pool.task_ids)
    match = LabelMatch(easy, misses, len(pool))
    if match.miss_fraction > MAX_MISS_FRACTION:
        raise LabelsError(
            f"labels {labels.path} label only {len(pool) - misses} of the {len(pool)} training tasks "
            f"({misses} misses, {match.miss_fraction:.0%} > {MAX_MISS_FRACTION:.0%}): they do not describe this "
            "pool. Label the whole training pool (`python -m client_app.label_tasks` without --limit)"
        )
    return match
