"""The ClientApp's checks before any work: it runs only with the run's code, resolves its
node-local settings (caches, CA file) from its own environment without changing the recipe
digest, and a node that cannot see the server's run dir says so instead of failing later on a
missing file; a lane that resolved another recipe names the keys that differ (the trainer
service's check, also tests/client/test_service_hardening.py). Flower's own Message and
Context; no trainer is started."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity

from client_app.app import train
from client_app.service import Dirs, Refused, TrainerService
from fl_app.calls import RECORD, FitCall
from fl_app.channel import write_disk_probe
from fl_app.channel.open import node_channel
from fl_app.config import ConfigError, load_config, node_local_keys, recipe_leaves, recipe_mismatch, recipe_sha256
from fl_app.provenance import CodeMismatch, code_root, code_sha256
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


def _call(tmp_path: Path, token: str, **fields: object) -> FitCall:
    cfg = load_config(str(RECIPE), overrides={"run-dir": str(tmp_path / "run")})
    header = {
        "run_id": 3,
        "recipe_sha256": recipe_sha256(cfg),
        "recipe_leaves": recipe_leaves(cfg),
        "code_sha256": code_sha256(code_root()),
        "run_dir": str(tmp_path / "run"),
        "run_dir_token": token,
    }
    return FitCall(**{**header, "round": 1, "client_id": 0, "local_epochs": 1, "seed": 0, **fields})


def _message(call: FitCall) -> Message:
    content = RecordDict({RECORD: ConfigRecord({RECORD: call.model_dump_json()})})
    return Message(content=content, dst_node_id=42, message_type="train")


def _channel(tmp_path: Path, call: FitCall):
    cfg = load_config(str(RECIPE), overrides={"run-dir": str(tmp_path / "run")})
    return node_channel(call, cfg.run, "node 42 (here)")[0]


def test_a_node_refuses_to_run_other_code_than_the_run_s_app(tmp_path):
    call = _call(tmp_path, "t", code_sha256="0" * 64)  # the server's FAB differs
    with pytest.raises(CodeMismatch, match=f"node 42 .*imports the project from {code_root()}.*another checkout"):
        train(_message(call), _context(tmp_path))
    assert not (tmp_path / "run").exists()  # refused before anything was written


def test_node_local_paths_are_not_part_of_the_recipe(tmp_path, monkeypatch):
    """Before: a node whose FEDAGENT_CACHE_DIR differed from the server's was refused in round 0
    (`model.warm_start.cache_dir` was hashed into the digest)."""
    call = _call(tmp_path, "t")
    monkeypatch.setenv("FEDAGENT_CACHE_DIR", str(tmp_path / "elsewhere"))  # another machine's caches
    cfg = load_config(str(RECIPE), overrides={"run-dir": str(tmp_path / "run")})
    assert recipe_sha256(cfg) == call.recipe_sha256 and recipe_leaves(cfg) == call.recipe_leaves
    assert _channel(tmp_path, call).cache_dir == tmp_path / "elsewhere" / "weights"
    caches = (cfg.model.warm_start.cache_dir, cfg.model.tiny.cache_dir, cfg.run.weight_cache_dir)
    assert all(c.startswith(str(tmp_path / "elsewhere")) for c in caches), caches  # resolved here
    assert recipe_mismatch(cfg, call.recipe_leaves) == ""  # no key differs
    assert {"model.warm_start.cache_dir", "model.tiny.cache_dir", "run.weight_cache_dir"} <= set(node_local_keys())


@pytest.mark.parametrize("recipe", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.stem)
def test_no_recipe_digest_depends_on_the_machine(recipe, tmp_path, monkeypatch):
    """Every recipe resolves to one digest under two machines' environments (cache dirs, home):
    a key whose value comes from the machine must be declared NODE_LOCAL (fl_app/config.py)."""
    digests = []
    for machine in ("a", "b"):
        monkeypatch.setenv("FEDAGENT_CACHE_DIR", str(tmp_path / machine / "cache"))
        monkeypatch.setenv("HOME", str(tmp_path / machine))
        cfg = load_config(str(recipe), overrides={"run-dir": "/srv/runs/x"})
        digests.append((recipe_sha256(cfg), recipe_leaves(cfg)))
    assert digests[0] == digests[1]


def test_a_recipe_mismatch_names_the_keys_that_differ(tmp_path):
    """Before: `409 ... different recipe than the server (sha256 ab12... vs cd34...)` and nothing
    else. Now the lane names each differing key with its own value and both digests, and a plain
    model directory at another path says where it must be."""
    call = _call(tmp_path, "t")  # the server's resolution
    node = load_config(
        str(RECIPE), overrides={"run-dir": str(tmp_path / "run"), "algo.lr": 3e-4, "model.path": "/models/qwen"}
    )
    with pytest.raises(Refused) as err:
        TrainerService(node, 3, "cpu").check(call, Dirs(), ("actor",))
    message = str(err.value)
    assert err.value.status == 409 and "different recipe than the server" in message
    own = recipe_leaves(node)
    assert f"algo.lr: here 0.0003 ({own['algo.lr']}) vs server {call.recipe_leaves['algo.lr']}" in message
    path = own["model.path"]
    assert f'model.path: here "/models/qwen" ({path}) vs server' in message
    assert "same absolute path on every node" in message
    assert "federation." not in message  # only the keys that differ
    unnamed = call.model_copy(update={"recipe_leaves": {}})  # a server of another app version
    with pytest.raises(Refused, match="names no per-key digests"):
        TrainerService(node, 3, "cpu").check(unnamed, Dirs(), ("actor",))


def test_a_node_without_the_server_s_disk_names_it(tmp_path):
    (tmp_path / "run").mkdir()
    token = write_disk_probe(tmp_path / "run")
    _channel(tmp_path, _call(tmp_path, token)).require_store(1 << 30)  # same disk: fine
    other = _channel(tmp_path, _call(tmp_path, "another-server's-token"))
    with pytest.raises(
        WeightsError, match="node 42 .* cannot see the run dir at .*do not share a disk.*run.weight_store=http"
    ):
        other.require_store(1 << 30)


@pytest.mark.parametrize("path", ["/models/not-on-this-node", "cache:not-imported-here"])
def test_a_node_without_the_model_says_every_node_needs_it(tmp_path, monkeypatch, path):
    """Before: `ModelDirError: model directory ... does not exist: set model.path to a local Hugging
    Face model directory, or to tiny`, after the env service had started, naming neither the node
    nor that every node needs the model (a `cache:` name at the same place)."""
    monkeypatch.setenv("FEDAGENT_CACHE_DIR", str(tmp_path / "cache"))
    cfg = load_config(str(RECIPE), overrides={"run-dir": str(tmp_path / "run"), "model.path": path})
    with pytest.raises(ConfigError, match="no model directory at .* Every node needs the model locally"):
        TrainerService(cfg, 3, "cpu").start()
