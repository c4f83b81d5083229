"""FedProx: the proximal term mu/2 * ||w - w_t||^2 over the POLICY parameters only.

w_t is the round-start global model: the weights loaded for this fit. Its snapshot (the anchor)
is held as detached fp32 copies, taken right after the load and released before the next load,
so a persistent trainer never holds two anchors (field log 2026-07-29: an anchor left alive
across a rebuild). The critic and the reference model are never anchored (field log 2026-07-23:
"FedProx anchored the PPO critic too"): the trainer passes the actor's parameters only.

Two equivalent ways to apply it, both giving each parameter the extra gradient mu * (w - w_t):
  * add `anchor.term(actor.named_parameters(), mu)` to ONE backward per optimizer step;
  * or call `anchor.add_grad_(actor.named_parameters(), mu)` after the micro-batch backwards
    and before gradient clipping (it is then the same as having the term in the loss).
Adding the term to every micro-batch loss would apply it once per micro-batch: don't.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

NamedParams = Iterable[tuple[str, torch.Tensor]]


def _checked_pairs(params: NamedParams, anchor: Mapping[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Pair each parameter with its anchor; the name sets must agree exactly (fail closed)."""
    pairs, seen = [], set()
    for name, param in params:
        if name not in anchor:
            raise KeyError(
                f"FedProx anchor has no entry for parameter {name!r}; snapshot the same module you regularise"
            )
        seen.add(name)
        pairs.append((param, anchor[name]))
    missing = set(anchor) - seen
    if missing:
        raise KeyError(
            f"FedProx anchor entries without a parameter: {sorted(missing)[:5]} (of {len(missing)}); "
            "pass the same named parameters the anchor was taken from"
        )
    return pairs


def _check_mu(mu: float) -> None:
    if mu < 0:
        raise ValueError(f"FedProx mu must be >= 0, got {mu}")


def fedprox_term(params: NamedParams, anchor: Mapping[str, torch.Tensor], mu: float) -> torch.Tensor:
    """mu/2 * sum_k ||w_k - anchor_k||^2, computed in fp32; its gradient on w_k is mu * (w_k - anchor_k)."""
    _check_mu(mu)
    pairs = _checked_pairs(params, anchor)
    if not pairs:
        raise ValueError("FedProx got no parameters; pass the policy's named_parameters()")
    total = torch.zeros((), dtype=torch.float32, device=pairs[0][0].device)
    for param, ref in pairs:
        total = total + (param.float() - ref).square().sum()
    return 0.5 * mu * total


class FedProxAnchor:
    """Detached fp32 copies of the policy parameters at the moment the round's weights were loaded.

    Usage per fit: `anchor = FedProxAnchor.snapshot(actor.named_parameters())` right after
    `load_weights`, apply it during training, `anchor.release()` when the fit ends (before the
    next load). Using a released anchor raises: FedProx must never silently degrade to FedAvg.
    """

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self._tensors: dict[str, torch.Tensor] | None = tensors

    @classmethod
    def snapshot(cls, params: NamedParams) -> FedProxAnchor:
        """Copy the given parameters (same device, fp32, no graph)."""
        tensors = {name: p.detach().to(dtype=torch.float32, copy=True) for name, p in params}
        if not tensors:
            raise ValueError("FedProx snapshot got no parameters; pass the policy's named_parameters()")
        return cls(tensors)

    @property
    def tensors(self) -> Mapping[str, torch.Tensor]:
        if self._tensors is None:
            raise RuntimeError("FedProx anchor was released; take a new snapshot after loading the round's weights")
        return self._tensors

    @property
    def released(self) -> bool:
        return self._tensors is None

    def term(self, params: NamedParams, mu: float) -> torch.Tensor:
        """The proximal loss term (see `fedprox_term`)."""
        return fedprox_term(params, self.tensors, mu)

    @torch.no_grad()
    def add_grad_(self, params: NamedParams, mu: float) -> None:
        """In place: p.grad += mu * (p - anchor) for every parameter (a None grad counts as zero)."""
        _check_mu(mu)
        for param, ref in _checked_pairs(params, self.tensors):
            delta = (param.float() - ref).mul_(mu).to(param.dtype)
            if param.grad is None:
                param.grad = delta
            else:
                param.grad.add_(delta)

    def release(self) -> None:
        """Drop the copies so their memory can be returned (idempotent)."""
        self._tensors = None
