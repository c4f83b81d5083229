"""The training-engine contract (issue #17): every engine behind `client_app.trainer.engine`
(builtin, verl on CPU) under the one fit loop (`client_app.trainer.loop`), held to the same
properties, and the two engines held to each other:

  * load then export is the identity bit for bit, for every member (invariant 1), and what
    cannot be loaded is refused with a message naming the problem;
  * a fit trains every member, from fresh optimizers (invariant 3), and leaves no optimizer
    state or gradient behind (invariant 24);
  * FedProx adds exactly mu * (w - w_anchor) to the policy's gradient and never reaches the
    critic (invariant 4);
  * micro-batching changes memory, never the gradient or the loss (field log 2026-07-22);
  * a row scored in a right-padded batch scores as if alone;
  * validation is never penalised, in both rollout modes (invariant 10);
  * a GiGPO fit gets step-level advantages from the rows' actions, in both rollout modes;
  * host memory is flat across fits (invariant 24);
  * builtin and verl score rows, take policy and critic steps and start critics alike (1e-5),
    for every loss aggregation mode and KL estimator the recipe can select;
  * under `federation.update: lora` both engines hold the same adapters (names, A bits, base
    digest), take the same steps on B, and either's B merges to the same bits in the other.

Real env service, real random-weight Qwen2 policies, real engines; nothing mocked.
"""

from __future__ import annotations

import dataclasses
import gc
import importlib.util
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any

import pytest
import torch
from trainer_support import (  # noqa: F401
    SMALL_ENV_PARAMS,
    assert_flat,
    env_url,
    fit_rss_series,
    initial_and_size,
    model_dir,
    one_torch_thread,
    random_model_dir,
    small_config,
)

from client_app.algos import FedProxAnchor
from client_app.rollout import Episode, TrainRow, derive_seed, group_specs, training_rows
from client_app.trainer import make_engine
from client_app.trainer.advantages import ADVANTAGES
from client_app.trainer.base import ClientTasks
from client_app.trainer.compute import resolve_precision
from client_app.trainer.engine import PolicyBatch, ValueBatch
from client_app.trainer.loop import RLTrainer, critic_pass, policy_pass
from client_app.trainer.lora import adapter_layers, is_adapter
from fl_app.calls import EvalCall, FitCall
from fl_app.config import Config
from fl_app.weights import save_shards

TOL = 1e-5
TRAIN_TASKS = list(range(SMALL_ENV_PARAMS["val_size"], SMALL_ENV_PARAMS["num_goals"]))
HAS_VERL = importlib.util.find_spec("verl") is not None
_no_verl = pytest.mark.skipif(not HAS_VERL, reason="verl not installed")
_no_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
# every engine on the CPU (CI) and, gpu-marked, on CUDA (bf16 compute: tolerances, not bits)
ENGINES = [
    "builtin",
    "builtin-cpu-bf16",  # the bf16 compute copy of fp32 masters (the CUDA default), on the CPU
    "builtin-cpu-fp32-lora",  # federation.update: lora, the members are the adapters' B (+ the value head)
    # compiled decoder layers (run.compile, the GPU recipes'), on the CPU: ~70 s of compiling, so
    # slow-marked; tests/trainer/test_compute.py holds compiled layers to eager ones in the default run
    pytest.param("builtin-cpu-fp32+compile", marks=pytest.mark.slow),
    pytest.param("verl", marks=_no_verl),
    pytest.param("verl-lora", marks=_no_verl),  # the same adapters on verl's FSDP2 engine
    pytest.param("builtin-cuda", marks=[pytest.mark.gpu, _no_cuda]),
    pytest.param("builtin-cuda-bf16+compile", marks=[pytest.mark.gpu, _no_cuda]),  # what GPU recipes run
    pytest.param("builtin-cuda-autocast", marks=[pytest.mark.gpu, _no_cuda]),  # the former GPU mode
    pytest.param("verl-cuda", marks=[pytest.mark.gpu, _no_cuda, _no_verl]),
    pytest.param("verl-cuda-lora", marks=[pytest.mark.gpu, _no_cuda, _no_verl]),
]
LORA_KIND = "-lora"
# (rtol, atol) of gradients, log-probs and repeated fits: fp32, and bf16 compute (CUDA's default)
TOLERANCE = {"fp32": (1e-4, 1e-7), "bf16": (5e-2, 2e-3)}
# temperature != 1 (log-probs are tempered), KL and entropy on, 5-row mini-batches of 2-row
# micro-batches (a ragged last one), a value clip that binds
SECTIONS = {
    "rollout": {"temperature": 0.7},
    "algo": {
        "lr": 1e-3,
        "kl_coef": 0.05,
        "entropy_coeff": 0.01,
        "mini_batch_size": 5,
        "micro_batch_size": 2,
        "critic": {"lr": 3e-3, "value_clip": 0.2, "loss_coef": 1.0},
    },
}
PPO = {"name": "ppo", "tasks_per_step": 3, "group_size": None}


def _config(kind: str, model: Path, **sections: dict) -> Config:
    """`kind` = backend[-device[-precision[+compile]]][-lora], as the bench names its arms;
    `-lora`: the members are LoRA adapters over the frozen model (`federation.update: lora`)."""
    lora = kind.endswith(LORA_KIND)
    parts = kind.removesuffix(LORA_KIND).split("-")
    backend, device, arm = parts + ["cpu", "auto"][len(parts) - 1 :]
    precision, _, compiled = arm.partition("+")
    merged = {k: dict(v) for k, v in SECTIONS.items()}
    merged["run"] = {"device": device, "precision": precision, "compile": compiled == "compile"}
    if lora:
        merged["federation"] = {"update": "lora", "lora": {"rank": 4, "alpha": 8.0}}
    for name, values in sections.items():
        merged[name] = {**merged.get(name, {}), **values}
    return small_config(model, **merged).model_copy(update={"backend": backend})


def _computes_in_fp32(trainer: RLTrainer) -> bool:
    return resolve_precision(trainer.cfg.run.precision, trainer.engine.device) == "fp32"


def _tolerance(trainer: RLTrainer) -> tuple[float, float]:
    return TOLERANCE["fp32" if _computes_in_fp32(trainer) else "bf16"]


def _assert_grads_close(trainer: RLTrainer, got: torch.Tensor, want: torch.Tensor) -> None:
    """Element by element in fp32; in bf16, where one element in thousands can lose most of its
    digits to cancellation, tensor by tensor (a normalisation bug is off by whole factors)."""
    rtol, atol = _tolerance(trainer)
    if _computes_in_fp32(trainer):
        torch.testing.assert_close(got, want, rtol=rtol, atol=atol)
    else:
        assert float((got - want).norm()) <= rtol * float(want.norm()) + atol, (got - want).abs().max()


