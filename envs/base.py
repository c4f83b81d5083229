"""The engine contract every environment implements, in-process.

The service (`envs.service`) wraps any engine that satisfies `Env`; the rollout loop only
ever talks to the service. Keeping the contract tiny is what lets shop and ALFWorld share
the service, the client and the trainer's rollout code.

Task addressing: an engine serves a fixed, seeded list of tasks. `reset(seed)` plays task
`seed % num_tasks`. Tasks `[0, val_size)` are the fixed validation split; the rest are the
training pool that partitions cut into client shards.
"""

from __future__ import annotations

import hashlib
from typing import Protocol, runtime_checkable


@runtime_checkable
class Env(Protocol):
    """One environment instance: plays one episode at a time.

    `info` returned by `reset` and `step` always carries:
      - `task_id` (str): stable identity of the served task (GRPO groups are verified on it)
      - `instruction` (str): the task text the agent must fulfil
      - `valid_actions` (list[str]): the actions accepted in the new state
      - `won` (bool): True once the task is solved
    `step` additionally carries `valid_action` (bool): False when the action was not valid in
    the state it was taken in (the observation then repeats the state; never an exception),
    and, on the step that ends the episode (`done`), `outcome` (str): `won`, or the env's name
    for why it ended without a win (shop: `wrong_product`, `over_budget`, `wrong_options`), so
    every run can say per round why its agent fails.
    """

    name: str

    @property
    def num_tasks(self) -> int: ...

    @property
    def val_size(self) -> int: ...

    def reset(self, seed: int) -> tuple[str, dict]: ...

    def step(self, action: str) -> tuple[str, float, bool, dict]: ...

    def expert_action(self) -> str:
        """The oracle's next action in the current state (for demonstrations and checks)."""
        ...

    def task_ids(self) -> list[str]:
        """Task ids in served order: `task_ids()[i]` is what `reset(i)` plays."""
        ...

    def task_categories(self) -> list[str]:
        """Each task's category in served order (shop: the goal's product category; ALFWorld:
        the game's task type), read-only, for the task-preference partition."""
        ...


def task_order_fingerprint(env: Env) -> str:
    """sha256 over the full served task order; pool members must agree on it."""
    h = hashlib.sha256()
    for tid in env.task_ids():
        h.update(tid.encode())
        h.update(b"\0")
    return h.hexdigest()
