"""The verl training engine's own properties (the engine contract, shared with builtin, is
tests/test_engine_contract.py): the verl config it composes from the recipe is written into the
run dir, and an outer Ray cluster never leaks into it. Real verl engine on CPU."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

pytest.importorskip("verl")

from trainer_support import model_dir, one_torch_thread, random_model_dir, random_rows, small_config  # noqa: E402,F401

from client_app.trainer import make_engine  # noqa: E402


def test_resolved_config_written_and_ray_isolated(model_dir, tmp_path, monkeypatch):  # noqa: F811
    import ray
    from omegaconf import OmegaConf

    monkeypatch.setenv("RAY_ADDRESS", "127.0.0.1:1")  # an outer cluster that must not leak in
    cfg = small_config(
        model_dir,
        rollout={"temperature": 0.7},
        algo={
            "lr": 1e-3,
            "kl_coef": 0.05,
            "entropy_coeff": 0.01,
            "kl_type": "k3+",
            "loss_agg_mode": "seq-mean-token-mean",
        },
    ).model_copy(update={"backend": "verl"})
    engine = make_engine(cfg, model_dir, run_dir=tmp_path)
    try:
        assert "RAY_ADDRESS" not in os.environ and not ray.is_initialized()
        written = OmegaConf.load(engine.resolved_config_path)
        assert engine.resolved_config_path == tmp_path / "verl" / "verl_config.yaml"
        actor = written.actor_rollout_ref.actor
        assert actor.strategy == "fsdp2" and actor.optim.lr == 1e-3 and actor.kl_loss_coef == 0.05
        assert actor.entropy_coeff == 0.01 and actor.loss_agg_mode == "seq-mean-token-mean" and actor.use_kl_loss
        assert actor.kl_loss_type == "k3+"
        assert written.actor_rollout_ref.rollout.temperature == 0.7
    finally:
        engine.close()


def test_a_lane_that_exits_leaves_no_rendezvous_file_behind(model_dir, tmp_path):  # noqa: F811
    """The process group's rendezvous file: torch removes it when the group is destroyed, which
    never happens in a process that built a verl engine, so one file per lane process piled up in
    the temp dir. The child builds a real engine, closes it and exits."""
    import subprocess
    import sys

    child = (
        "import glob, os, sys, tempfile\n"
        "from pathlib import Path\n"
        "sys.path.insert(0, 'tests')\n"
        "from trainer_support import small_config\n"
        "from client_app.trainer import make_engine\n"
        "cfg = small_config(Path(sys.argv[1])).model_copy(update={'backend': 'verl'})\n"
        "make_engine(cfg, Path(sys.argv[1]), run_dir=Path(sys.argv[2])).close()\n"
        "pattern = os.path.join(tempfile.gettempdir(), f'fedagent-verl-pg-{os.getpid()}-*')\n"
        "print(len(glob.glob(pattern)), os.getpid())\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    args = [sys.executable, "-c", child, str(model_dir), str(tmp_path / "run")]
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True, cwd=Path(__file__).parents[1])
    alive, pid = out.stdout.split()[-2:]
    assert alive == "1", "the rendezvous file should exist while the group does"
    assert not list(tmp_path.glob(f"fedagent-verl-pg-{pid}-*"))


def test_one_fsdp2_unit_holds_every_parameter_and_loads_after_a_forward_only_pass(tmp_path):
    """One rank shards nothing, so the engine wraps each model (actor, reference, critic) as one
    FSDP2 unit instead of verl's unit per decoder layer (per-unit hooks cost host time on every
    pass). Weights load into the sharded fp32 parameters; a unit left gathered after a forward
    (`reshard_after_forward: false`, or FSDP2's default for a root) would then go on computing
    with the weights gathered before the load. So: every unit is sharded again after a
    forward-only pass, and weights loaded right after scoring are the ones scored and exported."""
    import torch
    from torch.distributed.fsdp import FSDPModule

    path = random_model_dir(tmp_path / "policy", layers=3)
    cfg = small_config(path, algo={"name": "ppo", "kl_coef": 0.05}).model_copy(update={"backend": "verl"})
    engine = make_engine(cfg, path)
    try:
        for worker in (engine.actor, engine.ref, engine.critic):
            units = [m for m in worker.engine.module.modules() if isinstance(m, FSDPModule)]
            with_params = [m for m in units if m._get_fsdp_state()._fsdp_param_group is not None]
            assert with_params == [worker.engine.module], [type(m).__name__ for m in with_params]
        g = torch.Generator().manual_seed(0)
        rows = random_rows(3, len(engine.tokenizer), seed=0)
        start = engine.export_weights()
        moved = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in start.items()}
        engine.load_weights(moved)
        expected = engine.log_probs(rows)
        engine.load_weights(start)
        engine.log_probs(rows, "policy")
        engine.log_probs(rows, "reference")
        for worker in (engine.actor, engine.ref):
            assert worker.engine.module._get_fsdp_state()._fsdp_param_group.is_sharded
        engine.load_weights(moved)
        assert all(torch.equal(a, b) for a, b in zip(engine.log_probs(rows), expected, strict=True))
        engine.log_probs(rows)
        exported = engine.export_weights()
        assert all(torch.equal(exported[k], moved[k]) for k in moved)
    finally:
        engine.close()
