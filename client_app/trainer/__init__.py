"""The lane's trainer: one fit loop (`loop.RLTrainer`) over a training engine (`backend`:
builtin or verl, `engine.Engine`) and a rollout engine (`rollout.engine`: hf or vllm)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from client_app.trainer.engine import Engine
from fl_app.config import Config

if TYPE_CHECKING:
    from client_app.trainer.loop import RLTrainer


def make_engine(
    cfg: Config, model_path: Path, run_dir: Path | None = None, reference_path: Path | None = None
) -> Engine:
    """The training engine `cfg.backend` names (verl is imported only when chosen: an optional
    extra). `reference_path`: the KL reference's model dir when it is not the policy's."""
    if cfg.backend == "verl":
        from client_app.trainer.verl_backend import VerlEngine

        return VerlEngine(cfg, model_path, run_dir=run_dir, reference_path=reference_path)
    from client_app.trainer.builtin import BuiltinEngine

    return BuiltinEngine(cfg, model_path, reference_path=reference_path)


def make_trainer(cfg: Config, env_url: str | None, run_dir: Path | None = None) -> RLTrainer:
    """The lane's persistent trainer: the fit loop over the configured engines."""
    from client_app.models import model_dirs
    from client_app.trainer.loop import RLTrainer

    dirs = model_dirs(cfg)  # the tiny build or model.path, warm-started when configured
    engine = make_engine(cfg, dirs.policy, run_dir, reference_path=dirs.reference)
    return RLTrainer(cfg, engine, dirs.policy, env_url)