def _same_fit(
    a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], start: dict[str, torch.Tensor], device: str
) -> bool:
    """Two fits ended in the same place: bit for bit on the CPU; on CUDA (non-deterministic
    kernels) within 2% of how far the fit moved."""
    if device == "cpu":
        return not _changed(a, b)
    return _max_diff(a, b) < 0.02 * _max_diff(a, start)


def build(kind: str, model: Path, url: str | None, run_dir: Path | None = None, **sections: dict) -> RLTrainer:
    cfg = _config(kind, model, **sections)
    return RLTrainer(cfg, make_engine(cfg, model, run_dir), model, url)


def _with_micro(trainer: RLTrainer, micro: int, tokens: int | None = None) -> Config:
    """Set the engine's micro-batch sizes (policy and critic) and token budget; returns the
    config to restore."""
    saved = trainer.engine.cfg
    a = saved.algo.model_copy(
        update={
            "micro_batch_size": micro,
            "micro_batch_tokens": tokens,
            "critic": saved.algo.critic.model_copy(update={"micro_batch_size": micro}),
        }
    )
    trainer.engine.cfg = saved.model_copy(update={"algo": a})
    return saved


def _state(trainer: RLTrainer) -> dict[str, dict[str, torch.Tensor]]:
    return {m: trainer.export_weights(m) for m in trainer.members}


def _load(trainer: RLTrainer, state: dict[str, dict[str, torch.Tensor]]) -> None:
    for member, weights in state.items():
        trainer.load_weights(weights, member)


def _changed(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k] - b[k]).abs().max()) for k in a)


def _grads(trainer: RLTrainer, member: str) -> dict[str, torch.Tensor]:
    """Full (unsharded) gradients of `member`, as CPU copies."""
    out = {}
    for name, p in trainer.engine.parameters(member):
        g = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad
        out[name] = g.detach().float().cpu().clone()
    return out


def play(trainer: RLTrainer, tasks: list[int], group: int, seed: int) -> tuple[list[Episode], list[TrainRow]]:
    """Real episodes by the trainer's current policy, and their training rows."""
    episodes, _, _ = trainer._play(group_specs(tasks, group), 1.0, seed, "test")
    return episodes, training_rows(episodes, 0.1)


def scored_rows(
    trainer: RLTrainer, tasks: list[int], group: int, seed: int
) -> tuple[list[Episode], list[TrainRow], list[torch.Tensor]]:
    """Rows with a seeded score per episode (a random policy scores every episode alike: zero
    advantages, an entropy-only gradient) and their GRPO advantages."""
    episodes, rows = play(trainer, tasks, group, seed)
    scores = torch.rand(len(episodes), generator=torch.Generator().manual_seed(seed)).tolist()
    rows = [dataclasses.replace(rw, score=scores[rw.episode]) for rw in rows]
    advantages, _ = ADVANTAGES["group_relative"](episodes, rows, None, trainer.cfg.algo)
    return episodes, rows, advantages


# ================================================================ one engine at a time


@pytest.fixture(scope="module", params=ENGINES)
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def ppo(kind, env_url, model_dir, tmp_path_factory):  # noqa: F811
    with closing(build(kind, model_dir, env_url, tmp_path_factory.mktemp("run"), algo=PPO)) as t:
        yield t


@pytest.fixture(scope="module")
def initial(ppo) -> dict[str, dict[str, torch.Tensor]]:
    return _state(ppo)


def test_load_then_export_is_bitwise_identity_for_every_member(ppo, initial):
    assert ppo.members == ("actor", "critic")
    gen = torch.Generator().manual_seed(0)
    try:
        for member, start in initial.items():
            weights = {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in start.items()}
            for w in weights.values():
                w.view(-1)[0] = 1.0 + 2.0**-20  # not representable in bf16
            ppo.load_weights(weights, member)
            out = ppo.export_weights(member)
            assert out.keys() == weights.keys()
            for k, w in weights.items():
                assert out[k].dtype == torch.float32 and out[k].device.type == "cpu"
                assert torch.equal(out[k].view(torch.int32), w.view(torch.int32)), (member, k)
            out[k].add_(1.0)  # an export is a copy, not a view of the model
            assert torch.equal(ppo.export_weights(member)[k], w)
    finally:
        _load(ppo, initial)


