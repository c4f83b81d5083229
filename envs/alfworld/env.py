"""`AlfworldEnv`: ALFWorld's text mode on the real engine, behind the project's Env protocol.

Observations are the engine's text verbatim ("-= Welcome to TextWorld, ALFRED! =-", "You arrive
at countertop 1. On the countertop 1, you see ..."); `valid_actions` are the engine's
admissible commands. An action is matched after lower-casing and collapsing whitespace; one that
is not admissible changes nothing (same observation, reward 0, valid_action False; the engine
itself would answer "Nothing happens."). Reward 1.0 on the step that wins, and the episode ends
there; `max_steps` (optional, counting every step) also ends it. The step budget normally
belongs to the rollout.

Task addressing (envs/base.py): `reset(seed)` plays task `seed % num_tasks`; tasks
[0, val_size) are the validation games. Which games and in which order: games.py.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from envs.alfworld.engine import AlfredGame
from envs.alfworld.games import (
    DEFAULT_GENERATED_GAMES,
    OFFICIAL_MANIFESTS,
    Game,
    generated_games,
    official_games,
    resolve_data_dir,
)
from envs.alfworld.generate import GameSetSpec
from envs.alfworld.tasks import TASK_TYPES

TASK_PREFIX = "Your task is to: "


def normalize(action: str) -> str:
    return " ".join(action.lower().split())


class AlfworldEnv:
    """One ALFWorld episode at a time on its own engine instance.

    Params:
      num_games      tasks served (validation + training). Generated data: how many to
                     generate (default 120); official data: a cap (default: all).
      val_size       validation games, taken from `val_split` (default 24).
      seed           generation seed and the seed of the served order.
      data_dir       official data root (holding json_2.1.1/); None: $ALFWORLD_DATA if set,
                     else generated games; "generated": generated games regardless.
      cache_dir      where generated games live (default $FEDAGENT_CACHE_DIR/alfworld or
                     ~/.cache/fedagent-flower/alfworld).
      task_types     subset of the six ALFWorld task types (default: all six).
      val_split      valid_seen (default) or valid_unseen.
      max_steps      end episodes after this many steps (default: never; the rollout's budget).
      manifest_dir   manifests of the official data (default: the committed ones).
      only_tasks     environment heterogeneity (env_disjoint): the task ids this engine may
                     play, all training games; an id it does not serve, or a reset to any other
                     task, raises ValueError (default None: every task).
    """

    name = "alfworld"

    def __init__(
        self,
        num_games: int | None = None,
        val_size: int = 24,
        seed: int = 0,
        data_dir: str | None = None,
        cache_dir: str | None = None,
        task_types: Sequence[str] | None = None,
        val_split: str = "valid_seen",
        max_steps: int | None = None,
        manifest_dir: str | None = None,
        only_tasks: Sequence[str] | None = None,
    ):
        types = tuple(sorted(set(task_types or TASK_TYPES), key=_type_rank))
        if val_size < 0 or (max_steps is not None and max_steps < 1):
            raise ValueError(f"val_size must be >= 0 and max_steps >= 1 (got {val_size}, {max_steps})")
        root = resolve_data_dir(data_dir)
        if root is None:
            total = DEFAULT_GENERATED_GAMES if num_games is None else num_games
            if total < val_size:
                raise ValueError(f"num_games={total} is smaller than val_size={val_size}")
            spec = GameSetSpec(seed, total - val_size, val_size, val_split, types)
            self._games: list[Game] = generated_games(spec, None if cache_dir is None else Path(cache_dir))
        else:
            self._games = official_games(
                root,
                Path(manifest_dir) if manifest_dir else OFFICIAL_MANIFESTS,
                types,
                seed,
                val_size,
                num_games,
                val_split,
            )
        if not self._games:
            raise ValueError("no ALFWorld game to serve: raise num_games or widen task_types")
        self._val_size = val_size
        self._max_steps = max_steps
        self._allowed = None if only_tasks is None else self._training_indices(only_tasks)
        self._engine = AlfredGame()
        self._task = -1

    # -- task addressing ---------------------------------------------------------------------
    @property
    def num_tasks(self) -> int:
        return len(self._games)

    @property
    def val_size(self) -> int:
        return self._val_size

    def task_ids(self) -> list[str]:
        return [g.task_id for g in self._games]

    def task_categories(self) -> list[str]:
        return [g.task_type for g in self._games]

    def game(self, task: int) -> Game:
        return self._games[task % self.num_tasks]

    def _training_indices(self, ids: Sequence[str]) -> frozenset[int]:
        """Served positions of `ids`; each must be a training game this engine serves."""
        where = {g.task_id: i for i, g in enumerate(self._games)}
        unknown = [t for t in ids if where.get(t, -1) < self._val_size]
        if unknown or not ids:
            raise ValueError(
                f"only_tasks must name training games this engine serves; {len(unknown)} of "
                f"{len(ids)} do not, e.g. {unknown[:3]} (another game set, seed or val_size?)"
            )
        return frozenset(where[t] for t in ids)

    # -- episode -----------------------------------------------------------------------------
    def reset(self, seed: int) -> tuple[str, dict]:
        task = seed % self.num_tasks
        if self._allowed is not None and task not in self._allowed:
            raise ValueError(
                f"task {task} ({self._games[task].task_id}) is not one of this engine's "
                f"only_tasks: this engine does not serve it"
            )
        self._task = task
        frame = self._engine.reset(self._games[self._task].path)
        self._obs, self._admissible, self._won = frame.feedback, frame.admissible, frame.won
        self._instruction = _instruction(frame.feedback)
        self._steps = 0
        self._plan: list[str] | None = self._engine.walkthrough or None
        return self._obs, self._info()

    def step(self, action: str) -> tuple[str, float, bool, dict]:
        if self._task < 0:
            raise RuntimeError("call reset(seed) before step()")
        command = normalize(action)
        valid = not self.done and command in self._admissible
        reward = 0.0
        if valid:
            frame = self._engine.step(command)
            self._obs, self._admissible = frame.feedback, frame.admissible
            reward = 1.0 if frame.won and not self._won else 0.0
            self._won = frame.won
            self._plan = self._plan[1:] if self._plan and self._plan[0] == command else None
        self._steps += 1
        info = self._info()
        info["valid_action"] = valid
        if self.done:
            info["outcome"] = "won" if self._won else "out_of_steps"
        return self._obs, reward, self.done, info

    @property
    def done(self) -> bool:
        return self._won or (self._max_steps is not None and self._steps >= self._max_steps)

    def expert_action(self) -> str:
        """The next command of the walkthrough while the episode follows it, else of a fresh
        plan from ALFWorld's planner (planning.py); "" once the episode is over."""
        if self._task < 0 or self.done:
            return ""
        if not self._plan or self._plan[0] not in self._admissible:
            self._plan = self._engine.plan() or None
        return self._plan[0] if self._plan else ""

    def _info(self) -> dict[str, Any]:
        game = self._games[self._task]
        return {
            "task_id": game.task_id,
            "task_index": self._task,
            "task_type": game.task_type,
            "instruction": self._instruction,
            "valid_actions": list(self._admissible),
            "won": self._won,
        }


def _type_rank(task_type: str) -> int:
    if task_type not in TASK_TYPES:
        raise ValueError(f"unknown task type {task_type!r}; choose from {TASK_TYPES}")
    return TASK_TYPES.index(task_type)


def _instruction(intro: str) -> str:
    """The goal sentence of the intro's "Your task is to: <goal>." line."""
    for line in intro.splitlines():
        if line.startswith(TASK_PREFIX):
            return line[len(TASK_PREFIX) :].rstrip(".")
    raise ValueError(f"the game's intro has no {TASK_PREFIX!r} line: {intro[-200:]!r}")
