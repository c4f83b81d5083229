"""PPO through the real thing (`flwr run`, ServerApp, ClientApp, trainer service, env service,
tiny model): the critic is federated beside the policy every round, a round is complete only
with both, and a resumed run restores the critic (invariant 7)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from flower_harness import ROOT, flower, run_config, run_status

from fl_app.rundir import RunDir
from fl_app.weights import Manifest

RECIPE = ROOT / "tests" / "fixtures" / "e2e-ppo-recipe.yaml"
MEMBERS = ("actor", "critic")


def _run(fr, run_dir: Path, rounds: int) -> str:
    p = fr.run(run_config(RECIPE, run_dir, rounds=rounds), timeout_s=1500)
    out = p.stdout + p.stderr
    status = run_status(run_dir)
    assert p.returncode == 0 and status.returncode == 0, status.stdout + out[-4000:] + fr.superlink_log()[-3000:]
    return out


def _digests(run_dir: Path, r: int) -> dict[str, list[str]]:
    rd = RunDir(run_dir)
    return {m: [s.digest for s in Manifest.from_dir(rd.member_dir(r, m)).shards] for m in MEMBERS}


@pytest.mark.slow
@pytest.mark.timeout(2400)  # three `flwr run`s (2 + 1 + 3 rounds): ~10 min on 2 loaded cores
def test_ppo_flwr_run_federates_the_critic_and_resume_restores_it(tmp_path):
    """rounds=2, then resumed to rounds=3, against an uninterrupted rounds=3 run: every round
    holds an aggregated critic beside the actor; round 3 of the resumed run is bit-identical to
    the uninterrupted one in both members, and the critic's value predictions on round 3's
    rollouts (made by the round-2 critic the resume loaded, before any update) are identical."""
    resumed, fresh = tmp_path / "resumed", tmp_path / "fresh"
    with flower(tmp_path / "flwr") as fr:
        _run(fr, resumed, rounds=2)
        rd = RunDir(resumed, total_rounds=2, members=MEMBERS)
        assert rd.last_complete_round() == 2
        for r in range(3):
            assert rd.recorded_members(r) == list(MEMBERS)
            assert Manifest.from_dir(rd.member_dir(r, "critic")).tensor_bytes > 0
        first = json.loads((resumed / "summary.json").read_text())
        assert first["members"] == list(MEMBERS)
        assert first["critic"]["init"] == "fresh" and first["critic"]["source"] == ""
        rows = rd.read_metrics()
        assert rows[0]["critic_start"]["mode"] == "fresh"
        assert all(r["train_critic_optimizer_steps"] > 0 for r in rows[1:])

        out = _run(fr, resumed, rounds=3)
        assert "resuming after round 2" in out, out[-4000:]
        _run(fr, fresh, rounds=3)
    after = json.loads((resumed / "summary.json").read_text())
    assert after["critic"] == {
        "init": "resume",
        "source": str(RunDir(resumed).member_dir(2, "critic")),
        "round0": rows[0]["critic_start"],
    }
    assert _digests(resumed, 2) == _digests(fresh, 2)
    assert _digests(resumed, 3) == _digests(fresh, 3)
    row3 = {name: RunDir(name).read_metrics()[3] for name in (resumed, fresh)}
    assert row3[resumed]["train_critic_value_mean"] == row3[fresh]["train_critic_value_mean"]
    # the metric tracks the critic: round 2 started from another critic and predicted otherwise
    assert row3[resumed]["train_critic_value_mean"] != rows[2]["train_critic_value_mean"]
