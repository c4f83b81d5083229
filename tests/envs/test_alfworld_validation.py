"""Per-task-type validation success is a partition of ONE validation pass (field log 2026-07-28)."""

from __future__ import annotations

import random
from dataclasses import dataclass
from fractions import Fraction

import pytest

from envs.alfworld.tasks import TASK_TYPES
from envs.alfworld.validation import per_type_breakdown


@dataclass
class Ep:  # shaped like client_app.rollout.Episode: task_id + won
    task_id: str
    won: bool


def one_pass(composition: dict[str, int], seed: int = 0) -> list[Ep]:
    rng = random.Random(seed)
    return [
        Ep(f"valid_seen/{t}-Apple-None-Fridge-{k}/trial_T{k:03d}", rng.random() < 0.4)
        for t, n in composition.items()
        for k in range(n)
    ]


def test_groups_partition_the_pass_and_pool_back_to_all():
    # the paper's val-64 composition (Pick, Look, Clean, Heat, Cool, Pick2)
    composition = dict(zip(TASK_TYPES, (14, 8, 12, 9, 11, 10)))
    episodes = one_pass(composition)
    b = per_type_breakdown(episodes)
    assert b["all"]["episodes"] == 64 == sum(b[t]["episodes"] for t in TASK_TYPES)
    for t, n in composition.items():
        assert b[t]["episodes"] == n
        # every cell lies on the 1/n_t grid of this pass's composition
        assert Fraction(b[t]["success"]).limit_denominator(64) * n == b[t]["successes"]
    pooled = sum(b[t]["success"] * b[t]["episodes"] for t in TASK_TYPES) / 64
    assert pooled == pytest.approx(b["all"]["success"])
    assert b["all"]["successes"] == sum(e.won for e in episodes)


def test_a_per_type_pass_is_a_different_quantity():
    """Filtering the pool to one type and playing 64 episodes repeats that type's games: its
    denominator is 64, not the type's share of the pass, so it cannot give the pass's cells."""
    composition = dict(zip(TASK_TYPES, (14, 8, 12, 9, 11, 10)))
    episodes = one_pass(composition)
    look = [e for e in episodes if "look_at_obj_in_light" in e.task_id]
    repeated = [look[k % len(look)] for k in range(64)]  # games[seed % len(games)]
    single = per_type_breakdown(episodes)["look_at_obj_in_light"]
    separate = per_type_breakdown(repeated)["look_at_obj_in_light"]
    assert (single["episodes"], separate["episodes"]) == (8, 64)


def test_accepts_mappings_and_explicit_task_types_and_skips_absent_types():
    b = per_type_breakdown(
        [
            {"task_type": "pick_and_place_simple", "won": True},
            {"task_id": "train/pick_two_obj_and_place-Mug-None-Desk-301/trial_x", "won": False},
        ]
    )
    assert set(b) == {"all", "pick_and_place_simple", "pick_two_obj_and_place"}
    assert b["all"] == {"episodes": 2, "successes": 1, "success": 0.5}


def test_refuses_empty_passes_and_unknown_task_ids():
    with pytest.raises(ValueError, match="none"):
        per_type_breakdown([])
    with pytest.raises(ValueError, match="names no ALFWorld task folder"):
        per_type_breakdown([Ep("000012-B0001", True)])
