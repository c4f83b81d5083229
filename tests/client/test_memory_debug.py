"""The env-gated memory debug dump (client_app/memory_debug.py, invariant 24's debug aid): it
names the tensors that grew between fits and who holds them, on a real trainer service."""

from __future__ import annotations

import logging

import pytest
import torch
from trainer_support import assert_flat, env_url, model_dir, one_torch_thread, service_fit, small_config  # noqa: F401

from client_app.memory_debug import MemoryGrowthReport
from fl_app.weights import save_shards


def test_report_names_a_retired_weight_copy_and_its_holder():
    model = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.Linear(48, 16))
    reporter = MemoryGrowthReport()
    assert reporter.report() is None  # the first census is the baseline
    assert reporter.report() == []  # nothing changed
    retired = {name: p.detach().clone() for name, p in model.named_parameters()}  # a reload leak
    lines = reporter.report()
    assert lines, "a retained copy of every weight must show as growth"
    line = next(x for x in lines if "float32 [48, 32]" in x)
    assert line.startswith("+1 x float32 [48, 32] on cpu") and line.endswith("held by: dict['0.weight']"), line
    del retired
    assert reporter.report() == []

    class Trainer:
        pass

    trainer, kept = Trainer(), [torch.zeros(7, 5)]
    trainer.anchor = torch.ones(3, 11)  # an attribute and a list that hold tensors
    lines = reporter.report()
    assert any(x.endswith("held by: Trainer.anchor") and "[3, 11]" in x for x in lines), lines
    assert any(x.endswith("held by: list") and "[7, 5]" in x for x in lines), lines
    del kept


def test_service_logs_what_grew_between_fits(env_url, model_dir, tmp_path, monkeypatch, caplog):  # noqa: F811
    """FEDAGENT_MEMORY_DEBUG=1 on a real TrainerService: the second fit's log names a tensor the
    trainer was made to keep across fits, the weight shape it has and the key holding it."""
    from client_app.service import TrainerService

    monkeypatch.setenv("FEDAGENT_MEMORY_DEBUG", "1")
    cfg = small_config(model_dir, federation={"clients": 4, "clients_per_round": 2, "tasks_per_client": 20})
    svc = TrainerService(cfg, run_id=1, lane="cpu", run_dir=tmp_path)  # request paths live in the run dir
    caplog.set_level(logging.INFO, logger="fedagent.service")
    try:
        svc.start()
        weights = save_shards(svc.trainer.export_weights("actor"), tmp_path / "w0", 1 << 20).root

        def fit(k: int) -> None:
            service_fit(svc, k, weights, tmp_path / f"out{k}")

        fit(0)
        assert "tensor census taken" in caplog.text
        fit(1)
        embed = svc.trainer.engine.model.get_input_embeddings().weight
        svc.trainer.leaked = {"retired_embedding": embed.detach().clone()}  # what a reload leak looks like
        fit(2)
    finally:
        svc.close()
    grown = [r.getMessage() for r in caplog.records if "memory debug (fit 3)" in r.getMessage()]
    print("\n" + "\n".join(grown))
    assert grown and "tensors that grew" in grown[0], caplog.text[-3000:]
    shape = list(embed.shape)
    assert f"+1 x float32 {shape} on cpu" in grown[0] and "held by: dict['retired_embedding']" in grown[0], grown[0]


@pytest.mark.parametrize(
    "series,warmup,leaks",
    [
        # two CUDA lanes' readings (H100, 2026-12-05): +0.15 MB a fit and one transient peak
        ([2811.7, 2812.0, 2812.1, 2812.3, 2812.5, 2812.7, 2812.8, 2813.0, 2813.1, 2821.5], 5, False),
        ([2810.6, 2810.8, 2811.0, 2813.2, 2811.3, 2811.5, 2811.6, 2827.3, 2812.0, 2812.2], 5, False),
        ([2800.0 + 2 * i for i in range(10)], 5, True),  # a steady leak
        ([2800.0] * 7 + [2810.0] * 3, 5, True),  # a step late in the run
        ([90.0, 95.0, 100.0, 100.0, 100.0, 140.0], 2, True),  # a leak that starts at the last CPU fit
    ],
)
def test_the_rss_check_fails_on_leaks_and_not_on_one_transient_peak(series, warmup, leaks):
    """invariant 24's RSS tests read growth per fit with `assert_flat` (the model here is 7.8 MB)."""
    if leaks:
        with pytest.raises(AssertionError, match="RSS grows"):
            assert_flat(series, warmup, model_mb=7.8)
    else:
        assert assert_flat(series, warmup, model_mb=7.8) < 0.25
