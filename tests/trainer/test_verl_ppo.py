"""PPO on the verl training engine through the trainer service, as a round uses it (the engine
contract, critic included, is tests/trainer/test_engine_contract.py)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("verl")

from trainer_support import model_dir, one_torch_thread, service_call, small_config  # noqa: E402,F401

from fl_app.config import Config  # noqa: E402

TOL = 1e-5
MEMBERS = ("actor", "critic")
SECTIONS = {
    "algo": {
        "name": "ppo",
        "group_size": 1,
        "tasks_per_step": 4,
        "lr": 1e-3,
        "kl_coef": 0.0,
        "critic": {"lr": 3e-3, "value_clip": 0.2, "loss_coef": 1.0, "mini_batch_size": 5, "micro_batch_size": 2},
    }
}


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_lane_service_federates_the_verl_critic(model_dir, tmp_path):  # noqa: F811
    """Through the trainer service, as a round uses it: round 0 exports both members (and says
    where the critic came from), a fit loads and returns both."""
    from client_app.service import Dirs, TrainerService
    from fl_app.calls import FitCall, InitCall
    from fl_app.weights import load_shards

    data = small_config(model_dir, run={"run_dir": str(tmp_path / "run")}, **SECTIONS).model_dump()
    data["backend"] = "verl"
    svc = TrainerService(Config.model_validate(data), run_id=1, lane="cpu")
    try:
        svc.start()
        run = tmp_path / "run"  # the service reads and writes weights only inside the run dir
        init = svc.init(service_call(svc, InitCall), Dirs(weights_out={m: str(run / "r0" / m) for m in MEMBERS}))
        assert init["critic_start"]["mode"] == "fresh"
        reply = svc.fit(
            service_call(svc, FitCall, members=MEMBERS, round=1, client_id=0, local_epochs=1, seed=0),
            Dirs(
                weights_in={m: str(run / "r0" / m) for m in MEMBERS},
                weights_out={m: str(run / "r1" / m) for m in MEMBERS},
            ),
        )
        assert reply["metrics"]["critic_optimizer_steps"] >= 1
        before, after = load_shards(run / "r0" / "critic"), load_shards(run / "r1" / "critic")
        assert "score.weight" in after and _max_diff(after, before) > TOL
        assert (tmp_path / "run" / "verl" / "verl_config.yaml").exists()  # into the run dir, nowhere else
    finally:
        svc.close()
