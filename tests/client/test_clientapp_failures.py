"""A trainer service that dies mid-fit or refuses a call costs the server one line (issue 37): the
ClientApp answers with a Flower error reply naming the failure and the service's log, instead of
raising into Flower's simulation backend, which logged it with its Ray traceback (~220 lines
with ANSI codes) into the run's stream.

Real pieces throughout: the ClientApp and a trainer service (random-weight tiny policy, real shop
env service), Flower's own Simulation Runtime loop (`vce_api.run_api`: its workers, queues and
LinkState) with a backend that runs each message through `VirtualClientEngineActor.run`, the
code every Ray actor runs, in this process (Ray's transport aside), and the server's
RoundDispatch and request_one on Flower's InMemoryGrid.
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import PARTITION_ID_KEY
from flwr.server.superlink.fleet.vce.backend.backend import Backend
from flwr.server.superlink.fleet.vce.metrics import VceMetrics
from flwr.server.superlink.fleet.vce.vce_api import _register_node_info_stores, _register_nodes, run_api
from flwr.simulation.ray_transport.ray_actor import VirtualClientEngineActor
from flwr.supercore.logger import FLOWER_LOGGER
from grid_support import grid, link_state, task_identity
from trainer_support import model_dir, small_config  # noqa: F401

from client_app.app import app, train
from client_app.lane import LaneService
from fl_app.calls import RECORD, FitCall, InitCall
from fl_app.channel import arrays_key, write_disk_probe
from fl_app.config import load_config, recipe_sha256, save_config
from fl_app.provenance import code_root, code_sha256
from server_app.dispatch import Close, RoundDispatch, request_one
from server_app.strategy import reply_of

ROOT = Path(__file__).resolve().parents[2]
TASK_ID = 11


class InProcessBackend(Backend):
    """Flower's simulation Backend, each message run by `VirtualClientEngineActor.run` (what a Ray
    actor runs: it wraps what the ClientApp raises as ClientAppException) in the calling worker."""

    def __init__(self) -> None:
        super().__init__({})
        self.actor = VirtualClientEngineActor()

    def build(self, app_fn: Callable[[], ClientApp]) -> None:
        self.app_fn = app_fn

    @property
    def num_workers(self) -> int:
        return 2

    def is_worker_idle(self) -> bool:
        return True

    def terminate(self) -> None:
        pass

    def process_message(self, message: Message, context: Context) -> tuple[Message, Context]:
        _, out, context = self.actor.run(self.app_fn, message, str(context.node_config[PARTITION_ID_KEY]), context)
        return out, context


@dataclass
class Node:
    """What a node's ClientApp sees: the run config, the run dir, the call header the server sends."""

    run_id: int
    run_config: dict
    run_dir: Path

    def header(self) -> dict:
        cfg = load_config(str(self.run_config["recipe"]), overrides=self.run_config)
        return {
            "run_id": self.run_id,
            "recipe_sha256": recipe_sha256(cfg),
            "code_sha256": code_sha256(code_root()),
            "run_dir": str(self.run_dir),
            "run_dir_token": write_disk_probe(self.run_dir),
        }

    def lane(self) -> LaneService:
        return LaneService(self.run_id, self.run_config, log_dir=self.run_dir / "logs", run_dir=self.run_dir)


@pytest.fixture
def setup(tmp_path, monkeypatch, model_dir) -> Iterator[tuple[Path, dict]]:  # noqa: F811
    """A recipe for the tiny policy, a run dir, and a private runtime dir for this test's lane."""
    short = Path(tempfile.mkdtemp(prefix="fa-", dir="/tmp"))  # Unix socket paths are short
    monkeypatch.setenv("FEDAGENT_RUNTIME_DIR", str(short / "rt"))
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    recipe = tmp_path / "recipe.yaml"
    save_config(small_config(model_dir, run={"run_dir": str(run_dir), "weight_cache_dir": str(tmp_path / "c")}), recipe)
    yield run_dir, {"recipe": str(recipe), "run-dir": str(run_dir)}
    shutil.rmtree(short, ignore_errors=True)


@pytest.fixture
def flower_errors() -> Iterator[list[logging.LogRecord]]:
    """Every ERROR Flower logs (its simulation backend logs a raising ClientApp's traceback)."""
    records: list[logging.LogRecord] = []
    handler = logging.Handler(logging.ERROR)
    handler.emit = records.append  # type: ignore[method-assign]
    FLOWER_LOGGER.addHandler(handler)
    yield records
    FLOWER_LOGGER.removeHandler(handler)


