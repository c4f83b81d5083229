"""vLLM as a rollout engine (`rollout.engine: vllm`), inside the lane service's own process.

`VllmGenerator` has `BatchedGenerator`'s contract (`generate(prompts, temperature, seeds)` ->
response ids cut after the first eos; `tokenizer`; `eos_ids`), so the same episode loop
(`client_app.rollout.run_episodes`: windowed or concat prompts, action parsing, env sessions,
task groups) plays the episodes whichever engine generates.

Why in-process (`vllm.LLM` with `VLLM_ENABLE_V1_MULTIPROCESSING=0`, one rank) rather than
verl's Ray-hosted vLLM replicas: the lane service already is the single process that owns the
GPU lane, the training engine lives in it, and a weight sync is then a loop over the engine's
full tensors (`engine.RolloutPolicy.policy_tensors`) into vLLM's `model.load_weights` on the same
device, with no IPC handles, no Ray cluster (issue #7: never attach to Flower's) and nothing to
clean up but this object.

Sleep discipline (invariant 25): the engine is built asleep and is asleep before every weight
sync; `load_weights` refuses an awake engine. Level 2 sleep drops weights and KV cache from
the GPU (the weights are overwritten at every sync anyway, so no host copy is kept); vLLM keeps
the model's buffers (rotary tables) on the host across it. The trainer sleeps the engine after
every rollout, so the update and the export run with the GPU to themselves.

Sampling: the tempered full distribution over every output row (no top-k/top-p), which is what
the training engines' log-probs normalise over with this engine; each request carries its own
seed (row i of turn t samples with the rollout loop's `derive_seed`), so what an episode does
does not depend on its batch.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import importlib.util
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from client_app.rollout import cut_at_eos, turn_end_ids_of

log = logging.getLogger("fedagent.trainer.vllm")


def arm_vllm_env() -> None:
    """Process settings vLLM reads at engine construction: in-process engine core (the weight
    sync and sleep calls reach the worker directly), and vLLM's own sampler when FlashInfer is
    absent (the lean offline install, docs/offline-gpu.md): without it vLLM imports FlashInfer
    unguarded and fails."""
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0") != "0":
        raise RuntimeError(
            "VLLM_ENABLE_V1_MULTIPROCESSING is set to non-zero in this environment; the lane "
            "runs vLLM inside its own process (weight sync by reference). Unset it"
        )
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if importlib.util.find_spec("flashinfer") is None:
        os.environ["VLLM_USE_FLASHINFER_SAMPLER"] = "0"


def gpu_key() -> str:
    """This process's GPU as the node knows it (its UUID: CUDA_VISIBLE_DEVICES numbers differ
    between processes); "cpu" without one."""
    if not torch.cuda.is_available():
        return "cpu"
    return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)


@contextlib.contextmanager
def engine_start_lock(gpu: str) -> Iterator[None]:
    """One vLLM engine start at a time on the GPU `gpu`, across the node's processes. vLLM sizes
    its KV cache by profiling the GPU's free memory, and refuses to start when another process
    frees memory meanwhile; the lanes of a simulation (several virtual clients on one GPU) start
    together, and each puts its engine to sleep right after its start, freeing gigabytes. On one
    H100, two of three verl + vLLM lanes started at once failed that way ("Error in memory
    profiling"). An flock: the kernel releases it if its holder dies."""
    path = Path(tempfile.gettempdir()) / f"fedagent-vllm-start-{gpu}.lock"
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            t0 = time.perf_counter()
            log.info("waiting for another vLLM engine start on this GPU (%s)", path)
            fcntl.flock(f, fcntl.LOCK_EX)
            log.info("waited %.1f s for the other vLLM engine start", time.perf_counter() - t0)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


class VllmGenerator:
    """Batched sampling with vLLM, asleep except between a weight sync and the end of a rollout."""

    def __init__(
        self,
        model_path: Path,
        tokenizer: Any,
        max_new_tokens: int,
        max_model_len: int,
        gpu_memory_utilization: float,
        seed: int,
    ) -> None:
        if importlib.util.find_spec("vllm") is None:
            raise RuntimeError(
                "rollout.engine=vllm needs vLLM in this environment (vllm==0.24.0; offline "
                "GPU nodes: docs/offline-gpu.md); or use rollout.engine: hf"
            )
        arm_vllm_env()
        from vllm import LLM

        self.tokenizer = tokenizer
        self.max_new_tokens = max_new_tokens
        self.eos_ids = list(turn_end_ids_of(tokenizer.eos_token_id, str(model_path)))
        t0 = time.perf_counter()
        with engine_start_lock(gpu_key()):  # through the first sleep: the memory it frees is the start's
            self.llm = LLM(
                model=str(model_path),
                skip_tokenizer_init=True,
                dtype="bfloat16",
                seed=seed,
                enable_sleep_mode=True,
                gpu_memory_utilization=gpu_memory_utilization,
                max_model_len=max_model_len,
                tensor_parallel_size=1,
            )
            self.awake = True
            self.sleep()
        self.startup_s = time.perf_counter() - t0
        log.info("vLLM engine for %s ready in %.1f s (asleep until the first weight sync)", model_path, self.startup_s)

    def sleep(self) -> None:
        """Drop weights and KV cache from the GPU (level 2). Idempotent."""
        if self.awake:
            self.llm.sleep(level=2)
            self.awake = False

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
        """Wake the engine with `named_tensors` (Hugging Face names, any float dtype, any device;
        consumed one at a time) as its weights; seconds taken. The engine must be asleep
        (invariant 25): syncing into an awake engine would race its KV cache and CUDA graphs."""
        if self.awake:
            raise RuntimeError("weight sync into an awake vLLM engine; call sleep() first (invariant 25)")
        t0 = time.perf_counter()
        self.llm.wake_up(tags=["weights"])
        try:
            self.llm.apply_model(lambda model: model.load_weights(named_tensors))
        except BaseException:
            # vLLM only puts a fully awake engine to sleep: wake the rest, then drop it all again
            self.llm.wake_up(tags=["kv_cache"])
            self.llm.sleep(level=2)
            raise
        self.llm.wake_up(tags=["kv_cache"])
        self.awake = True
        self.llm.reset_prefix_cache()  # cached prefixes were computed with the old weights
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    def named_parameters(self) -> dict[str, torch.Tensor]:
        """vLLM's own parameters (its fused names), CPU copies: for checking a sync."""
        if not self.awake:
            raise RuntimeError("the vLLM engine is asleep: its weights are not on the GPU")
        return self.llm.apply_model(lambda model: {n: p.detach().float().cpu() for n, p in model.named_parameters()})[0]

    def generate(self, prompts: Sequence[Sequence[int]], temperature: float, seeds: Sequence[int]) -> list[list[int]]:
        """Response ids per prompt, cut after the first eos; row i samples with `seeds[i]`
        (greedy when temperature == 0)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if not self.awake:
            raise RuntimeError("generate on a sleeping vLLM engine: sync the weights first (load_weights)")
        if len(seeds) != len(prompts):
            raise ValueError(f"got {len(seeds)} seeds for {len(prompts)} prompts; pass one seed per prompt")
        params = [
            SamplingParams(
                max_tokens=self.max_new_tokens,
                temperature=temperature,
                top_p=1.0,
                top_k=0,
                seed=int(s) if temperature > 0 else None,
                stop_token_ids=self.eos_ids,
                detokenize=False,
            )
            for s in seeds
        ]
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=list(p)) for p in prompts], params, use_tqdm=False)
        return [cut_at_eos(list(o.outputs[0].token_ids), self.eos_ids) for o in outs]

    def close(self) -> None:
        """Shut the engine down and give its GPU memory back."""
        llm, self.llm = getattr(self, "llm", None), None
        if llm is not None:
            shutdown = getattr(llm.llm_engine, "engine_core", None)
            if shutdown is not None and hasattr(shutdown, "shutdown"):
                shutdown.shutdown()
            del llm
            gc.collect()
            torch.cuda.empty_cache()
        self.awake = False
