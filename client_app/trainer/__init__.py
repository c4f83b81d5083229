"""The lane's trainer: one fit loop (`loop.RLTrainer`) over a training engine (`backend`:
builtin or verl, `engine.Engine`) and a rollout engine (`rollout.engine`: hf or vllm)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from client_app.trainer.engine import Engine
from fl_app.config import Config

if TYPE_CHECKING:
    from client_app.trainer.loop import RLTrainer
    from client_app.trainer.ranks import Ranks


def make_engine(
    cfg: Config,
    model_path: Path,
    run_dir: Path | None = None,
    reference_path: Path | None = None,
    ranks: Ranks | None = None,
) -> Engine:
    """The training engine `cfg.backend` names (verl is imported only when chosen: an optional
    extra). `reference_path`: the KL reference's model dir when it is not the policy's; `ranks`:
    the lane's process group when it spans several ranks (builtin only, `client_app.trainer.ranks`)."""
    if cfg.backend == "verl":
        from client_app.trainer.verl_backend import VerlEngine

        return VerlEngine(cfg, model_path, run_dir=run_dir, reference_path=reference_path)
    from client_app.trainer.builtin import BuiltinEngine

    return BuiltinEngine(cfg, model_path, reference_path=reference_path, ranks=ranks)


def make_trainer(
    cfg: Config, env_url: str | None, run_dir: Path | None = None, rank: int = 0, rank_timeout_s: float | None = None
) -> RLTrainer:
    """The lane's persistent trainer: the fit loop over the configured engines. With
    `run.lane_devices` > 1 it is `rank` of the lane's ranks; rank 0 (the service) starts the
    others here and waits until they built the same trainer. `rank_timeout_s`: the limit of one
    collective (default `ranks.RANK_TIMEOUT_S`)."""
    from client_app.models import model_dirs
    from client_app.trainer.device import resolve_device
    from client_app.trainer.loop import RLTrainer
    from client_app.trainer.ranks import RANK_TIMEOUT_S, Lead, Ranks, bind_device, trainer_signature

    dirs = model_dirs(cfg)  # the tiny build or model.path, warm-started when configured
    ranks: Ranks | None = None
    if cfg.run.lane_devices > 1:
        device = resolve_device(cfg.run.device)
        timeout = RANK_TIMEOUT_S if rank_timeout_s is None else rank_timeout_s
        ranks = (
            Lead(cfg, env_url, run_dir, device, timeout)
            if rank == 0
            else Ranks(rank, cfg.run.lane_devices, bind_device(rank, device))
        )
    engine = make_engine(cfg, dirs.policy, run_dir, reference_path=dirs.reference, ranks=ranks)
    trainer = RLTrainer(cfg, engine, dirs.policy, env_url, ranks)
    if isinstance(ranks, Lead):
        try:
            ranks.start(trainer_signature(cfg, engine))
        except BaseException:
            trainer.close()
            raise
    return trainer
