"""The builtin trainer: weight exchange (invariant 1), a fresh optimizer per fit (3), FedProx on
the policy only (4), validation never penalised (10), flat memory across fits (24), and clear
errors for unusable model directories. Real env service, real (random-weight) Qwen2 policy, real fits on CPU."""
from __future__ import annotations

import gc
import json
import shutil
from collections.abc import Callable

import psutil
import pytest
import torch
from transformers import DistilBertConfig

from client_app.algos import FedProxAnchor
from client_app.rollout import group_specs, run_episodes, training_rows
from client_app.tiny_model import ModelDirError
from client_app.trainer.base import EvalRequest, FitRequest
from client_app.trainer.builtin import BuiltinTrainer, avoid_cudnn_attention
from trainer_support import (SMALL_ENV_PARAMS, env_url, model_dir, one_torch_thread,  # noqa: F401
                             random_model_dir, small_config)

TRAIN_TASKS = list(range(SMALL_ENV_PARAMS["val_size"], SMALL_ENV_PARAMS["num_goals"]))


@pytest.fixture(scope="module")
def trainer(env_url, model_dir):
    t = BuiltinTrainer(small_config(model_dir), env_url)
    try:
        yield t
    finally:
        t.close()


@pytest.fixture(scope="module")
def initial(trainer) -> dict[str, torch.Tensor]:
    return trainer.export_weights()


def _live(cls: type) -> list:
    """Every live object of exactly this class (type() check: isinstance trips lazy modules)."""
    gc.collect()
    return [o for o in gc.get_objects() if type(o) is cls]


def test_load_then_export_is_bitwise_identity(trainer, initial):
    gen = torch.Generator().manual_seed(0)
    weights = {k: torch.randn(v.shape, generator=gen) * 0.05 for k, v in initial.items()}
    for w in weights.values():
        w.view(-1)[0] = 1.0 + 2.0 ** -20          # not representable in bf16
    live = {k: (p, p.data_ptr()) for k, p in trainer.params.items()}
    try:
        trainer.load_weights(weights)
        out = trainer.export_weights()
        assert out.keys() == weights.keys()
        for k, w in weights.items():
            assert out[k].dtype == torch.float32 and out[k].device.type == "cpu"
            assert torch.equal(out[k].view(torch.int32), w.view(torch.int32)), k
            p, ptr = live[k]
            assert trainer.params[k] is p and p.data_ptr() == ptr, f"{k} was replaced, not copied into"
            assert out[k].data_ptr() != p.data_ptr()
        out[k].add_(1.0)                           # an export is a copy, not a view of the model
        assert torch.equal(trainer.params[k].detach(), w)
        # what cannot be loaded fails with a message naming the problem
        name = next(iter(weights))
        with pytest.raises(KeyError, match="missing"):
            trainer.load_weights({k: v for k, v in weights.items() if k != name})
        with pytest.raises(KeyError, match="unexpected"):
            trainer.load_weights({**weights, "extra.weight": torch.zeros(1)})
        with pytest.raises(ValueError, match="shape"):
            trainer.load_weights({**weights, name: torch.zeros(3, 3)})
        with pytest.raises(TypeError, match="fp32"):
            trainer.load_weights({**weights, name: weights[name].bfloat16()})
    finally:
        trainer.load_weights(initial)


def test_fresh_optimizer_per_fit(trainer, initial):
    """Two fits from the same weights with the same request end bit-identical: no optimizer
    state (moments, step count) survives a fit. And the optimizer is gone afterwards."""
    req = FitRequest(round=1, client_id=3, task_indices=TRAIN_TASKS, local_epochs=2, seed=0)
    trainer.load_weights(initial)
    first = trainer.fit(req)
    a = trainer.export_weights()
    trainer.load_weights(initial)
    second = trainer.fit(req)
    b = trainer.export_weights()
    trainer.load_weights(initial)
    assert any(not torch.equal(a[k], initial[k]) for k in a), "the fit must change the weights"
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert first.num_examples == second.num_examples == 2 * 2 * 2   # E x tasks_per_step x group_size
    assert first.metrics["optimizer_steps"] >= 1 and first.metrics["update_s"] > 0
    assert not _live(torch.optim.AdamW)
    assert all(p.grad is None for p in trainer.params.values())


