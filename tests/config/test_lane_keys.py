"""The lane keys are checked at recipe load, before any process starts (issue 41)."""

from __future__ import annotations

import pytest

from fl_app.config import ConfigError, load_config


def test_a_lane_of_several_gpus_is_refused_naming_the_fix():
    with pytest.raises(
        ConfigError,
        match=r"run.lane_devices=2: no engine trains one fit over several ranks.*"
        r"client-resources-num-gpus=1",
    ):
        load_config("tiny-shop-grpo", overrides={"run.lane_devices": 2})


def test_cpu_lanes_on_cuda_are_refused_and_default_to_one():
    with pytest.raises(ConfigError, match=r"run.cpu_lanes=2 with run.device=cuda"):
        load_config("tiny-shop-grpo", overrides={"run.cpu_lanes": 2, "run.device": "cuda"})
    cfg = load_config("tiny-shop-grpo", overrides={"run.cpu_lanes": 2})
    assert cfg.run.cpu_lanes == 2 and load_config("tiny-shop-grpo").run.cpu_lanes == 1
