"""Partitions and client sampling are pure functions of their inputs (invariants 5, 11)."""

from __future__ import annotations

import random

from fl_app.config import load_config
from partitions.uniform import client_shard, sample_clients, sampling_seed
from server_app.strategy import ClientSampler


def test_client_sampling_is_pure_function_of_seed_and_round():
    a = [sample_clients(0, r, 100, 2) for r in range(1, 71)]
    random.seed(12345)  # process-global RNG state must not matter
    b = [sample_clients(0, r, 100, 2) for r in range(1, 71)]
    assert a == b
    # a resumed run recomputes round 4 without having sampled rounds 1-3
    assert sample_clients(0, 4, 100, 2) == a[3]
    assert all(len(set(s)) == 2 for s in a)


def test_sampling_matches_the_published_rounds():
    """FedAgent seeds Python's generator with seed + round - 1 (seed 42): rounds 1-3."""
    assert [sample_clients(42, r, 100, 2) for r in (1, 2, 3)] == [[81, 14], [4, 36], [52, 66]]


def test_runs_of_different_seeds_sample_independent_clients_unless_the_sampling_seed_is_fixed():
    """Fed the run seed, the published rule (seed + round - 1) would give seed s + 1 the clients
    of seed s one round later; the sampler's seed is a hash of the run seed instead, and a fixed
    `federation.sampling_seed` (42 in the paper recipes) draws the same clients for every seed."""
    rounds = range(1, 71)

    def draws(run_seed: int, fixed: int | None = None) -> list[list[int]]:
        return [sample_clients(sampling_seed(run_seed, fixed), r, 100, 2) for r in rounds]

    s0, s1 = draws(0), draws(1)
    shifted = sum(a == b for a, b in zip(s0[1:], s1[:-1]))
    same = sum(a == b for a, b in zip(s0, s1))
    assert shifted <= 1 and same <= 1, (shifted, same)  # the additive rule gives shifted == 69
    assert draws(0) == s0  # still a pure function of (seed, round)
    assert draws(0, fixed=42) == draws(7, fixed=42) == [sample_clients(42, r, 100, 2) for r in rounds]
    assert draws(0, fixed=42)[:3] == [[81, 14], [4, 36], [52, 66]]
    assert load_config("webshop-grpo-qwen2.5-1.5b").federation.sampling_seed == 42
    assert load_config("tiny-shop-grpo").federation.sampling_seed is None


def test_shard_is_independent_of_pool_listing_order():
    pool = list(range(64, 1000))
    shuffled = pool[:]
    random.Random(1).shuffle(shuffled)
    assert client_shard(7, 100, 100, pool, seed=0) == client_shard(7, 100, 100, shuffled, seed=0)


def test_shards_cover_the_pool_evenly_and_stay_inside_it():
    pool = list(range(64, 1000))
    shards = [client_shard(c, 100, 100, pool, seed=0) for c in range(100)]
    assert all(len(s) == 100 and len(set(s)) == 100 and set(s) <= set(pool) for s in shards)
    assert set().union(*map(set, shards)) == set(pool)
    assert shards[0] != shards[1]


def test_over_selection_keeps_the_draw_of_a_run_without_it():
    """federation.over_select appends clients from a stream of their own: the first
    clients_per_round are the draw without it (so a run without faults keeps its bits), the extra
    ones are distinct, not sampled, and a pure function of (seed, round)."""
    for per_round, extra in ((2, 1), (5, 3), (10, 20), (1, 99)):
        for r in range(1, 40):
            plain = ClientSampler(seed=42, num_clients=100, per_round=per_round).sample(r)
            over = ClientSampler(seed=42, num_clients=100, per_round=per_round, over_select=extra).sample(r)
            assert over[:per_round] == plain == sample_clients(42, r, 100, per_round)
            assert len(set(over)) == per_round + extra
            random.seed(r)
            assert ClientSampler(seed=42, num_clients=100, per_round=per_round, over_select=extra).sample(r) == over
