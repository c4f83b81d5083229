"""Invariant 24 for the verl backend on CPU: host RSS after export is flat across consecutive
fits of different clients (load -> fit -> export), on a model large enough (~8 MB fp32) that
leaking one weight copy, one AdamW state or one FedProx anchor per fit stands far above
allocator noise (the field log's three reload leaks were each at least one weight copy)."""
from __future__ import annotations

import psutil
import pytest
import torch

pytest.importorskip("verl")

from client_app.trainer.base import FitRequest  # noqa: E402
from fl_app.config import Config  # noqa: E402
from trainer_support import env_url, one_torch_thread, random_model_dir, small_config  # noqa: E402,F401


def test_rss_flat_across_6_fits(env_url, tmp_path_factory):  # noqa: F811
    from client_app.trainer.verl_backend import VerlTrainer

    wide = random_model_dir(tmp_path_factory.mktemp("models") / "wide", hidden_size=256, layers=2, heads=4)
    data = small_config(wide, env={"max_turns": 2}, rollout={"max_prompt_tokens": 128},
                        algo={"group_size": 2}).model_dump()
    data["backend"] = "verl"
    trainer = VerlTrainer(Config.model_validate(data), env_url)
    try:
        initial = trainer.export_weights()
        model_mb = sum(t.numel() * 4 for t in initial.values()) / 2**20
        proc, series = psutil.Process(), []
        for i in range(6):
            gen = torch.Generator().manual_seed(i)
            state = {k: v + 1e-3 * torch.randn(v.shape, generator=gen) for k, v in initial.items()}
            trainer.load_weights(state)
            del state
            trainer.fit(FitRequest(round=1 + i // 2, client_id=i, task_indices=list(range(16 + 3 * i, 56)),
                                   local_epochs=1, seed=0, proximal_mu=0.01))
            exported = trainer.export_weights()
            del exported
            series.append(proc.memory_info().rss / 2**20)
        steady = series[2:]
        per_fit = (steady[-1] - steady[0]) / (len(steady) - 1)
        print(f"\nverl RSS after export per fit (MB): {[round(x, 1) for x in series]}; slope {per_fit:.2f} MB/fit; "
              f"model {model_mb:.1f} MB")
        assert per_fit < 0.25 * model_mb, f"RSS grows {per_fit:.1f} MB per fit (model is {model_mb:.1f} MB)"
    finally:
        trainer.close()
