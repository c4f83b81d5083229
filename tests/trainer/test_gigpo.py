"""GiGPO: parity with verl-agent's own functions (golden outputs), the estimator's defining
properties, and the trainer's per-step anchors and rewards in windowed and concat rows.

The golden file holds what verl-agent's `compute_gigpo_outcome_advantage` and
`compute_step_discounted_returns` returned (tools/gigpo_golden.py, the commit recorded in the
file), so this test needs no verl-agent install.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from client_app.algos import discounted_step_returns, gigpo_advantage
from client_app.rollout import Episode, EpisodeSpec, TrainRow, Turn, training_rows
from client_app.trainer.advantages import ADVANTAGES, step_group_stats
from fl_app.config import ConfigError, load_config

GOLDEN = json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "gigpo_golden.json").read_text())
TOL = 1e-6


def _inputs(case: dict) -> tuple[torch.Tensor, torch.Tensor, list[dict]]:
    """The golden case's token-level rewards (its score on the row's last masked token) and mask."""
    mask = torch.tensor(case["mask"], dtype=torch.float32)
    rewards = torch.zeros_like(mask)
    for b, row in enumerate(case["rows"]):
        rewards[b, int(mask[b].nonzero().max())] = row["score"]
    return rewards, mask, case["rows"]


def test_golden_file_records_the_reference_commit():
    assert GOLDEN["commit"] == "d0b97244c50f17fb43a6ef0a15bca0e95a044ff7"
    assert GOLDEN["produced_by"] == "tools/gigpo_golden.py" and len(GOLDEN["cases"]) == 8


def _groups(values: list[float], keys: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row: whether its group (of two or more) has all values equal, and the std its level is
    divided by (the group's unbiased std in fp64; 1 for a group of one, as in the reference)."""
    members: dict = {}
    for v, k in zip(values, keys):
        members.setdefault(k, []).append(v)
    uniform = torch.tensor([len(members[k]) > 1 and len(set(members[k])) == 1 for k in keys])
    std = {k: torch.tensor(v, dtype=torch.float64).std().item() if len(v) > 1 else 1.0 for k, v in members.items()}
    return uniform, torch.tensor([std[k] for k in keys], dtype=torch.float64)


@pytest.mark.parametrize("case", GOLDEN["cases"], ids=lambda c: f"seed{c['seed']}")
def test_gigpo_matches_verl_agent(case: dict) -> None:
    """Returns, each level and their sum agree to 1e-6 in the units of the scores and returns:
    with mean_std_norm a level is divided by its group's std, and so is the tolerance (verl-agent
    keeps its statistics in fp32, whose rounding a small std amplifies; ours are fp64). One
    documented difference: a group whose values are all equal gets exactly 0 at its level, where
    verl-agent's float mean leaves a residue that its std division amplifies to up to ~0.06 (as
    for GRPO, docs/trainer.md)."""
    rewards, mask, rows = _inputs(case)
    traj, uid, anchors = [r["traj"] for r in rows], [r["uid"] for r in rows], [r["anchor"] for r in rows]
    step_rewards = torch.tensor([r["reward"] for r in rows])
    for gamma, expected in case["returns"].items():
        ours = discounted_step_returns(step_rewards, traj, float(gamma))
        assert (ours - torch.tensor(expected)).abs().max() <= TOL
    for key, expected in case["advantages"].items():
        gamma, mode, w = key.split("/")
        step = torch.tensor(case["returns"][gamma])  # verl-agent's, matched above
        by_std = mode == "mean_std_norm"

        def ours(scores: torch.Tensor, weight: float, step=step, by_std=by_std) -> torch.Tensor:
            adv, ret = gigpo_advantage(scores, step, mask, anchors, uid, step_weight=weight, norm_by_std=by_std)
            assert torch.equal(adv, ret)
            return adv.double()

        # all-zero scores make the episode level exactly 0 (every group uniform): the step level alone
        levels = {
            "episode": (ours(rewards, 0.0)[:, 0], *_groups([r["score"] for r in rows], uid)),
            "step": (ours(0 * rewards, 1.0)[:, 0], *_groups(case["returns"][gamma], list(zip(uid, anchors)))),
        }
        tied = torch.zeros(len(rows), dtype=torch.bool)
        tol = torch.zeros(len(rows), dtype=torch.float64)
        for level, (value, uniform, std) in levels.items():
            ref = torch.tensor(case[level][f"{gamma}/{mode}"], dtype=torch.float64)
            row_tol = TOL / (std + 1e-6) if by_std else torch.full_like(std, TOL)
            over = ((value - ref).abs() - row_tol)[~uniform]
            assert (over <= 0).all(), f"{key} {level}: ours - verl-agent exceeds the tolerance by {over.max():.3e}"
            assert (value[uniform] == 0).all() and (ref[uniform].abs() < 0.1).all()
            tied |= uniform
            tol += row_tol * (float(w) if level == "step" else 1.0)
        # the sum, on every token: the row's value where the mask is 1, 0 elsewhere
        both = ours(rewards, float(w))
        assert ((both - torch.tensor(expected, dtype=torch.float64)).abs() <= tol[:, None] + TOL)[~tied].all(), key
        assert (both[mask == 0] == 0).all()
        assert tied.any() or case["seed"] % 2, "the even seeds hold an all-identical group"


