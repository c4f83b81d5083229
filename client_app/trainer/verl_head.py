"""verl's FSDP2 language-model engine, scoring only the positions its losses read.

Without flash-attn (`use_remove_padding: false`: the CPU, and GPU images without the package)
verl 0.9.1 applies the LM head at every position of every padded row, prompt and padding
included, and takes the log-softmax of those logits one token at a time (its fallback when
flash-attn's cross-entropy is absent). Its PPO loss and the log-prob scoring then read only the
positions that predict a response token (`no_padding_2_padding`). A windowed row is mostly
prompt, so nearly all of that work is thrown away.

`ResponseHeadEngine` is verl's `FSDPEngineWithLMHead` with the LM head applied to those positions
only (a forward pre-hook on the output embedding selects their hidden states) and the
log-probs and entropy computed in one vectorised fp32 pass by the functions builtin uses
(`client_app.algos.logits`). Positions nothing reads get zeros. As in builtin, the right-padded
rows go to the model without a padding mask (SDPA's causal kernel; the pads come after every
position that is read, so nothing read depends on them). Every other layout (packed
sequences, fused kernels, distillation) is verl's own code path, unchanged. It is registered
through verl's `EngineRegistry` (its extension point for engines) for the device the backend
runs on. On the CPU it scores exactly as verl's own path (tests/trainer/test_engine_contract.py); under
CUDA autocast it differs from it by design: verl takes the log-softmax of bf16 logits, this
engine of fp32 ones, as builtin does.

Where those positions are is worked out on the host (`HostLayout`), from the micro-batch verl
has not yet moved, and reaches the device as indices: selecting them with boolean masks on the
device, as verl's losses also slice each row by lengths read there, makes the host wait for the
device at every such step, and a GPU pass is bound by host time.

For the same reason AdamW and the gradient clip step the shards' local tensors (`LocalShards`)
rather than FSDP2's DTensor parameters, without DTensor's per-op dispatch over every parameter
at every step. AdamW is elementwise, so stepping each shard is stepping the tensor, on one rank
(a DTensor holds its whole tensor there) as on k; the clip needs the norm of the whole gradient,
which over k ranks is the square root of the ranks' summed squared shard norms.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any, cast

import torch

from client_app.algos.logits import entropy_from_logits, token_log_probs

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class HostLayout:
    """Where the positions this engine scores sit, worked out on the host from the micro-batch
    before verl moves it to the device: with these indices no step of a pass waits for the
    device (a boolean mask applied on the device must first read how many it selects)."""

    shape: tuple[int, int]  # (rows, width) of the padded ids the model sees: width = the longest row
    tokens: int  # real tokens of the micro-batch (the packed layout's length)
    keep: torch.Tensor  # [N] flat index into [rows * width] of each position that predicts a response token
    rows: torch.Tensor  # [N] its row
    slots: torch.Tensor  # [N] its index in the packed layout (each row's real tokens, row after row)
    labels: torch.Tensor  # [N] the response token it predicts
    positioned: bool  # every row positioned 0..n-1 (what lets the model go without a padding mask)

    @classmethod
    def of(cls, micro_batch: Any) -> HostLayout:
        """For a row of p prompt and r response tokens, positions p-1 .. p+r-2 (what verl's
        `no_padding_2_padding` slices), in row-major order."""
        # the backend's layout, on the host already (a copy if it came on the device)
        attention, width_p = micro_batch["attention_mask"].cpu(), micro_batch["prompts"].shape[1]
        prompt_lens, response_lens = attention[:, :width_p].sum(1), attention[:, width_p:].sum(1)
        if bool((prompt_lens == 0).any()):
            raise ValueError("a row has no prompt token: nothing predicts its first response token")
        lengths = prompt_lens + response_lens
        width, n, tokens = int(lengths.max()), int(response_lens.sum()), int(lengths.sum())
        rows = torch.repeat_interleave(torch.arange(len(lengths)), response_lens)
        first = torch.cumsum(response_lens, 0) - response_lens  # each row's first kept position, in [N]
        cols = prompt_lens[rows] - 1 + torch.arange(n) - first[rows]
        starts = torch.cumsum(lengths, 0) - lengths
        positions = micro_batch["position_ids"].cpu()
        expected = torch.arange(tokens) - torch.repeat_interleave(starts, lengths)
        return cls(
            shape=(len(lengths), width),
            tokens=tokens,
            keep=rows * width + cols,
            rows=rows,
            slots=starts[rows] + cols,
            labels=micro_batch["responses"].cpu()[attention[:, width_p:].bool()],
            positioned=positions.dim() == 2 and torch.equal(positions.values(), expected),
        )

    def to(self, device: torch.device) -> HostLayout:
        """The indices on `device`, copied without waiting for it."""
        move = partial(torch.Tensor.to, device=device, non_blocking=True)
        return replace(
            self, keep=move(self.keep), rows=move(self.rows), slots=move(self.slots), labels=move(self.labels)
        )


class LocalShards:
    """An FSDP2 module's trained parameters as the plain tensors this rank's DTensor shards hold
    (the same storage: stepping these steps the module). FSDP2 reduces each gradient into the
    DTensor's own `.grad`; `take_grads` hands each tensor its local part before a step. A shard
    whose storage has moved since (a `model.to()`, an offload) would leave the optimizer
    stepping a dead copy: that is an error."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.params = [cast("DTensor", p) for p in module.parameters() if p.requires_grad]
        self.tensors = [p._local_tensor for p in self.params]  # DTensor's own storage, no copy

    def take_grads(self) -> None:
        for param, tensor in zip(self.params, self.tensors):
            if param._local_tensor.data_ptr() != tensor.data_ptr():
                raise RuntimeError(
                    f"an FSDP2 shard of shape {tuple(param.shape)} moved after the optimizer was built "
                    "(the module was moved or offloaded): the optimizer would step a stale copy"
                )
            tensor.grad = None if param.grad is None else cast("DTensor", param.grad)._local_tensor

    def zero_grad(self) -> None:
        for param, tensor in zip(self.params, self.tensors):
            param.grad = tensor.grad = None

    def clip_(self, max_norm: float) -> float:
        """Clip the gradients to `max_norm` by the norm of the whole gradient, returned: on one
        rank torch's `clip_grad_norm_`; over k ranks each rank's squared shard norm is summed
        over the engine's process group first, so every rank clips by the same global norm (and
        skips the same non-finite step)."""
        if torch.distributed.get_world_size() == 1:
            return torch.nn.utils.clip_grad_norm_(self.tensors, max_norm=max_norm).item()
        grads = [t.grad for t in self.tensors if t.grad is not None]
        squared = torch.nn.utils.get_total_norm(grads).pow(2)
        torch.distributed.all_reduce(squared)
        norm = squared.sqrt()
        torch.nn.utils.clip_grads_with_norm_(self.tensors, max_norm, norm)
        return norm.item()


