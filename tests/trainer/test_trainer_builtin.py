"""The builtin training engine's own properties (the engine contract, shared with verl, is
tests/trainer/test_engine_contract.py): clear errors for unusable model directories, and on CUDA fp32
master weights, cuDNN attention off and flat host and device memory (invariant 24). Real env
service, real (random-weight) Qwen2 policy, real fits."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from trainer_support import (  # noqa: F401
    SMALL_ENV_PARAMS,
    env_url,
    fit_rss_series,
    initial_and_size,
    model_dir,
    one_torch_thread,
    small_config,
)
from transformers import DistilBertConfig

from client_app.tiny_model import ModelDirError
from client_app.trainer import make_trainer
from client_app.trainer.base import ClientTasks
from client_app.trainer.builtin import BuiltinEngine
from client_app.trainer.device import avoid_cudnn_attention
from fl_app.calls import EvalCall, FitCall

TRAIN_TASKS = list(range(SMALL_ENV_PARAMS["val_size"], SMALL_ENV_PARAMS["num_goals"]))


# ---------------------------------------------------------------- unusable model directories


def test_missing_model_dir_fails_clearly(tmp_path):
    with pytest.raises(ModelDirError, match="does not exist"):
        BuiltinEngine(small_config(tmp_path / "no-such-model"), tmp_path / "no-such-model")


def test_non_causal_lm_dir_fails_clearly(tmp_path):
    DistilBertConfig().save_pretrained(tmp_path)
    with pytest.raises(ModelDirError, match="not a causal language model"):
        BuiltinEngine(small_config(tmp_path), tmp_path)


def test_tokenizer_without_chat_template_fails_clearly(tmp_path, model_dir):
    dst = tmp_path / "no-template"
    shutil.copytree(model_dir, dst)
    (dst / "chat_template.jinja").unlink(missing_ok=True)
    tok_cfg = json.loads((dst / "tokenizer_config.json").read_text())
    tok_cfg.pop("chat_template", None)
    (dst / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    with pytest.raises(ModelDirError, match="no chat template"):
        BuiltinEngine(small_config(dst), dst)


# ---------------------------------------------------------------- CUDA


@pytest.mark.gpu
def test_cuda_fit_keeps_fp32_master_weights(env_url, model_dir):
    """On CUDA: the bf16 compute copy (run.precision auto), fp32 master weights exported bit for
    bit, a real fit."""
    t = make_trainer(small_config(model_dir, run={"device": "cuda"}), env_url)
    try:
        assert t.engine.device.type == "cuda" and t.engine.precision == "bf16" and t.engine.amp_dtype is None
        initial = t.export_weights()
        assert all(v.dtype == torch.float32 and v.device.type == "cpu" for v in initial.values())
        res = t.fit(FitCall(round=1, client_id=0, local_epochs=2, seed=0, proximal_mu=0.01), ClientTasks(TRAIN_TASKS))
        assert res.num_examples == 8 and res.metrics["optimizer_steps"] >= 2 and res.metrics["skipped_steps"] == 0
        trained = t.export_weights()
        assert all(p.dtype == torch.float32 for _, p in t.engine.parameters("actor"))
        assert any(not torch.equal(trained[k], initial[k]) for k in initial)
        t.load_weights(initial)
        assert all(
            torch.equal(a.view(torch.int32), b.view(torch.int32))
            for a, b in zip(t.export_weights().values(), initial.values())
        )
        ev = t.evaluate(EvalCall(seed=0), list(range(8)))
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
    t = make_trainer(small_config(model_dir, run={"device": "cuda"}), env_url)
    try:
        initial, _ = initial_and_size(t)
        allocated: list[float] = []
        series = fit_rss_series(t, initial, 12, also=lambda: allocated.append(torch.cuda.memory_allocated() / 2**20))
        steady = series[3:]
        per_fit = (steady[-1] - steady[0]) / (len(steady) - 1)
        print(f"CUDA lane RSS per fit (MB): {[round(x, 1) for x in series]}; allocated {allocated}")
        assert per_fit < 10.0, f"host RSS grows {per_fit:.1f} MB per fit on CUDA"
        assert max(allocated[3:]) - min(allocated[3:]) < 1.0, f"allocated device memory moves: {allocated}"
    finally:
        t.close()
