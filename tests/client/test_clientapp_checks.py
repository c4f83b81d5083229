"""The ClientApp's checks before any work (issue 14, items 2 and 3): it trains only the recipe the
server resolved and only with the run's code, and a node that cannot see the server's run dir
says so instead of failing later on a missing file. Flower's own Message and Context; no trainer
is started."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from client_app.app import RecipeMismatch, _node
from fl_app.config import load_config, recipe_sha256
from fl_app.provenance import CodeMismatch, code_root, code_sha256
from fl_app.transport import write_disk_probe
from fl_app.weights import WeightsError

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "tests" / "fixtures" / "e2e-recipe.yaml"


@pytest.fixture(autouse=True)
def task_identity() -> Iterator[None]:
    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 3, 1, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


def _context(tmp_path: Path, **overrides: object) -> Context:
    return Context(
        run_id=3,
        node_id=42,
        node_config={},
        state=RecordDict(),
        run_config={"recipe": str(RECIPE), "run-dir": str(tmp_path / "run"), **overrides},
    )


def _message(config: dict) -> Message:
    return Message(content=RecordDict({"config": ConfigRecord(config)}), dst_node_id=42, message_type="train")


def _server_config(tmp_path: Path, token: str) -> dict:
    cfg = load_config(str(RECIPE), overrides={"run-dir": str(tmp_path / "run")})
    return {
        "recipe-sha256": recipe_sha256(cfg),
        "code-sha256": code_sha256(code_root()),
        "run-dir": str(tmp_path / "run"),
        "run-dir-token": token,
    }


def test_a_node_refuses_a_recipe_other_than_the_server_s(tmp_path):
    conf = _server_config(tmp_path, "t")
    assert _node(_message(conf), _context(tmp_path)).cfg.federation.rounds == 2  # same recipe: accepted
    with pytest.raises(RecipeMismatch, match="node 42 resolved a different recipe than the server"):
        _node(_message(conf), _context(tmp_path, rounds=3))


def test_a_node_refuses_to_run_other_code_than_the_run_s_app(tmp_path):
    conf = {**_server_config(tmp_path, "t"), "code-sha256": "0" * 64}  # the server's FAB differs
    with pytest.raises(CodeMismatch, match=f"node 42 imports the project from {code_root()}.*another checkout"):
        _node(_message(conf), _context(tmp_path))


def test_node_local_paths_are_not_part_of_the_recipe(tmp_path, monkeypatch):
    conf = _server_config(tmp_path, "t")
    monkeypatch.setenv("FEDAGENT_CACHE_DIR", str(tmp_path / "elsewhere"))  # another machine's caches
    node = _node(_message(conf), _context(tmp_path))
    assert node.cache_dir == tmp_path / "elsewhere" / "weights"


def test_a_node_without_the_server_s_disk_names_it(tmp_path):
    (tmp_path / "run").mkdir()
    token = write_disk_probe(tmp_path / "run")
    node = _node(_message(_server_config(tmp_path, token)), _context(tmp_path))
    node.require_store(1 << 30)  # same disk: fine
    other = _node(_message(_server_config(tmp_path, "another-server's-token")), _context(tmp_path))
    with pytest.raises(
        WeightsError, match="node 42 .* cannot see the run dir at .*do not share a disk.*run.weight_store=http"
    ):
        other.require_store(1 << 30)
