"""PPO on the verl backend (CPU): the critic is verl's value-model engine
(`FSDPEngineWithValueHead`) driven by `VerlTrainer`, federated as the `critic` member.

  * a fresh critic is the same on both backends, bit for bit (same weight names, the policy's
    backbone, the same seeded value head), and inject then export returns it bit for bit;
  * from the same rows, returns and rollout-time values, verl's critic update (its value loss
    scaled to `algo.critic.loss_coef`, several mini-batches, micro-batching, value clipping
    that binds) gives the builtin critic update's weights within 1e-5;
  * a real PPO fit against a real env service trains both members, with fresh optimizers.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("verl")

from client_app.rollout import derive_seed, group_specs, run_episodes, training_rows  # noqa: E402
from client_app.trainer.base import FitRequest  # noqa: E402
from client_app.trainer.builtin import BuiltinTrainer, gae_targets  # noqa: E402
from fl_app.config import Config  # noqa: E402
from trainer_support import env_url, model_dir, one_torch_thread, small_config  # noqa: E402,F401

TOL = 1e-5
SECTIONS = {"algo": {"name": "ppo", "group_size": 1, "tasks_per_step": 4, "lr": 1e-3, "kl_coef": 0.0,
                     "critic": {"lr": 3e-3, "value_clip": 0.2, "loss_coef": 1.0, "mini_batch_size": 5,
                                "micro_batch_size": 2}}}


@pytest.fixture(scope="module")
def builtin(env_url, model_dir):  # noqa: F811
    trainer = BuiltinTrainer(small_config(model_dir, **SECTIONS), env_url)
    yield trainer
    trainer.close()


@pytest.fixture(scope="module")
def verl_trainer(env_url, model_dir):  # noqa: F811
    from client_app.trainer.verl_backend import VerlTrainer

    data = small_config(model_dir, **SECTIONS).model_dump()
    data["backend"] = "verl"
    trainer = VerlTrainer(Config.model_validate(data), env_url)
    yield trainer
    trainer.close()


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def test_fresh_critic_is_the_same_on_both_backends(verl_trainer, builtin):
    assert verl_trainer.members == builtin.members == ("actor", "critic")
    ours, theirs = verl_trainer.export_weights("critic"), builtin.export_weights("critic")
    assert ours.keys() == theirs.keys() and "score.weight" in ours
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    gen = torch.Generator().manual_seed(5)
    state = {k: v + 1e-7 + 0.01 * torch.randn(v.shape, generator=gen) for k, v in ours.items()}
    verl_trainer.load_weights(state, "critic")
    back = verl_trainer.export_weights("critic")
    assert all(back[k].dtype == torch.float32 and torch.equal(back[k], state[k]) for k in state)
    verl_trainer.load_weights(ours, "critic")


def test_critic_update_matches_builtin(verl_trainer, builtin):
    specs = group_specs([0, 1, 2, 3], 1)
    episodes, _ = run_episodes(builtin.generator, builtin.env, specs, builtin.settings, 1.0, 11, builtin.max_sessions)
    gen = torch.Generator().manual_seed(3)
    scores = torch.rand(len(episodes), generator=gen).tolist()
    rows = [dataclasses.replace(rw, score=scores[rw.episode]) for rw in training_rows(episodes, 0.1)]
    assert len(rows) > 5 and len(rows) % 5, "want several critic mini-batches and a ragged last one"
    start = builtin.export_weights("critic")
    verl_trainer.load_weights(start, "critic")
    values_builtin, values_verl = builtin.row_values(rows), verl_trainer.row_values(rows)
    assert max(float((x - y).abs().max()) for x, y in zip(values_builtin, values_verl)) < TOL
    a = builtin.cfg.algo
    _, returns = gae_targets(rows, values_builtin, a.gamma, a.lam)
    old = [v + 0.3 * torch.linspace(-1, 1, len(v)) for v in values_builtin]      # clipping binds on some tokens
    seed = derive_seed("critic-minibatch", 0, 1, 2, 0)

    opt = torch.optim.AdamW(builtin._members["critic"].values(), lr=a.critic.lr, weight_decay=a.critic.weight_decay)
    m_builtin = builtin.update_critic(rows, returns, old, opt, seed)
    w_builtin = builtin.export_weights("critic")
    verl_trainer.reset_optimizer()
    m_verl = verl_trainer.update_critic(rows, returns, old, seed)
    w_verl = verl_trainer.export_weights("critic")
    moved, diff = _max_diff(w_builtin, start), _max_diff(w_builtin, w_verl)
    print(f"\ncritic: rows={len(rows)} steps={m_verl['critic_optimizer_steps']:.0f} clipfrac="
          f"{m_verl['critic_clipfrac']:.2f} max|dw|={moved:.3e} max|w_builtin - w_verl|={diff:.3e}")
    assert m_verl["critic_optimizer_steps"] == m_builtin["critic_optimizer_steps"] >= 2
    assert m_builtin["critic_clipfrac"] > 0
    assert moved > 100 * TOL and diff < TOL
    for key in ("critic_loss", "critic_grad_norm"):
        assert m_verl[key] == pytest.approx(m_builtin[key], rel=1e-4), key
    builtin.load_weights(start, "critic")
    verl_trainer.load_weights(start, "critic")


def test_ppo_fit_trains_actor_and_critic(verl_trainer):
    before = {m: verl_trainer.export_weights(m) for m in verl_trainer.members}
    res = verl_trainer.fit(FitRequest(round=1, client_id=0, task_indices=list(range(16, 56)), local_epochs=1, seed=0,
                                      proximal_mu=0.01))
    assert res.metrics["critic_optimizer_steps"] >= 1 and res.metrics["optimizer_steps"] >= 1
    for member in ("actor", "critic"):
        assert _max_diff(verl_trainer.export_weights(member), before[member]) > TOL, member
    for engine in (verl_trainer.engine, verl_trainer.critic.engine):
        assert not engine.optimizer.state                 # fresh AdamW next fit (invariant 3)
    for member, state in before.items():
        verl_trainer.load_weights(state, member)


def test_fedprox_moves_the_policy_never_the_critic(verl_trainer):
    """Invariants 4 and 3 on verl: two fits of the same client from the same weights, FedProx
    off and mu = 20. One local epoch, so both play the same episodes and the critic pass (which
    runs before the policy update) sees the same rows: the critics come out bit-identical (no
    proximal term on the critic, and no optimizer state carried between the fits), while the
    policies differ (FedProx acts on the policy)."""
    start = {m: verl_trainer.export_weights(m) for m in verl_trainer.members}
    ends = []
    for mu in (0.0, 20.0):
        for member, state in start.items():
            verl_trainer.load_weights(state, member)
        verl_trainer.fit(FitRequest(round=2, client_id=5, task_indices=list(range(16, 56)), local_epochs=1, seed=0,
                                    proximal_mu=mu))
        ends.append({m: verl_trainer.export_weights(m) for m in verl_trainer.members})
    assert _max_diff(ends[0]["critic"], start["critic"]) > TOL             # the critic trained ...
    assert all(torch.equal(ends[0]["critic"][k], ends[1]["critic"][k]) for k in start["critic"])   # ... alike
    assert _max_diff(ends[0]["actor"], ends[1]["actor"]) > TOL             # FedProx changed the policy
    for member, state in start.items():
        verl_trainer.load_weights(state, member)


def test_lane_service_federates_the_verl_critic(model_dir, tmp_path):  # noqa: F811
    """Through the trainer service, as a round uses it: round 0 exports both members (and says
    where the critic came from), a fit loads and returns both."""
    from client_app.service import FitBody, InitBody, TrainerService
    from fl_app.weights import load_shards

    data = small_config(model_dir, run={"run_dir": str(tmp_path / "run")}, **SECTIONS).model_dump()
    data["backend"] = "verl"
    svc = TrainerService(Config.model_validate(data), run_id=1, lane="cpu")
    try:
        svc.start()
        run = tmp_path / "run"        # the service reads and writes weights only inside the run dir
        init = svc.init(InitBody(run_id=1, weights_out={m: str(run / "r0" / m) for m in ("actor", "critic")}))
        assert init["critic_start"]["mode"] == "fresh"
        out = {m: str(run / "r1" / m) for m in ("actor", "critic")}
        reply = svc.fit(FitBody(run_id=1, round=1, client_id=0, local_epochs=1, seed=0,
                                weights_in={m: str(run / "r0" / m) for m in ("actor", "critic")}, weights_out=out))
        assert reply["metrics"]["critic_optimizer_steps"] >= 1
        before, after = load_shards(run / "r0" / "critic"), load_shards(run / "r1" / "critic")
        assert "score.weight" in after and _max_diff(after, before) > TOL
        assert (tmp_path / "run" / "verl" / "verl_config.yaml").exists()     # into the run dir, nowhere else
    finally:
        svc.close()
