"""The aggregators' definitions in float64 torch, whole tensors at once: what
tests/channel/test_robust.py and test_quant.py hold the streaming aggregators to."""

from __future__ import annotations

import math

import torch

from fl_app.robust import Rule


def aggregate_reference(
    agg: str,
    w: dict[str, torch.Tensor],
    xs: list[dict[str, torch.Tensor]],
    weights: list[float],
    rule: Rule,
    eta: float = 1.0,
) -> dict[str, torch.Tensor]:
    """The aggregators' definitions in float64 torch, whole tensors at once."""
    f = torch.tensor(weights, dtype=torch.float64) / sum(weights)
    floats = [k for k in w if w[k].is_floating_point()]
    d = {k: torch.stack([x[k].double() - w[k].double() for x in xs]) for k in floats}
    norms = torch.sqrt(sum((d[k].flatten(1) ** 2).sum(1) for k in floats))
    out = {}
    for k in floats:
        xk = torch.stack([x[k].double() for x in xs])
        shape = (-1,) + (1,) * (xk.dim() - 1)
        if agg == "fedavg":
            a = (xk * f.view(shape)).sum(0)
        elif agg == "clipped":
            c = (
                rule.clip_multiple * norms.median()
                if len(xs) % 2
                else rule.clip_multiple * norms.sort().values[1:3].mean()
            )
            scale = torch.clamp(c / norms, max=1.0)
            a = w[k].double() + (d[k] * (f * scale).view(shape)).sum(0)
        elif agg == "median":
            a = torch.quantile(xk, 0.5, dim=0)
        else:
            b = math.floor(rule.trim_fraction * len(xs))
            a = xk.sort(0).values[b : len(xs) - b].mean(0)
        out[k] = w[k].double() + eta * (a - w[k].double())
    return out
