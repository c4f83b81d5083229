"""PPO's critic beyond the engine contract (tests/trainer/test_engine_contract.py): the critic's fp32
round trip through aggregation, where the starting critic comes from (invariant 7), and a PPO
fit without its critic failing closed. Real env service, real (random-weight) Qwen2 policy and
critic, real fits on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from trainer_support import (  # noqa: F401
    SMALL_ENV_PARAMS,
    env_url,
    model_dir,
    one_torch_thread,
    service_call,
    small_config,
)

from client_app.critic import VALUE_HEAD, build_critic
from client_app.rollout import derive_seed, group_specs, training_rows
from client_app.trainer import make_trainer
from client_app.trainer.base import ClientTasks
from client_app.trainer.loop import RLTrainer
from fl_app.aggregate import fedavg_manifests, fedavg_refs
from fl_app.calls import FitCall
from fl_app.channel import Channel, WeightsRef
from fl_app.channel.run_dir import DirStore
from fl_app.rundir import RunDir, RunDirError
from fl_app.weights import load_shards, save_shards, state_nbytes

TRAIN_TASKS = list(range(SMALL_ENV_PARAMS["val_size"], SMALL_ENV_PARAMS["num_goals"]))
SHARD_BYTES = 1 << 20


def ppo_config(model_dir: Path, **sections):
    algo = {"name": "ppo", "tasks_per_step": 3, "group_size": None, **sections.pop("algo", {})}
    return small_config(model_dir, algo=algo, **sections)


@pytest.fixture(scope="module")
def trainer(env_url, model_dir):
    t = make_trainer(ppo_config(model_dir), env_url)
    try:
        yield t
    finally:
        t.close()


@pytest.fixture(scope="module")
def initial(trainer) -> dict[str, dict[str, torch.Tensor]]:
    return {m: trainer.export_weights(m) for m in trainer.members}


def _load(t: RLTrainer, state: dict[str, dict[str, torch.Tensor]]) -> None:
    for member, weights in state.items():
        t.load_weights(weights, member)


def _rows(t: RLTrainer, tasks: list[int], seed: int):
    episodes, _, _ = t._play(group_specs(tasks, 1), 1.0, seed, "test")
    return training_rows(episodes, 0.1)


def _changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- federation of the critic


def test_critic_round_trip_export_aggregate_load_gives_identical_values(trainer, initial, env_url, model_dir, tmp_path):
    """A trained critic exported, FedAvg'd (inline and through the store), and loaded into another
    trainer predicts exactly the same values (invariant 1 for the critic)."""
    _load(trainer, initial)
    trainer.fit(FitCall(round=1, client_id=1, local_epochs=1, seed=2), ClientTasks(TRAIN_TASKS))
    critic = trainer.export_weights("critic")
    rows = _rows(trainer, [60, 61], seed=9)
    values = trainer.engine.score(rows, "critic")
    ref = WeightsRef(inline=True, nbytes=state_nbytes(critic))
    arrays = critic
    channel = Channel(
        DirStore(tmp_path, SHARD_BYTES),
        cache_dir=tmp_path / "cache",
        inline_max_bytes=ref.nbytes,
        shard_bytes=SHARD_BYTES,
    )
    inline = fedavg_refs([(ref, arrays, 3.0), (ref, arrays, 5.0)], channel, tmp_path / "inline")
    clients = [save_shards(critic, tmp_path / f"client-{k}", SHARD_BYTES) for k in range(2)]
    stored = fedavg_manifests([(clients[0], 3.0), (clients[1], 5.0)], tmp_path / "stored", SHARD_BYTES)
    assert [s.digest for s in inline.shards] == [s.digest for s in stored.shards]
    other = make_trainer(ppo_config(model_dir, run={"seed": 1}), env_url)  # another fresh value head
    try:
        assert not all(torch.equal(a, b) for a, b in zip(other.engine.score(rows, "critic"), values))
        other.load_weights(load_shards(tmp_path / "stored"), "critic")
        assert all(torch.equal(a, b) for a, b in zip(other.engine.score(rows, "critic"), values))
    finally:
        other.close()
        _load(trainer, initial)


# ---------------------------------------------------------------- the starting critic


def _write_run(run: Path, weights: dict[str, dict[str, torch.Tensor]], rounds: int) -> RunDir:
    """A run dir whose rounds 0..rounds-1 are complete and hold `weights` (every member given)."""
    rd = RunDir(run, total_rounds=rounds, members=tuple(weights))
    for r in range(rounds):
        for member, state in weights.items():
            save_shards(state, rd.member_dir(r, member), SHARD_BYTES)
        rd.complete_round(r, {})
    return rd


@pytest.fixture(scope="module")
def trained(trainer, initial) -> dict[str, dict[str, torch.Tensor]]:
    _load(trainer, initial)
    trainer.fit(FitCall(round=1, client_id=7, local_epochs=1, seed=3), ClientTasks(TRAIN_TASKS))
    out = {m: trainer.export_weights(m) for m in trainer.members}
    _load(trainer, initial)
    return out


def test_warm_start_from_an_aggregated_actor_loads_its_sibling_critic(env_url, model_dir, trained, initial, tmp_path):
    rd = _write_run(tmp_path / "earlier", trained, rounds=2)
    t = make_trainer(ppo_config(model_dir, model={"init_from": str(rd.member_dir(1))}), env_url)
    try:
        assert t.critic_start.mode == "auto-sibling"
        assert t.critic_start.path == str(rd.member_dir(1, "critic").resolve())
        for member in ("actor", "critic"):
            assert not _changed(t.export_weights(member), trained[member]), member
        # the KL reference stays the original backbone, not the warm policy
        assert all(torch.equal(p, initial["actor"][k]) for k, p in t.engine.ref.named_parameters())
    finally:
        t.close()


def test_explicit_critic_path_must_hold_a_value_head(env_url, model_dir, trained, tmp_path):
    rd = _write_run(tmp_path / "earlier", trained, rounds=1)
    with pytest.raises(ValueError, match="holds no value head"):
        make_trainer(ppo_config(model_dir, algo={"critic": {"path": str(rd.member_dir(0, "actor"))}}), env_url)
    t = make_trainer(ppo_config(model_dir, algo={"critic": {"path": str(rd.member_dir(0, "critic"))}}), env_url)
    try:
        assert t.critic_start.mode == "explicit"
        assert not _changed(t.export_weights("critic"), trained["critic"])
    finally:
        t.close()


def test_warm_start_without_a_critic_needs_a_deliberate_fresh_value_head(env_url, model_dir, trained, tmp_path):
    """A warm start from a round with no critic (a GRPO run) is refused unless the fresh head is
    asked for; the fresh head then sits on the WARM backbone and is seeded."""
    rd = _write_run(tmp_path / "grpo-run", {"actor": trained["actor"]}, rounds=1)
    warm = str(rd.member_dir(0))
    with pytest.raises(ValueError, match="random value baseline.*`fresh`"):
        make_trainer(ppo_config(model_dir, model={"init_from": warm}), env_url)
    cfg = ppo_config(model_dir, model={"init_from": warm}, algo={"critic": {"path": "fresh"}})
    t = make_trainer(cfg, env_url)
    try:
        assert t.critic_start.mode == "fresh" and t.critic_start.path == ""
        critic = t.export_weights("critic")
        backbone = {k.removeprefix("model."): v for k, v in trained["actor"].items() if k.startswith("model.")}
        assert {k.removeprefix("model."): v for k, v in critic.items() if k not in VALUE_HEAD}.keys() == backbone.keys()
        assert all(torch.equal(critic[f"model.{k}"], v) for k, v in backbone.items())
        expected_head = build_critic(t.engine.model, derive_seed("value-head", cfg.run.seed)).score.weight
        assert torch.equal(critic["score.weight"], expected_head.detach()) and critic["score.weight"].abs().sum() > 0
    finally:
        t.close()


def test_init_from_an_incomplete_round_is_refused(env_url, model_dir, trained, tmp_path):
    rd = _write_run(tmp_path / "dead", trained, rounds=1)
    for member, state in trained.items():  # round 1 was written but never completed
        save_shards(state, rd.member_dir(1, member), SHARD_BYTES)
    with pytest.raises(RunDirError, match="never completed"):
        make_trainer(ppo_config(model_dir, model={"init_from": str(rd.member_dir(1))}), env_url)


def test_a_ppo_fit_without_its_critic_fails_closed(model_dir, tmp_path):
    """The trainer service refuses a PPO fit that does not carry the critic instead of training
    half a model (invariant 28: fail closed)."""
    from client_app.service import Dirs, Refused, TrainerService

    svc = TrainerService(ppo_config(model_dir), run_id=1, lane="cpu", run_dir=tmp_path)
    try:
        svc.start()
        actor = save_shards(svc.trainer.export_weights("actor"), tmp_path / "actor", SHARD_BYTES).root
        call = service_call(svc, FitCall, round=1, client_id=0, local_epochs=1, seed=0)
        dirs = Dirs(weights_in={"actor": str(actor)}, weights_out={"actor": str(tmp_path / "out")})
        with pytest.raises(
            Refused, match=r"carries weights for \['actor'\].*the trainer federates \['actor', 'critic'\]"
        ):
            svc.fit(call, dirs)
        assert svc.fits == 0 and not (tmp_path / "out").exists()
    finally:
        svc.close()
