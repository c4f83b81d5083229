"""How the builtin engine computes: in fp32, under bf16 autocast over fp32 weights, or on a bf16
compute copy of fp32 master weights (`run.precision`); and with compiled layers (`run.compile`).

Whatever the mode, the weights that are loaded, optimized, anchored by FedProx, exported and
averaged are the fp32 masters (invariant 1); only the forward and backward passes change.
The bf16 compute copy is what makes a GPU update fast: under autocast the fp32 weights keep
the residual stream, norms, rotary and SwiGLU in fp32 and every matmul casts its weight again,
so memory-bound elementwise kernels and casts took most of the GPU's time
(docs/benchmarks.md, "Where the builtin update's time goes").
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable
from typing import Any, Literal

import torch

log = logging.getLogger("fedagent.trainer.compute")

Precision = Literal["fp32", "autocast", "bf16"]
RECOMPILE_LIMIT = 64  # graphs per compiled function (compile_layers)


def resolve_precision(choice: str, device: torch.device) -> Precision:
    """`auto`: the bf16 compute copy on CUDA, fp32 on the CPU (exactly reproducible there)."""
    if choice == "auto":
        return "bf16" if device.type == "cuda" else "fp32"
    if choice not in ("fp32", "autocast", "bf16"):  # the config refuses these; a direct caller may not
        raise ValueError(f"run.precision={choice!r} is none of auto, fp32, autocast, bf16")
    return choice  # type: ignore[return-value]


def autocast_dtype(precision: Precision) -> torch.dtype | None:
    """The autocast dtype forward passes run under (only `autocast` has one)."""
    return torch.bfloat16 if precision == "autocast" else None


class ComputeCopy:
    """The module one member's forward and backward passes run on.

    `fp32` and `autocast`: the master module itself, and `fold_grads` / `refresh` do nothing.
    `bf16`: a bf16 copy of it. After each backward, `fold_grads` adds the copy's gradients into
    the masters' fp32 `.grad` and drops them, so gradient accumulation over micro-batches sums
    in fp32; after every optimizer step or weight load, `refresh` casts the masters into the
    copy again (round to nearest: the same bits vLLM gets from the masters). Only parameters are
    cast; buffers (the rotary frequencies) keep their fp32 values (`bf16_parameters`).
    """

    def __init__(self, master: torch.nn.Module, precision: Precision) -> None:
        self.is_copy = precision == "bf16"
        self.masters = list(master.parameters())  # tied weights once, as the optimizer sees them
        # Any: a transformers model (its heads are attributes mypy cannot see through nn.Module)
        self.module: Any = bf16_parameters(copy.deepcopy(master)) if self.is_copy else master
        self.copies = list(self.module.parameters())

    def fold_grads(self) -> None:
        """Move the copy's gradients into the masters' (fp32 sums); no-op without a copy."""
        if not self.is_copy:
            return
        for m, c in zip(self.masters, self.copies):
            if c.grad is None:
                continue
            if m.grad is None:
                m.grad = c.grad.float()
            else:
                m.grad.add_(c.grad)
            c.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """Cast the masters into the copy; no-op without a copy."""
        if not self.is_copy:
            return
        for m, c in zip(self.masters, self.copies):
            c.copy_(m)

    def drop_grads(self) -> None:
        """Forget the copy's gradients (fold_grads already moved them; this covers an aborted step)."""
        for c in self.copies:
            c.grad = None


def bf16_parameters(module: torch.nn.Module) -> torch.nn.Module:
    """`module` with its parameters cast to bf16 in place and its buffers left alone.
    `module.to(torch.bfloat16)` would also round the rotary embedding's fp32 `inv_freq`, which
    moves a token at position p by p x inv_freq x 2^-9 radians: half a radian and more in the
    recipes' 300-900-token prompts, where autocast and vLLM keep the frequencies in fp32.
    Tied parameters stay tied (one Parameter object, its data replaced once)."""
    for p in module.parameters():
        p.data = p.data.to(torch.bfloat16)
    return module


def compile_models(models: Iterable[torch.nn.Module]) -> None:
    """`run.compile` for an engine: `compile_layers` on each of its models (policy, reference, critic)."""
    for model in models:
        compile_layers(model)
    log.info("run.compile: decoder layers compile on first use (the lane's first fit pays for it)")


def compile_layers(model: torch.nn.Module) -> None:
    """Compile each decoder layer of `model` for the passes without a KV cache (scoring and
    training), with dynamic shapes; cached passes (Hugging Face `generate`) stay eager, so
    generation's growing cache never triggers a recompilation. Every layer runs the same code,
    so one compilation serves them all. Inductor fuses what runs between the matmuls: norms,
    rotary, SwiGLU, residual adds and casts.

    A lane compiles one graph per grad mode and parameter kind, and again where a batch crosses a
    size the compiled code assumed (a one-row micro-batch; token counts on either side of a kernel
    choice's threshold): on the H200 the smollm recipe passed dynamo's default limit of 8 graphs
    per function within 4 fits, after which new shapes silently ran eager. The limit is process
    wide, and the lane service is the trainer's own process: it is raised to `RECOMPILE_LIMIT`."""
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILE_LIMIT)
    layers = getattr(getattr(model, "base_model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or not layers:
        raise ValueError(
            f"run.compile needs a decoder whose layers are `base_model.layers` (Llama, Qwen2, Mistral, ...); "
            f"{type(model).__name__} has none: set run.compile: false"
        )
    for layer in layers:
        eager = layer.forward
        compiled = torch.compile(eager, dynamic=True)

        def forward(*args: Any, _eager: Any = eager, _compiled: Any = compiled, **kwargs: Any) -> Any:
            return (_eager if kwargs.get("past_key_values") is not None else _compiled)(*args, **kwargs)

        layer.forward = forward
