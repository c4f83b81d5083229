"""The contract between the trainer service and the lane's trainer (`loop.RLTrainer`).

A trainer is persistent: it is built once per GPU lane and serves many client fits in turn.
Per fit it swaps weights in, rebuilds only the optimizer and LR schedule (a fresh AdamW per
fit is what FedAvg assumes), trains, and exports fp32 weights. Weights come in named members:
`actor` always, `critic` too for PPO (invariant 7: the critic is federated beside the policy).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Protocol

import torch

from client_app.critic import CriticStart


@dataclass(frozen=True)
class FitRequest:
    """One client's local training in one round."""

    round: int  # federated round (1-based)
    client_id: int  # logical client id in [0, federation.clients)
    task_indices: list[int]  # the client's shard: env task indices it may draw from
    local_epochs: int  # E: RL iterations (rollout batch + update) in this fit
    seed: int  # master seed; row seeds derive from (seed, round, client, epoch, index)
    proximal_mu: float = 0.0  # FedProx mu; anchor = the weights loaded for this fit; policy only
    # the client's env variant (issue 19): the env service serving it and the variant's content
    # hash that service must report; empty: the trainer's own (unperturbed) env service
    env_url: str = ""
    env_variant: str = ""


@dataclass
class FitResult:
    num_examples: int  # weight of this client in FedAvg (episodes trained on)
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class EvalRequest:
    task_indices: list[int]  # the fixed validation set
    seed: int  # decoding seed (fixed across rounds)


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

    def fit(self, req: FitRequest) -> FitResult: ...

    def evaluate(self, req: EvalRequest) -> EvalResult: ...

    def close(self) -> None:
        """Release everything the trainer holds (env sessions, device memory)."""
        ...
