"""A server optimizer's state is part of the round (fl_app.server_opt, fl_app.rundir): recorded
in the COMPLETE marker and verified with the round, so a run killed mid-round and resumed steps
exactly as an uninterrupted one; a round without the run's state is refused, a corrupt one is
moved aside and redone."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from fl_app.aggregate import fedavg_manifests
from fl_app.config import FederationCfg, load_config
from fl_app.rundir import MARKER, RunDir, RunDirError
from fl_app.server_opt import ServerOptimizer
from fl_app.weights import Manifest, WeightsError, load_shards, save_shards
from server_app.app import run_dir

SHARD = 20_000
MEMBERS = ("actor", "critic")
OPTS = {
    "fedavgm": ServerOptimizer("fedavgm", lr=1.0, momentum=0.9),
    "fedadam": ServerOptimizer("fedadam", lr=0.01, beta1=0.9, beta2=0.99, tau=1e-3),
    "nesterov": ServerOptimizer("nesterov", lr=0.7, momentum=0.9),
}


def _open(path: Path, opt: ServerOptimizer | None) -> RunDir:
    """What the ServerApp opens: the run's members and its optimizer's state entries."""
    state = opt.state_entries(MEMBERS) if opt is not None else ()
    return RunDir(path, total_rounds=3, members=MEMBERS, opt_state=state)


def _play(rd: RunDir, opt: ServerOptimizer | None, r: int, finish: bool = True) -> None:
    """Round r as the ServerApp plays it: round 0 the initial model; later rounds two clients
    (a pure function of round and global model) -> their mean -> the optimizer's step (or, for
    sgd, the fold itself) -> COMPLETE. `finish=False` dies before the step: a partial round."""
    for m in MEMBERS:
        if r == 0:
            g = torch.Generator().manual_seed(len(m))
            save_shards({"w": torch.randn(9000, generator=g), "ids": torch.arange(4)}, rd.member_dir(0, m), SHARD)
            continue
        w = load_shards(rd.member_dir(r - 1, m))
        ups = []
        for c in (0, 1):
            g = torch.Generator().manual_seed(10 * r + c)
            client = {"w": w["w"] + 0.1 * torch.randn(w["w"].shape, generator=g), "ids": w["ids"]}
            ups.append((save_shards(client, rd.client_dir(r, c) / m, SHARD), 3 + c))
        fedavg_manifests(ups, rd.mean_dir(r, m) if opt else rd.member_dir(r, m), SHARD)
    if not finish:
        return
    if opt is not None and r > 0:
        opt.step_round(rd, r)
    rd.complete_round(r, {})


def _digests(rd: RunDir, r: int) -> dict[str, list[str]]:
    """The digest of every shard of round r: each member and each state entry."""
    dirs = {m: rd.member_dir(r, m) for m in MEMBERS}
    dirs.update({e: rd.opt_state_dir(r, e) for e in rd.opt_state or ()})
    return {k: [s.digest for s in Manifest.from_dir(p).shards] for k, p in dirs.items()}


@pytest.mark.parametrize("name", sorted(OPTS))
def test_a_run_killed_mid_round_resumes_from_the_rounds_moments_bit_for_bit(tmp_path, name):
    opt = OPTS[name]
    whole = _open(tmp_path / "whole", opt)
    for r in range(4):
        _play(whole, opt, r)
    killed = _open(tmp_path / "killed", opt)
    for r in range(2):
        _play(killed, opt, r)
    _play(killed, opt, 2, finish=False)  # killed after round 2's mean, before its step
    resumed = _open(killed.path, opt)  # a new ServerApp
    assert resumed.prepare_resume() == 1
    for r in (2, 3):
        _play(resumed, opt, r)
    for r in (1, 2, 3):
        assert _digests(resumed, r) == _digests(whole, r), r
    marker = json.loads((resumed.round_dir(3) / MARKER).read_text())
    assert sorted(marker["server_opt"]) == sorted(opt.state_entries(MEMBERS))
    assert not resumed.mean_dir(3, "actor").parent.exists()  # the mean is scratch
    # the moments matter: round 2 stepped from zeros instead of round 1's moments differs
    ups = [(Manifest.from_dir(whole.client_dir(2, c) / "actor"), 3 + c) for c in (0, 1)]
    mean = fedavg_manifests(ups, tmp_path / "mean-2", SHARD)
    zeros = [tmp_path / f"from-zeros-{m}" for m in opt.moments]
    forgot = opt.step(whole.member_dir(1, "actor"), mean.root, None, tmp_path / "from-zeros", zeros)
    assert [s.digest for s in forgot.shards] != _digests(whole, 2)["actor"]


def test_a_round_without_the_runs_state_is_refused_naming_the_way_out(tmp_path):
    adam = OPTS["fedadam"]
    rd = _open(tmp_path / "adam", adam)
    for r in range(3):
        _play(rd, adam, r)
    entry = adam.entries("critic")[1]
    shutil.rmtree(rd.opt_state_dir(2, entry))
    with pytest.raises(RunDirError, match=f"server optimizer state '{entry}'.*no manifest.json"):
        _open(rd.path, adam).prepare_resume()
    # a run written with sgd cannot be resumed as fedadam, nor a fedadam run as sgd or nesterov
    sgd = _open(tmp_path / "sgd", None)
    for r in range(2):
        _play(sgd, None, r)
    with pytest.raises(RunDirError, match=r"holds server optimizer state none \(server_optimizer sgd\).*started with"):
        _open(sgd.path, adam).prepare_resume()
    shutil.copytree(rd.path, tmp_path / "adam2")
    shutil.rmtree(tmp_path / "adam2" / "rounds" / "round-0002")
    for other in (None, OPTS["nesterov"]):
        with pytest.raises(RunDirError, match=r"holds server optimizer state \['fedadam/actor/m'"):
            _open(tmp_path / "adam2", other).prepare_resume()
    assert _open(tmp_path / "adam2", adam).prepare_resume() == 1
    # a reader that does not know the recipe (server_app.status) still checks what the marker records
    assert RunDir(tmp_path / "adam2", members=MEMBERS).complete_rounds() == [0, 1]


def test_corrupt_state_fails_verification_so_resume_moves_the_round_aside_and_redoes_it(tmp_path):
    opt = OPTS["nesterov"]
    rd = _open(tmp_path / "run", opt)
    for r in range(3):
        _play(rd, opt, r)
    state = rd.opt_state_dir(2, opt.entries("actor")[0])
    shard = state / Manifest.from_dir(state).shards[0].file
    data = bytearray(shard.read_bytes())
    data[-5] ^= 1
    shard.write_bytes(bytes(data))
    with pytest.raises(WeightsError, match="is corrupt"):
        RunDir(rd.path, members=MEMBERS).verify_round(2)  # what server_app.status checks of a final round
    again = _open(rd.path, opt)
    assert again.prepare_resume() == 1
    assert [p.name.split(".")[1].split("-")[0] for p in again.rounds_dir.glob("round-0002.*")] == ["corrupt"]


def test_the_server_app_opens_its_run_dir_with_the_optimizers_state_entries(tmp_path):
    """`server_app.app.run_dir`: PPO federates actor and critic, so fedadam keeps m and v of both."""
    cfg = load_config(
        "tiny-shop-ppo",
        overrides={"federation.server_optimizer": "fedadam", "server-lr": 0.01, "run-dir": str(tmp_path / "r")},
    )
    assert run_dir(cfg).opt_state == ("fedadam/actor/m", "fedadam/actor/v", "fedadam/critic/m", "fedadam/critic/v")
    assert run_dir(load_config("tiny-shop-ppo", overrides={"run-dir": str(tmp_path / "s")})).opt_state == ()
    assert FederationCfg().server_optimizer == "sgd"
