"""The real thing: `flwr run` against a private local SuperLink, the real ServerApp, ClientApp,
trainer service, env service and tiny model (issue 4's must-shows, scaled to minutes)."""
from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import psutil
import pytest

from fl_app.rundir import RunDir
from fl_app.weights import Manifest, load_shards
from flower_harness import ROOT, flower

RECIPE = ROOT / "tests" / "fixtures" / "e2e-recipe.yaml"


def _rc(run_dir: Path, **extra: object) -> str:
    items = {"recipe": f'"{RECIPE}"', "run-dir": f'"{run_dir}"', **{k: str(v) for k, v in extra.items()}}
    return " ".join(f"{k}={v}" for k, v in items.items())


def _service_pids(home: Path) -> list[int]:
    rt = home / "rt"
    return [int(p.read_text()) for p in rt.glob("svc-*.pid")] if rt.exists() else []


@pytest.fixture(scope="module")
def fl(tmp_path_factory):
    with flower(tmp_path_factory.mktemp("flwr")) as fr:
        yield fr


@pytest.fixture(scope="module")
def two_rounds(fl, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("run") / "r"
    p = fl.run(_rc(run_dir, rounds=2), timeout_s=1500)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert (run_dir / "summary.json").exists(), p.stdout[-4000:] + fl.superlink_log()[-4000:]
    return run_dir


def test_flwr_run_completes_rounds_and_writes_the_run_dir(two_rounds, fl):
    rd = RunDir(two_rounds, total_rounds=2)
    assert rd.last_complete_round() == 2
    rows = rd.read_metrics()
    assert [r["round"] for r in rows] == [0, 1, 2]
    assert all("val_success" in r for r in rows)
    assert all(len(r["clients"]) == 2 and r["train_num-examples"] > 0 for r in rows[1:])
    summary = json.loads((two_rounds / "summary.json").read_text())
    assert summary["status"] == "complete" and summary["final_round"] == 2
    assert (two_rounds / "validation.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (two_rounds / "config.yaml").exists()
    for r in range(3):
        assert Manifest.from_dir(rd.member_dir(r)).tensor_bytes > 0


def test_one_trainer_service_serves_every_fit_and_stops(two_rounds, fl):
    summary = json.loads((two_rounds / "summary.json").read_text())
    (svc,) = summary["services"]                       # one lane (CPU) -> one service
    assert svc["fits"] == 4 and svc["evals"] == 3      # 2 rounds x 2 clients; rounds 0, 1, 2
    for pid in _service_pids(fl.home):
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_bf16_unrepresentable_value_survives_client_aggregation_and_reload(two_rounds):
    """Invariant 1: fp32 end to end (a bf16 round trip would collapse these values)."""
    state = load_shards(RunDir(two_rounds).member_dir(2))
    flat = next(iter(t for t in state.values() if t.is_floating_point() and t.numel() > 1000)).flatten()
    assert not (flat == flat.bfloat16().float()).all()


def test_resume_continues_after_the_last_round_on_disk_and_matches_uninterrupted(fl, two_rounds, tmp_path):
    """rounds=2 then rounds=3 on the same dir == an uninterrupted rounds=3 run, bit for bit."""
    p = fl.run(_rc(two_rounds, rounds=3), timeout_s=900)
    assert "resuming after round 2" in p.stdout, p.stdout[-4000:]
    fresh = tmp_path / "fresh"
    p2 = fl.run(_rc(fresh, rounds=3), timeout_s=900)
    assert p2.returncode == 0
    resumed = Manifest.from_dir(RunDir(two_rounds).member_dir(3))
    uninterrupted = Manifest.from_dir(RunDir(fresh).member_dir(3))
    assert [s.sha256 for s in resumed.shards] == [s.sha256 for s in uninterrupted.shards]


def test_run_dir_with_more_rounds_than_asked_is_refused(fl, two_rounds):
    p = fl.run(_rc(two_rounds, rounds=1), timeout_s=600)
    out = p.stdout + p.stderr
    assert "refusing to resume" in out and "Ways out" in out, out[-4000:]


def test_bad_config_fails_before_anything_starts(fl, tmp_path):
    run_dir = tmp_path / "bad"
    p = fl.run(_rc(run_dir, **{"clients-per-round": 9}), timeout_s=600)
    out = p.stdout + p.stderr
    assert "exceeds federation.clients" in out, out[-4000:]
    assert not run_dir.exists()                         # nothing was created
    assert not _service_pids(fl.home) or all(not psutil.pid_exists(p) for p in _service_pids(fl.home))
