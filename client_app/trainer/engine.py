"""The narrow interfaces between a training engine and what drives it.

A training engine owns the models (policy, reference, critic) and their optimizers on one lane,
and knows how to score and train rows; it knows nothing of rounds, tasks, rollouts or
advantages. Two implement it: `builtin.BuiltinEngine` (torch + transformers) and
`verl_backend.VerlEngine` (verl 0.9.1's FSDP2 engine). Each implements two small protocols, one
per kind of caller, so each caller sees only what it uses:

  * `RolloutPolicy`: what a rollout engine (`rollouts.Rollouts`: hf `generate` or a vLLM sync)
    needs, the live policy;
  * `TrainingEngine`: what the fit loop (`loop.py`) needs, the members' weights, scoring and
    optimizer steps.

`tests/trainer/test_engine_contract.py` holds every engine to both.

Rows (`client_app.rollout.TrainRow`) carry token ids and a generated-token mask; per-row
quantities (log-probs, values, advantages, returns) are 1-D fp32 tensors over a row's response
tokens, as the loop passes them around.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol, overload

import torch

from client_app.algos import ActorLossSpec, AggNorm, ValueLossSpec
from client_app.critic import CriticStart
from client_app.rollout import TrainRow

# Whose scores: the policy's and the reference's log-probs, or the critic's values.
Role = Literal["policy", "reference", "critic"]


@dataclass(frozen=True)
class PolicyBatch:
    """One policy mini-batch: rows, and per row the rollout-time (old) log-probs, advantages and,
    when the loss has a KL term, the reference's log-probs. `norm`: the loss denominators of
    the whole mini-batch when this rank holds only part of it (a lane over several ranks,
    `ranks.RowLayout`); None: `mini_batch_norm` of these rows."""

    rows: Sequence[TrainRow]
    old_log_probs: Sequence[torch.Tensor]
    advantages: Sequence[torch.Tensor]
    ref_log_probs: Sequence[torch.Tensor] | None
    norm: AggNorm | None = None


@dataclass(frozen=True)
class ValueBatch:
    """One critic mini-batch: rows, and per row the rollout-time values and the value targets."""

    rows: Sequence[TrainRow]
    old_values: Sequence[torch.Tensor]
    returns: Sequence[torch.Tensor]


@dataclass(frozen=True)
class StepResult:
    """One optimizer step's outcome. `metrics` are the mini-batch's loss terms (policy: pg_loss,
    entropy, kl_loss, pg_clipfrac, ppo_kl, pg_clipfrac_lower; critic: loss, clipfrac);
    `stepped` is False when a non-finite gradient norm made the engine skip the step."""

    metrics: dict[str, float]
    grad_norm: float
    stepped: bool


# A step's mini-batch and loss: both the policy's or both the critic's (`TrainingEngine.step`).
Batch = PolicyBatch | ValueBatch
LossSpec = ActorLossSpec | ValueLossSpec


class RolloutPolicy(Protocol):
    """What a rollout engine needs of the training engine: the policy it holds right now."""

    device: torch.device
    tokenizer: Any
    amp_dtype: torch.dtype | None  # the autocast dtype its forward passes (and hf generation) run under

    def generation_model(self) -> torch.nn.Module:
        """The live policy, in eval mode, for Hugging Face `generate` (rollout.engine: hf)."""
        ...

    def policy_tensors(self) -> Iterable[tuple[str, torch.Tensor]]:
        """The policy's full tensors under Hugging Face names, one at a time, for a rollout
        engine's in-place weight sync (rollout.engine: vllm)."""
        ...


