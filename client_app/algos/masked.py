"""Statistics over the valid tokens of a padded [B, T] batch.

Masks are 0/1 (bool or numeric) and mark the tokens the policy generated. Values at masked-out
positions are *never read*: they are selected away with `torch.where`, so NaN or inf left there by
padding cannot leak into a sum or a gradient (multiplying by 0 would turn inf into NaN).
"""

from __future__ import annotations

import torch


def masked_sum(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Sum of `values` where `mask` is set, over all elements or along `dim`."""
    kept = torch.where(mask.bool(), values, torch.zeros((), dtype=values.dtype, device=values.device))
    return kept.sum() if dim is None else kept.sum(dim=dim)


def masked_count(mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Number of set mask entries (an integer tensor)."""
    selected = mask.bool()
    return selected.sum() if dim is None else selected.sum(dim=dim)


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of `values` over the set mask entries; 0 where nothing is selected (no signal, no NaN)."""
    count = masked_count(mask, dim).to(values.dtype if values.is_floating_point() else torch.float32)
    return masked_sum(values, mask, dim) / count.clamp(min=1)


def masked_var(values: torch.Tensor, mask: torch.Tensor, unbiased: bool = True) -> torch.Tensor:
    """Variance of `values` over the whole mask (Bessel-corrected when `unbiased`)."""
    n = int(masked_count(mask))
    if unbiased and n < 2:
        raise ValueError(
            f"masked_var needs at least 2 valid tokens for an unbiased variance, got {n}; "
            "use a larger mini-batch or unbiased=False"
        )
    centered = values - masked_mean(values, mask)
    var = masked_mean(centered * centered, mask)
    return var * (n / (n - 1)) if unbiased else var


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, shift_mean: bool = True) -> torch.Tensor:
    """Normalise `values` to unit variance with statistics from the valid tokens only.

    With `shift_mean` the result has zero mean over the mask; without it the mean is kept.
    Every position is transformed (masked ones too); callers keep using the mask downstream.
    """
    mean = masked_mean(values, mask)
    scaled = (values - mean) * torch.rsqrt(masked_var(values, mask) + 1e-8)
    return scaled if shift_mean else scaled + mean