def test_master_weights_hold_the_exported_bits_and_write_the_same_shards(ppo, tmp_path):
    """What the service writes after a fit (`master_weights`: the live masters where the engine
    holds them whole, no copy, on its device) has exactly `export_weights`' bits, and shards
    written from it are byte for byte the shards of the CPU copies (a CUDA lane streams them
    through pinned buffers): invariant 1 on the export path."""
    before = _state(ppo)
    for member in ppo.members:
        live, copy = ppo.master_weights(member), ppo.export_weights(member)
        assert live.keys() == copy.keys()
        for k, v in live.items():
            assert v.dtype == torch.float32 and torch.equal(v.cpu().view(torch.int32), copy[k].view(torch.int32)), k
        if ppo.cfg.backend == "builtin":  # its masters are whole: no copy
            params = dict(ppo.engine.parameters(member))
            assert all(live[k].data_ptr() == params[k].data_ptr() for k in live)
            assert {v.device.type for v in live.values()} == {ppo.engine.device.type}
        # small shards: several (a third of LoRA adapters' few KB), and tensors streamed in more than one piece
        shard = min(64 << 10, sum(v.numel() * 4 for v in live.values()) // 3)
        a = save_shards(live, tmp_path / f"{member}-live", shard, durable=False)
        b = save_shards(copy, tmp_path / f"{member}-copy", shard, durable=False)
        assert a.sha256 == b.sha256 and len(a.shards) > 1
    assert not any(_changed(ppo.export_weights(m), before[m]) for m in ppo.members)  # writing is read-only


def test_the_reference_stays_on_the_engine_s_device(ppo):
    """The reference scores every row of every fit: kept in host memory (verl's choice for a
    forward-only engine) its weights would cross to the GPU at every micro-batch
    (docs/benchmarks.md has what that cost)."""
    ref = ppo.engine.ref
    assert ref is not None  # SECTIONS set a KL coefficient
    module = ref if isinstance(ref, torch.nn.Module) else ref.engine.module
    local = [p.to_local() if hasattr(p, "to_local") else p for p in module.parameters()]  # FSDP2: DTensors
    assert local and {p.device.type for p in local} == {ppo.engine.device.type}


def test_load_refuses_foreign_narrow_or_misshapen_weights(ppo, initial):
    weights = initial["actor"]
    name = next(iter(weights))
    with pytest.raises(KeyError, match="missing"):
        ppo.load_weights({k: v for k, v in weights.items() if k != name})
    with pytest.raises(KeyError, match="unexpected"):
        ppo.load_weights({**weights, "extra.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match="shape"):
        ppo.load_weights({**weights, name: torch.zeros(3, 3)})
    with pytest.raises(TypeError, match="fp32"):
        ppo.load_weights({**weights, name: weights[name].bfloat16()})
    with pytest.raises(KeyError, match="no 'value' weights"):
        ppo.export_weights("value")
    _load(ppo, initial)
    assert not _changed(ppo.export_weights(), weights)


def test_ppo_fits_train_both_members_from_fresh_optimizers(ppo, initial):
    """Two fits from the same weights with the same request end bit-identical in both members:
    no optimizer state (moments, step counts) of the policy or the critic survives a fit; and
    nothing is left behind (invariants 3, 24)."""
    call, tasks = FitCall(round=3, client_id=4, local_epochs=2, seed=5), ClientTasks(TRAIN_TASKS)
    ends, results = [], []
    for _ in range(2):
        _load(ppo, initial)
        results.append(ppo.fit(call, tasks))
        ends.append(_state(ppo))
    _load(ppo, initial)
    m = results[0].metrics
    assert results[0].num_examples == 2 * 3 * 1  # E x tasks_per_step x (ungrouped PPO)
    assert m["optimizer_steps"] >= 2 and m["critic_optimizer_steps"] >= 2
    assert m["skipped_steps"] == m["critic_skipped_steps"] == 0
    assert all(torch.isfinite(torch.tensor(m[k])) for k in ("critic_loss", "pg_loss", "critic_value_mean"))
    for member in ("actor", "critic"):
        assert _changed(ends[0][member], initial[member]), f"the fit must train the {member}"
        assert _same_fit(ends[0][member], ends[1][member], initial[member], ppo.engine.device.type), member
    for member in ppo.members:
        assert all(p.grad is None for _, p in ppo.engine.parameters(member))
    gc.collect()
    adams = [o for o in gc.get_objects() if type(o) is torch.optim.AdamW]
    assert all(not opt.state for opt in adams), "optimizer state outlived the fit"


def test_fedprox_adds_mu_times_the_drift_to_the_policy_gradient_only(ppo, initial):
    """On a fixed batch, mu > 0 changes the policy's gradient by exactly mu * (w - w_anchor);
    a whole fit with mu = 5 moves the policy differently and leaves the critic bit-identical."""
    _load(ppo, initial)
    _, rows, adv = scored_rows(ppo, [20, 21, 22], 1, seed=0)
    anchor = FedProxAnchor.snapshot(ppo.engine.parameters("actor"))
    gen = torch.Generator().manual_seed(1)
    ppo.load_weights({k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in initial["actor"].items()})
    moved = ppo.export_weights()
    old = ppo.engine.score(rows, "policy")
    ref = ppo.engine.score(rows, "reference")
    batch = PolicyBatch(rows, old, adv, ref)
    mu, grads = 0.5, {}
    ppo.engine.begin_fit(reference_from_policy=False)
    try:
        for label, hook in (("plain", None), ("fedprox", lambda: anchor.add_grad_(ppo.engine.parameters("actor"), mu))):
            ppo.load_weights(moved)

            def snapshot(hook=hook, label=label) -> None:
                if hook is not None:
                    hook()
                grads[label] = _grads(ppo, "actor")

            ppo.engine.step(batch, ppo.policy_loss, after_backward=snapshot)
    finally:
        ppo.engine.end_fit()
        anchor.release()
    rtol, atol = _tolerance(ppo)
    for k, w in moved.items():
        expected = mu * (w - initial["actor"][k])
        torch.testing.assert_close(grads["fedprox"][k] - grads["plain"][k], expected, rtol=rtol, atol=atol)
    out = {}
    for mu in (0.0, 5.0):
        _load(ppo, initial)
        ppo.fit(FitCall(round=2, client_id=5, local_epochs=1, seed=1, proximal_mu=mu), ClientTasks(TRAIN_TASKS))
        out[mu] = _state(ppo)
    _load(ppo, initial)
    assert _changed(out[0.0]["actor"], out[5.0]["actor"])
    assert _changed(out[0.0]["critic"], initial["critic"])
    assert _same_fit(out[0.0]["critic"], out[5.0]["critic"], initial["critic"], ppo.engine.device.type)
    gc.collect()
    assert all(a.released for a in gc.get_objects() if type(a) is FedProxAnchor)


def test_micro_batches_change_neither_gradients_nor_losses(ppo, initial):
    """Policy and critic: the loss is normalised by the WHOLE mini-batch, so its value and its
    gradient depend neither on the micro-batch size nor on a token budget that cuts the
    micro-batches by length (algo.micro_batch_tokens; field log 2026-07-22)."""
    _load(ppo, initial)
    episodes, rows, adv = scored_rows(ppo, [30, 31, 32], 1, seed=5)
    old = [lp - 0.05 for lp in ppo.engine.score(rows, "policy")]  # ratios != 1
    ref = ppo.engine.score(rows, "reference")
    values = ppo.engine.score(rows, "critic")
    _, returns = ADVANTAGES["gae"](episodes, rows, values, ppo.cfg.algo)
    old_values = [v + 1.2 * torch.linspace(-1, 1, len(v)) for v in values]  # the clip binds on some tokens
    longest = max(len(r.prompt_ids) + len(r.response_ids) for r in rows)
    seen: dict[tuple[int, int | None], tuple] = {}
    for micro, tokens in ((1, None), (2, None), (len(rows), None), (len(rows), 2 * longest)):
        saved = _with_micro(ppo, micro, tokens)
        ppo.engine.begin_fit(reference_from_policy=False)
        try:
            grads: dict[str, dict[str, torch.Tensor]] = {}
            _load(ppo, initial)
            pol = ppo.engine.step(
                PolicyBatch(rows, old, adv, ref),
                ppo.policy_loss,
                after_backward=lambda: grads.__setitem__("actor", _grads(ppo, "actor")),  # noqa: B023 (runs now)
            )
            val = ppo.engine.step(
                ValueBatch(rows, old_values, returns),
                ppo.value_loss,
                after_backward=lambda: grads.__setitem__("critic", _grads(ppo, "critic")),  # noqa: B023
            )
        finally:
            ppo.engine.end_fit()
            ppo.engine.cfg = saved
        seen[micro, tokens] = (pol, val, grads)
    _load(ppo, initial)
    rtol, atol = _tolerance(ppo)
    base_pol, base_val, base_grads = seen[len(rows), None]
    assert 0 < base_val.metrics["clipfrac"] < 1, "the test must exercise the value clip"
    for micro, (pol, val, grads) in seen.items():
        for key in ("pg_loss", "kl_loss", "entropy"):
            assert pol.metrics[key] == pytest.approx(base_pol.metrics[key], rel=rtol / 10, abs=atol), (micro, key)
        assert val.metrics["loss"] == pytest.approx(base_val.metrics["loss"], rel=rtol / 10), micro
        for member in ("actor", "critic"):
            for k in grads[member]:
                _assert_grads_close(ppo, grads[member][k], base_grads[member][k])


def test_a_token_budget_reaches_where_the_engines_cut_their_passes(ppo, initial, monkeypatch):
    """algo.micro_batch_tokens is not only accepted but applied: both engines cut their scoring
    passes and their policy steps by it into passes within the budget (verl's steps too, rather
    than verl's own token budget, which balances long and short rows into every pass)."""
    import client_app.trainer.builtin as builtin_engine
    import client_app.trainer.verl_backend as verl_engine
    from client_app.trainer.engine import micro_batches

    _load(ppo, initial)
    episodes, rows, adv = scored_rows(ppo, [50, 51, 52], 1, seed=6)
    widths = [len(r.prompt_ids) + len(r.response_ids) for r in rows]
    budget = 2 * max(widths)
    cuts: list[tuple[int | None, list[list[int]]]] = []

    def spy(rows_: object, micro: int, max_tokens: int | None = None) -> list[list[int]]:
        out = micro_batches(rows_, micro, max_tokens)  # type: ignore[arg-type]
        cuts.append((max_tokens, out))
        return out

    for module in (builtin_engine, verl_engine):
        monkeypatch.setattr(module, "micro_batches", spy)
    passes: dict[str, list[int]] = {"actor": [], "reference": []}  # verl: the rows of each forward
    if hasattr(ppo.engine, "engine"):
        for name, fsdp in (("actor", ppo.engine.engine), ("reference", ppo.engine.ref.engine)):

            def pass_spy(micro_batch: Any, *args: Any, _f=fsdp.forward_step, _n=name, **kwargs: Any) -> Any:
                passes[_n].append(len(micro_batch))
                return _f(micro_batch, *args, **kwargs)

            monkeypatch.setattr(fsdp, "forward_step", pass_spy)
    saved = _with_micro(ppo, len(rows), budget)
    ppo.engine.begin_fit(reference_from_policy=False)
    try:
        old = ppo.engine.score(rows, "policy")
        ppo.engine.step(PolicyBatch(rows, old, adv, ppo.engine.score(rows, "reference")), ppo.policy_loss)
    finally:
        ppo.engine.end_fit()
        ppo.engine.cfg = saved
        _load(ppo, initial)
    assert len(cuts) == 3 and all(tokens == budget for tokens, _ in cuts), cuts  # 2 scoring passes + the step
    for _, parts in cuts:
        assert len(parts) > 1 and all(len(p) * max(widths[i] for i in p) <= budget for p in parts)
        assert sorted(i for p in parts for i in p) == list(range(len(rows)))
    if hasattr(ppo.engine, "engine"):  # verl trains in passes of exactly the step's cuts
        # and scores in passes of the scoring cuts (several of one size may come in one call)
        scored, trained = passes["actor"][: len(cuts[0][1])], passes["actor"][len(cuts[0][1]) :]
        assert scored == [len(p) for p in cuts[0][1]] and trained == [len(p) for p in cuts[-1][1]], passes
        assert passes["reference"] == [len(p) for p in cuts[1][1]], passes


def test_a_row_in_a_right_padded_batch_scores_as_if_alone(ppo, initial):
    _load(ppo, initial)
    _, rows = play(ppo, [40, 41, 42], 1, seed=9)
    assert len({len(r.prompt_ids) + len(r.response_ids) for r in rows}) > 1, "need rows of different lengths"
    batched = (ppo.engine.score(rows, "policy"), ppo.engine.score(rows, "critic"))
    saved = _with_micro(ppo, 1)
    try:
        alone = (ppo.engine.score(rows, "policy"), ppo.engine.score(rows, "critic"))
    finally:
        ppo.engine.cfg = saved
    atol = 1e-5 if _computes_in_fp32(ppo) else 5e-2
    for b_rows, a_rows in zip(batched, alone):
        for b, a in zip(b_rows, a_rows):
            torch.testing.assert_close(b, a, rtol=0, atol=atol)


@pytest.mark.parametrize("mode", ["windowed", "concat"])
def test_validation_is_never_penalised(kind, env_url, model_dir, mode):  # noqa: F811
    """Invariant 10 in both rollout modes (field log 2026-07-28: concat mode penalised validation)."""
    t = build(kind, model_dir, env_url, rollout={"mode": mode}, algo={"kl_coef": 0.0})
    try:
        val, val_tasks = EvalCall(seed=0), range(8)
        runs = {}
        for penalty in (0.0, 5.0):
            t.cfg = t.cfg.model_copy(
                update={"rollout": t.cfg.rollout.model_copy(update={"invalid_action_penalty": penalty})}
            )
            runs[penalty] = t.evaluate(val, val_tasks)
        keys = ("success", "reward", "turns", "invalid_action_rate")
        assert runs[0.0].metrics["invalid_action_rate"] > 0, "the penalty must have had something to act on"
        assert {k: runs[0.0].metrics[k] for k in keys} == {k: runs[5.0].metrics[k] for k in keys}
        assert 0.0 <= runs[5.0].metrics["reward"] <= 1.0 and runs[0.0].num_examples == 8
        outcomes = runs[0.0].outcomes  # per task (hardness labels): agree with the success rate
        assert sorted(outcomes) == list(range(8)) and sum(outcomes.values()) / 8 == runs[0.0].metrics["success"]
    finally:
        t.close()


def test_a_concat_grpo_fit_trains_one_row_per_episode(kind, env_url, model_dir):  # noqa: F811
    t = build(kind, model_dir, env_url, rollout={"mode": "concat", "max_prompt_tokens": 1024}, env={"max_turns": 3})
    try:
        before = t.export_weights()
        res = t.fit(FitCall(round=1, client_id=2, local_epochs=2, seed=0), ClientTasks(TRAIN_TASKS))
        assert res.metrics["rows"] == res.num_examples == 2 * 2 * 2  # E x tasks x group
        assert res.metrics["optimizer_steps"] >= 2 and _changed(before, t.export_weights())
    finally:
        t.close()


@pytest.mark.parametrize("mode", ["windowed", "concat"])
def test_a_gigpo_fit_trains_on_step_level_advantages(kind, env_url, model_dir, mode):  # noqa: F811
    """algo.name=gigpo through the fit loop on every engine, in both rollout modes: the rows carry
    their actions (one per windowed row, every reply of a concat row, spans on generated tokens
    only), the episodes of a group share their first page at least, so actions are grouped by
    anchor state, and the policy steps. (A random policy acts invalidly everywhere, so its step
    returns tie: tests/trainer/test_gigpo.py and the tiny-shop-gigpo run show non-zero ones.)"""
    t = build(
        kind,
        model_dir,
        env_url,
        rollout={"mode": mode, "max_prompt_tokens": 1024},
        env={"max_turns": 3},
        algo={"name": "gigpo", "gigpo": {"mode": "mean_std_norm"}},
    )
    try:
        episodes, rows = play(t, TRAIN_TASKS[:2], 2, seed=1)
        turns = [(k, j) for k, ep in enumerate(episodes) for j in range(len(ep.turns))]
        steps = [(rw.episode, st) for rw in rows for st in rw.steps]
        assert [k for k, _ in steps] == [k for k, _ in turns]  # every action once, in order
        for (k, j), (_, st) in zip(turns, steps):
            assert st.anchor == episodes[k].turns[j].observation
        for rw in rows:
            assert sum(st.end - st.start for st in rw.steps) == sum(rw.mask)
            assert all(rw.mask[i] for st in rw.steps for i in range(st.start, st.end))
        before = t.export_weights()
        res = t.fit(FitCall(round=1, client_id=4, local_epochs=1, seed=0), ClientTasks(TRAIN_TASKS))
        m = res.metrics
        assert m["step_grouped_share"] > 0 and m["step_advantage_abs"] >= 0, m
        assert m["optimizer_steps"] > 0 and _changed(before, t.export_weights())
    finally:
        t.close()


def test_a_fit_leaves_out_the_groups_whose_episodes_all_scored_the_same(kind, env_url, model_dir):  # noqa: F811
    """algo.filter_uniform_groups. A random policy wins nothing and, without the invalid-action
    penalty, every episode scores 0: every group is uniform, so with the filter the fit trains no
    row, takes no step and returns the weights bit for bit; without it the same fit steps (the
    KL and entropy terms move the policy even where every advantage is 0)."""
    seen = {}
    for on in (False, True):
        t = build(kind, model_dir, env_url, rollout={"invalid_action_penalty": 0.0}, algo={"filter_uniform_groups": on})
        try:
            before = t.export_weights()
            res = t.fit(FitCall(round=1, client_id=3, local_epochs=2, seed=0), ClientTasks(TRAIN_TASKS))
            seen[on] = (res.metrics, _changed(before, t.export_weights()))
            # invariant 2: FedAvg weighs a client by the episodes it played, filtered or not
            assert res.num_examples == 2 * t.cfg.algo.tasks_per_step * t.cfg.algo.rollouts_per_task
        finally:
            t.close()
    (plain, plain_moved), (filtered, filtered_moved) = seen[False], seen[True]
    assert plain["uniform_groups"] == filtered["uniform_groups"] == 1.0, "the test needs all-equal groups"
    assert plain["rows"] > 0 and plain["optimizer_steps"] > 0 and plain_moved
    assert filtered["rows"] == 0 and filtered["optimizer_steps"] == 0 and not filtered_moved
    assert filtered["train_success"] == plain["train_success"] == 0.0


@pytest.fixture(scope="module", params=["grpo", "ppo"])
def wide(request, kind, env_url, tmp_path_factory):  # noqa: F811
    """A model large enough (~8 MB of fp32 weights, ~24 MB with AdamW moments) that leaking one
    copy of anything per fit stands far above allocator noise; with PPO, a critic as large beside it."""
    model = random_model_dir(tmp_path_factory.mktemp("models") / "wide", hidden_size=256, layers=2, heads=4)
    algo = {"name": request.param, "group_size": 2 if request.param == "grpo" else 1}
    t = build(
        kind,
        model,
        env_url,
        tmp_path_factory.mktemp("run"),
        env={"max_turns": 2},
        rollout={"max_prompt_tokens": 128},
        algo=algo,
    )
    with closing(t):
        yield t


def test_rss_flat_across_6_fits(wide, kind):
    """On CUDA a lane's first fits also warm device-side caches (cuBLAS workspaces, the caching
    allocator's pools) whose host bookkeeping settles later: more fits, more warm-up there."""
    if kind == "builtin-cpu-bf16":  # ~60 s a fit series on a CPU without bf16 kernels
        pytest.skip("the bf16 compute copy on the CPU: covered by test_rss_flat_across_20_fits (-m slow)")
    state, model_mb = initial_and_size(wide)
    on_cuda = wide.engine.device.type == "cuda"
    assert_flat(fit_rss_series(wide, state, 10 if on_cuda else 6), warmup=5 if on_cuda else 2, model_mb=model_mb)


@pytest.mark.slow
def test_rss_flat_across_20_fits(wide):
    state, model_mb = initial_and_size(wide)
    assert_flat(fit_rss_series(wide, state, 20), warmup=4, model_mb=model_mb)


# ================================================================ the engines against each other

needs_verl = pytest.mark.skipif(not HAS_VERL, reason="verl not installed")


@pytest.fixture(scope="module")
def pair(env_url, model_dir, tmp_path_factory):  # noqa: F811
    """A builtin and a verl PPO trainer on the same policy and config."""
    if not HAS_VERL:
        pytest.skip("verl not installed")
    made = [build(kind, model_dir, env_url, tmp_path_factory.mktemp("run"), algo=PPO) for kind in ("builtin", "verl")]
    try:
        yield tuple(made)
    finally:
        for t in made:
            t.close()


def _lora_pair(trained: str, env_url: str, model_dir: Path, tmp_path_factory) -> Iterator[tuple[RLTrainer, RLTrainer]]:
    """A builtin and a verl PPO trainer under `federation.update: lora` (`lora.trained`) on the
    same policy and config, both holding the same random trained factors (and value head):
    adapters that move the model."""
    if not HAS_VERL:
        pytest.skip("verl not installed")
    federation = {"lora": {"rank": 4, "alpha": 8.0, "trained": trained}}
    made = [
        build(kind, model_dir, env_url, tmp_path_factory.mktemp("run"), algo=PPO, federation=federation)
        for kind in ("builtin-cpu-fp32-lora", "verl-lora")
    ]
    gen = torch.Generator().manual_seed(9)
    state = {
        m: {k: 0.05 * torch.randn(v.shape, generator=gen) for k, v in w.items()} for m, w in _state(made[0]).items()
    }
    for t in made:
        _load(t, state)
    try:
        yield tuple(made)
    finally:
        for t in made:
            t.close()


@pytest.fixture(scope="module")
def lora_pair(env_url, model_dir, tmp_path_factory):  # noqa: F811
    """B trained over a fixed A on every layer (`lora.trained: B`)."""
    yield from _lora_pair("B", env_url, model_dir, tmp_path_factory)


@pytest.fixture(scope="module")
def lora_pair_smaller(env_url, model_dir, tmp_path_factory):  # noqa: F811
    """A trained over a fixed B where it is the smaller factor (`lora.trained: smaller`)."""
    yield from _lora_pair("smaller", env_url, model_dir, tmp_path_factory)


def _policy_pass_pair(
    pair: tuple[RLTrainer, RLTrainer], rows, advantages, seed: int, mu: float = 0.0
) -> list[tuple[dict[str, torch.Tensor], dict[str, float]]]:
    """The same policy pass on both engines from the builtin's current weights."""
    start = pair[0].export_weights()
    out = []
    for t in pair:
        t.load_weights(start)
        anchor = FedProxAnchor.snapshot(t.engine.parameters("actor")) if mu else None
        t.engine.begin_fit(reference_from_policy=False)
        try:
            metrics = policy_pass(
                t.engine,
                t.policy_loss,
                rows,
                advantages,
                t.cfg.algo.mini_batch_size,
                seed,
                (lambda t=t, anchor=anchor: anchor.add_grad_(t.engine.parameters("actor"), mu))
                if anchor is not None
                else None,
            )
        finally:
            t.engine.end_fit()
            if anchor is not None:
                anchor.release()
        out.append((t.export_weights(), metrics))
        t.load_weights(start)
    return out


@needs_verl
def test_fresh_critics_and_row_scores_are_the_same_on_both_engines(pair):
    builtin, verl = pair
    assert builtin.members == verl.members == ("actor", "critic")
    for member in builtin.members:
        ours, theirs = builtin.export_weights(member), verl.export_weights(member)
        assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours), member
    _, rows = play(builtin, [0, 1, 2], 2, seed=3)
    for role in ("policy", "reference", "critic"):
        diffs = [
            float((a - b).abs().max()) for a, b in zip(builtin.engine.score(rows, role), verl.engine.score(rows, role))
        ]
        assert max(diffs) < TOL, role


@needs_verl
@pytest.mark.parametrize("pairing", ["pair", "lora_pair", "lora_pair_smaller"])
@pytest.mark.parametrize("mode,mu", [("windowed", 0.0), ("windowed", 0.3), ("concat", 0.0)])
def test_engines_take_the_same_policy_steps(request, pairing, mode, mu):
    """Several mini-batches (one ragged), micro-batching, KL, entropy, temperature 0.7, FedProx,
    and concat rows (observation glue masked mid-response): the same weights within 1e-5 (the
    full model, or under lora the adapters' B)."""
    pair = request.getfixturevalue(pairing)
    builtin = pair[0]
    saved = builtin.rollouts.settings
    builtin.rollouts.settings = dataclasses.replace(saved, mode=mode)
    try:
        _, rows, adv = scored_rows(builtin, [0, 1] if mode == "windowed" else [0, 1, 2], 2, seed=123)
    finally:
        builtin.rollouts.settings = saved
    assert len(rows) >= 5 and (mode == "concat" or len(rows) % 5), "want several mini-batches, a ragged one"
    assert mode != "concat" or any(0 in rw.mask for rw in rows)
    start = builtin.export_weights()
    (w_b, m_b), (w_v, m_v) = _policy_pass_pair(pair, rows, adv, derive_seed("minibatch", 0, 1, 3, 0), mu)
    print(
        f"\n{mode} mu={mu}: rows={len(rows)} max|dw|={_max_diff(w_b, start):.2e} "
        f"max|w_builtin - w_verl|={_max_diff(w_b, w_v):.2e}"
    )
    assert m_b["optimizer_steps"] == m_v["optimizer_steps"] >= 1
    assert _max_diff(w_b, start) > 100 * TOL  # the pass really moved the weights ...
    assert _max_diff(w_b, w_v) < TOL  # ... and both engines moved them alike
    for key in ("pg_loss", "kl_loss", "entropy", "grad_norm"):
        assert m_v[key] == pytest.approx(m_b[key], rel=1e-4, abs=1e-6), key


@needs_verl
@pytest.mark.parametrize("pairing", ["pair", "lora_pair", "lora_pair_smaller"])
def test_engines_take_the_same_critic_steps(request, pairing):
    builtin, verl = pair = request.getfixturevalue(pairing)
    episodes, rows, _ = scored_rows(builtin, [0, 1, 2, 3], 1, seed=11)
    values = builtin.engine.score(rows, "critic")
    _, returns = ADVANTAGES["gae"](episodes, rows, values, builtin.cfg.algo)
    old = [v + 0.3 * torch.linspace(-1, 1, len(v)) for v in values]  # the value clip binds
    start = builtin.export_weights("critic")
    ends, metrics = [], []
    for t in pair:
        t.load_weights(start, "critic")
        t.engine.begin_fit(reference_from_policy=False)
        try:
            metrics.append(critic_pass(t.engine, t.value_loss, rows, old, returns, 2, seed=7))
        finally:
            t.engine.end_fit()
        ends.append(t.export_weights("critic"))
        t.load_weights(start, "critic")
    assert metrics[0]["critic_optimizer_steps"] == metrics[1]["critic_optimizer_steps"] >= 2
    assert 0 < metrics[0]["critic_clipfrac"] < 1
    assert _max_diff(ends[0], start) > 100 * TOL and _max_diff(ends[0], ends[1]) < TOL
    assert metrics[1]["critic_loss"] == pytest.approx(metrics[0]["critic_loss"], rel=1e-4)


@needs_verl
@pytest.mark.parametrize("pairing", ["lora_pair", "lora_pair_smaller"])
def test_lora_engines_hold_the_same_adapters_and_either_s_b_merges_alike_in_the_other(request, pairing):
    """Same members and names, the same fixed factors' bits on every adapted layer, the same base
    digest; the trained factors exported by either engine load into the other and merge to the
    same bits (W + s B A, the weights a vLLM rollout is synced), and both score rows alike with
    them (1e-5), also as the reference of `algo.ref_anchor: round`."""
    builtin, verl = lora_pair = request.getfixturevalue(pairing)
    assert builtin.members == verl.members == ("actor", "critic")
    assert len(verl.base_sha256) == 64 and verl.base_sha256 == builtin.base_sha256
    models = {"actor": (builtin.engine.model, verl.engine.engine.module)}
    models["critic"] = (builtin.engine.critic, verl.engine.critic.engine.module)
    for member, (ours, theirs) in models.items():
        a_ours, a_theirs = dict(adapter_layers(ours)), dict(adapter_layers(theirs))
        assert a_ours.keys() == a_theirs.keys() and len(a_ours) == 7  # q k v o gate up down
        assert all(a_ours[n].trained == a_theirs[n].trained for n in a_ours), member
        assert all(torch.equal(getattr(a, a.fixed), getattr(a_theirs[n], a.fixed)) for n, a in a_ours.items()), member
        assert list(builtin.export_weights(member)) == list(verl.export_weights(member))
    _, rows = play(builtin, [0, 1, 2], 2, seed=5)
    gen = torch.Generator().manual_seed(31)
    for source, target in ((verl, builtin), (builtin, verl)):
        b = {k: 0.1 * torch.randn(v.shape, generator=gen) for k, v in source.export_weights().items()}
        source.load_weights(b)
        target.load_weights(source.export_weights())
        merged = [dict(t.engine.policy_tensors()) for t in (source, target)]
        assert merged[0].keys() == merged[1].keys() and not any(is_adapter(k) for k in merged[0])
        assert all(torch.equal(merged[0][k].cpu(), merged[1][k].cpu()) for k in merged[0])
        scores = [t.engine.score(rows, "policy") for t in (source, target)]
        assert max(float((x - y).abs().max()) for x, y in zip(*scores)) < TOL
        reference = builtin.engine.score(rows, "reference")  # the plain base: B moves the policy off it
        assert max(float((x - y).abs().max()) for x, y in zip(scores[0], reference)) > 100 * TOL
    # algo.ref_anchor: round copies the merged policy into each engine's plain reference
    state = _state(builtin)
    for t in lora_pair:
        t.engine.begin_fit(reference_from_policy=True)
        t.engine.end_fit()
    policy, *references = [builtin.engine.score(rows, "policy")] + [
        t.engine.score(rows, "reference") for t in lora_pair
    ]
    assert all(max(float((x - y).abs().max()) for x, y in zip(policy, ref)) < TOL for ref in references)
    zeros = {k: torch.zeros_like(v) for k, v in state["actor"].items()}  # B = 0: the base again, bit for bit
    for t in lora_pair:
        t.load_weights(zeros)
        t.engine.begin_fit(reference_from_policy=True)
        t.engine.end_fit()
        _load(t, state)


@needs_verl
def test_verl_lora_fit_steps_only_b_and_the_value_head(lora_pair, env_url, model_dir):  # noqa: F811
    """verl's optimizers hold exactly the exchanged tensors (B, + the critic's value head); a fit
    moves them and leaves the frozen base and A bit for bit, and a freshly built verl lane (a
    restarted node) given the same global fits to the same bits (resume stays exact)."""
    _, verl = lora_pair
    engine = verl.engine
    modules = {"actor": engine.engine.module, "critic": engine.critic.engine.module}

    def frozen(module: torch.nn.Module) -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().clone() for n, p in module.named_parameters() if not p.requires_grad}

    for member, fsdp in zip(modules, (engine.engine, engine.critic.engine)):
        trained = [p for _, p in engine.parameters(member)]
        assert (
            len(trained)
            == len(verl.export_weights(member))
            == sum(len(g["params"]) for g in fsdp.optimizer.param_groups)
        )
    start = _state(verl)
    base = {m: frozen(module) for m, module in modules.items()}
    a = {m: {n: layer.lora_A.clone() for n, layer in adapter_layers(module)} for m, module in modules.items()}
    call, tasks = FitCall(round=2, client_id=1, local_epochs=1, seed=3, proximal_mu=0.01), ClientTasks(TRAIN_TASKS)
    verl.fit(call, tasks)
    end = _state(verl)
    for member, module in modules.items():
        assert _changed(end[member], start[member]), member
        assert all(torch.equal(t, base[member][n]) for n, t in frozen(module).items()), member
        assert all(torch.equal(layer.lora_A, a[member][n]) for n, layer in adapter_layers(module)), member
    with closing(build("verl-lora", model_dir, env_url, algo=PPO)) as fresh:
        assert fresh.base_sha256 == verl.base_sha256
        _load(fresh, start)
        fresh.fit(call, tasks)
        assert not any(_changed(w, end[m]) for m, w in _state(fresh).items())
    _load(verl, start)


@needs_verl
def test_a_warm_started_base_digests_alike_on_both_engines_and_unlike_the_model_dir(model_dir, tmp_path):  # noqa: F811
    """`model.init_from` under lora is the frozen base on verl as on builtin: the policy with
    B = 0 is exactly the warm start, both engines give it one digest, and it is not the model
    directory's (so a lane on the other base is refused by the service's digest check)."""
    from client_app.models import hf_parameters

    gen = torch.Generator().manual_seed(4)
    warm = {k: v + 0.01 * torch.randn(v.shape, generator=gen) for k, v in hf_parameters(model_dir).items()}
    save_shards(warm, tmp_path / "warm", 1 << 20, durable=False)
    digests = []
    for kind, start in (("builtin-cpu-fp32-lora", True), ("verl-lora", True), ("verl-lora", False)):
        cfg = _config(kind, model_dir)
        if start:
            cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"init_from": str(tmp_path / "warm")})})
        with closing(RLTrainer(cfg, make_engine(cfg, model_dir), model_dir, None)) as t:
            digests.append(t.base_sha256)
            if start:
                policy = dict(t.engine.policy_tensors())
                assert all(torch.equal(policy[k].cpu(), w) for k, w in warm.items()), kind
    assert len(digests[0]) == 64 and digests[0] == digests[1] != digests[2]