def _advantage(scores, returns, anchors, groups, norm_by_std=True, w=1.0):
    n = len(scores)
    adv, _ = gigpo_advantage(
        torch.tensor(scores).unsqueeze(-1),
        torch.tensor(returns),
        torch.ones(n, 1),
        anchors,
        groups,
        step_weight=w,
        norm_by_std=norm_by_std,
    )
    return adv[:, 0]


@pytest.mark.parametrize("norm_by_std", [True, False])
def test_identical_trajectories_get_exactly_zero_advantage(norm_by_std: bool) -> None:
    """Eight copies of one 3-step trajectory: every step group and the episode group are uniform."""
    returns = [0.9025, 0.95, 1.0] * 8
    adv = _advantage([1.0] * 24, returns, ["a", "b", "c"] * 8, [0] * 24, norm_by_std)
    assert torch.equal(adv, torch.zeros(24))


def test_a_singleton_anchor_group_has_no_step_advantage() -> None:
    """Step advantage = 0 for a state only one step visited: only the episode term remains."""
    scores, groups = [1.0, 1.0, 0.0], [0, 0, 0]
    with_step = _advantage(scores, [0.3, 0.7, 0.1], ["x", "y", "z"], groups, w=1.0)
    episode_only = _advantage(scores, [0.3, 0.7, 0.1], ["x", "y", "z"], groups, w=0.0)
    assert torch.equal(with_step, episode_only)


def test_step_groups_stay_inside_their_episode_group() -> None:
    """The same observation in two tasks' groups is two step groups (of one: advantage 0)."""
    a = _advantage([1.0, 0.0], [1.0, 0.0], ["same", "same"], ["task-a", "task-b"], w=1.0)
    b = _advantage([1.0, 0.0], [1.0, 0.0], ["same", "same"], ["task-a", "task-b"], w=0.0)
    assert torch.equal(a, b)


def test_step_advantage_ranks_actions_taken_in_one_state_by_their_return() -> None:
    """Two trajectories of equal outcome pass one state; the one that got further from it
    (higher discounted return) gets the higher advantage there, and the step weight scales it."""
    scores = [1.0, 1.0, 1.0, 1.0]
    returns = [0.9, 1.0, 0.8, 0.95]  # traj 1: (s, t), traj 2: (s, u); s is shared
    adv = _advantage(scores, returns, ["s", "t", "s", "u"], [0] * 4, norm_by_std=False, w=0.5)
    assert adv[0] == pytest.approx(0.5 * 0.05) and adv[2] == pytest.approx(-0.5 * 0.05)
    assert adv[1] == 0 and adv[3] == 0  # singleton step groups; the episode group is uniform


def test_discounted_returns_follow_each_trajectory_in_order() -> None:
    rewards = torch.tensor([0.0, 1.0, 0.0, 0.5, 2.0])
    out = discounted_step_returns(rewards, ["a", "b", "a", "b", "a"], 0.5)
    # a: rewards 0, 0, 2 -> 0.5, 1.0, 2.0; b: rewards 1, 0.5 -> 1.25, 0.5
    assert out.tolist() == [0.5, 1.25, 1.0, 0.5, 2.0]


# ------------------------------------------------------------ the trainer's estimator


