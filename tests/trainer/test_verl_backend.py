"""The verl training engine's own properties (the engine contract, shared with builtin, is
tests/trainer/test_engine_contract.py): the verl config it composes from the recipe is written into the
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
    out = subprocess.run(args, env=env, capture_output=True, text=True, check=True, cwd=Path(__file__).parents[2])
    alive, pid = out.stdout.split()[-2:]
    assert alive == "1", "the rendezvous file should exist while the group does"
    assert not list(tmp_path.glob(f"fedagent-verl-pg-{pid}-*"))


def test_one_fsdp2_unit_gathered_once_a_phase_and_weights_loaded_after_a_rollout_are_used(tmp_path, monkeypatch):
    """One rank shards nothing, so the engine wraps each model (actor, reference, critic) as one
    FSDP2 unit instead of verl's unit per decoder layer, and a unit stays gathered over a
    phase's passes: a scoring sweep, a step's micro-batches and a rollout's decoding steps each
    gather once (not once a pass), and every phase but the rollout frees the gathered copy at its
    end. A unit left gathered over a load would go on computing with the weights gathered
    before it: weights loaded right after a rollout's forward passes are the ones scored and
    exported."""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    from client_app.trainer.engine import PolicyBatch

    path = random_model_dir(tmp_path / "policy", layers=3)
    cfg = small_config(path, algo={"name": "ppo", "kl_coef": 0.05, "micro_batch_size": 2, "mini_batch_size": 6})
    engine = make_engine(cfg.model_copy(update={"backend": "verl"}), path)
    gathers: list[str] = []
    unshard = FSDPParamGroup.unshard

    def counted(group: FSDPParamGroup, *args, **kwargs):
        if not group.is_unsharded and group._all_gather_result is None:
            gathers.append(type(group.modules[0]).__name__)
        return unshard(group, *args, **kwargs)

    def sharded(*workers) -> bool:
        return all(w.engine.module._get_fsdp_state()._fsdp_param_group.is_sharded for w in workers)

    try:
        for worker in (engine.actor, engine.ref, engine.critic):
            units = [m for m in worker.engine.module.modules() if isinstance(m, FSDPModule)]
            with_params = [m for m in units if m._get_fsdp_state()._fsdp_param_group is not None]
            assert with_params == [worker.engine.module], [type(m).__name__ for m in with_params]
        g = torch.Generator().manual_seed(0)
        rows = random_rows(6, len(engine.tokenizer), seed=0)  # 3 passes of 2 rows
        start = engine.export_weights()
        moved = {k: v + 0.01 * torch.randn(v.shape, generator=g) for k, v in start.items()}
        engine.load_weights(moved)
        expected = engine.score(rows, "policy")
        engine.load_weights(start)
        monkeypatch.setattr(FSDPParamGroup, "unshard", counted)
        # scoring: one gather per model for its 3 passes, all freed after
        old, ref, _ = engine.score(rows, "policy"), engine.score(rows, "reference"), engine.score(rows, "critic")
        assert len(gathers) == 3 and sharded(engine.actor, engine.ref, engine.critic), gathers
        # a step of 3 micro-batches: one gather, the shards stepped
        engine.begin_fit(reference_from_policy=False)
        try:
            engine.step(PolicyBatch(rows, old, [torch.ones_like(x) for x in old], ref), engine.policy_loss)
        finally:
            engine.end_fit()
        assert len(gathers) == 4 and sharded(engine.actor), gathers
        # a rollout's decoding steps: one gather, kept to the load
        model = engine.generation_model()
        with torch.no_grad():
            for row in rows[:3]:
                model(input_ids=torch.tensor([row.prompt_ids]))
        assert len(gathers) == 5 and not sharded(engine.actor), gathers
        engine.load_weights(moved)
        assert all(torch.equal(a, b) for a, b in zip(engine.score(rows, "policy"), expected, strict=True))
        model(input_ids=torch.tensor([rows[0].prompt_ids]))
        exported = engine.export_weights()
        assert all(torch.equal(exported[k], moved[k]) for k in moved)
    finally:
        engine.close()


def test_a_pass_that_raises_mid_forward_or_backward_leaves_the_engine_exact(tmp_path):
    """A pass aborted by an exception (an OOM in a rollout, a scoring sweep or a step) leaves FSDP2
    mid-iteration: a gathered unit that ignores reshard(), later loads failing on it, or later
    backward passes sending their gradients nowhere. The engine resets FSDP2 (torch's
    reset_iter_state) and the next load, scores and step are exactly a clean engine's."""
    import torch

    from client_app.trainer.engine import PolicyBatch

    path = random_model_dir(tmp_path / "policy", layers=2)
    cfg = small_config(path, algo={"kl_coef": 0.05, "micro_batch_size": 2, "mini_batch_size": 6})
    engine = make_engine(cfg.model_copy(update={"backend": "verl"}), path)
    layer = engine.engine.module.model.layers[1]
    armed = {"forward": False, "backward": False}

    def forward_bomb(*_):
        if armed["forward"]:
            armed["forward"] = False
            raise RuntimeError("out of memory (test)")

    def backward_bomb(*_):
        if armed["backward"]:
            armed["backward"] = False
            raise RuntimeError("out of memory in backward (test)")

    layer.register_forward_pre_hook(forward_bomb)
    layer.register_full_backward_pre_hook(backward_bomb)
    try:
        rows = random_rows(6, len(engine.tokenizer), seed=1)  # 3 micro-batches a pass
        start = engine.export_weights()
        old, ref = engine.score(rows, "policy"), engine.score(rows, "reference")
        batch = PolicyBatch(rows, old, [torch.linspace(-1, 1, len(x)) for x in old], ref)

        def step() -> dict[str, torch.Tensor]:
            engine.load_weights(start)
            engine.begin_fit(reference_from_policy=False)
            try:
                engine.step(batch, engine.policy_loss)
            finally:
                engine.end_fit()
            return engine.export_weights()

        clean = step()
        assert any(not torch.equal(clean[k], start[k]) for k in start)
        for how in ("scoring", "rollout", "step forward", "step backward"):
            armed["backward" if how == "step backward" else "forward"] = True
            with pytest.raises(RuntimeError, match="out of memory"):
                if how == "scoring":
                    engine.score(rows, "policy")
                elif how == "rollout":
                    engine.generation_model()(input_ids=torch.tensor([rows[0].prompt_ids]))
                else:
                    step()
            engine.load_weights(start)
            assert all(torch.equal(a, b) for a, b in zip(engine.score(rows, "policy"), old, strict=True)), how
            again = step()
            assert all(torch.equal(again[k], clean[k]) for k in clean), how
    finally:
        engine.close()


