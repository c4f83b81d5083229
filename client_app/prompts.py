"""Prompts: what the policy sees each turn, and how its reply becomes an action.

Windowed mode (verl-agent, the published runs; invariant 15): one prompt per turn with the task,
the last `history_length` (observation, action) turns, the current observation and the
admissible actions. The message layout is fixed so truncation can be structural:

    [system]     the env's system prompt (envs.registry.system_prompt)
    [user]       Observation: <older observation>      } one pair per history turn,
    [assistant]  <action taken there>                  } oldest first
    ...
    [user]       Task: <instruction>
                 Observation: <current observation>
                 Your admissible actions of the current situation are: ['a', 'b'].

The task sits in the last message, so the oldest history can be dropped without losing it.
`prompt_ids` is the ONE function that turns messages into token ids, for generation and for
training alike, so the context a policy acted on is exactly the context it is trained on.

Concat mode (invariant 16): the first prompt is the windowed one without history; after each
generated reply the episode's token sequence grows by `concat_glue_ids`: the end of the
assistant turn, the next observation as a user turn, and the generation prompt. That text is
taken from a rendered chat-template string AFTER a placeholder reply, never by re-rendering the
real history and slicing at the old length: templates that rewrite past assistant turns (Qwen3
drops their `<think>` blocks) would otherwise shift or eat the turn boundary.
"""

from __future__ import annotations

from typing import Any

# End-of-turn markers a decoded generation may still carry (ChatML, Qwen base, Llama 3, SentencePiece).
END_MARKERS = ("<|im_end|>", "<|endoftext|>", "<|eot_id|>", "</s>")


# A reply no chat template rewrites (no reasoning block, no whitespace to strip): concat glue is
# read from a rendered conversation right after it.
GLUE_PLACEHOLDER = "FEDAGENT_TURN_PLACEHOLDER"


def _admissible(valid_actions: list[str]) -> str:
    actions = ", ".join(f"'{a}'" for a in valid_actions)
    return f"Your admissible actions of the current situation are: [{actions}]."


def build_messages(
    instruction: str,
    history: list[tuple[str, str]],
    observation: str,
    valid_actions: list[str],
    history_length: int,
    system_prompt: str,
) -> list[dict[str, str]]:
    """Chat messages for one turn; `history` is every earlier (observation, action) of the episode,
    `system_prompt` the env's (`envs.registry.system_prompt`)."""
    window = history[-history_length:] if history_length > 0 else []
    messages = [{"role": "system", "content": system_prompt}]
    for past_obs, past_action in window:
        messages.append({"role": "user", "content": f"Observation: {past_obs}"})
        messages.append({"role": "assistant", "content": response_text(past_action)})
    messages.append(
        {"role": "user", "content": (f"Task: {instruction}\nObservation: {observation}\n{_admissible(valid_actions)}")}
    )
    return messages


def observation_message(observation: str, valid_actions: list[str]) -> dict[str, str]:
    """The user turn that carries a new observation into a concat-mode conversation."""
    return {"role": "user", "content": f"Observation: {observation}\n{_admissible(valid_actions)}"}


def concat_glue_ids(
    tokenizer: Any, conversation: list[dict[str, str]], observation: dict[str, str], reply_ended: bool
) -> list[int]:
    """Token ids that follow a generated reply in a concat-mode sequence, up to the next
    generation prompt.

    `conversation` is the episode so far, ending with the user turn the reply answered. The
    conversation + a placeholder reply + `observation` is rendered with the generation prompt;
    the glue is the text after the placeholder, minus the end-of-turn token the model generated
    itself (`reply_ended`; a reply cut by the token budget gets it here, outside the loss).
    """
    probe = [*conversation, {"role": "assistant", "content": GLUE_PLACEHOLDER}, observation]
    text = tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=True)
    at = text.rfind(GLUE_PLACEHOLDER)
    if at < 0:
        raise ValueError(
            "the chat template dropped the assistant reply from a rendered conversation, so "
            "concat mode cannot find the turn boundary; use rollout.mode=windowed with this model"
        )
    tail = text[at + len(GLUE_PLACEHOLDER) :]
    eos = tokenizer.eos_token
    if not tail.startswith(eos):
        raise ValueError(
            f"the chat template ends an assistant turn with {tail[:24]!r}, not with the tokenizer's "
            f"eos {eos!r} that ends generation; concat mode needs them to agree (set eos_token to the "
            "template's end-of-turn token, or use rollout.mode=windowed)"
        )
    glue = tail if not reply_ended else tail[len(eos) :]
    if observation["content"] not in glue:
        raise ValueError(
            "the rendered observation turn is not where concat mode expects it (after the reply); "
            "use rollout.mode=windowed with this chat template"
        )
    return list(tokenizer(glue, add_special_tokens=False)["input_ids"])


def _render_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    # The template already wrote every special token it wants; never let the tokenizer add more.
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_ids(tokenizer: Any, messages: list[dict[str, str]], max_prompt_tokens: int) -> list[int]:
    """Token ids of the generation prompt, at most `max_prompt_tokens` long.

    Too long: drop the oldest history turn (a user/assistant pair after the system message)
    until it fits or no history is left, then keep the last `max_prompt_tokens` ids.
    Use this for generation AND for building the training row (invariant 15).
    """
    if max_prompt_tokens <= 0:
        raise ValueError(f"max_prompt_tokens must be positive, got {max_prompt_tokens}")
    msgs = list(messages)
    ids = _render_ids(tokenizer, msgs)
    while len(ids) > max_prompt_tokens and len(msgs) >= 4:
        msgs = msgs[:1] + msgs[3:]
        ids = _render_ids(tokenizer, msgs)
    return ids[-max_prompt_tokens:]


def response_text(action: str) -> str:
    """What the model is trained to emit for `action`; the tokenizer's eos ends the turn."""
    return action


def response_ids(tokenizer: Any, action: str) -> list[int]:
    """Token ids of a demonstrated reply: `response_text(action)` followed by eos."""
    if tokenizer.eos_token_id is None:
        raise ValueError("tokenizer has no eos token; set eos_token (e.g. <|im_end|>) so replies can end")
    return list(tokenizer(response_text(action), add_special_tokens=False)["input_ids"]) + [tokenizer.eos_token_id]


def parse_action(text: str) -> str:
    """The action in a generated reply.

    Cut at the first end-of-turn marker; if `<action>` is present keep only what follows it, up
    to `</action>`; then take the first non-empty line, stripped. "" means nothing usable.
    """
    for marker in END_MARKERS:
        text = text.split(marker, 1)[0]
    start = text.find("<action>")
    if start >= 0:
        text = text[start + len("<action>") :].split("</action>", 1)[0]
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""
