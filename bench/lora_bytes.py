"""What `federation.update: lora` moves per round against full fp32, per rank and `lora.trained`:
the exchanged tensors (the adapters' trained factors, `client_app/trainer/lora.py`) of a model's
shape, built on the meta device (no weights, no download), against all of its parameters.

    python -m bench.lora_bytes                      # the tiny default and SmolLM2-135M's shape
    python -m bench.lora_bytes --ranks 4 8 16 32 --trained smaller
    python -m bench.lora_bytes --model-dir DIR      # a Hugging Face model dir's config.json

A round moves the same members down and up for every client, so the ratio of a round's
`bytes_moved` is the ratio of the parameter counts (docs/trainer.md, "LoRA federation").
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from client_app.tiny_model import MLP_RATIO
from client_app.trainer.lora import add_adapters
from fl_app.config import LORA_TARGETS, TinyModelCfg

# SmolLM2-135M-Instruct's config.json (the shape docs/models.md runs; Llama architecture)
SMOLLM2_135M: dict[str, Any] = {
    "model_type": "llama",
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 30,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "vocab_size": 49152,
    "tie_word_embeddings": True,
}


# the default build's BPE vocabulary (its config.json, model.tiny.seed 0): below the
# `model.tiny.vocab_size` bound of 4,096, which the tokenizer's merges did not fill
TINY_VOCAB = 3390


def tiny_shape() -> dict[str, Any]:
    """The tiny default's Qwen2 shape (client_app/tiny_model.py `init_model`)."""
    t = TinyModelCfg()
    return {
        "model_type": "qwen2",
        "hidden_size": t.hidden_size,
        "intermediate_size": MLP_RATIO * t.hidden_size,
        "num_hidden_layers": t.layers,
        "num_attention_heads": t.heads,
        "num_key_value_heads": t.heads // 2,
        "vocab_size": TINY_VOCAB,
        "tie_word_embeddings": True,
    }


def dir_shape(model_dir: Path) -> dict[str, Any]:
    """The shape a Hugging Face model dir's config.json gives."""
    keys = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
    config = json.loads((model_dir / "config.json").read_text())
    extra = ("num_key_value_heads", "vocab_size", "tie_word_embeddings")
    return {k: config[k] for k in keys} | {k: config[k] for k in extra if k in config}


def counts(shape: dict[str, Any], rank: int, trained: str = "B") -> tuple[int, int]:
    """(all parameters, the adapters' exchanged numbers) of a causal LM of `shape` at `rank`,
    training the factor `trained` picks."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(shape)
    config = AutoConfig.for_model(kwargs.pop("model_type"), **kwargs)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    full = sum(p.numel() for p in model.parameters())
    add_adapters(model, "actor", LORA_TARGETS, rank, 2.0 * rank, seed=0, trained=trained)
    return full, sum(p.numel() for p in model.parameters() if p.requires_grad)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16, 32])
    ap.add_argument("--model-dir", type=Path, nargs="*", default=[], help="Hugging Face model dirs (config.json)")
    ap.add_argument("--trained", nargs="+", choices=["B", "smaller"], default=["B", "smaller"], help="lora.trained")
    args = ap.parse_args()
    shapes = [(d.name[:13], dir_shape(d)) for d in args.model_dir] or [
        ("tiny default", tiny_shape()),
        ("SmolLM2-135M", SMOLLM2_135M),
    ]
    for label, shape in shapes:
        for trained in args.trained:
            for rank in args.ranks:
                full, adapters = counts(shape, rank, trained)
                print(
                    f"{label:>13} {trained:>7} rank {rank:>3}: {full:>12,} params, "
                    f"adapters {adapters:>10,}: x{full / adapters:.1f}"
                )


if __name__ == "__main__":
    main()