@needs_verl
def test_verl_lm_head_sees_only_response_positions_and_trains_as_verl_scores(pair, monkeypatch):
    """verl's engine applies its LM head to the positions that predict a response token, no
    others (client_app/trainer/verl_head.py), and scores and trains exactly as verl's own full-
    logits path on the same engine: log-probs, entropy and a policy pass with KL and entropy."""
    from client_app.trainer.verl_head import engine_class

    builtin, verl = pair
    fsdp = verl.engine.engine
    assert isinstance(fsdp, engine_class()) and isinstance(verl.engine.ref.engine, engine_class())
    seen: list[tuple[int, ...]] = []
    hook = fsdp.module.get_output_embeddings().register_forward_hook(
        lambda _m, args, _out: seen.append(tuple(args[0].shape))
    )
    try:
        episodes, rows, adv = scored_rows(builtin, [0, 1], 2, seed=17)
        start = builtin.export_weights()
        verl.load_weights(start)

        def score_and_pass() -> tuple[list[torch.Tensor], dict[str, torch.Tensor], dict[str, float]]:
            seen.clear()
            scores = verl.engine.score(rows, "policy")
            verl.engine.begin_fit(reference_from_policy=False)
            try:
                # 4-row mini-batches: 2-row micro-batches (padded rows of unequal length)
                metrics = policy_pass(verl.engine, verl.policy_loss, rows, adv, 4, seed=21)
            finally:
                verl.engine.end_fit()
            weights = verl.export_weights()
            verl.load_weights(start)
            return scores, weights, metrics

        ours = score_and_pass()
        response_tokens = sum(len(rw.response_ids) for rw in rows)
        # every head call is [N, H]: the scoring pass, then the policy pass (which re-scores
        # old log-probs once, then trains), each over every row's response tokens exactly
        assert all(len(shape) == 2 for shape in seen), seen
        assert sum(shape[0] for shape in seen) == 3 * response_tokens
        for worker in (verl.engine.actor, verl.engine.ref):  # verl's own path, same engines
            monkeypatch.setattr(worker.engine, "score_response_only", False)
        theirs = score_and_pass()
        assert all(len(shape) == 3 for shape in seen) and sum(s[0] * s[1] for s in seen) > 2 * response_tokens
    finally:
        hook.remove()
    assert len(rows) > 5 and max(float((a - b).abs().max()) for a, b in zip(ours[0], theirs[0])) < TOL
    assert _max_diff(ours[1], start) > 100 * TOL and _max_diff(ours[1], theirs[1]) < TOL
    for key in ("pg_loss", "kl_loss", "entropy", "grad_norm"):
        assert ours[2][key] == pytest.approx(theirs[2][key], rel=1e-5, abs=1e-7), key


