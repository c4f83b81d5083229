"""`flwr run` on ALFWorld (issue 5): the real ServerApp, ClientApp, trainer service, ALFWorld env
service and tiny model, two rounds of two clients, on the small pinned game set
(tests/fixtures/e2e-alfworld-recipe.yaml scales the tiny-alfworld-grpo recipe to minutes)."""

from __future__ import annotations

import json

import pytest
from flower_harness import ROOT, flower, run_config, run_status
from test_alfworld import alf_cache  # noqa: F401

from fl_app.rundir import RunDir

RECIPE = ROOT / "tests" / "fixtures" / "e2e-alfworld-recipe.yaml"


@pytest.mark.slow
def test_flwr_run_trains_on_alfworld_for_two_rounds(alf_cache, tmp_path):
    cache = tmp_path / "cache"  # the run's FEDAGENT_CACHE_DIR: tiny model and games
    cache.mkdir()
    (cache / "alfworld").symlink_to(alf_cache)
    run_dir = tmp_path / "run"
    with flower(tmp_path / "flwr") as fl:
        fl.env["FEDAGENT_CACHE_DIR"] = str(cache)
        p = fl.run(run_config(RECIPE, run_dir), timeout_s=1500)
        status = run_status(run_dir)
        assert p.returncode == 0 and status.returncode == 0, status.stdout + p.stdout[-4000:] + p.stderr[-4000:]
        assert (run_dir / "summary.json").exists(), p.stdout[-4000:] + fl.superlink_log()[-4000:]
    rows = RunDir(run_dir, total_rounds=2).read_metrics()
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert all(0.0 <= r["val_success"] <= 1.0 and 1 <= r["val_turns"] <= 6 for r in rows)
    # 2 clients x 1 local epoch x 2 tasks x group 2
    assert all(len(r["clients"]) == 2 and r["train_num-examples"] == 8 for r in rows[1:])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["final_round"] == 2
    assert "name: alfworld" in (run_dir / "config.yaml").read_text()
    built = [json.loads(p.read_text()) for p in (cache / "models").glob("*/tiny_model.json")]
    assert len(built) == 1 and built[0]["env"]["name"] == "alfworld"
