"""Preference partition: each client's category mixture is a Dirichlet draw around the pool's
(notes §2.1). The knob omega sets tr Cov(q_i) = omega (1 - ||pi||^2): ~0 gives IID shards,
~1 one category per client.

Per client (its own generator, seeded by (seed, client id): clients and seeds are independent):
  1. optional thinning of one category (published WebShop: fashion kept at 20%, >= 1 task);
  2. pi_c = (p_c + eps) / (1 + eps C), p the category fractions after thinning, eps = 0.01;
  3. q ~ Dirichlet(pi (1 - omega) / omega); counts ~ Multinomial(|X_i|, q);
  4. capacity fix: counts above a category's population are capped and the overflow re-drawn
     multinomially over the categories with room (weights q, renormalised), until none overflows;
  5. tasks drawn without replacement within each category; any shortfall topped up from unused tasks.

Departures, on purpose: numpy's `Generator.dirichlet` instead of the legacy `RandomState`'s, whose
gamma draws underflow to 0/0 = NaN for the tiny alphas of omega = 0.99 (2 NaN mixtures in 2,000
draws on the published WebShop pi); the Generator switches to a stable method for small alphas.
The generator is keyed by (seed, client) rather than the published RandomState(42 + client), with
which run seeds s and s + 1 would hand 99 of 100 clients the same draw.
When the capped categories held all of q's mass, the overflow goes to the others in proportion to
their room (the published renormalisation would divide by zero there).
"""

from __future__ import annotations

import numpy as np

from partitions.pool import TaskPool

SMOOTHING = 0.01  # [code] Laplace epsilon of the global marginal


def category_members(pool: TaskPool) -> dict[str, np.ndarray]:
    """Category -> its tasks' served indices (ascending), categories in canonical order."""
    idx = np.asarray(pool.indices)
    cats = np.asarray(pool.categories)
    return {c: idx[cats == c] for c in pool.category_names()}


def thinned_count(n: int, ratio: float) -> int:
    return max(1, int(n * ratio))


def marginal(counts: dict[str, int]) -> np.ndarray:
    """pi: the smoothed category marginal, in the order of `counts`."""
    p = np.array(list(counts.values()), dtype=float)
    p /= p.sum()
    return (p + SMOOTHING) / (1 + SMOOTHING * len(p))


def effective_counts(pool: TaskPool, downsample_category: str | None, downsample_ratio: float | None) -> dict[str, int]:
    """Category populations a client draws from (after thinning; the same for every client)."""
    counts = pool.category_counts()
    if downsample_category is not None:
        if downsample_category not in counts:
            raise ValueError(
                f"partition.params.downsample_category={downsample_category!r} is not a category "
                f"of the training pool ({', '.join(counts)})"
            )
        counts[downsample_category] = thinned_count(counts[downsample_category], downsample_ratio or 1.0)
    return counts


def _capacity_fix(counts: np.ndarray, room: np.ndarray, q: np.ndarray, rng: np.random.Generator) -> np.ndarray:
    """Cap counts at each category's population and re-draw the overflow over the categories with
    room. Every pass fills the overflowing categories, so it ends within C passes."""
    counts = counts.copy()
    while (over := counts > room).any():
        excess = int((counts[over] - room[over]).sum())
        counts[over] = room[over]
        free = counts < room
        if not free.any():
            break
        w = np.where(free, q, 0.0)
        if w.sum() <= 0:
            w = np.where(free, room - counts, 0).astype(float)
        counts += rng.multinomial(excess, w / w.sum())
    return counts


def preference_shard(
    client_id: int,
    pool: TaskPool,
    size: int,
    omega: float,
    seed: int,
    downsample_category: str | None = None,
    downsample_ratio: float | None = None,
) -> list[int]:
    """One client's shard: `size` distinct served task indices, ascending."""
    if size > len(pool):
        raise ValueError(f"federation.tasks_per_client={size} exceeds the training pool ({len(pool)} tasks)")
    rng = np.random.default_rng([seed, client_id])
    members = category_members(pool)
    if downsample_category is not None:
        effective_counts(pool, downsample_category, downsample_ratio)  # validates the name
        items = members[downsample_category]
        keep = thinned_count(len(items), downsample_ratio or 1.0)
        members[downsample_category] = np.sort(rng.choice(items, size=keep, replace=False))
    room = np.array([len(v) for v in members.values()])
    pi = marginal({c: len(v) for c, v in members.items()})
    q = rng.dirichlet(pi * (1 - omega) / omega)
    counts = _capacity_fix(rng.multinomial(size, q), room, q, rng)
    chosen = [rng.choice(items, size=int(k), replace=False) for items, k in zip(members.values(), counts) if k]
    shard = np.concatenate(chosen) if chosen else np.array([], dtype=np.int64)
    if len(shard) < size:  # the thinned categories cannot fill the shard: top up from the rest
        unused = np.setdiff1d(np.asarray(pool.indices), shard)
        shard = np.concatenate([shard, rng.choice(unused, size=size - len(shard), replace=False)])
    return sorted(int(t) for t in shard)