def test_fedprox_applied_to_policy_only(trainer, initial):
    """On a fixed batch, mu > 0 changes the policy gradient by exactly mu * (w - w_anchor) and
    touches nothing else; the anchor is released when the fit ends."""
    trainer.load_weights(initial)
    episodes, _ = run_episodes(trainer.generator, trainer.env, group_specs([20, 21], 2), trainer.settings, 1.0,
                               seed=0, max_sessions=trainer.max_sessions)
    rows = training_rows(episodes, 0.1)
    adv = trainer.episode_advantages(episodes, rows)
    anchor = FedProxAnchor.snapshot(trainer.model.named_parameters())
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():                       # the policy has moved away from the round's weights
        for p in trainer.params.values():
            p.add_(torch.randn(p.shape, generator=gen) * 0.01)
    old = trainer.row_log_probs(trainer.model, rows)
    ref = trainer.row_log_probs(trainer.ref, rows)
    ref_before = {k: p.detach().clone() for k, p in trainer.ref.named_parameters()}
    idx = list(range(len(rows)))
    mu = 0.5
    try:
        trainer.accumulate_gradients(rows, adv, old, ref, idx, None, 0.0)
        plain = {k: p.grad.clone() for k, p in trainer.params.items()}
        for p in trainer.params.values():
            p.grad = None
        trainer.accumulate_gradients(rows, adv, old, ref, idx, anchor, mu)
        for k, p in trainer.params.items():
            expected = mu * (p.detach() - anchor.tensors[k])
            assert expected.abs().max() > 0
            torch.testing.assert_close(p.grad - plain[k], expected, rtol=1e-4, atol=1e-7)
        for k, p in trainer.ref.named_parameters():
            assert p.grad is None and torch.equal(p.detach(), ref_before[k]), f"reference {k} was touched"
    finally:
        for p in trainer.params.values():
            p.grad = None
        anchor.release()
        trainer.load_weights(initial)
    trainer.fit(FitRequest(round=1, client_id=1, task_indices=TRAIN_TASKS, local_epochs=1, seed=0, proximal_mu=0.1))
    trainer.load_weights(initial)
    assert all(a.released for a in _live(FedProxAnchor))


def test_micro_batches_do_not_change_the_gradient(trainer, initial):
    trainer.load_weights(initial)
    episodes, _ = run_episodes(trainer.generator, trainer.env, group_specs([30, 31], 2), trainer.settings, 1.0,
                               seed=5, max_sessions=trainer.max_sessions)
    rows = training_rows(episodes, 0.1)
    adv = [a + 0.3 * (k % 3 - 1) for k, a in enumerate(trainer.episode_advantages(episodes, rows))]
    old = [lp - 0.05 for lp in trainer.row_log_probs(trainer.model, rows)]   # ratios != 1
    ref = trainer.row_log_probs(trainer.ref, rows)
    grads = []
    saved = trainer.cfg.algo.micro_batch_size
    try:
        for micro in (1, len(rows)):
            trainer.cfg.algo.micro_batch_size = micro
            trainer.accumulate_gradients(rows, adv, old, ref, list(range(len(rows))), None, 0.0)
            grads.append({k: p.grad.clone() for k, p in trainer.params.items()})
            for p in trainer.params.values():
                p.grad = None
    finally:
        trainer.cfg.algo.micro_batch_size = saved
    for k in grads[0]:
        torch.testing.assert_close(grads[0][k], grads[1][k], rtol=1e-4, atol=1e-7)


def test_right_padded_batch_scores_each_row_as_if_alone(trainer, initial):
    """`_response_hidden` runs without an attention mask (rows are right-padded): a row's
    log-probs in a batch of longer and shorter rows must equal the row scored on its own."""
    trainer.load_weights(initial)
    episodes, _ = run_episodes(trainer.generator, trainer.env, group_specs([40, 41], 2), trainer.settings, 1.0,
                               seed=9, max_sessions=trainer.max_sessions)
    rows = training_rows(episodes, 0.1)
    assert len({len(r.prompt_ids) + len(r.response_ids) for r in rows}) > 1, "need rows of different lengths"
    batched = trainer.row_log_probs(trainer.model, rows)
    saved = trainer.cfg.algo.micro_batch_size
    try:
        trainer.cfg.algo.micro_batch_size = 1
        alone = trainer.row_log_probs(trainer.model, rows)
    finally:
        trainer.cfg.algo.micro_batch_size = saved
    for b, a in zip(batched, alone):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-5)


