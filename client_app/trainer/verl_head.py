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
runs on. On the CPU it scores exactly as verl's own path (tests/test_engine_contract.py); under
CUDA autocast it differs from it by design: verl takes the log-softmax of bf16 logits, this
engine of fp32 ones, as builtin does.
"""

from __future__ import annotations

from typing import Any

import torch

from client_app.algos.logits import entropy_from_logits, token_log_probs


def response_positions(micro_batch: Any, width: int) -> torch.Tensor:
    """[B, width] mask of the padded positions whose next token is a response token: for a row
    of p prompt and r response tokens, positions p-1 .. p+r-2 (what `no_padding_2_padding` slices)."""
    attention, width_p = micro_batch["attention_mask"], micro_batch["prompts"].shape[1]  # the backend's layout
    prompt_lens, response_lens = attention[:, :width_p].sum(1), attention[:, width_p:].sum(1)
    if bool((prompt_lens == 0).any()):
        raise ValueError("a row has no prompt token: nothing predicts its first response token")
    j = torch.arange(width, device=prompt_lens.device)
    return (j >= (prompt_lens - 1)[:, None]) & (j < (prompt_lens + response_lens - 1)[:, None])


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

        _keep: torch.Tensor | None = None
        score_response_only = True  # False: verl's own full-logits path (the bench's baseline)

        def initialize(self) -> None:
            super().initialize()
            self.module.get_output_embeddings().register_forward_pre_hook(self._select)

        def _select(self, _head: torch.nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...] | None:
            """The output embedding's input, cut to the armed positions ([B, L, H] -> [N, H])."""
            keep = self._keep
            if keep is None:
                return None  # generation, or a layout verl scores itself
            (hidden,) = args
            if tuple(hidden.shape[:2]) != tuple(keep.shape):
                raise RuntimeError(
                    f"LM head input {tuple(hidden.shape)} does not match the positions {tuple(keep.shape)}"
                )
            return (hidden[keep],)

        def _ours(self, micro_batch: Any) -> bool:
            """The padded, unfused layout without extras: the one this engine scores itself."""

            def flag(key: str, default: bool) -> bool:
                return bool(tu.get_non_tensor_data(data=micro_batch, key=key, default=default))

            layout = set(micro_batch.keys())
            return (
                self.score_response_only
                and {"prompts", "attention_mask"} <= layout
                and not (
                    flag("use_remove_padding", True)
                    or flag("use_fused_kernels", False)
                    or flag("distillation_use_topk", False)
                    or flag("distillation_only", False)
                    or flag("calculate_sum_pi_squared", False)
                )
            )

        def prepare_model_inputs(self, micro_batch: Any) -> tuple[dict[str, Any], dict[str, Any]]:
            model_inputs, output_args = super().prepare_model_inputs(micro_batch)
            if self._ours(micro_batch):
                ids, positions = model_inputs["input_ids"], model_inputs["position_ids"]
                if positions.dim() == 2:
                    # rows are right-padded with positions 0..n-1, which the model derives itself:
                    # with neither a mask nor positions SDPA takes its causal kernel instead of a
                    # [B, heads, L, L] mask, and a real token never sees the pads after it
                    real = model_inputs["attention_mask"].bool()
                    if not bool((positions == torch.arange(ids.shape[1], device=ids.device))[real].all()):
                        raise ValueError("rows must be positioned 0..n-1 to be scored without a padding mask")
                    model_inputs["attention_mask"] = model_inputs["position_ids"] = None
                keep = response_positions(micro_batch, ids.shape[1]).to(ids.device)
                output_args["keep"] = keep
                output_args["labels"] = torch.roll(ids, shifts=-1, dims=1)[keep]
                self._keep = keep
            return model_inputs, output_args

        def forward_step(self, micro_batch: Any, loss_function: Any, forward_only: bool) -> Any:
            try:
                return super().forward_step(micro_batch, loss_function, forward_only)
            finally:
                self._keep = None  # never armed outside this micro-batch's forward

        def prepare_model_outputs(
            self, output: Any, output_args: dict[str, Any], micro_batch: Any, logits_processor_func: Any
        ) -> dict[str, Any]:
            keep = output_args.get("keep")
            if keep is None:
                return super().prepare_model_outputs(output, output_args, micro_batch, logits_processor_func)
            logits = output.logits.float()  # [N, V]: the kept positions, row-major; fp32 as builtin's
            if not output_args.get("temperature_is_one", False):
                rows = keep.nonzero()[:, 0]
                logits = logits / output_args["temperature"][rows].unsqueeze(-1)
            input_ids = micro_batch["input_ids"]  # nested: each row's real tokens
            cu_seqlens = input_ids.offsets()
            real = torch.arange(keep.shape[1], device=keep.device) < cu_seqlens.diff()[:, None]

            def nested(per_position: torch.Tensor) -> torch.Tensor:
                dense = per_position.new_zeros(keep.shape).masked_scatter(keep, per_position)
                return torch.nested.nested_tensor_from_jagged(dense[real], cu_seqlens)

            model_output = {"log_probs": nested(token_log_probs(logits, output_args["labels"]))}
            if tu.get_non_tensor_data(data=micro_batch, key="calculate_entropy", default=False):
                model_output["entropy"] = nested(entropy_from_logits(logits))
            return model_output

    return ResponseHeadEngine


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
