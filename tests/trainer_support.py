"""Shared pieces of the rollout / builtin-trainer / central-training tests: a small shop, a small
tiny-model build (the real build path, seconds instead of minutes) and a config sized for CPU."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from fl_app.config import Config

SMALL_ENV_PARAMS = {"num_products": 300, "num_goals": 120, "val_size": 16, "search_return_n": 50, "seed": 0}
POOL_SIZE = 8


def small_config(cache_dir: Path, **sections: dict[str, Any]) -> Config:
    """A CPU-sized config around a small tiny model built into `cache_dir`; `sections` update it."""
    data: dict[str, Any] = {
        "model": {"path": "tiny", "tiny": {"hidden_size": 32, "layers": 1, "heads": 2, "vocab_size": 300,
                                           "sft_episodes": 6, "sft_epochs": 1, "cache_dir": str(cache_dir)}},
        "env": {"name": "shop", "params": dict(SMALL_ENV_PARAMS), "pool_size": POOL_SIZE, "max_turns": 3},
        "rollout": {"history_length": 2, "max_prompt_tokens": 384, "max_response_tokens": 8,
                    "temperature": 1.0, "val_temperature": 0.4, "invalid_action_penalty": 0.1},
        "algo": {"tasks_per_step": 2, "group_size": 2, "lr": 1e-3, "mini_batch_size": 4, "micro_batch_size": 2,
                 "kl_coef": 0.01, "entropy_coeff": 0.001},
        "federation": {"val_tasks": 8},
        "run": {"device": "cpu", "seed": 0},
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return Config.model_validate(data)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny matmuls on 2 shared cores: one intra-op thread is several times faster than two
    (OpenMP barriers stall whenever another process holds a core). Restored afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
