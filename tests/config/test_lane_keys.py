"""The lane keys are checked at recipe load, before any process starts (issue 41)."""

from __future__ import annotations

import pytest

from fl_app.config import ConfigError, load_config


@pytest.mark.parametrize("backend", ["builtin", "verl"])
def test_a_lane_of_several_ranks_loads_for_either_engine(backend):
    cfg = load_config("tiny-shop-grpo", overrides={"run.lane_devices": 2, "backend": backend})
    assert cfg.run.lane_devices == 2 and load_config("tiny-shop-grpo").run.lane_devices == 1


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (
            {"backend": "verl", "federation.update": "lora"},
            r"run.lane_devices=2 with backend: verl and federation.update: lora.*full weights only",
        ),
        ({"backend": "verl", "algo.name": "ppo"}, r"run.lane_devices=2 with algo.name='ppo'.*without a critic"),
        ({"algo.name": "ppo"}, r"run.lane_devices=2 with algo.name='ppo'.*without a critic"),
        ({"algo.tasks_per_step": 1}, r"algo.tasks_per_step=1 gives fewer than 2; raise algo.tasks_per_step"),
        ({"rollout.engine": "vllm", "run.device": "cuda"}, r"run.lane_devices=2 rolls out with rollout.engine: hf"),
    ],
)
def test_a_lane_of_several_ranks_no_engine_can_train_as_one_fit_is_refused_naming_the_fix(overrides, match):
    with pytest.raises(ConfigError, match=match):
        load_config("tiny-shop-grpo", overrides={"run.lane_devices": 2, **overrides})


def test_cpu_lanes_on_cuda_are_refused_and_default_to_one():
    with pytest.raises(ConfigError, match=r"run.cpu_lanes=2 with run.device=cuda"):
        load_config("tiny-shop-grpo", overrides={"run.cpu_lanes": 2, "run.device": "cuda"})
    cfg = load_config("tiny-shop-grpo", overrides={"run.cpu_lanes": 2})
    assert cfg.run.cpu_lanes == 2 and load_config("tiny-shop-grpo").run.cpu_lanes == 1
