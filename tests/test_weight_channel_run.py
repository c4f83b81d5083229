"""Issue 14, weights without a shared disk, as a run: a `file://` store gives the same bits as
the run-dir store (every weight above the inline limit). The served store (`run.weight_store=
http`) is compared with the inline run in the default suite
(`test_flower_e2e.py::test_the_served_weight_store_gives_the_inline_runs_bits`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flower_harness import ROOT, flower, run_config, run_status

from fl_app.rundir import RunDir
from fl_app.weights import Manifest

FIXTURES = ROOT / "tests" / "fixtures"
STORE = FIXTURES / "e2e-store-recipe.yaml"


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


@pytest.mark.slow
def test_a_file_url_store_gives_the_same_bits(fl, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    _complete(fl, STORE, tmp_path / "disk")
    _complete(fl, STORE, tmp_path / "file", **{"run.weight_store": f'"file://{shared}"'})
    assert _digests(tmp_path / "disk", 1) == _digests(tmp_path / "file", 1)
    assert list(shared.rglob("round-0001/actor/manifest.json")), "the global model was published to the store"
