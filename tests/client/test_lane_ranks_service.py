"""A trainer service whose lane spans 2 ranks (`run.lane_devices: 2`, CPU, invariant 43): it starts
rank 1 with its trainer, serves a fit over both ranks through its ordinary request path (the
fit's upload written by rank 0), and its close stops rank 1 by PID. A service whose lane lost a
rank answers the call, then exits, and its lane starts a fresh one at the next call."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest
import torch
from trainer_support import model_dir, one_torch_thread, service_call, service_fit, small_config  # noqa: F401

from client_app.lane import LaneService, ServiceRequestError
from client_app.service import Dirs, TrainerService
from client_app.trainer.ranks import Lead
from fl_app.calls import FitCall, InitCall
from fl_app.config import load_config, save_config
from fl_app.weights import load_shards


def test_a_service_over_two_ranks_fits_through_both_and_its_close_stops_them(model_dir, tmp_path):  # noqa: F811
    cfg = small_config(
        model_dir,
        federation={"clients": 2, "clients_per_round": 1, "tasks_per_client": 20},
        algo={"tasks_per_step": 3},
        run={"lane_devices": 2, "weight_cache_dir": str(tmp_path / "cache")},
    )
    svc = TrainerService(cfg, 1, "cpu", tmp_path)
    ranks: list[int] = []
    try:
        svc.start()
        assert svc.trainer is not None and isinstance(svc.trainer.ranks, Lead)
        ranks = svc.trainer.ranks.pids
        assert len(ranks) == 1 and psutil.Process(ranks[0]).ppid() == psutil.Process().pid
        svc.init(service_call(svc, InitCall), Dirs(weights_out={"actor": str(tmp_path / "init")}))
        metrics = service_fit(svc, 1, tmp_path / "init", tmp_path / "out")
        assert metrics["rows"] > 0 and metrics["rank_wait_s"] >= 0
        start, fitted = load_shards(tmp_path / "init"), load_shards(tmp_path / "out")
        assert any(not torch.equal(start[n], fitted[n]) for n in start), "the fit's upload is the initial model"
    finally:
        svc.close()
    assert not [p for p in ranks if psutil.pid_exists(p)], "the service's close left a rank running"


def exit_code(pid: int, timeout_s: float = 10.0) -> int:
    """The exit code of our child `pid` that has exited (its last threads may still be going)."""
    deadline = time.monotonic() + timeout_s
    while (reaped := os.waitpid(pid, os.WNOHANG))[0] == 0:
        assert time.monotonic() < deadline, f"process {pid} did not finish exiting within {timeout_s:.0f} s"
        time.sleep(0.05)
    return os.waitstatus_to_exitcode(reaped[1])


@pytest.mark.skipif(importlib.util.find_spec("verl") is None, reason="needs verl (the verl extra)")
def test_a_verl_service_that_lost_a_rank_answers_the_call_exits_and_its_lane_starts_a_fresh_one(
    tmp_path,
    model_dir,  # noqa: F811
    monkeypatch,
):
    """A real service process (verl over 2 gloo ranks, its lane's `LaneService`): rank 1 SIGKILLed
    mid-fit fails the call naming it; the service then exits with code 1, its log naming the
    rank, leaving no child behind; the next call starts a fresh service, which fits. Before: the
    service lived on and refused every later call ("the service must restart")."""
    short = Path(tempfile.mkdtemp(prefix="fa-", dir="/tmp"))  # Unix socket paths are short
    monkeypatch.setenv("FEDAGENT_RUNTIME_DIR", str(short / "rt"))
    run_dir, recipe = tmp_path / "run", tmp_path / "recipe.yaml"
    cfg = small_config(
        model_dir,
        federation={"clients": 2, "clients_per_round": 1, "tasks_per_client": 20},
        algo={"tasks_per_step": 3},
        run={"lane_devices": 2, "run_dir": str(run_dir), "weight_cache_dir": str(tmp_path / "cache")},
    )
    save_config(cfg.model_copy(update={"backend": "verl"}), recipe)
    run_config = {"recipe": str(recipe), "run-dir": str(run_dir)}
    node = SimpleNamespace(run_id=7, cfg=load_config(str(recipe), overrides=run_config))  # what service_call reads
    lane = LaneService(7, run_config, log_dir=run_dir / "logs", lane="cpu", run_dir=run_dir)

    def fit(epochs: int, out: str) -> dict:
        call = service_call(node, FitCall, round=1, client_id=0, local_epochs=epochs, seed=0)
        dirs = {"weights_in": {"actor": str(run_dir / "w0")}, "weights_out": {"actor": str(run_dir / out)}}
        return lane.request("/fit", {"call": call.model_dump(mode="json"), "dirs": dirs})

    try:
        service = psutil.Process(lane.ensure_started()["pid"])
        call = service_call(node, InitCall)
        lane.request(
            "/init", {"call": call.model_dump(mode="json"), "dirs": {"weights_out": {"actor": str(run_dir / "w0")}}}
        )
        children = service.children(recursive=True)
        (victim,) = [p for p in service.children() if "client_app.trainer.ranks" in p.cmdline()]
        fitter = ThreadPoolExecutor(1).submit(fit, 50, "w1")  # minutes of work, never finished
        time.sleep(5.0)
        assert not fitter.done(), f"the fit ended within 5 s: {fitter.exception()}"
        victim.send_signal(signal.SIGKILL)
        with pytest.raises(ServiceRequestError) as failed:
            fitter.result(timeout=120)
        assert failed.value.error_type == "RankFailure"
        assert f"lane rank 1 of 2 (pid {victim.pid}) was killed by SIGKILL" in failed.value.message
        assert service.status() == psutil.STATUS_ZOMBIE, "the service outlived its failed call"
        assert exit_code(service.pid) == 1
        log = lane.log_path.read_text()
        assert f"exiting with code 1: the lane lost its ranks (lane rank 1 of 2 (pid {victim.pid})" in log, log[-3000:]
        assert not psutil.wait_procs(children, timeout=10)[1], "the service left a child running"
        again = fit(1, "w2")["metrics"]
        assert again["rows"] > 0 and lane.pid() != service.pid
        fresh = psutil.Process(lane.pid())
        (rank,) = [p for p in fresh.children() if "client_app.trainer.ranks" in p.cmdline()]
        assert rank.pid != victim.pid
        start, fitted = load_shards(run_dir / "w0"), load_shards(run_dir / "w2")
        assert any(not torch.equal(start[n], fitted[n]) for n in start), "the fresh service's fit moved nothing"
    finally:
        lane.shutdown()
        shutil.rmtree(short, ignore_errors=True)
