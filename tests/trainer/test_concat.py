"""Concat rollout mode (invariant 16): one growing token sequence per episode, observation glue
taken from rendered chat-template diffs, so a template that rewrites history (Qwen3 drops past
`<think>` blocks) cannot eat a turn boundary. Real tokenizer, real env service, real
(random-weight) Qwen2 policy."""

from __future__ import annotations

import pytest
import torch
from trainer_support import POOL_SIZE, SMALL_ENV_PARAMS, one_torch_thread, random_model_dir, small_config  # noqa: F401

from client_app import prompts
from client_app.rollout import BatchedGenerator, RolloutSettings, group_specs, run_episodes, training_rows
from client_app.tiny_model import load_causal_lm
from client_app.trainer import make_trainer
from client_app.trainer.base import ClientTasks
from envs.client import SyncEnvClient
from envs.registry import system_prompt
from envs.service import serve_in_subprocess
from fl_app.calls import FitCall

SHOP = system_prompt("shop")

# Qwen3's rule, in the tiny tokenizer's ChatML: an assistant turn that precedes the last user
# turn loses everything up to its `</think>` when the conversation is rendered again.
REWRITING_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set content = m['content'] -%}"
    "{%- if m['role'] == 'assistant' and loop.index0 < ns.last_user and '</think>' in content -%}"
    "{%- set content = content.split('</think>')[-1].lstrip('\n') -%}"
    "{%- endif -%}"
    "{{- '<|im_start|>' + m['role'] + '\n' + content + '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
