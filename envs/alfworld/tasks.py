"""ALFRED tasks on a room: sample a goal, populate the room, write the PDDL problem ALFWorld plays.

Follows ALFRED's rules where the wheel ships them (`alfworld/gen/constants.py`,
`goal_library.py`): which objects fit which receptacle (`VAL_RECEPTACLE_OBJECTS`), which can be
cleaned/heated/cooled/toggled/sliced (`VAL_ACTION_OBJECTS`), which receptacles open
(`OPENABLE_CLASS_SET`), which room kinds a task type is valid in (`GOALS_VALID`), up to
`MAX_NUM_OF_OBJ_INSTANCES` instances per object type, the goal PDDL and the sentence templates.
Our own choices, kept small: every pickupable type the room lists gets 1..3 instances in random
fitting receptacles; the goal object never starts inside the goal receptacle type (so no game is
won at step 0); a cooling goal's object never starts in the fridge; lamps stand on furniture.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from envs.alfworld.engine import alfworld_module
from envs.alfworld.rooms import (
    Location,
    Receptacle,
    Room,
    alfred_id,
    constants,
    free_location,
    scene_kind,
    scene_object_types,
    scene_receptacle_types,
    static_receptacle_types,
)

TASK_TYPES = (
    "pick_and_place_simple",
    "look_at_obj_in_light",
    "pick_clean_then_place_in_recep",
    "pick_heat_then_place_in_recep",
    "pick_cool_then_place_in_recep",
    "pick_two_obj_and_place",
)
#: The appliance a state-change task needs, and the state predicate it sets.
APPLIANCE = {
    "pick_clean_then_place_in_recep": ("SinkBasin", "Cleanable", "isClean"),
    "pick_heat_then_place_in_recep": ("Microwave", "Heatable", "isHot"),
    "pick_cool_then_place_in_recep": ("Fridge", "Coolable", "isCool"),
}
LAMP_SURFACES = (
    "Desk",
    "SideTable",
    "Dresser",
    "Shelf",
    "CoffeeTable",
    "DiningTable",
    "TVStand",
    "ArmChair",
    "Sofa",
    "Bed",
)


@dataclass(frozen=True)
class Task:
    task_type: str
    object_target: str  # e.g. "Apple"
    parent_target: str  # goal receptacle type, "" for look_at_obj_in_light
    toggle_target: str = ""  # lamp type for look_at_obj_in_light

    def pddl_params(self) -> dict:
        """ALFRED's traj_data `pddl_params` (what `add_task_to_grammar` reads)."""
        return {
            "object_target": self.object_target,
            "parent_target": self.parent_target,
            "toggle_target": self.toggle_target,
            "mrecep_target": "",
            "object_sliced": False,
        }

    def folder(self, scene: int) -> str:
        """ALFRED's task folder name: <type>-<object>-<movable recep>-<receptacle or lamp>-<scene>."""
        return f"{self.task_type}-{self.object_target}-None-{self.parent_target or self.toggle_target}-{scene}"


@dataclass(frozen=True)
class Thing:
    id: str
    type: str
    receptacle: Receptacle


@dataclass(frozen=True)
class Scene:
    room: Room
    things: tuple[Thing, ...]
    start: Location


def _pickupable_types(room: Room) -> list[str]:
    """Types the room lists that some receptacle of the room can hold (never a receptacle itself)."""
    fits = constants().VAL_RECEPTACLE_OBJECTS
    static = static_receptacle_types()
    here = room.receptacle_types
    return sorted(t for t in room.object_types - static if any(t in fits[r] for r in here) and not t.endswith("Sliced"))


