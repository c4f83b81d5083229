"""The embedded default model: a tiny Qwen2 policy built locally and warm-started on an env's expert.

No model hub is reachable, yet `flwr run .` must train something real on a fresh machine. So
`model.path: tiny` builds, once per config and cached on disk, an ordinary Hugging Face model
directory:

1. expert episodes are played in-process on TRAINING tasks (never the validation tasks
   `[0, val_size)`), every turn rendered with the same windowed prompts the RL loop uses;
   a seeded fraction `sft_noise` of the demonstrated actions is replaced by a random valid
   action (and played), and a seeded fraction `sft_shortcut` of the episodes demonstrates a
   bad habit (buying without choosing the asked-for options), so the warm start is imperfect
   in a way reward can correct (`collect_demonstrations`);
2. a byte-level BPE tokenizer is trained on that text, with ChatML special tokens and template;
   the env's opaque identifiers (shop product ids) are whole tokens (`whole_tokens`);
3. a Qwen2-architecture causal LM is initialised from a local torch.Generator;
4. a short copy warm-up teaches it to repeat spans of that text (`copy_warmup`);
5. it is fine-tuned on (prompt, reply) pairs with the loss on the reply tokens only.

The build is a pure function of the config (`seed` included): two builds give identical
safetensors bytes. `load_causal_lm` is the one loader for tiny and real model directories.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from client_app import prompts
from client_app.sft import (
    Demo,
    build_host,
    cached_build,
    collect_demonstrations,
    cpu_build_settings,
    demo_rows,
    supervised_finetune,
)
from envs.registry import make_env
from fl_app.config import EnvCfg, RolloutCfg, TinyModelCfg

log = logging.getLogger(__name__)

# Bump when a change to this module changes what gets built, so stale caches are not reused.
CODE_VERSION = "tiny-model-4"

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

MLP_RATIO = 4  # intermediate_size = MLP_RATIO * hidden_size
INIT_STD = 0.02  # normal init of every matrix (Qwen2's initializer_range)
SFT_LR = 3e-3  # AdamW peak LR, linear warmup then linear decay to 0
SFT_BATCH = 8  # (prompt, reply) rows per optimizer step
COPY_SPANS_PER_ROW = 12  # copy warm-up length, in spans per demonstration row (see `copy_warmup`)
COPY_BATCH = 32


class ModelDirError(ValueError):
    """A model directory cannot be used as a policy; the message says why and what to do."""


# ----------------------------------------------------------------------------- cache


def cache_key(tiny_cfg: TinyModelCfg, env_cfg: EnvCfg, rollout_cfg: RolloutCfg) -> str:
    """sha256 over everything the built weights depend on (not where the cache lives)."""
    payload = {
        "code": CODE_VERSION,
        "tiny": tiny_cfg.model_dump(mode="json", exclude={"cache_dir"}),
        "env": {"name": env_cfg.name, "params": env_cfg.params, "max_turns": env_cfg.max_turns},
        "rollout": rollout_cfg.model_dump(
            mode="json", include={"mode", "history_length", "max_prompt_tokens", "max_response_tokens"}
        ),
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def tiny_model_dir(tiny_cfg: TinyModelCfg, env_cfg: EnvCfg, rollout_cfg: RolloutCfg) -> Path:
    return Path(tiny_cfg.cache_dir).expanduser() / cache_key(tiny_cfg, env_cfg, rollout_cfg)


def build_tiny_model(tiny_cfg: TinyModelCfg, env_cfg: EnvCfg, rollout_cfg: RolloutCfg) -> Path:
    """The cached tiny model directory for this config; builds it on first use."""
    return cached_build(
        tiny_model_dir(tiny_cfg, env_cfg, rollout_cfg),
        lambda tmp: build_into(tmp, tiny_cfg, env_cfg, rollout_cfg),
        "tiny model",
    )


# ----------------------------------------------------------------------------- build steps


def build_into(out_dir: Path, tiny_cfg: TinyModelCfg, env_cfg: EnvCfg, rollout_cfg: RolloutCfg) -> None:
    """Build the model directory in `out_dir` (no caching; `build_tiny_model` wraps this)."""
    with cpu_build_settings("tiny model"):
        demos = collect_demonstrations(
            env_cfg,
            rollout_cfg.history_length,
            tiny_cfg.sft_episodes,
            tiny_cfg.sft_noise,
            tiny_cfg.seed,
            tiny_cfg.sft_shortcut,
        )
        tokenizer = train_tokenizer(
            tokenizer_corpus(demos), tiny_cfg.vocab_size, whole_tokens(make_env(env_cfg.name, **env_cfg.params))
        )
        max_positions = rollout_cfg.max_prompt_tokens + rollout_cfg.max_response_tokens
        model = init_model(tiny_cfg, tokenizer, max_positions)
        rows = demo_rows(tokenizer, demos, rollout_cfg)
        copy_warmup(model, rows, math.ceil(COPY_SPANS_PER_ROW * len(rows) / COPY_BATCH), tiny_cfg.seed)
        final_loss = supervised_finetune(model, rows, tiny_cfg.sft_epochs, tiny_cfg.seed, SFT_LR, SFT_BATCH)
        model.save_pretrained(out_dir)
        tokenizer.save_pretrained(out_dir)
        (out_dir / "tiny_model.json").write_text(
            json.dumps(
                {
                    "code_version": CODE_VERSION,
                    "tiny": tiny_cfg.model_dump(mode="json", exclude={"cache_dir"}),
                    "env": env_cfg.model_dump(mode="json"),
                    "history_length": rollout_cfg.history_length,
                    "max_prompt_tokens": rollout_cfg.max_prompt_tokens,
                    "demonstrations": len(rows),
                    "sft_final_loss": round(final_loss, 6),
                    "built_on": build_host(),
                },
                indent=2,
                sort_keys=True,
            )
            + "\n"
        )


def whole_tokens(env) -> list[str]:
    """Strings the tokenizer keeps whole: the env's opaque ids, as shown and as typed.

    A shop product id ("B0KZAN5RA2" on the page, "click[b0kzan5ra2]" in the action) would be
    ten one-character tokens (Qwen's pre-tokenizer splits digits), and copying ten random
    characters is what a 2-layer model does worst; as one token it is a single pointer copy.
    Envs without such ids (no `product_ids`) get none.
    """
    ids = env.product_ids() if hasattr(env, "product_ids") else []
    return sorted({form for i in ids for form in (i, i.lower())})


def tokenizer_corpus(demos: list[Demo]) -> list[str]:
    """The texts of the demonstrations, in a fixed order; history repeats earlier current turns,
    so each turn's last message (plus the system prompt and the reply) covers them at the right frequency."""
    texts = []
    for d in demos:
        texts += [d.messages[0]["content"], d.messages[-1]["content"], prompts.response_text(d.action)]
    return texts


def train_tokenizer(texts: list[str], vocab_size: int, whole: Sequence[str] = ()):
    """Byte-level BPE on `texts`, saved and reloaded as a `Qwen2Tokenizer` with ChatML tokens;
    each string of `whole` becomes one added token (matched before BPE, kept on save/load).

    The BPE is trained with Qwen2's own normalizer and pre-tokenizer: `AutoTokenizer` rebuilds
    a qwen2 model's tokenizer with exactly that pipeline from vocab + merges, so any other
    pipeline would tokenize differently after a save/load than during SFT.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[PAD, IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(texts, trainer)
    trained = json.loads(bpe.to_str())["model"]
    tokenizer = Qwen2Tokenizer(
        vocab=trained["vocab"],
        merges=[tuple(m) for m in trained["merges"]],  # type: ignore[misc]  # the stub says str; pairs are what it reads
        eos_token=IM_END,
        pad_token=PAD,
        extra_special_tokens=[IM_START],
        model_max_length=1 << 20,
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    if whole:
        tokenizer.add_tokens(list(whole))
    return tokenizer


def tiny_config(tiny_cfg: TinyModelCfg, vocab_size: int, **extra: Any):
    """The tiny model's Qwen2 shape: `tiny_cfg`'s width, layers and heads (KV heads = heads / 2),
    an MLP of `MLP_RATIO` x the width, tied embeddings; `extra` sets the other config fields."""
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=tiny_cfg.hidden_size,
        intermediate_size=MLP_RATIO * tiny_cfg.hidden_size,
        num_hidden_layers=tiny_cfg.layers,
        num_attention_heads=tiny_cfg.heads,
        num_key_value_heads=tiny_cfg.heads // 2,
        tie_word_embeddings=True,
        **extra,
    )


def init_model(tiny_cfg: TinyModelCfg, tokenizer, max_positions: int):
    """A Qwen2 causal LM with every weight drawn from a local generator seeded by `tiny_cfg.seed`."""
    from transformers import GenerationConfig, Qwen2ForCausalLM

    if tiny_cfg.hidden_size % tiny_cfg.heads or tiny_cfg.heads % 2:
        raise ValueError(
            f"tiny model: hidden_size={tiny_cfg.hidden_size} must be divisible by heads="
            f"{tiny_cfg.heads}, and heads must be even (KV heads = heads / 2)"
        )
    eos, pad = tokenizer.convert_tokens_to_ids(IM_END), tokenizer.convert_tokens_to_ids(PAD)
    config = tiny_config(
        tiny_cfg,
        len(tokenizer),
        max_position_embeddings=max_positions,
        initializer_range=INIT_STD,
        bos_token_id=None,
        eos_token_id=eos,
        pad_token_id=pad,
        use_cache=True,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):  # transformers' own init draws from the global RNG
        model = Qwen2ForCausalLM(config)
    gen = torch.Generator().manual_seed(tiny_cfg.seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith(".bias"):
                param.zero_()
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * INIT_STD)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=pad, bos_token_id=None)
    return model.float()


def copy_warmup(model, rows: list[tuple[list[int], list[int]]], steps: int, seed: int) -> None:
    """Teach copying before SFT: predict the second half of `span + span` for random spans of
    the demonstration token stream. Copying (the task into the query, an id from the admissible
    list into the reply) is what a from-scratch model learns slowest from SFT alone."""
    if steps == 0:
        return
    gen = torch.Generator().manual_seed(seed + 2)
    opt = torch.optim.AdamW(model.parameters(), lr=SFT_LR, weight_decay=0.0)
    device = next(model.parameters()).device
    model.train()
    for _ in range(steps):
        k = int(torch.randint(8, 33, (1,), generator=gen))
        spans = []
        for r in torch.randint(len(rows), (COPY_BATCH,), generator=gen).tolist():
            seq = rows[r][0] + rows[r][1]
            start = int(torch.randint(max(1, len(seq) - k + 1), (1,), generator=gen))
            span = (seq * k)[start : start + k]  # (seq * k): k long even for a row shorter than k
            spans.append(span + span)
        x = torch.tensor(spans, device=device)
        hidden = model.model(input_ids=x).last_hidden_state[:, k - 1 : -1]  # positions predicting copy 2
        loss = F.cross_entropy(model.lm_head(hidden).flatten(0, 1), x[:, k:].flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
    log.info("tiny model: copy warm-up %d steps, last loss %.4f", steps, loss.item())


# ----------------------------------------------------------------------------- loading


def load_causal_lm(path: str | Path, device: str | torch.device = "cpu"):
    """(model, tokenizer) from a local Hugging Face directory, fp32 master weights on `device`.

    Everything is checked before any weight is read, and every failure names the fix.
    """
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM, AutoTokenizer

    p = Path(path).expanduser()
    if not p.is_dir():
        raise ModelDirError(
            f"model directory {p} does not exist: set `model.path` to a local Hugging Face "
            "model directory, or to `tiny` to build the embedded default model"
        )
    if not (p / "config.json").is_file():
        raise ModelDirError(f"{p} has no config.json, so it is not a Hugging Face model directory; fix `model.path`")
    config = AutoConfig.from_pretrained(p)
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ModelDirError(
            f"{p} holds a {config.model_type!r} model (architectures "
            f"{getattr(config, 'architectures', None)}), not a causal language model; "
            "point `model.path` at a causal LM (e.g. Qwen2.5-1.5B-Instruct)"
        )
    tokenizer = AutoTokenizer.from_pretrained(p)
    if not getattr(tokenizer, "chat_template", None):
        raise ModelDirError(
            f"the tokenizer in {p} has no chat template, and prompts are built with "
            "apply_chat_template; use an instruct/chat model or add `chat_template` "
            "to its tokenizer_config.json"
        )
    if tokenizer.eos_token_id is None:
        raise ModelDirError(
            f"the tokenizer in {p} has no eos token, so replies could never end; set "
            "`eos_token` in its tokenizer_config.json"
        )
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # batched generation needs a pad id; masked anyway
    model = AutoModelForCausalLM.from_pretrained(p, dtype=torch.float32)
    model = model.to(device)  # type: ignore[arg-type]  # transformers' stub types `to` as its own wrapper
    model.eval()
    return model, tokenizer
