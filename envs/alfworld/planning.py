"""The expert: ALFWorld's planner (fast-downward as shipped in fast-downward-textworld), run on
ALFRED's task-relevant projection of the current state.

Why a projection: ALFWorld's `AlfredExpert(PLANNER)` replans on the whole game, and with the
shipped room inventories (40-60 objects in a kitchen) fast-downward's search took up to 95 s of
CPU for one 7-step plan (measured; most plans take < 1 s, the tail is heavy). ALFRED itself
never planned on whole scenes: its `PlannedGameState` writes only the goal's object types (plus
what the agent holds) into the planning problem. We do the same. Objects outside the goal cannot
help reach it or block it (the domain has no capacity limits), so the projected plan is also a
valid and cost-optimal plan of the whole game; the generator replays every walkthrough in the
whole game and keeps the game only if it ends won, and a test does the same for the expert.
"""

from __future__ import annotations

import ctypes
import re
from typing import Any

from envs.alfworld.engine import ENGINE_LOCK, alfworld_module

_GOAL_TYPE = re.compile(r"objectType\s+\?\w+\s+(\w+)", re.IGNORECASE)
_planner_lib: Any = None


def goal_section(problem: str) -> str:
    """The problem's `(:goal ...)` through the closing parenthesis of `define`."""
    at = problem.find("(:goal")
    if at < 0:
        raise ValueError("PDDL problem has no (:goal ...) section")
    return problem[at:]


def projected_problem(facts: list[Any], name2type: dict[str, str], goal: str) -> str:
    """A PDDL problem holding the current facts restricted to every non-object entity, the
    objects of the goal's object types, and whatever the agent holds."""
    wanted = {t.lower() for t in _GOAL_TYPE.findall(goal)}
    keep = {f.arguments[0].name for f in facts if f.name == "objecttype" and f.arguments[1].name in wanted}
    keep |= {f.arguments[1].name for f in facts if f.name == "holds"}
    entities = {n: t for n, t in name2type.items() if t != "object" or n in keep}
    init = sorted(
        "(" + " ".join([f.name, *(a.name for a in f.arguments)]) + ")"
        for f in facts
        if all(a.name in entities for a in f.arguments)
    )
    objects = "\n".join(f"{n} - {t}" for n, t in sorted(entities.items()))
    return (
        "(define (problem projection)\n(:domain alfred)\n(:objects\n"
        + objects
        + "\n)\n(:init\n"
        + "\n".join(init)
        + "\n)\n"
        + goal
    )


def solve(domain: str, problem: str) -> list[str]:
    """fast-downward's plan (operator names) for a PDDL problem; [] if none.

    Uses the translation options of the engine's replanner (`optimize=True`) and one planner
    library per process, under the engine lock.
    """
    global _planner_lib
    fd = alfworld_module("fast_downward")
    with ENGINE_LOCK:
        if _planner_lib is None:
            _planner_lib = fd.load_lib()
        _task, sas = fd.pddl2sas(domain, problem, optimize=True)
        if not _planner_lib.solve_sas(ctypes.c_char_p(sas.encode("utf-8")), False):
            return []
        ops = (fd.Operator * _planner_lib.get_last_plan_length())()
        _planner_lib.get_last_plan(ops)
        return [op.name for op in ops]


def plan_commands(state: Any, game_data: dict, entity_infos: dict) -> list[str]:
    """Commands (as the game spells them) that reach the goal from `state` (a PddlState)."""
    problem = projected_problem(list(state.facts), state.name2type, goal_section(game_data["pddl_problem"]))
    ops = solve(game_data["pddl_domain"], problem)
    return state.plan_to_templated_actions(ops, entity_infos) if ops else []