def task_valid_in(task_type: str, scene: int) -> bool:
    """ALFRED's room kinds for the task type, plus what it needs: a lamp on furniture to look
    under, the sink/microwave/fridge to clean/heat/cool with."""
    c = constants()
    if scene_kind(scene) not in c.GOALS_VALID[task_type]:
        return False
    receptacle_types = scene_receptacle_types(scene)
    if task_type == "look_at_obj_in_light":
        lamps = scene_object_types(scene) & c.VAL_ACTION_OBJECTS["Toggleable"]
        return bool(lamps) and bool(receptacle_types & set(LAMP_SURFACES))
    if task_type in APPLIANCE:
        return APPLIANCE[task_type][0] in receptacle_types
    return True


def _lamps(room: Room) -> list[str]:
    return sorted(room.object_types & constants().VAL_ACTION_OBJECTS["Toggleable"])


def _start_types(task_type: str, parent: str, holders: set[str]) -> set[str]:
    """Receptacle types the goal object may start in: never the goal receptacle type (no game is
    won at step 0) and, for cooling, never the fridge."""
    banned = {parent, "Fridge"} if task_type == "pick_cool_then_place_in_recep" else {parent}
    return holders - banned


def sample_task(task_type: str, room: Room, rng: random.Random) -> Task | None:
    """A goal valid in `room`, uniform over its (object, receptacle) choices; None if none."""
    c = constants()
    fits = c.VAL_RECEPTACLE_OBJECTS
    objects = _pickupable_types(room)
    if task_type == "look_at_obj_in_light":
        if not objects or not _lamps(room):
            return None
        return Task(task_type, rng.choice(objects), "", rng.choice(_lamps(room)))
    appliance = APPLIANCE.get(task_type)
    if appliance:
        objects = [o for o in objects if o in c.VAL_ACTION_OBJECTS[appliance[1]]]
    choices = []
    for o in objects:
        holders = {r.type for r in room.receptacles if o in fits[r.type]}
        for parent in sorted(holders):
            if appliance and parent == appliance[0]:
                continue
            if _start_types(task_type, parent, holders):
                choices.append((o, parent))
    if not choices:
        return None
    o, parent = rng.choice(choices)
    return Task(task_type, o, parent)


def populate(room: Room, task: Task, rng: random.Random) -> Scene:
    """Place 1..MAX_NUM_OF_OBJ_INSTANCES instances of every pickupable type (2.. for the
    two-object goal's object), one lamp per lamp type, and the agent on a free floor pose."""
    c = constants()
    fits = c.VAL_RECEPTACLE_OBJECTS
    taken_ids = {r.id for r in room.receptacles}
    things = []
    for t in _pickupable_types(room):
        holders = [r for r in room.receptacles if t in fits[r.type]]
        low = 1
        if t == task.object_target and task.parent_target:
            allowed = _start_types(task.task_type, task.parent_target, {r.type for r in holders})
            holders = [r for r in holders if r.type in allowed]
            low = 2 if task.task_type == "pick_two_obj_and_place" else 1
        for _ in range(rng.randint(low, max(low, c.MAX_NUM_OF_OBJ_INSTANCES))):
            things.append(Thing(alfred_id(t, rng, taken_ids), t, rng.choice(holders)))
    surfaces = [r for r in room.receptacles if r.type in LAMP_SURFACES]
    for lamp in _lamps(room):
        if surfaces:
            things.append(Thing(alfred_id(lamp, rng, taken_ids), lamp, rng.choice(surfaces)))
    taken_locs = {r.location for r in room.receptacles}
    return Scene(room, tuple(sorted(things, key=lambda th: th.id)), free_location(room.floor, rng, taken_locs))


def project(scene: Scene, task: Task) -> Scene:
    """ALFRED's planning view: only the objects of the goal's types (every receptacle stays)."""
    keep = {task.object_target, task.toggle_target}
    return Scene(scene.room, tuple(th for th in scene.things if th.type in keep), scene.start)


