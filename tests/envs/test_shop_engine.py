"""Shop engine: contract, task order, search/pages/actions, heterogeneity hooks, speed."""

from __future__ import annotations

import inspect
import random
import threading
import time

import numpy as np
import pytest

from envs.base import Env, task_order_fingerprint
from envs.registry import make_env
from envs.shop.catalog import generate_catalog
from envs.shop.env import SEARCH_MARKER, ShopEnv
from envs.shop.world import WorldSpec, build_world

TINY = dict(num_products=300, num_goals=1000, val_size=64, search_return_n=50, seed=0)


def play_expert(env: ShopEnv, task: int, max_steps: int = 30) -> tuple[float, int, dict]:
    env.reset(task)
    for n in range(1, max_steps + 1):
        _, reward, done, info = env.step(env.expert_action())
        assert info["valid_action"], f"oracle took an invalid action on task {task}"
        if done:
            return reward, n, info
    raise AssertionError(f"oracle did not finish task {task} in {max_steps} steps")


def test_shop_env_satisfies_env_protocol():
    env = make_env("shop", **TINY)
    assert isinstance(env, Env) and env.name == "shop"
    assert env.num_tasks == 1000 and env.val_size == 64
    obs, info = env.reset(1000 + 7)  # seed % num_tasks
    assert info["task_id"] == env.task_ids()[7]
    assert set(info) >= {"task_id", "instruction", "valid_actions", "won"}
    obs, reward, done, info = env.step("click[buy now]")
    assert set(info) >= {"task_id", "instruction", "valid_actions", "won", "valid_action"}


def test_defaults_serve_the_unmarked_case():
    """Invariant 14: no heterogeneity unless asked; WebShop's search_return_n of 50."""
    defaults = {k: p.default for k, p in inspect.signature(ShopEnv).parameters.items()}
    assert {k: defaults[k] for k in TINY} == TINY
    assert defaults["ranking"] == "bm25" and defaults["lookalike"] == "" and defaults["rank_seed"] is None
    assert defaults["catalog_keep"] is None and defaults["data_dir"] is None
    env = ShopEnv()
    assert bool(env._visible.all()) and len(env.product_ids()) == 300


def test_task_ids_are_stable_strings_naming_the_target():
    env = ShopEnv(**TINY)
    ids = env.task_ids()
    assert len(set(ids)) == len(ids) == env.num_tasks
    for i in (0, 63, 64, 999):
        assert ids[i] == f"{i:06d}-{env.goal(i).asin}"


def test_default_build_is_fast_and_shares_the_world():
    spec = WorldSpec(**{k: TINY[k] for k in ("num_products", "num_goals", "seed")})
    t0 = time.process_time()
    build_world(spec)  # a cold, uncached build
    assert time.process_time() - t0 < 1.0
    a, b = ShopEnv(**TINY), ShopEnv(**TINY)
    assert a._world is b._world  # one catalog + index per process
    t0 = time.perf_counter()
    pool = [ShopEnv(**TINY) for _ in range(16)]
    assert time.perf_counter() - t0 < 0.5 and all(e._world is a._world for e in pool)


