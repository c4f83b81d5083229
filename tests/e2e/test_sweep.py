"""tools.sweep: arms x seeds of real `flwr run`s at once, each with a Flower of its own; every arm
resolved before anything starts; a complete run is never run again; one report at the end."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from server_app.local_superlink import find_superlink, stop_superlink
from tools.sweep import SweepError, core_slots, main, parse_cores, plan

ROOT = Path(__file__).resolve().parents[2]
RECIPE = ROOT / "tests" / "fixtures" / "e2e-recipe.yaml"


def test_arms_are_resolved_before_anything_starts(tmp_path):
    with pytest.raises(SweepError, match="NAME=RUN_CONFIG"):
        plan(["no-equals-sign"], [0], "", tmp_path)
    with pytest.raises(SweepError, match="named 'a'"):
        plan([f'a=recipe="{RECIPE}"', f'a=recipe="{RECIPE}"'], [0], "", tmp_path)
    with pytest.raises(SweepError, match="arm 'b'.*'federation.agregator' is not a recipe key"):
        plan([f'b=recipe="{RECIPE}" federation.agregator="lr2"'], [0], "", tmp_path)
    assert main(["--arm", "x=rounds=0", "--out", str(tmp_path / "s")]) == 2  # nothing was started
    assert not (tmp_path / "s").exists()


def test_a_sweep_without_flower_s_commands_refuses_before_any_job(tmp_path, monkeypatch, capsys):
    """As in a `pip install --target` dir without console scripts: no `flwr` beside this Python or
    on PATH. Before: each job died at its start with a FileNotFoundError traceback."""
    monkeypatch.setattr(sys, "executable", str(tmp_path / "bin" / "python3"))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    out = tmp_path / "s"
    assert main(["--arm", f'a=recipe="{RECIPE}"', "--seeds", "0", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no `flwr` command beside this Python" in err and "on PATH" in err, err
    assert not out.exists()
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "flwr").touch()  # flwr without the flower-superlink it starts
    assert main(["--arm", f'a=recipe="{RECIPE}"', "--seeds", "0", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "no `flower-superlink` command beside this Python" in err, err
    assert "pip install 'flwr[simulation]==1.42.0'" in err, err
    assert not out.exists()


def test_each_job_is_its_arm_with_the_common_keys_its_seed_and_its_own_run_dir(tmp_path):
    jobs = plan(
        [f'fedavg=recipe="{RECIPE}"', f'lr2=recipe="{RECIPE}" algo.lr=2e-4'],
        [0, 2],
        "rounds=1",
        tmp_path,
    )
    assert [j.name for j in jobs] == ["fedavg-s0", "fedavg-s2", "lr2-s0", "lr2-s2"]
    run_dir = tmp_path.resolve() / "lr2-s2"
    assert jobs[3].run_config == f'recipe="{RECIPE}" algo.lr=2e-4 rounds=1 seed=2 run-dir="{run_dir}"'
    assert core_slots(jobs=3, threads=2, cores=range(8)) == [[0, 1], [2, 3], [4, 5]]
    assert core_slots(jobs=2, threads=1, cores=parse_cores("12-13")) == [[12], [13]]
    assert core_slots(jobs=3, threads=2, cores=range(4)) == []  # oversubscribed: no pinning
    with pytest.raises(SweepError, match="--cores"):
        parse_cores("0-x")


@pytest.mark.slow
def test_a_sweep_runs_two_arms_at_once_and_resumes_without_rerunning(tmp_path, capsys):
    out = tmp_path / "sweep"
    arms = ["--arm", f'fedavg=recipe="{RECIPE}"', "--arm", f'lr2=recipe="{RECIPE}" algo.lr=2e-4']
    args = [*arms, "--seeds", "0", "--run-config", "rounds=1", "--jobs", "2", "--threads", "1", "--out", str(out)]
    assert main(args) == 0, capsys.readouterr().out
    printed = capsys.readouterr().out
    assert "fedavg-s0: complete" in printed and "lr2-s0: complete" in printed
    assert (out / "report" / "bands.png").exists()
    homes = {json.loads((out / a / "summary.json").read_text())["status"] for a in ("fedavg-s0", "lr2-s0")}
    assert homes == {"complete"}
    assert sorted(p.name for p in (out / ".flwr").iterdir()) == ["fedavg-s0", "lr2-s0"]  # a Flower each
    assert main(args) == 0
    assert printed.count("already complete") == 0 and capsys.readouterr().out.count("already complete, skipped") == 2


def _flower_of(home: Path) -> list[psutil.Process]:
    """The processes whose FLWR_HOME is `home` (a job's flwr run, SuperLink and runtimes)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("FLWR_HOME") == str(home):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return [p for p in found if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def test_a_terminated_sweep_stops_every_flower_it_started(tmp_path):
    out = tmp_path / "sweep"
    home = out.resolve() / ".flwr" / "a-s0"
    args = ["--arm", f'a=recipe="{RECIPE}"', "--seeds", "0", "--run-config", "rounds=5", "--threads", "1"]
    sweep = subprocess.Popen(
        [sys.executable, "-m", "tools.sweep", *args, "--out", str(out)], cwd=ROOT, start_new_session=True
    )
    try:
        deadline = time.monotonic() + 120
        while find_superlink(home) is None:  # the job's own Flower is up
            assert sweep.poll() is None and time.monotonic() < deadline, "the job's SuperLink never started"
            time.sleep(0.5)
        assert _flower_of(home)
        sweep.send_signal(signal.SIGTERM)  # to the sweep alone: its jobs run in groups of their own
        assert sweep.wait(timeout=90) == 128 + signal.SIGTERM
        assert _flower_of(home) == []
    finally:
        if sweep.poll() is None:
            os.killpg(sweep.pid, signal.SIGKILL)
        stop_superlink(home)
        for p in _flower_of(home):
            p.kill()
