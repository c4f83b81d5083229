"""How episodes ended, as metrics: `<prefix>outcome_<label>` is the share of a round's episodes
(`train_`, `val_`) that ended with `label` (`won`, or the env's or the rollout's name for why
not: envs/base.py). A label no episode had is absent from the row and reads as 0."""

from __future__ import annotations

from collections.abc import Mapping


def outcome_key(prefix: str, label: str) -> str:
    return f"{prefix}outcome_{label}"


def outcome_shares_of(row: Mapping[str, object], prefix: str) -> dict[str, float]:
    """label -> share, for the labels a metrics row has under `prefix`."""
    head = outcome_key(prefix, "")
    return {k.removeprefix(head): float(v) for k, v in row.items() if k.startswith(head) and isinstance(v, int | float)}