def engine_class() -> type[Any]:
    """The engine class (built on first use: verl's engine modules read the platform on import)."""
    global _ENGINE
    if _ENGINE is None:
        _ENGINE = _build_engine_class()
    return _ENGINE


_ENGINE: type[Any] | None = None


def _build_engine_class() -> type[Any]:
    from verl.utils import tensordict_utils as tu
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    class ResponseHeadEngine(FSDPEngineWithLMHead):
        """verl's FSDP2 LM engine with the LM head applied at the response positions only."""

        _host: HostLayout | None = None  # the micro-batch being scored, while its forward runs
        _armed: HostLayout | None = None  # the same on the device, from its inputs to its outputs
        score_response_only = True  # False: verl's own full-logits path (the bench's baseline)
        _shards: LocalShards | None = None  # what the optimizer steps (none: a forward-only engine)

        def initialize(self) -> None:
            super().initialize()
            self.module.get_output_embeddings().register_forward_pre_hook(self._select)

        def _build_optimizer(self, module: torch.nn.Module) -> Any:
            """verl's optimizer, over this rank's shards' local tensors (`LocalShards`), and a
            step that is clip + AdamW only (no fp16 loss scaler, no QAT: the backend sets neither)."""
            from verl.workers.config.optimizer import build_optimizer

            if self.scaler is not None or self._qat_enabled:
                raise RuntimeError(
                    "the verl engine steps its shards with clip + AdamW only: an fp16 loss scaler or QAT "
                    "cannot be armed here"
                )
            self._shards = LocalShards(module)
            return build_optimizer(self._shards.tensors, self.optimizer_config)

        def optimizer_zero_grad(self) -> None:
            if self._shards is None:
                return super().optimizer_zero_grad()
            self._shards.zero_grad()  # FSDP2 adds into a DTensor gradient that is not None

        def optimizer_step(self) -> float:
            """verl's step (clip, skip a non-finite norm, AdamW) on the local tensors."""
            if self._shards is None:
                return super().optimizer_step()
            self._shards.take_grads()
            norm = self._shards.clip_(self.optimizer_config.clip_grad)
            if math.isfinite(norm):
                self.optimizer.step()
            else:
                log.warning("grad norm is %s: the step is skipped", norm)
                self._shards.zero_grad()
            return norm

        def _select(self, _head: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            """The output embedding's input, cut to the armed positions ([B, L, H] -> [N, H])."""
            layout = self._armed
            if layout is None:
                return None  # generation, or a layout verl scores itself
            (hidden,) = args
            if tuple(hidden.shape[:2]) != layout.shape:
                raise RuntimeError(f"LM head input {tuple(hidden.shape)} does not match the positions {layout.shape}")
            return (hidden.flatten(0, 1).index_select(0, layout.keep),)

        def _ours(self, micro_batch: Any) -> bool:
            """The padded, unfused layout without extras: the one this engine scores itself."""

            def flag(key: str, default: bool) -> bool:
                return bool(tu.get_non_tensor_data(data=micro_batch, key=key, default=default))

            layout = set(micro_batch.keys())
            return (
                self.score_response_only
                and {"prompts", "responses", "attention_mask", "position_ids"} <= layout
                and not (
                    flag("use_remove_padding", True)
                    or flag("use_fused_kernels", False)
                    or flag("distillation_use_topk", False)
                    or flag("distillation_only", False)
                    or flag("calculate_sum_pi_squared", False)
                )
            )

        def forward_step(self, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
            """verl's, with the micro-batch's layout read here, on the host, before verl moves it."""
            if self._ours(micro_batch):
                self._host = HostLayout.of(micro_batch)
                if loss_function is not None:
                    loss_function = partial(_host_lengths, loss_function, micro_batch["attention_mask"].cpu())
            try:
                return super().forward_step(micro_batch, loss_function, forward_only)
            finally:
                self._host = self._armed = None  # never armed outside this micro-batch's forward

        def prepare_model_inputs(self, micro_batch: Any) -> tuple[dict[str, Any], dict[str, Any]]:
            model_inputs, output_args = super().prepare_model_inputs(micro_batch)
            if self._host is not None:
                ids, positions = model_inputs["input_ids"], model_inputs["position_ids"]
                if positions.dim() == 2:
                    # rows are right-padded with positions 0..n-1, which the model derives itself:
                    # with neither a mask nor positions SDPA takes its causal kernel instead of a
                    # [B, heads, L, L] mask, and a real token never sees the pads after it
                    if not self._host.positioned:
                        raise ValueError("rows must be positioned 0..n-1 to be scored without a padding mask")
                    model_inputs["attention_mask"] = model_inputs["position_ids"] = None
                self._armed = output_args["layout"] = self._host.to(ids.device)
            return model_inputs, output_args

        def prepare_model_outputs(
            self, output: Any, output_args: dict[str, Any], micro_batch: Any, logits_processor_func: Any
        ) -> dict[str, Any]:
            layout: HostLayout | None = output_args.get("layout")
            if layout is None:
                return super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
            logits = output.logits.float()  # [N, V]: the kept positions, row-major; fp32 as builtin's
            if not output_args.get("temperature_is_one", False):
                logits = logits / output_args["temperature"][layout.rows].unsqueeze(-1)
            cu_seqlens = micro_batch["input_ids"].offsets()  # nested: each row's real tokens

            def nested(per_position: torch.Tensor) -> torch.Tensor:
                packed = per_position.new_zeros(layout.tokens).index_copy(0, layout.slots, per_position)
                return torch.nested.nested_tensor_from_jagged(packed, cu_seqlens)

            model_output = {"log_probs": nested(token_log_probs(logits, layout.labels))}
            if tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False):
                model_output["entropy"] = nested(entropy_from_logits(logits))
            return model_output

    return ResponseHeadEngine


def _host_lengths(
    loss_function: Any, attention_mask: torch.Tensor, model_output: Any, data: Any, dp_group: Any = None
) -> Any:
    """verl's loss, reading the rows' lengths from the host copy of the attention mask. Its losses
    cut each row's response out of the packed outputs in a Python loop over the rows
    (`no_padding_2_padding`), slicing by lengths it sums from `data["attention_mask"]`: on the
    device, every row's slice waits for the device twice."""
    host = data.copy()  # shallow: only the mask is swapped
    host.clear_device_()
    host["attention_mask"] = attention_mask
    return loss_function(model_output=model_output, data=host, dp_group=dp_group)


def register(device: str) -> None:
    """Make verl build `ResponseHeadEngine` for language models with the fsdp2 backend on
    `device` ("cpu": the key this backend registers; "cuda": the platform vendor's key, which
    verl looks up before its own vendor-less one). Idempotent; another class already on the
    key is an error, never overwritten."""
    from verl.utils.device import get_vendor
    from verl.workers.engine import EngineRegistry

    key: Any = device if device == "cpu" else (device, get_vendor())
    registry = EngineRegistry._engines.setdefault("language_model", {}).setdefault("fsdp2", {})
    ours = engine_class()
    if registry.get(key) is ours:
        return
    if key in registry:
        raise RuntimeError(f"verl already has {registry[key].__name__} for language models on {key!r}")
    vendor = None if device == "cpu" else key[1]
    EngineRegistry.register(model_type="language_model", backend=["fsdp2"], device=device, vendor=vendor)(ours)
