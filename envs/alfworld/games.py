"""Which games an AlfworldEnv serves, in which order: one loader for generated and official data.

Both sources have the official layout (`<root>/json_2.1.1/<split>/...`) and a manifest per
split; the loader reads the manifests (never walks), verifies the listed games, and builds the
served order (invariant 11, field log 2026-07-26/27):

    manifest order (sorted by path, content-only)
    -> seeded shuffle with a local RNG keyed by (seed, split)
    -> validation: the first `val_size` of the validation split; training: the first
       `num_games - val_size` (all when num_games is None) of the train split
    served = validation + training, so tasks [0, val_size) are the validation set.

A task-type filter keeps the manifest's relative order (filter, then shuffle).
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from pathlib import Path

from envs.alfworld.generate import GameSetSpec, ensure_set, pinned_digests
from envs.alfworld.manifest import GAME_FILE, OFFICIAL_ROOT, Manifest, ManifestError, verify_games
from envs.alfworld.tasks import TASK_TYPES

OFFICIAL_MANIFESTS = Path(__file__).with_name("manifests") / "official"
DEFAULT_GENERATED_GAMES = 120


@dataclass(frozen=True)
class Game:
    task_id: str  # "<split>/<task folder>/<trial>": stable per game, on every machine
    path: Path  # the game.tw-pddl file
    task_type: str


def task_type_of(task_id: str) -> str:
    """The task type a task id (or game path) names: ALFRED task folders start with it."""
    for part in Path(task_id).parts:
        for task_type in TASK_TYPES:
            if part.startswith(task_type + "-"):
                return task_type
    raise ValueError(f"{task_id!r} names no ALFWorld task folder (<task_type>-<object>-...)")


def split_games(root: Path, manifest: Manifest, split: str, task_types: tuple[str, ...]) -> list[Game]:
    split_root = Path(root) / OFFICIAL_ROOT / split
    verify_games(manifest, split_root)
    suffix = "/" + GAME_FILE
    return [
        Game(f"{split}/{e.path[: -len(suffix)]}", split_root / e.path, e.task_type)
        for e in manifest.entries
        if e.task_type in task_types
    ]


def served_order(
    val: list[Game], train: list[Game], seed: int, val_size: int, num_train: int | None, val_split: str
) -> list[Game]:
    val, train = list(val), list(train)
    random.Random(f"alfworld-order/{seed}/{val_split}").shuffle(val)
    random.Random(f"alfworld-order/{seed}/train").shuffle(train)
    if len(val) < val_size:
        raise ValueError(
            f"val_size={val_size} but the {val_split!r} split has only {len(val)} games "
            "of the requested task types; lower val_size"
        )
    if num_train is not None and len(train) < num_train:
        raise ValueError(
            f"{num_train} training games requested but the train split has only "
            f"{len(train)} of the requested task types; lower num_games"
        )
    return val[:val_size] + (train if num_train is None else train[:num_train])


def official_games(
    data_dir: Path,
    manifest_dir: Path,
    task_types: tuple[str, ...],
    seed: int,
    val_size: int,
    num_games: int | None,
    val_split: str,
) -> list[Game]:
    """Games of the official data under `data_dir`, pinned by the manifests in `manifest_dir`."""
    if not (Path(data_dir) / OFFICIAL_ROOT).is_dir():
        raise ManifestError(
            f"{data_dir} does not hold {OFFICIAL_ROOT}/ (the layout alfworld-download "
            f"writes); point data_dir/ALFWORLD_DATA at the directory that holds it"
        )
    splits = {}
    for split in ("train", val_split):
        path = Path(manifest_dir) / f"{split}.json"
        if not path.is_file():
            raise ManifestError(
                f"no manifest for split {split!r} at {path}. The task set must be pinned before it "
                f"is used: on the machine whose preprocessing is complete run\n  python -m "
                f"envs.alfworld.manifest --data-dir {data_dir} --out-dir {manifest_dir}\nand commit "
                f"the result (or pass manifest_dir= pointing at manifests cut elsewhere)."
            )
        splits[split] = split_games(data_dir, Manifest.load(path), split, task_types)
    num_train = None if num_games is None else num_games - val_size
    return served_order(splits[val_split], splits["train"], seed, val_size, num_train, val_split)


def generated_games(spec: GameSetSpec, cache_dir: Path | None) -> list[Game]:
    """The generated set for `spec` (generated into the cache on first use), checked against
    the committed digests when `spec` is a pinned set."""
    root = ensure_set(spec, cache_dir)
    pinned = pinned_digests(spec) or {}
    games = {}
    for split in spec.splits:
        manifest = Manifest.load(root / "manifests" / f"{split}.json")
        if split in pinned and manifest.digest != pinned[split]:
            raise ManifestError(
                f"generated {split!r} games of {spec.key} have digest {manifest.digest[:12]}, but "
                f"pinned_sets.json pins {pinned[split][:12]}: this machine generates a different "
                f"task set (alfworld/textworld/fast-downward versions? see {root}/generation.json)"
            )
        games[split] = split_games(root, manifest, split, spec.task_types)
    return served_order(games[spec.val_split], games["train"], spec.seed, spec.num_val, spec.num_train, spec.val_split)


def resolve_data_dir(data_dir: str | None) -> Path | None:
    """None -> $ALFWORLD_DATA if set, else generated games; "generated" forces generated games."""
    if data_dir == "generated":
        return None
    if data_dir is None:
        data_dir = os.environ.get("ALFWORLD_DATA") or None
    return None if data_dir is None else Path(data_dir).expanduser()
