"""bench.published_round end to end at a tiny scale on the CPU: the real trainer, env service,
channel shards and FedAvg; the report's structure, the published client draw, and the phases
adding up to the measured wall."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from trainer_support import random_model_dir

from bench.published_round import FEDAGENT_GPU_MIN_PER_ROUND, main
from client_app.service import TrainerService

# the bench's own seconds between the phases (building calls, listing uploads): the run's phases
# and the lane's unnamed rest must cover the rest of the measured wall
GLUE_SHARE = 0.05


def _argv(tmp: Path, out: Path) -> list[str]:
    model = random_model_dir(tmp / "policy", max_positions=256)
    argv = ["--model", str(model), "--device", "cpu", "--synthetic-catalog", "--clients", "1", "--iterations", "1"]
    argv += ["--tasks", "2", "--group", "2", "--turns", "2", "--val-tasks", "2", "--work-dir", str(tmp)]
    argv += ["--json", str(out), "rollout.max_response_tokens=4", "rollout.max_prompt_tokens=128"]
    return argv + ["run.compile=false", "env.pool_size=4"]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    tmp = tmp_path_factory.mktemp("round")
    out = tmp / "round.json"
    assert main(_argv(tmp, out)) == 0
    return json.loads(out.read_text())


def test_a_round_cut_off_in_validation_keeps_its_measured_fits(tmp_path: Path, monkeypatch) -> None:
    """Device time that ends during validation (an error there, here) leaves the JSON with the
    stage it reached and every finished fit's numbers."""

    def ended(*args: object, **kwargs: object) -> None:
        raise RuntimeError("the device went back")

    monkeypatch.setattr(TrainerService, "evaluate", ended)
    out = tmp_path / "round.json"
    with pytest.raises(RuntimeError, match="the device went back"):
        main(_argv(tmp_path, out))
    so_far = json.loads(out.read_text())
    assert so_far["complete"] is False and so_far["stage"] == "validation"
    assert list(so_far["fits"]) == ["81"] and so_far["fits"]["81"]["rollout_s"] > 0
    assert so_far["fits"]["81"]["update_s"] > 0 and so_far["server_s"]["aggregation"] > 0


def test_round_is_computed_from_the_measured_part(report: dict) -> None:
    """One client x one iteration of the recipe's 2 x 3: each of the 2 clients' fit phases x 3,
    load and export once per client, aggregation and validation as measured; the round is the
    sum of its phases, the lane's unnamed rest scaled like its fits in `other`."""
    assert report["round"] == "computed from 1 client(s) x 1 iteration(s) of 2 x 3"
    assert (report["engine"], report["rollout_engine"]) == ("builtin", "hf")  # the recipe's vLLM needs a GPU
    measured, phases = report["measured_phase_s"], report["phase_s"]
    for p, factor in {"rollout": 6, "scoring": 6, "update": 6, "load": 2, "export": 2}.items():
        assert phases[p] == pytest.approx(measured[p] * factor, abs=0.01), p
    for p in ("aggregation", "validation"):
        assert phases[p] == measured[p], p
    assert phases["transport"] == phases["checkpoint"] == phases["dispatch"] == 0.0
    glue = measured["other"] - report["lane_unnamed_s"] + measured["dispatch"]
    assert phases["other"] == pytest.approx(6 * report["lane_unnamed_s"] + glue, abs=0.01)
    assert report["round_s"] == pytest.approx(sum(phases.values()), abs=0.01)


def test_phases_add_up_to_the_measured_wall(report: dict) -> None:
    """The run's phases (metrics.jsonl's arithmetic) add up to the measured wall, and what no
    phase names is the lane's own unnamed rest, leaving only a sliver of bench glue."""
    measured, wall = report["measured_phase_s"], report["measured_wall_s"]
    assert sum(measured.values()) == pytest.approx(wall, abs=0.01)
    assert all(measured[p] > 0 for p in ("load", "rollout", "update", "export", "aggregation", "validation"))
    glue = measured["other"] - report["lane_unnamed_s"] + measured["dispatch"]
    assert 0 <= report["lane_unnamed_s"] <= measured["other"] + 0.001
    assert abs(glue) <= GLUE_SHARE * wall
    (fit,) = report["fits"].values()
    named = fit["load_s"] + fit["rollout_s"] + fit["scoring_s"] + fit["update_s"] + fit["export_s"]
    assert fit["fit_total_s"] == pytest.approx(named + report["lane_unnamed_s"], abs=0.01)


def test_report_names_its_shape_and_the_published_draw(report: dict) -> None:
    shape = report["shape"]
    assert (shape["clients_per_round"], shape["local_epochs"]) == (2, 3)  # the recipe's M and E
    assert (shape["tasks"], shape["group"], shape["max_turns"], shape["max_response_tokens"]) == (2, 2, 2, 4)
    assert report["at_recipe_scale"] is False and report["complete"] is True
    assert report["clients"] == [81, 14]  # Random(42 + 1 - 1).sample(range(100), 2): the published round 1
    assert list(report["fits"]) == ["81"]
    assert report["fits"]["81"]["rows"] > 0 and report["fits"]["81"]["optimizer_steps"] == 1
    replies = report["replies"]
    assert 0 < replies["turns"] <= 4 * 2 and replies["reply_tokens_max"] <= replies["reply_cap"] == 4
    assert replies["prompt_tokens_max"] <= replies["prompt_cap"] == 128
    assert report["gpus"] == 0 and report["vs_fedagent"] is None and report["peak_memory"] is None
    assert report["fedagent_h100_minutes_per_round"] == round(FEDAGENT_GPU_MIN_PER_ROUND, 1) == 82.3


def test_missing_catalog_is_refused_before_any_build(tmp_path: Path) -> None:
    """The published recipe reads WebShop's files; without them the bench names the fix and
    builds nothing (no model written)."""
    with pytest.raises(SystemExit, match="--synthetic-catalog"):
        main(["--device", "cpu", "--model-dir", str(tmp_path / "model"), "env.params.data_dir=/nonexistent"])
    assert not (tmp_path / "model").exists()


def test_the_engines_bench_refuses_a_missing_catalog_before_measuring(tmp_path: Path, capsys) -> None:
    """bench.engines on the published recipe checks its catalog first (no peak measured, no model
    read) and takes the same `--synthetic-catalog`."""
    from bench import engines

    argv = ["--recipe", "webshop-grpo-qwen2.5-1.5b", "--device", "cpu", "--model", str(tmp_path / "none")]
    with pytest.raises(SystemExit, match="--synthetic-catalog"):
        engines.main([*argv, "--arms", "peak,hf", "env.params.data_dir=/nonexistent"])
    assert "peak_tflops" not in capsys.readouterr().out
    args = argparse.Namespace(
        recipe="webshop-grpo-qwen2.5-1.5b", model=tmp_path, device="cpu", turns=15, synthetic_catalog=True, overrides=[]
    )
    cfg = engines.bench_config(args, "hf")
    assert (cfg.env.params["data_dir"], cfg.env.params["num_products"], cfg.rollout.engine) == (None, 1000, "hf")
