"""PPO in the builtin trainer: a critic trained beside the policy in both rollout modes, a
micro-batch-invariant critic loss, FedProx on the policy only (invariant 4), the critic's fp32
round trip through aggregation, and where the starting critic comes from (invariant 7).
Real env service, real (random-weight) Qwen2 policy and critic, real fits on CPU."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from client_app.algos import masked_mean
from client_app.critic import VALUE_HEAD, build_critic
from client_app.rollout import derive_seed, group_specs, run_episodes, training_rows
from client_app.trainer.base import FitRequest
from client_app.trainer.builtin import BuiltinTrainer, _pad_rows, gae_targets
from fl_app.aggregate import fedavg_manifests
from fl_app.rundir import RunDir, RunDirError
from fl_app.transport import WeightsRef, fedavg_received, state_to_arrayrecord
from fl_app.weights import load_shards, save_shards, state_nbytes
from trainer_support import (SMALL_ENV_PARAMS, env_url, model_dir, one_torch_thread,  # noqa: F401
                             small_config)

TRAIN_TASKS = list(range(SMALL_ENV_PARAMS["val_size"], SMALL_ENV_PARAMS["num_goals"]))
SHARD_BYTES = 1 << 20


def ppo_config(model_dir: Path, **sections):
    algo = {"name": "ppo", "tasks_per_step": 3, "group_size": None, **sections.pop("algo", {})}
    return small_config(model_dir, algo=algo, **sections)


@pytest.fixture(scope="module")
def trainer(env_url, model_dir):
    t = BuiltinTrainer(ppo_config(model_dir), env_url)
    try:
        yield t
    finally:
        t.close()


@pytest.fixture(scope="module")
def initial(trainer) -> dict[str, dict[str, torch.Tensor]]:
    return {m: trainer.export_weights(m) for m in trainer.members}


def _load(t: BuiltinTrainer, state: dict[str, dict[str, torch.Tensor]]) -> None:
    for member, weights in state.items():
        t.load_weights(weights, member)


def _rows(t: BuiltinTrainer, tasks: list[int], seed: int):
    episodes, _ = run_episodes(t.generator, t.env, group_specs(tasks, 1), t.settings, 1.0, seed=seed,
                               max_sessions=t.max_sessions)
    return training_rows(episodes, 0.1)


def _changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


# ---------------------------------------------------------------- training

@pytest.mark.parametrize("mode", ["windowed", "concat"])
def test_ppo_fit_trains_policy_and_critic(env_url, model_dir, mode):
    t = BuiltinTrainer(ppo_config(model_dir, rollout={"mode": mode, "max_prompt_tokens": 1024},
                                  env={"max_turns": 3}), env_url)
    try:
        assert t.members == ("actor", "critic") and t.cfg.algo.group_size == 1    # unset: ungrouped PPO
        before = {m: t.export_weights(m) for m in t.members}
        res = t.fit(FitRequest(round=1, client_id=2, task_indices=TRAIN_TASKS, local_epochs=2, seed=0))
        assert res.num_examples == 2 * 3 * 1
        m = res.metrics
        assert m["critic_optimizer_steps"] >= 2 and m["optimizer_steps"] >= 2
        assert m["critic_skipped_steps"] == 0 and m["skipped_steps"] == 0
        assert all(torch.isfinite(torch.tensor(m[k])) for k in ("critic_loss", "pg_loss", "critic_value_mean"))
        if mode == "concat":
            assert m["rows"] == 2 * 3                                           # one row per episode
        for member in t.members:
            assert _changed(before[member], t.export_weights(member)), f"the fit must train the {member}"
        assert all(p.grad is None for params in t._members.values() for p in params.values())
    finally:
        t.close()


def test_critic_loss_is_a_micro_batch_invariant_token_mean(trainer, initial):
    """The critic loss is loss_coef x the token mean over the whole mini-batch: its value and its
    gradient are the same whatever the micro-batch size (field log 2026-07-22)."""
    _load(trainer, initial)
    rows = _rows(trainer, [30, 31, 32], seed=4)
    values = trainer.row_values(rows)
    _, returns = gae_targets(rows, values, trainer.cfg.algo.gamma, trainer.cfg.algo.lam)
    old = [v + 1.2 * torch.linspace(-1, 1, len(v)) for v in values]             # clip binds on some tokens
    c = trainer.cfg.algo.critic
    mask = _pad_rows([torch.tensor(r.mask, dtype=torch.float32) for r in rows])
    v, ret, o = (_pad_rows(x, mask.shape[1]) for x in (values, returns, old))
    clipped = torch.clamp(v, o - c.value_clip, o + c.value_clip)
    expected = c.loss_coef * float(masked_mean(torch.maximum((v - ret) ** 2, (clipped - ret) ** 2), mask))
    grads, losses = [], []
    saved = c.micro_batch_size
    try:
        for micro in (1, 2, len(rows)):
            c.micro_batch_size = micro
            stats = trainer.accumulate_critic_gradients(rows, returns, old, list(range(len(rows))))
            losses.append(stats["loss"])
            grads.append({k: p.grad.clone() for k, p in trainer.critic.named_parameters()})
            trainer.critic.zero_grad(set_to_none=True)
    finally:
        c.micro_batch_size = saved
    assert 0 < stats["clipfrac"] < 1, "the test must exercise the value clip"
    for loss in losses:
        assert loss == pytest.approx(expected, rel=1e-5)
    for g in grads[1:]:
        for k in g:
            torch.testing.assert_close(g[k], grads[0][k], rtol=1e-4, atol=1e-7)


def test_fedprox_never_touches_the_critic(trainer, initial):
    """One local epoch from the same weights with mu = 0 and mu = 5: the policies differ (the
    proximal term acts), the critics are bit-identical (it never reaches them)."""
    out = {}
    for mu in (0.0, 5.0):
        _load(trainer, initial)
        trainer.fit(FitRequest(round=2, client_id=5, task_indices=TRAIN_TASKS, local_epochs=1, seed=1, proximal_mu=mu))
        out[mu] = {m: trainer.export_weights(m) for m in trainer.members}
    _load(trainer, initial)
    assert _changed(out[0.0]["actor"], out[5.0]["actor"])
    assert _changed(out[0.0]["critic"], initial["critic"])
    assert not _changed(out[0.0]["critic"], out[5.0]["critic"])


# ---------------------------------------------------------------- federation of the critic

def test_critic_round_trip_export_aggregate_load_gives_identical_values(trainer, initial, env_url, model_dir,
                                                                        tmp_path):
    """A trained critic exported, FedAvg'd (inline and through the store), and loaded into another
    trainer predicts exactly the same values (invariant 1 for the critic)."""
    _load(trainer, initial)
    trainer.fit(FitRequest(round=1, client_id=1, task_indices=TRAIN_TASKS, local_epochs=1, seed=2))
    critic = trainer.export_weights("critic")
    rows = _rows(trainer, [60, 61], seed=9)
    values = trainer.row_values(rows)
    ref = WeightsRef(inline=True, nbytes=state_nbytes(critic))
    arrays = state_to_arrayrecord(critic)
    inline = fedavg_received([(ref, arrays, 3.0), (ref, arrays, 5.0)], None, tmp_path / "inline", SHARD_BYTES)
    clients = [save_shards(critic, tmp_path / f"client-{k}", SHARD_BYTES) for k in range(2)]
    stored = fedavg_manifests([(clients[0], 3.0), (clients[1], 5.0)], tmp_path / "stored", SHARD_BYTES)
    assert [s.digest for s in inline.shards] == [s.digest for s in stored.shards]
    other = BuiltinTrainer(ppo_config(model_dir, run={"seed": 1}), env_url)     # another fresh value head
    try:
        assert not all(torch.equal(a, b) for a, b in zip(other.row_values(rows), values))
        other.load_weights(load_shards(tmp_path / "stored"), "critic")
        assert all(torch.equal(a, b) for a, b in zip(other.row_values(rows), values))
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
    trainer.fit(FitRequest(round=1, client_id=7, task_indices=TRAIN_TASKS, local_epochs=1, seed=3))
    out = {m: trainer.export_weights(m) for m in trainer.members}
    _load(trainer, initial)
    return out


def test_warm_start_from_an_aggregated_actor_loads_its_sibling_critic(env_url, model_dir, trained, initial,
                                                                      tmp_path):
    rd = _write_run(tmp_path / "earlier", trained, rounds=2)
    t = BuiltinTrainer(ppo_config(model_dir, model={"init_from": str(rd.member_dir(1))}), env_url)
    try:
        assert t.critic_start.mode == "auto-sibling"
        assert t.critic_start.path == str(rd.member_dir(1, "critic").resolve())
        for member in ("actor", "critic"):
            assert not _changed(t.export_weights(member), trained[member]), member
        # the KL reference stays the original backbone, not the warm policy
        assert all(torch.equal(p, initial["actor"][k]) for k, p in t.ref.named_parameters())
    finally:
        t.close()


def test_explicit_critic_path_must_hold_a_value_head(env_url, model_dir, trained, tmp_path):
    rd = _write_run(tmp_path / "earlier", trained, rounds=1)
    with pytest.raises(ValueError, match="holds no value head"):
        BuiltinTrainer(ppo_config(model_dir, algo={"critic": {"path": str(rd.member_dir(0, "actor"))}}), env_url)
    t = BuiltinTrainer(ppo_config(model_dir, algo={"critic": {"path": str(rd.member_dir(0, "critic"))}}), env_url)
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
        BuiltinTrainer(ppo_config(model_dir, model={"init_from": warm}), env_url)
    cfg = ppo_config(model_dir, model={"init_from": warm}, algo={"critic": {"path": "fresh"}})
    t = BuiltinTrainer(cfg, env_url)
    try:
        assert t.critic_start.mode == "fresh" and t.critic_start.path == ""
        critic = t.export_weights("critic")
        backbone = {k.removeprefix("model."): v for k, v in trained["actor"].items() if k.startswith("model.")}
        assert {k.removeprefix("model."): v for k, v in critic.items() if k not in VALUE_HEAD}.keys() == backbone.keys()
        assert all(torch.equal(critic[f"model.{k}"], v) for k, v in backbone.items())
        expected_head = build_critic(t.model, derive_seed("value-head", cfg.run.seed)).score.weight
        assert torch.equal(critic["score.weight"], expected_head.detach()) and critic["score.weight"].abs().sum() > 0
    finally:
        t.close()


def test_init_from_an_incomplete_round_is_refused(env_url, model_dir, trained, tmp_path):
    rd = _write_run(tmp_path / "dead", trained, rounds=1)
    for member, state in trained.items():                 # round 1 was written but never completed
        save_shards(state, rd.member_dir(1, member), SHARD_BYTES)
    with pytest.raises(RunDirError, match="never completed"):
        BuiltinTrainer(ppo_config(model_dir, model={"init_from": str(rd.member_dir(1))}), env_url)


def test_fresh_optimizers_per_ppo_fit(trainer, initial):
    """Two PPO fits from the same weights end bit-identical in both members: no optimizer state
    (of the policy or of the critic) survives a fit (invariant 3)."""
    req = FitRequest(round=3, client_id=4, task_indices=TRAIN_TASKS, local_epochs=2, seed=5)
    ends = []
    for _ in range(2):
        _load(trainer, initial)
        trainer.fit(req)
        ends.append({m: trainer.export_weights(m) for m in trainer.members})
    _load(trainer, initial)
    assert _changed(ends[0]["critic"], initial["critic"])
    for member in ("actor", "critic"):
        assert not _changed(ends[0][member], ends[1][member]), member


def test_a_ppo_fit_without_its_critic_fails_closed(model_dir, tmp_path):
    """The trainer service refuses a PPO fit that does not carry the critic instead of training
    half a model (invariant 28: fail closed)."""
    from fastapi import HTTPException

    from client_app.service import FitBody, TrainerService

    svc = TrainerService(ppo_config(model_dir), run_id=1, lane="cpu")
    try:
        svc.start()
        actor = save_shards(svc.trainer.export_weights("actor"), tmp_path / "actor", SHARD_BYTES).root
        body = FitBody(run_id=1, round=1, client_id=0, local_epochs=1, seed=0,
                       weights_in={"actor": str(actor)}, weights_out={"actor": str(tmp_path / "out")})
        with pytest.raises(HTTPException, match=r"carries weights for \['actor'\] but this trainer federates"):
            svc.fit(body)
        assert svc.fits == 0 and not (tmp_path / "out").exists()
    finally:
        svc.close()