@needs_verl
@pytest.mark.parametrize(
    "loss_agg_mode,kl_type", [("seq-mean-token-mean", "k1"), ("seq-mean-token-sum-norm", "k3+"), ("token-sum", "abs")]
)
def test_every_loss_mode_and_kl_estimator_trains_alike_on_both_engines(
    env_url,
    model_dir,
    tmp_path,  # noqa: F811
    loss_agg_mode,
    kl_type,
):
    """`algo.loss_agg_mode` and `algo.kl_type` reach both engines' losses, and mean the same there."""
    algo = {"loss_agg_mode": loss_agg_mode, "kl_type": kl_type, "lr": 1e-4}
    made = [build(kind, model_dir, env_url, tmp_path / kind, algo=algo) for kind in ("builtin", "verl")]
    try:
        assert made[1].engine.actor_config.loss_agg_mode == loss_agg_mode
        assert made[1].engine.actor_config.kl_loss_type == kl_type
        _, rows, adv = scored_rows(made[0], [3, 4], 2, seed=8)
        # away from the reference: at policy == reference `abs`'s gradient is the sign of a
        # log-prob difference that is pure rounding noise (it differs between any two engines)
        gen = torch.Generator().manual_seed(2)
        made[0].load_weights(
            {k: v + 0.02 * torch.randn(v.shape, generator=gen) for k, v in made[0].export_weights().items()}
        )
        start = made[0].export_weights()
        (w_b, m_b), (w_v, m_v) = _policy_pass_pair(tuple(made), rows, adv, seed=4)
        assert _max_diff(w_b, start) > 10 * TOL and _max_diff(w_b, w_v) < TOL
        for key in ("pg_loss", "kl_loss"):
            assert m_v[key] == pytest.approx(m_b[key], rel=1e-4, abs=1e-7), key
    finally:
        for t in made:
            t.close()


