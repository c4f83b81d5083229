"""Shared pieces of the rollout / builtin-trainer / central-training tests: a small shop, a small
random-weight Qwen2 policy with the tiny model's tokenizer (built from the tiny build's own
pieces, but without its warm start, so these tests do not depend on its tuning), and a config
sized for CPU."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable
from pathlib import Path
from typing import Any, Iterator, TypeVar

import psutil
import pytest
import torch

from client_app.rollout import TrainRow
from client_app.tiny_model import collect_demonstrations, init_model, train_tokenizer
from client_app.trainer.base import ClientTasks
from envs.service import serve_in_subprocess
from fl_app import host
from fl_app.calls import FitCall
from fl_app.config import Config, EnvCfg, TinyModelCfg

SMALL_ENV_PARAMS = {"num_products": 300, "num_goals": 120, "val_size": 16, "search_return_n": 50, "seed": 0}
POOL_SIZE = 8

C = TypeVar("C")


@pytest.fixture(scope="module")
def env_url() -> Iterator[str]:
    """A real shop env service for the module, stopped at its end."""
    with serve_in_subprocess("shop", POOL_SIZE, SMALL_ENV_PARAMS) as url:
        yield url


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A random-weight policy directory shared by the module's trainers."""
    return random_model_dir(tmp_path_factory.mktemp("models") / "policy")


def random_model_dir(
    out: Path, hidden_size: int = 32, layers: int = 1, heads: int = 2, vocab_size: int = 300, max_positions: int = 512
) -> Path:
    """A Hugging Face directory: BPE tokenizer trained on shop demonstrations + random Qwen2."""
    if (out / "config.json").exists():
        return out
    demos = collect_demonstrations(EnvCfg(params=SMALL_ENV_PARAMS, max_turns=4), 2, 8, 0.0, 0)
    tokenizer = train_tokenizer(
        sorted({m["content"] for d in demos for m in d.messages} | {d.action for d in demos}), vocab_size
    )
    tiny = TinyModelCfg(hidden_size=hidden_size, layers=layers, heads=heads, vocab_size=vocab_size)
    init_model(tiny, tokenizer, max_positions).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def small_config(model_dir: Path, **sections: dict[str, Any]) -> Config:
    """A CPU-sized config around the policy in `model_dir`; `sections` update it."""
    data: dict[str, Any] = {
        "model": {"path": str(model_dir)},
        "env": {"name": "shop", "params": dict(SMALL_ENV_PARAMS), "pool_size": POOL_SIZE, "max_turns": 3},
        "rollout": {
            "history_length": 2,
            "max_prompt_tokens": 384,
            "max_response_tokens": 8,
            "temperature": 1.0,
            "val_temperature": 0.4,
            "invalid_action_penalty": 0.1,
        },
        "algo": {
            "tasks_per_step": 2,
            "group_size": 2,
            "lr": 1e-3,
            "mini_batch_size": 4,
            "micro_batch_size": 2,
            "kl_coef": 0.01,
            "entropy_coeff": 0.001,
        },
        "federation": {"val_tasks": 8},
        "run": {"device": "cpu", "seed": 0},
    }
    for name, values in sections.items():
        data[name] = {**data.get(name, {}), **values}
    return Config.model_validate(data)


# A lane over k ranks (tests/trainer/test_lane_ranks.py, test_verl_lane_ranks.py): the shard, the call
# and what must be the same episodes and rows, exactly, whatever the number of ranks.
LANE_SHARD = list(range(SMALL_ENV_PARAMS["val_size"], SMALL_ENV_PARAMS["num_goals"]))[:60]
LANE_CALL = FitCall(round=1, client_id=3, local_epochs=2, seed=0)
PLAYED = ("rows", "rollout_tokens", "rollout_steps", "train_score", "train_turns", "train_invalid_action_rate")


def lane_config(model_dir: Path, ranks: int, backend: str = "builtin") -> Config:
    """3 tasks x 2 episodes: 2 rank blocks of unequal size (2 tasks and 1)."""
    cfg = small_config(model_dir, algo={"tasks_per_step": 3}, run={"lane_devices": ranks})
    return cfg.model_copy(update={"backend": backend})


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-12)


@pytest.fixture(autouse=True, scope="module")
def one_torch_thread() -> Iterator[None]:
    """Tiny matmuls on 2 shared cores: a second intra-op thread buys little and takes the core
    that the tests' env services and lanes run on. Restored afterwards."""
    with host.one_torch_thread():
        yield