class TrainingEngine(Protocol):
    """What the fit loop needs of a training engine: weights in and out, scores, steps."""

    critic_start: CriticStart | None  # where the starting critic came from; None without a critic
    base_sha256: str  # federation.update: lora: the frozen base's digest (client_app/trainer/lora.py); else ""
    # its weights are spread over the lane's ranks (verl's FSDP2 over k ranks): every call that
    # reads or writes them (load, export, score, step, generation) is made on every rank at once
    sharded: bool

    @property
    def members(self) -> tuple[str, ...]:
        """The weights this engine holds and exchanges: ("actor",) or ("actor", "critic")."""
        ...

    def load_weights(self, state: Mapping[str, torch.Tensor], member: str = "actor") -> None:
        """Copy fp32 weights into the live `member` model in place (names, shapes, fp32 checked)."""
        ...

    def export_weights(self, member: str = "actor") -> dict[str, torch.Tensor]:
        """The fp32 master weights of `member`: detached CPU copies (load then export is the identity)."""
        ...

    def master_weights(self, member: str = "actor") -> dict[str, torch.Tensor]:
        """`export_weights` without the copy where the engine holds full fp32 masters (builtin:
        its parameters, detached, on its device), for writing them out at once: read-only, and
        stale after the next load or train step. An engine whose masters are sharded returns
        `export_weights`."""
        ...

    def parameters(self, member: str = "actor") -> Iterable[tuple[str, torch.nn.Parameter]]:
        """`member`'s trainable parameters as its optimizer sees them, gradients included
        (FedProx anchors the policy's and adds its gradient to them, invariant 4)."""
        ...

    def begin_fit(self, reference_from_policy: bool) -> None:
        """Fresh optimizers and LR schedules for every trained member (invariant 3); with
        `reference_from_policy`, the reference model takes the policy's current weights."""
        ...

    def end_fit(self) -> None:
        """Release optimizer state and gradients (invariant 24)."""
        ...

    def score(self, rows: Sequence[TrainRow], role: Role) -> list[torch.Tensor]:
        """Per response token of each row, without gradient: the log-probs under the policy or
        the reference at the sampling temperature, or the critic's values."""
        ...

    @overload
    def step(
        self, batch: PolicyBatch, loss: ActorLossSpec, after_backward: Callable[[], None] | None = None
    ) -> StepResult: ...

    @overload
    def step(
        self, batch: ValueBatch, loss: ValueLossSpec, after_backward: Callable[[], None] | None = None
    ) -> StepResult: ...

    def step(self, batch: Batch, loss: LossSpec, after_backward: Callable[[], None] | None = None) -> StepResult:
        """One optimizer step of the member the batch is for (a `PolicyBatch` the policy, a
        `ValueBatch` the critic) on one mini-batch: gradients accumulated over micro-batches of
        the loss normalised by the WHOLE mini-batch (micro-batching changes memory, not the
        gradient), `after_backward` (FedProx, the policy only) before the clip, then the step."""
        ...

    def close(self) -> None:
        """Drop the models and their memory."""
        ...


class Engine(RolloutPolicy, TrainingEngine, Protocol):
    """Both parts, as every engine class implements them: what `make_engine` builds and the
    trainer holds (it hands the rollout engine one part and its loop the other)."""


def mini_batch_norm(tokens: Sequence[int], horizon: int | None) -> AggNorm:
    """Loss denominators of a mini-batch whose rows hold `tokens` generated tokens each: its
    tokens, its rows (as verl counts them), the horizon."""
    return AggNorm(num_tokens=float(sum(tokens)), num_seqs=float(len(tokens)), horizon=horizon)


def length_order(rows: Sequence[TrainRow]) -> list[int]:
    """Row indices by sequence length (prompt + response): consecutive rows pad little."""
    return sorted(range(len(rows)), key=lambda i: len(rows[i].prompt_ids) + len(rows[i].response_ids))


def micro_batches(rows: Sequence[TrainRow], micro: int, max_tokens: int | None = None) -> list[list[int]]:
    """Row indices in micro-batches of rows of similar length (less padding): at most `micro` rows
    each and, with `max_tokens` (`algo.micro_batch_tokens`), at most that many padded tokens (rows x
    the longest; a row longer than the budget goes alone). A mini-batch's loss is normalised over
    all of its rows, so how it is cut changes memory and speed only."""
    batches: list[list[int]] = []
    for i in length_order(rows):
        width = len(rows[i].prompt_ids) + len(rows[i].response_ids)  # the longest so far: sorted
        last = batches[-1] if batches else []
        if not last or len(last) == micro or (max_tokens is not None and (len(last) + 1) * width > max_tokens):
            batches.append([i])
        else:
            last.append(i)
    return batches
