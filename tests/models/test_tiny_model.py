"""The embedded default model: deterministic cached build, loadability, warm-start quality, and
the loader's errors for directories that cannot serve as a policy."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DistilBertConfig

from client_app import prompts
from client_app.sft import SHORTCUT_ACTION, collect_demonstrations, sft_batch
from client_app.tiny_model import (
    ModelDirError,
    build_tiny_model,
    cache_key,
    load_causal_lm,
    tokenizer_corpus,
    train_tokenizer,
    whole_tokens,
)
from envs.registry import make_env, system_prompt
from fl_app.config import EnvCfg, RolloutCfg, TinyModelCfg, load_config
from fl_app.host import usable_cores

# A reduced build: same code path as the default, seconds instead of minutes.
SMALL_ENV = EnvCfg(
    params={"num_products": 300, "num_goals": 120, "val_size": 16, "search_return_n": 50, "seed": 0}, max_turns=8
)
SMALL_ROLLOUT = RolloutCfg(max_prompt_tokens=384)


def small_tiny(cache_dir: Path, **over) -> TinyModelCfg:
    base = dict(
        hidden_size=32, layers=1, heads=2, vocab_size=300, sft_episodes=6, sft_epochs=1, cache_dir=str(cache_dir)
    )
    return TinyModelCfg(**(base | over))


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(small_tiny(tmp_path_factory.mktemp("cache")), SMALL_ENV, SMALL_ROLLOUT)


def test_tiny_model_build_is_deterministic(tiny_dir, tmp_path):
    other = build_tiny_model(small_tiny(tmp_path / "other-cache"), SMALL_ENV, SMALL_ROLLOUT)
    assert other != tiny_dir and other.name == tiny_dir.name
    for name in ("model.safetensors", "tokenizer.json", "config.json", "tiny_model.json"):
        assert (other / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    reseeded = build_tiny_model(small_tiny(tmp_path / "other-cache", seed=1), SMALL_ENV, SMALL_ROLLOUT)
    assert reseeded.name != tiny_dir.name
    assert (reseeded / "model.safetensors").read_bytes() != (tiny_dir / "model.safetensors").read_bytes()


def test_tiny_model_bits_do_not_depend_on_the_machines_load(tiny_dir, tmp_path):
    """The build's thread count follows the usable cores, never the load: on some CPUs the count
    changes the bits (Intel Xeon: MKL splits weight-gradient reductions across threads), so a
    build beside busy processes must use the count an idle machine uses and give the same model."""
    import client_app.sft as sft

    idle_threads = sft.build_threads()
    burners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(usable_cores())]
    try:
        time.sleep(0.5)
        assert sft.build_threads() == idle_threads
        busy = build_tiny_model(small_tiny(tmp_path / "busy"), SMALL_ENV, SMALL_ROLLOUT)
    finally:
        for b in burners:
            b.kill()
            b.wait()
    assert (busy / "model.safetensors").read_bytes() == (tiny_dir / "model.safetensors").read_bytes()
    built_on = json.loads((busy / "tiny_model.json").read_text())["built_on"]  # what the bits depend on
    assert built_on["torch_threads"] == idle_threads and built_on["cpu"] and built_on["cpu_capability"]


def test_tiny_model_loads_as_plain_hugging_face_dir(tiny_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_dir)
    tok = AutoTokenizer.from_pretrained(tiny_dir)
    assert model.config.model_type == "qwen2" and model.config.tie_word_embeddings
    assert model.config.num_key_value_heads == model.config.num_attention_heads // 2
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert "<|im_start|>" in tok.chat_template and tok.eos_token == "<|im_end|>"
    assert model.generation_config.eos_token_id == tok.convert_tokens_to_ids("<|im_end|>")
    env = make_env(SMALL_ENV.name, **SMALL_ENV.params)
    assert len(tok) <= 300 + len(whole_tokens(env)) and model.config.vocab_size == len(tok)
    # product ids are single tokens, as shown on a page and as typed in an action
    asin = env.product_ids()[0]
    assert len(tok(f"'{asin}'", add_special_tokens=False)["input_ids"]) == 3
    assert [tok.decode([i]) for i in tok(f"click[{asin.lower()}]", add_special_tokens=False)["input_ids"]][-2:] == [
        asin.lower(),
        "]",
    ]
    # a real forward pass on a real windowed prompt
    msgs = prompts.build_messages(
        "buy a red mug", [], "Search", ["search[<query>]"], history_length=2, system_prompt=system_prompt("shop")
    )
    ids = torch.tensor([prompts.prompt_ids(tok, msgs, SMALL_ROLLOUT.max_prompt_tokens)])
    with torch.no_grad():
        logits = model(input_ids=ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok)) and torch.isfinite(logits).all()


def test_saved_tokenizer_tokenizes_like_the_one_sft_trained_with(tiny_dir):
    """Invariant 15 across a save/load: AutoTokenizer rebuilds a qwen2 tokenizer from vocab+merges
    with its own pipeline, so the ids a rollout generates from must equal the ids SFT trained on."""
    tiny = small_tiny(tiny_dir.parent)
    demos = collect_demonstrations(
        SMALL_ENV, SMALL_ROLLOUT.history_length, tiny.sft_episodes, tiny.sft_noise, tiny.seed, tiny.sft_shortcut
    )
    trained = train_tokenizer(
        tokenizer_corpus(demos), tiny.vocab_size, whole_tokens(make_env(SMALL_ENV.name, **SMALL_ENV.params))
    )
    loaded = AutoTokenizer.from_pretrained(tiny_dir)
    assert type(loaded).__name__ == "Qwen2Tokenizer" and loaded.get_vocab() == trained.get_vocab()
    for d in demos:
        assert prompts.prompt_ids(loaded, d.messages, SMALL_ROLLOUT.max_prompt_tokens) == prompts.prompt_ids(
            trained, d.messages, SMALL_ROLLOUT.max_prompt_tokens
        )
        assert prompts.response_ids(loaded, d.action) == prompts.response_ids(trained, d.action)
    prices = "'$1,234.56', '$20.99 to $30.99', 'B0MO3DOXRL', 'café'"
    assert loaded(prices)["input_ids"] == trained(prices)["input_ids"]


def test_build_is_cached_and_says_where(tiny_dir, caplog):
    with caplog.at_level(logging.INFO, logger="client_app.sft"):
        again = build_tiny_model(small_tiny(tiny_dir.parent), SMALL_ENV, SMALL_ROLLOUT)
    assert again == tiny_dir
    assert f"tiny model: cached at {tiny_dir}" in caplog.text
    assert not [p for p in tiny_dir.parent.iterdir() if ".building-" in p.name]


def test_cache_key_follows_what_the_weights_depend_on(tmp_path):
    tiny = small_tiny(tmp_path)
    key = cache_key(tiny, SMALL_ENV, SMALL_ROLLOUT)
    assert key == cache_key(small_tiny(tmp_path / "elsewhere"), SMALL_ENV, SMALL_ROLLOUT)  # not the location
    assert key == cache_key(tiny, SMALL_ENV, SMALL_ROLLOUT.model_copy(update={"temperature": 0.5}))
    assert key != cache_key(tiny, SMALL_ENV, SMALL_ROLLOUT.model_copy(update={"history_length": 1}))
    assert key != cache_key(small_tiny(tmp_path, sft_noise=0.2), SMALL_ENV, SMALL_ROLLOUT)
    env2 = SMALL_ENV.model_copy(update={"params": SMALL_ENV.params | {"seed": 1}})
    assert key != cache_key(tiny, env2, SMALL_ROLLOUT)


def test_concurrent_builds_produce_one_directory(tmp_path, caplog):
    tiny = small_tiny(tmp_path, sft_episodes=2)
    results: list[Path] = []
    with caplog.at_level(logging.INFO, logger="client_app.sft"):
        threads = [
            threading.Thread(target=lambda: results.append(build_tiny_model(tiny, SMALL_ENV, SMALL_ROLLOUT)))
            for _ in range(2)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(results) == 2 and results[0] == results[1]
    assert caplog.text.count("tiny model: built in") == 1 and caplog.text.count("tiny model: cached at") == 1
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [results[0].name]


def test_demonstrations_use_training_tasks_and_noise_the_given_fraction():
    env = make_env(SMALL_ENV.name, **SMALL_ENV.params)
    clean = collect_demonstrations(SMALL_ENV, 2, episodes=20, noise=0.0, seed=0)
    assert all(d.task >= env.val_size for d in clean)
    assert all(d.action == d.expert for d in clean)
    noisy = collect_demonstrations(SMALL_ENV, 2, episodes=40, noise=0.5, seed=0)
    changed = sum(d.action != d.expert for d in noisy) / len(noisy)
    assert 0.3 < changed < 0.7
    assert all(d.task >= env.val_size for d in noisy)
    # the last message always shows the admissible actions of the state the action was taken in
    assert all("Your admissible actions of the current situation are: [" in d.messages[-1]["content"] for d in noisy)


def test_shortcut_episodes_buy_without_choosing_the_goal_options():
    env = make_env(SMALL_ENV.name, **SMALL_ENV.params)
    hasty = collect_demonstrations(SMALL_ENV, 2, episodes=20, noise=0.0, seed=0, shortcut=1.0)
    option_turns = [
        d
        for d in hasty
        if d.expert not in (SHORTCUT_ACTION, "click[< prev]") and "Buy Now" in d.messages[-1]["content"]
    ]
    assert option_turns, "no demonstrated turn where the expert would have chosen an option"
    assert all(d.action == SHORTCUT_ACTION for d in option_turns)
    assert all(d.action == d.expert for d in hasty if d not in option_turns)  # the rest is the expert
    # a shortcut costs reward on a goal with options: replay one such episode (turn 0 has no history)
    starts = [i for i, d in enumerate(hasty) if len(d.messages) == 2] + [len(hasty)]
    episode = next(hasty[a:b] for a, b in zip(starts, starts[1:]) if option_turns[0] in hasty[a:b])
    env.reset(episode[0].task)
    for d in episode:
        _obs, reward, done, _info = env.step(d.action)
    assert done and reward < 1.0
    assert collect_demonstrations(SMALL_ENV, 2, episodes=20, noise=0.0, seed=0, shortcut=0.0) == collect_demonstrations(
        SMALL_ENV, 2, episodes=20, noise=0.0, seed=0
    )


def test_sft_loss_targets_only_reply_tokens():
    rows = [([5, 6, 7], [8, 9]), ([5, 6], [10, 11, 12])]
    ids, mask, targets = sft_batch(rows, pad_id=0)
    assert ids.tolist() == [[5, 6, 7, 8, 9], [5, 6, 10, 11, 12]]
    assert mask.tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 1]]
    assert targets.tolist() == [[-100, -100, 8, 9, -100], [-100, 10, 11, 12, -100]]
    ids, mask, targets = sft_batch([([5], [8]), ([5, 6, 7], [8, 9])], pad_id=0)
    assert ids[0].tolist() == [5, 8, 0, 0, 0] and mask[0].tolist() == [1, 1, 0, 0, 0]
    assert targets[0].tolist() == [8, -100, -100, -100, -100]


def test_load_causal_lm_returns_fp32_policy(tiny_dir):
    model, tok = load_causal_lm(str(tiny_dir), "cpu")
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert tok.pad_token_id is not None and tok.eos_token_id is not None and not model.training


def test_load_causal_lm_missing_dir_names_it_and_the_fix(tmp_path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelDirError, match=r"no-such-model does not exist.*model\.path.*tiny"):
        load_causal_lm(missing, "cpu")


def test_load_causal_lm_rejects_non_causal_lm_config(tmp_path):
    DistilBertConfig().save_pretrained(tmp_path)
    with pytest.raises(ModelDirError, match=r"'distilbert'.*not a causal language model"):
        load_causal_lm(tmp_path, "cpu")


def test_load_causal_lm_rejects_tokenizer_without_chat_template(tiny_dir, tmp_path):
    bare = tmp_path / "bare"
    shutil.copytree(tiny_dir, bare)
    (bare / "chat_template.jinja").unlink(missing_ok=True)
    cfg_path = bare / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.pop("chat_template", None)
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ModelDirError, match=r"no chat template"):
        load_causal_lm(bare, "cpu")


# ----------------------------------------------------------------------------- full size (slow)


def play_episodes(
    model, tok, env_cfg: EnvCfg, rollout: RolloutCfg, tasks: list[int], temperature: float, seed: int
) -> float:
    """Success rate of `model` sampling at `temperature` on `tasks`: all episodes advance together,
    one left-padded `generate` call per turn."""
    envs = [make_env(env_cfg.name, **env_cfg.params) for _ in tasks]
    state = [dict(zip(("obs", "info"), env.reset(task)), history=[], done=False) for env, task in zip(envs, tasks)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)  # generate() samples from the global RNG; fork_rng restores it
        for _ in range(env_cfg.max_turns):
            live = [i for i, s in enumerate(state) if not s["done"]]
            if not live:
                break
            rows = [
                prompts.prompt_ids(
                    tok,
                    prompts.build_messages(
                        state[i]["info"]["instruction"],
                        state[i]["history"],
                        state[i]["obs"],
                        state[i]["info"]["valid_actions"],
                        rollout.history_length,
                        system_prompt(env_cfg.name),
                    ),
                    rollout.max_prompt_tokens,
                )
                for i in live
            ]
            width = max(map(len, rows))
            ids = torch.full((len(rows), width), tok.pad_token_id)
            mask = torch.zeros_like(ids)
            for k, row in enumerate(rows):
                ids[k, width - len(row) :], mask[k, width - len(row) :] = torch.tensor(row), 1
            with torch.no_grad():
                out = model.generate(
                    ids,
                    attention_mask=mask,
                    do_sample=temperature > 0,
                    temperature=temperature or None,
                    top_p=1.0,
                    max_new_tokens=rollout.max_response_tokens,
                )
            for k, i in enumerate(live):
                s = state[i]
                action = prompts.parse_action(tok.decode(out[k, width:].tolist()))
                s["history"].append((s["obs"], action))
                s["obs"], _reward, s["done"], s["info"] = envs[i].step(action)
    return sum(bool(s["info"]["won"]) for s in state) / len(state)


@pytest.mark.slow
def test_default_tiny_model_warm_start_is_imperfect(tmp_path):
    """The default build lands in the band where RL has something to learn: 10-50% val success."""
    cfg = load_config()
    tiny = cfg.model.tiny.model_copy(update={"cache_dir": str(tmp_path)})
    model, tok = load_causal_lm(build_tiny_model(tiny, cfg.env, cfg.rollout), "cpu")
    success = play_episodes(
        model, tok, cfg.env, cfg.rollout, list(range(cfg.federation.val_tasks)), cfg.rollout.val_temperature, seed=0
    )
    print(f"warm-start validation success: {success:.3f}")
    assert 0.10 <= success <= 0.50
