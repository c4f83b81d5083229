"""ALFWorld checks on the default game set (120 games): minutes of CPU, hence `-m slow`.

pytest -m slow tests/envs/test_alfworld_slow.py -s     # prints the per-type table of docs/alfworld.md
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from test_alfworld import play_expert, play_random

from envs.alfworld.env import AlfworldEnv
from envs.alfworld.generate import GameSetSpec, ensure_set, pinned_digests
from envs.alfworld.manifest import Manifest
from envs.alfworld.validation import per_type_breakdown

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]  # generation alone is minutes
DEFAULT = GameSetSpec()  # seed 0, 96 train + 24 valid_seen, all six task types
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def default_cache(tmp_path_factory) -> Path:
    cache = tmp_path_factory.getbasetemp() / "alfworld-default"
    ensure_set(DEFAULT, cache, workers=2)
    return cache


def test_generation_is_machine_independent(default_cache, tmp_path):
    """The default set generated in two fresh directories - in this process with two worker
    processes (the fixture), and in a child with one worker, another hash seed, another temp
    dir and another working dir - has the pinned manifests (paths + per-file sha256)."""
    pinned = pinned_digests(DEFAULT)
    assert pinned is not None
    code = (
        "import sys; from pathlib import Path; from envs.alfworld.generate import GameSetSpec, "
        "generate_set; generate_set(GameSetSpec(), Path(sys.argv[1]), workers=1)"
    )
    (tmp_path / "tmp").mkdir()
    subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "b")],
        check=True,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT), "PYTHONHASHSEED": "4321", "TMPDIR": str(tmp_path / "tmp")},
    )
    for root in (ensure_set(DEFAULT, default_cache), tmp_path / "b"):
        for split in DEFAULT.splits:
            assert Manifest.load(root / "manifests" / f"{split}.json").digest == pinned[split], (root, split)


def test_every_walkthrough_wins_the_whole_game(default_cache):
    """Walkthroughs are planned on the task-relevant projection; each one replayed in the whole
    game is admissible at every step and wins exactly at its last command."""
    env = AlfworldEnv(data_dir="generated", cache_dir=str(default_cache))
    for task in range(env.num_tasks):
        game = json.loads(env.game(task).path.read_text())
        obs, info = env.reset(task)
        for k, command in enumerate(game["walkthrough"]):
            assert command in info["valid_actions"], (env.task_ids()[task], k, command)
            obs, reward, done, info = env.step(command)
            assert done == (k == len(game["walkthrough"]) - 1), (env.task_ids()[task], k)
        assert info["won"] and reward == 1.0


def test_expert_and_random_rates_per_task_type(default_cache):
    """One validation pass each: the expert wins 100 % of every type; a seeded uniform-random
    agent with 50 steps wins far fewer. Prints the table recorded in docs/alfworld.md."""
    env = AlfworldEnv(data_dir="generated", cache_dir=str(default_cache))
    tasks = range(env.val_size)
    expert = per_type_breakdown({"task_id": env.task_ids()[t], "won": play_expert(env, t)[2]["won"]} for t in tasks)
    rng = random.Random(0)
    rand = per_type_breakdown(
        {"task_id": env.task_ids()[t], "won": play_random(env, t, rng)[-1][-1]["won"]} for t in tasks
    )
    print("\n| task type | games | expert | random (50 steps) |\n|---|---|---|---|")
    for name in expert:
        print(
            f"| {name} | {expert[name]['episodes']} | {expert[name]['success']:.0%} | "
            f"{rand[name]['successes']}/{rand[name]['episodes']} = {rand[name]['success']:.0%} |"
        )
    assert all(g["success"] == 1.0 for g in expert.values())
    assert rand["all"]["success"] <= 0.25
