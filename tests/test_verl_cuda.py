"""The verl backend on CUDA (`pytest -m gpu`; verl 0.9.1 on a CUDA machine: docs/offline-gpu.md).

On CPU the two backends agree within 1e-5 in fp32 (tests/test_verl_backend.py, test_verl_ppo.py).
On a GPU both compute in bf16 over fp32 master weights, but differently (builtin: fp32 parameters
under bf16 autocast; verl: FSDP2 casts the parameters to bf16), so they cannot agree bit for bit.
What must hold is that they agree within bf16 noise: the log-probs of the same rows, and an
update from the same rows lands much closer to builtin's than builtin's own update lands to
itself when only the mini-batch shuffle changes. A dtype slip (bf16 masters, a lost fp32 cast)
or a wrong loss would break that. Then a PPO fit on CUDA: actor and critic (loaded with SDPA,
since the image has no flash-attn) both train and export fp32.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch

from client_app.rollout import derive_seed
from client_app.trainer.base import FitRequest
from client_app.trainer.builtin import BuiltinTrainer
from trainer_support import env_url, model_dir, small_config  # noqa: F401

pytestmark = pytest.mark.gpu
pytest.importorskip("verl")

from test_verl_backend import _builtin_update, _rows, _verl_cfg, _verl_update  # noqa: E402

CUDA = {"run": {"device": "cuda"}}
ARGS = {"rollout": {"temperature": 0.7}, "algo": {"lr": 1e-3, "kl_coef": 0.05, "entropy_coeff": 0.01,
                                                   "mini_batch_size": 5, "micro_batch_size": 2}}


@pytest.fixture(autouse=True)
def needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _verl(model_dir, env_url, tmp_path, **sections):  # noqa: F811
    from client_app.trainer.verl_backend import VerlTrainer

    return VerlTrainer(_verl_cfg(model_dir, **sections), env_url, run_dir=tmp_path)


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a)))


def test_cuda_update_agrees_with_builtin_within_bf16_noise(env_url, model_dir, tmp_path):  # noqa: F811
    builtin = BuiltinTrainer(small_config(model_dir, **CUDA, **ARGS), env_url)
    verl = _verl(model_dir, env_url, tmp_path, **CUDA, **ARGS)
    try:
        rows, advantages = _rows(builtin, "windowed")
        start = builtin.export_weights()
        verl.load_weights(start)
        lp_gap = torch.cat([(x - y).abs() for x, y in zip(verl.row_log_probs(rows),
                                                           builtin.row_log_probs(builtin.model, rows))])
        seed = derive_seed("minibatch", 0, 1, 3, 0)
        w_builtin, m_builtin = _builtin_update(builtin, start, rows, advantages, seed)
        w_reshuffled, _ = _builtin_update(builtin, start, rows, advantages, seed + 1)
        w_verl, m_verl = _verl_update(verl, start, rows, advantages, seed)
        moved = _distance(w_builtin, start)
        backends, shuffles = _distance(w_verl, w_builtin) / moved, _distance(w_reshuffled, w_builtin) / moved
        print(f"\nCUDA: rows={len(rows)} log-prob gap mean {float(lp_gap.mean()):.2e} max {float(lp_gap.max()):.2e}; "
              f"|dw|={moved:.3e}; |w_verl - w_builtin|/|dw| = {backends:.3f}, reshuffled builtin {shuffles:.3f}; "
              f"pg_loss {m_verl['pg_loss']:.5f} vs {m_builtin['pg_loss']:.5f}, "
              f"grad_norm {m_verl['grad_norm']:.4f} vs {m_builtin['grad_norm']:.4f}")
        assert all(v.dtype == torch.float32 for v in w_verl.values())
        assert float(lp_gap.mean()) < 0.02 and float(lp_gap.max()) < 0.25
        assert m_verl["optimizer_steps"] == m_builtin["optimizer_steps"] >= 2
        assert backends < 0.5 * shuffles, "the backends differ by more than a mini-batch reshuffle"
        for key in ("pg_loss", "grad_norm"):
            assert m_verl[key] == pytest.approx(m_builtin[key], rel=0.05, abs=1e-3), key
    finally:
        verl.close()
        builtin.close()


def test_cuda_ppo_fit_trains_actor_and_critic(env_url, model_dir, tmp_path):  # noqa: F811
    ppo = {"algo": {"name": "ppo", "group_size": 1, "tasks_per_step": 4, "lr": 1e-3, "kl_coef": 0.0,
                    "critic": {"lr": 3e-3, "mini_batch_size": 5, "micro_batch_size": 2}}}
    verl = _verl(model_dir, env_url, tmp_path, **CUDA, **ppo)
    try:
        assert verl.members == ("actor", "critic")
        assert next(verl.critic.engine.module.parameters()).device.type == "cuda"
        before = {m: verl.export_weights(m) for m in verl.members}
        res = verl.fit(FitRequest(round=1, client_id=0, task_indices=list(range(16, 56)), local_epochs=2, seed=0,
                                  proximal_mu=0.01))
        print(f"\nCUDA PPO fit: {({k: round(v, 4) for k, v in res.metrics.items()})}")
        assert res.metrics["critic_optimizer_steps"] >= 2 and res.metrics["optimizer_steps"] >= 2
        for member in verl.members:
            after = verl.export_weights(member)
            assert after.keys() == before[member].keys()
            assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in after.values())
            assert max(float((after[k] - before[member][k]).abs().max()) for k in after) > 1e-5, member
        for engine in (verl.engine, verl.critic.engine):
            assert not engine.optimizer.state             # fresh AdamW next fit (invariant 3)
    finally:
        verl.close()