@pytest.fixture(scope="module")
def concat_trainer(env_url, model_dir):
    t = BuiltinTrainer(small_config(model_dir, rollout={"mode": "concat"}), env_url)
    try:
        yield t
    finally:
        t.close()


@pytest.mark.parametrize("mode", ["windowed", "concat"])
def test_validation_rows_never_penalised(mode, request, initial):
    """Invariant 10 in both rollout modes (field log 2026-07-28: concat mode penalised validation)."""
    trainer = request.getfixturevalue("trainer" if mode == "windowed" else "concat_trainer")
    assert trainer.settings.mode == mode
    trainer.load_weights(initial)
    req = EvalRequest(task_indices=list(range(8)), seed=0)
    saved = trainer.cfg.rollout.invalid_action_penalty
    try:
        trainer.cfg.rollout.invalid_action_penalty = 0.0
        plain = trainer.evaluate(req)
        trainer.cfg.rollout.invalid_action_penalty = 5.0
        penalised = trainer.evaluate(req)
    finally:
        trainer.cfg.rollout.invalid_action_penalty = saved
    keys = ("success", "reward", "turns", "invalid_action_rate")
    assert plain.metrics["invalid_action_rate"] > 0, "the penalty must have had something to act on"
    assert {k: plain.metrics[k] for k in keys} == {k: penalised.metrics[k] for k in keys}
    assert 0.0 <= penalised.metrics["reward"] <= 1.0 and plain.num_examples == 8


def _fit_rss_series(trainer, initial: dict[str, dict[str, torch.Tensor]], fits: int,
                    also: Callable[[], None] = lambda: None) -> list[float]:
    """RSS (MB) at one phase point (after export) of consecutive fits of different clients; `also`
    records anything else at that point."""
    proc = psutil.Process()
    series = []
    for i in range(fits):
        for member, state in initial.items():
            trainer.load_weights(state, member)
        shard = TRAIN_TASKS[(7 * i) % 50:][:40]
        trainer.fit(FitRequest(round=1 + i // 2, client_id=i, task_indices=shard, local_epochs=1, seed=0,
                               proximal_mu=0.01))
        exported = [trainer.export_weights(m) for m in trainer.members]
        del exported
        series.append(proc.memory_info().rss / 2**20)
        also()
    return series


def _initial(trainer) -> tuple[dict[str, dict[str, torch.Tensor]], float]:
    """Every member's weights, and the policy's size in MB (a leak of one copy of it per fit)."""
    initial = {m: trainer.export_weights(m) for m in trainer.members}
    return initial, sum(t.numel() * 4 for t in initial["actor"].values()) / 2**20


@pytest.fixture(scope="module", params=["grpo", "ppo"])
def wide_trainer(request, env_url, tmp_path_factory):
    """A model large enough (~8 MB of fp32 weights, ~24 MB with AdamW moments) that leaking one
    copy of anything per fit stands far above allocator noise; with PPO, a critic as large beside it."""
    wide = random_model_dir(tmp_path_factory.mktemp("models") / "wide", hidden_size=256, layers=2, heads=4)
    t = BuiltinTrainer(small_config(wide, env={"max_turns": 2}, rollout={"max_prompt_tokens": 128},
                                    algo={"name": request.param, "group_size": 2 if request.param == "grpo" else 1}),
                       env_url)
    try:
        yield t
    finally:
        t.close()


def _assert_flat(series: list[float], warmup: int, model_mb: float) -> float:
    steady = series[warmup:]
    per_fit = (steady[-1] - steady[0]) / (len(steady) - 1)
    print(f"RSS after export per fit (MB): {[round(x, 1) for x in series]}; slope {per_fit:.2f} MB/fit")
    assert per_fit < 0.25 * model_mb, f"RSS grows {per_fit:.1f} MB per fit (model is {model_mb:.1f} MB)"
    return per_fit


