"""verl against builtin on CUDA (gpu-marked): in bf16 compute the two engines cannot agree to
fp32 precision, so the criterion is relative: the distance between their updates of the same
rows must be under half of what merely reshuffling builtin's own mini-batches moves it, and
their log-probs must agree within bf16 noise. (The contract on CUDA: test_engine_contract.py.)"""

from __future__ import annotations

import pytest
import torch
from test_engine_contract import PPO, _policy_pass_pair, build, scored_rows
from trainer_support import env_url, model_dir  # noqa: F401

from client_app.rollout import derive_seed

pytestmark = pytest.mark.gpu
pytest.importorskip("verl")


@pytest.fixture(autouse=True)
def needs_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")


def _distance(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return float(torch.sqrt(sum(((a[k] - b[k]) ** 2).sum() for k in a)))


def test_cuda_update_agrees_with_builtin_within_bf16_noise(env_url, model_dir, tmp_path):  # noqa: F811
    pair = tuple(build(kind, model_dir, env_url, tmp_path / kind, algo=PPO) for kind in ("builtin-cuda", "verl-cuda"))
    builtin, verl = pair
    try:
        _, rows, advantages = scored_rows(builtin, [0, 1], 2, seed=123)
        start = builtin.export_weights()
        verl.load_weights(start)
        lp_gap = torch.cat(
            [(x - y).abs() for x, y in zip(verl.engine.score(rows, "policy"), builtin.engine.score(rows, "policy"))]
        )
        seed = derive_seed("minibatch", 0, 1, 3, 0)
        (w_builtin, m_builtin), (w_verl, m_verl) = _policy_pass_pair(pair, rows, advantages, seed)
        (w_reshuffled, _), _ = _policy_pass_pair(pair, rows, advantages, seed + 1)
        moved = _distance(w_builtin, start)
        engines, shuffles = _distance(w_verl, w_builtin) / moved, _distance(w_reshuffled, w_builtin) / moved
        print(
            f"\nCUDA: rows={len(rows)} log-prob gap mean {float(lp_gap.mean()):.2e} max {float(lp_gap.max()):.2e}; "
            f"|dw|={moved:.3e}; |w_verl - w_builtin|/|dw| = {engines:.3f}, reshuffled builtin {shuffles:.3f}; "
            f"pg_loss {m_verl['pg_loss']:.5f} vs {m_builtin['pg_loss']:.5f}, "
            f"grad_norm {m_verl['grad_norm']:.4f} vs {m_builtin['grad_norm']:.4f}"
        )
        assert all(v.dtype == torch.float32 for v in w_verl.values())
        assert float(lp_gap.mean()) < 0.02 and float(lp_gap.max()) < 0.25
        assert m_verl["optimizer_steps"] == m_builtin["optimizer_steps"] >= 2
        assert engines < 0.5 * shuffles, "the engines differ by more than a mini-batch reshuffle"
        for key in ("pg_loss", "grad_norm"):
            assert m_verl[key] == pytest.approx(m_builtin[key], rel=0.05, abs=1e-3), key
    finally:
        for t in pair:
            t.close()