def test_concurrent_builds_serve_identical_order():
    """Invariant 21: no shared global RNG; uncached builds racing in threads agree."""
    spec = WorldSpec(num_products=120, num_goals=400, seed=11)
    reference = build_world(spec)
    results: list = [None] * 6
    barrier = threading.Barrier(len(results))

    def build(k: int) -> None:
        barrier.wait()
        random.random(), np.random.random()  # touch the global RNGs mid-race
        results[k] = build_world(spec)

    threads = [threading.Thread(target=build, args=(k,)) for k in range(len(results))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for world in results:
        assert [g.instruction for g in world.goals] == [g.instruction for g in reference.goals]
        assert [g.asin for g in world.goals] == [g.asin for g in reference.goals]
        assert [p.title for p in world.products] == [p.title for p in reference.products]
    fingerprints: list = [None] * 8

    def make_env_in_thread(k: int) -> None:
        fingerprints[k] = task_order_fingerprint(ShopEnv(**{**TINY, "seed": 12}))

    threads = [threading.Thread(target=make_env_in_thread, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(fingerprints)) == 1 and None not in fingerprints


def test_build_neither_reads_nor_moves_global_rng():
    random.seed(5)
    np.random.seed(5)
    expected = (random.random(), np.random.random())
    random.seed(5)
    np.random.seed(5)
    build_world(WorldSpec(num_products=50, num_goals=60, seed=3))
    assert (random.random(), np.random.random()) == expected
    random.seed(99)  # global state must not leak in
    a = build_world(WorldSpec(num_products=50, num_goals=60, seed=3))
    random.seed(1234)
    b = build_world(WorldSpec(num_products=50, num_goals=60, seed=3))
    assert [g.instruction for g in a.goals] == [g.instruction for g in b.goals]


def test_task_order_is_a_function_of_the_seed():
    a = task_order_fingerprint(ShopEnv(**TINY))
    b = task_order_fingerprint(ShopEnv(**{**TINY, "seed": 1}))
    assert a != b


def test_catalog_schema_is_complete():
    products = generate_catalog(200, seed=4)
    assert len({p.asin for p in products}) == 200
    assert len({p.category for p in products}) == 5
    for p in products:
        assert p.title and p.query and p.description and len(p.bullets) == len(p.attributes) >= 3
        assert " › " in p.product_category
        assert p.pricing[0] <= p.price <= p.pricing[-1] and len(p.pricing) in (1, 2)
        for _name, values in p.options.items():
            assert values and len(set(values)) == len(values)
    assert any(len(p.pricing) == 2 for p in products) and any(not p.options for p in products)


def test_search_page_lists_the_search_marker_only():
    env = ShopEnv(**TINY)
    _, info = env.reset(0)
    assert info["valid_actions"] == [SEARCH_MARKER] == ["search[<your query>]"]


def test_results_paginate_ten_per_page_up_to_search_return_n():
    env = ShopEnv(**{**TINY, "search_return_n": 23})
    env.reset(2)
    obs, _, _, info = env.step("search[free]")
    assert "'Page 1 (Total results: 23)'" in obs and "click[next >]" in info["valid_actions"]
    assert sum(a.startswith("click[b0") for a in info["valid_actions"]) == 10
    env.step("click[next >]")
    obs, _, _, info = env.step("click[next >]")
    assert "'Page 3 (Total results: 23)'" in obs
    assert "click[next >]" not in info["valid_actions"] and "click[< prev]" in info["valid_actions"]
    assert sum(a.startswith("click[b0") for a in info["valid_actions"]) == 3


def test_every_listed_action_is_accepted():
    for task in range(3):
        env = ShopEnv(**TINY)
        env.reset(task)
        taken: list[str] = []
        while True:
            for action in env.valid_actions():
                probe = ShopEnv(**TINY)
                probe.reset(task)
                for a in taken:
                    probe.step(a)
                action = "search[gift]" if action == SEARCH_MARKER else action
                assert probe.step(action)[3]["valid_action"], action
            taken.append(env.expert_action())
            if env.step(taken[-1])[2]:
                break


def test_invalid_actions_keep_state_and_never_raise():
    env = ShopEnv(**TINY)
    env.reset(4)
    env.step(env.expert_action())  # on a results page
    before = env.observation
    for action in (
        "click[nothing here]",
        "search[shoes]",
        "buy now",
        "",
        "click[]",
        "search[]",
        "click buy now",
        None,
        42,
    ):
        obs, reward, done, info = env.step(action)
        assert (obs, reward, done, info["valid_action"]) == (before, 0.0, False, False)
    assert env.step("CLICK[ Back To Search ]")[3]["valid_action"]  # case/space-insensitive


def test_step_after_buy_is_invalid_and_done():
    env = ShopEnv(**TINY)
    reward, _, _ = play_expert(env, 9)
    obs = env.observation
    assert env.step("click[buy now]")[:3] == (obs, 0.0, True)
    assert env.expert_action() == ""


def test_detail_tabs_and_prev_return_to_item_with_options_kept():
    env = ShopEnv(**TINY)
    task = next(t for t in range(100) if env.goal(t).goal_options)
    env.reset(task)
    while "click[buy now]" not in env.valid_actions():
        env.step(env.expert_action())
    value = next(iter(env.goal(task).goal_options.values()))
    env.step(f"click[{value}]")
    obs, _, _, info = env.step("click[features]")
    assert info["valid_actions"] == ["click[back to search]", "click[< prev]"]
    assert obs.startswith("'Back to Search', '< Prev', ")
    env.step("click[< prev]")
    assert env._chosen and "click[buy now]" in env.valid_actions()


def test_filtered_catalog_keeps_protected_targets():
    """Invariant 13: the kept catalog contains the target of every served (protected) goal; the
    engine shows exactly `catalog_keep` and adds nothing itself."""
    base = ShopEnv(**TINY)
    served = list(range(100, 140))
    keep = sorted(set(random.Random(0).sample(base.product_ids(), 60)) | {base.goal(t).asin for t in served})
    env = ShopEnv(**TINY, catalog_keep=keep, protected_tasks=served)
    assert int(env._visible.sum()) == len(keep)
    assert all(env.winnable(t) and env.reachable(t) for t in served)
    for t in served:
        reward, _, _ = play_expert(env, t)
        assert reward == 1.0
        env.reset(t)
        env.step(f"search[{env.goal(t).instruction}]")
        assert {a[6:-1].upper() for a in env.valid_actions() if a.startswith("click[b0")} <= set(keep)
    dropped = next(t for t in range(env.num_tasks) if env.goal(t).asin not in keep)
    with pytest.raises(ValueError, match="filtered out"):
        env.reset(dropped)


def test_catalog_tripwire_refuses_a_filter_that_loses_a_served_target():
    """Invariant 13's tripwire can fire: a catalog built from the targets of other goals (the
    published bug: the floor came from the pre-shuffle goal order) refuses to build, naming the
    count; a filter without the tasks it must keep is refused too."""
    base = ShopEnv(**TINY)
    served = list(range(100, 200))
    wrong_order = list(range(200, 300))  # another client's (or order's) goals
    keep = sorted({base.goal(t).asin for t in wrong_order})
    lost = sum(base.goal(t).asin not in keep for t in served)
    assert lost > 0
    with pytest.raises(ValueError, match=rf"refusing to serve: {lost} of 100 protected tasks lost"):
        ShopEnv(**TINY, catalog_keep=keep, protected_tasks=served)
    with pytest.raises(ValueError, match="needs protected_tasks"):
        ShopEnv(**TINY, catalog_keep=keep)
    right = sorted(set(keep) | {base.goal(t).asin for t in served})
    assert ShopEnv(**TINY, catalog_keep=right, protected_tasks=served).reachable(served[0])


def test_search_memo_is_shared_by_equal_engines_and_never_across_catalogs_or_rankings():
    """Engines of one configuration share one memo of search results (a pool's engines repeat
    each other's queries); a different catalog filter, ranking or result count gets its own,
    and a memoized answer equals a fresh search."""
    a, b = ShopEnv(**TINY), ShopEnv(**TINY)
    keep = sorted(set(random.Random(1).sample(a.product_ids(), 60)) | {a.goal(t).asin for t in range(10)})
    others = [
        ShopEnv(**TINY, catalog_keep=keep, protected_tasks=range(10)),
        ShopEnv(**TINY, ranking="inverted_topk"),
        ShopEnv(**{**TINY, "search_return_n": 5}),
    ]
    assert a._search is b._search
    assert len({id(e._search) for e in [a, *others]}) == 4
    query = "organic gluten free"
    index = a._world.index
    assert a._search(query) == tuple(index.search(query, 50))
    filtered = others[0]._search(query)
    assert filtered == tuple(index.search(query, 50, others[0]._visible))
    assert filtered != a._search(query) and all(others[0]._visible[i] for i in filtered)
    assert others[1]._search(query) == a._search(query)[::-1]
    assert others[2]._search(query) == a._search(query)[:5]


def test_unknown_catalog_ids_are_refused():
    with pytest.raises(ValueError, match="unknown product ids"):
        ShopEnv(**TINY, catalog_keep=["NOPE"], protected_tasks=[])


def test_ranking_variants_reorder_the_same_hits():
    env = {r: ShopEnv(**TINY, ranking=r) for r in ("bm25", "inverted_topk", "shuffled_topk")}
    world = env["bm25"]._world
    query = "organic gluten free"
    base = world.index.search(query, 50)
    assert world.index.search(query, 50, ranking="inverted_topk") == base[::-1]
    shuffled = world.index.search(query, 50, ranking="shuffled_topk", seed=0)
    assert sorted(shuffled) == sorted(base) and shuffled != base
    assert shuffled == world.index.search(query, 50, ranking="shuffled_topk", seed=0)
    for variant, e in env.items():
        assert play_expert(e, 17)[0] == 1.0, variant
    with pytest.raises(ValueError, match="ranking"):
        ShopEnv(**TINY, ranking="random")


def test_lookalikes_share_text_but_lose_reward():
    """A lookalike copies a goal target's text; buying it with the goal's options where it
    offers them loses the attacked term (tests/envs/test_env_variants.py checks every lookalike)."""
    env = ShopEnv(**TINY, lookalike="price_color")
    world = env._world
    fakes = [p for p in world.products if p.asin in env.lookalike_of()]
    assert len(world.products) == 300 + len(fakes) and fakes
    assert len(env.task_ids()) == 1000 and all(g.asin in world.position for g in world.goals)
    assert env.task_ids() == ShopEnv(**TINY).task_ids()  # goals are unchanged
    fake = fakes[0]
    original = env.product(env.lookalike_of()[fake.asin])
    assert fake.title == original.title and fake.description == original.description
    assert fake.price > original.price and fake.options != original.options
    task = next(t for t in range(1000) if env.goal(t).asin == original.asin)
    env.reset(task)
    env.step(f"search[{fake.title}]")
    env.step(f"click[{fake.asin.lower()}]")
    for value in env.goal(task).goal_options.values():
        env.step(f"click[{value}]")
    _, reward, done, info = env.step("click[buy now]")
    assert done and reward < 1.0 and not info["won"] and not info["reward_terms"]["price_ok"]


def test_index_fields_and_bm25_params_change_ranking():
    world = ShopEnv(**TINY)._world
    titles_only = ShopEnv(**TINY, index_fields=("title",))._world
    query = "thoroughly expect"  # bullet text, never in titles
    assert world.index.search(query, 50) and not titles_only.index.search(query, 50)
    flat = ShopEnv(**TINY, bm25_k1=0.3, bm25_b=0.0)._world
    queries = [g.instruction for g in world.goals[:20]]
    assert any(world.index.search(q, 10) != flat.index.search(q, 10) for q in queries)
    with pytest.raises(ValueError, match="index field"):
        ShopEnv(**TINY, index_fields=("title", "nonsense"))


@pytest.mark.slow
def test_catalog_scales_to_50k_products_in_seconds():
    t0 = time.process_time()
    world = build_world(WorldSpec(num_products=50_000, num_goals=5_000, seed=0))
    assert time.process_time() - t0 < 10.0
    assert len(world.products) == 50_000
    env = ShopEnv(num_products=50_000, num_goals=5_000, val_size=64)
    for task in range(0, 5_000, 97):
        assert play_expert(env, task)[0] == 1.0