# ================================================================ bf16 compute copy against fp32


@pytest.fixture(scope="module")
def precisions(env_url, model_dir, tmp_path_factory):  # noqa: F811
    """The builtin engine computing in fp32 and on a bf16 copy of fp32 masters, same policy."""
    made = [
        build(kind, model_dir, env_url, tmp_path_factory.mktemp("run"), algo=PPO)
        for kind in ("builtin-cpu-fp32", "builtin-cpu-bf16")
    ]
    try:
        yield tuple(made)
    finally:
        for t in made:
            t.close()


def _copy_matches_masters(t: RLTrainer) -> bool:
    """Every bf16 compute parameter is its fp32 master rounded to nearest, bit for bit, and every
    buffer of the copies and of the reference is the master's own, fp32 (a bf16 rotary `inv_freq`
    moves positions by up to p x 2^-9 radians)."""
    e = t.engine
    params = all(
        c.dtype == torch.bfloat16 and torch.equal(c, m.to(torch.bfloat16))
        for member in t.members
        for m, c in zip(e._compute[member].masters, e._compute[member].copies)
    )
    pairs = [(e.model, e._compute["actor"].module), (e.critic, e._compute["critic"].module), (e.model, e.ref)]
    buffers = all(
        dict(master.named_buffers()).keys() == dict(other.named_buffers()).keys()
        and all(
            b.dtype == torch.float32 and torch.equal(b, dict(other.named_buffers())[n])
            for n, b in master.named_buffers()
        )
        for master, other in pairs
    )
    return params and buffers


