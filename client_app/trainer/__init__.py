"""Trainer backends behind one interface (`base.Trainer`)."""
from __future__ import annotations

from pathlib import Path

from client_app.trainer.base import Trainer
from fl_app.config import Config


def make_trainer(cfg: Config, env_url: str | None, run_dir: Path | None = None) -> Trainer:
    """The trainer `cfg.backend` names (imported only when chosen: verl is an optional extra)."""
    if cfg.backend == "verl":
        from client_app.trainer.verl_backend import VerlTrainer
        return VerlTrainer(cfg, env_url, run_dir=run_dir)
    from client_app.trainer.builtin import BuiltinTrainer
    return BuiltinTrainer(cfg, env_url)