REPLIES = [
    "<think>the search page: look for a red mug</think>\nsearch[red mug]",
    "<think>results are listed; the first one matches</think>\nclick[b0001]",
    "<think>pick the size, then buy</think>\nclick[buy now]",
]
OBSERVATIONS = [
    ("Search", ["search[<your query>]"]),
    ("Page 1 (Total results: 2) [SEP] b0001 [SEP] red mug", ["click[b0001]", "click[next >]"]),
    ("red mug [SEP] size [SEP] large [SEP] Buy Now", ["click[large]", "click[buy now]"]),
    ("Thank you for shopping with us!", []),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return random_model_dir(tmp_path_factory.mktemp("models") / "policy")


@pytest.fixture(scope="module")
def env():
    with serve_in_subprocess("shop", POOL_SIZE, SMALL_ENV_PARAMS) as url, SyncEnvClient(url) as client:
        yield client


def _play(tok, replies: list[str], ended: list[bool]) -> tuple[list[int], list[dict[str, str]]]:
    """A concat-mode episode built the way the rollout builds it: first prompt, then per turn the
    reply ids (eos when `ended`) and the glue."""
    obs, actions = OBSERVATIONS[0]
    conversation = prompts.build_messages("buy a red mug", [], obs, actions, 0, SHOP)
    context = prompts.prompt_ids(tok, conversation, 10_000)
    for k, (reply, end) in enumerate(zip(replies, ended)):
        response = list(tok(reply, add_special_tokens=False)["input_ids"]) + ([tok.eos_token_id] if end else [])
        user = prompts.observation_message(*OBSERVATIONS[k + 1])
        context += response + prompts.concat_glue_ids(tok, conversation, user, end)
        conversation += [{"role": "assistant", "content": reply}, user]
    return context, conversation


@pytest.mark.parametrize("ended", [[True, True, True], [True, False, True]], ids=["eos", "cut-reply"])
def test_concat_glue_survives_a_history_rewriting_template(model_dir, ended):
    """With a Qwen3-style template the glue still yields exactly the transcript the policy saw:
    every reply verbatim (reasoning included), every observation once, every turn boundary."""
    _, tok = load_causal_lm(model_dir)
    plain = tok.chat_template  # ChatML, renders history verbatim
    tok.chat_template = REWRITING_TEMPLATE
    context, conversation = _play(tok, REPLIES, ended)
    # the template really rewrites history: re-rendering and slicing at the old length would misalign
    rerendered = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert "look for a red mug" not in rerendered and "the first one matches" not in rerendered
    first_two = _play(tok, REPLIES[:1], ended[:1])[0]
    assert not rerendered.startswith(tok.decode(first_two)), "the naive prefix diff must break on this template"
    # what the concat sequence holds is the verbatim transcript (the same chat, no rewriting)
    tok.chat_template = plain
    transcript = tok.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert tok.decode(context, skip_special_tokens=False) == transcript
    for reply in REPLIES:
        assert transcript.count(reply) == 1
    assert transcript.count("<|im_start|>assistant\n") == len(REPLIES) + 1


def test_concat_glue_refuses_a_template_whose_turn_end_is_not_eos(model_dir):
    _, tok = load_causal_lm(model_dir)
    tok.chat_template = tok.chat_template.replace("'<|im_end|>'", "'<|endoftext|>'")
    conversation = prompts.build_messages("buy a red mug", [], "Search", ["search[<your query>]"], 0, SHOP)
    with pytest.raises(ValueError, match="not with the tokenizer's eos"):
        prompts.concat_glue_ids(tok, conversation, prompts.observation_message("Search", []), True)


def test_concat_episode_is_one_row_whose_prefixes_are_the_generation_contexts(env, model_dir):
    """Each generation context is a prefix of the episode's one training row; the glue between
    replies carries the next observation and is masked; the sequence never outgrows the budget."""
    model, tok = load_causal_lm(model_dir)
    gen = BatchedGenerator(model, tok, max_new_tokens=8)
    budget = 420
    settings = RolloutSettings(
        max_turns=4, history_length=2, max_prompt_tokens=budget, system_prompt=SHOP, mode="concat"
    )
    episodes, _ = run_episodes(gen, env, group_specs([40, 41, 42], 2), settings, 1.0, seed=7, max_sessions=POOL_SIZE)
    rows = training_rows(episodes, 0.1)
    assert len(rows) == len(episodes) and [r.episode for r in rows] == list(range(len(episodes)))
    multi_turn = budget_ended = 0
    for ep, row in zip(episodes, rows):
        first = prompts.build_messages(ep.instruction, [], ep.turns[0].observation, ep.turns[0].valid_actions, 0, SHOP)
        assert row.prompt_ids == prompts.prompt_ids(tok, first, budget) == ep.turns[0].prompt_ids
        offset = 0
        for k, turn in enumerate(ep.turns):
            if k:
                glue = row.response_ids[offset : offset + len(turn.prompt_ids)]
                assert glue == turn.prompt_ids and row.mask[offset : offset + len(glue)] == [0] * len(glue)
                assert f"Observation: {turn.observation}" in tok.decode(glue)
                offset += len(glue)
            context = row.prompt_ids + row.response_ids[:offset]
            assert len(context) <= budget
            assert row.response_ids[offset : offset + len(turn.response_ids)] == turn.response_ids
            assert row.mask[offset : offset + len(turn.response_ids)] == [1] * len(turn.response_ids)
            offset += len(turn.response_ids)
        assert offset == len(row.response_ids) == len(row.mask)
        multi_turn += len(ep.turns) > 1
        budget_ended += not ep.done and len(ep.turns) < settings.max_turns
        if not ep.done:  # named by what ended it: the context budget or the turn budget
            assert ep.outcome == ("context_full" if len(ep.turns) < settings.max_turns else "timeout")
    assert multi_turn, "the test needs episodes with more than one turn"
    assert budget_ended, "the budget must end some episode early (raise max_turns or lower the budget)"


def test_concat_generation_context_is_the_row_prefix(env, model_dir):
    """Greedy rollout: regenerating turn k from the row's prefix gives the same reply, so the
    context the policy acted on is exactly the prefix it is trained on."""
    model, tok = load_causal_lm(model_dir)
    gen = BatchedGenerator(model, tok, max_new_tokens=8)
    settings = RolloutSettings(max_turns=3, history_length=2, max_prompt_tokens=2048, system_prompt=SHOP, mode="concat")
    episodes, _ = run_episodes(gen, env, group_specs([43, 44], 1), settings, 0.0, seed=0, max_sessions=POOL_SIZE)
    checked = 0
    for ep, row in zip(episodes, training_rows(episodes, 0.1)):
        offset = 0
        for k, turn in enumerate(ep.turns):
            offset += len(turn.prompt_ids) if k else 0
            again = gen.generate([row.prompt_ids + row.response_ids[:offset]], 0.0, [0])[0]
            assert again == turn.response_ids
            offset += len(turn.response_ids)
            checked += 1
    assert checked > len(episodes), "needs multi-turn episodes"


# The Flower e2e recipe's tiny model and env (tests/fixtures/e2e-recipe.yaml): the windowed build is cached.
E2E_TINY = {"hidden_size": 32, "layers": 1, "heads": 2, "vocab_size": 400, "sft_episodes": 32, "sft_epochs": 1}
E2E_ENV = {"num_products": 60, "num_goals": 200, "val_size": 16, "search_return_n": 10, "seed": 0}


@pytest.mark.parametrize("algo", ["grpo", "ppo"])
@pytest.mark.parametrize("mode", ["windowed", "concat"])
def test_both_rollout_modes_train_the_tiny_model(mode, algo, tmp_path_factory):
    """The locally built tiny model (the e2e tests' size) trains in either mode with either
    algorithm: every member moves, no step is skipped, rows follow the mode."""
    cfg = small_config(
        "tiny",
        model={"tiny": E2E_TINY},
        env={"params": E2E_ENV, "max_turns": 6},
        rollout={"mode": mode, "max_prompt_tokens": 512, "max_response_tokens": 16},
        algo={
            "name": algo,
            "tasks_per_step": 2 if algo == "grpo" else 4,
            "group_size": 2 if algo == "grpo" else 1,
            "lr": 1e-4,
        },
    )
    with serve_in_subprocess("shop", POOL_SIZE, E2E_ENV) as url:
        t = make_trainer(cfg, url)
        try:
            before = {m: t.export_weights(m) for m in t.members}
            res = t.fit(FitCall(round=1, client_id=0, local_epochs=2, seed=0), ClientTasks(list(range(16, 200))))
            m = res.metrics
            assert res.num_examples == 2 * 4 and m["skipped_steps"] == 0 and m["optimizer_steps"] >= 2
            assert m["rows"] == 2 * 4 if mode == "concat" else m["rows"] > 2 * 4  # summed over 2 epochs
            assert m["train_turns"] > 1, "multi-turn episodes are what the modes differ in"
            for member in t.members:
                after = t.export_weights(member)
                assert any(not torch.equal(after[k], before[member][k]) for k in after), member
        finally:
            t.close()
