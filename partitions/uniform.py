"""The uniform partition: every client gets an equal, contiguous block of one seeded
permutation of the training pool (FedAgent's `uniform` strategy).

When N * tasks_per_client exceeds the pool, consecutive clients' blocks start `stride` apart
and wrap around the permutation, so blocks overlap evenly instead of the tail clients getting
nothing.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Sequence


def client_shard(
    client_id: int, num_clients: int, tasks_per_client: int, train_pool: Sequence[int], seed: int
) -> list[int]:
    """The task indices (env `reset` seeds) of one client's shard.

    `train_pool` is put in canonical (sorted) order before the seeded shuffle, so callers that
    list the pool differently still agree (invariant 11).
    """
    if not 0 <= client_id < num_clients:
        raise ValueError(f"client_id {client_id} outside [0, {num_clients})")
    pool = sorted(set(train_pool))
    if not pool:
        raise ValueError("empty training pool: the environment serves no training tasks")
    order = list(pool)
    random.Random(f"uniform-partition:{seed}").shuffle(order)
    n = len(order)
    stride = max(n // num_clients, 1)
    start = client_id * stride
    size = min(tasks_per_client, n)
    return [order[(start + j) % n] for j in range(size)]


def sampling_seed(run_seed: int, fixed: int | None) -> int:
    """The seed `sample_clients` draws from: `fixed` (`federation.sampling_seed`) when set, else a
    hash of the run seed. The published rule adds the round to its seed, so fed the run seed
    itself, runs of seeds s and s + 1 would sample the same clients one round apart."""
    if fixed is not None:
        return fixed
    return int.from_bytes(hashlib.sha256(f"client-sampling:{run_seed}".encode()).digest()[:8], "big") >> 1


def sample_clients(seed: int, server_round: int, num_clients: int, per_round: int) -> list[int]:
    """Clients trained in a round: a pure function of (seed, round) (invariant 5).

    Same rule as the published runs (a generator seeded with seed + round - 1, M draws without
    replacement), so a resumed run samples exactly what an uninterrupted one would.
    """
    if per_round > num_clients:
        raise ValueError(f"cannot sample {per_round} of {num_clients} clients")
    return random.Random(seed + server_round - 1).sample(range(num_clients), per_round)


def over_selected(seed: int, server_round: int, num_clients: int, sampled: Sequence[int], extra: int) -> list[int]:
    """`extra` more clients for a round that already sampled `sampled` (federation.over_select):
    a pure function of (seed, round) drawn from a stream of its own among the clients not
    sampled, so the round's first draw, and with it a run without over-selection, is unchanged
    (`random.sample` switches algorithm with the sample size: a longer draw need not start with
    the shorter one)."""
    rest = sorted(set(range(num_clients)) - set(sampled))
    if extra > len(rest):
        raise ValueError(f"cannot over-select {extra} of the {len(rest)} clients not sampled")
    return random.Random(f"over-select:{seed}:{server_round}").sample(rest, extra)


def round_clients(
    seed: int,
    server_round: int,
    num_clients: int,
    per_round: int,
    over_select: int = 0,
    only_clients: Sequence[int] = (),
) -> list[int]:
    """A round's clients in sample order: `only_clients` when set (the local-only baseline), else
    the seeded draw, then `over_select` more (`over_selected`); its first `per_round` are the draw
    of a run without over-selection. The server samples with it, and a test fault that names
    "the round's first client" (client_app.poison) reads the same rule."""
    if only_clients:
        return list(only_clients)
    first = sample_clients(seed, server_round, num_clients, per_round)
    if not over_select:
        return first
    return first + over_selected(seed, server_round, num_clients, first, over_select)
