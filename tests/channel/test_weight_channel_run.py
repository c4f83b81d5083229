"""Issue 14, weights without a shared disk, as a run: a `file://` store and an `s3://` store
(moto's S3 server, credentials and endpoint from the environment as on a real node) give the
same bits as the run-dir store (every weight above the inline limit). The served store (`run.weight_store=
http`) is compared with the inline run in the default suite
(`test_flower_e2e.py::test_the_served_weight_store_gives_the_inline_runs_bits`)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flower_harness import ROOT, flower, run_config, run_status
from test_store_fsspec import s3, s3fs  # noqa: F401  (s3: the moto S3 server fixture, used by name)

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


@pytest.mark.slow
def test_an_s3_store_gives_the_same_bits(tmp_path, request, monkeypatch):
    """Server and nodes reach the object store through the driver's usual environment (never the
    run config); set before the local SuperLink starts, as an operator's environment would be."""
    opts = request.getfixturevalue("s3")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", opts["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", opts["secret"])
    monkeypatch.setenv("AWS_ENDPOINT_URL", opts["client_kwargs"]["endpoint_url"])
    monkeypatch.setenv("AWS_DEFAULT_REGION", opts["client_kwargs"]["region_name"])
    with flower(tmp_path / "flwr") as fr:
        _complete(fr, STORE, tmp_path / "disk")
        _complete(fr, STORE, tmp_path / "s3", **{"run.weight_store": '"s3://weights/runs"'})
        # another run (other seed: other uploads under the same keys) into the same prefix: its own run-<id>
        _complete(fr, STORE, tmp_path / "s3-again", seed=1, **{"run.weight_store": '"s3://weights/runs"'})
    assert _digests(tmp_path / "disk", 1) == _digests(tmp_path / "s3", 1) != _digests(tmp_path / "s3-again", 1)
    uploads = s3fs().S3FileSystem(**opts).find("weights/runs")
    assert any("/clients/client-" in u for u in uploads), uploads[:20]  # the nodes uploaded there
    assert any(u.endswith("round-0001/actor/manifest.json") for u in uploads), uploads[:20]
