"""Shared pieces of the rollout / builtin-trainer / central-training tests: a small shop, a small
random-weight Qwen2 policy with the tiny model's tokenizer (built from the tiny build's own
pieces, but without its warm start, so these tests do not depend on its tuning), and a config
sized for CPU."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

from client_app.tiny_model import collect_demonstrations, init_model, train_tokenizer
from envs.service import serve_in_subprocess
from fl_app.config import Config, EnvCfg, TinyModelCfg

SMALL_ENV_PARAMS = {"num_products": 300, "num_goals": 120, "val_size": 16, "search_return_n": 50, "seed": 0}
POOL_SIZE = 8


@pytest.fixture(scope="module")
def env_url() -> Iterator[str]:
    """A real shop env service for the module, stopped at its end."""
    with serve_in_subprocess("shop", POOL_SIZE, SMALL_ENV_PARAMS) as url:
        yield url


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A random-weight policy directory shared by the module's trainers."""
    return random_model_dir(tmp_path_factory.mktemp("models") / "policy")


def random_model_dir(out: Path, hidden_size: int = 32, layers: int = 1, heads: int = 2,
                     vocab_size: int = 300, max_positions: int = 512) -> Path:
    """A Hugging Face directory: BPE tokenizer trained on shop demonstrations + random Qwen2."""
    if (out / "config.json").exists():
        return out
    demos = collect_demonstrations(EnvCfg(params=SMALL_ENV_PARAMS, max_turns=4), 2, 8, 0.0, 0)
    tokenizer = train_tokenizer(sorted({m["content"] for d in demos for m in d.messages} | {d.action for d in demos}),
                                vocab_size)
    tiny = TinyModelCfg(hidden_size=hidden_size, layers=layers, heads=heads, vocab_size=vocab_size)
    init_model(tiny, tokenizer, max_positions).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def small_config(model_dir: Path, **sections: dict[str, Any]) -> Config:
    """A CPU-sized config around the policy in `model_dir`; `sections` update it."""
    data: dict[str, Any] = {
        "model": {"path": str(model_dir)},
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
