"""vLLM generation throughput on a local model directory (GPU only; preparation for the verl backend).

    VLLM_USE_FLASHINFER_SAMPLER=0 python -m bench.vllm_generate --model /tmp/qwen05b-random \\
        --batches 1,64,256 --prompt-tokens 512 --new-tokens 64 --json /tmp/vllm.json

Prompts are random token ids below the model's tokenizer size (no tokenizer is loaded:
`skip_tokenizer_init`), every request generates exactly `--new-tokens` tokens (`ignore_eos`) at
temperature 1.0, so tokens/s measures the engine, not the policy. The engine is built once
(start-up timed: weights, torch.compile, CUDA graphs), one warm-up batch runs, then each batch
size is timed once. Without FlashInfer (the lean install, docs/offline-gpu.md) set
VLLM_USE_FLASHINFER_SAMPLER=0, or vLLM's sampler fails to import it.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

from bench.report import emit


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.vllm_generate", description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="local Hugging Face model directory")
    ap.add_argument("--vocab", type=int, default=4096, help="prompt ids are drawn below this (the tokenizer's size)")
    ap.add_argument("--batches", default="1,64,256")
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.5)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if os.environ.get("VLLM_USE_FLASHINFER_SAMPLER") != "0":
        try:
            import flashinfer  # noqa: F401
        except ImportError:
            ap.error("flashinfer is not installed: set VLLM_USE_FLASHINFER_SAMPLER=0")
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    t0 = time.perf_counter()
    llm = LLM(
        model=args.model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        seed=0,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_model_len=args.prompt_tokens + args.new_tokens + 64,
    )
    startup_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=args.new_tokens, temperature=1.0, ignore_eos=True, detokenize=False)
    rng = random.Random(0)

    def prompts(n: int) -> list[TokensPrompt]:
        return [
            TokensPrompt(prompt_token_ids=[rng.randrange(args.vocab) for _ in range(args.prompt_tokens)])
            for _ in range(n)
        ]

    llm.generate(prompts(8), params, use_tqdm=False)
    rows = []
    for b in (int(x) for x in args.batches.split(",")):
        batch = prompts(b)
        t0 = time.perf_counter()
        outs = llm.generate(batch, params, use_tqdm=False)
        dt = time.perf_counter() - t0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        rows.append({"batch": b, "seconds": round(dt, 3), "tokens": tokens, "tokens_per_s": round(tokens / dt, 1)})
        print(json.dumps(rows[-1]), flush=True)
    report = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(),
        "model": args.model,
        "prompt_tokens": args.prompt_tokens,
        "new_tokens": args.new_tokens,
        "engine_startup_s": round(startup_s, 1),
        "rows": rows,
    }
    return emit(report, args.json)


if __name__ == "__main__":
    sys.exit(main())