def task_sentence(task: Task, rng: random.Random) -> str:
    """One of ALFRED's templates for the task type, filled as ALFWorld fills it (lower-case types)."""
    template = rng.choice(alfworld_module("alfworld.gen.goal_library").gdict[task.task_type]["templates"])
    return template.format(
        obj=task.object_target.lower(), recep=task.parent_target.lower(), toggle=task.toggle_target.lower(), mrecep=""
    )


# ------------------------------------------------------------------------------ PDDL


def mangle(name: str) -> str:
    """ALFRED's PDDL-safe spelling of ids (PlannedGameState.fix_pddl_str_chars, minus '#')."""
    for char, word in (("-", "_minus_"), ("|", "_bar_"), ("+", "_plus_"), (".", "_dot_"), (",", "_comma_")):
        name = name.replace(char, word)
    return name


def _loc(loc: Location) -> str:
    return mangle("loc|%d|%d|%d|%d" % loc)


def problem_pddl(scene: Scene, task: Task, name: str) -> str:
    """The initial state and goal as an ALFRED PDDL problem for ALFWorld's `alfred.pddl` domain.

    Declares every ALFRED object type and receptacle type as a constant (as ALFRED does), so the
    domain's SinkBasinType/MicrowaveType/FridgeType/KnifeType references always resolve.
    """
    c = constants()
    fits = c.VAL_RECEPTACLE_OBJECTS
    act = c.VAL_ACTION_OBJECTS
    rtypes = sorted(c.RECEPTACLES - c.MOVABLE_RECEPTACLES_SET)
    otypes = sorted(c.OBJECTS_SET - set(rtypes))
    receps = scene.room.receptacles
    locations = sorted({r.location for r in receps} | {scene.start})
    decl = (
        ["agent1 - agent"]
        + [f"{t}Type - otype" for t in otypes]
        + [f"{t}Type - rtype" for t in rtypes]
        + [f"{mangle(th.id)} - object" for th in scene.things]
        + [f"{mangle(r.id)} - receptacle" for r in receps]
        + [f"{_loc(loc)} - location" for loc in locations]
    )
    init = [f"(atLocation agent1 {_loc(scene.start)})"]
    for r in receps:
        init += [
            f"(receptacleType {mangle(r.id)} {r.type}Type)",
            f"(receptacleAtLocation {mangle(r.id)} {_loc(r.location)})",
        ]
        if r.type in c.OPENABLE_CLASS_SET:
            init.append(f"(openable {mangle(r.id)})")
    present = sorted({th.type for th in scene.things})
    for rt in sorted(scene.room.receptacle_types):
        init += [f"(canContain {rt}Type {ot}Type)" for ot in present if ot in fits.get(rt, ())]
    for th in scene.things:
        o = mangle(th.id)
        init += [
            f"(objectType {o} {th.type}Type)",
            f"(inReceptacle {o} {mangle(th.receptacle.id)})",
            f"(objectAtLocation {o} {_loc(th.receptacle.location)})",
        ]
        if th.type in act["Toggleable"]:
            init.append(f"(toggleable {o})")
            continue
        init.append(f"(pickupable {o})")
        for predicate, group in (
            ("cleanable", "Cleanable"),
            ("heatable", "Heatable"),
            ("coolable", "Coolable"),
            ("sliceable", "Sliceable"),
        ):
            if th.type in act[group]:
                init.append(f"({predicate} {o})")
        if th.type in c.MOVABLE_RECEPTACLES_SET:
            init.append(f"(isReceptacleObject {o})")
    goal = (
        alfworld_module("alfworld.gen.goal_library")
        .gdict[task.task_type]["pddl"]
        .format(obj=task.object_target, recep=task.parent_target, toggle=task.toggle_target, mrecep="")
    )
    pad = "\n        "
    return (
        f"(define (problem plan_{name})\n    (:domain alfred)\n"
        f"    (:objects{pad}{pad.join(decl)}\n    )\n"
        f"    (:init{pad}{pad.join(init)}\n    )\n"
        f"{goal.replace('#', '-').strip()}\n"
    )
