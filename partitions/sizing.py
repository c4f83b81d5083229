"""The two global primitives the coverage and hardness partitions share (notes §2.2, §2.3).

`client_sizes` draws N Beta-distributed sizes between `low` and `high` that sum EXACTLY to the
target number of assignments; `assign_with_overlap` places every pool item into k distinct
clients (k = floor(r) or ceil(r)) in proportion to each client's remaining capacity. Both
consume one `numpy.random.Generator` in a fixed order, so every process that replays them from
the same seed gets the same global allocation (invariant 11).
"""

from __future__ import annotations

import math

import numpy as np

MIN_CONCENTRATION = 2e-3  # [code] the published floor on the Beta concentration
MU_CLAMP = 1e-6  # [code] mu is kept inside (0, 1)


def overlap_ratio(num_clients: int, pool_size: int, low: int, center: int, high: int) -> float:
    """r: how many shards each pool item sits in on average, N*center/|pool| clipped to the range
    the size bounds allow ([code] `default_r`; the documented `overlap_ratio = 1.3` is unused)."""
    return float(
        np.clip(num_clients * center / pool_size, num_clients * low / pool_size, num_clients * high / pool_size)
    )


def beta_mean(low: int, center: int, high: int) -> float:
    """mu = (center - low) / (high - low), clamped into (0, 1)."""
    return float(np.clip((center - low) / (high - low), MU_CLAMP, 1 - MU_CLAMP))


def client_sizes(
    num_clients: int, low: int, center: int, high: int, concentration: float, pool_size: int, rng: np.random.Generator
) -> np.ndarray:
    """N integer sizes in [low, high] summing exactly to round(r * |pool|).

    x_i ~ Beta(mu xi, (1 - mu) xi), raw size low + x_i (high - low); rescaled to the target sum,
    clipped to the bounds, rounded by largest remainder, then +-1 corrections (clients with the
    largest rounding residual first) restore the exact sum inside the bounds.
    """
    if not 0 <= low < high:
        raise ValueError(f"size bounds need 0 <= low < high, got low={low}, high={high}")
    target = round(overlap_ratio(num_clients, pool_size, low, center, high) * pool_size)
    mu, xi = beta_mean(low, center, high), max(concentration, MIN_CONCENTRATION)
    x = rng.beta(mu * xi, (1 - mu) * xi, size=num_clients)
    raw = low + x * (high - low)
    share = raw / raw.sum() if raw.sum() > 0 else np.full(num_clients, 1 / num_clients)
    scaled = np.clip(share * target, low, high)
    sizes = np.floor(scaled).astype(np.int64)
    residual = scaled - sizes
    short = round(float(scaled.sum())) - int(sizes.sum())
    for i in np.argsort(-residual, kind="stable")[: max(short, 0)]:
        sizes[i] += 1
    # corrections: the clipped, rounded sum may still miss the target
    order = np.argsort(-(scaled - sizes), kind="stable")
    while (diff := target - int(sizes.sum())) != 0:
        step = 1 if diff > 0 else -1
        movable = [i for i in (order if step > 0 else order[::-1]) if (sizes[i] < high if step > 0 else sizes[i] > low)]
        if not movable:
            raise ValueError(f"cannot reach {target} assignments with {num_clients} sizes in [{low}, {high}]")
        for i in movable[: abs(diff)]:
            sizes[i] += step
    return sizes


def assign_with_overlap(pool_size: int, sizes: np.ndarray, rng: np.random.Generator) -> list[np.ndarray]:
    """Place items 0..pool_size-1 into shards of the given sizes, each item into k distinct shards.

    r = sum(sizes) / pool_size; exactly sum(sizes) - floor(r) * pool_size items (drawn at random)
    get ceil(r) copies, the rest floor(r). Items are placed in index order, each copy to a distinct
    client drawn with probability proportional to its remaining capacity; a final pass tops up any
    capacity left with random items the client lacks. Returns each client's items, ascending.
    """
    sizes = np.asarray(sizes, dtype=np.int64)
    n = len(sizes)
    if sizes.min() < 0 or sizes.max() > pool_size:
        raise ValueError(f"shard sizes must lie in [0, {pool_size}] (the pool), got {sizes.min()}..{sizes.max()}")
    total = int(sizes.sum())
    k_lo = total // pool_size
    extra = total - k_lo * pool_size
    if math.ceil(total / pool_size) > n:
        raise ValueError(
            f"{total} assignments of {pool_size} items need {math.ceil(total / pool_size)} copies "
            f"each, more than the {n} clients"
        )
    copies = np.full(pool_size, k_lo, dtype=np.int64)
    copies[rng.choice(pool_size, size=extra, replace=False)] += 1
    capacity = sizes.copy()
    member = np.zeros((n, pool_size), dtype=bool)
    for item in range(pool_size):
        open_ = np.flatnonzero(capacity > 0)
        k = min(int(copies[item]), len(open_))
        if k == 0:
            continue
        chosen = rng.choice(open_, size=k, replace=False, p=capacity[open_] / capacity[open_].sum())
        member[chosen, item] = True
        capacity[chosen] -= 1
    for c in np.flatnonzero(capacity > 0):
        missing = np.flatnonzero(~member[c])
        member[c, rng.choice(missing, size=int(capacity[c]), replace=False)] = True
        capacity[c] = 0
    return [np.flatnonzero(member[c]) for c in range(n)]