def test_the_bf16_compute_copy_steps_like_fp32_and_its_masters_keep_small_updates(precisions):
    """The bf16 mode trains the fp32 masters: its policy pass lands where fp32's does up to bf16
    rounding (far closer than a reshuffle of fp32's own mini-batches moves it), the copy is the
    masters rounded after every step, and an update far below bf16's resolution still moves
    the masters (a bf16 model would drop it: the reason the masters exist)."""
    fp32, bf16 = precisions
    assert bf16.engine.precision == "bf16" and fp32.engine.precision == "fp32"
    assert _copy_matches_masters(bf16)
    assert all(p.dtype == torch.float32 for m in bf16.members for _, p in bf16.engine.parameters(m))
    _, rows, adv = scored_rows(fp32, [5, 6, 7], 2, seed=21)
    start = fp32.export_weights()
    (w32, m32), (w16, m16) = _policy_pass_pair(precisions, rows, adv, seed=3)
    (w32b, _), _ = _policy_pass_pair(precisions, rows, adv, seed=4)  # fp32, mini-batches reshuffled
    moved = _max_diff(w32, start)
    off, reshuffled = _max_diff(w16, w32) / moved, _max_diff(w32b, w32) / moved
    print(f"\nmax|dw|={moved:.2e}; max|w - w_fp32| / max|dw|: bf16 {off:.3f}, fp32 reshuffled {reshuffled:.3f}")
    assert moved > 100 * TOL and m16["optimizer_steps"] == m32["optimizer_steps"] >= 2
    assert off < 0.5 * reshuffled
    assert m16["pg_loss"] == pytest.approx(m32["pg_loss"], rel=0.05, abs=1e-4)
    # an update 1,000x below bf16's resolution: the masters move, the copy (rounded) may not
    saved = bf16.engine.cfg
    bf16.engine.cfg = saved.model_copy(update={"algo": saved.algo.model_copy(update={"lr": 1e-9})})
    try:
        bf16.load_weights(start)
        bf16.engine.begin_fit(reference_from_policy=False)
        policy_pass(bf16.engine, bf16.policy_loss, rows, adv, bf16.cfg.algo.mini_batch_size, seed=3)
        bf16.engine.end_fit()
        tiny_step = bf16.export_weights()
        assert _changed(tiny_step, start) and _max_diff(tiny_step, start) < 1e-6
        assert _copy_matches_masters(bf16)
    finally:
        bf16.engine.cfg = saved
        bf16.load_weights(start)