def _message(node: int, mtype: str, call: FitCall | InitCall, arrays: dict[str, ArrayRecord] | None = None) -> Message:
    content = RecordDict({**(arrays or {}), RECORD: ConfigRecord({RECORD: call.model_dump_json()})})
    return Message(content=content, message_type=mtype, dst_node_id=node)


def _kill_mid_fit(node: Node, started: Path, killed: list[int]) -> None:
    """SIGKILL the lane's trainer service 2 s into the fit whose inputs appear at `started`."""
    deadline = time.monotonic() + 300
    while not started.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(2.0)  # the ClientApp is inside its /fit request; 200 epochs take minutes
    pid = node.lane().pid()
    assert pid is not None
    killed.append(pid)  # before the kill: the re-dispatch that follows it is the short fit
    os.kill(pid, signal.SIGKILL)


def test_a_service_killed_mid_fit_is_one_line_and_the_client_is_re_dispatched(setup, flower_errors):
    run_dir, overrides = setup
    run_id = 5
    factory, _, run = link_state(run_id, TASK_ID)
    run.override_config = overrides
    nodes_mapping = _register_nodes(2, factory)
    stores = _register_node_info_stores(nodes_mapping, run, app_dir=str(ROOT))
    nodes = sorted(nodes_mapping)
    node = Node(run_id, dict(stores[nodes[0]].retrieve_context(run_id).run_config), run_dir)
    stop = threading.Event()
    runtime = threading.Thread(
        target=run_api, args=(lambda: app, InProcessBackend, nodes_mapping, factory, stores, stop, VceMetrics())
    )
    runtime.start()
    log: list[str] = []
    try:
        with task_identity(run_id, TASK_ID):
            g, header = grid(factory, run), node.header()
            init = request_one(
                g, nodes, lambda n: _message(n, "query.init", InitCall(**header)), "round 0", 600.0, log.append
            )
            ref, arrays = reply_of(init).weights["actor"], init.content.array_records[arrays_key("actor")]
            started = run_dir / "rounds" / "round-0001" / "clients" / "client-0000" / "global-actor"
            killed: list[int] = []
            killer = threading.Thread(target=_kill_mid_fit, args=(node, started, killed))
            killer.start()

            def fit(cid: int, n: int) -> Message:  # the re-dispatched fit is short: the test is about the failure
                epochs = 200 if not killed else 1
                call = FitCall(**header, round=1, client_id=cid, local_epochs=epochs, seed=0, weights={"actor": ref})
                return _message(n, MessageType.TRAIN, call, {arrays_key("actor"): arrays})

            close = Close(per_round=1, min_ok=1)
            outcome = RoundDispatch(g, fit, round_=1, close=close, timeout_s=600.0, log=log.append).run({0: nodes[0]})
            killer.join(10)
    finally:
        stop.set()
        runtime.join(30)
        node.lane().shutdown()
    assert killed, "the service was never killed"
    logged = sum(len(r.getMessage().splitlines()) for r in flower_errors)
    assert not flower_errors, f"Flower logged {logged} lines of errors: {flower_errors[0].getMessage()[:300]}"
    assert list(outcome.replies) == [0] and outcome.replies[0].metadata.src_node_id == nodes[1]
    (failure,) = outcome.failures
    assert (failure.client, failure.node) == (0, nodes[0])
    assert failure.reason.startswith(
        "CLIENT_APP_RAISED_EXCEPTION: trainer service for lane cpu failed during /fit: RemoteProtocolError: "
    ), failure.reason
    assert f"(its log: {node.lane().log_path} on " in failure.reason
    assert "\n" not in failure.reason and "\x1b" not in failure.reason and "Traceback" not in failure.reason
    assert any(f"re-dispatching it to node {nodes[1]}" in line for line in log), log


def test_a_call_the_service_refuses_is_an_error_reply_of_one_line_with_its_detail(setup):
    run_dir, overrides = setup
    node = Node(3, overrides, run_dir)
    context = Context(run_id=3, node_id=42, node_config={}, state=RecordDict(), run_config=overrides)
    header = {**node.header(), "recipe_sha256": "0" * 64}  # a server with another recipe
    call = FitCall(**header, round=1, client_id=0, local_epochs=1, seed=0)
    try:
        with task_identity(3, TASK_ID):
            reply = train(_message(42, MessageType.TRAIN, call), context)
    finally:
        node.lane().shutdown()
    assert reply.has_error()
    reason = reply.error.reason
    assert reason.startswith("trainer service /fit failed (HTTP 409): Refused: ") and "different recipe" in reason
    assert "\n" not in reason