def test_rss_flat_across_5_fits(wide_trainer):
    initial, model_mb = _initial(wide_trainer)
    _assert_flat(_fit_rss_series(wide_trainer, initial, 5), warmup=2, model_mb=model_mb)


@pytest.mark.slow
def test_rss_flat_across_20_fits(wide_trainer):
    initial, model_mb = _initial(wide_trainer)
    _assert_flat(_fit_rss_series(wide_trainer, initial, 20), warmup=4, model_mb=model_mb)


# ---------------------------------------------------------------- unusable model directories

def test_missing_model_dir_fails_clearly(tmp_path):
    with pytest.raises(ModelDirError, match="does not exist"):
        BuiltinTrainer(small_config(tmp_path / "no-such-model"), "http://127.0.0.1:9")


def test_non_causal_lm_dir_fails_clearly(tmp_path):
    DistilBertConfig().save_pretrained(tmp_path)
    with pytest.raises(ModelDirError, match="not a causal language model"):
        BuiltinTrainer(small_config(tmp_path), "http://127.0.0.1:9")


def test_tokenizer_without_chat_template_fails_clearly(tmp_path, model_dir):
    dst = tmp_path / "no-template"
    shutil.copytree(model_dir, dst)
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg = json.loads((dst / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    with pytest.raises(ModelDirError, match="no chat template"):
        BuiltinTrainer(small_config(dst), "http://127.0.0.1:9")


@pytest.mark.gpu
def test_cuda_fit_keeps_fp32_master_weights(env_url, model_dir):
    """On CUDA: bf16 autocast for compute, fp32 master weights exported bit for bit, a real fit."""
    t = BuiltinTrainer(small_config(model_dir, run={"device": "cuda"}), env_url)
    try:
        assert t.device.type == "cuda" and t.amp_dtype == torch.bfloat16
        initial = t.export_weights()
        assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in initial.values())
        res = t.fit(FitRequest(round=1, client_id=0, task_indices=TRAIN_TASKS, local_epochs=2, seed=0, proximal_mu=0.01))
        assert res.num_examples == 8 and res.metrics["optimizer_steps"] >= 2 and res.metrics["skipped_steps"] == 0
        trained = t.export_weights()
        assert all(p.dtype == torch.float32 for p in t.params.values())
        assert any(not torch.equal(trained[k], initial[k]) for k in initial)
        t.load_weights(initial)
        assert all(torch.equal(a.view(torch.int32), b.view(torch.int32))
                   for a, b in zip(t.export_weights().values(), initial.values()))
        ev = t.evaluate(EvalRequest(task_indices=list(range(8)), seed=0))
        assert ev.num_examples == 8 and 0.0 <= ev.metrics["success"] <= 1.0 and ev.metrics["turns"] >= 1
        assert torch.cuda.memory_allocated() > 0
    finally:
        t.close()


def test_cuda_lanes_take_cudnn_out_of_attention():
    """Invariant 24 on CUDA: cuDNN attention caches a plan per new shape in host memory (RSS grew
    ~120 MB per fit on an H200), so a CUDA trainer switches it off; a CPU trainer leaves torch alone."""
    saved = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        avoid_cudnn_attention(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        avoid_cudnn_attention(torch.device("cuda"))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(saved)


@pytest.mark.gpu
def test_cuda_rss_and_allocated_memory_flat_across_12_fits(env_url, model_dir):
    """Invariant 24 on CUDA, at the phase point after export: host RSS (where cuDNN's per-shape
    attention plans piled up) and current allocated device memory."""
    t = BuiltinTrainer(small_config(model_dir, run={"device": "cuda"}), env_url)
    try:
        initial, _ = _initial(t)
        allocated: list[float] = []
        series = _fit_rss_series(t, initial, 12,
                                 also=lambda: allocated.append(torch.cuda.memory_allocated() / 2**20))
        steady = series[3:]
        per_fit = (steady[-1] - steady[0]) / (len(steady) - 1)
        print(f"CUDA lane RSS per fit (MB): {[round(x, 1) for x in series]}; allocated {allocated}")
        assert per_fit < 10.0, f"host RSS grows {per_fit:.1f} MB per fit on CUDA"
        assert max(allocated[3:]) - min(allocated[3:]) < 1.0, f"allocated device memory moves: {allocated}"
    finally:
        t.close()
