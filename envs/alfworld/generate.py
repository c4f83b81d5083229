"""Generate ALFWorld games locally: ALFRED-domain PDDL problems on the shipped room inventories,
compiled the way `alfworld-generate` compiles the official ones, solved by ALFWorld's planner
on ALFRED's task-relevant projection (planning.py).

Layout (the official one, so one loader reads both):
    <set root>/json_2.1.1/<split>/<task folder>/<trial>/{traj_data.json, game.tw-pddl}
    <set root>/manifests/<split>.json        sorted paths + sha256 + task type, one digest
A game is a pure function of (seed, split, index): every draw comes from a local
`random.Random` seeded with a string naming exactly that, so the set is byte-identical on every
machine and across worker layouts (`pinned_sets.json` holds the expected digests; a test
regenerates and compares). Game `index` of a split has task type `task_types[index % k]`, so the
types are balanced. A candidate is discarded when the planner finds no plan, the game is won at
step 0, or the plan is longer than ALFRED's PLANNER_MAX_STEPS; candidate `attempt + 1` of the
same index is then drawn (discards are counted in generation.json). Tests play the expert in the
whole game (the small pinned set's validation games by default; every walkthrough of the
default set replayed with -m slow).

Run at setup:  python -m envs.alfworld.generate [--seed 0 --num-games 120 --val-size 24]
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import random
import shutil
import sys
import threading
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from multiprocessing import get_context
from pathlib import Path

from envs.alfworld.engine import AlfredGame, alfworld_module, default_cache_dir
from envs.alfworld.manifest import GAME_FILE, OFFICIAL_ROOT, Manifest, cut_manifest
from envs.alfworld.rooms import build_room, split_scenes
from envs.alfworld.tasks import (
    TASK_TYPES,
    Task,
    populate,
    problem_pddl,
    project,
    sample_task,
    task_sentence,
    task_valid_in,
)

GENERATOR_VERSION = 1
MAX_ATTEMPTS = 64
PINNED = Path(__file__).with_name("pinned_sets.json")


@dataclass(frozen=True)
class GameSetSpec:
    """Everything that changes which games are generated (the cache key)."""

    seed: int = 0
    num_train: int = 96
    num_val: int = 24
    val_split: str = "valid_seen"
    task_types: tuple[str, ...] = TASK_TYPES

    def __post_init__(self) -> None:
        unknown = set(self.task_types) - set(TASK_TYPES)
        if unknown or not self.task_types:
            raise ValueError(f"task_types must be a non-empty subset of {TASK_TYPES}, got {self.task_types}")
        if self.val_split not in ("valid_seen", "valid_unseen"):
            raise ValueError(f"val_split must be valid_seen or valid_unseen, got {self.val_split!r}")
        if self.seed < 0 or self.num_train < 0 or self.num_val < 0:
            raise ValueError("seed, num_train and num_val must be >= 0")

    @property
    def key(self) -> str:
        types = "".join(str(TASK_TYPES.index(t) + 1) for t in sorted(self.task_types, key=TASK_TYPES.index))
        return (
            f"gen{GENERATOR_VERSION}-seed{self.seed}-train{self.num_train}-{self.val_split}{self.num_val}-types{types}"
        )

    @property
    def splits(self) -> dict[str, int]:
        return {"train": self.num_train, self.val_split: self.num_val}


# ------------------------------------------------------------------------------ one game

_engine: AlfredGame | None = None
_engine_lock = threading.Lock()


def _generator_engine() -> AlfredGame:
    """One engine per process (each maps its own 33 MB copy of libdownward)."""
    global _engine
    with _engine_lock:
        if _engine is None:
            _engine = AlfredGame()
        return _engine


def walkthrough(projected_game: dict, max_plan: int) -> list[str] | None:
    """ALFWorld's planner expert on the game's projection, if the game is a keeper: not won at
    step 0 and a plan of 1 to `max_plan` commands; None otherwise."""
    engine = _generator_engine()
    frame = engine.reset(projected_game)
    plan = engine.replan()
    return None if frame.won or not plan or len(plan) > max_plan else plan


def _ordered_types(spec: GameSetSpec) -> list[str]:
    return sorted(spec.task_types, key=TASK_TYPES.index)


def make_game(spec: GameSetSpec, split: str, index: int, split_root: Path) -> tuple[str, int]:
    """Write game `index` of `split` under `split_root`; returns (relative game path, discards).

    The walkthrough is planned on the game's task-relevant projection (planning.py): every
    object of the goal's types and every receptacle are in it, so the demangled names the plan
    uses ("cup 2", "cabinet 7") are the ones the whole game shows.
    """
    task_type = _ordered_types(spec)[index % len(spec.task_types)]
    info = alfworld_module("alfworld.info")
    misc = alfworld_module("alfworld.agents.utils.misc")
    max_plan = alfworld_module("alfworld.gen.constants").PLANNER_MAX_STEPS
    domain = Path(info.ALFRED_PDDL_PATH).read_text()
    scenes = [s for s in split_scenes(split) if task_valid_in(task_type, s)]
    trial = f"trial_G{spec.seed}_{split}_{index:05d}"
    for attempt in range(MAX_ATTEMPTS):
        rng = random.Random(f"fedagent-alfworld/gen{GENERATOR_VERSION}/{spec.seed}/{split}/{index}/{attempt}")
        scene_number = rng.choice(scenes)
        room = build_room(scene_number, rng)
        task = sample_task(task_type, room, rng)
        if task is None:
            continue
        traj = _traj_data(task, scene_number, trial, task_sentence(task, rng))
        # the sentence goes in as the trial's one annotation, drawn with a local rng: the
        # template path of add_task_to_grammar would draw from the global `random`
        grammar = misc.add_task_to_grammar(
            Path(info.ALFRED_TWL2_PATH).read_text(), traj, goal_desc_human_anns_prob=1.0, rng=rng
        )
        scene = populate(room, task, rng)
        plan = walkthrough(
            {
                "pddl_domain": domain,
                "grammar": grammar,
                "pddl_problem": problem_pddl(project(scene, task), task, trial),
            },
            max_plan,
        )
        if plan is None:
            continue
        folder = split_root / task.folder(scene_number) / trial
        folder.mkdir(parents=True, exist_ok=True)
        _write_json(folder / "traj_data.json", traj)
        _write_json(
            folder / GAME_FILE,
            {
                "pddl_domain": domain,
                "grammar": grammar,
                "pddl_problem": problem_pddl(scene, task, trial),
                "solvable": True,
                "walkthrough": plan,
            },
        )
        return (folder / GAME_FILE).relative_to(split_root).as_posix(), attempt
    raise RuntimeError(f"no solvable {task_type} game for {split}[{index}] in {MAX_ATTEMPTS} attempts")


def _traj_data(task: Task, scene: int, trial: str, sentence: str) -> dict:
    """The traj_data.json fields ALFWorld reads (task type, pddl_params, scene, annotations)."""
    return {
        "task_id": trial,
        "task_type": task.task_type,
        "pddl_params": task.pddl_params(),
        "scene": {"floor_plan": f"FloorPlan{scene}", "scene_num": scene},
        "turk_annotations": {
            "anns": [{"task_desc": sentence, "assignment_id": "fedagent-generated", "high_descs": [], "votes": []}]
        },
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, sort_keys=True, separators=(",", ":")))


def _make_games(spec: GameSetSpec, split: str, indices: list[int], split_root: str) -> list[tuple[str, int]]:
    return [make_game(spec, split, i, Path(split_root)) for i in indices]


# ------------------------------------------------------------------------------ a set


def generate_set(spec: GameSetSpec, root: Path, workers: int = 1) -> dict[str, Manifest]:
    """Generate every game of `spec` under `root` and write the manifests. With `workers` > 1,
    worker processes take indices one at a time; the output does not depend on how many."""
    root = Path(root)
    started = time.time()
    discards = {}
    for split, count in spec.splits.items():
        split_root = root / OFFICIAL_ROOT / split
        split_root.mkdir(parents=True, exist_ok=True)
        if workers <= 1 or count < 2:
            results = _make_games(spec, split, list(range(count)), str(split_root))
        else:  # one index per task: kitchens plan ~10x slower than bathrooms, so balance live
            with ProcessPoolExecutor(workers, mp_context=get_context("spawn")) as ex:
                parts = ex.map(
                    _make_games, [spec] * count, [split] * count, [[i] for i in range(count)], [str(split_root)] * count
                )
                results = [r for part in parts for r in part]
        discards[split] = sum(d for _, d in results)
    manifests = {}
    for split, count in spec.splits.items():
        m = cut_manifest(root / OFFICIAL_ROOT / split, split)
        if len(m.entries) != count:
            raise RuntimeError(f"{split}: generated {count} games but the manifest lists {len(m.entries)}")
        m.dump(root / "manifests" / f"{split}.json")
        manifests[split] = m
    report = {
        "spec": asdict(spec),
        "key": spec.key,
        "seconds": round(time.time() - started, 1),
        "workers": workers,
        "discarded": discards,
        "digests": {s: m.digest for s, m in manifests.items()},
        "versions": _versions(),
    }
    (root / "generation.json").write_text(json.dumps(report, indent=1) + "\n")
    return manifests


def _versions() -> dict[str, str]:
    from importlib.metadata import version

    return {p: version(p) for p in ("alfworld", "textworld", "fast-downward-textworld")}


def pinned_digests(spec: GameSetSpec) -> dict[str, str] | None:
    """The committed manifest digests for `spec`, if it is one of the pinned sets."""
    return json.loads(PINNED.read_text()).get(spec.key)


def ensure_set(spec: GameSetSpec, cache_dir: Path | None = None, workers: int | None = None) -> Path:
    """The root of `spec`'s game set in the cache, generated on first use.

    Safe under concurrent callers (threads of one pool, several processes): generation runs
    under an exclusive file lock, into a private temp dir that is renamed into place when
    complete, so a reader never sees a partial set.
    """
    base = Path(cache_dir).expanduser() if cache_dir else default_cache_dir()
    base = base / "generated"
    final = base / spec.key
    if (final / "generation.json").is_file():
        return final
    base.mkdir(parents=True, exist_ok=True)
    with open(base / f"{spec.key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (final / "generation.json").is_file():
            return final
        tmp = base / f".tmp-{spec.key}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        try:
            if workers is None:
                workers = min(4, os.cpu_count() or 1) if sum(spec.splits.values()) >= 48 else 1
            generate_set(spec, tmp, workers)
            os.rename(tmp, final)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp)
    return final


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m envs.alfworld.generate", description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--num-games", type=int, default=120, help="train + validation games")
    ap.add_argument("--val-size", type=int, default=24)
    ap.add_argument("--val-split", default="valid_seen", choices=["valid_seen", "valid_unseen"])
    ap.add_argument("--task-types", nargs="+", default=list(TASK_TYPES), choices=TASK_TYPES)
    ap.add_argument(
        "--cache-dir", default=None, help="default: $FEDAGENT_CACHE_DIR/alfworld or ~/.cache/fedagent-flower/alfworld"
    )
    ap.add_argument("--workers", type=int, default=None, help="generator processes (default: up to 4)")
    args = ap.parse_args(argv)
    spec = GameSetSpec(args.seed, args.num_games - args.val_size, args.val_size, args.val_split, tuple(args.task_types))
    started = time.time()
    root = ensure_set(spec, args.cache_dir, args.workers)
    report = json.loads((root / "generation.json").read_text())
    pinned = pinned_digests(spec)
    print(
        f"{root} ({time.time() - started:.1f} s; generated in {report['seconds']} s with "
        f"{report['workers']} workers; discarded {report['discarded']})"
    )
    for split, digest in report["digests"].items():
        mark = "" if pinned is None else (" pinned OK" if pinned.get(split) == digest else " DIFFERS FROM PIN")
        print(f"  {split}: {spec.splits[split]} games, digest {digest[:16]}{mark}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