def test_rows_built_in_the_no_padding_layout_equal_verl_s_own_conversion():
    """`verl_rows.no_padding_batch` writes, key for key and bit for bit, what verl's
    `left_right_2_no_padding` makes of the same rows padded left and right."""
    import random

    import torch
    from verl.utils import tensordict_utils as tu
    from verl.workers.utils.padding import left_right_2_no_padding

    from client_app.rollout import TrainRow
    from client_app.trainer.advantages import pad_rows
    from client_app.trainer.verl_rows import no_padding_batch

    rng, pad = random.Random(3), 7
    rows = [
        TrainRow(
            [rng.randrange(50) for _ in range(rng.randint(1, 9))],
            [rng.randrange(50) for _ in range(r)],
            [rng.randint(0, 1) for _ in range(r)],
            0.0,
            0,
            i,
        )
        for i, r in enumerate(rng.randint(1, 6) for _ in range(5))
    ]
    advantages = [torch.randn(len(rw.response_ids)) for rw in rows]
    ours = no_padding_batch(rows, pad, {"advantages": advantages})

    n, p, r = len(rows), max(len(rw.prompt_ids) for rw in rows), max(len(rw.response_ids) for rw in rows)
    prompts, responses = torch.full((n, p), pad), torch.full((n, r), pad)
    attention, mask = torch.zeros((n, p + r), dtype=torch.long), torch.zeros((n, r), dtype=torch.long)
    for b, rw in enumerate(rows):
        lp, lr = len(rw.prompt_ids), len(rw.response_ids)
        prompts[b, p - lp :], responses[b, :lr], mask[b, :lr] = (
            torch.tensor(rw.prompt_ids),
            torch.tensor(rw.response_ids),
            torch.tensor(rw.mask),
        )
        attention[b, p - lp : p + lr] = 1
    theirs = left_right_2_no_padding(
        tu.get_tensordict(
            {
                "prompts": prompts,
                "responses": responses,
                "input_ids": torch.cat([prompts, responses], 1),
                "attention_mask": attention,
                "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
                "response_mask": mask,
                "advantages": pad_rows(advantages, r),
            }
        )
    )
    assert sorted(ours.keys()) == sorted(theirs.keys()) and len(ours) == len(theirs) == n
    for key in theirs.keys():
        a, b = ours[key], theirs[key]
        if isinstance(b, torch.Tensor) and b.is_nested:
            assert a.is_nested and torch.equal(a.values(), b.values()), key
            assert torch.equal(a.offsets(), b.offsets()) and a.offsets().dtype == b.offsets().dtype, key
        elif isinstance(b, torch.Tensor):
            assert a.dtype == b.dtype and torch.equal(a, b), key
        else:
            assert a == b, key
    for key in ("max_seq_len", "max_response_len", "indices"):
        a, b = tu.get_non_tensor_data(ours, key, None), tu.get_non_tensor_data(theirs, key, None)
        assert (torch.equal(a, b) and a.dtype == b.dtype) if key == "indices" else a == b, key


