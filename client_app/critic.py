"""The PPO critic: the policy's architecture with a one-output value head, and where the critic
of round 1 comes from.

The critic is `AutoModelForTokenClassification(num_labels=1)` over the policy's config (verl's
critic, so its tensors are the backbone's `model.*` plus `score.weight`, `score.bias`). It is
federated beside the actor (invariant 7), so the critic a run starts from matters as much as
the actor: field log 2026-07-24, "PPO warm start silently RESET the critic", where a
continuation run inherited a trained policy and opened with a random value baseline.
`resolve_start_critic` makes that choice explicit and records it:

  explicit      `algo.critic.path` names a weights dir; it must hold a value head
  auto-sibling  `model.init_from` is a round of an earlier run: the critic written beside it
  fresh         a new value head on the starting policy's backbone: the default of a run from a
                pretrained base, or `algo.critic.path: fresh` (a deliberate reset)

A warm start (`model.init_from`) whose round has no critic, without `algo.critic.path`, is an
error: nobody gets a random value head by accident.
"""

from __future__ import annotations

import copy
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from fl_app.rundir import sibling_member
from fl_app.weights import Manifest

log = logging.getLogger("fedagent.critic")

VALUE_HEAD = ("score.weight", "score.bias")
FRESH = "fresh"


@dataclass(frozen=True)
class CriticStart:
    """Where the starting critic comes from; `path` is empty for a fresh value head."""

    mode: str  # explicit | auto-sibling | fresh
    path: str
    reason: str

    def as_dict(self) -> dict[str, str]:
        return asdict(self)


def has_value_head(weights_dir: Path) -> bool:
    """True when the weights dir's manifest lists the value head tensors (no tensor is read)."""
    names = {t.name for t in Manifest.from_dir(Path(weights_dir)).tensors}
    return all(n in names for n in VALUE_HEAD)


def resolve_start_critic(init_from: str, critic_path: str) -> CriticStart:
    """The critic the trainer starts from (see the module doc); raises on every silent-reset trap."""
    if critic_path == FRESH:
        return CriticStart("fresh", "", "algo.critic.path=fresh: a new value head, deliberately")
    if critic_path:
        path = Path(critic_path).expanduser()
        if not has_value_head(path):
            raise ValueError(
                f"algo.critic.path={critic_path!r} holds no value head ({', '.join(VALUE_HEAD)}): it is not a "
                "critic (an actor checkpoint?). Point it at a critic weights dir (e.g. runs/x/rounds/round-0007/"
                "critic), set it to `fresh` to start a new value head deliberately, or leave it empty"
            )
        return CriticStart("explicit", str(path.resolve()), "algo.critic.path")
    if init_from:
        sibling = sibling_member(Path(init_from), "critic")
        if sibling is None:
            raise ValueError(
                f"model.init_from={init_from!r} has no critic beside it, so this PPO run would start a trained "
                "policy with a random value baseline (field log: 'PPO warm start silently RESET the critic'). "
                "Set algo.critic.path to a critic weights dir, or to `fresh` to start a new value head "
                "deliberately"
            )
        if not has_value_head(sibling):
            raise ValueError(
                f"{sibling} (the critic beside model.init_from) holds no value head; set algo.critic.path explicitly"
            )
        return CriticStart("auto-sibling", str(sibling.resolve()), f"the critic beside model.init_from={init_from}")
    return CriticStart("fresh", "", "a fresh run from the pretrained backbone: new value head (expected)")


def build_critic(policy: Any, seed: int) -> Any:
    """A value model with the policy's architecture and CURRENT backbone weights, and a fresh
    value head drawn from `seed` (normal(0, initializer_range), bias 0), in fp32 on the policy's
    device. Deterministic: the same policy and seed give the same critic bit for bit."""
    from transformers import AutoModelForTokenClassification

    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    critic = AutoModelForTokenClassification.from_config(config, dtype=torch.float32)
    critic.base_model.load_state_dict(policy.base_model.state_dict())
    with torch.no_grad():
        for name, value in seeded_value_head(critic.score.weight.shape, config, seed).items():
            critic.get_parameter(name).copy_(value)
    return critic.to(next(policy.parameters()).device).eval()


def seeded_value_head(shape: torch.Size | tuple[int, ...], config: Any, seed: int) -> dict[str, torch.Tensor]:
    """A fresh value head (`score.weight` ~ normal(0, initializer_range) from `seed`, `score.bias`
    0), fp32: the same head on every backend for the same seed."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(tuple(shape), generator=gen) * getattr(config, "initializer_range", 0.02)
    return {"score.weight": weight, "score.bias": torch.zeros(shape[0])}
