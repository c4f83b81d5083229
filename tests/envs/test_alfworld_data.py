"""ALFWorld's official-data path: one loader reads `$ALFWORLD_DATA/json_2.1.1/<split>/` through
pinned manifests (field log 2026-07-26/27, invariant 11).

The "official" data here is a real directory in the official layout (traj_data.json +
game.tw-pddl per trial) built from the session's generated games, so the real code path runs.
The test marked `realdata` runs against the real download when ALFWORLD_DATA points at it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from test_alfworld import SMALL, alf_cache, play_expert, small_params  # noqa: F401

from envs.alfworld.games import OFFICIAL_MANIFESTS
from envs.alfworld.generate import ensure_set
from envs.alfworld.manifest import OFFICIAL_ROOT, Manifest, ManifestError, cut_manifest
from envs.registry import make_env

SPLITS = ("train", "valid_seen")


@pytest.fixture
def official(alf_cache, tmp_path) -> tuple[Path, Path]:
    """(data dir, manifest dir): the generated games copied into the official layout, in
    reverse path order (so directory creation order differs from the sorted order), manifests
    cut from that copy."""
    src = ensure_set(SMALL, alf_cache) / OFFICIAL_ROOT
    data, manifests = tmp_path / "alfworld_data", tmp_path / "manifests"
    for split in SPLITS:
        for trial in sorted((src / split).glob("*/*"), reverse=True):
            shutil.copytree(trial, data / OFFICIAL_ROOT / split / trial.relative_to(src / split))
        cut_manifest(data / OFFICIAL_ROOT / split, split).dump(manifests / f"{split}.json")
    return data, manifests


def official_env(data: Path, manifests: Path, **over):
    return make_env(
        "alfworld",
        **{"num_games": None, "val_size": 6, "seed": 0, "data_dir": str(data), "manifest_dir": str(manifests), **over},
    )


def test_official_layout_serves_the_same_tasks_in_the_same_order(official, alf_cache):
    """Same games, same manifests -> the same served order as the generated source: one loader,
    and the order is a function of the set's paths, not of how the directory was written."""
    data, manifests = official
    env = official_env(data, manifests)
    generated = make_env("alfworld", **small_params(alf_cache))
    assert env.task_ids() == generated.task_ids()
    for split in SPLITS:
        assert (
            Manifest.load(manifests / f"{split}.json").digest
            == Manifest.load(ensure_set(SMALL, alf_cache) / "manifests" / f"{split}.json").digest
        )
    actions, total, info = play_expert(env, 0)
    assert info["won"] and total == 1.0


def test_alfworld_data_env_var_selects_official_data(official, monkeypatch):
    data, manifests = official
    monkeypatch.setenv("ALFWORLD_DATA", str(data))
    env = make_env("alfworld", num_games=None, val_size=6, seed=0, manifest_dir=str(manifests))
    assert env.game(0).path.is_relative_to(data)


def test_missing_listed_games_are_an_error_naming_them(official):
    data, manifests = official
    listed = Manifest.load(manifests / "train.json").entries
    for e in listed[1:3]:
        shutil.rmtree((data / OFFICIAL_ROOT / "train" / e.path).parent)
    with pytest.raises(ManifestError) as err:
        official_env(data, manifests)
    msg = str(err.value)
    assert "2 of 6 games listed in the 'train' manifest are missing" in msg
    assert listed[1].path in msg and listed[2].path in msg


def test_changed_game_content_is_an_error(official):
    data, manifests = official
    entry = Manifest.load(manifests / "valid_seen.json").entries[0]
    game_file = data / OFFICIAL_ROOT / "valid_seen" / entry.path
    game = json.loads(game_file.read_text())
    game["grammar"] = game["grammar"].replace("Your task is to: ", "Your task is to: quickly ")
    game_file.write_text(json.dumps(game))
    with pytest.raises(ManifestError, match=r"1 of 6 .* different from the manifest"):
        official_env(data, manifests)


def test_extra_games_on_disk_are_ignored(official):
    data, manifests = official
    before = official_env(data, manifests).task_ids()
    split_root = data / OFFICIAL_ROOT / "train"
    first = sorted(split_root.glob("*/*"))[0]
    shutil.copytree(first, first.parent / "trial_T20190101_000000_000000")  # sorts first
    assert official_env(data, manifests).task_ids() == before
    assert len(cut_manifest(split_root, "train").entries) == 7  # a fresh cut would see it


def test_manifest_cut_follows_alfworld_eligibility(official):
    """Like ALFWorld's collect_game_files: movable/Sliced trials, unsolvable games and trials
    without a game file are not part of a split."""
    data, _ = official
    split_root = data / OFFICIAL_ROOT / "train"
    first = sorted(split_root.glob("*/*"))[0]
    shutil.copytree(first, split_root / "pick_and_place_with_movable_recep-Apple-Bowl-Fridge-1" / "t1")
    unsolvable = split_root / "pick_and_place_simple-Apple-None-Fridge-1" / "t2"
    shutil.copytree(first, unsolvable)
    game = json.loads((unsolvable / "game.tw-pddl").read_text())
    (unsolvable / "game.tw-pddl").write_text(json.dumps({**game, "solvable": False}))
    shutil.copytree(first, split_root / "pick_and_place_simple-Apple-None-Fridge-1" / "t3")
    (split_root / "pick_and_place_simple-Apple-None-Fridge-1" / "t3" / "game.tw-pddl").unlink()
    assert len(cut_manifest(split_root, "train").entries) == 6


def test_no_manifest_is_an_error_saying_how_to_cut_one(official, tmp_path):
    data, _ = official
    with pytest.raises(ManifestError, match="python -m envs.alfworld.manifest --data-dir"):
        official_env(data, tmp_path / "nothing-here")


def test_hand_edited_manifest_is_refused(official):
    data, manifests = official
    path = manifests / "train.json"
    doc = json.loads(path.read_text())
    doc["games"] = doc["games"][1:]
    path.write_text(json.dumps(doc))
    with pytest.raises(ManifestError, match="edited by hand"):
        official_env(data, manifests)


@pytest.mark.realdata
def test_real_alfworld_data_plays():
    """Real download + committed manifests: pinned set present, expert wins validation games."""
    data = os.environ.get("ALFWORLD_DATA")
    if not data or not (Path(data) / OFFICIAL_ROOT / "train").is_dir():
        pytest.skip("ALFWORLD_DATA does not point at the official ALFWorld data")
    env = make_env("alfworld", num_games=None, val_size=64, seed=0, data_dir=data, manifest_dir=str(OFFICIAL_MANIFESTS))
    assert env.num_tasks >= 64
    for task in range(8):
        actions, total, info = play_expert(env, task, limit=100)
        assert info["won"] and total == 1.0, (env.task_ids()[task], actions)