def _episode(group: int, k: int, mode: str, steps: list[tuple[str, float, bool]]) -> Episode:
    """An episode whose turn j was taken in state steps[j][0], got reward steps[j][1] and was
    valid iff steps[j][2]; windowed prompts/replies of 2 ids, concat glue of 1 id."""
    ep = Episode(EpisodeSpec(group, group), f"task-{group}", "buy", mode)  # type: ignore[arg-type]
    for j, (obs, reward, valid) in enumerate(steps):
        prompt = [100 + j] * (1 if mode == "concat" and j else 3)
        ep.turns.append(Turn(obs, ["a"], prompt, [10 * k + j, 0], "a", valid, reward))
        ep.reward += reward
    return ep


def _episodes(mode: str) -> list[Episode]:
    return [
        _episode(0, 0, mode, [("home", 0.0, True), ("results", 0.0, True), ("item", 1.0, True)]),
        _episode(0, 1, mode, [("home", 0.0, True), ("results", 0.0, False), ("results", 0.0, True)]),
        _episode(0, 2, mode, [("home", 0.0, True), ("other", 0.2, True)]),
        _episode(1, 3, mode, [("home", 0.0, True)]),
    ]


def _algo(**gigpo) -> object:
    dot = [f"algo.gigpo.{k}={v}" for k, v in gigpo.items()]
    return load_config("tiny-shop-gigpo", dotlist=dot).algo


def test_windowed_and_concat_rows_carry_the_same_step_advantages() -> None:
    """The estimator gives every generated token its step's advantage: windowed, one row per
    step; concat, each reply's tokens in the episode's one row (glue masked). Both modes score
    the same steps, so the per-step values agree."""
    algo = _algo(mode="mean_std_norm", gamma=0.9)
    per_mode = {}
    for mode in ("windowed", "concat"):
        episodes = _episodes(mode)
        rows = training_rows(episodes, 0.1)
        adv, returns = ADVANTAGES["step_group_relative"](episodes, rows, None, algo)
        assert returns is None and [len(a) for a in adv] == [len(rw.response_ids) for rw in rows]
        per_mode[mode] = [float(a[t]) for a, rw in zip(adv, rows) for t, m in enumerate(rw.mask) if m]
    assert per_mode["windowed"] == pytest.approx(per_mode["concat"], abs=1e-7)


def test_the_estimator_feeds_anchors_rewards_and_the_penalty_as_verl_agent() -> None:
    """Per-step inputs: anchor = the observation the action was taken in, step return = the
    discounted env rewards from that step on minus that step's invalid-action penalty, episode
    score = the training score (env return minus the penalty on every invalid action)."""
    algo = _algo(mode="mean_norm", gamma=0.9, step_weight=1.0)
    episodes = _episodes("windowed")
    rows = training_rows(episodes, 0.1)
    adv, _ = ADVANTAGES["step_group_relative"](episodes, rows, None, algo)
    ours = torch.stack([a[0] for a in adv])
    scores = [1.0, 1.0, 1.0, -0.1, -0.1, -0.1, 0.2, 0.2, 0.0]
    returns = torch.tensor([0.81, 0.9, 1.0, 0.0, -0.1, 0.0, 0.18, 0.2, 0.0])
    anchors = [t.observation for ep in episodes for t in ep.turns]
    groups = [ep.spec.group for ep in episodes for _ in ep.turns]
    expected = _advantage(scores, returns.tolist(), anchors, groups, norm_by_std=False)
    assert torch.allclose(ours, expected, atol=1e-7)
    stats = step_group_stats(rows, algo)
    # steps in a step group of two or more: home x3 (group 0), results x3; of 9 steps
    assert stats["step_grouped_share"] == pytest.approx(6 / 9)
    assert stats["step_advantage_abs"] > 0


def test_gigpo_keys_are_refused_on_another_algorithm_and_bad_values_at_load() -> None:
    with pytest.raises(ConfigError, match="algo.gigpo"):
        load_config("tiny-shop-grpo", dotlist=["algo.gigpo.gamma=0.9"])
    with pytest.raises(ConfigError, match="algo.gigpo.mode"):
        load_config("tiny-shop-gigpo", dotlist=["algo.gigpo.mode=std"])
    with pytest.raises(ConfigError, match="filter_uniform_groups"):
        load_config("tiny-shop-gigpo", dotlist=["algo.filter_uniform_groups=true"])


def test_a_row_without_its_actions_is_an_error_not_a_zero_step_advantage() -> None:
    rows = [TrainRow([1], [2, 3], [1, 1], 1.0, 0, 0)]  # built without `steps`
    with pytest.raises(ValueError, match="TrainRow.steps"):
        ADVANTAGES["step_group_relative"]([], rows, None, _algo())
