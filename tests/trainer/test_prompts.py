"""Windowed prompts (invariant 15): window contents, structural truncation, action parsing."""

from __future__ import annotations

import pytest

from client_app import prompts
from client_app.tiny_model import train_tokenizer
from envs.registry import system_prompt

INSTRUCTION = "i need a red cotton shirt in size large, price lower than 30.00 dollars"
SYSTEM = system_prompt("shop")


@pytest.fixture(scope="module")
def tokenizer():
    corpus = [
        INSTRUCTION,
        SYSTEM,
        "search[red cotton shirt]",
        "click[b0000042]",
        "Observation: results page 1 of 5 [SEP] b0000042 [SEP] Red Cotton Shirt [SEP] $12.50",
    ] * 3
    return train_tokenizer(corpus, vocab_size=300)


def _history(n: int) -> list[tuple[str, str]]:
    return [(f"page number {i} with products", f"click[item {i}]") for i in range(n)]


def test_windowed_prompt_keeps_last_k_turns():
    history = _history(5)
    msgs = prompts.build_messages(
        INSTRUCTION, history, "current page", ["click[a]", "click[b]"], history_length=2, system_prompt=SYSTEM
    )
    assert [m["role"] for m in msgs] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert msgs[0]["content"] == SYSTEM
    assert msgs[1]["content"] == "Observation: page number 3 with products"
    assert msgs[2]["content"] == "click[item 3]"
    assert msgs[3]["content"] == "Observation: page number 4 with products"
    assert msgs[4]["content"] == "click[item 4]"
    last = msgs[-1]["content"]
    assert last.startswith(f"Task: {INSTRUCTION}\nObservation: current page\n")
    assert last.endswith("Your admissible actions of the current situation are: ['click[a]', 'click[b]'].")
    text = "".join(m["content"] for m in msgs)
    assert "page number 2" not in text and "item 2" not in text

    assert len(prompts.build_messages(INSTRUCTION, history, "p", ["a"], history_length=0, system_prompt=SYSTEM)) == 2
    assert (
        len(prompts.build_messages(INSTRUCTION, _history(1), "p", ["a"], history_length=2, system_prompt=SYSTEM)) == 4
    )
    # deterministic text: the same inputs render the same bytes
    assert msgs == prompts.build_messages(INSTRUCTION, history, "current page", ["click[a]", "click[b]"], 2, SYSTEM)


def test_prompt_ids_render_the_chat_template_with_generation_prompt(tokenizer):
    msgs = prompts.build_messages(
        INSTRUCTION, _history(2), "current page", ["click[a]"], history_length=2, system_prompt=SYSTEM
    )
    ids = prompts.prompt_ids(tokenizer, msgs, max_prompt_tokens=10_000)
    text = tokenizer.decode(ids)
    assert text == tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert ids.count(tokenizer.convert_tokens_to_ids("<|im_start|>")) == len(msgs) + 1


def test_prompt_truncation_is_identical_for_generation_and_training(tokenizer):
    """Over budget: oldest turns go first, then the head; rebuilding at training time gives the same ids."""
    history = _history(4)
    obs, actions = "current page", ["click[a]", "click[b]"]
    msgs = prompts.build_messages(INSTRUCTION, history, obs, actions, history_length=3, system_prompt=SYSTEM)
    full = prompts.prompt_ids(tokenizer, msgs, 10_000)
    no_oldest = prompts.prompt_ids(tokenizer, msgs[:1] + msgs[3:], 10_000)
    no_history = prompts.prompt_ids(tokenizer, msgs[:1] + msgs[-1:], 10_000)
    assert len(no_history) < len(no_oldest) < len(full)

    # Budget that fits after dropping exactly the oldest turn.
    gen_ids = prompts.prompt_ids(tokenizer, msgs, len(no_oldest))
    assert gen_ids == no_oldest
    assert "page number 1" not in tokenizer.decode(gen_ids) and "page number 2" in tokenizer.decode(gen_ids)

    # Budget below the history-free prompt: left-truncated, generation prompt and task kept.
    budget = len(no_history) - 5
    cut = prompts.prompt_ids(tokenizer, msgs, budget)
    assert cut == no_history[-budget:]
    assert tokenizer.decode(cut).endswith("<|im_start|>assistant\n")

    # The trainer rebuilds the row later from the stored turn: identical ids, for every budget.
    rebuilt = prompts.build_messages(
        INSTRUCTION, list(history), obs, list(actions), history_length=3, system_prompt=SYSTEM
    )
    for b in (len(full), len(no_oldest), len(no_oldest) - 1, budget, 1):
        ids = prompts.prompt_ids(tokenizer, rebuilt, b)
        assert ids == prompts.prompt_ids(tokenizer, msgs, b)
        assert len(ids) <= b


def test_response_ids_end_with_eos(tokenizer):
    ids = prompts.response_ids(tokenizer, "click[b0000042]")
    assert ids[-1] == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.decode(ids[:-1]) == prompts.response_text("click[b0000042]") == "click[b0000042]"


@pytest.mark.parametrize(
    "text, action",
    [
        ("click[b0000042]", "click[b0000042]"),
        ("  search[red shirt]  \nmore text", "search[red shirt]"),
        ("\n\n click[buy now]<|im_end|>", "click[buy now]"),
        ("click[next >]<|im_end|>\ngarbage", "click[next >]"),
        ("<think>hmm</think>\n<action>click[size: large]</action>", "click[size: large]"),
        ("I will buy. <action> click[buy now] </action> done", "click[buy now]"),
        ("<action>search[blue mug]<|endoftext|>", "search[blue mug]"),
        ("click[< prev]</s>", "click[< prev]"),
        ("", ""),
        ("   \n<|im_end|>click[x]", ""),
    ],
)
def test_parse_action(text, action):
    assert prompts.parse_action(text) == action