def fit_rss_series(
    trainer: Any, initial: dict[str, dict[str, torch.Tensor]], fits: int, also: Callable[[], None] = lambda: None
) -> list[float]:
    """RSS (MB) at one phase point (after export) of consecutive fits of different clients; `also`
    records anything else at that point."""
    proc = psutil.Process()
    series = []
    for i in range(fits):
        for member, weights in initial.items():
            trainer.load_weights(weights, member)
        shard = list(range(SMALL_ENV_PARAMS["val_size"], SMALL_ENV_PARAMS["num_goals"]))[(7 * i) % 50 :][:40]
        trainer.fit(
            FitCall(round=1 + i // 2, client_id=i, local_epochs=1, seed=0, proximal_mu=0.01), ClientTasks(shard)
        )
        exported = {m: trainer.export_weights(m) for m in trainer.members}
        del exported
        series.append(proc.memory_info().rss / 2**20)
        also()
    return series


def random_rows(n: int, vocab: int, seed: int) -> list[TrainRow]:
    """Rows of different widths (a right-padded batch), random ids."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(8, 40))]
        reply = [rng.randrange(vocab) for _ in range(rng.randint(2, 9))]
        rows.append(TrainRow(prompt, reply, [1] * len(reply), rng.random(), i // 2, i))
    return rows


def assert_flat(series: list[float], warmup: int, model_mb: float) -> float:
    """RSS growth per fit after warm-up, as the median of the slopes between every two steady
    readings (Theil-Sen): a steady leak reads its slope, a leak that starts late still moves most
    pairs, and one transient peak (the allocator's, gone at the next fit: a CUDA lane once read
    +8.4 MB at its 10th fit after +0.15 MB a fit) moves too few of them to count."""
    steady = series[warmup:]
    if len(steady) < 3:
        raise ValueError(f"{len(series)} readings after {warmup} warm-up fits: need at least 3 steady ones")
    slopes = [(steady[j] - steady[i]) / (j - i) for i in range(len(steady)) for j in range(i + 1, len(steady))]
    per_fit = statistics.median(slopes)
    print(f"RSS after export per fit (MB): {[round(x, 1) for x in series]}; median slope {per_fit:.2f} MB/fit")
    assert per_fit < 0.25 * model_mb, f"RSS grows {per_fit:.1f} MB per fit (model is {model_mb:.1f} MB)"
    return per_fit


def initial_and_size(trainer: Any) -> tuple[dict[str, dict[str, torch.Tensor]], float]:
    """Every member's exported weights, and the policy's fp32 size in MB: its exported tensors, or
    under `federation.update: lora` the whole model (a leaked copy of the base is what would grow)."""
    state = {m: trainer.export_weights(m) for m in trainer.members}
    full = trainer.engine.policy_tensors() if trainer.cfg.federation.update == "lora" else state["actor"].items()
    return state, sum(t.numel() * 4 for _, t in full) / 2**20


def delta_service(model_dir: Path, run_dir: Path, **sections: dict[str, Any]) -> Any:
    """A TrainerService (run 1, lane cpu, not started) of a 2-client `delta-int8` run whose
    error-feedback residuals live under `run_dir`/node-cache; `sections` update its config."""
    from client_app.service import TrainerService

    federation = {"clients": 2, "clients_per_round": 1, "tasks_per_client": 20, "update": "delta-int8"}
    run = {"weight_cache_dir": str(run_dir / "node-cache")}
    return TrainerService(small_config(model_dir, federation=federation, run=run, **sections), 1, "cpu", run_dir)


def service_call(svc: Any, kind: type[C], members: tuple[str, ...] = ("actor",), **fields: Any) -> C:
    """A call as the server would send it to `svc` (a TrainerService): its run, its recipe's
    digest, and a ref per member in (the service reads the local dirs it is handed, not the refs)."""
    from fl_app.calls import InitCall
    from fl_app.channel import WeightsRef
    from fl_app.config import recipe_sha256

    refs = {m: WeightsRef(inline=True, nbytes=0) for m in members} if kind is not InitCall else {}
    header = {"run_id": svc.run_id, "recipe_sha256": recipe_sha256(svc.cfg), "weights": refs}
    return kind(**{**header, **fields})


def service_fit(svc: Any, client: int, weights_in: Path, weights_out: Path) -> dict[str, float]:
    """One round-1 fit of `client` (1 local epoch, seed 0) on a real TrainerService: its metrics."""
    from client_app.service import Dirs

    call = service_call(svc, FitCall, round=1, client_id=client, local_epochs=1, seed=0)
    dirs = Dirs(weights_in={"actor": str(weights_in)}, weights_out={"actor": str(weights_out)})
    return svc.fit(call, dirs)["metrics"]