def test_adamw_steps_the_shards_own_storage_as_verl_steps_its_dtensors(tmp_path, monkeypatch):
    """On one rank the optimizer and the gradient clip run on the plain tensors FSDP2's DTensor
    shards hold (`verl_head.LocalShards`), not through DTensor's dispatch: the same storage, so
    two steps give the weights verl's own DTensor step gives (verl's `_build_optimizer` on a
    twin engine), and a shard whose storage moved after the optimizer was built is an error,
    not a step of a stale copy."""
    import torch
    from torch.distributed.tensor import DTensor
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngine

    from client_app.trainer.engine import PolicyBatch
    from client_app.trainer.verl_head import engine_class

    path = random_model_dir(tmp_path / "policy", layers=2)
    cfg = small_config(path, algo={"kl_coef": 0.05, "micro_batch_size": 2, "mini_batch_size": 4, "grad_clip": 0.05})
    cfg = cfg.model_copy(update={"backend": "verl"})
    ours = make_engine(cfg, path)
    monkeypatch.setattr(engine_class(), "_build_optimizer", FSDPEngine._build_optimizer)
    theirs = make_engine(cfg, path)
    try:
        stepped = [p for group in ours.engine.optimizer.param_groups for p in group["params"]]
        shards = [p for p in ours.engine.module.parameters()]
        assert len(stepped) == len(shards) > 0 and not any(isinstance(p, DTensor) for p in stepped)
        assert [p.data_ptr() for p in stepped] == [p._local_tensor.data_ptr() for p in shards]
        assert all(isinstance(p, DTensor) for group in theirs.engine.optimizer.param_groups for p in group["params"])

        rows = random_rows(8, len(ours.tokenizer), seed=4)
        start = ours.export_weights()
        old, ref = ours.score(rows, "policy"), ours.score(rows, "reference")
        gen = torch.Generator().manual_seed(5)
        advantages = [torch.randn(len(x), generator=gen) for x in old]

        def two_steps(engine) -> tuple[dict[str, torch.Tensor], list[float]]:
            engine.load_weights(start)
            engine.begin_fit(reference_from_policy=False)
            try:  # two mini-batches of two micro-batches: a second step after a first zeroes the grads
                norms = [
                    engine.step(
                        PolicyBatch(rows[i : i + 4], old[i : i + 4], advantages[i : i + 4], ref[i : i + 4]),
                        engine.policy_loss,
                    ).grad_norm
                    for i in (0, 4)
                ]
            finally:
                engine.end_fit()
            return engine.export_weights(), norms

        (w_ours, n_ours), (w_theirs, n_theirs) = two_steps(ours), two_steps(theirs)
        assert min(n_ours) > cfg.algo.grad_clip  # the clip scaled both steps
        assert n_ours == n_theirs, (n_ours, n_theirs)
        assert max(float((w_ours[k] - start[k]).abs().max()) for k in start) > 1e-4
        assert all(torch.equal(w_ours[k], w_theirs[k]) for k in start)

        # a non-finite gradient norm skips the step and leaves no gradient behind for the next
        poisoned = [a.clone() for a in advantages]
        poisoned[0][0] = float("nan")
        ours.load_weights(start)
        ours.begin_fit(reference_from_policy=False)
        try:
            skipped = ours.step(PolicyBatch(rows[:4], old[:4], poisoned[:4], ref[:4]), ours.policy_loss)
            assert not skipped.stepped and all(torch.equal(v, start[k]) for k, v in ours.export_weights().items())
        finally:
            ours.end_fit()
        assert two_steps(ours)[1] == n_ours

        shard = shards[0]
        shard._local_tensor = shard._local_tensor.clone()  # what an offload or `.to()` does to a shard
        with pytest.raises(RuntimeError, match="moved after the optimizer was built"):
            two_steps(ours)
    finally:
        ours.close()
        theirs.close()
