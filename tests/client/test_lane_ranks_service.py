"""A trainer service whose lane spans 2 ranks (`run.lane_devices: 2`, CPU, invariant 43): it starts
rank 1 with its trainer, serves a fit over both ranks through its ordinary request path (the
fit's upload written by rank 0), and its close stops rank 1 by PID."""

from __future__ import annotations

import psutil
import torch
from trainer_support import model_dir, one_torch_thread, service_call, service_fit, small_config  # noqa: F401

from client_app.service import Dirs, TrainerService
from client_app.trainer.ranks import Lead
from fl_app.calls import InitCall
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
