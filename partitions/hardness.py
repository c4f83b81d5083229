"""Hardness partition: clients differ in how many of their tasks a reference policy solved
(notes §2.3; invariant 12).

Quotas: one global `default_rng(seed)` draws k_i ~ Beta sizes between 0 and L = |X_i| around
floor(L/2), summing exactly to N floor(L/2) (the coverage sizing with low 0, center L/2, high L).
The knob xi' is their Beta concentration; realized success rates rho_i = k_i / L then have
variance ~ 0.25 / (xi' + 1) and mean 1/2 whatever xi'.

Two shard rules around the quotas (both continue the same stream, in client order):
  intended  (default; the published docs and algorithm box): Y_i, k_i easy tasks placed by
            `assign_with_overlap` on the easy pool (every easy task lands in floor/ceil of
            sum(k)/|easy| clients), then F_i, L - k_i hard tasks drawn from the WHOLE hard pool,
            F_0 .. F_{N-1} in client order from the one stream;
  executed  what the published code ran: per client, k_i easy, then k_i hard (its shortfall test
            looked at the already-shrunk easy list), then random rest, cut to max(L, |pool| // N):
            clients with k_i < L/2 get k_i + (L - 2 k_i) p_easy successes, flooring their rate.
The published body drew every client's fill from the same post-quota stream state, so clients
with equal quotas got identical fills (field log 2026-07-27); both rules here draw from one
advancing stream, so equal-quota clients share only ~|F|^2 / |hard| fill tasks.
"""

from __future__ import annotations

import numpy as np

from partitions.pool import TaskPool
from partitions.sizing import assign_with_overlap, client_sizes


def easy_quotas(num_clients: int, size: int, xi_prime: float, pool_size: int, rng: np.random.Generator) -> np.ndarray:
    return client_sizes(num_clients, 0, size // 2, size, xi_prime, pool_size, rng)


def _check_buckets(quotas: np.ndarray, size: int, n_easy: int, n_hard: int) -> None:
    """Fail closed when the labels cannot realize the quotas (e.g. a reference that solves nothing)."""
    need_hard = size - int(quotas.min())
    if n_easy < int(quotas.max()) or n_hard < need_hard:
        raise ValueError(
            f"the labels split the pool into {n_easy} easy and {n_hard} hard tasks, but the hardness quotas ask "
            f"for up to {int(quotas.max())} easy and {need_hard} hard tasks per client (tasks_per_client={size}); "
            "label with a reference policy whose success rate is nearer 1/2, raise partition.params.xi_prime, "
            "or lower federation.tasks_per_client"
        )


def hardness_shards(
    pool: TaskPool,
    easy: frozenset[int],
    num_clients: int,
    size: int,
    xi_prime: float,
    seed: int,
    rule: str = "intended",
) -> list[list[int]]:
    """Every client's shard (served indices, ascending). `easy`: served indices labelled solved."""
    if rule not in ("intended", "executed"):
        raise ValueError(f"unknown hardness rule {rule!r}; choose intended or executed")
    idx = np.asarray(pool.indices)
    is_easy = np.isin(idx, np.fromiter(easy, dtype=np.int64, count=len(easy)))
    easy_idx, hard_idx = idx[is_easy], idx[~is_easy]
    rng = np.random.default_rng(seed)
    quotas = easy_quotas(num_clients, size, xi_prime, len(pool), rng)
    _check_buckets(quotas, size, len(easy_idx), len(hard_idx))
    if rule == "intended":
        placed = assign_with_overlap(len(easy_idx), quotas, rng)
        return [
            sorted(easy_idx[y].tolist() + rng.choice(hard_idx, size=size - int(k), replace=False).tolist())
            for y, k in zip(placed, quotas)
        ]
    return [_executed_shard(easy_idx, hard_idx, int(k), max(size, len(pool) // num_clients), rng) for k in quotas]


def _executed_shard(
    easy_idx: np.ndarray, hard_idx: np.ndarray, k: int, cut: int, rng: np.random.Generator
) -> list[int]:
    """The published composition: k easy + k hard + random rest, truncated to `cut`."""
    a = rng.choice(easy_idx, size=min(k, len(easy_idx)), replace=False)
    b = rng.choice(hard_idx, size=min(k, len(hard_idx)), replace=False)
    rest = np.setdiff1d(np.concatenate([easy_idx, hard_idx]), np.concatenate([a, b]))
    c = rng.choice(rest, size=max(0, min(cut - len(a) - len(b), len(rest))), replace=False)
    return sorted(np.concatenate([a, b, c])[:cut].tolist())
