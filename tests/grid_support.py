"""Flower's in-memory SuperLink for tests: a LinkState holding one run, the ServerApp's grid over it,
and the task identity Flower's grid reads (what simulation runs on, without a process of its own)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from flwr.proto.task_pb2 import Task
from flwr.server.superlink.linkstate import LinkState, LinkStateFactory
from flwr.server.superlink.linkstate.in_memory_linkstate import RunRecord
from flwr.supercore.constant import FLWR_IN_MEMORY_DB_NAME, NOOP_FEDERATION_ID
from flwr.supercore.object_store import ObjectStoreFactory
from flwr.supercore.run import Run
from flwr.supercore.task_identity import TaskIdentity
from flwr.superlink.federation import NoOpFederationManager
from flwr.superlink.grid import InMemoryGrid

SUPERLINK = 1


def link_state(run_id: int, task_id: int) -> tuple[LinkStateFactory, LinkState, Run]:
    """A fresh in-memory LinkState with run `run_id` (its primary task `task_id`) registered."""
    factory = LinkStateFactory(FLWR_IN_MEMORY_DB_NAME, NoOpFederationManager(), ObjectStoreFactory())
    state = factory.state()
    run = Run.create_empty(run_id)
    run.primary_task_id, run.federation_id = task_id, NOOP_FEDERATION_ID
    state.run_ids[run_id] = RunRecord(run=run)
    state.task_store[task_id] = Task(task_id=task_id, run_id=run_id)
    return factory, state, run


def grid(factory: LinkStateFactory, run: Run) -> InMemoryGrid:
    """The ServerApp's end of `factory`'s state, as simulation gives it."""
    g = InMemoryGrid(state_factory=factory, pull_interval=0.05)
    g.set_run(run)
    return g


@contextmanager
def task_identity(run_id: int, task_id: int) -> Iterator[None]:
    """The ServerApp's task identity while the block runs (Flower's grid stamps messages with it)."""
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = run_id, SUPERLINK, task_id
    try:
        yield
    finally:
        TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved
