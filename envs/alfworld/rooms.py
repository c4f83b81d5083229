"""Room inventories of the 120 AI2-THOR scenes, as the alfworld wheel ships them.

Per scene `alfworld/gen/layouts/` has `FloorPlan<n>-objects.json` (object and receptacle types
present), `FloorPlan<n>-openable.json` (receptacle instance ids with the agent pose ALFRED
interacts from) and `FloorPlan<n>-layout.npy` (the navigable floor grid, metres). A few
receptacle types present in a scene have no shipped pose (garbage cans, stove burners, coffee
machines, toasters, towel holders, ...); `build_room` gives each such type an instance at a
seeded free floor point, with an ALFRED-shaped id. Everything else is read as shipped.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from envs.alfworld.engine import alfworld_module

GRID_M = 0.25  # ALFRED's agent step: poses are stored in grid units
HORIZON = 30  # camera pitch of synthesised poses (ALFRED's usual value)
UNPOSED_COUNTS = {"StoveBurner": 4}  # instances of a pose-less receptacle type (default 1)
SPLIT_SCENES = {
    "train": "TRAIN_SCENE_NUMBERS",
    "valid_seen": "TRAIN_SCENE_NUMBERS",
    "valid_unseen": "TEST_SCENE_NUMBERS",
}

Location = tuple[int, int, int, int]  # (x, z) grid, rotation / 90 degrees, horizon


@dataclass(frozen=True)
class Receptacle:
    id: str  # ALFRED object id, e.g. "Cabinet|+00.68|+00.50|-02.20"
    type: str  # e.g. "Cabinet", "SinkBasin"
    location: Location


@dataclass(frozen=True)
class Room:
    scene: int
    kind: str  # Kitchen | LivingRoom | Bedroom | Bathroom
    object_types: frozenset[str]  # every type objects.json lists
    receptacles: tuple[Receptacle, ...]  # sorted by id
    floor: tuple[tuple[int, int], ...]  # navigable grid points, sorted

    @property
    def receptacle_types(self) -> frozenset[str]:
        return frozenset(r.type for r in self.receptacles)


def free_location(floor: tuple[tuple[int, int], ...], rng: random.Random, taken: set[Location]) -> Location:
    """A seeded floor pose that no receptacle (or earlier draw) uses; added to `taken`."""
    while True:
        x, z = rng.choice(floor)
        loc = (x, z, rng.randrange(4), HORIZON)
        if loc not in taken:
            taken.add(loc)
            return loc


def constants():
    return alfworld_module("alfworld.gen.constants")


def static_receptacle_types() -> frozenset[str]:
    """Receptacle types that stay put and can hold something (ALFRED's non-movable receptacles)."""
    c = constants()
    return frozenset(c.VAL_RECEPTACLE_OBJECTS) - c.MOVABLE_RECEPTACLES_SET


def scene_kind(scene: int) -> str:
    for kind, numbers in constants().SCENE_TYPE.items():
        if scene in numbers:
            return kind
    raise ValueError(f"scene {scene} is not an AI2-THOR floor plan number")


def split_scenes(split: str) -> list[int]:
    """ALFRED's scene split: train and valid_seen use the train scenes, valid_unseen the others."""
    if split not in SPLIT_SCENES:
        raise ValueError(f"unknown split {split!r}; choose from {sorted(SPLIT_SCENES)}")
    return sorted(getattr(constants(), SPLIT_SCENES[split]))


def _layout_dir() -> Path:
    return Path(constants().__file__).parent / "layouts"


@lru_cache(maxsize=None)
def _shipped(scene: int) -> tuple[frozenset[str], dict[str, list[float]], tuple[tuple[int, int], ...]]:
    import numpy as np

    d = _layout_dir()
    types = frozenset(json.loads((d / f"FloorPlan{scene}-objects.json").read_text()))
    poses = json.loads((d / f"FloorPlan{scene}-openable.json").read_text())
    grid = np.load(d / f"FloorPlan{scene}-layout.npy")
    floor = tuple(sorted({(round(float(x) / GRID_M), round(float(z) / GRID_M)) for x, z in grid}))
    return types, poses, floor


def scene_object_types(scene: int) -> frozenset[str]:
    return _shipped(scene)[0]


def scene_receptacle_types(scene: int) -> frozenset[str]:
    """Receptacle types `build_room` gives the scene (shipped poses plus pose-less ones)."""
    types, poses, _ = _shipped(scene)
    return frozenset(receptacle_type(r) for r in poses) | (types & static_receptacle_types())


def receptacle_type(alfred_id: str) -> str:
    """ "Cabinet|..." -> Cabinet; basins carry their type last: "Sink|x|y|z|SinkBasin" -> SinkBasin."""
    parts = alfred_id.split("|")
    return parts[-1] if len(parts) == 5 else parts[0]


def alfred_id(type_: str, rng: random.Random, taken: set[str]) -> str:
    """A fresh ALFRED-shaped id ("Type|x|y|z", basins "Sink|x|y|z|SinkBasin") with seeded coordinates."""
    head, tail = type_, ""
    if type_.endswith("Basin"):
        head, tail = type_[: -len("Basin")], "|" + type_
    while True:
        coords = "|".join(f"{rng.uniform(-4.0, 4.0):+06.2f}" for _ in range(3))
        ident = f"{head}|{coords}{tail}"
        if ident not in taken:
            taken.add(ident)
            return ident


def build_room(scene: int, rng: random.Random) -> Room:
    """The scene's receptacles: shipped ids and poses, plus seeded ones for pose-less types."""
    types, poses, floor = _shipped(scene)
    static = static_receptacle_types()
    receptacles = []
    for rid, (x, z, rotation, horizon) in sorted(poses.items()):
        loc = (round(x / GRID_M), round(z / GRID_M), round(rotation / 90) % 4, round(horizon))
        receptacles.append(Receptacle(rid, receptacle_type(rid), loc))
    posed = {r.type for r in receptacles}
    taken_ids = set(poses)
    taken_locs = {r.location for r in receptacles}
    for t in sorted((types & static) - posed):
        for _ in range(UNPOSED_COUNTS.get(t, 1)):
            receptacles.append(Receptacle(alfred_id(t, rng, taken_ids), t, free_location(floor, rng, taken_locs)))
    return Room(scene, scene_kind(scene), types, tuple(sorted(receptacles, key=lambda r: r.id)), floor)
