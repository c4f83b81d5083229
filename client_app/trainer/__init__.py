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
    the lane's process group when it spans several ranks (`client_app.trainer.ranks`)."""
    if cfg.backend == "verl":
        from client_app.trainer.verl_backend import VerlEngine

        return VerlEngine(cfg, model_path, run_dir=run_dir, reference_path=reference_path, ranks=ranks)
    from client_app.trainer.builtin import BuiltinEngine

    return BuiltinEngine(cfg, model_path, reference_path=reference_path, ranks=ranks)


def make_trainer(
    cfg: Config,
    env_url: str | None,
    run_dir: Path | None = None,
    rank_timeout_s: float | None = None,
    ranks: Ranks | None = None,
) -> RLTrainer:
    """The lane's persistent trainer: the fit loop over the configured engines. With
    `run.lane_devices` > 1 it is one of the lane's ranks: rank 0 (the service; `ranks` None)
    starts the others here and checks they built the same trainer; rank r > 0 passes its
    `ranks` (`ranks.worker_main`). An engine whose own process group spans the ranks
    (`ranks.spans_engine`: verl) is built after they joined, on all of them at once.
    `rank_timeout_s`: the limit of one collective (default `ranks.RANK_TIMEOUT_S`)."""
    from client_app.models import model_dirs
    from client_app.trainer.device import resolve_device
    from client_app.trainer.loop import RLTrainer
    from client_app.trainer.ranks import RANK_TIMEOUT_S, Lead, spans_engine, trainer_signature

    dirs = model_dirs(cfg)  # the tiny build or model.path, warm-started when configured
    if cfg.run.lane_devices > 1 and ranks is None:
        timeout = RANK_TIMEOUT_S if rank_timeout_s is None else rank_timeout_s
        ranks = Lead(cfg, env_url, run_dir, resolve_device(cfg.run.device), timeout)

    def build() -> RLTrainer:
        engine = make_engine(cfg, dirs.policy, run_dir, reference_path=dirs.reference, ranks=ranks)
        return RLTrainer(cfg, engine, dirs.policy, env_url, ranks)

    if not isinstance(ranks, Lead):
        return build()
    if not spans_engine(cfg):
        trainer = build()
        try:
            ranks.start(trainer_signature(cfg, trainer.engine))
        except BaseException:
            trainer.close()
            raise
        return trainer
    ranks.start()  # the ranks join first: building the engine takes all of them
    trainer = ranks.run(None, build)  # a rank that fails its build is named
    try:
        ranks.run(None, lambda: ranks.check_same_trainer(trainer_signature(cfg, trainer.engine)))
    except BaseException:
        trainer.close()
        raise
    return trainer
