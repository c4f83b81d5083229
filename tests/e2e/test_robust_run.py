"""A real 2-round run, 4 clients a round, one of them poisoned (its update x100), aggregated by the
coordinate-wise median over the unflagged clients (issue #39): the round's metrics row scores
every client's update (round 2 against the server's first step too), flags and excludes exactly
the poisoned one, and the median of the rest keeps it out of the model."""

from __future__ import annotations

import json

import pytest
import torch
from flower_harness import ROOT, flower, run_config, run_status

from fl_app.rundir import RunDir
from fl_app.weights import load_shards

RECIPE = ROOT / "tests" / "fixtures" / "e2e-recipe.yaml"


@pytest.mark.slow  # 45 s; tests/channel/test_robust.py holds each aggregator and score to its definition
def test_a_poisoned_client_is_flagged_and_the_median_keeps_it_out(tmp_path):
    run_dir = tmp_path / "run"
    extra = {
        "rounds": 2,
        "clients-per-round": 4,
        "federation.aggregator": '"median"',
        "faults.poison.kind": '"scale"',
        "federation.drop_flagged": "true",
    }
    with flower(tmp_path / "flwr") as fr:
        p = fr.run(run_config(RECIPE, run_dir, **extra), timeout_s=1500)
    status = run_status(run_dir)
    assert p.returncode == 0 and status.returncode == 0, status.stdout + p.stdout[-4000:] + p.stderr[-4000:]
    rd = RunDir(run_dir, total_rounds=2)
    rows = [r for r in rd.read_metrics() if r["round"] > 0]
    print(json.dumps([{k: r[k] for k in ("round", "clients", "update_scores", "flagged", "excluded")} for r in rows]))
    for row in rows:
        poisoned = row["clients"][0]  # faults.poison without a list: the round's first sampled client
        scores = row["update_scores"]["actor"]
        assert sorted(scores) == sorted(str(c) for c in row["clients"])
        assert row["flagged"] == row["excluded"] == [poisoned], row
        assert [s["excluded"] for s in scores.values()] == [c == str(poisoned) for c in scores]
        steps = [s["step_z"] for s in scores.values()]  # round 1 has no server step before it
        assert all(z is None for z in steps) if row["round"] == 1 else all(isinstance(z, float) for z in steps)
        clean = [s["norm"] for c, s in scores.items() if c != str(poisoned)]
        assert scores[str(poisoned)]["norm"] > 50 * max(clean)  # x100 of an update like the others
    # The median's step is bounded by the clean updates: no coordinate moves 100x a clean step.
    before, after = load_shards(rd.member_dir(1, "actor")), load_shards(rd.member_dir(2, "actor"))
    step = torch.sqrt(sum(((after[k] - before[k]).double() ** 2).sum() for k in after if after[k].is_floating_point()))
    clean_norms = [s["norm"] for c, s in rows[1]["update_scores"]["actor"].items() if c != str(rows[1]["clients"][0])]
    assert float(step) <= max(clean_norms)
