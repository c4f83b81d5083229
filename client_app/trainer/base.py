"""The contract between the trainer service and the lane's trainer (`loop.RLTrainer`).

A trainer is persistent: it is built once per GPU lane and serves many client fits in turn.
Per fit it swaps weights in, rebuilds only the optimizer and LR schedule (a fresh AdamW per
fit is what FedAvg assumes), trains, and exports fp32 weights. A fit is the server's `FitCall`
itself (fl_app.calls), with the client's tasks its lane resolved (`ClientTasks`). Weights come in named members:
`actor` always, `critic` too for PPO (invariant 7: the critic is federated beside the policy).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from client_app.critic import CriticStart
from fl_app.calls import EvalCall, FitCall


@dataclass(frozen=True)
class ClientTasks:
    """What a client trains on, as its lane resolves it from the call's client id: its shard of
    the env's tasks and, under environment heterogeneity, the env service of its variant and the
    variant's content hash that service must report (empty: the trainer's own env service)."""

    task_indices: list[int]
    env_url: str = ""
    env_variant: str = ""


@dataclass
class FitResult:
    num_examples: int  # weight of this client in FedAvg (episodes trained on)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class EvalResult:
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)  # success, reward, per-type breakdowns
    outcomes: dict[int, bool] = field(default_factory=dict)  # task index -> won (labelling; one episode per task)


class Trainer(Protocol):
    @property
    def critic_start(self) -> CriticStart | None:
        """Where the starting critic came from; None for an algorithm without a critic."""
        ...

    @property
    def members(self) -> tuple[str, ...]:
        """The weights this trainer exchanges, e.g. ("actor",) or ("actor", "critic")."""
        ...

    @property
    def base_sha256(self) -> str:
        """`federation.update: lora`: the digest of the frozen base its adapters add to; "" otherwise."""
        ...

    @property
    def lost(self) -> str | None:
        """Why this trainer serves no more calls (its lane over several ranks lost them at a
        failure), or None: its service then exits, and its lane starts a fresh one."""
        ...

    def load_weights(self, state: Mapping[str, torch.Tensor], member: str = "actor") -> None:
        """Copy fp32 weights into the live `member` model in place (no rebuild)."""
        ...

    def export_weights(self, member: str = "actor") -> dict[str, torch.Tensor]:
        """The fp32 master weights of `member`, detached CPU copies, names as in `load_weights`."""
        ...

    def master_weights(self, member: str = "actor") -> dict[str, torch.Tensor]:
        """The same weights without the copy where possible (on the trainer's device, read-only,
        stale after the next load or fit): what the service writes out after a fit."""
        ...

    def fit(self, call: FitCall, tasks: ClientTasks) -> FitResult: ...

    def evaluate(self, call: EvalCall, task_indices: Sequence[int]) -> EvalResult: ...

    def close(self) -> None:
        """Release everything the trainer holds (env sessions, device memory)."""
        ...
