"""Issue 14, weights without a shared disk, as a run: `flwr run` with `run.weight_store=http`
(the ServerApp serves its run dir over HTTP, nodes fetch the global model and upload their
results with the run's token, writing only node-local files) or a `file://` store gives the
same bits as the run-dir store; every weight is above the inline limit, so all of it crosses
the channel. Real Flower simulation, real trainer, real HTTP store."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flower_harness import ROOT, flower, run_config, run_status

from fl_app.rundir import RunDir
from fl_app.weights import Manifest

FIXTURES = ROOT / "tests" / "fixtures"
STORE, HTTP = FIXTURES / "e2e-store-recipe.yaml", FIXTURES / "e2e-http-recipe.yaml"


@pytest.fixture(scope="module")
def fl(tmp_path_factory):
    with flower(tmp_path_factory.mktemp("flwr")) as fr:
        yield fr


def _complete(fl, recipe: Path, run_dir: Path, **extra: object) -> dict:
    p = fl.run(run_config(recipe, run_dir, rounds=1, **extra), timeout_s=900)
    status = run_status(run_dir)
    assert status.returncode == 0, status.stdout + p.stdout[-3000:] + p.stderr[-3000:]
    return {"log": p.stdout + p.stderr, "summary": json.loads((run_dir / "summary.json").read_text())}


def _digests(run_dir: Path, rnd: int) -> list[str]:
    return [s.digest for s in Manifest.from_dir(RunDir(run_dir).member_dir(rnd)).shards]


def test_served_store_and_shared_disk_store_give_the_same_bits(fl, tmp_path):
    disk = _complete(fl, STORE, tmp_path / "disk")
    http = _complete(fl, HTTP, tmp_path / "http", **{"run.weight_cache_dir": f'"{tmp_path / "node-cache"}"'})
    assert _digests(tmp_path / "disk", 1) == _digests(tmp_path / "http", 1)
    assert _digests(tmp_path / "disk", 0) == _digests(tmp_path / "http", 0)
    assert "weight store: serving" in http["log"] and "weight store: serving" not in disk["log"]
    # through the channel: round 0's model was uploaded into the server's run dir by a node, and
    # the nodes fetched the global models into their own cache, writing only there
    assert (tmp_path / "http" / "scratch" / "init-actor" / "manifest.json").is_file()
    cache = tmp_path / "node-cache"
    assert len([p for p in cache.iterdir() if (p / "manifest.json").is_file()]) == 2  # rounds 0 and 1
    assert not list((cache / "work").rglob("*.safetensors")), "published dirs are dropped"
    assert http["summary"]["services"] and sum(s["fits"] for s in http["summary"]["services"]) == 2


@pytest.mark.slow
def test_a_file_url_store_gives_the_same_bits(fl, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    _complete(fl, STORE, tmp_path / "disk")
    _complete(fl, STORE, tmp_path / "file", **{"run.weight_store": f'"file://{shared}"'})
    assert _digests(tmp_path / "disk", 1) == _digests(tmp_path / "file", 1)
    assert list(shared.rglob("round-0001/actor/manifest.json")), "the global model was published to the store"
